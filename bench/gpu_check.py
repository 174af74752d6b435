"""One GPU run that builds the CUDA extension, checks every kernel against its float64 reference, and times it.

    python bench/gpu_check.py                 # on an H200: about 90 s (2026-12-04; --budget caps it), nothing to install
    python bench/gpu_check.py --dry-run       # on CPU: the same code paths on small shapes (the ops' reference
                                              # paths; its times mean nothing) - run by tests/test_gpu_check.py

The run is made so that a wrong kernel cannot pass and a crash cannot lose the run:

1. Processes. This parent never touches the GPU. It starts one child to build compress/kernels/cuda (torch's JIT
   `load()`, sm_90 as sm_90a; the build is cached in COMPRESS_CUDA_BUILD_DIR for the next children), then one child
   per kernel family (fp8_quantize, w4a16, fp8_gemm). A child writes a line to gpu_check.jsonl before each case
   ("start") and the case's row after it, flushed at once. When a child dies (a CUDA fault aborts the process or
   poisons its context) or hangs (no new line for --stall seconds), the parent writes a failed row for the case
   that was running, with the exit code and the last output lines, and starts a fresh child at the next case: a
   fault costs one row. Every step ends by the run's --budget (default 360 s), keeping time for the later steps;
   cases left when it runs out are recorded as not run (the run is then incomplete, not passed).
   gpu_check.json / .md are rewritten after every family from the .jsonl.
2. Correctness, every case on fresh random inputs (never zeros; the seed is recorded), every output allocation
   poisoned with NaN (torch's deterministic mode fills torch.empty), each case run twice. A case passes only if
   - the two runs agree bit for bit (else "nondeterministic (race?)");
   - the output is finite (an unwritten element stays NaN);
   - the whole-matrix relative error ||y - ref|| / ||ref|| is within TOL (KERNELS.md: 1e-3 for fp16 W4A16, 5e-3
     for bf16, 1e-2 for fp8), AND the worst 16x16 output tile (RMS of (y - ref) / row RMS of ref) is within
     TILE_TOL_FACTOR x TOL: one wrong tile of 4096x14336 moves the whole-matrix error by 1/480 of its own, AND
   - no element is off by more than ELEM_EPS 16-bit epsilons x (|ref| + row RMS) (`tile_errors`, `judge`).
   The reference is the float64 dequantize-then-matmul (W4A16: prepack.w4a16_reference; fp8: fp8_reference on the
   fp8 operands) and, for the quantize kernel, fp8_quantize_rows_reference, which must match bit for bit.
   Before trusting itself, each GEMM family plants an error of 2.5x the tile tolerance in one tile of a real
   output, and one wrong element, and fails if the checker misses either ("checker self-test").
3. Cases. W4A16: bf16 group 128 on the model shapes N x K = 4096x4096, 8192x8192, 14336x4096, 4096x14336 at
   M in MS; other formats (fp16, zero points, group 64 / 32 / per channel) on 4096x4096; every group size x zero
   point x dtype the kernel accepts on 576x1536; edge shapes: N not a multiple of 64 (96, 192, 4128: one-strip
   blocks), K not a multiple of the 128 k-tile (576, 200, 64: zero-padded by gpu.pack_w4a16, the path SmolLM2's
   layers take), at M in EDGE_MS (partial m16 / m32 / m64 tiles, not powers of two); split-K forced to uneven
   ranges, one k-tile a split and an empty last split (the timed rows take the automatic count, and also time the
   kernel unsplit); shapes the kernel must refuse (N % 32, group 16, K % group), where the refusal itself is
   checked. fp8: per-row x per-channel and per-tensor scales on the model shapes, the two mixed scale forms, partial N and K tiles (136x144, 4104x4112), the smallest
   shape (8x16), SmolLM2's layers and K = 200 (padded to 208) through gpu.linear_fp8 (our quantize + our GEMM, as a
   W8A8 layer runs), and N % 8 (refused). The per-token quantize kernel: bf16 / fp16, K from 16 to 20000 (the scalar
   kernel at K = 100, the vector kernel's register and loop paths), rows spanning 6 orders of magnitude and an
   all-zero row, bit for bit against its reference, timed at M = 4096.
4. Timing (cases that passed, model shapes only) with CUDA events, median of --repeats calls after warm-up, each
   replayed from a CUDA graph (no Python overhead) with L2 flushed before it (--flush: a 256 MiB read, default, or
   write; see Timer), against bf16
   `F.linear` (cuBLAS), the dequantize-then-matmul path, and for fp8 `torch._scaled_mm` (cuBLASLt), all in the
   same process. fp8 is timed as the GEMM alone and as the W8A8 layer (per-token quantize kernel + GEMM).
5. compute-sanitizer, when installed: memcheck and racecheck over a few small cases of every family in a separate
   child (torch's caching allocator off, so an overrun past a tensor is outside any allocation); a tool that cannot
   run on the device is recorded as such, not as a kernel failure.
6. The issue's bars, computed only for a kernel family with no failed case (else "not evaluated: kernel failed
   correctness"): W4A16 >= 3x bf16 at M <= 16 on 8192x8192; the dispatcher's choice (faster of our kernel and
   dequantize-then-matmul) never slower than bf16; fp8 W8A8 layer (quantize + GEMM) >= 1.5x bf16 at M = 4096, and
   the fp8 GEMM within 10% of torch._scaled_mm.

Results go to --out, else $OUT, else bench/results/gpu_check/: gpu_check.jsonl (every row as it happened),
gpu_check.json and gpu_check.md (summary, stamped with date, GPU, torch, CUDA, commit and seed), gpu_check.log (all
child output). Exit status 0 only when every case ran and passed. This file is longer than the style's 400 lines
because it must run alone on a machine where nothing can be fixed: the checker, the cases and the process
supervision are kept together.
"""
from __future__ import annotations

import argparse
import json
import os
import zlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.kernels import cuda_ext, gpu, ops  # noqa: E402
from compress.kernels.fp8_layout import (fp8_layer_supported, fp8_quantize_rows_reference,  # noqa: E402
                                         fp8_reference, fp8_supported)
from compress.kernels.prepack import GROUP_SIZES, padded_k, w4a16_layer_supported, w4a16_reference  # noqa: E402
from compress.kernels.prepack import w4a16_supported  # noqa: E402

FAMILIES = ("fp8_quantize", "w4a16", "fp8_gemm")
MS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)
QUICK_MS = (1, 16, 64, 4096)
EDGE_MS = (1, 3, 5, 17, 33, 63, 65, 127, 200)  # partial tiles of BM = 16 / 32 / 64 (W4A16) and 64 / 128 (fp8)
SHAPES = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336))  # (N, K): Llama-3-8B-like projections
DRY_SHAPES, DRY_MS, DRY_EDGE_MS = ((64, 256), (96, 128)), (1, 3, 16), (1, 3, 17, 65)
COMBO_SHAPE, DRY_COMBO_SHAPE = (576, 1536), (64, 256)  # all four group sizes divide K
COMBO_MS, DRY_COMBO_MS = (1, 17, 33, 65), (1, 17)

