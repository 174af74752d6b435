"""GPTQ as compress/quantizers/gptq.py computed it before its speed work (commit 1ebc46c), kept verbatim as the
bit-for-bit reference: one column at a time on the [N, K] weight (W[:, j:i2] -= err[:, None] * h_inv[j, j:i2]),
each layer factoring its own copy of H. The fast form (a factor shared by the layers reading one input, the
lazy-update blocks worked on transposed) must give exactly these codes, scales and zero points, given the same
inverse-Hessian factor (`inverse_factor`: the function that makes it; by default the textbook Cholesky,
cholesky_inverse, Cholesky of the base commit, which compress's cheaper factor is not bit for bit).
"""
from __future__ import annotations

import torch
from torch import Tensor

from compress.core.primitives import FP8_DTYPES, cast_float, compute_qparams, global_scale, group_view, shrink_range
from compress.core.qtensor import QuantizedTensor
from compress.core.scheme import QuantScheme, replace_granularity
from compress.quantizers.gptq import GPTQConfig, SingularHessianError


def _inverse_hessian_factor(h: Tensor, dampening: float, name: str) -> Tensor:
    """Upper Cholesky factor of H^-1 after dampening (the GPTQ 'Hinv' rows), computed in `h`'s own buffer: no
    second [K, K] matrix (for a 7B model's down_proj, K = 11008, each is 485 MB). LAPACK works in place on a
    column-major matrix, and H is symmetric, so its transpose view is that matrix; the factor returned is a view."""
    damp = dampening * torch.mean(torch.diag(h))
    h.diagonal().add_(damp)  # = h + damp * I, without the identity matrix
    ht = h.T
    info = torch.empty((), dtype=torch.int32, device=h.device)  # an out= tensor lives where the matrix does
    torch.linalg.cholesky_ex(ht, out=(ht, info))
    if int(info) != 0:
        raise SingularHessianError(
            f"{name}: the Hessian is not positive definite even after dampening {dampening:g} of its mean "
            f"diagonal. Raise the stage's `options.dampening` (e.g. 0.1), give more calibration samples, or check the "
            "calibration inputs for NaN/inf.")
    torch.cholesky_inverse(ht, out=ht)  # H^-1
    return torch.linalg.cholesky(ht, upper=True, out=ht)


def _permute_columns_(t: Tensor, perm: Tensor, rows: int = 256) -> None:
    """t[:, :] = t[:, perm] in place, a few rows at a time (a copy of `rows` rows, not of t)."""
    for r in range(0, t.shape[0], rows):
        t[r:r + rows] = t[r:r + rows, perm]


def _permute_rows_(t: Tensor, perm: Tensor) -> None:
    """t[:] = t[perm] in place, following the permutation's cycles (one row of extra memory)."""
    order = perm.tolist()
    done = bytearray(len(order))
    for first in range(len(order)):
        if done[first]:
            continue
        done[first] = 1
        if order[first] == first:
            continue
        saved, j = t[first].clone(), first
        while order[j] != first:
            t[j] = t[order[j]]
            j = order[j]
            done[j] = 1
        t[j] = saved


