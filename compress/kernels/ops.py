"""The public ops of the CUDA kernels, registered with torch.library: `compress::w4a16_gemm`,
`compress::fp8_gemm`, `compress::fp8_quantize_rows`, `compress::w4a16_dequant`.

Every op checks its inputs here (dtype, device, shapes, contiguity, divisibility; the messages carry the values),
runs the CUDA kernel on CUDA tensors (cuda_ext.py builds it on first use) and the pure-torch reference on any other
device, and has a fake (meta) implementation, so `torch.compile` traces through it and `torch.library.opcheck`
tests it on CPU. The reference of w4a16_gemm reads the packed weight the way the kernel does
(prepack.emulate_w4a16_codes), so the CPU path also exercises the layout.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import cuda_ext
from .prepack import BK, emulate_w4a16_codes, w4a16_dequant_supported, w4a16_splits, w4a16_supported
from .fp8_layout import fp8_supported
from .w4a16_v2 import emulate_w4a16_v2_gemm, used_splits, w4a16_v2_splits, w4a16_v2_supported

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
HALF = (torch.float16, torch.bfloat16)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_w4a16(x: Tensor, wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, group_size: int,
                splits: int = 0) -> None:
    _need(x.dim() == 2, f"w4a16_gemm: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    _need(0 <= splits <= max(k // BK, 1),
          f"w4a16_gemm: splits={splits} must be 0 (automatic) or 1..K/{BK} = {k // BK} (split-K ranges)")
    _need(x.dtype in HALF, f"w4a16_gemm: x must be float16 or bfloat16, got {x.dtype}")
    why = w4a16_supported(max(m, 1), n, k, group_size)
    _need(why is None, f"w4a16_gemm: {why}")
    _need(wq.dtype == torch.int32 and wq.numel() * 8 == n * k,
          f"w4a16_gemm: wq must be int32 with N*K/8 = {n * k // 8} elements, got {wq.dtype} with {wq.numel()}")
    groups = 1 if group_size == -1 else k // group_size
    _need(tuple(scales.shape) == (groups, n) and scales.dtype == x.dtype,
          f"w4a16_gemm: scales must be [{groups}, {n}] {x.dtype}, got {tuple(scales.shape)} {scales.dtype}")
    if zeros is not None:
        _need(tuple(zeros.shape) == (groups, n) and zeros.dtype == x.dtype,
              f"w4a16_gemm: zeros must be [{groups}, {n}] {x.dtype}, got {tuple(zeros.shape)} {zeros.dtype}")
    for name, t in (("x", x), ("wq", wq), ("scales", scales), ("zeros", zeros)):
        if t is not None:
            _need(t.is_contiguous(), f"w4a16_gemm: {name} must be contiguous (strides {t.stride()})")
            _need(t.device == x.device, f"w4a16_gemm: {name} is on {t.device}, x on {x.device}")


@torch.library.custom_op("compress::w4a16_gemm", mutates_args=())
def w4a16_gemm(x: Tensor, wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, group_size: int,
               splits: int = 0) -> Tensor:
    """out[M, N] = x[M, K] @ W^T, W[n, k] = (u - z) * s per group; wq from prepack.prepack_w4a16. `splits`: split-K
    count on CUDA (0: prepack.w4a16_splits picks it for the device; 1: none). Reference path (non-CUDA devices):
    decode the codes as the kernel reads them, dequantize, matmul in float32 (splits only checked)."""
    check_w4a16(x, wq, scales, zeros, n, group_size, splits)
    k = x.shape[1]
    g = k if group_size == -1 else group_size
    u = emulate_w4a16_codes(wq.cpu(), n, k).to(x.device).float()  # [N, K]
    z = 8.0 if zeros is None else zeros.float().t().repeat_interleave(g, 1)
    w = (u - z) * scales.float().t().repeat_interleave(g, 1)
    return (x.float() @ w.t()).to(x.dtype)


@w4a16_gemm.register_fake
def _(x, wq, scales, zeros, n, group_size, splits=0):
    check_w4a16(x, wq, scales, zeros, n, group_size, splits)
    return x.new_empty(x.shape[0], n)


@w4a16_gemm.register_kernel("cuda")
def _(x, wq, scales, zeros, n, group_size, splits=0):
    check_w4a16(x, wq, scales, zeros, n, group_size, splits)
    return launch_w4a16(x, wq, scales, zeros, n, group_size, splits)


# The launch_* functions are the CUDA implementations of the ops above minus the op's dispatch and input checks (about
# 25 us of Python a call on this project's CPU VM, more than a decode-sized kernel takes on an H200). The registered
# CUDA implementations check, then call them; gpu.py's layers call them directly in eager mode, on operands their
# prepare step built and checked once (torch.compile traces the ops instead).
def launch_w4a16(x: Tensor, wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, group_size: int,
                 splits: int = 0) -> Tensor:
    ext = cuda_ext.load()
    if not ext.ok:
        raise RuntimeError(f"compress::w4a16_gemm: {ext.reason}")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    m, k = x.shape
    if splits == 0:
        splits = _auto_splits(m, n, k, x.device.index if x.device.index is not None else torch.cuda.current_device())
    workspace = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else None
    with torch.cuda.device(x.device):
        status = torch.ops.compress_cuda.w4a16_gemm(x, wq, scales, zeros, out, workspace, group_size, splits,
                                                   torch.cuda.current_stream().cuda_stream)
    _status("w4a16_gemm", status, x.shape[0], n, x.shape[1])
    return out


@functools.lru_cache(maxsize=4096)
def _auto_splits(m: int, n: int, k: int, device: int) -> int:
    """prepack.w4a16_splits for this CUDA device (memoised: a decode step asks for the same shapes every token)."""
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 100 * 1024  # the smallest sm_8x figure
    return w4a16_splits(m, n, k, props.multi_processor_count, smem)


def _status(op: str, status: int, m: int, n: int, k: int) -> None:
    if status == 1:
        raise ValueError(f"{op}: the kernel does not support M={m}, N={n}, K={k} on this device "
                         "(alignment or architecture); the dispatcher should have taken the reference path")
    if status != 0:
        raise RuntimeError(f"{op}: CUDA launch failed (status {status}) for M={m}, N={n}, K={k}")


# ---- W4A16 version 2: the decode kernel (cuda/w4a16_v2.cu), 1 <= M <= 16, on version 1's operands -------------------
PDL_ENV = "COMPRESS_W4A16_PDL"  # "1": launch version 2 as a programmatic dependent (sm_90); off until measured


def check_w4a16_v2(x: Tensor, wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, group_size: int,
                   splits: int = 0) -> None:
    check_w4a16(x, wq, scales, zeros, n, group_size, 0)
    m, k = x.shape
    _need(0 <= splits <= k // BK, f"w4a16_gemm_v2: splits={splits} must be 0 (automatic) or 1..K/{BK} = {k // BK}")
    why = w4a16_v2_supported(m, n, k, group_size, max(splits, 1) if m else 1)
    _need(m == 0 or why is None, f"w4a16_gemm_v2: {why}")


@torch.library.custom_op("compress::w4a16_gemm_v2", mutates_args=())
def w4a16_gemm_v2(x: Tensor, wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, group_size: int,
                  splits: int = 0) -> Tensor:
    """The W4A16 decode kernel (version 2): the same operands and result as w4a16_gemm, for 1 <= M <= 16 (version 1
    takes larger M). `splits`: split-K count on CUDA (0: w4a16_v2.w4a16_v2_splits picks it). Reference path
    (non-CUDA devices): the kernel's emulation (w4a16_v2.emulate_w4a16_v2_gemm), which reads the packed words,
    x's swizzled copy and the per-group fold as the kernel does."""
    check_w4a16_v2(x, wq, scales, zeros, n, group_size, splits)
    if x.shape[0] == 0:
        return x.new_empty(0, n)
    k = x.shape[1]
    packed = {"wq": wq.cpu(), "scales": scales.cpu(), "zeros": None if zeros is None else zeros.cpu(), "N": n, "K": k,
              "group_size": group_size}
    return emulate_w4a16_v2_gemm(x.cpu(), packed, max(splits, 1)).to(x.device)


