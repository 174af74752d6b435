"""fp8 KV cache: per-layer `k_scale` / `v_scale`, calibrated from the keys and values attention reads.

Serving engines (vLLM, TensorRT-LLM) store keys and values in fp8 as k / k_scale and v / v_scale, with
one scale per attention layer taken from calibration: scale = max|k| / fp8_max over the calibration
tokens, for keys after the rotary embedding (what the cache holds). We measure that effect on accuracy
by quantize-dequantizing the keys and values each attention call reads, through an attention function
registered with transformers' `AttentionInterface`: it wraps the model's own implementation (sdpa or
the family's eager function), so no model code is copied or traced.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .kivi import KVQuant, kivi_attention
from ..core.primitives import cast_fp8, fake_quantize_micro_activation
from ..core.scheme import FP8_MAX, ActScheme

# NVFP4 KV cache: each cached key / value vector in blocks of 16 head-dimension channels, e2m1 values with e4m3
# block scales, under one fp32 tensor scale per layer and per k / v from calibration (k_scale = max|k| / (448 * 6),
# the scale convention of our static NVFP4 activations). 0.5625 bytes per element.
NVFP4_KV = ActScheme("fp4_e2m1", "group", dynamic=False, group_size=16, scale_dtype="float8_e4m3")
KV_MAX = {**FP8_MAX, "nvfp4": NVFP4_KV.qmax}  # what a layer's absmax maps onto: k_scale = absmax / KV_MAX
KV_BYTES = {"fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "nvfp4": 0.5 + 1 / 16}  # per cached element, block scales included

WRAPPED = {"sdpa": "compress_kv_sdpa", "eager": "compress_kv_eager"}  # base implementation -> our name


_RECORD = "_compress_kv_record"  # set on an attention module only inside recording_kv (this file reads and writes it)


@contextlib.contextmanager
def recording_kv(block: nn.Module, records: dict[str, list[float]]):
    """While active, records[name] = [max |k|, max |v|] over the calls of each attention module of `block` (keys
    after the rotary embedding: what the cache holds). Transformers hands the attention function only the module,
    so the running maxima ride on it, under a private name, for the duration."""
    names = attention_modules(block)
    for name in names:
        records[name] = [0.0, 0.0]
        setattr(block.get_submodule(name), _RECORD, records[name])
    try:
        yield records
    finally:
        for name in names:
            setattr(block.get_submodule(name), _RECORD, None)


def attention_modules(block: nn.Module) -> list[str]:
    """Names (relative to `block`) of the modules that call the attention function: `*Attention` classes."""
    names = [n for n, m in block.named_modules() if n and type(m).__name__.endswith("Attention")]
    if not names:
        raise ValueError(f"found no *Attention module in {type(block).__name__}; the kv_cache stage needs one")
    return names


def fake_quantize_kv(t: Tensor, scale: Tensor, dtype: str) -> Tensor:
    """t -> fp8(t / scale) * scale, in t's dtype; nvfp4: blocks of 16 channels of each token's vector under the
    layer's tensor scale (NVFP4_KV)."""
    if dtype == "nvfp4":
        if t.shape[-1] % NVFP4_KV.group_size:
            raise ValueError(f"an NVFP4 KV cache needs a head dimension divisible by 16, got {t.shape[-1]}")
        return fake_quantize_micro_activation(t, NVFP4_KV, scale)
    s = scale.to(t.dtype)
    return (cast_fp8(t / s, dtype).to(t.dtype)) * s


def _base_function(module: nn.Module, base: str):
    if base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward")


def _wrapper(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        record = getattr(module, _RECORD, None)
        if record is not None:  # calibration: running maxima of |k| and |v|
            record[0] = max(record[0], float(key.detach().abs().amax()))
            record[1] = max(record[1], float(value.detach().abs().amax()))
        elif getattr(module, "kv_quant", None) is not None:  # int8 / int4 KIVI cache (kv/kivi.py)
            return kivi_attention(module, query, key, value, attention_mask, module.kv_quant, **kwargs)
        elif getattr(module, "k_scale", None) is not None:
            key = fake_quantize_kv(key, module.k_scale, module.kv_cache_dtype)
            value = fake_quantize_kv(value, module.v_scale, module.kv_cache_dtype)
        return _base_function(module, base)(module, query, key, value, attention_mask, **kwargs)
    return attention


AttentionInterface.register(WRAPPED["sdpa"], _wrapper("sdpa"))
AttentionInterface.register(WRAPPED["eager"], _wrapper("eager"))
AttentionMaskInterface.register(WRAPPED["sdpa"], sdpa_mask)
AttentionMaskInterface.register(WRAPPED["eager"], eager_mask)


def use_kv_attention(model: nn.Module) -> None:
    """Route the model's attention through the wrapper (a no-op for layers without scales or recording)."""
    impl = model.config._attn_implementation
    if impl in WRAPPED.values():
        return
    if impl not in WRAPPED:
        raise ValueError(f"kv_cache calibration wraps 'sdpa' or 'eager' attention; this model uses {impl!r}. "
                         "Load it with attn_implementation='sdpa'.")
    model.set_attn_implementation(WRAPPED[impl])


def restore_attention(model: nn.Module) -> None:
    impl = model.config._attn_implementation
    for base, name in WRAPPED.items():
        if impl == name:
            model.set_attn_implementation(base)


def set_kv_scales(module: nn.Module, k_absmax: float, v_absmax: float, dtype: str) -> None:
    """Register k_scale / v_scale (float32 scalars, vLLM's names) on an attention module."""
    device = next(iter([*module.parameters(), *module.buffers()]), torch.empty(0)).device
    for name, absmax in (("k_scale", k_absmax), ("v_scale", v_absmax)):
        module.register_buffer(name, torch.tensor(max(absmax, 1e-8) / KV_MAX[dtype], dtype=torch.float32,
                                                  device=device))
    module.kv_cache_dtype = dtype


def kv_layers(model: nn.Module) -> dict[str, dict]:
    """Attention modules carrying fp8 KV scales (name -> {dtype, k_scale, v_scale}) or an int KIVI cache format
    (name -> {dtype, group, residual})."""
    out = {n: m.kv_quant.to_dict() for n, m in model.named_modules() if getattr(m, "kv_quant", None) is not None}
    return out | {n: {"dtype": m.kv_cache_dtype, "k_scale": float(m.k_scale), "v_scale": float(m.v_scale)}
                  for n, m in model.named_modules()
                  if getattr(m, "k_scale", None) is not None and hasattr(m, "kv_cache_dtype")}


def attach_kv_quant(module: nn.Module, kv: KVQuant) -> list[str]:
    """Mark every attention module under `module` to attend over an int KIVI cache of format `kv` (kv/kivi.py; the
    attention wrapper above reads it); returns their names."""
    names = attention_modules(module)
    for name in names:
        target = module.get_submodule(name)
        target.kv_quant = kv
        target.kv_cache_dtype = f"int{kv.bits}"
    return names
