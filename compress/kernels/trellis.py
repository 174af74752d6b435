"""ctypes bindings of trellis.c: the Viterbi encoder of trellis codes and their few-row decode matmul (built on first
use into the compress cache, like cpu_rows.c; RowsUnavailable with the reason where it cannot be). `fmt` is a
core.trellis.TrellisFormat and `cb` its codebook. KERNEL is the dispatcher's kernel for TrellisLinear layers."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from ..core.hadamard import rotate_by
from ..core.trellis import codebook
from .cpu_rows import MAX_ROWS, RowsUnavailable, build
from .kernel import Kernel

SOURCE = Path(__file__).with_name("trellis.c")


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    path = build(SOURCE, "trellis kernels")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise RowsUnavailable(f"loading {path} failed: {e}") from e
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.compress_trellis_viterbi.argtypes = [p, p, i64, i64, i64, i64, p, p, p]
    lib.compress_trellis_rows.argtypes = [p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64]
    lib.compress_trellis_viterbi.restype = lib.compress_trellis_rows.restype = ctypes.c_int
    return lib


def viterbi(target: Tensor, fmt, cb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The walks nearest each row of target [S, T] (float, in codebook units): (start int32 [S], steps uint8
    [S, T - 1], squared error float32 [S]). Exact (dynamic programming over all 2^L states)."""
    x = target.detach().float().cpu().contiguous()
    s, t = x.shape
    if t != fmt.steps:
        raise ValueError(f"trellis walks of {fmt.steps} steps, got rows of {t}")
    cb = cb.float().cpu().contiguous()
    start = torch.empty(s, dtype=torch.int32)
    steps = torch.empty(s, max(t - 1, 1), dtype=torch.uint8)
    err = torch.empty(s, dtype=torch.float32)
    rc = load().compress_trellis_viterbi(x.data_ptr(), cb.data_ptr(), s, t, fmt.state_bits, fmt.bits,
                                         start.data_ptr(), steps.data_ptr(), err.data_ptr())
    if rc:
        raise MemoryError("the trellis encoder could not allocate its back pointers") if rc == 2 else \
            ValueError(f"bad trellis arguments: {fmt}")
    return start, steps[:, :t - 1], err


def trellis_rows(x: Tensor, qdata: Tensor, scale: Tensor, fmt, cb: Tensor, out_features: int) -> Tensor:
    """y = x @ (diag(scale) · C)ᵀ for 1..16 rows of float32 x [M, n], the tiles decoded as they are read (the rotated
    basis: the caller rotates x in and y out)."""
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    m, n = x2.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the trellis rows kernel takes 1..{MAX_ROWS} rows (got {m})")
    cb, sc = cb.float().contiguous(), scale.float().reshape(-1).contiguous()
    y = torch.empty(m, out_features)
    rc = load().compress_trellis_rows(x2.data_ptr(), qdata.contiguous().data_ptr(), fmt.tile_bytes, cb.data_ptr(),
                                      sc.data_ptr(), y.data_ptr(), m, out_features, n, fmt.state_bits, fmt.bits,
                                      fmt.tile)
    if rc:
        raise MemoryError("the trellis rows kernel could not allocate its tile buffers") if rc == 2 else \
            ValueError(f"bad trellis rows arguments ({m} rows, {out_features} x {n}, {fmt})")
    return y


def _rows_reason(layer, dtype: torch.dtype, device) -> str | None:
    if device.type != "cpu":
        return "a CPU kernel (no CUDA trellis decoder yet: dequantize+matmul there)"
    if dtype != torch.float32:
        return f"float32 activations (got {str(dtype).replace('torch.', '')})"
    try:
        load()
    except RowsUnavailable as e:
        return str(e)
    return None


def _rows_run(layer, x: Tensor, bias: Tensor | None) -> Tensor:
    """y = x Wᵀ + b for a TrellisLinear: x rotated in (x·Q_in), the tiles decoded as they are read, 16 rows at a time,
    and y rotated out (·Q_outᵀ)."""
    fmt, n = layer.trellis, layer.out_features
    xr = rotate_by(x.reshape(-1, x.shape[-1]), layer.signs_in)
    cb = codebook(fmt)
    y = torch.cat([trellis_rows(xr[i:i + MAX_ROWS], layer.qdata, layer.scale, fmt, cb, n)
                   for i in range(0, xr.shape[0], MAX_ROWS)])
    y = rotate_by(y, layer.signs_out, transpose=True).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias


# the dispatcher's kernel for TrellisLinear layers (kernels/dispatch.py): meant for decoding's few rows
KERNEL = Kernel("compress trellis rows (CPU)", _rows_reason, lambda layer, dtype: layer, _rows_run,
                rows=(1, MAX_ROWS), trellis=True)
