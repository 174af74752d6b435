"""Memory accounting: weight bytes by dtype (packed codes counted as stored), checkpoint bytes, peak RSS."""
from __future__ import annotations

import resource
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from ..core.nn import QuantLinear, is_linear, linear_shape


def _tensors(model: nn.Module, meta: bool = False):
    """Weight tensors, each storage once; `meta`: count tensors on the meta device too (a streamed model's blocks,
    by shape and dtype)."""
    seen = set()
    # a tied weight on the meta device may be a separate tensor (accelerate's disk offload): transformers names it
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) if meta else set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or (t.is_meta and not meta) or (t.is_meta and name in tied):
            continue
        key = id(t) if t.is_meta else t.data_ptr()
        if key in seen:
            continue
        if not name.endswith(("weight", "bias", "qdata", "scale", "zero_point", "lora_a", "lora_b")):
            continue  # rotary tables and masks are not weights
        seen.add(key)
        yield name, t


def weight_bytes(model: nn.Module, meta: bool = False) -> dict:
    """Bytes held by weights, by storage dtype, plus the linear layers' share and their bf16 equivalent (`meta`:
    including tensors on the meta device, as they will be when loaded)."""
    by_dtype: dict[str, int] = defaultdict(int)
    for _, t in _tensors(model, meta):
        by_dtype[str(t.dtype).replace("torch.", "")] += t.numel() * t.element_size()
    linear_now = linear_bf16 = quant_now = quant_bf16 = 0
    for _, m in model.named_modules():
        if not is_linear(m):
            continue
        out_f, in_f = linear_shape(m)
        bf16 = out_f * in_f * 2
        if isinstance(m, QuantLinear):
            now = m.qtensor().nbytes + sum(t.numel() * t.element_size() for t in (m.lora_a, m.lora_b)
                                           if t is not None)  # the low-rank repair: part of the layer's bytes
            quant_now += now
            quant_bf16 += bf16
        else:
            now = m.weight.numel() * m.weight.element_size()
        if m.bias is not None:
            now += m.bias.numel() * m.bias.element_size()
        linear_now += now
        linear_bf16 += bf16
    return {
        "total": sum(by_dtype.values()),
        "by_dtype": dict(sorted(by_dtype.items())),
        "linear_layers": linear_now,
        "linear_layers_bf16": linear_bf16,
        "quantized_linears": quant_now,
        "quantized_linears_bf16": quant_bf16,
        "quantized_over_bf16": (quant_now / quant_bf16) if quant_bf16 else None,
    }


def serving_bytes(model: nn.Module, float_bytes: int = 2, meta: bool = False) -> int:
    """Weight bytes as a GPU server holds them: quantized layers as stored (codes, scales, zero points), every
    float tensor at `float_bytes` (bf16), whatever dtype it has in this process (float32 on CPU)."""
    quant = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    total = 0
    for name, t in _tensors(model, meta):
        stored = name.rpartition(".")[0] in quant and not name.endswith(("bias", "lora_a", "lora_b"))
        total += t.numel() * (t.element_size() if stored or not t.is_floating_point() else float_bytes)
    return total


def folder_bytes(path: str | Path) -> int:
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".gguf"))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_cuda_bytes() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
