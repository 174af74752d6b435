"""Hugging Face-layout checkpoints: one writer for every safetensors format (float tensors + each
quantized layer's tensors in the format's own names + config.json with its quantization_config +
tokenizer + generation config), the dense export, and the AWQ / GPTQ model-level glue around the
layer layouts in awq.py / gptq.py.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from ..core.nn import QuantLinear
from ..core.qtensor import QuantizedTensor
from ..arch.moe import checkpoint_tensors, hub_names, router_names
from ..arch import family_spec
from .shards import MAX_SHARD_BYTES, ShardWriter


def _conv1d(model: nn.Module) -> bool:
    """Whether the family's linear layers are GPT-2 style Conv1D ([in, out] weights; `conv1d=True` in its
    compress/arch/tables.py entry): quantized formats are read into nn.Linear-shaped modules, so their quantized
    layers have nowhere to go."""
    spec = family_spec(model)
    return spec is not None and spec.conv1d


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def resident(module: nn.Module) -> bool:
    """Whether a module's own tensors are in memory: a streamed export (`parts`) sees one decoder block at a time,
    the rest of the model on the meta device."""
    own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return not any(t.is_meta for t in own)


def resident_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """The quantized layers whose codes are in memory now (all of them, unless the export is streamed)."""
    return {n: m for n, m in quant_layers(model).items() if resident(m)}


def float_linears(model: nn.Module) -> list[str]:
    """Linear layers left in float, and a MoE model's routers (serving stacks run them as linear layers), under the
    checkpoint's names: they go into a quantized config's `ignore` list."""
    from ..core.nn import LINEAR_TYPES
    names = hub_names(model)
    routers = router_names(model)
    return [names.module(n) for n, m in model.named_modules() if isinstance(m, LINEAR_TYPES) or n in routers]


def kv_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Attention modules carrying calibrated fp8 KV-cache scales (the kv_cache stage)."""
    return {n: m for n, m in model.named_modules()
            if getattr(m, "k_scale", None) is not None and hasattr(m, "kv_cache_dtype")}


def conv1d_problems(model: nn.Module, fmt: str) -> list[str]:
    if quant_layers(model) and _conv1d(model):
        return [f"{model.config.model_type} keeps its linear layers as Conv1D ([in, out] weights), which the "
                f"{fmt} loaders do not read quantized; export `dense` or `gguf-*` instead"]
    return []


def quantized_head(model: nn.Module) -> str | None:
    """The module name of the output projection (lm_head) when it is quantized, else None."""
    head = model.get_output_embeddings()
    if not isinstance(head, QuantLinear):
        return None
    return next(n for n, m in model.named_modules() if m is head)


def fused_problems(model: nn.Module, fmt: str) -> list[str]:
    """Layers an engine fuses into one module (q/k/v, gate/up, a MoE block's experts: arch/fused.py) that the model
    holds in different schemes, or partly in float: vLLM refuses or misreads such a checkpoint."""
    from ..arch.fused import fused_groups, fused_label
    from ..core.nn import LINEAR_TYPES

    schemes = {n: m.scheme.name if isinstance(m, QuantLinear) else "float" for n, m in model.named_modules()
               if isinstance(m, (QuantLinear, *LINEAR_TYPES))}
    out = []
    for group in fused_groups(schemes):
        held = sorted({schemes[n] for n in group})
        if len(held) > 1:
            out.append(f"{fused_label(group)} hold {' / '.join(held)}: vLLM loads them as one fused module with one "
                       f"scheme, so a {fmt} checkpoint cannot split them; give them one scheme (auto_precision's "
                       "fused_groups: true, the default, or one layer_schemes entry for all of them), or export "
                       "`dense` / gguf-* (our own checkpoint keeps per-layer schemes too)")
    return out


def head_problems(model: nn.Module, why: str) -> list[str]:
    """A quantized lm_head (tied_lm_head: untie, or an untied model with lm_head not ignored) in a format whose
    loaders keep the output projection in float: refused, since its tensors would be unreadable or dropped."""
    name = quantized_head(model)
    if name is None:
        return []
    scheme = model.get_submodule(name).scheme.name
    return [f"{name} ({scheme}): {why}; export compressed-tensors, dense or gguf-*, or keep {name} in float "
            f"(`ignore: [lm_head]`, the default; tied_lm_head: keep)"]