@w4a16_gemm_v2.register_fake
def _(x, wq, scales, zeros, n, group_size, splits=0):
    check_w4a16_v2(x, wq, scales, zeros, n, group_size, splits)
    return x.new_empty(x.shape[0], n)


@w4a16_gemm_v2.register_kernel("cuda")
def _(x, wq, scales, zeros, n, group_size, splits=0):
    check_w4a16_v2(x, wq, scales, zeros, n, group_size, splits)
    return launch_w4a16_v2(x, wq, scales, zeros, n, group_size, splits)


_TICKETS: dict[int, Tensor] = {}  # per CUDA device: the split-K tickets every launch leaves zeroed


def _tickets(device: torch.device, n: int) -> Tensor:
    """The device's zeroed int32 tickets, at least ceil(n / 256) of them (grown, never shrunk). One array a device:
    version 2 launches that use it must not overlap, as on one stream (a decode loop, a CUDA graph)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    need = -(-n // 256)
    have = _TICKETS.get(idx)
    if have is None or have.numel() < need:
        have = torch.zeros(max(need, 1024), dtype=torch.int32, device=device)
        _TICKETS[idx] = have
    return have


def launch_w4a16_v2(x: Tensor, wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, group_size: int,
                    splits: int = 0, pdl: Optional[bool] = None) -> Tensor:
    """The CUDA path of w4a16_gemm_v2 without the op's checks. pdl: launch as a programmatic dependent of the previous
    kernel in the stream (sm_90; None: COMPRESS_W4A16_PDL)."""
    ext = cuda_ext.load()
    if not ext.ok:
        raise RuntimeError(f"compress::w4a16_gemm_v2: {ext.reason}")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    m, k = x.shape
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if splits == 0:
        splits = _auto_splits_v2(m, n, k, group_size, dev)
    used = used_splits(k, splits)
    workspace = torch.empty(used, m, n, dtype=torch.float32, device=x.device) if used > 1 else None
    tickets = _tickets(x.device, n) if used > 1 else None
    with torch.cuda.device(x.device):
        status = torch.ops.compress_cuda.w4a16_v2_gemm(x, wq, scales, zeros, out, workspace, tickets, group_size,
                                                      used, _pdl() if pdl is None else int(pdl),
                                                      torch.cuda.current_stream().cuda_stream)
    _status("w4a16_gemm_v2", status, m, n, k)
    return out


@functools.lru_cache(maxsize=1)
def _pdl() -> int:
    import os
    return 1 if os.environ.get(PDL_ENV, "0") == "1" else 0


@functools.lru_cache(maxsize=4096)
def _auto_splits_v2(m: int, n: int, k: int, group_size: int, device: int) -> int:
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 100 * 1024
    return w4a16_v2_splits(m, n, k, group_size, props.multi_processor_count, smem)


def check_fp8(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    _need(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
          f"fp8_gemm: a [M, K] and b [N, K] needed, got {tuple(a.shape)} and {tuple(b.shape)}")
    _need(a.dtype == FP8 and b.dtype == FP8, f"fp8_gemm: a and b must be float8_e4m3fn, got {a.dtype}, {b.dtype}")
    m, n = a.shape[0], b.shape[0]
    _need(a_scale.dtype == torch.float32 and a_scale.numel() in (1, m),
          f"fp8_gemm: a_scale must be float32 with 1 or M={m} elements, got {a_scale.dtype} with {a_scale.numel()}")
    _need(b_scale.dtype == torch.float32 and b_scale.numel() in (1, n),
          f"fp8_gemm: b_scale must be float32 with 1 or N={n} elements, got {b_scale.dtype} with {b_scale.numel()}")
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        _need(t.is_contiguous(), f"fp8_gemm: {name} must be contiguous (strides {t.stride()})")
        _need(t.device == a.device, f"fp8_gemm: {name} is on {t.device}, a on {a.device}")


@torch.library.custom_op("compress::fp8_gemm", mutates_args=())
def fp8_gemm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> Tensor:
    """out[M, N] bf16 = (a * a_scale) @ (b * b_scale)^T, a [M, K] and b [N, K] float8 e4m3, fp32 accumulation.
    Reference path: dequantize to float32 and matmul."""
    check_fp8(a, b, a_scale, b_scale)
    y = (a.float() * a_scale.reshape(-1, 1)) @ (b.float() * b_scale.reshape(-1, 1)).t()
    return y.to(torch.bfloat16)


@fp8_gemm.register_fake
def _(a, b, a_scale, b_scale):
    check_fp8(a, b, a_scale, b_scale)
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


@fp8_gemm.register_kernel("cuda")
def _(a, b, a_scale, b_scale):
    check_fp8(a, b, a_scale, b_scale)
    return launch_fp8_gemm(a, b, a_scale, b_scale)


def launch_fp8_gemm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> Tensor:
    ext = cuda_ext.load()
    if not ext.ok:
        raise RuntimeError(f"compress::fp8_gemm: {ext.reason}")
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    if a.shape[0] == 0:
        return out
    with torch.cuda.device(a.device):
        status = torch.ops.compress_cuda.fp8_gemm(a, b, a_scale, b_scale, out, torch.cuda.current_stream().cuda_stream)
    _status("fp8_gemm", status, a.shape[0], b.shape[0], a.shape[1])
    return out


def _check_rows(x: Tensor) -> None:
    _need(x.dim() == 2 and x.dtype in HALF, f"fp8_quantize_rows: x must be 2-D float16/bfloat16, got "
                                            f"{tuple(x.shape)} {x.dtype}")
    _need(x.is_contiguous(), f"fp8_quantize_rows: x must be contiguous (strides {x.stride()})")


@torch.library.custom_op("compress::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token e4m3: scale[m] = max(absmax / 448, 1e-12) (float32), q = saturate(x / scale)."""
    _check_rows(x)
    amax = x.float().abs().amax(dim=1)
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=1e-12)  # true division, as the kernel (fp8_layout)
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


