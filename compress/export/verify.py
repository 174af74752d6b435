"""`compress verify`: reload an export through its target's own loader where that loader runs here, and
measure KL divergence and top-1 agreement of its next-token predictions against the source model.

Loaders: transformers (dense, compressed-tensors, block-scaled fp8), llama-cpp-python (GGUF). vLLM's
AWQ / GPTQ / per-tensor fp8 kernels need a GPU, so those exports are read back with the format's
published layout (awq_dequantize, gptq_dequantize, fp8 value × scale) into a dense model, and the
result says so.
"""
from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ..moe import unfuse_experts
from ..shards import read_safetensors, read_tensor, tensor_names
from . import EXPORT_META

# compressed-tensors' microscaling formats: its compressed-mode CPU forward runs them in bfloat16 whatever the
# model's dtype; the dequantizing load decompresses them once (the library's own decompress) into the weights
MICRO_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
READER = "compress reader (the format's layout, dequantized; its serving kernels need a GPU)"


def read_record(folder: str | Path) -> dict:
    path = Path(folder) / EXPORT_META
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {EXPORT_META}; is it a folder written by `compress export`?")
    return json.loads(path.read_text())


def _needs_dequantize(config: dict) -> bool:
    """transformers' compressed layout for pack-quantized asymmetric weights expects an unpacked zero point,
    while compressed-tensors writes (and vLLM reads) it packed; the dequantizing load path reads it right."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any(g.get("format") == "pack-quantized" and not (g.get("weights") or {}).get("symmetric", True)
               or g.get("format") in MICRO_FORMATS for g in groups.values())


def _dense_from_tensors(folder: Path, dequantize_layer) -> nn.Module:
    """A float model of the export's config whose quantized layers are filled by `dequantize_layer`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = read_safetensors(folder)
    dense: dict[str, Tensor] = {}
    prefixes = {k.rsplit(".", 1)[0] for k in state if k.endswith((".qweight", ".weight_scale", ".weight_scale_inv"))}
    for k, v in state.items():
        module, _, leaf = k.rpartition(".")
        if module in prefixes and leaf != "bias":
            continue
        if leaf in ("k_scale", "v_scale"):
            continue
        dense[k] = v.float() if v.is_floating_point() else v
    for p in prefixes:
        dense[f"{p}.weight"] = dequantize_layer(p, state)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    unfuse_experts(model)  # exports name each expert's layers (experts.{e}.gate_proj, ...)
    missing, unexpected = model.load_state_dict(dense, strict=False)
    model.tie_weights()
    missing = [m for m in missing if not (getattr(config, "tie_word_embeddings", False) and "lm_head" in m)]
    if missing or unexpected:
        raise ValueError(f"{folder}: export does not match its config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    return model.eval()


def apply_kv_scales(model: nn.Module, folder: Path, record: dict) -> bool:
    """Quantize the reloaded model's KV cache with the fp8 scales stored in the export, as vLLM does when it
    serves it (transformers reads the weights but leaves these scales unused). True when there were any."""
    from ..kv_cache import set_kv_scales, use_kv_attention
    from ..scheme import FP8_MAX

    layers = record.get("kv_cache_layers") or []
    if not layers:
        return False
    names = tensor_names(folder)

    def scale(attention: str, which: str) -> float:
        for key in (f"{attention}.{which}_scale", f"{attention}.{which}_proj.{which}_scale"):
            if key in names:
                return float(read_tensor(folder, key))
        raise ValueError(f"{folder}: export.json lists KV-cache scales for {attention}, and the weights "
                         f"have no {which}_scale for it")

    for attention in layers:
        set_kv_scales(model.get_submodule(attention), scale(attention, "k") * FP8_MAX["fp8_e4m3"],
                      scale(attention, "v") * FP8_MAX["fp8_e4m3"], "fp8_e4m3")
    use_kv_attention(model)
    return True


def _without_input_quantization(model: nn.Module) -> nn.Module:
    """Switch off compressed-tensors' reference activation quantization in a reloaded model. Its CPU reference
    scales symmetric int8 by absmax / 127.5 (compressed_tensors.quantization.utils.calculate_qparams: half the
    255-code range), while vLLM's kernels and our model use absmax / 127, so the two cannot agree token for
    token; the stored weights are compared with float inputs on both sides, and the stored input scales are
    compared with ours exactly (verify_export)."""
    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is not None and scheme.input_activations is not None:
            m.quantization_scheme = scheme.model_copy(update={"input_activations": None})
    return model


def _without_offloading(model: nn.Module) -> nn.Module:
    """transformers 5.17 (the GPU machine's) leaves a compressed-tensors reload under compressed-tensors' own
    offloading: each module's parameters in a CPU cache, copied to its onload device at every access, and its inputs
    sent there; `.to(device)` and `.float()` then act on those copies, not on the weights. Removed, so that the model
    is moved and cast like any other (5.25 loads a plain model: nothing to remove)."""
    try:
        from compressed_tensors.offload import OffloadCache, remove_dispatch
    except ImportError:
        return model
    if any(isinstance(m._parameters, OffloadCache) for m in model.modules()):
        remove_dispatch(model)
    return model


def input_scales_match(folder: Path, source: nn.Module) -> bool | None:
    """Whether every static input scale in the export equals the source's (None: there are none)."""
    from ..nn import QuantLinear

    static = {n: m.input_scale for n, m in source.named_modules()
              if isinstance(m, QuantLinear) and m.input_scale is not None}
    if not static or not any(folder.glob("*.safetensors")):
        return None
    keys = tensor_names(folder)

    def same(n: str, s: Tensor) -> bool:
        if f"{n}.input_global_scale" in keys:  # compressed-tensors' NVFP4: the inverse of ours (amax / (448 * 6))
            return float(read_tensor(folder, f"{n}.input_global_scale")) == float(1.0 / s.float())
        return f"{n}.input_scale" in keys and float(read_tensor(folder, f"{n}.input_scale")) == float(s)

    return all(same(n, s) for n, s in static.items())


def load_export(folder: str | Path):
    """(loader description, model) — a transformers-style model whose forward gives logits — or, for GGUF,
    (loader, path of the .gguf file). Stored fp8 KV-cache scales are applied to the reloaded model."""
    folder = Path(folder)
    record = read_record(folder)
    loader, model = _load(folder, record)
    if not isinstance(model, Path) and apply_kv_scales(model, folder, record):
        loader += " + the file's fp8 KV-cache scales"
    return loader, model


def _load(folder: Path, record: dict):
    fmt = record["format"]
    if fmt.startswith("gguf-"):
        return "llama-cpp-python", next(folder.glob("*.gguf"))
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if fmt in ("dense", "compressed-tensors") or (fmt == "fp8" and quant.get("weight_block_size")):
        from transformers import AutoModelForCausalLM
        kwargs = {}
        loader = "transformers"
        if fmt == "compressed-tensors":
            from transformers import CompressedTensorsConfig
            deq = _needs_dequantize(config)
            kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=deq)
            loader = "transformers + compressed-tensors" + (" (dequantize on load)" if deq else "")
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report lists the KV scales as unexpected: applied below
        try:
            with warnings.catch_warnings():  # "quantization_config from the model will be used": the point
                warnings.simplefilter("ignore", UserWarning)
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
        _without_offloading(model)
        if fmt == "compressed-tensors" and deq:
            # transformers 5.17's dequantizing load leaves NVFP4 weights decompressed in bfloat16 beside float32
            # activations (a dtype error at the first matmul); 5.25 gives float32. Compared in float32 either way
            # (transformers refuses .float() on a quantized model: the tensors are cast one by one)
            for t in [*model.parameters(), *model.buffers()]:
                if t.dtype in (torch.bfloat16, torch.float16):
                    t.data = t.data.float()
        return loader, _without_input_quantization(model)
    if fmt == "awq":
        from .awq import awq_dequantize
        return READER, _dense_from_tensors(folder, lambda p, s: awq_dequantize(
            s[f"{p}.qweight"], s[f"{p}.qzeros"], s[f"{p}.scales"]))
    if fmt == "gptq":
        from .gptq import gptq_dequantize
        return READER, _dense_from_tensors(folder, lambda p, s: gptq_dequantize(
            s[f"{p}.qweight"], s[f"{p}.qzeros"], s[f"{p}.scales"], s[f"{p}.g_idx"], quant["bits"]))
    if fmt == "modelopt-nvfp4":
        from .modelopt import dequantize_layer
        return ("compressed-tensors' ModelOpt NVFP4 converter + NVFP4 decompressor (TensorRT-LLM's and vLLM's "
                "kernels need a Blackwell GPU)"), _dense_from_tensors(folder, dequantize_layer)
    if fmt == "fp8":
        return READER, _dense_from_tensors(folder, lambda p, s: s[f"{p}.weight"].float() * s[f"{p}.weight_scale"])
    raise ValueError(f"{folder}: no reader for format {fmt!r}")


