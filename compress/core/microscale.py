"""Microscaling formats: the fp4 e2m1 grid, e8m0 block scales (OCP MX) and NVFP4's e4m3 block scales.

Element grid, fp4 e2m1 (1 sign, 2 exponent, 1 mantissa bit, no inf/NaN): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
A code is sign << 3 | index into that list; the index's low bit is the mantissa bit, so "ties to even" means
"ties to the even index". Rounding is round-to-nearest-even with saturation at +-6, as compressed-tensors'
`cast_to_fp4` and ModelOpt's `_cast_fp4` do. Two codes share a byte, the even element in the low nibble
(compressed-tensors `pack_fp4_to_uint8`, ModelOpt's NVFP4 `weight`, torchao `pack_uint4`).

Block scales:
  NVFP4 (16 elements): an fp8 e4m3 scale per block and one fp32 global scale per tensor,
      global = 448 * 6 / amax(tensor)                 (compressed-tensors `generate_gparam`; ModelOpt stores
                                                       its reciprocal as `weight_scale_2`)
      block  = e4m3(amax(block) / 6 * global)         (compressed-tensors `calculate_qparams`)
      w      = e2m1 * block / global
  MX (32 elements, OCP Microscaling v1.0): a power of two stored as e8m0 (bias 127, 0xFF = NaN),
      X = 2 ** (floor(log2(amax)) - emax_elem), emax_elem = 2 for e2m1, 8 for e4m3; elements saturate.
      amax is first rounded (half up) to one mantissa bit, as compressed-tensors' `generate_mx_scales` does for
      fp4, fp6 and fp8 elements alike (torchao's EVEN mode for fp4), so a block whose max is at least 1.75 x 2**k
      takes the next power: e2m1 clips at most [6, 7) to 6, e4m3 never clips (its blocks use 192..384 of 448).
      Matching it means our MX checkpoints hold exactly what llm-compressor would write for the same weights.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
ELEM_EMAX = {"fp4_e2m1": 2, "fp8_e4m3": 8}  # floor(log2(largest element)): 6 -> 2, 448 -> 8
AMAX_MANTISSA = 1  # the block max is rounded to one mantissa bit before its exponent is taken (see above)


def round_e2m1(x: Tensor) -> Tensor:
    """x (any float dtype) rounded to the nearest e2m1 value, ties to even, saturating at +-6; float32 out.
    The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; torch.round rounds halves to even, and on
    each segment an even multiple of the spacing is an even index. NaN stays NaN; -0 keeps its sign."""
    xf = x.float()
    a = xf.abs().clamp(max=E2M1_MAX)
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, xf)


def encode_e2m1(values: Tensor) -> Tensor:
    """e2m1 values (already on the grid) -> uint8 codes sign << 3 | index."""
    v = values.float()
    a = v.abs()
    index = (a >= 0.5).int() + (a >= 1).int() + (a >= 1.5).int() + (a >= 2).int() + (a >= 3).int() + \
        (a >= 4).int() + (a >= 6).int()
    return (index | (torch.signbit(v).int() << 3)).to(torch.uint8)


def decode_e2m1(codes: Tensor) -> Tensor:
    """uint8 codes -> float32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.long()
    mag = lut[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes [..., K] (K even) -> [..., K / 2], element 2j in the low nibble of byte j."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of pack_nibbles."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)


# ---------------------------------------------------------------- scales

def round_e4m3(x: Tensor) -> Tensor:
    """float32 values rounded to fp8 e4m3 (nearest even, saturating at 448), returned as float32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """The fp32 per-tensor scale that maps the tensor's largest block onto e4m3's top: 448 * 6 / amax.
    An all-zero (or non-finite) tensor gets 1 (compressed-tensors' fallback)."""
    a = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    g = torch.full_like(a, E4M3_MAX * E2M1_MAX) / a  # a true division (`2688 / a` is a reciprocal times 2688)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).reshape(())


def nvfp4_block_scale(block_amax: Tensor, global_scale: Tensor) -> Tensor:
    """e4m3 block scales (as float32 values) for blocks of the given amax: e4m3(amax / 6 * global). A zero scale
    (an all-zero block, or one below e4m3's smallest subnormal) stays zero: its elements are zero."""
    return round_e4m3(block_amax.float() / E2M1_MAX * global_scale.float())


def _round_to_mantissa(a: Tensor, mantissa: int) -> Tensor:
    """a (>= 0, float32) rounded half-up to `mantissa` bits (the binade may step up): what the element grid would
    make of the block max."""
    m, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    step = 2.0 ** (mantissa + 1)
    return torch.ldexp(torch.floor(m * step + 0.5) / step, e)


def e8m0_exponent(block_amax: Tensor, element: str) -> Tensor:
    """The unbiased shared exponent of MX blocks: floor(log2(amax rounded to one mantissa bit)) - emax_elem, clamped
    to e8m0's range [-127, 127]; an all-zero block gets -127 (its elements are zero whatever the scale)."""
    a = _round_to_mantissa(block_amax.float(), AMAX_MANTISSA)
    _, e = torch.frexp(a)  # floor(log2(a)) = e - 1 for a > 0
    exp = (e - 1 - ELEM_EMAX[element]).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(a > 0, exp, torch.full_like(exp, -E8M0_BIAS)).to(torch.int32)


def encode_e8m0(exponent: Tensor) -> Tensor:
    return (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8)


def decode_e8m0(codes: Tensor) -> Tensor:
    """uint8 e8m0 codes -> float32 powers of two (0xFF -> NaN)."""
    c = codes.to(torch.int32)
    v = torch.ldexp(torch.ones_like(c, dtype=torch.float32), c - E8M0_BIAS)
    return torch.where(c == E8M0_NAN, torch.full_like(v, math.nan), v)


def e8m0_scale(block_amax: Tensor, element: str) -> Tensor:
    """MX block scales as float32 powers of two."""
    return torch.ldexp(torch.ones_like(block_amax, dtype=torch.float32), e8m0_exponent(block_amax, element))