@fp8_quantize_rows.register_fake
def _(x):
    _check_rows(x)
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], dtype=torch.float32)


@fp8_quantize_rows.register_kernel("cuda")
def _(x):
    _check_rows(x)
    return launch_fp8_quantize_rows(x)


def launch_fp8_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    ext = cuda_ext.load()
    if not ext.ok:
        raise RuntimeError(f"compress::fp8_quantize_rows: {ext.reason}")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        with torch.cuda.device(x.device):
            status = torch.ops.compress_cuda.fp8_quantize_rows(x, q, scale, torch.cuda.current_stream().cuda_stream)
        _status("fp8_quantize_rows", status, x.shape[0], 0, x.shape[1])
    return q, scale


# ---- W4A16 dequantization (cuda/dequant.cu): the large-batch path, dequantize into scratch then cuBLAS -----------
def check_w4a16_dequant(wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, k: int, group_size: int) -> None:
    why = w4a16_dequant_supported(n, k, group_size)
    _need(why is None, f"w4a16_dequant: {why}")
    _need(scales.dtype in HALF, f"w4a16_dequant: scales must be float16 or bfloat16 (the output dtype), got "
                                f"{scales.dtype}")
    _need(wq.dtype == torch.int32 and wq.numel() * 8 == n * k,
          f"w4a16_dequant: wq must be int32 with N*K/8 = {n * k // 8} elements, got {wq.dtype} with {wq.numel()}")
    groups = 1 if group_size == -1 else k // group_size
    _need(tuple(scales.shape) == (groups, n),
          f"w4a16_dequant: scales must be [K/G, N] = [{groups}, {n}], got {tuple(scales.shape)}")
    if zeros is not None:
        _need(tuple(zeros.shape) == (groups, n) and zeros.dtype == scales.dtype,
              f"w4a16_dequant: zeros must be [{groups}, {n}] {scales.dtype}, got {tuple(zeros.shape)} {zeros.dtype}")
    for name, t in (("wq", wq), ("scales", scales), ("zeros", zeros)):
        if t is not None:
            _need(t.is_contiguous(), f"w4a16_dequant: {name} must be contiguous (strides {t.stride()})")
            _need(t.device == wq.device, f"w4a16_dequant: {name} is on {t.device}, wq on {wq.device}")