@torch.no_grad()
def model_logits(model: nn.Module, windows: Tensor) -> Tensor:
    """float32 logits [B, T, V] of a transformers-style model, one window at a time."""
    return torch.stack([model(input_ids=w[None]).logits[0].float() for w in windows])


def compare_logits(reference: Tensor, test: Tensor) -> dict:
    """Mean KL(reference || test) per position (nats) and top-1 agreement, over all positions."""
    ref = torch.log_softmax(reference.float(), -1)
    out = torch.log_softmax(test.float(), -1)
    kl = (ref.exp() * (ref - out)).sum(-1)
    return {"kl": float(kl.mean()), "top1_agreement": float((ref.argmax(-1) == out.argmax(-1)).float().mean()),
            "positions": int(kl.numel())}


def export_logits(folder: str | Path, windows: Tensor) -> tuple[str, Tensor]:
    loader, model = load_export(folder)
    if loader == "llama-cpp-python":
        from .gguf_llama_cpp import llama_cpp_logits
        return loader, llama_cpp_logits(str(model), windows)
    return loader, model_logits(model, windows)


@contextlib.contextmanager
def float_activations(model: nn.Module):
    """Run `model`'s quantized layers with float inputs (weights stay quantized) inside the block."""
    from ..nn import QuantLinear

    layers = [(m, m.scheme) for m in model.modules() if isinstance(m, QuantLinear) and m.scheme.act is not None]
    try:
        for m, s in layers:
            m.scheme = replace(s, act=None)
        yield bool(layers)
    finally:
        for m, s in layers:
            m.scheme = s