TILE = 16
TOL = {"float16": 1e-3, "bfloat16": 5e-3, "fp8": 1e-2}  # whole-matrix relative error (KERNELS.md)
# Spacing of the 16-bit output format at 1.0. The output rounding (half of it) and, for W4A16, the rounding of the
# dequantized weight to the activation dtype set the error floor: measured on kernel-like numerics (bf16 / fp16
# weight and output rounding, fp32 accumulation), whole-matrix 2.2e-3 (bf16) / 2.7e-4 (fp16), worst 16x16 tile
# 1.76x that (at M = 1, where a tile has 16 elements), worst element 0.86 eps x (|ref| + row RMS). The bounds
# below leave 2.5x (tile, against the whole-matrix error a passing kernel shows) and 4.6x (element) to spare.
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
TILE_TOL_FACTOR = 2.0
ELEM_EPS = 4.0
TINY = 1e-300
# The self-test plants 2.5x the tile tolerance into one tile: below the per-element bound for most elements, so
# only the tile check can catch it (bf16: 2.5% of the row RMS; the whole-matrix error hardly moves).
SELFTEST_TILE_FACTOR = 2.5

# Seconds. A child that writes no result line for STALL_TIMEOUT is taken for hung (the slowest case, the first of a
# model shape, packs the weight on the CPU and loads the extension: well under it); every step ends by the run's
# --budget, keeping RESERVE_PER_STEP for each later step; a sanitizer run gets at most SANITIZER_TIMEOUT.
STALL_TIMEOUT, SANITIZER_TIMEOUT, MIN_STEP, RESERVE_PER_STEP = 90, 90, 15, 20
MAX_RESTARTS, EXIT_RESTART = 6, 3
SANITIZER_REFUSALS = ("Device not supported", "Unable to find injection library")  # the tool cannot run here
NOT_EVALUATED = "not evaluated: kernel failed correctness"
SANITIZER_TOOLS = ("memcheck", "racecheck")  # racecheck: shared-memory hazards (all three kernels use shared memory)
KERNEL_SYMBOLS = {"w4a16": "w4a16_kernel", "fp8_gemm": "fp8_gemm_sm", "fp8_quantize": "fp8_quantize_rows"}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


