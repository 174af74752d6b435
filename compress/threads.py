"""torch's CPU thread count: set for a run's phase (0 = all cores), or for a while and restored."""
from __future__ import annotations

import contextlib
import os

import torch


def set_threads(n: int) -> None:
    torch.set_num_threads(n if n > 0 else (os.cpu_count() or 1))


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch's CPU threads set to n for a while (0: all cores; None: unchanged)."""
    saved = torch.get_num_threads()
    if n is not None:
        set_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)
