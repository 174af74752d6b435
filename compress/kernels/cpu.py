"""torch's built-in CPU kernels for quantized weights, wrapped for QuantLinear.

- int4 weight-only: `aten._weight_int4pack_mm_for_cpu` on a weight repacked once by
  `aten._convert_weight_to_int4pack_for_cpu`. Its dequantization (measured against a float reference in
  tests/test_kernels_cpu.py) is w = (u - 8) * s + zf per group, u the unsigned code 0..15, s and zf in the
  activations' dtype stored together as [K / G, N, 2]. Our grid w = (u - z) * s maps onto it with zf = (8 - z) * s
  (symmetric schemes: z = 8, so zf = 0). It accepts G in {32, 64, 128, 256} and N % 16 == 0; a per-channel
  scale is written as the largest of those that divides K, repeated. It is fast only for bf16 / fp16
  activations: with float32 ones it was ~7x slower than float32 F.linear here (4096x4096, M = 1), so a float32
  layer is offered it only as `int4pack_bf16`: the input rounded to bf16, the output cast back (named as such).
- int8 weight-only, symmetric per channel: `aten._weight_int8pack_mm(x, w int8 [N, K], scales [N])`.

Each kernel has a `*_reason(layer) -> str | None` check (None: usable), a `prepare_*` that builds its operands once,
and a `linear_*` that runs them. The dispatcher (dispatch.py) decides when they are used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.qtensor import QuantizedTensor

INT4PACK_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts
FAST_DTYPES = (torch.bfloat16, torch.float16)


def int4pack_group(qt: QuantizedTensor) -> int | None:
    """The int4pack group size that expresses this weight's scales exactly, or None."""
    s, k = qt.scheme, qt.shape[1]
    if s.granularity == "group":
        return s.group_size if s.group_size in INT4PACK_GROUPS and k % s.group_size == 0 else None
    if s.granularity in ("channel", "tensor"):
        return next((g for g in INT4PACK_GROUPS if k % g == 0), None)
    return None


def int4pack_reason(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> str | None:
    s = qt.scheme
    if device.type != "cpu":
        return f"CPU kernel (the layer is on {device.type})"
    if s.dtype != "int4" or s.act is not None:
        return f"int4 weight-only only (scheme {s.name})"
    if dtype not in FAST_DTYPES:
        return f"needs bf16/fp16 activations to be fast (got {str(dtype).replace('torch.', '')})"
    if qt.shape[0] % 16:
        return f"out_features={qt.shape[0]} is not a multiple of 16"
    if int4pack_group(qt) is None:
        what = f"group_size={s.group_size}" if s.granularity == "group" else s.granularity
        return f"{what} with in_features={qt.shape[1]}: needs a group of 32/64/128/256 dividing in_features"
    return None


@dataclass
class Int4Packed:
    weight: Tensor  # uint8, torch's packed layout
    scale_zeros: Tensor  # [K / G, N, 2] in the activations' dtype
    group_size: int
    out_features: int


def prepare_int4pack(qt: QuantizedTensor, dtype: torch.dtype) -> Int4Packed:
    n, k = qt.shape
    g = int4pack_group(qt)
    u = qt.codes() - (qt.scheme.qmin if qt.zero_point is None else 0)  # unsigned codes 0..15
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 2)
    def per_row(t: Tensor) -> Tensor:  # [N, groups of the scheme]: 1 for channel, a tensor scale repeated
        return t.float().reshape(1, 1).expand(n, 1) if t.numel() == 1 else t.float().reshape(n, -1)

    scale = per_row(qt.scale)
    zero = None if qt.zero_point is None else per_row(qt.zero_point)
    reps = k // g // scale.shape[1]  # channel / tensor scales repeated over the int4pack groups
    return Int4Packed(weight, int4pack_scales_and_zeros(scale, zero, reps, dtype), g, n)


def int4pack_scales_and_zeros(scales: Tensor, zeros: Tensor | None, reps: int, dtype: torch.dtype) -> Tensor:
    """torch's int4pack operand (CPU `_weight_int4pack_mm_for_cpu` and CUDA `_weight_int4pack_mm`, tinygemm) for
    w = (u - z) * s with scales / zero points [N, groups] (zeros None: z = 8): [groups * reps, N, 2] of
    (scale, zf) in `dtype`, each group repeated `reps` times (channel scales spread over int4pack's groups). torch
    dequantizes w = (u - 8) * scale + zf, so zf = (8 - z) * s, computed from the scale as rounded to `dtype`: the
    only error left is zf's own rounding."""
    s = scales.float().to(dtype).float()
    z = torch.full_like(s, 8.0) if zeros is None else zeros.float()
    s, z = s.repeat_interleave(reps, 1), z.repeat_interleave(reps, 1)  # [N, K / G]
    return torch.stack([s.t(), ((8.0 - z) * s).t()], dim=-1).to(dtype).contiguous()  # [K / G, N, 2]


def int4pack_bf16_reason(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> str | None:
    if dtype != torch.float32:
        return "float32 layers only (bf16 / fp16 layers run int4pack directly)"
    return int4pack_reason(qt, torch.bfloat16, device)


def prepare_int4pack_bf16(qt: QuantizedTensor, dtype: torch.dtype) -> Int4Packed:
    return prepare_int4pack(qt, torch.bfloat16)


def linear_int4pack_bf16(p: Int4Packed, x: Tensor, bias: Tensor | None) -> Tensor:
    y = linear_int4pack(p, x.to(torch.bfloat16), None).to(x.dtype)
    return y if bias is None else y + bias


def linear_int4pack(p: Int4Packed, x: Tensor, bias: Tensor | None) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), p.weight, p.group_size, p.scale_zeros)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], p.out_features)


def int8pack_reason(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> str | None:
    s = qt.scheme
    if device.type != "cpu":
        return f"CPU kernel (the layer is on {device.type})"
    if s.dtype != "int8" or s.act is not None:
        return f"int8 weight-only only (scheme {s.name})"
    if not s.symmetric or s.granularity != "channel":
        return f"symmetric per-channel int8 only (got {'symmetric' if s.symmetric else 'asymmetric'} " \
               f"{s.granularity})"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations in {dtype}"
    return None


@dataclass
class Int8Packed:
    weight: Tensor  # int8 [N, K]
    scales: Tensor  # [N] in the activations' dtype


def prepare_int8pack(qt: QuantizedTensor, dtype: torch.dtype) -> Int8Packed:
    return Int8Packed(qt.qdata.contiguous(), qt.scale.reshape(-1).to(dtype).contiguous())


def linear_int8pack(p: Int8Packed, x: Tensor, bias: Tensor | None) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(x2, p.weight, p.scales)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], p.weight.shape[0])
