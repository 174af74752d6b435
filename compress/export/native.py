"""Our own checkpoint (`compress run`'s output folder): QuantLinear buffers (codes, scales) and KV scales at their own
dtype, every other float tensor at the run's save dtype, in model.safetensors or shards (shards.py); config.json,
generation and tokenizer files; compress.json with each quantized layer's scheme, the KV-cache formats, online
rotations, the recipe and provenance. Written by `save_compressed`, read back by `load_compressed`; registered in
EXPORTERS as `native` so that `compress verify` reads it like every other format."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..arch import auto_model_class, set_module
from ..arch.moe import unfuse_experts
from ..core.nn import QuantLinear, linear_shape
from ..core.scheme import QuantScheme
from ..kv.cache import KV_MAX, kv_layers, set_kv_scales, use_kv_attention
from .hf import set_architectures
from .shards import MAX_SHARD_BYTES, read_safetensors, write_safetensors

COMPRESS_META = "compress.json"  # per-layer schemes + provenance, beside config.json


def storage_tensors(module: nn.Module, save_dtype: str = "bfloat16", prefix: str = "", seen: dict | None = None):
    """(name, tensor) as a compress checkpoint stores them: QuantLinear buffers (codes, scales) and KV scales at their
    own dtype, every other float tensor at `save_dtype`; a tensor shared with one already yielded (`seen`, by
    storage: the tied lm_head) is skipped, and re-tied at load. Tensors on the meta device (streamed blocks not
    loaded now) are skipped."""
    float_dtype = getattr(torch, save_dtype)
    keep = {f"{n}.{b}" for n, m in module.named_modules() if isinstance(m, QuantLinear) for b, _ in m.named_buffers()}
    keep |= {f"{n}.{b}" for n, m in module.named_modules() if getattr(m, "kv_cache_dtype", None)
             for b in ("k_scale", "v_scale")}
    seen = {} if seen is None else seen
    for name, t in module.state_dict().items():
        if t.is_meta:
            continue
        key = (t.data_ptr(), t.shape, t.dtype)
        if key in seen and t.numel():
            continue
        seen[key] = name
        t = t.detach().cpu()
        yield (f"{prefix}.{name}" if prefix else name), \
            (t.to(float_dtype) if t.is_floating_point() and name not in keep else t).contiguous()


def save_compressed(model: nn.Module, tokenizer, out_dir: str | Path, meta: dict, save_dtype: str = "bfloat16",
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the weights (QuantLinear buffers + float tensors in `save_dtype`; model.safetensors, or shards of at most
    `max_shard_bytes` with their index), config.json, tokenizer files and compress.json (per-layer schemes, recipe,
    provenance) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir, dict(storage_tensors(model, save_dtype)), {"compress": "1"}, max_shard_bytes)
    write_model_files(model, tokenizer, out_dir, meta, save_dtype, kv_layers(model))
    return out_dir


def write_model_files(model: nn.Module, tokenizer, out_dir: Path, meta: dict, save_dtype: str, kv: dict) -> None:
    """Everything of a compress checkpoint but the tensors: config.json, generation and tokenizer files, and
    compress.json (per-layer schemes, `kv` scales, recipe, provenance). `model` may be a meta skeleton."""
    from ..transforms.rotation import online_rotations
    layers = {n: m.scheme.to_dict() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    lowrank = {n: m.rank for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.rank}  # eora's terms
    trellis = {n: m.trellis.to_dict() for n, m in model.named_modules() if getattr(m, "trellis", None) is not None}
    rotations = {n: r.n for n, r in online_rotations(model).items()}  # linear -> order of its online Hadamard
    config = copy.deepcopy(model.config)
    config.dtype = save_dtype  # what the float tensors on disk are
    set_architectures(config, model)
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    (out_dir / COMPRESS_META).write_text(json.dumps({**meta, "format": "compress-native-v1", "save_dtype": save_dtype,
                                                     "layers": layers, "kv_cache": kv,
                                                     **({"online_rotations": rotations} if rotations else {}),
                                                     **({"lowrank": lowrank} if lowrank else {}),
                                                     **({"trellis": trellis} if trellis else {})},
                                                    indent=2))


def quantized_skeleton(config, layers: dict[str, QuantScheme], dtype: torch.dtype = torch.float32,
                       codes: dict | None = None) -> nn.Module:
    """A meta-device model of `config` (no weights) whose modules named in `layers` are QuantLinear layers of those
    schemes (TrellisLinear where `codes` gives the layer a trellis format): what a saved compressed model is rebuilt
    into, and what the export checks of a plan look at."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = auto_model_class(config).from_config(config, dtype=dtype)
    unfuse_experts(model)  # a compress checkpoint names each expert's layers (experts.{e}.gate_proj, ...)
    return meta_quant_layers(model, layers, dtype, codes)


