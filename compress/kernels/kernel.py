"""Kernel: the one record every matmul kernel is registered as (CPU ones in dispatch.py, CUDA ones in gpu.py).
Its own module so that gpu.py and dispatch.py both read it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Kernel:
    """A matmul for one family of quantized layers: `reason(layer, dtype, device)` says why it cannot run a
    QuantLinear (None: it can), `prepare(layer, dtype)` builds its operands once per layer, `run(state, x, bias)`
    computes y = x W^T + b.

    `rows`: the batch sizes (rows of x, M) the kernel is meant for, (lo, hi) inclusive, hi None for no upper bound;
    None: any. It decides nothing where the dispatcher measures (every usable kernel is timed at every size); it is
    the choice where it does not (plan_dispatch(measure=False) takes, per row-count bucket, the first usable kernel
    meant for it) and beyond the largest measured size (see dispatch.plan_dispatch)."""
    name: str
    reason: Callable[[Any, torch.dtype, torch.device], str | None]
    prepare: Callable[[Any, torch.dtype], Any]
    run: Callable[[Any, Tensor, Tensor | None], Tensor]
    rows: tuple[int, int | None] | None = None
    trellis: bool = False  # reads trellis codes (a TrellisLinear's tiles), not a grid's codes

    def __post_init__(self):
        if self.rows is not None:
            lo, hi = self.rows
            if lo < 1 or (hi is not None and hi < lo):
                raise ValueError(f"Kernel {self.name!r}: rows={self.rows} must be (lo, hi) with 1 <= lo <= hi, "
                                 "or (lo, None) for no upper bound")

    def meant_for(self, rows: float) -> bool:
        """Whether `rows` (math.inf: every size above some bound) is in the kernel's range."""
        if self.rows is None:
            return True
        lo, hi = self.rows
        return lo <= rows and (hi is None or rows <= hi)
