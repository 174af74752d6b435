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
    computes y = x W^T + b."""
    name: str
    reason: Callable[[Any, torch.dtype, torch.device], str | None]
    prepare: Callable[[Any, torch.dtype], Any]
    run: Callable[[Any, Tensor, Tensor | None], Tensor]
