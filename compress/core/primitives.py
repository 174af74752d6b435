"""Quantization primitives: scale/zero-point computation, the affine map, fp8 casts, and activation
quantization.

Pure functions: float32 math on the input's device, no module mutation, no device moves.
Weights are [out_features, in_features]; groups run along in_features; blocks are square tiles.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .microscale import e8m0_scale, nvfp4_block_scale, nvfp4_global_scale, round_e2m1
from .scheme import FP8_MAX, ActScheme, QuantScheme

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def group_view(w: Tensor, scheme: QuantScheme) -> Tensor:
    """w [out, in] as [rows, n_groups, group] following the scheme's granularity (a copy for blocks)."""
    out_features, in_features = w.shape
    if scheme.granularity in ("group", "block"):
        g = scheme.group_size
        if in_features % g:
            raise ValueError(f"in_features={in_features} is not divisible by group_size={g}")
        if scheme.granularity == "group":
            return w.reshape(out_features, in_features // g, g)  # [N, K // G, G]
        if out_features % g:
            raise ValueError(f"out_features={out_features} is not divisible by the block size {g}")
        tiles = w.reshape(out_features // g, g, in_features // g, g).transpose(1, 2)  # [N // B, K // B, B, B]
        return tiles.reshape(out_features // g, in_features // g, g * g)
    if scheme.granularity == "channel":
        return w.reshape(out_features, 1, in_features)  # [N, 1, K]
    return w.reshape(1, 1, out_features * in_features)  # [1, 1, N*K]


def group_range(wg: Tensor, symmetric: bool) -> tuple[Tensor, Tensor]:
    """(lo, hi) [rows, groups] of grouped weights [rows, groups, G] as compute_qparams spans them: ±absmax when
    symmetric, [min ∧ 0, max ∨ 0] otherwise."""
    if symmetric:
        hi = wg.abs().amax(dim=-1)
        return -hi, hi
    return wg.amin(dim=-1).clamp(max=0.0), wg.amax(dim=-1).clamp(min=0.0)


def shrink_range(w: Tensor, factor: Tensor, scheme: QuantScheme) -> Tensor:
    """w [out, in] (float32) with each of the scheme's groups clamped to its range (group_range) times `factor`
    [rows, groups], so that compute_qparams of the result gives the shrunk grid (AWQ's clipping)."""
    wg = group_view(w.float(), scheme)
    lo, hi = group_range(wg, scheme.symmetric)
    f = factor.reshape(hi.shape).to(hi.dtype)
    return torch.minimum(torch.maximum(wg, (lo * f)[..., None]), (hi * f)[..., None]).reshape(w.shape)


def ungroup(wg: Tensor, shape: tuple[int, int], scheme: QuantScheme) -> Tensor:
    """Inverse of group_view: back to [out, in]."""
    if scheme.granularity == "block":
        g = scheme.group_size
        n, k = shape
        return wg.reshape(n // g, k // g, g, g).transpose(1, 2).reshape(n, k)
    return wg.reshape(shape)


def scale_shape(scheme: QuantScheme, out_features: int, in_features: int) -> tuple[int, ...]:
    """Shape of the scale (and zero point) of a [out, in] weight under `scheme`."""
    if scheme.granularity == "tensor":
        return ()
    if scheme.granularity == "channel":
        return (out_features, 1)
    if scheme.granularity == "block":
        return (out_features // scheme.group_size, in_features // scheme.group_size)
    return (out_features, in_features // scheme.group_size)


def cast_fp8(x: Tensor, dtype: str) -> Tensor:
    """Saturating cast to float8: values beyond the largest finite value become +-max (torch's own cast
    gives inf for e5m2 and NaN for e4m3fn in some versions); in range, torch's round-to-nearest-even.
    NaN stays NaN."""
    m = FP8_MAX[dtype]
    return x.float().clamp(-m, m).to(FP8_DTYPES[dtype])


def cast_float(x: Tensor, dtype: str) -> Tensor:
    """x on a float element grid: float8 (cast_fp8) or fp4 e2m1 (float32 values on the grid, microscale.py)."""
    return round_e2m1(x) if dtype == "fp4_e2m1" else cast_fp8(x, dtype)


def global_scale(w: Tensor, scheme: QuantScheme) -> Tensor | None:
    """NVFP4's per-tensor fp32 scale, 448 * 6 / amax(w); None for every other scheme. Methods that quantize a
    weight in pieces (GPTQ's column groups) take it once from the whole weight and pass it to compute_qparams."""
    return nvfp4_global_scale(w.detach().abs().amax()) if scheme.has_global_scale else None


def _micro_scale(amax: Tensor, element: str, scale_dtype: str, g: Tensor | None) -> Tensor:
    """Effective float32 block scales of a microscaling format from block absmax. NVFP4: e4m3(amax / 6 * g) / g,
    the e4m3 value kept at least e4m3's smallest subnormal (2**-9) so no block scale is zero; MX: 2**e (e8m0)."""
    if scale_dtype == "e8m0":
        return e8m0_scale(amax, element)
    return nvfp4_block_scale(amax, g).clamp(min=2.0 ** -9) / g


def compute_qparams(w: Tensor, scheme: QuantScheme, global_scale: Tensor | None = None
                    ) -> tuple[Tensor, Tensor | None]:
    """Scale (and zero point) from the weight's range: absmax if symmetric, min/max otherwise.

    The scale is rounded to scheme.scale_dtype *before* it is used, so the stored scale and the
    codes agree exactly. An all-zero group gets scale 1 (its codes are zero whatever the scale).
    Returns float32 scale and, for asymmetric schemes, a float32 integer-valued zero point,
    both of shape scale_shape(scheme, *w.shape).
    Microscaling schemes return the effective block scale (NVFP4: the e4m3 value divided by the tensor's global
    scale, `global_scale` or else the one of w itself; MX: the power of two), which QuantizedTensor stores encoded.
    """
    wg = group_view(w.float(), scheme)
    zero_point = None
    if scheme.is_micro:
        g = None if not scheme.has_global_scale else \
            (global_scale.float() if global_scale is not None else nvfp4_global_scale(wg.abs().amax()))
        scale = _micro_scale(wg.abs().amax(dim=-1), scheme.dtype, scheme.scale_dtype, g)
        return scale.reshape(scale_shape(scheme, *w.shape)), None
    if scheme.is_float:
        scale = wg.abs().amax(dim=-1) / scheme.fp8_max
    elif scheme.symmetric:
        scale = wg.abs().amax(dim=-1) / scheme.qmax
    else:
        lo = wg.amin(dim=-1).clamp(max=0.0)  # the grid always holds 0
        hi = wg.amax(dim=-1).clamp(min=0.0)
        scale = (hi - lo) / (scheme.qmax - scheme.qmin)
    scale = scale.to(getattr(torch, scheme.scale_dtype)).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not scheme.symmetric:
        zero_point = torch.clamp(torch.round(-lo / scale), scheme.qmin, scheme.qmax)
    shape = scale_shape(scheme, *w.shape)
    return scale.reshape(shape), None if zero_point is None else zero_point.reshape(shape)


def quantize_affine(w: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme) -> Tensor:
    """Integer codes q = clamp(round(w / scale) + zero_point, qmin, qmax), shape of w.

    Codes are int8 for symmetric schemes (range [-2**(b-1), 2**(b-1)-1]) and uint8 for
    asymmetric ones (range [0, 2**b - 1]). For fp8 schemes: the float8 tensor cast_fp8(w / scale); for fp4 e2m1:
    float32 values on the e2m1 grid (no torch dtype holds them unpacked).
    """
    wg = group_view(w.float(), scheme)
    s = scale.float().reshape(wg.shape[:-1] + (1,))
    if scheme.is_float:
        return ungroup(cast_float(wg / s, scheme.dtype), tuple(w.shape), scheme)
    q = torch.round(wg / s)
    if zero_point is not None:
        q = q + zero_point.float().reshape(s.shape)
    q = torch.clamp(q, scheme.qmin, scheme.qmax)
    return ungroup(q, tuple(w.shape), scheme).to(torch.int8 if scheme.symmetric else torch.uint8)


def dequantize_affine(q: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """w_hat = (q - zero_point) * scale, shape of q, in `dtype`."""
    qg = group_view(q.float(), scheme)
    s = scale.float().reshape(qg.shape[:-1] + (1,))
    if zero_point is not None:
        qg = qg - zero_point.float().reshape(s.shape)
    return ungroup(qg * s, tuple(q.shape), scheme).to(dtype)


# ---------------------------------------------------------------- activations

def activation_qparams(x: Tensor, act: ActScheme) -> tuple[Tensor, Tensor | None]:
    """Dynamic scale (and zero point) of x [..., K]: per token -> [..., 1], per tensor -> [];
    per group (microscaling) -> [..., K // G, 1], the effective block scales (fake_quantize_activation)."""
    xf = x.float()
    if act.granularity == "group":
        raise ValueError("group (microscaled) activations are quantized by fake_quantize_activation")
    if act.granularity == "token":
        if act.symmetric:
            absmax = xf.abs().amax(dim=-1, keepdim=True)
        else:
            lo, hi = xf.amin(dim=-1, keepdim=True).clamp(max=0), xf.amax(dim=-1, keepdim=True).clamp(min=0)
    elif act.symmetric:
        absmax = xf.abs().amax()
    else:
        lo, hi = xf.amin().clamp(max=0), xf.amax().clamp(min=0)
    if act.symmetric:
        scale = absmax / act.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, None
    scale = (hi - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.clamp(torch.round(-lo / scale), 0, 255)


def quantize_activation(x: Tensor, act: ActScheme, scale: Tensor, zero_point: Tensor | None = None) -> Tensor:
    """Codes of x with the given scale: int8 in [-127, 127] (symmetric, as bitsandbytes and vLLM; int4 in [-7, 7]),
    uint8 in [0, 255] with a zero point, float8 (saturating), or fp4 e2m1 values (float32)."""
    xs = x.float() / scale
    if act.dtype in FP8_MAX or act.dtype == "fp4_e2m1":
        return cast_float(xs, act.dtype)
    if zero_point is None:
        q = 7 if act.dtype == "int4" else 127
        return torch.clamp(torch.round(xs), -q, q).to(torch.int8)
    return torch.clamp(torch.round(xs) + zero_point, 0, 255).to(torch.uint8)


def fake_quantize_activation(x: Tensor, act: ActScheme, static_scale: Tensor | None = None) -> Tensor:
    """Quantize-dequantize x (same dtype and shape): the reference for every W?A8 matmul (and W4A4)."""
    if act.granularity == "group":
        return fake_quantize_micro_activation(x, act, static_scale)
    if act.dynamic:
        scale, zero_point = activation_qparams(x, act)
    else:
        if static_scale is None:
            raise ValueError("static activation quantization needs a calibrated input_scale")
        scale, zero_point = static_scale.float(), None
    q = quantize_activation(x, act, scale, zero_point).float()
    if zero_point is not None:
        q = q - zero_point
    return (q * scale).to(x.dtype)


def fake_quantize_micro_activation(x: Tensor, act: ActScheme, static_scale: Tensor | None = None) -> Tensor:
    """Microscaled activations (NVFP4, MXFP4, MXFP8): block scales per `group_size` features from each input
    on the fly. NVFP4's tensor scale is 1 / static_scale (calibrated: the layer's input_scale = amax / (448 * 6))
    or, for dynamic: true, 448 * 6 / amax(x)."""
    k, gsz = x.shape[-1], act.group_size
    if k % gsz:
        raise ValueError(f"{k} input features are not a multiple of the activation block {gsz}")
    xg = x.float().reshape(*x.shape[:-1], k // gsz, gsz)  # [..., K // G, G]
    g = None
    if act.scale_dtype == "float8_e4m3":
        if act.dynamic:
            g = nvfp4_global_scale(xg.abs().amax())
        elif static_scale is None:
            raise ValueError("NVFP4 activations with a static global scale need a calibrated input_scale")
        else:
            g = 1.0 / static_scale.float().clamp(min=torch.finfo(torch.float32).tiny)
    s = _micro_scale(xg.abs().amax(dim=-1, keepdim=True), act.dtype, act.scale_dtype, g)
    return (cast_float(xg / s, act.dtype).float() * s).reshape(x.shape).to(x.dtype)
