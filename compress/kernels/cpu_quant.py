"""ctypes bindings of cpu_quant.c: round-to-nearest fake quantization of float32 weights by groups, one pass over
each row (built on first use into the compress cache, like cpu_rows.c). `fake_quantize_rows` returns None where the
kernel does not apply (a scheme other than integer codes by group or channel, a tensor not on the CPU, no C
compiler): the caller then uses torch's operations, which give the same values."""
from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch
from torch import Tensor

from ..core.scheme import QuantScheme
from .cpu_rows import RowsUnavailable, build

SOURCE = Path(__file__).with_name("cpu_quant.c")
SCALE_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}
MAX_GROUP = 4096


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built or loaded here (the torch path is used then)."""
    try:
        lib = ctypes.CDLL(str(build(SOURCE, "fake-quantization kernel")))
    except (RowsUnavailable, OSError):
        return None
    p, i64, c_int, c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.compress_fake_quant.argtypes = [p, p, p, p, i64, i64, i64, c_int, c_float, c_float, c_int, p, c_int]
    lib.compress_autoround_round.argtypes = [p, p, p, p, i64, i64, c_float, c_float, p, c_int, p, p]
    lib.compress_sign_step.argtypes = [p, p, i64, c_float, c_float]
    for f in (lib.compress_fake_quant, lib.compress_autoround_round, lib.compress_sign_step):
        f.restype = c_int
    return lib


def in_bands(n: int, threads: int, work, least: int = 64) -> None:
    """work(start, count) over [0, n) cut into up to `threads` bands of at least `least` items, each band on its own
    thread (a C call leaves Python's lock), the first on the caller's; raises if any band's call returned non-zero."""
    bands = max(1, min(threads, n // least))
    edges = [n * i // bands for i in range(bands + 1)]
    codes = [0] * bands

    def band(i: int) -> None:
        codes[i] = work(edges[i], edges[i + 1] - edges[i])

    helpers = [threading.Thread(target=band, args=(i,)) for i in range(1, bands)]
    for t in helpers:
        t.start()
    band(0)
    for t in helpers:
        t.join()
    if any(codes):
        raise ValueError("cpu_quant.c rejected its arguments")


def applies(w: Tensor, scheme: QuantScheme) -> bool:
    """Whether the kernel computes fake_quantize(w, scheme): integer codes with scales per group or per output row,
    no per-tensor scale, a float32 scale dtype or one of the 16-bit ones, a float32 [out, in] tensor on the CPU."""
    group = scheme.group_size if scheme.granularity == "group" else w.shape[-1] if w.dim() == 2 else 0
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and not scheme.is_float
            and not scheme.is_micro and not scheme.has_global_scale and scheme.granularity in ("group", "channel")
            and scheme.scale_dtype in SCALE_KINDS and 0 < group <= MAX_GROUP and w.shape[1] % group == 0)


def fake_quantize_rows(w: Tensor, scheme: QuantScheme, colmul: Tensor | None = None,
                       out: Tensor | None = None, threads: int = 1, clip: tuple[Tensor, Tensor] | None = None,
                       minus_w: bool = False) -> Tensor | None:
    """fake_quantize(w * colmul, scheme) / colmul (colmul [in] float32, None: 1) for float32 w [out, in] on the CPU,
    written into `out` (float32 or bfloat16 [out, in], contiguous; None: a new float32 tensor) and returned; the
    values are torch's bit for bit. `clip` (lo, hi), each [out, groups]: each group clamped to its range first
    (torch.minimum(torch.maximum(w, lo), hi), AWQ's clipping search); `minus_w`: the result minus w (float32, the
    search's error). `threads` > 1: the rows are cut into that many bands, each computed on its own thread (the call
    leaves Python's lock; the rows are independent, so the values are the same). None where the kernel does not
    apply (`applies`) or is not available."""
    if not applies(w, scheme) or (lib := load()) is None:
        return None
    w = w.contiguous()
    rows, cols = w.shape
    group = scheme.group_size if scheme.granularity == "group" else cols
    if colmul is not None:
        colmul = colmul.float().contiguous()
        if colmul.shape != (cols,) or colmul.device.type != "cpu":
            raise ValueError(f"colmul must be a CPU vector of {cols} values, got {tuple(colmul.shape)}")
    if clip is not None:
        clip = tuple(c.float().contiguous() for c in clip)
        if any(c.shape != (rows, cols // group) for c in clip):
            raise ValueError(f"clip ranges must be [{rows}, {cols // group}] each")
    if out is None:
        out = torch.empty(w.shape, dtype=torch.float32)
    if out.shape != w.shape or not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16) or \
            (minus_w and out.dtype != torch.float32):
        raise ValueError("out must be a contiguous float32 (or, without minus_w, bfloat16) tensor of w's shape")
    mode = 2 if minus_w else int(out.dtype == torch.bfloat16)
    groups = cols // group

    def band(r0: int, n: int) -> int:
        return lib.compress_fake_quant(
            w.data_ptr() + r0 * cols * 4, None if colmul is None else colmul.data_ptr(),
            None if clip is None else clip[0].data_ptr() + r0 * groups * 4,
            None if clip is None else clip[1].data_ptr() + r0 * groups * 4, n, cols, group,
            int(scheme.symmetric), float(scheme.qmin), float(scheme.qmax), SCALE_KINDS[scheme.scale_dtype],
            out.data_ptr() + r0 * cols * out.element_size(), mode)

    in_bands(rows, threads, band)
    return out


def autoround_round(values: Tensor, v: Tensor, scale: Tensor, zero: Tensor | None, qmin: float, qmax: float,
                    dtype: torch.dtype, threads: int = 1) -> tuple[Tensor, Tensor, Tensor] | None:
    """AutoRound's rounding of one weight (quantizers/autoround.rounding_forward's element-wise part): values and V
    [..., G] float32 in the same contiguous layout, the groups' scale and zero point [...] (zero None: symmetric).
    Returns (the rounded weight in `dtype`, float32 or bfloat16; the codes' inside mask; the scale gradient's
    factor), each of values' shape, torch's bits; None where the kernel does not apply (another layout, not on the
    CPU) or is not available."""
    tensors = [values, v, scale] + ([zero] if zero is not None else [])
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or \
            v.shape != values.shape or scale.shape != values.shape[:-1] or \
            (zero is not None and zero.shape != scale.shape) or (lib := load()) is None:
        return None
    group, groups = values.shape[-1], scale.numel()
    hat = torch.empty(values.shape, dtype=dtype)
    inside, ds_factor = torch.empty_like(values), torch.empty_like(values)

    def band(g0: int, n: int) -> int:
        at = g0 * group * 4
        return lib.compress_autoround_round(
            values.data_ptr() + at, v.data_ptr() + at, scale.data_ptr() + g0 * 4,
            None if zero is None else zero.data_ptr() + g0 * 4, n, group, float(qmin), float(qmax),
            hat.data_ptr() + g0 * group * hat.element_size(), int(dtype == torch.bfloat16), inside.data_ptr() + at,
            ds_factor.data_ptr() + at)

    in_bands(groups, threads, band, least=max(1, 4096 // group))
    return hat, inside, ds_factor


def sign_step_rows(v: Tensor, grad: Tensor, lr: float, bound: float, threads: int = 1) -> bool:
    """v = clamp(v - lr * sign(grad), -bound, bound) in place (AutoRound's SignSGD step on V), torch's bits, for
    contiguous float32 CPU tensors of one shape; False (nothing done) where the kernel does not apply."""
    if v.device.type != "cpu" or grad.device.type != "cpu" or v.dtype != torch.float32 or \
            grad.dtype != torch.float32 or not v.is_contiguous() or not grad.is_contiguous() or \
            v.shape != grad.shape or (lib := load()) is None:
        return False
    in_bands(v.numel(), threads, lambda i0, n: lib.compress_sign_step(
        v.data_ptr() + i0 * 4, grad.data_ptr() + i0 * 4, n, float(lr), float(bound)), least=4096)
    return True
