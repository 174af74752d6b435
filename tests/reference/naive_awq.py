"""AWQ's scale search written out plainly: for r on the grid, s = mean|x|^r (AutoAWQ's duo scaling: / mean|w|^(1-r)),
normalised so that sqrt(max(s) * min(s)) = 1; each balance weight W becomes Q(W * s) / s (round-to-nearest from
naive.py, nothing from compress/); the first r with the least loss wins.

compress/ never imports this. The arithmetic that decides codes (W * s, s) is float32 like the library, so that the
rounding matches; the losses are the caller's (float64 in the tests)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from .naive import naive_dequantize, naive_quantize


def naive_fake_quantize(w: torch.Tensor, scheme) -> torch.Tensor:
    """Round-to-nearest and back, per naive.py's loops."""
    codes, scales, zeros = naive_quantize(w, scheme.bits, scheme.granularity, scheme.group_size, scheme.symmetric,
                                          scheme.scale_dtype)
    return naive_dequantize(codes, scales, zeros, scheme.granularity, scheme.group_size)


def naive_weight_mean(weights: list[torch.Tensor], group: int) -> torch.Tensor:
    """Duo scaling's mean|w| per input channel: |w| over its (row, group)'s max (+1e-6), averaged over all rows of
    all balance weights. [K]"""
    w = torch.cat([x.float() for x in weights]).abs()
    normed = torch.empty_like(w)
    for c0 in range(0, w.shape[1], group):
        g = w[:, c0:c0 + group]
        normed[:, c0:c0 + group] = g / (g.amax(dim=1, keepdim=True) + 1e-6)
    return normed.mean(dim=0)  # over all rows at once: the library's float32 sum order, so s keeps its bits

def naive_awq_search(x_mean: torch.Tensor, weights: list[torch.Tensor], scheme, n_grid: int,
                     loss_of: Callable[[list[torch.Tensor]], float], duo: bool = False):
    """Returns (s, r, loss, loss at r = 0, every r's loss) for the balance `weights` ([out, in] each), where
    loss_of(trial weights Q(W * s) / s) is the inspect module's output error."""
    group = scheme.group_size if scheme.granularity == "group" else weights[0].shape[1]
    w_mean = naive_weight_mean(weights, group) if duo else None
    losses, best = [], None
    for r in torch.linspace(0, 1, n_grid).tolist():  # the grid's values as the code spells them (float32 steps)
        s = x_mean.float() ** r
        if duo:
            s = s / (w_mean ** (1 - r) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / math.sqrt(float(s.max()) * float(s.min()))
        loss = loss_of([naive_fake_quantize(w.float() * s[None, :], scheme) / s[None, :] for w in weights])
        losses.append(loss)
        if best is None or loss < best[2]:
            best = (s, r, loss)
    return best[0], best[1], best[2], losses[0], losses