@torch.library.custom_op("compress::w4a16_dequant", mutates_args=())
def w4a16_dequant(wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, k: int, group_size: int) -> Tensor:
    """The dense weight W [N, K] in scales' dtype from the W4A16 GEMM's operands (wq from prepack.prepack_w4a16,
    scales / zeros [K/G, N]; zeros None: z = 8): W[n, k] = (u - z) * s, rounded once. Reference path (non-CUDA
    devices): decode the codes as the kernels read them (prepack.emulate_w4a16_codes), compute in float32 (exact:
    an integer -15..15 times a 16-bit scale), round once to the dtype: bit-identical to the CUDA kernel."""
    check_w4a16_dequant(wq, scales, zeros, n, k, group_size)
    g = k if group_size == -1 else group_size
    u = emulate_w4a16_codes(wq.cpu(), n, k).to(wq.device).float()  # [N, K]
    z = 8.0 if zeros is None else zeros.float().t().repeat_interleave(g, 1)
    return ((u - z) * scales.float().t().repeat_interleave(g, 1)).to(scales.dtype)


@w4a16_dequant.register_fake
def _(wq, scales, zeros, n, k, group_size):
    check_w4a16_dequant(wq, scales, zeros, n, k, group_size)
    return scales.new_empty(n, k)


@w4a16_dequant.register_kernel("cuda")
def _(wq, scales, zeros, n, k, group_size):
    check_w4a16_dequant(wq, scales, zeros, n, k, group_size)
    return launch_w4a16_dequant(wq, scales, zeros, n, k, group_size)


