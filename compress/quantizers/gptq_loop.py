"""GPTQ's inner column loop on an integer grid, compiled with TorchScript where torch can, so that it runs without
Python between its operations.

A lazy-update block is 128 columns, each about ten small operations on one row of the transposed block; a 7B block
has ~36,000 columns. Run from Python, every operation takes the interpreter lock, and two workers solving two
layers at once (stages/quantize.py on a CPU of more than one thread) hand the lock back and forth: on the 2-core
Xeon, two concurrent 128 x 4096 blocks took 2.1x one block's time from Python, 1.2x compiled (and one block alone
1.3x less compiled). The compiled function runs the same aten operations in the same order as the Python one, bit
for bit (tested); where scripting is not available the Python function runs.

Each column's error reaches the block's later columns as one fused multiply-add per value (addcmul_), where the
plain form (tests/reference/gptq_plain.py) multiplies, rounds, then subtracts: one rounding instead of two, half
the passes over the block (2.1-2.6x faster loop). So the codes are not bit for bit the plain form's: a value that
lands within float32 rounding of a grid midpoint may round the other way. On the test problems 0 to 0.05% of the
codes moved, each by one step (tests/test_gptq_loop.py bounds it).
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor


def integer_block(wt: Tensor, et: Tensor, s_t: Tensor, z_t: Optional[Tensor], hb: Tensor, qmin: float,
                  qmax: float) -> None:
    """The columns of one lazy-update block on fixed integer grids (gptq.py's static groups): `wt` [B, N] the block
    transposed (a column per row), `et` [B, N] receives each column's error (w - Q(w)) / d, `s_t` / `z_t` [B, N or 1]
    each column's scale and zero point (None: symmetric), `hb` [B, B] the block of the inverse-Hessian factor. Each
    row of `wt` becomes its column's integer codes; the later rows take the error of the earlier ones."""
    b = wt.shape[0]
    for jj in range(b):
        col = wt[jj]
        q = torch.round(col / s_t[jj])
        if z_t is not None:
            z = z_t[jj]
            q += z
            q.clamp_(qmin, qmax)
            deq = (q - z) * s_t[jj]
        else:
            q.clamp_(qmin, qmax)
            deq = q * s_t[jj]
        torch.sub(col, deq, out=et[jj])
        et[jj].div_(hb[jj, jj])
        if jj + 1 < b:
            wt[jj + 1:].addcmul_(hb[jj, jj + 1:, None], et[jj], value=-1.0)  # one rounding per value: see above
        wt[jj] = q


@functools.cache
def compiled_integer_block() -> Callable:
    """integer_block compiled by torch.jit.script, or integer_block itself where that fails (a torch without
    TorchScript, sources not shipped)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice: nothing the user can act on
            return torch.jit.script(integer_block)
    except Exception:  # noqa: BLE001 - any failure to compile leaves the Python function, the same computation
        return integer_block
