"""HQQ: half-quadratic quantization (Badri & Shaji, 2023, https://mobiusml.github.io/hqq_blog/). No calibration data.

RTN takes a group's scale and zero point from its min and max. HQQ keeps that scale and solves for the zero point
that minimises an l_p error (p < 1, robust to the few large weights) of the dequantized group, by half-quadratic
splitting: with s the scale and Ŵ = (clamp(round(W / s + z)) - z) · s,

    W_e <- shrink_p(W - Ŵ, β)                       sparse error term (generalised soft threshold)
    z   <- mean over the group of (W_q - (W - W_e) / s)    closed-form zero point
    β   <- κ β

until the mean |W - Ŵ| stops falling. At a trained layer's scale (|w| ~ 0.02) every rounding error is under the
shrink threshold (1/β)|e|^(p-1), which passes only |e| > 0.17 at β = 10, so W_e = 0 and each step is the closed-form
least-squares zero point for the current codes; the shrink acts on larger weights. Unlike HQQ's own solver, which
returns the zero point of the step that made things worse, this one keeps the best. The zero points are fractional:
with the scheme's `zero_point_dtype: float16` they are stored as they are (at float16), with `uint8` they are
rounded to the integer grid after the solve.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.primitives import group_view, scale_shape, ungroup
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme


@dataclass(frozen=True)
class HQQOptions:
    """HQQ's solver settings (`options:` of a `method: hqq` stage); the defaults are HQQ's own."""

    lp_norm: float = 0.7  # p of the l_p error; 1 = plain soft thresholding
    beta: float = 10.0  # initial half-quadratic penalty
    kappa: float = 1.01  # beta grows by this factor each step
    iters: int = 20  # at most this many steps

    def __post_init__(self):
        if not 0 < self.lp_norm <= 1:
            raise ValueError(f"hqq lp_norm must be in (0, 1] (HQQ uses 0.7), got {self.lp_norm}")
        if not self.beta > 0 or not self.kappa >= 1:
            raise ValueError(f"hqq needs beta > 0 and kappa >= 1 (HQQ: 10, 1.01), got {self.beta}, {self.kappa}")
        if self.iters < 1:
            raise ValueError(f"hqq iters must be >= 1 (HQQ uses 20), got {self.iters}")


def hqq_problem(scheme: QuantScheme) -> str | None:
    """Why HQQ cannot produce `scheme` (None: it can)."""
    if scheme.is_float:
        return f"HQQ optimises an integer grid's zero point; {scheme.dtype} has none (use method: rtn or gptq)"
    if scheme.symmetric:
        return "HQQ optimises the zero point, and this scheme is symmetric (no zero point); set symmetric: false"
    if scheme.granularity not in ("group", "channel"):
        return f"HQQ works per group or per channel, not per {scheme.granularity}; set granularity: group"
    return None


def shrink_lp(x: Tensor, beta: float, p: float) -> Tensor:
    """Generalised soft threshold: the minimiser of |e|^p + beta/2 (e - x)^2, to first order (HQQ's operator)."""
    if p == 1:
        return torch.sign(x) * torch.relu(x.abs() - 1.0 / beta)
    return torch.sign(x) * torch.relu(x.abs() - (1.0 / beta) * x.abs().clamp(min=1e-8).pow(p - 1))


@torch.no_grad()
def quantize_hqq(w: Tensor, scheme: QuantScheme, options: HQQOptions = HQQOptions(), inputs=None) -> QuantizedTensor:
    """Quantize a [out, in] weight with HQQ's zero-point solve (the scale stays min/max). `inputs` is unused:
    HQQ needs no calibration data."""
    if (why := hqq_problem(scheme)) is not None:
        raise ValueError(why)
    wg = group_view(w.float(), scheme)  # [..., group]
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    qmax = float(scheme.qmax)
    scale = ((hi - lo) / qmax).to(getattr(torch, scheme.scale_dtype)).float()  # stored scale, used as stored
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = -lo / scale

    def dequant(z: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.clamp(torch.round(wg / scale + z), 0, qmax)
        return q, (q - z) * scale

    beta, best_err, best_zero = options.beta, float("inf"), zero
    for _ in range(options.iters):
        q, w_hat = dequant(zero)
        err = float((wg - w_hat).abs().mean())
        if err >= best_err:
            break
        best_err, best_zero = err, zero
        w_e = shrink_lp(wg - w_hat, beta, options.lp_norm)
        zero = (q - (wg - w_e) / scale).mean(dim=-1, keepdim=True)
        beta *= options.kappa
    zero = best_zero
    if scheme.zero_point_dtype == "float16":
        zero = zero.to(torch.float16).float()  # the codes are rounded against the zero point as stored
    else:
        zero = torch.clamp(torch.round(zero), 0, qmax)
    q, _ = dequant(zero)
    shape = scale_shape(scheme, *w.shape)
    return QuantizedTensor.from_codes(ungroup(q, tuple(w.shape), scheme), scale.reshape(shape), zero.reshape(shape),
                                      scheme)