# ----------------------------------------------------------------------------------------------------------------
# The checker
# ----------------------------------------------------------------------------------------------------------------
def tile_errors(y: Tensor, ref: Tensor, eps: float, tile: int = TILE) -> dict:
    """Errors of an output y [M, N] against its float64 reference.

    Each element's error is divided by its row's RMS of ref: the rounding errors (output and dequantized weight) are
    proportional to the size of the row's outputs, not to each element (an output near zero by cancellation still
    carries the rounding of the terms that cancelled), and rows differ in size (per-token activations span orders
    of magnitude), so one whole-matrix scale would hide errors in small rows.
    Returns rel_err (||y - ref|| / ||ref||, the old whole-matrix check), tile_err (the largest RMS of the normalised
    error over any tile x tile block; edge tiles count their real elements only) and worst_tile ([tile row, tile
    col]), bad (elements with |y - ref| > ELEM_EPS * eps * (|ref| + row RMS), NaN counted) and first_bad ([row,
    col] or None), finite (no NaN / inf in y)."""
    M, N = ref.shape
    ref = ref.double()
    d = y.double() - ref                                                    # [M, N]
    rms = ref.pow(2).mean(dim=1, keepdim=True).sqrt().clamp(min=TINY)      # [M, 1]
    finite = bool(torch.isfinite(y).all())
    rel = float(d.norm() / ref.norm().clamp(min=TINY)) if finite else float("inf")
    outside = ~(d.abs() <= ELEM_EPS * eps * (ref.abs() + rms))               # NaN compares False: counted as bad
    bad = int(outside.sum())
    first = None
    if bad:
        i = int(outside.flatten().nonzero()[0])
        first = [i // N, i % N]
    del outside
    e2 = (d / rms).pow(2).nan_to_num(nan=float("inf"))
    del d
    pm, pn = -M % tile, -N % tile
    sums = F.pad(e2, (0, pn, 0, pm)).reshape((M + pm) // tile, tile, (N + pn) // tile, tile).sum(dim=(1, 3))
    rows_in = torch.full((sums.shape[0],), float(tile), dtype=torch.float64, device=sums.device)
    cols_in = torch.full((sums.shape[1],), float(tile), dtype=torch.float64, device=sums.device)
    rows_in[-1], cols_in[-1] = tile - pm, tile - pn                         # partial edge tiles
    tile_rms = (sums / (rows_in[:, None] * cols_in[None, :])).sqrt()       # [M / 16, N / 16]
    worst = int(tile_rms.argmax())
    return {"rel_err": rel, "tile_err": float(tile_rms.flatten()[worst]),
            "worst_tile": [worst // tile_rms.shape[1], worst % tile_rms.shape[1]], "bad": bad, "first_bad": first,
            "finite": finite}


def differing(a: Tensor, b: Tensor) -> int:
    """Elements whose bits differ (NaN == NaN here: the same bits are the same result); all of them if the shapes
    differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(as_int) != b.contiguous().view(as_int)).sum())


def judge(y: Tensor, y_again: Tensor, ref: Tensor, tol: float, eps: float) -> dict:
    """Row fields of one GEMM case: tile_errors plus deterministic, ok and why (every reason it failed)."""
    e = tile_errors(y, ref, eps)
    diff = differing(y, y_again)
    why = []
    if not e["finite"]:
        why.append("NaN/inf in the output (poisoned memory left unwritten, or an overflow)")
    if e["rel_err"] > tol:
        why.append(f"relative error {e['rel_err']:.2e} > {tol:.0e}")
    if e["tile_err"] > TILE_TOL_FACTOR * tol:
        r, c = e["worst_tile"]
        why.append(f"tile {r},{c} (rows {r * TILE}.., cols {c * TILE}..) error {e['tile_err']:.2e} > "
                   f"{TILE_TOL_FACTOR * tol:.0e}")
    if e["bad"]:
        why.append(f"{e['bad']} element(s) off by more than {ELEM_EPS:g} eps x (|ref| + row RMS), first at "
                   f"{e['first_bad'][0]},{e['first_bad'][1]}")
    if diff:
        why.append(f"nondeterministic (race?): the two runs differ in {diff} element(s)")
    return {**e, "deterministic": diff == 0, "ok": not why, "why": why}


def plant_tile_error(y: Tensor, ref: Tensor, tile: tuple[int, int], size: float) -> Tensor:
    """A copy of y with `size` x its row's RMS of ref added to every element of one 16x16 tile."""
    out = y.clone()
    r, c = tile[0] * TILE, tile[1] * TILE
    rms = ref.double().pow(2).mean(dim=1, keepdim=True).sqrt()[r:r + TILE]
    out[r:r + TILE, c:c + TILE] = (out[r:r + TILE, c:c + TILE].double() + size * rms).to(y.dtype)
    return out


def checker_selftest(y: Tensor, ref: Tensor, tol: float, eps: float) -> list[str]:
    """Plant a tile error and one wrong element into a real (passing) output; the reasons the checker missed them."""
    missed = []
    tile = ((y.shape[0] - 1) // TILE, (y.shape[1] - 1) // TILE // 2)  # the last tile row: partial when M % 16
    size = SELFTEST_TILE_FACTOR * TILE_TOL_FACTOR * tol
    planted = plant_tile_error(y, ref, tile, size)
    found = judge(planted, planted, ref, tol, eps)
    # the tile check itself must name the tile (on a small output the whole-matrix check would fail it as well)
    if found["worst_tile"] != list(tile) or not any(w.startswith(f"tile {tile[0]},{tile[1]} ") for w in found["why"]):
        missed.append(f"an error of {size:.1e} x row RMS in tile {tile[0]},{tile[1]} was not flagged by the tile "
                      "check")
    one = y.clone()
    m, n = y.shape[0] // 2, y.shape[1] // 3
    one[m, n] = (one[m, n].double() + 0.5 * ref[m].double().pow(2).mean().sqrt()).to(y.dtype)
    if judge(one, one, ref, tol, eps)["bad"] != 1:
        missed.append(f"one element off by half its row RMS at {m},{n} was not counted")
    return missed


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
class Timer:
    """CUDA events around the call only; L2 flushed before each call (CPU: perf_counter, for --dry-run).

    On CUDA the call is captured once in a CUDA graph and replayed, so the events time the GPU work, not the Python
    around a custom op (input checks, allocation: tens of µs, more than a decode-sized GEMM). Calls that cannot be
    captured are timed directly; `graphed` counts which were.

    flush "read" (default) evicts the L2 by reading 256 MiB, which leaves it full of clean lines, as a decode step
    finds it after the previous layer's weights; "write" (the first GPU runs) writes 256 MiB, which leaves up to
    the L2's size of dirty lines whose write-back then competes with the timed call's reads - a cost real inference
    does not pay, and a larger share of a small (int4) call than of a large (bf16) one."""

    def __init__(self, device: torch.device, repeats: int, flush: str = "read"):
        if flush not in ("read", "write"):
            raise ValueError(f"flush={flush!r}: use 'read' or 'write'")
        self.device, self.repeats, self.mode = device, repeats, flush
        self.flush = torch.ones(32 * 2 ** 20, dtype=torch.int64, device=device) if device.type == "cuda" else None
        self.graphed = {"yes": 0, "no": 0}

    def _flush(self) -> None:
        if self.mode == "read":
            self.sink = self.flush.sum()  # reads every byte; the result stays on the GPU
        else:
            self.flush.zero_()

    def _graph(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except Exception:  # noqa: BLE001 - anything uncapturable is timed directly
            torch.cuda.synchronize()
            self.graphed["no"] += 1
            return fn
        self.graphed["yes"] += 1
        return graph.replay

    def __call__(self, fn) -> float:
        """Median microseconds."""
        fn()
        if self.flush is not None:
            fn = self._graph(fn)
        times = []
        for _ in range(self.repeats):
            if self.flush is not None:
                self._flush()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def run_twice(fn, device: torch.device):
    """fn() twice, with every torch.empty poisoned: in deterministic mode torch fills uninitialized memory with NaN
    (floats; the largest value for integers: torch.utils.deterministic.fill_uninitialized_memory), so an output
    element the kernel does not write stays NaN. warn_only: no op is refused, and the fills are not timed."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        outs = [fn(), fn()]
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    return outs


# ----------------------------------------------------------------------------------------------------------------
# Cases: the same list in the parent and in every child (a child is told where to start).
# ----------------------------------------------------------------------------------------------------------------
def _w4(n, k, dtype, group, zeros, ms, timed=False, refuse=False, splits=0) -> dict:
    return {"kernel": "w4a16", "N": n, "K": k, "dtype": dtype, "group": group, "zeros": zeros, "ms": ms,
            "timed": timed, "refuse": refuse, "splits": splits}


def _f8(n, k, scales, path, ms, timed=False, refuse=False) -> dict:
    return {"kernel": "fp8_gemm", "N": n, "K": k, "scales": scales, "path": path, "ms": ms, "timed": timed,
            "refuse": refuse}


# Order inside a family: the small correctness cases first (seconds in all), then the model shapes, whose timed rows
# feed the bars: if the budget runs out, what is lost is timing, not coverage.
def w4a16_specs(dry: bool, quick: bool) -> list[dict]:
    shapes, ms = (DRY_SHAPES, DRY_MS) if dry else (SHAPES, QUICK_MS if quick else MS)
    edge = DRY_EDGE_MS if dry else EDGE_MS
    n, k = DRY_COMBO_SHAPE if dry else COMBO_SHAPE
    specs = [_w4(n, k, dt, g, z, DRY_COMBO_MS if dry else COMBO_MS)  # every format the kernel accepts
             for dt in ("bfloat16", "float16") for g in GROUP_SIZES for z in (False, True)]
    specs += [
        _w4(96, 384, "bfloat16", 32, True, edge),     # N % 64 != 0: one-strip blocks at every M tile size
        _w4(192, 576, "float16", 32, True, edge),     # SmolLM2 k/v_proj: N % 64 != 0, K padded 576 -> 640
        _w4(576, 576, "bfloat16", 64, False, edge),   # SmolLM2 q/o_proj: K padded 576 -> 640 (new groups)
        _w4(1536, 576, "bfloat16", -1, True, edge),   # SmolLM2 gate/up per channel: padded codes = row zero point
        _w4(64, 200, "float16", -1, False, edge),     # K = 200: not a multiple of 8, padded to 256
        _w4(64, 64, "bfloat16", 32, True, edge),      # K below one k-tile
        _w4(100, 256, "bfloat16", 128, False, (1,), refuse=True),  # N % 32 != 0
        _w4(64, 576, "bfloat16", 128, False, (1,), refuse=True),   # group 128 does not divide K
        _w4(64, 256, "bfloat16", 16, False, (1,), refuse=True),    # a group size the kernel lacks
    ]
    # split-K forced (0 = the automatic choice, which the timed rows take): uneven ranges, one k-tile a split, an
    # empty last split (10 k-tiles in 6 splits of 2), and the M > 16 tilings with splits
    specs += [
        _w4(96, 384, "bfloat16", 32, True, (1, 17, 33, 65), splits=2),
        _w4(64, 1280, "bfloat16", 64, True, (1, 3, 17), splits=6),
    ]
    if not dry:
        specs.append(_w4(4128, 4096, "float16", 128, False, (1, 17, 65, 300)))  # a large N % 64 != 0
        specs += [_w4(8192, 8192, "bfloat16", 128, False, (1, 16), splits=7),
                  _w4(4096, 4096, "float16", 32, True, (1, 5, 16), splits=32),
                  _w4(4128, 4096, "float16", 128, False, (1, 17, 65), splits=5)]
    specs += [_w4(n, k, "bfloat16", 128, False, ms, timed=True) for n, k in shapes]  # the bars' rows
    variants = [("float16", 128, False), ("bfloat16", 128, True), ("bfloat16", 64, False), ("bfloat16", 32, True),
                ("bfloat16", -1, False), ("float16", -1, True)]
    return specs + [_w4(*shapes[0], dt, g, z, ms, timed=True) for dt, g, z in variants]


def fp8_specs(dry: bool, quick: bool) -> list[dict]:
    shapes, ms = (DRY_SHAPES, DRY_MS) if dry else (SHAPES, QUICK_MS if quick else MS)
    edge = DRY_EDGE_MS if dry else EDGE_MS
    specs = [
        _f8(136, 144, "row x channel", "op", edge),        # partial N tile (128 + 8) and K tile (128 + 16)
        _f8(8, 16, "row x channel", "op", edge),           # the smallest shape the kernel takes
        _f8(576, 576, "row x channel", "layer", edge),     # SmolLM2 layers through gpu.linear_fp8: quantize + GEMM
        _f8(1536, 576, "row x channel", "layer", edge),
        _f8(576, 1536, "row x channel", "layer", edge),
        _f8(64, 200, "row x channel", "layer", edge),      # K = 200 padded to 208 (gpu.pack_fp8)
        _f8(100, 256, "row x channel", "op", (1,), refuse=True),  # N % 8 != 0
    ]
    # the kernel takes the row / tensor activation scale and the channel / tensor weight scale independently
    specs += [_f8(*shapes[0], sc, "op", DRY_COMBO_MS if dry else COMBO_MS)
              for sc in ("row x tensor", "tensor x channel")]
    if not dry:
        specs.append(_f8(4104, 4112, "row x channel", "op", (1, 64, 65, 129, 4096)))  # partial tiles at scale
    return specs + [_f8(n, k, sc, "op", ms, timed=True) for n, k in shapes for sc in ("row x channel", "tensor")]


def quantize_specs(dry: bool) -> list[dict]:
    # K = 100: the scalar kernel (K % 8 != 0); 20000: rows longer than the vector kernel keeps in registers
    ks, ms = ((16, 100, 200, 576), (1, 3, 65)) if dry else ((16, 100, 200, 576, 4096, 8192, 14336, 20000),
                                                           (1, 3, 65, 4096))
    return [{"kernel": "fp8_quantize", "K": k, "dtype": dt, "ms": ms, "refuse": False}
            for k in ks for dt in ("bfloat16", "float16")]


def _flatten(family: str, specs: list[dict]) -> list[dict]:
    cases = []
    for s_id, spec in enumerate(specs):
        for m in spec["ms"]:
            cases.append({**{k: v for k, v in spec.items() if k != "ms"}, "family": family, "id": len(cases),
                          "spec": s_id, "M": m, "case": label(spec, m)})
    return cases


def family_cases(family: str, dry: bool, quick: bool) -> list[dict]:
    if family == "w4a16":
        return _flatten(family, w4a16_specs(dry, quick))
    if family == "fp8_gemm":
        return _flatten(family, fp8_specs(dry, quick))
    if family == "fp8_quantize":
        return _flatten(family, quantize_specs(dry))
    if family.startswith("sanitizer:"):  # a few small cases of every family, under compute-sanitizer
        specs = [_w4(96, 384, "bfloat16", 32, True, (17,)), _w4(192, 576, "float16", 32, True, (33,)),
                 _w4(64, 1280, "bfloat16", 64, True, (3,), splits=6),
                 _w4(64, 256, "float16", -1, False, (65,)), _f8(136, 144, "row x channel", "op", (65, 129)),
                 _f8(64, 200, "row x channel", "layer", (3,)),
                 {"kernel": "fp8_quantize", "K": 200, "dtype": "bfloat16", "ms": (3,), "refuse": False},
                 {"kernel": "fp8_quantize", "K": 100, "dtype": "float16", "ms": (3,), "refuse": False}]
        return [dict(c, timed=False) for c in _flatten(family, specs)]
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES} or sanitizer:<tool>")


def label(spec: dict, m: int) -> str:
    k = spec["kernel"]
    if k == "w4a16":
        g = "channel" if spec["group"] == -1 else f"g{spec['group']}"
        what = f"w4a16 {spec['N']}x{spec['K']} {SHORT[spec['dtype']]} {g}{' +z' if spec['zeros'] else ''}"
        what += f" split {spec['splits']}" if spec.get("splits") else ""
    elif k == "fp8_gemm":
        what = f"fp8 {spec['N']}x{spec['K']} {spec['scales']}{' layer' if spec['path'] == 'layer' else ''}"
    else:
        what = f"fp8 quantize {SHORT[spec['dtype']]} K={spec['K']}"
    return f"{what}: refused" if spec.get("refuse") else f"{what} M={m}"


# ----------------------------------------------------------------------------------------------------------------
# Case runners (in a child)
# ----------------------------------------------------------------------------------------------------------------
class Ctx:
    """What a child's case runners share: device, where references are computed, timer, seed, weight cache."""

    def __init__(self, device: torch.device, ref_device: torch.device, timer: Timer | None, seed: int):
        self.device, self.ref_device, self.timer, self.seed = device, ref_device, timer, seed
        self.sm = None
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            self.sm = major * 10 + minor
        self.cached: tuple[tuple, dict] | None = None
        self.selftested = False

    def gen(self, *key, device: torch.device | None = None) -> torch.Generator:
        """A generator seeded from the run's seed and `key`, the same in every process (a restarted child
        rebuilds the same inputs)."""
        seed = zlib.crc32(repr((self.seed,) + key).encode())
        return torch.Generator(device=device or self.device).manual_seed(seed)

    def weight(self, case: dict, build) -> dict:
        key = (case["family"], case["spec"])
        if self.cached is None or self.cached[0] != key:
            self.cached = None  # free the previous weight first
            self.cached = (key, build(case, self))
        return self.cached[1]


def _w4a16_weight(case: dict, ctx: Ctx) -> dict:
    n, k, g = case["N"], case["K"], case["group"]
    dtype = getattr(torch, case["dtype"])
    gen = ctx.gen(case["family"], "weight", case["spec"], device=torch.device("cpu"))  # packing runs on the CPU
    G = k if g == -1 else g
    u = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // G, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // G), generator=gen).float() if case["zeros"] else None
    p = gpu.pack_w4a16(u, scales, zeros, g, dtype, ctx.device)  # pads K to the k-tile when needed
    # the reference sees the scales as the kernel does (rounded to the activation dtype); zero points are integers
    w = {"p": p, "u": u.to(ctx.ref_device), "s": scales.to(dtype).double().to(ctx.ref_device),
         "z": None if zeros is None else zeros.double().to(ctx.ref_device)}
    if case["timed"]:
        zz = 8.0 if zeros is None else w["z"].repeat_interleave(G, 1)
        w["dense"] = ((w["u"].double() - zz) * w["s"].repeat_interleave(G, 1)).to(dtype).to(ctx.device)
    return w


def run_w4a16(case: dict, ctx: Ctx) -> dict:
    n, k, m, g = case["N"], case["K"], case["M"], case["group"]
    dtype = getattr(torch, case["dtype"])
    w = ctx.weight(case, _w4a16_weight)
    p = w["p"]
    x = (torch.randn(m, k, generator=ctx.gen(case["family"], case["id"]), device=ctx.device) * 0.5).to(dtype)
    splits = case.get("splits", 0)
    y, y2 = run_twice(lambda: gpu.linear_w4a16(p, x, None, splits), ctx.device)
    ref = w4a16_reference(x.to(ctx.ref_device), w["u"], w["s"], w["z"], g)
    row = {"k_padded": p.k_padded, **judge(y.to(ctx.ref_device), y2.to(ctx.ref_device), ref, TOL[case["dtype"]],
                                            EPS[case["dtype"]])}
    _selftest(row, y.to(ctx.ref_device), ref, TOL[case["dtype"]], EPS[case["dtype"]], ctx)
    if row["ok"] and case["timed"] and ctx.timer is not None:
        G = k if g == -1 else g
        u_dev, sc, zz = w["u"].to(ctx.device), p.scales, p.zeros
        ours = ctx.timer(lambda: gpu.linear_w4a16(p, x, None))
        dense = ctx.timer(lambda: F.linear(x, w["dense"]))
        deq = ctx.timer(lambda: F.linear(x, ((u_dev.to(dtype) - (8 if zz is None else zz.t().repeat_interleave(G, 1)))
                                             * sc.t().repeat_interleave(G, 1))))
        best = min(ours, deq)
        row.update(us=ours, dense_us=dense, dequant_matmul_us=deq, vs_dense=dense / ours,
                   dispatch_vs_dense=dense / best, dispatch_choice="w4a16" if ours <= deq else "dequant+matmul")
        if ctx.device.type == "cuda":  # the automatic split-K count, and the kernel without it, in the same run
            auto = ops._auto_splits(m, n, p.k_padded, ctx.device.index or 0)
            row.update(splits=auto, us_no_split=ctx.timer(lambda: gpu.linear_w4a16(p, x, None, 1)) if auto > 1
                       else ours)
    return row


def _fp8_weight(case: dict, ctx: Ctx) -> dict:
    n, k = case["N"], case["K"]
    gen = ctx.gen(case["family"], "weight", case["spec"])
    w = torch.randn(n, k, generator=gen, device=ctx.device) * 0.05
    per_col = case["scales"].endswith("channel")
    b_scale = (w.abs().amax(dim=1) / 448).clamp(min=1e-12) if per_col else (w.abs().amax() / 448).reshape(1)
    b = (w / b_scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = {"b": b, "sb": b_scale.float().contiguous()}
    if case["path"] == "layer":
        out["layer"] = gpu.pack_fp8(b, out["sb"], None, torch.bfloat16)  # pads K to a multiple of 16
    if case["timed"]:
        out["dense"] = (b.float() * out["sb"].reshape(-1, 1)).to(torch.bfloat16)
    return out


def run_fp8(case: dict, ctx: Ctx) -> dict:
    n, k, m = case["N"], case["K"], case["M"]
    w = ctx.weight(case, _fp8_weight)
    b, sb = w["b"], w["sb"]
    x = (torch.randn(m, k, generator=ctx.gen(case["family"], case["id"]), device=ctx.device) * 0.5).to(torch.bfloat16)
    if case["scales"].startswith("row"):  # dynamic per-token activations (the reference quantizer: the GEMM alone)
        a, sa = fp8_quantize_rows_reference(x)
    else:
        sa = (x.float().abs().amax() / 448).clamp(min=1e-12).reshape(1)
        a = (x.float() / sa).clamp(-448, 448).to(torch.float8_e4m3fn)
    if case["path"] == "layer":  # our quantize kernel + our GEMM, K padded: what a W8A8 layer runs
        y, y2 = run_twice(lambda: gpu.linear_fp8(w["layer"], x, None), ctx.device)
    else:
        y, y2 = run_twice(lambda: ops.fp8_gemm(a, b, sa, sb), ctx.device)
    rd = ctx.ref_device
    ref = fp8_reference(a.to(rd), b.to(rd), sa.to(rd), sb.to(rd))
    row = judge(y.to(rd), y2.to(rd), ref, TOL["fp8"], EPS["bfloat16"])
    _selftest(row, y.to(rd), ref, TOL["fp8"], EPS["bfloat16"], ctx)
    if row["ok"] and case["timed"] and ctx.timer is not None:
        t = ctx.timer
        per_row = case["scales"] == "row x channel"
        # torch._scaled_mm takes rowwise scales as [M, 1] and [1, N], per-tensor ones as scalars
        sa2 = sa.reshape(m, 1).contiguous() if per_row else sa.reshape(())
        sb2 = sb.reshape(1, n).contiguous() if per_row else sb.reshape(())
        b_t = b.t()  # column-major view for torch._scaled_mm
        ours = t(lambda: ops.fp8_gemm(a, b, sa, sb))
        dense = t(lambda: F.linear(x, w["dense"]))
        row.update(us=ours, dense_us=dense, vs_dense=dense / ours)
        try:
            cublas = t(lambda: torch._scaled_mm(a, b_t, scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16))
            row.update(scaled_mm_us=cublas, vs_scaled_mm=cublas / ours)
        except (RuntimeError, ValueError) as e:  # a scale layout this torch's _scaled_mm refuses
            row["scaled_mm_error"] = str(e)[:200]
        if per_row:  # the W8A8 layer: per-token quantize kernel + GEMM, against torch's quantize + _scaled_mm
            layer = gpu.pack_fp8(b, sb, None, torch.bfloat16)
            ours_layer = t(lambda: gpu.linear_fp8(layer, x, None))
            row.update(layer_us=ours_layer, layer_vs_dense=dense / ours_layer)
            try:
                theirs = gpu.ScaledMM(b_t, sb.reshape(1, n).contiguous(), None, torch.bfloat16)
                torch_layer = t(lambda: gpu.linear_scaled_mm(theirs, x, None))
                row.update(scaled_mm_layer_us=torch_layer, layer_vs_scaled_mm_layer=torch_layer / ours_layer)
            except (RuntimeError, ValueError) as e:
                row["scaled_mm_error"] = str(e)[:200]
    return row


def run_quantize(case: dict, ctx: Ctx) -> dict:
    m, k = case["M"], case["K"]
    dtype = getattr(torch, case["dtype"])
    gen = ctx.gen(case["family"], case["id"])
    # rows spanning 6 orders of magnitude, and one all-zero row (scale clamps to 1e-12, codes 0)
    spread = 10.0 ** (torch.rand(m, 1, generator=gen, device=ctx.device) * 6 - 3)
    x = (torch.randn(m, k, generator=gen, device=ctx.device) * spread).to(dtype)
    if m > 1:
        x[m // 2] = 0
    (q, s), (q2, s2) = run_twice(lambda: ops.fp8_quantize_rows(x), ctx.device)
    q_ref, s_ref = fp8_quantize_rows_reference(x.to(ctx.ref_device))
    q, s, q2, s2 = (t.to(ctx.ref_device) for t in (q, s, q2, s2))
    wrong_codes = differing(q, q_ref)
    scale_ok = bool(torch.allclose(s, s_ref, rtol=1e-6, atol=0))
    diff = differing(q, q2) + differing(s, s2)
    why = []
    if wrong_codes:
        why.append(f"{wrong_codes} code(s) differ from the reference (bit for bit)")
    if not scale_ok:
        why.append(f"scales differ from the reference by up to {float(((s - s_ref) / s_ref).abs().max()):.1e}")
    if diff:
        why.append(f"nondeterministic (race?): the two runs differ in {diff} element(s)")
    row = {"wrong_codes": wrong_codes, "scales_ok": scale_ok, "deterministic": diff == 0, "ok": not why, "why": why}
    if not why and m >= 4096 and ctx.timer is not None:  # bytes: x read once, codes written, scales
        row["quantize_us"] = ctx.timer(lambda: ops.fp8_quantize_rows(x))
        row["quantize_tbps"] = m * k * (x.element_size() + 1) / row["quantize_us"] / 1e6
    return row


def run_refusal(case: dict, ctx: Ctx) -> dict:
    """A shape the kernel must refuse: the support rule gives a reason, the path raises ValueError (no crash), and on
    CUDA the C rule agrees with the Python mirror."""
    n, k = case["N"], case["K"]
    why = []
    if case["kernel"] == "w4a16":
        reason = w4a16_layer_supported(n, k, case["group"])
        kernel_refuses = w4a16_supported(1, n, padded_k(k), case["group"]) is not None
        attempt = lambda: gpu.pack_w4a16(torch.zeros(n, k, dtype=torch.int64), torch.ones(n, 1), None,  # noqa: E731
                                         case["group"], torch.bfloat16, ctx.device)
        c_rule = (lambda: torch.ops.compress_cuda.w4a16_supported(1, n, padded_k(k), case["group"], 1, ctx.sm))
    else:
        reason = fp8_layer_supported(n, k, ctx.sm or 90)
        kernel_refuses = True
        a = torch.ones(1, k, device=ctx.device).to(torch.float8_e4m3fn)
        b = torch.ones(n, k, device=ctx.device).to(torch.float8_e4m3fn)
        one = torch.ones(1, device=ctx.device)
        # on CPU the op's reference path takes any shape; on CUDA the launcher answers "unsupported"
        attempt = (lambda: ops.fp8_gemm(a, b, one, one)) if ctx.device.type == "cuda" else None
        c_rule = (lambda: torch.ops.compress_cuda.fp8_supported(1, n, k, ctx.sm))
    if reason is None:
        why.append("the support rule accepts this shape; it must refuse it")
    if attempt is not None:
        try:
            attempt()
            why.append("the kernel path ran instead of raising ValueError")
        except ValueError:
            pass
    if ctx.device.type == "cuda" and kernel_refuses and cuda_ext.load().ok and int(c_rule()) == 0:
        why.append("the C rule (compress_cuda.*_supported) accepts what the Python mirror refuses")
    return {"refused": reason, "ok": not why, "why": why}


def _selftest(row: dict, y: Tensor, ref: Tensor, tol: float, eps: float, ctx: Ctx) -> None:
    """Once per child, on the first passing output with at least 16 rows: prove the checker catches planted errors."""
    if ctx.selftested or not row["ok"] or y.shape[0] < TILE:
        return
    ctx.selftested = True
    missed = checker_selftest(y, ref, tol, eps)
    row["checker_selftest"] = "caught a planted tile error and a planted element error" if not missed else missed
    if missed:
        row["ok"] = False
        row["why"] = row["why"] + [f"checker self-test: {m}" for m in missed]


def run_case(case: dict, ctx: Ctx) -> dict:
    if case.get("refuse"):
        return run_refusal(case, ctx)
    if case["kernel"] == "fp8_gemm" and ctx.sm is not None and fp8_supported(1, 8, 16, ctx.sm):
        return {"ok": None, "skipped": fp8_supported(1, 8, 16, ctx.sm), "why": []}
    return {"w4a16": run_w4a16, "fp8_gemm": run_fp8, "fp8_quantize": run_quantize}[case["kernel"]](case, ctx)


# ----------------------------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------------------------
def emit(path: Path, record: dict) -> None:
    """Append one JSON line and make it durable before going on (the next call may crash the process)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def child_build(results: Path) -> int:
    props = torch.cuda.get_device_properties(0)
    ext = cuda_ext.load()
    emit(results, {"event": "env", "gpu": props.name, "sm": f"{props.major}{props.minor}", "build_ok": ext.ok,
                   "build": f"built in {ext.build_seconds:.0f} s" if ext.ok else f"FAILED: {ext.reason}"})
    print("build:", "ok" if ext.ok else ext.reason, flush=True)
    return 0 if ext.ok else 1


def cuda_healthy() -> bool:
    """False once the process's CUDA context is broken (an illegal address poisons every later call)."""
    try:
        torch.cuda.synchronize()
        return float((torch.ones(1, device="cuda") + 1).item()) == 2.0
    except Exception:  # noqa: BLE001
        return False


def child(family: str, start: int, results: Path, seed: int, dry: bool, quick: bool, repeats: int,
          plant: str | None, flush: str = "read") -> int:
    if dry:
        torch.set_num_threads(1)
    device = torch.device("cpu" if dry else "cuda")
    under_sanitizer = family.startswith("sanitizer:")
    # under compute-sanitizer the references run on the CPU: cuBLAS would be instrumented too, for minutes
    ctx = Ctx(device, torch.device("cpu") if under_sanitizer else device,
              None if under_sanitizer else Timer(device, 2 if dry else repeats, flush), seed)
    cases = family_cases(family, dry, quick)
    # harness self-test (tests/test_gpu_check.py): FAMILY:ID:abort|hang, comma-separated; a crash or a hang inside a
    # case must cost that case's row only
    faults = dict(p.rsplit(":", 1) for p in plant.split(",")) if plant else {}
    t0 = time.perf_counter()
    for case in cases[start:]:
        emit(results, {"event": "start", "family": family, "id": case["id"], "case": case["case"]})
        fault = faults.get(f"{family}:{case['id']}")
        if fault == "abort":
            os.abort()
        if fault == "hang":
            time.sleep(10 ** 6)
        base = {k: v for k, v in case.items() if k not in ("timed", "refuse", "spec")}
        t1 = time.perf_counter()
        fault = False
        try:
            row = {**base, **run_case(case, ctx)}
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            row = {**base, "ok": False, "why": [f"exception: {type(e).__name__}: {str(e)[:400]}"]}
            fault = device.type == "cuda" and not cuda_healthy()  # a sticky CUDA error: go on in a fresh process
        row["seconds"] = round(time.perf_counter() - t1, 3)
        emit(results, row)
        status = "ok" if row["ok"] else ("skipped" if row["ok"] is None else "FAILED: " + "; ".join(row["why"]))
        errs = f" (rel {row['rel_err']:.1e}, tile {row['tile_err']:.1e})" if "tile_err" in row else ""
        print(f"[{family} {case['id'] + 1}/{len(cases)}] {case['case']}: {status}{errs} "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if fault:
            return EXIT_RESTART
    if ctx.timer is not None:
        emit(results, {"event": "timer", "family": family, "graphed": ctx.timer.graphed})
    return 0


# ----------------------------------------------------------------------------------------------------------------
# The parent: supervision, compute-sanitizer, summary
# ----------------------------------------------------------------------------------------------------------------
def spawn(cmd: list[str], deadline: float, log: Path, env: dict | None = None, watch: Path | None = None,
          stall: float | None = None) -> tuple[int | None, str | None, list[str]]:
    """Run a child in its own process group, copying its output to stdout and `log`. Returns (exit code, why it was
    killed: None, "stalled" (`watch` did not grow for `stall` seconds) or "deadline" (time.monotonic() passed
    `deadline`), all output lines). A kill takes the whole group (a sanitizer and its target too)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True, cwd=ROOT, env=env)
    lines: list[str] = []

    def pump():
        with open(log, "a") as f:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                f.write(line)
                f.flush()
                lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killed, size, progress = None, -1, time.monotonic()
    while True:
        try:
            rc = proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        grown = watch.stat().st_size if watch is not None and watch.exists() else -1
        if grown != size:
            size, progress = grown, now
        killed = "deadline" if now > deadline else ("stalled" if stall and now - progress > stall else None)
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            break
    reader.join(timeout=10)
    return rc, killed, lines


def read_results(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    return out


def describe_exit(rc: int | None, killed: str | None, stall: float = STALL_TIMEOUT) -> str:
    if killed == "stalled":
        return f"made no progress for {stall:g} s (hang?) and was killed"
    if killed == "deadline":
        return "was stopped at the run's time budget"
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


class Run:
    """The parent's state: where results go, the deadline, the child command line."""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.results, self.log = out / "gpu_check.jsonl", out / "gpu_check.log"
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self.seed = args.seed if args.seed is not None else int(time.time())
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if args.dry_run:
            self.env["OMP_NUM_THREADS"] = "1"
        # one build for every child (torch's JIT load() finds it and only loads it)
        self.env.setdefault("COMPRESS_CUDA_BUILD_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "compress_cuda"))

    def child_cmd(self, family: str, start: int = 0) -> list[str]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", family, "--start", str(start),
               "--results", str(self.results), "--seed", str(self.seed), "--repeats", str(self.args.repeats),
               "--flush", self.args.flush]
        cmd += ["--dry-run"] * self.args.dry_run + ["--quick"] * self.args.quick
        return cmd + (["--plant", self.args.plant] if self.args.plant else [])

    def step_deadline(self, steps_after: int) -> float:
        """When the current step must end, leaving RESERVE_PER_STEP seconds to each later step."""
        return self.deadline - RESERVE_PER_STEP * steps_after

    def record(self, row: dict) -> None:
        emit(self.results, row)


def run_family(run: Run, family: str, steps_after: int) -> None:
    """Run a family's cases in children until all have a row: a dead child's case gets a failed row, and a fresh
    child continues after it."""
    cases = family_cases(family, run.args.dry_run, run.args.quick)
    start, restarts = 0, 0

    def not_run(from_case: int, why: str) -> None:
        for c in cases[from_case:]:
            run.record({**{k: c[k] for k in ("family", "id", "kernel", "case", "M")}, "ok": None, "not_run": why,
                        "why": []})

    while start < len(cases):
        deadline = run.step_deadline(steps_after)
        if deadline - time.monotonic() < MIN_STEP or restarts > MAX_RESTARTS:
            not_run(start, "the run's time budget is spent" if restarts <= MAX_RESTARTS else
                    f"more than {MAX_RESTARTS} child restarts")
            return
        rc, killed, lines = spawn(run.child_cmd(family, start), deadline, run.log, run.env, watch=run.results,
                                  stall=run.args.stall)
        records = [r for r in read_results(run.results) if r.get("family") == family]
        done = {r["id"] for r in records if "event" not in r}
        started = [r["id"] for r in records if r.get("event") == "start" and r["id"] >= start]
        if rc == 0 and killed is None:
            return
        if not started:  # died before its first case: another child would too
            run.record({"family": family, "id": None, "kernel": family, "case": f"{family} child process",
                        "ok": None if killed == "deadline" else False,
                        "why": [f"the child {describe_exit(rc, killed, run.args.stall)} before its first case; last output: "
                                f"{' | '.join(lines[-8:])}"]})
            not_run(start, "its child process did not reach its first case")
            return
        last = max(started)
        if killed == "deadline":  # out of time, not a kernel failure
            not_run(last if last not in done else last + 1, "the run's time budget ran out")
            return
        if last not in done:  # the case that was running when the child died
            c = cases[last]
            run.record({**{k: c[k] for k in ("family", "id", "kernel", "case", "M")}, "ok": False, "crashed": True,
                        "why": [f"the child {describe_exit(rc, killed, run.args.stall)} during this case; last output: "
                                f"{' | '.join(lines[-5:])}"]})
        start, restarts = last + 1, restarts + 1


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if found is None and home and (Path(home) / "bin" / "compute-sanitizer").exists():
            found = str(Path(home) / "bin" / "compute-sanitizer")
    return found


def parse_sanitizer(text: str) -> dict:
    """errors (None when the tool did not report a summary: it could not run), warnings, and the kernel families
    named in its reports."""
    if any(marker in text for marker in SANITIZER_REFUSALS):
        return {"errors": None, "warnings": 0, "families": []}
    counts = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    race = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    counts += [int(e) for e, _ in race]
    families = [f for f, sym in KERNEL_SYMBOLS.items() if sym in text]
    return {"errors": max(counts) if counts else None, "warnings": sum(int(w) for _, w in race),
            "families": families}


SANITIZER_ROW = {"family": "sanitizer", "kernel": "compute-sanitizer", "M": None, "why": []}


def run_sanitizer(run: Run, tool_path: str) -> None:
    """Each tool over the family "sanitizer:<tool>" (a few small cases of every kernel) in one child; a row per tool
    with its verdict, the errors counted against the kernels its reports name."""
    base = SANITIZER_ROW
    for i, tool in enumerate(SANITIZER_TOOLS):
        case = f"compute-sanitizer {tool}"
        deadline = min(time.monotonic() + SANITIZER_TIMEOUT, run.step_deadline(len(SANITIZER_TOOLS) - 1 - i))
        if deadline - time.monotonic() < MIN_STEP:
            run.record({**base, "id": i, "case": case, "ok": None, "verdict": "not run: the time budget is spent"})
            continue
        # caching allocator off: every tensor is its own cudaMalloc, so memcheck sees an overrun into a neighbour
        env = dict(run.env, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        cmd = [tool_path, "--tool", tool, "--print-limit", "20", *run.child_cmd(f"sanitizer:{tool}")]
        rc, killed, lines = spawn(cmd, deadline, run.log, env)
        found = parse_sanitizer("\n".join(lines))
        row = {**base, "id": i, "case": case, "tool": tool, "errors": found["errors"], "warnings": found["warnings"]}
        if killed:
            row.update(ok=None, verdict=f"did not finish in {SANITIZER_TIMEOUT} s (or the budget)")
        elif found["errors"] is None:
            row.update(ok=None, verdict="could not run here: " + " | ".join(lines[-4:]))
        elif found["errors"]:
            # errors in code of none of our kernels (torch's own?) fail the run but no kernel's bars
            kernels = found["families"]
            row.update(ok=False, kernels=kernels,
                       verdict=f"{found['errors']} error(s) in {', '.join(kernels) or 'no kernel of ours'}",
                       why=[f"compute-sanitizer {tool}: {found['errors']} error(s); see gpu_check.log"])
        else:
            warned = f" ({found['warnings']} warnings)" if tool == "racecheck" else ""
            row.update(ok=True, verdict=f"0 errors{warned}")
        run.record(row)


def failed_kernels(rows: list[dict]) -> dict[str, int]:
    """Failed cases per kernel family; a sanitizer error counts against the families it names. The cases a child ran
    under a sanitizer count only when the tool itself ran (on a device it refuses, every CUDA call fails)."""
    ran = {f"sanitizer:{r['tool']}" for r in rows if r.get("family") == "sanitizer" and r.get("ok") is not None}
    out: dict[str, int] = {}
    for r in rows:
        if r.get("ok") is False and not (r.get("family", "").startswith("sanitizer:") and r["family"] not in ran):
            for k in r.get("kernels") or [r.get("kernel")]:  # no kernel of ours named: "compute-sanitizer"
                out[k] = out.get(k, 0) + 1
    return out


def verdicts(rows: list[dict]) -> dict:
    """The issue's bars, from rows that passed correctness only; a bar of a kernel family with any failed case is
    NOT_EVALUATED. Bars with no measured rows are absent."""
    failed = failed_kernels(rows)
    timed = [r for r in rows if r.get("ok") and r.get("us") is not None]
    out = {"all_correct": not failed and not any(r.get("not_run") for r in rows),
           "complete": not any(r.get("not_run") for r in rows), "failed_cases": failed}
    if failed.get("w4a16"):
        out["w4a16_ge_3x"] = out["w4a16_dispatch_never_slower"] = NOT_EVALUATED
    else:
        w4 = [r for r in timed if r["kernel"] == "w4a16" and (r["N"], r["K"]) == (8192, 8192) and r["M"] <= 16
              and r["dtype"] == "bfloat16" and r["group"] == 128 and not r.get("zeros")]
        if w4:
            out["w4a16_min_speedup_m_le_16_8192"] = min(r["vs_dense"] for r in w4)
            out["w4a16_ge_3x"] = out["w4a16_min_speedup_m_le_16_8192"] >= 3.0
        disp = [r["dispatch_vs_dense"] for r in timed if r["kernel"] == "w4a16"]
        if disp:
            out["w4a16_dispatch_min_vs_dense"] = min(disp)
            out["w4a16_dispatch_never_slower"] = min(disp) >= 1.0
    if failed.get("fp8_gemm") or failed.get("fp8_quantize"):  # a W8A8 layer runs both kernels
        out["fp8_ge_1_5x"] = out["fp8_within_10pct_of_scaled_mm"] = NOT_EVALUATED
    else:
        f8 = [r for r in timed if r["kernel"] == "fp8_gemm" and r["M"] == 4096]
        layers = [r for r in f8 if r.get("layer_us") is not None]
        if layers:  # the layer's time includes the per-token quantize kernel
            out["fp8_layer_min_speedup_m4096"] = min(r["dense_us"] / r["layer_us"] for r in layers)
            out["fp8_ge_1_5x"] = out["fp8_layer_min_speedup_m4096"] >= 1.5
        if f8:
            out["fp8_gemm_min_speedup_m4096"] = min(r["vs_dense"] for r in f8)
        ratios = [r["vs_scaled_mm"] for r in f8 if r.get("vs_scaled_mm") is not None]
        if ratios:
            out["fp8_min_vs_scaled_mm_m4096"] = min(ratios)
            out["fp8_within_10pct_of_scaled_mm"] = min(ratios) >= 0.9
    return out


def summarize(run: Run, env: dict) -> dict:
    records = read_results(run.results)
    rows = [r for r in records if "event" not in r]
    graphed = {"yes": 0, "no": 0}
    for r in records:
        if r.get("event") == "timer":
            graphed = {k: graphed[k] + r["graphed"][k] for k in graphed}
    result = {"env": env, "build": env.get("build"), "rows": rows, "verdicts": verdicts(rows),
              "seconds": round(time.monotonic() - run.t0, 1), "budget_s": run.args.budget,
              "timing": {"graphed_calls": graphed, "repeats": run.args.repeats, "l2_flush_mib": 256},
              "tolerances": {"whole_matrix": TOL, "tile_factor": TILE_TOL_FACTOR, "tile": TILE,
                             "element_eps": ELEM_EPS, "eps": EPS}}
    (run.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (run.out / "gpu_check.md").write_text(markdown(result))
    return result


def _fmt(v, spec=".1f") -> str:
    return "—" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    env, rows, v = result["env"], result["rows"], result["verdicts"]
    lines = [f"# GPU kernel check — {env['date']}, {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), "
             f"commit {env['commit']}, seed {env['seed']}, L2 flushed by a {env.get('l2_flush', 'write')} of 256 MiB "
             "before each timed call", "",
             f"Build: {result['build']}. Wall time {result['seconds']} s of a {result['budget_s']} s budget.", "",
             "## Bars", ""] + [f"- {k}: {val}" for k, val in v.items()] + ["", "## Failures", ""]
    bad = [r for r in rows if r.get("ok") is False]
    lines += [f"- {r['case']}: {'; '.join(r['why'])}" for r in bad] or ["none"]
    lines += ["", "## Families", "", "| family | cases | passed | failed | refused (checked) | not run / skipped |",
              "|---|---:|---:|---:|---:|---:|"]
    for fam in sorted({r["family"] for r in rows}):
        fr = [r for r in rows if r["family"] == fam]
        lines.append(f"| {fam} | {len(fr)} | {sum(r.get('ok') is True for r in fr)} | "
                     f"{sum(r.get('ok') is False for r in fr)} | {sum('refused' in r for r in fr)} | "
                     f"{sum(r.get('ok') is None for r in fr)} |")
    lines += ["", "## Cases", "",
              "| case | rel. err | worst tile (err) | bad | same twice | ok | µs | bf16 µs | ×bf16 | other |",
              "|---|---:|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        other = r.get("verdict") or r.get("refused") or r.get("not_run") or r.get("skipped") or ""
        if r.get("kernel") == "w4a16" and r.get("us") is not None:
            other = f"dequant+matmul {r['dequant_matmul_us']:.1f} µs; dispatch → {r['dispatch_choice']}"
            if r.get("splits", 1) > 1:
                other += f"; split-K {r['splits']} (unsplit {r['us_no_split']:.1f} µs)"
        elif r.get("kernel") == "fp8_gemm" and r.get("us") is not None:
            other = f"_scaled_mm {_fmt(r.get('scaled_mm_us'))} µs"
            if r.get("layer_us") is not None:
                other += (f"; layer (quantize + GEMM) {r['layer_us']:.1f} µs, {r['layer_vs_dense']:.2f}× bf16, "
                          f"torch layer {_fmt(r.get('scaled_mm_layer_us'))} µs")
        elif r.get("kernel") == "fp8_quantize" and "wrong_codes" in r:
            other = f"{r['wrong_codes']} wrong codes"
            if r.get("quantize_us") is not None:
                other += f"; {r['quantize_us']:.1f} µs ({r['quantize_tbps']:.2f} TB/s)"
        tile = f"{r['worst_tile'][0]},{r['worst_tile'][1]} ({r['tile_err']:.1e})" if "tile_err" in r else "—"
        ok = {True: "yes", False: "NO", None: "—"}[r.get("ok")]
        same = {True: "yes", False: "NO", None: "—"}[r.get("deterministic")]
        lines.append(f"| {r['case']} | {_fmt(r.get('rel_err'), '.1e')} | {tile} | {r.get('bad', '—')} | {same} "
                     f"| {ok} | {_fmt(r.get('us'))} | {_fmt(r.get('dense_us'))} | {_fmt(r.get('vs_dense'), '.2f')} "
                     f"| {other} |")
    return "\n".join(lines) + "\n"


def commit() -> str:
    env = os.environ.get("COMPRESS_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, small shapes, reference paths, meaningless times")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--flush", choices=("read", "write"), default="read",
                    help="how the L2 is emptied before each timed call (Timer): read 256 MiB (default) or write it")
    ap.add_argument("--quick", action="store_true", help="fewer M values on the model shapes")
    ap.add_argument("--out", help="output folder (default $OUT, else bench/results/gpu_check)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 360; dry run 600)")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--seed", type=int, help="input seed (default: the time; recorded in the results)")
    ap.add_argument("--stall", type=float, default=STALL_TIMEOUT,
                    help=f"seconds without a new result after which a child is taken for hung (default {STALL_TIMEOUT})")
    ap.add_argument("--plant", help=argparse.SUPPRESS)  # FAMILY:ID:abort|hang,... - harness self-test faults
    ap.add_argument("--child", help=argparse.SUPPRESS)     # internal: run one family (or "build") in this process
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.families.split(",")) - set(FAMILIES) - {""})
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {FAMILIES}")
    args.budget = args.budget or (600.0 if args.dry_run else 360.0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "build":
        return child_build(Path(args.results))
    if args.child:
        return child(args.child, args.start, Path(args.results), args.seed, args.dry_run, args.quick, args.repeats,
                     args.plant, args.flush)

    families = [f for f in args.families.split(",") if f]
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args, out)
    run.results.write_text("")
    run.log.write_text("")
    env = {"date": date.today().isoformat(), "commit": commit(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": sys.version.split()[0], "seed": run.seed, "l2_flush": args.flush, "gpu": "cpu (dry run)",
           "sm": None,
           "build": "dry run on CPU: ops' reference paths, nothing built"}
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        rc, killed, lines = spawn(run.child_cmd("build"), run.step_deadline(len(families) + 1), run.log, run.env)
        found = [r for r in read_results(run.results) if r.get("event") == "env"]
        env.update({k: found[-1][k] for k in ("gpu", "sm", "build")} if found else
                   {"build": f"FAILED: the build child {describe_exit(rc, killed)}: {' | '.join(lines[-8:])}"})
        if not found or not found[-1]["build_ok"]:
            summarize(run, env)
            print(env["build"], file=sys.stderr)
            return 1
    steps = families + ([] if args.no_sanitizer else ["sanitizer"])
    for i, family in enumerate(families):
        run_family(run, family, steps_after=len(steps) - 1 - i)
        summarize(run, env)
    if not args.no_sanitizer:
        tool = find_sanitizer()
        if tool is None or args.dry_run:
            why = "compute-sanitizer not installed" if tool is None else "not run in a dry run (CPU)"
            run.record({**SANITIZER_ROW, "id": 0, "case": "compute-sanitizer", "ok": None, "verdict": why})
        else:
            run_sanitizer(run, tool)
    result = summarize(run, env)
    v = result["verdicts"]
    print(f"\nbars: {json.dumps({k: val for k, val in v.items() if k != 'failed_cases'})}")
    failures = [r for r in result["rows"] if r.get("ok") is False]
    for r in failures:
        print(f"FAILED {r['case']}: {'; '.join(r['why'])}")
    print(f"{len(result['rows'])} rows, {len(failures)} failed, {result['seconds']} s; results in {out}")
    return 0 if v["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