def per_layer_problems(model: nn.Module, check: Callable[[QuantLinear], str | None]) -> list[str]:
    return [f"{n} ({m.scheme.name}): {why}" for n, m in quant_layers(model).items() if (why := check(m))]


def float_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor of the state dict outside the quantized layers and KV scales, floats cast to `dtype`, but those
    on the meta device (the parts of a streamed model not in memory now). Tied weights (lm_head = embed_tokens) are
    written once, as save_pretrained does."""
    quantized, kv = set(quant_layers(model)), set(kv_modules(model))
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if t.is_meta or module in quantized or (module in kv and leaf in ("k_scale", "v_scale")):
            continue
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in seen and t.numel():
            continue
        seen.add(key)
        t = t.detach().cpu()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def write_hf(model: nn.Module, tokenizer, folder: Path, tensors: Callable[[], dict[str, Tensor]],
             quant_config: dict | None, dtype: torch.dtype, metadata: dict | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None) -> None:
    """The weights (model.safetensors, or shards of at most `max_shard_bytes` and their index) + config.json (with
    `quant_config`) + generation config + tokenizer. `tensors()` gives the tensors of what is in memory: once for a
    resident model, or once per step of `parts` (streaming.stream_parts: one block at a time, written as it comes,
    so memory holds one block and never the whole checkpoint)."""
    folder = Path(folder)
    writer = ShardWriter(folder, {k: str(v) for k, v in (metadata or {}).items()}, max_shard_bytes)
    names = hub_names(model)  # a MoE family's experts under the names its hub checkpoints use
    for _ in parts if parts is not None else (None,):
        for name, t in checkpoint_tensors(model, tensors(), names).items():
            writer.add(name, t)
    writer.finish()
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).replace("torch.", "")
    set_architectures(config, model)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if quant_config is not None:
        config.quantization_config = quant_config
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def set_architectures(config, model: nn.Module) -> None:
    """`architectures` names the model class that loads the checkpoint; vLLM and SGLang pick their implementation
    from it. A model loaded from a GGUF file (or built from a config) has none, so write the class it runs as."""
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]


def dense_problems(model: nn.Module) -> list[str]:
    return []


def write_dense(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.bfloat16,
                max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    """A plain float checkpoint any loader reads: quantized layers dequantized, pruned shapes as they are."""
    layers: dict[str, str] = {}
    conv1d = _conv1d(model)

    def tensors() -> dict[str, Tensor]:
        out = float_tensors(model, dtype)
        for name, m in resident_layers(model).items():
            w = m.qtensor().dequantize(torch.float32)
            out[f"{name}.weight"] = (w.t() if conv1d else w).to(dtype).contiguous()
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias.detach().to(dtype)
            note = "" if m.scheme.act is None else "; activations run in float (the dense format stores no " \
                                                   "activation quantization)"
            layers[name] = f"dequantized from {m.scheme.name} to {config_dtype(dtype)}{note}"
        return out

    notes = []
    if kv_modules(model):
        notes.append("fp8 KV-cache scales are not part of a dense checkpoint; they were left out")
    write_hf(model, tokenizer, folder, tensors, None, dtype, max_shard_bytes=max_shard_bytes, parts=parts)
    return {"layers": layers, "float_dtype": config_dtype(dtype), "notes": notes}


def config_dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _layer_check(check):
    return lambda m: check(m.scheme, (m.out_features, m.in_features))


def _write_packed(model: nn.Module, tokenizer, folder: Path, layer_tensors: Callable[[QuantizedTensor], dict],
                  quant_config: dict, dtype: torch.dtype, fmt: str, max_shard_bytes: int = MAX_SHARD_BYTES,
                  parts: Iterable | None = None, check: Callable[[QuantLinear], str | None] | None = None) -> dict:
    """`check`: a refusal that needs the layer's data (seen only when its part is in memory, for a streamed
    export), raised as ExportError before the layer is written."""
    from .errors import ExportError

    layers = {}

    def tensors() -> dict[str, Tensor]:
        out = float_tensors(model, dtype)
        for name, m in resident_layers(model).items():
            if check is not None and (why := check(m)) is not None:
                raise ExportError(f"cannot export to {fmt}: {name} ({m.scheme.name}): {why}")
            for k, v in layer_tensors(m.qtensor()).items():
                out[f"{name}.{k}"] = v
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias.detach().to(dtype)
            layers[name] = f"{m.scheme.name} -> {fmt} (codes and scales copied exactly)"
        return out

    write_hf(model, tokenizer, folder, tensors, quant_config, dtype, max_shard_bytes=max_shard_bytes, parts=parts)
    notes = ["fp8 KV-cache scales are not part of this format; they were left out"] if kv_modules(model) else []
    return {"layers": layers, "float_dtype": config_dtype(dtype), "quantization_config": quant_config,
            "notes": notes}


def _single_scheme(model: nn.Module, fmt: str) -> list[str]:
    schemes = {m.scheme for m in quant_layers(model).values()}
    if not schemes:
        return [f"no layer is quantized; {fmt} needs a quantized model (export `dense` for a float one)"]
    if len(schemes) > 1:
        return [f"{fmt} config holds one bit width and group size for the whole model, and this model mixes "
                f"{sorted(s.name for s in schemes)}; export compressed-tensors (one config group per scheme)"]
    return []


def awq_problems(model: nn.Module) -> list[str]:
    from .awq import awq_problem
    return conv1d_problems(model, "awq") + _single_scheme(model, "awq") + fused_problems(model, "awq") + \
        per_layer_problems(model, _layer_check(awq_problem)) + \
        head_problems(model, "AWQ loaders keep the output projection in float (transformers adds it to "
                      "modules_to_not_convert; vLLM's AWQ quantizes linear layers only), so its packed tensors would "
                      "not be read")


def gptq_zero_problem(m: QuantLinear) -> str | None:
    """GPTQ v1 stores zero - 1: a zero point of 0 cannot be written (a check on the layer's data: a streamed export
    makes it when the layer's block is read)."""
    if m.zero_point is not None and not m.zero_point.is_meta and bool((m.zero_point == 0).any()):
        return ("a zero point of 0 (a group with no negative weight) cannot be stored: GPTQ v1 writes "
                "zero - 1; quantize with symmetric: true, or export awq")
    return None


def gptq_problems(model: nn.Module) -> list[str]:
    from .gptq import gptq_problem

    def check(m: QuantLinear) -> str | None:
        return _layer_check(gptq_problem)(m) or gptq_zero_problem(m)

    return conv1d_problems(model, "gptq") + _single_scheme(model, "gptq") + fused_problems(model, "gptq") + \
        per_layer_problems(model, check) + \
        head_problems(model, "this exporter writes GPTQ configs with `lm_head: false` (the loaders keep "
                      "the output projection in float) and not GPTQModel's quantized-head layout")


def _unconverted(model: nn.Module) -> list[str]:
    """Linear layers a loader must leave in float (module names, as AutoAWQ/GPTQ configs list them)."""
    return sorted(float_linears(model))


def write_awq(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.float16,
              max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    from .awq import awq_config, awq_tensors
    scheme = next(iter(quant_layers(model).values())).scheme
    config = awq_config(scheme, _unconverted(model))
    return _write_packed(model, tokenizer, folder, awq_tensors, config, dtype, "AWQ GEMM", max_shard_bytes, parts)


def write_gptq(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.float16,
               max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    from .gptq import gptq_config, gptq_tensors
    scheme = next(iter(quant_layers(model).values())).scheme
    config = gptq_config(scheme)
    unconverted = [n for n in _unconverted(model) if n != "lm_head"]  # GPTQ loaders never convert lm_head
    if unconverted:
        config["modules_in_block_to_quantize"] = None
        config["modules_to_not_convert"] = unconverted
    return _write_packed(model, tokenizer, folder, gptq_tensors, config, dtype, "GPTQ", max_shard_bytes, parts,
                         check=gptq_zero_problem)