def meta_quant_layers(model: nn.Module, layers: dict[str, QuantScheme], dtype: torch.dtype,
                      codes: dict | None = None) -> nn.Module:
    """Replace the linears named in `layers` by QuantLinear layers of those schemes on the meta device (shapes and
    dtypes, no data); a layer `codes` gives a TrellisFormat becomes a TrellisLinear of it."""
    from ..core.trellis import TrellisLinear

    for name, scheme in layers.items():
        old = model.get_submodule(name)
        out_features, in_features = linear_shape(old)
        fmt = (codes or {}).get(name)
        layer = QuantLinear(in_features, out_features, scheme, bias=old.bias is not None, dtype=dtype, device="meta") \
            if fmt is None else TrellisLinear(in_features, out_features, fmt, bias=old.bias is not None, dtype=dtype,
                                              device="meta")
        set_module(model, name, layer)
    return model


def compressed_skeleton(folder: str | Path, dtype: torch.dtype, shapes: dict[str, tuple]) -> tuple[nn.Module, set[str]]:
    """(model on the meta device, names kept at their stored dtype) for a folder written by save_compressed: the
    config's architecture with its QuantLinear layers and KV-cache scales; `shapes` (tensor name -> shape, from the
    file's headers) sizes what only the file knows (LLM.int8 static outlier features). The kept names are the
    QuantLinear buffers (codes, scales) and the KV scales; every other float tensor is read at `dtype`."""
    from transformers import AutoConfig

    folder = Path(folder)
    meta = json.loads((folder / COMPRESS_META).read_text())
    from ..core.trellis import TrellisFormat

    model = quantized_skeleton(AutoConfig.from_pretrained(folder),
                               {name: QuantScheme.from_dict(fields) for name, fields in meta["layers"].items()}, dtype,
                               {name: TrellisFormat(**fields) for name, fields in meta.get("trellis", {}).items()})
    for name, fields in meta.get("kv_cache", {}).items():
        if fields["dtype"].startswith("int"):  # an int KIVI cache: a format, no tensors
            from ..kv.kivi import KVQuant
            module = model.get_submodule(name)
            module.kv_quant = KVQuant(int(fields["dtype"][3:]), fields["group"], fields["residual"])
            module.kv_cache_dtype = fields["dtype"]
            continue
        set_kv_scales(model.get_submodule(name), fields["k_scale"] * KV_MAX[fields["dtype"]],
                      fields["v_scale"] * KV_MAX[fields["dtype"]], fields["dtype"])
    if meta.get("kv_cache"):
        use_kv_attention(model)
    from ..transforms.rotation import OnlineHadamard, attach_input_rotation
    for name, n in meta.get("online_rotations", {}).items():  # its signs come from the file
        attach_input_rotation(model.get_submodule(name), OnlineHadamard(n))
    for name, rank in meta.get("lowrank", {}).items():  # eora's low-rank terms: float tensors, read at `dtype`
        layer = model.get_submodule(name)
        layer.set_lowrank(torch.empty(rank, layer.in_features, dtype=dtype, device="meta"),
                          torch.empty(layer.out_features, rank, dtype=dtype, device="meta"))
    floats = ("bias", "lora_a", "lora_b")
    keep = {k for k in shapes if any(k.startswith(n + ".") and k[len(n) + 1:] not in floats for n in meta["layers"])}
    keep |= {f"{n}.{b}" for n, f in meta.get("kv_cache", {}).items() if "k_scale" in f for b in ("k_scale", "v_scale")}
    for name in meta["layers"]:  # LLM.int8 static outlier features: their count is only known from the file
        key = f"{name}.outlier_cols"
        if key in shapes:
            model.get_submodule(name).outlier_cols = torch.empty(tuple(shapes[key]), dtype=torch.int64, device="meta")
    return model, keep


def load_compressed(folder: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Rebuild a model saved by save_compressed: the config's architecture with QuantLinear layers."""
    state = read_safetensors(folder)
    model, keep = compressed_skeleton(folder, dtype, {k: tuple(v.shape) for k, v in state.items()})
    state = {k: (v.to(dtype) if v.is_floating_point() and k not in keep else v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if unexpected or still_meta:
        raise ValueError(f"{folder}: checkpoint does not match its config: unexpected={unexpected[:5]}, "
                         f"missing={still_meta[:5]}")
    return model.eval()


# ---------------------------------------------------------------- as an exporter (EXPORTERS["native"])

def problems(model: nn.Module) -> list[str]:
    """Every model compress holds can be written as its own checkpoint."""
    return []


def write(model: nn.Module, tokenizer, folder: Path, source_gguf=None, parts=None,
          max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """`compress export RUN --format native`: the model re-saved as compress's own checkpoint (float tensors in
    bfloat16, QuantLinear buffers and KV scales at their own dtype)."""
    if parts is not None:
        from .errors import ExportError
        raise ExportError("a streamed model's output folder is already compress's own checkpoint: copy the run "
                          "folder (or export another format)")
    save_compressed(model, tokenizer, folder, {}, max_shard_bytes=max_shard_bytes)
    layers = sum(isinstance(m, QuantLinear) for m in model.modules())
    return {"layers": layers, "float_dtype": "bfloat16", "notes": []}


def read(folder: Path, record: dict):
    """`compress verify`'s reader: the checkpoint rebuilt with its QuantLinear layers (reference matmuls)."""
    return "compress (its own checkpoint: QuantLinear layers, reference matmuls)", load_compressed(folder)