def launch_w4a16_dequant(wq: Tensor, scales: Tensor, zeros: Optional[Tensor], n: int, k: int, group_size: int,
                         out: Optional[Tensor] = None) -> Tensor:
    """The CUDA kernel without the op's checks (see launch_w4a16). `out`: a caller-provided contiguous [N, K] buffer
    of scales' dtype on wq's device to write into (a reused scratch); None allocates one from torch's caching
    allocator. Returns the buffer written."""
    ext = cuda_ext.load()
    if not ext.ok:
        raise RuntimeError(f"compress::w4a16_dequant: {ext.reason}")
    if out is None:
        out = torch.empty(n, k, dtype=scales.dtype, device=wq.device)
    with torch.cuda.device(wq.device):
        status = torch.ops.compress_cuda.w4a16_dequant(wq, scales, zeros, out, group_size,
                                                      torch.cuda.current_stream().cuda_stream)
    if status == 1:
        raise ValueError(f"w4a16_dequant: the kernel does not support N={n}, K={k}, group_size={group_size} on this "
                         "device (alignment or architecture); the dispatcher should have taken another path")
    if status != 0:
        raise RuntimeError(f"w4a16_dequant: CUDA launch failed (status {status}) for N={n}, K={k}")
    return out


__all__ = ["w4a16_gemm", "w4a16_gemm_v2", "fp8_gemm", "fp8_quantize_rows", "w4a16_dequant", "check_w4a16",
           "check_w4a16_v2", "check_fp8", "check_w4a16_dequant", "fp8_supported"]
