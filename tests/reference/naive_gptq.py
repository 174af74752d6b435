"""Naive GPTQ: the OBQ-style column-by-column update with an explicit inverse Hessian, in float64.

For each column q (in order): quantize it, spread its error over the remaining columns with
H^-1[q, :] / H^-1[q, q], then remove q from H^-1 (Schur complement). No Cholesky, no lazy blocks:
mathematically the same as the blocked Cholesky form in compress/quantizers/gptq.py.
"""
from __future__ import annotations

import torch

from tests.reference.naive import naive_quantize


def naive_gptq(w, h, bits: int, group_size: int | None, symmetric: bool, damp: float = 0.01,
               act_order: bool = False):
    W = w.double().clone()
    H = h.double().clone()
    n, k = W.shape
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    for c in range(k):
        if H[c, c] == 0:
            H[c, c] = 1.0
            W[:, c] = 0.0
    gran = "group" if group_size else "channel"
    col_scale = torch.zeros(n, k, dtype=torch.float64)
    col_zero = torch.zeros(n, k, dtype=torch.float64)
    static = act_order or group_size is None
    if static:
        _, s, z = naive_quantize(W.float(), bits, gran, group_size, symmetric)
        for c in range(k):
            g = c // group_size if group_size else 0
            col_scale[:, c] = s[:, g].double()
            if z is not None:
                col_zero[:, c] = z[:, g].double()
    order = list(range(k))
    if act_order:
        order = torch.argsort(torch.diag(H), descending=True).tolist()
    H = H + damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(H)
    remaining = list(order)
    codes = torch.zeros(n, k, dtype=torch.int64)
    for pos, q in enumerate(order):
        if not static and q % group_size == 0:
            _, s, z = naive_quantize(W[:, q:q + group_size].float(), bits, "channel", None, symmetric)
            for c in range(q, q + group_size):
                col_scale[:, c] = s[:, 0].double()
                col_zero[:, c] = 0.0 if z is None else z[:, 0].double()
        for r in range(n):
            s, z = col_scale[r, q], col_zero[r, q]
            code = min(max(torch.round(W[r, q] / s).item() + z.item(), qmin), qmax)
            codes[r, q] = int(code)
            err = (W[r, q] - (code - z) * s) / hinv[q, q]
            for c in remaining[pos + 1:]:
                W[r, c] -= err * hinv[q, c]
        # drop q from the inverse Hessian (Schur complement)
        hinv = hinv - torch.outer(hinv[:, q], hinv[q, :]) / hinv[q, q]
    return codes