def _device_of(model: nn.Module) -> torch.device:
    """Where a model computes: its first parameter's device (the CPU for one without parameters, or all on meta)."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def verify_export(folder: str | Path, source: nn.Module, windows: Tensor) -> dict:
    """Reload the export at `folder` and compare its predictions with `source` on `windows` [B, T].

    Where layers quantize their activations, both sides run them with float inputs (the layout readers have no
    activation quantization, and compressed-tensors' CPU reference rounds differently from vLLM: see
    _without_input_quantization), so the comparison is of the stored weights, the static input scales are
    checked for equality, and the result says so. llama.cpp computes as it serves and is compared with the
    source as it runs. Both run where `source` is (a CUDA run verifies on the GPU): the reloaded export is moved
    there (llama.cpp stays on the CPU), and the windows go to each model's device."""
    loader, model = load_export(folder)
    gguf = loader == "llama-cpp-python"
    where = _device_of(source)
    if gguf:
        from .gguf_llama_cpp import iter_llama_cpp_logits
        theirs = iter_llama_cpp_logits(str(model), windows.cpu())
    else:
        model.to(where)
        theirs = (model_logits(model, w[None].to(where))[0] for w in windows)
    kl = agree = positions = 0.0
    floated = False
    for w, logits in zip(windows, theirs):  # one window at a time: [T, vocab] logits, never [B, T, vocab]
        with contextlib.nullcontext(False) if gguf else float_activations(source) as floated:
            reference = model_logits(source, w[None].to(where))[0]
        c = compare_logits(reference, logits.to(reference.device))
        kl, agree, positions = kl + c["kl"] * c["positions"], agree + c["top1_agreement"] * c["positions"], \
            positions + c["positions"]
    result = {"loader": loader, "kl": kl / positions, "top1_agreement": agree / positions,
              "positions": int(positions), "windows": list(windows.shape)}
    if floated:
        result["activations"] = ("weights compared with float activations on both sides (vLLM quantizes them from "
                                 "the stored config and input scales; no loader here does it as vLLM does)")
        result["input_scales_match"] = input_scales_match(Path(folder), source)
    return result