def _column_qparams(w_cols: Tensor, scheme: QuantScheme, gscale: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-row scale/zero point [N] of a slice [N, G] (one group); microscaling block scales with the weight's
    global scale (NVFP4)."""
    if scheme.is_micro:
        return compute_qparams(w_cols, scheme, gscale)[0][:, 0], None
    scale, zero = compute_qparams(w_cols, replace_granularity(scheme, "channel"))
    return scale[:, 0], None if zero is None else zero[:, 0]


def plain_gptq(w: Tensor, hessian: Tensor, scheme: QuantScheme, cfg: GPTQConfig = GPTQConfig(),
               name: str = "layer", overwrite_hessian: bool = False, clip: Tensor | None = None,
               inverse_factor=None) -> QuantizedTensor:
    """GPTQ-quantize a [out, in] weight given the Hessian [in, in] of its inputs.

    `clip` [rows, groups] (AWQ's clipping search, handed over with clip_to: grid): each group's grid is that of its
    range shrunk by the factor (primitives.shrink_range), while the weights stay unclamped: a weight beyond the grid
    rounds to its end, and GPTQ carries that error, like any rounding error, to the columns not yet quantized
    (clamping the weights first would make the clipped values GPTQ's target, an error it can never repair).

    Computes in float64 when `w` is float64 (tests), float32 otherwise. Memory beyond the inputs: one [K, K] matrix
    (none with `overwrite_hessian`, which lets the solve work in the caller's Hessian) and one [N, K] matrix, which
    holds the weights being updated and, column by column, the codes that replace them.
    """
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    W = w.detach().to(dtype, copy=True).contiguous()  # [N, K]
    H = hessian.detach()
    if not (overwrite_hessian and H.dtype == dtype and H.is_contiguous()):
        H = H.to(dtype, copy=True).contiguous()  # [K, K]
    n_rows, k = W.shape
    group_view(W, scheme)  # raises if the group size does not divide in_features
    if scheme.granularity == "block":
        raise ValueError(f"{name}: GPTQ quantizes column by column; 128x128 blocks are not supported, use "
                         "granularity: channel (or method: rtn)")

    dead = torch.diag(H) == 0  # inputs that never fire: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    g = scheme.group_size if scheme.granularity == "group" else None
    static = scheme.granularity != "group" or cfg.act_order
    gscale = global_scale(W, scheme)  # NVFP4: one per tensor, from the original weights
    if static:  # parameters from the original weights, in the original column order
        scale_full, zero_full = compute_qparams(W if clip is None else shrink_range(W, clip, scheme), scheme, gscale)
        scale_tab = _table(scale_full, scheme, n_rows).to(dtype)  # [N or 1, groups]: one column per group
        zero_tab = None if zero_full is None else _table(zero_full, scheme, n_rows).to(dtype)
        group_of = torch.arange(k) // g if g else torch.zeros(k, dtype=torch.long)  # weight column -> table column

    perm = torch.argsort(torch.diag(H), descending=True) if cfg.act_order else None
    if perm is not None:
        _permute_columns_(W, perm)
        _permute_columns_(H, perm)
        _permute_rows_(H, perm)
        group_of = group_of[perm.cpu()]  # stays on the CPU: the loop reads one entry per column (no device sync)

    h_inv = (inverse_factor or _inverse_hessian_factor)(H, cfg.dampening, name)
    if not static:
        n_groups = k // g
        scale_g = torch.zeros(n_rows, n_groups, dtype=dtype, device=W.device)
        zero_g = None if scheme.symmetric else torch.zeros_like(scale_g)

    for i1 in range(0, k, cfg.block_size):
        i2 = min(i1 + cfg.block_size, k)
        err_block = torch.zeros(n_rows, i2 - i1, dtype=dtype, device=W.device)
        for j in range(i1, i2):
            col = W[:, j]
            if static:
                t = int(group_of[j])
                s, z = scale_tab[:, t], (zero_tab[:, t] if zero_tab is not None else None)
            else:
                if j % g == 0:  # first column of a group: parameters from the weights as updated so far
                    cols = W[:, j:j + g]
                    if clip is not None:
                        cols = shrink_range(cols, clip[:, j // g], replace_granularity(scheme, "channel")).to(dtype)
                    s_new, z_new = _column_qparams(cols, scheme, gscale)
                    scale_g[:, j // g] = s_new
                    if zero_g is not None:
                        zero_g[:, j // g] = z_new
                s = scale_g[:, j // g]
                z = None if zero_g is None else zero_g[:, j // g]
            if scheme.is_float:  # fp8 / fp4: the nearest value of the float grid (saturating), not an integer
                q = cast_float(col / s, scheme.dtype).to(dtype)
            else:
                q = torch.round(col / s) + (z if z is not None else 0)
                q = torch.clamp(q, scheme.qmin, scheme.qmax)
            deq = (q - (z if z is not None else 0)) * s
            err = (col - deq) / h_inv[j, j]
            W[:, j:i2] -= err[:, None] * h_inv[j, j:i2][None, :]  # [N, i2 - j]
            W[:, j] = q  # column j is final: its slot now holds the code
            err_block[:, j - i1] = err
        W[:, i2:] -= err_block @ h_inv[i1:i2, i2:]  # lazy update of the remaining columns

    del h_inv, H, hessian  # the [K, K] buffer is free before the codes are packed
    codes = W  # integer codes (or float8 values) held in the working dtype, exactly
    if perm is not None:
        _permute_columns_(codes, torch.argsort(perm))
    if static:
        scale, zero = scale_full, zero_full
    else:
        scale, zero = scale_g, zero_g
    if scheme.dtype == "fp4_e2m1":
        return QuantizedTensor.from_codes(codes.float(), scale.float(), None, scheme, gscale)
    if scheme.is_float:
        return QuantizedTensor.from_codes(codes.to(FP8_DTYPES[scheme.dtype]), scale.float(), None, scheme, gscale)
    return QuantizedTensor.from_codes(codes, scale.float(), None if zero is None else zero.float(), scheme)


def _table(p: Tensor, scheme: QuantScheme, n_rows: int) -> Tensor:
    """Per-group (or per-channel / per-tensor) parameters as a table with one column per group, in float32 (the
    precision the stored scales keep)."""
    if scheme.granularity == "tensor":
        return p.reshape(1, 1).float()
    if scheme.granularity == "channel":
        return p.reshape(n_rows, 1).float()
    return p.float()
