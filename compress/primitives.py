"""Quantization primitives: scale/zero-point computation and the affine map.

Pure functions: float32 math on the input's device, no module mutation, no device moves.
Weights are [out_features, in_features]; groups run along in_features.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .scheme import QuantScheme


def group_view(w: Tensor, scheme: QuantScheme) -> Tensor:
    """View a [out, in] weight as [rows, n_groups, group] following the scheme's granularity."""
    out_features, in_features = w.shape
    if scheme.granularity == "group":
        if in_features % scheme.group_size:
            raise ValueError(f"in_features={in_features} is not divisible by group_size={scheme.group_size}")
        return w.reshape(out_features, in_features // scheme.group_size, scheme.group_size)  # [N, K // G, G]
    if scheme.granularity == "channel":
        return w.reshape(out_features, 1, in_features)  # [N, 1, K]
    return w.reshape(1, 1, out_features * in_features)  # [1, 1, N*K]


def scale_shape(scheme: QuantScheme, out_features: int, in_features: int) -> tuple[int, ...]:
    """Shape of the scale (and zero point) of a [out, in] weight under `scheme`."""
    if scheme.granularity == "tensor":
        return ()
    if scheme.granularity == "channel":
        return (out_features, 1)
    return (out_features, in_features // scheme.group_size)


def compute_qparams(w: Tensor, scheme: QuantScheme) -> tuple[Tensor, Tensor | None]:
    """Scale (and zero point) from the weight's range: absmax if symmetric, min/max otherwise.

    The scale is rounded to scheme.scale_dtype *before* it is used, so the stored scale and the
    codes agree exactly. An all-zero group gets scale 1 (its codes are zero whatever the scale).
    Returns float32 scale and, for asymmetric schemes, a float32 integer-valued zero point,
    both of shape [] / [out, 1] / [out, in // group_size].
    """
    wg = group_view(w.float(), scheme)
    if scheme.symmetric:
        scale = wg.abs().amax(dim=-1) / scheme.qmax
        zero_point = None
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
    asymmetric ones (range [0, 2**b - 1]).
    """
    wg = group_view(w.float(), scheme)
    s = scale.float().reshape(wg.shape[:-1] + (1,))
    q = torch.round(wg / s)
    if zero_point is not None:
        q = q + zero_point.float().reshape(s.shape)
    q = torch.clamp(q, scheme.qmin, scheme.qmax)
    return q.reshape(w.shape).to(torch.int8 if scheme.symmetric else torch.uint8)


def dequantize_affine(q: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """w_hat = (q - zero_point) * scale, shape of q, in `dtype`."""
    qg = group_view(q, scheme).float()
    s = scale.float().reshape(qg.shape[:-1] + (1,))
    if zero_point is not None:
        qg = qg - zero_point.float().reshape(s.shape)
    return (qg * s).reshape(q.shape).to(dtype)
