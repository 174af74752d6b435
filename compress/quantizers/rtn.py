"""Round-to-nearest (RTN): scales from the weight's own range, codes by rounding."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.primitives import compute_qparams, dequantize_affine, global_scale, group_view, quantize_affine
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme


@dataclass(frozen=True)
class RTNOptions:
    """Round-to-nearest has no options."""


# rows quantized at a time when scales are per row or per group: each slice's temporaries stay in the CPU's cache
# (a 7B gate_proj, 11008 x 4096 int4 g64: 0.62 s whole, 0.29 s in 64-row slices, 1 thread; bit for bit the same)
ROWS = 128
SLICED_FROM = 1 << 22  # smaller weights are quantized whole: their temporaries fit the cache anyway


def quantize_rtn(w: Tensor, scheme: QuantScheme, options: RTNOptions | None = None, inputs=None) -> QuantizedTensor:
    """Quantize a [out, in] weight with absmax (symmetric) or min/max (asymmetric) scales."""
    if w.dim() != 2:
        raise ValueError(f"quantize_rtn expects a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    gscale = global_scale(w, scheme)  # NVFP4's per-tensor scale (None otherwise)
    if scheme.granularity in ("group", "channel") and w.numel() >= SLICED_FROM:
        return QuantizedTensor.cat_rows([_rtn(w[r:r + ROWS], scheme, gscale) for r in range(0, w.shape[0], ROWS)])
    return _rtn(w, scheme, gscale)


def _rtn(w: Tensor, scheme: QuantScheme, gscale: Tensor | None) -> QuantizedTensor:
    scale, zero_point = compute_qparams(w, scheme, gscale)
    q = quantize_affine(w, scale, zero_point, scheme)
    return QuantizedTensor.from_codes(q, scale, zero_point, scheme, gscale)


def fake_quantize(w: Tensor, scheme: QuantScheme) -> Tensor:
    """RTN round trip without packing: the same primitives as quantize_rtn, equal to
    quantize_rtn(w, scheme).dequantize() (tested)."""
    scale, zero = compute_qparams(w, scheme)
    if scheme.is_float or scheme.granularity == "block":
        return dequantize_affine(quantize_affine(w, scale, zero, scheme), scale, zero, scheme, w.dtype)
    # integer codes by group (the searches' hot path): the same operations as quantize_affine then dequantize_affine,
    # without the int8 / uint8 codes in between (every code is an integer in range: bit for bit the same values)
    wg = group_view(w.float(), scheme)
    s = scale.reshape(wg.shape[:-1] + (1,))
    q = torch.div(wg, s).round_()
    if zero is not None:
        z = zero.reshape(s.shape)
        return q.add_(z).clamp_(scheme.qmin, scheme.qmax).sub_(z).mul_(s).reshape(w.shape).to(w.dtype)
    return q.clamp_(scheme.qmin, scheme.qmax).mul_(s).reshape(w.shape).to(w.dtype)
