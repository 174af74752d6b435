"""One GPU run that builds the CUDA extension, checks every kernel against its float64 reference, and times it.

    python bench/gpu_check.py                 # on an H200: 84 s measured before chain mode and the 70B shapes
                                              # (2026-12-04); about 120-130 s estimated now (--budget caps it)
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
   M in MS and Llama-3-70B's MLP, 8192x28672 and 28672x8192, at LARGE_MS (1, 16, 4096); other formats (fp16, zero
   points, group 64 / 32 / per channel) on 4096x4096; every group size x zero point x dtype the kernel accepts on
   576x1536; edge shapes: N not a multiple of 64 (96, 192, 4128: one-strip blocks), K not a multiple of the 128
   k-tile (576, 200, 64: zero-padded by gpu.pack_w4a16, the path SmolLM2's layers take), at M in EDGE_MS (partial
   m16 / m32 / m64 tiles, not powers of two); split-K forced to uneven ranges, one k-tile a split and an empty last
   split (the timed rows take the automatic count, and also time the kernel unsplit); shapes the kernel must refuse
   (N % 32, group 16, K % group), where the refusal itself is checked. Every implementation in W4A16_IMPLS (ours; a
   rule says which cases each takes) runs every case it takes, judged alike. fp8: per-row x per-channel and
   per-tensor scales on the model shapes (the 70B ones at LARGE_MS), the two mixed scale forms, partial N and K
   tiles (136x144, 4104x4112), the smallest shape (8x16), SmolLM2's layers and K = 200 (padded to 208) through
   each of FP8_LAYER_IMPLS (ours: quantize + GEMM, as a W8A8 layer runs), and N % 8 (refused). The per-token
   quantize kernel: bf16 / fp16, K from 16 to 20000 (the scalar kernel at K = 100, the vector kernel's register and
   loop paths), rows spanning 6 orders of magnitude and an all-zero row, bit for bit against its reference, timed
   at M = 4096.
4. Timing (cases that passed, model shapes only), p10 / p50 / p90 of every measurement, two ways (Timer): a single
   call replayed from a CUDA graph with L2 flushed before it (--flush: a 256 MiB read, default, or write; --repeats
   samples), and a chain: one CUDA graph calling the layer on C distinct copies of its weights (C >= 8, together at
   least twice the L2; CHAIN_CAP_BYTES) back to back, time per layer (--chain-repeats replays), what a decode step
   sees and what the bars use. A single call carries the harness's fixed cost (graph launch, events: ~5-7 µs),
   which a chain spreads over its layers; each family's child records that floor (an empty kernel timed both ways)
   and the device-to-device copy bandwidth (the ceiling of weight streaming) before its first case (`harness`).
   Timed in the same process against bf16 `F.linear` (cuBLAS), and baselines: W4A16 against dequantize-then-
   matmul and torch's tinygemm (`_weight_int4pack_mm`, gpu.pack_tinygemm, on the same codes, bf16 only); fp8 as
   the GEMM alone against `torch._scaled_mm` with use_fast_accum False and True, and, per-token, as the W8A8 layer
   (each of ours, and torch's quantize + `_scaled_mm`). Every baseline's output is judged as ours are, recorded
   (row["baselines"]); an inaccurate one gates nothing. The dispatcher's choice is the fastest (chained) of ours,
   tinygemm where accurate, and dequantize-then-matmul: its GPU candidates.
5. compute-sanitizer, when installed: memcheck and racecheck over a few small cases of every family in a separate
   child (torch's caching allocator off, so an overrun past a tensor is outside any allocation); a tool that cannot
   run on the device is recorded as such, not as a kernel failure.
6. The issue's bars, in chain mode with our fastest implementation per case, computed only for a kernel family
   with no failed case (else "not evaluated: kernel failed correctness"; W4A16_BARS, DISPATCH_BAR, FP8_LAYER_BAR):
   W4A16 >= 3.0x bf16 at M = 1 on 8192x28672, >= 2.6x at M = 1 and >= 2.2x at M = 16 on 8192x8192; the
   dispatcher's choice >= 0.9x bf16 at every timed M up to 4096; the fp8 W8A8 layer (quantize + GEMM) >= 1.4x bf16
   at M = 4096 on every shape. bar_details gives each implementation's and baseline's own value and the single-call
   ratio beside it; where our fp8 GEMM stands against `_scaled_mm` is reported, not a bar.

Results go to --out, else $OUT, else bench/results/gpu_check/: gpu_check.jsonl (every row as it happened),
gpu_check.json and gpu_check.md (summary, stamped with date, GPU, torch, CUDA, commit and seed), gpu_check.log (all
child output). Exit status 0 only when every case ran and passed. This file is longer than the style's 400 lines
because it must run alone on a machine where nothing can be fixed: the checker, the cases and the process
supervision are kept together.
"""
from __future__ import annotations

import argparse
import dataclasses
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
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.kernels import cuda_ext, gpu, ops, prepack  # noqa: E402
from compress.kernels.fp8_layout import (fp8_layer_supported, fp8_quantize_rows_reference,  # noqa: E402
                                         fp8_reference, fp8_supported)
from compress.kernels.prepack import GROUP_SIZES, padded_k, w4a16_layer_supported, w4a16_reference  # noqa: E402
from compress.kernels.prepack import w4a16_supported  # noqa: E402
from compress.kernels.w4a16_v2 import w4a16_v2_supported  # noqa: E402

FAMILIES = ("fp8_quantize", "w4a16", "fp8_gemm")
MS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)
QUICK_MS = (1, 16, 64, 4096)
EDGE_MS = (1, 3, 5, 17, 33, 63, 65, 127, 200)  # partial tiles of BM = 16 / 32 / 64 (W4A16) and 64 / 128 (fp8)
# (N, K): Llama-3-8B-like projections, and Llama-3-70B's MLP (up/gate 28672x8192, down 8192x28672), timed at the
# decode M values and a prefill one only (LARGE_MS): 235M weights each, whose checks and copies cost the most
LARGE_SHAPES, LARGE_MS = ((8192, 28672), (28672, 8192)), (1, 16, 4096)
SHAPES = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)) + LARGE_SHAPES
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
# the kernel symbols a sanitizer report may name, per family (a report naming one fails that family)
KERNEL_SYMBOLS = {"w4a16": ("w4a16_kernel", "w4a16_v2_kernel", "w4a16_dequant_kernel"), "fp8_gemm": ("fp8_gemm_sm",),
                  "fp8_quantize": ("fp8_quantize_rows",)}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}

# Timing (Timer). A measurement takes `repeats` samples (--repeats single calls, --chain-repeats chain replays) but
# stops after TIME_CAP_S once it has MIN_SAMPLES: a slow baseline at M = 4096 must not eat the run's budget. A chain
# calls the layer on CHAIN_MIN_COPIES distinct weight copies at least, more until the copies together hold twice
# the device's L2 (at most CHAIN_MAX_COPIES), all in one CUDA graph; the copies of one chain stay within
# CHAIN_CAP_BYTES (eight bf16 copies of 8192x28672 are 3.5 GiB), fewer copies (a recorded note) beyond it.
TIME_CAP_S, MIN_SAMPLES = 0.25, 5
CHAIN_REPEATS, CHAIN_MIN_COPIES, CHAIN_MAX_COPIES, CHAIN_CAP_BYTES = 10, 8, 64, 4 * 2 ** 30
COPY_BYTES, DRY_COPY_BYTES = 2 ** 30, 8 * 2 ** 20  # the device-to-device copy the harness times (per direction)


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
def percentiles(samples: list[float]) -> dict:
    """p10 / p50 (the median) / p90 of samples (linear interpolation between order statistics) and their count."""
    s = sorted(samples)
    if len(s) == 1:
        return {"p10": s[0], "p50": s[0], "p90": s[0], "n": 1}
    deciles = statistics.quantiles(s, n=10, method="inclusive")
    return {"p10": deciles[0], "p50": statistics.median(s), "p90": deciles[-1], "n": len(s)}


def tensors_of(obj) -> list[Tensor]:
    """The tensors a layer's operands hold: a tensor, a tuple / list / dict of them, or a dataclass's fields."""
    if isinstance(obj, Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        obj = list(obj.values())
    return [t for o in obj for t in tensors_of(o)] if isinstance(obj, (list, tuple)) else []


def clone_operands(obj):
    """A copy of a layer's operands in fresh memory (strides kept: a transposed weight stays transposed)."""
    if isinstance(obj, Tensor):
        return obj.clone()
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: clone_operands(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(clone_operands(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_operands(o) for o in obj)
    if isinstance(obj, dict):
        return {k: clone_operands(v) for k, v in obj.items()}
    return obj


def chain_copies(size: int, l2_bytes: int | None, least: int = CHAIN_MIN_COPIES) -> tuple[int, str | None]:
    """How many weight copies a chain calls (each `size` bytes) and a note when they miss the aim: `least` at least,
    enough to hold twice the L2 (when known), at most CHAIN_MAX_COPIES and CHAIN_CAP_BYTES together."""
    size = max(size, 1)
    want = least if not l2_bytes else max(least, -(-2 * l2_bytes // size))
    want = min(want, CHAIN_MAX_COPIES)
    fit = max(2, CHAIN_CAP_BYTES // size)
    copies = min(want, fit)
    note = None
    if copies < want:
        note = f"{copies} copies, not {want}: the {CHAIN_CAP_BYTES / 2 ** 30:g} GiB cap"
    if l2_bytes and copies * size < 2 * l2_bytes:
        note = (note + "; " if note else "") + \
            f"the copies hold {copies * size / 2 ** 20:.0f} MiB, less than twice the L2 ({l2_bytes / 2 ** 20:.0f} MiB)"
    return copies, note


class Timer:
    """Times a call two ways, with p10 / p50 / p90 of its samples (CPU, for --dry-run: perf_counter; its times mean
    nothing).

    `single`: one call at a time, CUDA events around it, the L2 flushed before each: the call's cost when its weights
    come from HBM, plus the harness's fixed cost (graph launch and events: ~5-7 µs measured on an H200, the harness
    floor that every run records), which caps the ratio a fast kernel can show against a slow one.
    `chain`: one CUDA graph calling the layer on C distinct copies of its operands back to back, as a decode step runs
    its layers; the copies together are at least twice the L2, so each call reads its weights from HBM without a
    flush; time per layer = graph time / C. This is what the bars use.

    On CUDA the calls are captured once in a CUDA graph and replayed, so the events time the GPU work, not the Python
    around a custom op (input checks, allocation: tens of µs, more than a decode-sized GEMM). Calls that cannot be
    captured are timed directly; `graphed` counts which were.

    flush "read" (default) evicts the L2 by reading 256 MiB, which leaves it full of clean lines, as a decode step
    finds it after the previous layer's weights; "write" (the first GPU runs) writes 256 MiB, which leaves up to
    the L2's size of dirty lines whose write-back then competes with the timed call's reads - a cost real inference
    does not pay, and a larger share of a small (int4) call than of a large (bf16) one."""

    def __init__(self, device: torch.device, repeats: int, flush: str = "read", chain_repeats: int = CHAIN_REPEATS):
        if flush not in ("read", "write"):
            raise ValueError(f"flush={flush!r}: use 'read' or 'write'")
        self.device, self.repeats, self.mode, self.chain_repeats = device, repeats, flush, chain_repeats
        cuda = device.type == "cuda"
        self.flush = torch.ones(32 * 2 ** 20, dtype=torch.int64, device=device) if cuda else None
        self.l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) if cuda else None
        self.least_copies = CHAIN_MIN_COPIES if cuda else 2  # CPU (dry run): the code path, not the numbers
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

    def _samples(self, fn, repeats: int, flush: bool) -> list[float]:
        """Microseconds of `repeats` calls of fn (fewer past TIME_CAP_S, MIN_SAMPLES at least)."""
        times: list[float] = []
        stop = time.perf_counter() + TIME_CAP_S
        while len(times) < repeats and (len(times) < MIN_SAMPLES or time.perf_counter() < stop):
            if self.flush is not None:
                if flush:
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
        return times

    def single(self, fn) -> dict:
        """One call at a time, L2 flushed before each: {"p10", "p50", "p90", "n"} in µs."""
        fn()
        if self.flush is not None:
            fn = self._graph(fn)
        return percentiles(self._samples(fn, self.repeats, flush=True))

    def __call__(self, fn) -> float:
        """The median of `single` in µs (bench/w4a16_splits.py times so)."""
        return self.single(fn)["p50"]

    def chain(self, call: Callable[[Any], Any], operands, copies: int | None = None) -> dict:
        """call(operands) on C distinct copies of `operands` (the first is `operands` itself), back to back in one
        CUDA graph replayed --chain-repeats times, no flush: per-layer µs {"p10", "p50", "p90", "n"} plus "copies",
        "bytes" (all copies) and "note" when the copies miss the aim (chain_copies). `copies` overrides C."""
        size = sum(t.nbytes for t in tensors_of(operands))
        note = None
        if copies is None:
            copies, note = chain_copies(size, self.l2_bytes, self.least_copies)
        layers = [operands] + [clone_operands(operands) for _ in range(copies - 1)]

        def run_all():
            for op in layers:
                call(op)

        run_all()
        fn = self._graph(run_all) if self.flush is not None else run_all
        per_layer = [t / copies for t in self._samples(fn, self.chain_repeats, flush=False)]
        del fn, layers
        return {**percentiles(per_layer), "copies": copies, "bytes": copies * size, **({"note": note} if note else {})}


def harness(timer: Timer, device: torch.device) -> dict:
    """What every timing carries: the harness floor (a one-element fill, the emptiest kernel, timed as `single` and
    as a chain of CHAIN_MIN_COPIES calls) and the device-to-device copy bandwidth (one copy of COPY_BYTES timed as a
    graph of one call; bytes read + written): the ceiling a weight-streaming kernel can reach."""
    one = torch.zeros(1, device=device)
    out = {"floor_us": timer.single(lambda: one.fill_(1.0)),
           "chain_floor_us": timer.chain(lambda t: t.fill_(1.0), one, copies=CHAIN_MIN_COPIES)}
    n = (COPY_BYTES if device.type == "cuda" else DRY_COPY_BYTES) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy = timer.chain(lambda d: d.copy_(src), dst, copies=1)
    del copy["bytes"]
    moved = 2 * src.nbytes
    out.update(copy_us=copy, copy_bytes=moved, copy_tbps=moved / copy["p50"] / 1e6, l2_bytes=timer.l2_bytes)
    if device.type == "cuda":
        out["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return out


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


def shape_ms(shape: tuple[int, int], ms: tuple[int, ...]) -> tuple[int, ...]:
    """The M values a model shape is timed at: LARGE_MS for LARGE_SHAPES (decode, and one prefill M), else ms."""
    return LARGE_MS if shape in LARGE_SHAPES else ms


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
    specs += [_w4(n, k, "bfloat16", 128, False, shape_ms((n, k), ms), timed=True) for n, k in shapes]  # the bars' rows
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
    return specs + [_f8(n, k, sc, "op", shape_ms((n, k), ms), timed=True) for n, k in shapes
                    for sc in ("row x channel", "tensor")]


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


# ----------------------------------------------------------------------------------------------------------------
# Implementations: each of ours is checked on every case its rule takes, and timed on the timed shapes; the bars take
# the fastest per case. Baselines (torch's) are checked and timed beside them but gate nothing.
# ----------------------------------------------------------------------------------------------------------------
def _any_case(m: int, n: int, k: int, g: int) -> str | None:
    return None


# NamedTuples, not dataclasses, in this file: bench/w4a16_splits.py and the tests load it by path without
# registering it in sys.modules, where a dataclass of a module with postponed annotations looks itself up
class Impl(NamedTuple):
    """One of our implementations of a layer: `run(operands, x, splits)` -> y (splits: a forced split-K count, 0 =
    automatic); `rule(M, N, K, group_size)` -> why it cannot take a case (K: the operands' K, padded), None if it
    can; `forced_splits`: it also runs the cases that force a split-K count."""
    run: Callable[..., Tensor]
    rule: Callable[[int, int, int, int], str | None] = _any_case
    forced_splits: bool = False


def op_impl(name: str) -> Callable[..., Tensor]:
    """run() for an ops.<name> W4A16 op taking v1's operands: (x, wq, scales, zeros, n, group_size, splits), x
    zero-padded to the packed K as gpu.linear_w4a16 pads it."""
    def run(p: gpu.W4A16, x: Tensor, splits: int = 0) -> Tensor:
        x2 = x.reshape(-1, p.k)
        if p.k_padded != p.k:
            x2 = F.pad(x2, (0, p.k_padded - p.k))
        return getattr(ops, name)(x2.contiguous(), p.wq, p.scales, p.zeros, p.n, p.group_size, splits)
    return run


def prepack_rule(name: str) -> Callable[[int, int, int, int], str | None]:
    """rule() from prepack.<name>(M, N, K, group_size) -> str | None; refuses, naming it, while it does not exist."""
    def rule(m: int, n: int, k: int, g: int) -> str | None:
        fn = getattr(prepack, name, None)
        return f"prepack.{name} does not exist" if fn is None else fn(m, n, k, g)
    return rule


def _v2_rule(m: int, n: int, k: int, g: int) -> str | None:
    """Version 2 takes M <= 16 and whatever split count fits its shared memory (the most splits: the least x)."""
    return w4a16_v2_supported(m, n, k, g, max(1, k // 128))


def _v2_pdl(p: gpu.W4A16, x: Tensor, splits: int = 0) -> Tensor:
    """Version 2 launched as a programmatic dependent (sm_90: its weight loads start before the previous kernel in
    the stream ends); elsewhere the op's checked path, without the attribute."""
    if x.device.type != "cuda":
        return op_impl("w4a16_gemm_v2")(p, x, splits)
    x2 = x.reshape(-1, p.k)
    if p.k_padded != p.k:
        x2 = F.pad(x2, (0, p.k_padded - p.k))
    return ops.launch_w4a16_v2(x2.contiguous(), p.wq, p.scales, p.zeros, p.n, p.group_size, splits, pdl=True)


def _large_m(m: int, n: int, k: int, g: int) -> str | None:
    """The large-batch path (dequantize into scratch, then cuBLAS) is checked and timed from M = 64 up: its kernel
    writes W whatever M is, and below 64 the GEMMs are the dispatcher's choice."""
    return None if m >= 64 else f"M={m}: the large-batch path is checked and timed from M = 64"


def _scaled_mm_rule(m: int, n: int, k: int, g: int) -> str | None:
    return None if n % 16 == 0 else f"N={n}: torch._scaled_mm needs N % 16 == 0"


# Our W4A16 GEMMs on gpu.pack_w4a16's operands: v1 (any M), the decode kernel v2 (M <= 16; "v2 pdl": launched as a
# programmatic dependent, which only chain mode can show), and the large-batch path (dequantize + cuBLAS).
W4A16_IMPLS: dict[str, Impl] = {
    "v1": Impl(lambda p, x, splits=0: gpu.linear_w4a16(p, x, None, splits), forced_splits=True),
    "v2": Impl(op_impl("w4a16_gemm_v2"), _v2_rule, forced_splits=True),
    "v2 pdl": Impl(_v2_pdl, _v2_rule),
    "dequant+cuBLAS": Impl(lambda p, x, splits=0: gpu.linear_w4a16_dequant(p, x, None), _large_m),
}
# Our fp8 W8A8 layers (per-token activation quantize + GEMM) on gpu.pack_fp8's operands: our GEMM, and our quantize
# feeding torch._scaled_mm (both accumulation modes)
FP8_LAYER_IMPLS: dict[str, Impl] = {
    "ours": Impl(lambda p, x, splits=0: gpu.linear_fp8(p, x, None)),
    "quantize + _scaled_mm": Impl(lambda p, x, splits=0: gpu.linear_fp8_scaled_mm(p, x, None, use_fast_accum=False),
                                  _scaled_mm_rule),
    "quantize + _scaled_mm fast": Impl(lambda p, x, splits=0: gpu.linear_fp8_scaled_mm(p, x, None,
                                                                                      use_fast_accum=True),
                                       _scaled_mm_rule),
}
BF16, DEQUANT, TINYGEMM = "bf16", "dequant+matmul", "torch tinygemm"
FP8_GEMM, SCALED_MM, SCALED_MM_FAST = "fp8 gemm", "_scaled_mm", "_scaled_mm fast accum"
TORCH_LAYER = "torch quantize + _scaled_mm"
BRIEF = ("rel_err", "tile_err", "worst_tile", "bad", "deterministic", "ok", "why")


def check_impls(row: dict, runs: dict[str, Callable[[], Tensor]], ref: Tensor, tol: float, eps: float,
                ctx: Ctx) -> None:
    """Run each implementation twice (poisoned outputs) and judge it. The first one's verdict fills the row (rel_err,
    tile_err, ... as every row has them) and proves the checker (_selftest); each other's is row["impls"][name],
    its failures joining row["why"] under its name."""
    first = True
    for name, run in runs.items():
        y, y2 = run_twice(run, ctx.device)
        y, y2 = y.to(ctx.ref_device), y2.to(ctx.ref_device)
        if first:
            row.update(judge(y, y2, ref, tol, eps))
            _selftest(row, y, ref, tol, eps, ctx)
            first = False
        else:
            judge_into(row, name, judge(y, y2, ref, tol, eps))
    row["impls_run"] = list(runs)


def judge_into(row: dict, name: str, verdict: dict) -> None:
    row.setdefault("impls", {})[name] = {k: verdict[k] for k in BRIEF}
    if not verdict["ok"]:
        row["ok"] = False
        row["why"] = row["why"] + [f"{name}: {w}" for w in verdict["why"]]


def check_baseline(row: dict, name: str, run: Callable[[], Tensor], ref: Tensor, tol: float, eps: float,
                   ctx: Ctx) -> bool:
    """A baseline's accuracy on this case, judged as ours are, under row["baselines"][name]; an inaccurate baseline
    is still timed (its row says so), one that raises is recorded. False if it could not run."""
    try:
        y = run().to(ctx.ref_device)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        if ctx.device.type == "cuda" and not cuda_healthy():
            raise
        row.setdefault("baselines", {})[name] = {"ok": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        return False
    row.setdefault("baselines", {})[name] = {k: v for k, v in judge(y, y, ref, tol, eps).items()
                                             if k in BRIEF and k != "deterministic"}
    return True


def time_layer(row: dict, ctx: Ctx, label: str, call: Callable[[Any], Tensor], operands, ours: bool = False,
               chain: bool = True) -> None:
    """row["timings"][label] = {"single": ..., "chain": ...} (Timer) of call(operands). A baseline's failure to run is
    recorded in row["timing_errors"]; ours raise (the case fails)."""
    try:
        t = {"single": ctx.timer.single(lambda: call(operands))}
        if chain:
            t["chain"] = ctx.timer.chain(call, operands)
    except Exception as e:  # noqa: BLE001 - a baseline torch refuses here (a scale layout, an arch) is recorded
        if ours or (ctx.device.type == "cuda" and not cuda_healthy()):
            raise
        row.setdefault("timing_errors", {})[label] = f"{type(e).__name__}: {str(e)[:200]}"
        return
    row.setdefault("timings", {})[label] = t


def p50(row: dict, label: str, mode: str) -> float | None:
    return row.get("timings", {}).get(label, {}).get(mode, {}).get("p50")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


class Dequant(NamedTuple):
    """dequantize-then-matmul's operands (the dispatcher's reference path on a GPU): uint8 codes [N, K], scales and
    zero points (None: 8) [N, K / G] in the activation dtype."""
    codes: Tensor
    scales: Tensor
    zeros: Tensor | None
    group: int  # G (K for one scale per channel)


def dequant_matmul(q: Dequant, x: Tensor) -> Tensor:
    z = 8 if q.zeros is None else q.zeros.repeat_interleave(q.group, 1)
    return F.linear(x, (q.codes.to(x.dtype) - z) * q.scales.repeat_interleave(q.group, 1))


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
        w["dequant"] = Dequant(w["u"].to(ctx.device).to(torch.uint8), scales.to(dtype).to(ctx.device),
                               None if zeros is None else zeros.to(dtype).to(ctx.device), G)
        why = gpu.tinygemm_supported(n, k, g) or (None if dtype == torch.bfloat16 else
                                                  "bfloat16 activations only (torch's CUDA tinygemm)")
        if why is None:
            try:
                w["tinygemm"] = gpu.pack_tinygemm(w["u"], scales, zeros, g, ctx.device)  # repacked on the device
            except (RuntimeError, ValueError, NotImplementedError) as e:  # this torch's op refuses: recorded
                w["tinygemm"] = f"packing failed: {type(e).__name__}: {str(e)[:200]}"
        else:
            w["tinygemm"] = why
    return w


def run_w4a16(case: dict, ctx: Ctx) -> dict:
    n, k, m, g = case["N"], case["K"], case["M"], case["group"]
    dtype = getattr(torch, case["dtype"])
    w = ctx.weight(case, _w4a16_weight)
    p = w["p"]
    x = (torch.randn(m, k, generator=ctx.gen(case["family"], case["id"]), device=ctx.device) * 0.5).to(dtype)
    splits = case.get("splits", 0)
    ref = w4a16_reference(x.to(ctx.ref_device), w["u"], w["s"], w["z"], g)
    runs, refused = {}, {}
    for name, impl in W4A16_IMPLS.items():
        why = impl.rule(m, n, p.k_padded, g) or (None if impl.forced_splits or not splits else
                                                 "takes no forced split-K count")
        if why:
            refused[name] = why
        else:
            runs[name] = lambda impl=impl: impl.run(p, x, splits)
    row = {"k_padded": p.k_padded, **({"impls_refused": refused} if refused else {})}
    if not runs:
        return {**row, "ok": None, "skipped": "no implementation takes this case", "why": []}
    check_impls(row, runs, ref, TOL[case["dtype"]], EPS[case["dtype"]], ctx)
    if row["ok"] and case["timed"] and ctx.timer is not None:
        time_w4a16(row, ctx, w, x, list(runs), ref, case)
    return row


def time_w4a16(row: dict, ctx: Ctx, w: dict, x: Tensor, ours: list[str], ref: Tensor, case: dict) -> None:
    """Every implementation and baseline of one case, single-call and chained; then the row's summary fields."""
    p, m, n = w["p"], case["M"], case["N"]
    time_layer(row, ctx, BF16, lambda W: F.linear(x, W), w["dense"])
    for name in ours:
        time_layer(row, ctx, name, lambda q, impl=W4A16_IMPLS[name]: impl.run(q, x, 0), p, ours=True)
    time_layer(row, ctx, DEQUANT, lambda q: dequant_matmul(q, x), w["dequant"])
    tg = w["tinygemm"]
    if isinstance(tg, str):
        row.setdefault("baselines", {})[TINYGEMM] = {"ok": None, "skipped": tg}
    elif check_baseline(row, TINYGEMM, lambda: gpu.linear_tinygemm(tg, x, None), ref, TOL[case["dtype"]],
                        EPS[case["dtype"]], ctx):
        time_layer(row, ctx, TINYGEMM, lambda q: gpu.linear_tinygemm(q, x, None), tg)
    if ctx.device.type == "cuda" and "v1" in ours:  # the automatic split-K count, and v1 without it, in the same run
        row["splits"] = ops._auto_splits(m, n, p.k_padded, ctx.device.index or 0)
        if row["splits"] > 1:
            time_layer(row, ctx, "v1 unsplit", lambda q: gpu.linear_w4a16(q, x, None, 1), p, ours=True, chain=False)
    # summary: single-call (v1 first, as before) and chain (the bars: the fastest of ours) against bf16
    first, dense, dense_c = ours[0], p50(row, BF16, "single"), p50(row, BF16, "chain")
    by_impl = {nm: ratio(dense_c, p50(row, nm, "chain")) for nm in ours if p50(row, nm, "chain")}
    best = max(by_impl, key=by_impl.get) if dense_c and by_impl else first
    row.update(us=p50(row, first, "single"), dense_us=dense, vs_dense=ratio(dense, p50(row, first, "single")),
               best_impl=best, chain_us=p50(row, best, "chain"), chain_dense_us=dense_c,
               chain_vs_dense=ratio(dense_c, p50(row, best, "chain")), chain_vs_dense_by_impl=by_impl,
               best_single_vs_dense=max((ratio(dense, p50(row, nm, "single")) or 0.0 for nm in ours), default=None),
               dequant_matmul_us=p50(row, DEQUANT, "single"),
               chain_vs_dense_baselines={b: ratio(dense_c, p50(row, b, "chain")) for b in (TINYGEMM, DEQUANT)
                                         if p50(row, b, "chain")})
    if "splits" in row:
        row["us_no_split"] = p50(row, "v1 unsplit", "single") if row["splits"] > 1 else p50(row, "v1", "single")
    # the dispatcher's choice: its candidates on a GPU (ours, torch's tinygemm where it was accurate, the reference
    # path), the fastest in chain mode
    tg_ok = row.get("baselines", {}).get(TINYGEMM, {}).get("ok") is True
    cands = [c for c in ours + [DEQUANT] + [TINYGEMM] * tg_ok if p50(row, c, "chain")]
    if cands and dense_c:
        choice = min(cands, key=lambda c: p50(row, c, "chain"))
        row.update(dispatch_choice=choice, dispatch_vs_dense=ratio(dense_c, p50(row, choice, "chain")),
                   dispatch_vs_dense_single=ratio(dense, min(p50(row, c, "single") for c in cands)))


def _fp8_weight(case: dict, ctx: Ctx) -> dict:
    n, k = case["N"], case["K"]
    gen = ctx.gen(case["family"], "weight", case["spec"])
    w = torch.randn(n, k, generator=gen, device=ctx.device) * 0.05
    per_col = case["scales"].endswith("channel")
    b_scale = (w.abs().amax(dim=1) / 448).clamp(min=1e-12) if per_col else (w.abs().amax() / 448).reshape(1)
    b = (w / b_scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = {"b": b, "sb": b_scale.float().contiguous()}
    if case["path"] == "layer" or (case["timed"] and per_col):
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
    rd = ctx.ref_device
    ref = fp8_reference(a.to(rd), b.to(rd), sa.to(rd), sb.to(rd))
    row: dict = {}
    if case["path"] == "layer":  # our quantize kernel + our GEMM, K padded: what a W8A8 layer runs
        runs = {name: (lambda impl=impl: impl.run(w["layer"], x)) for name, impl in FP8_LAYER_IMPLS.items()
                if impl.rule(m, n, k, 0) is None}
    else:
        runs = {FP8_GEMM: lambda: ops.fp8_gemm(a, b, sa, sb)}
    if not runs:
        return {"ok": None, "skipped": "no implementation takes this case", "why": []}
    check_impls(row, runs, ref, TOL["fp8"], EPS["bfloat16"], ctx)
    if row["ok"] and case["timed"] and ctx.timer is not None:
        time_fp8(row, ctx, w, x, a, sa, ref, case)
    return row


def time_fp8(row: dict, ctx: Ctx, w: dict, x: Tensor, a: Tensor, sa: Tensor, ref: Tensor, case: dict) -> None:
    """Our GEMM, torch._scaled_mm in both accumulation modes and, with per-token activations, the W8A8 layers
    (ours, and torch's quantize + _scaled_mm), single-call and chained; then the row's summary fields."""
    n, k, m = case["N"], case["K"], case["M"]
    b, sb = w["b"], w["sb"]
    per_row = case["scales"] == "row x channel"
    # torch._scaled_mm takes rowwise scales as [M, 1] and [1, N], per-tensor ones as scalars, b column-major
    sa2 = sa.reshape(m, 1).contiguous() if per_row else sa.reshape(())
    sb2 = sb.reshape(1, n).contiguous() if per_row else sb.reshape(())
    time_layer(row, ctx, BF16, lambda W: F.linear(x, W), w["dense"])
    time_layer(row, ctx, FP8_GEMM, lambda o: ops.fp8_gemm(a, o[0], sa, o[1]), (b, sb), ours=True)
    for label, fast in ((SCALED_MM, False), (SCALED_MM_FAST, True)):
        def scaled(o, fast=fast):
            return torch._scaled_mm(a, o[0], scale_a=sa2, scale_b=o[1], out_dtype=torch.bfloat16, use_fast_accum=fast)
        if check_baseline(row, label, lambda: scaled((b.t(), sb2)), ref, TOL["fp8"], EPS["bfloat16"], ctx):
            time_layer(row, ctx, label, scaled, (b.t(), sb2))
    layers = []
    if per_row:  # the W8A8 layer: per-token quantize + GEMM, each of ours checked on this case, then torch's
        for name, impl in FP8_LAYER_IMPLS.items():
            if impl.rule(m, n, k, 0) is None:
                y, y2 = run_twice(lambda: impl.run(w["layer"], x), ctx.device)
                judge_into(row, f"layer {name}", judge(y.to(ctx.ref_device), y2.to(ctx.ref_device), ref, TOL["fp8"],
                                                       EPS["bfloat16"]))
                layers.append(name)
        if not row["ok"]:
            return
        for name in layers:
            time_layer(row, ctx, f"layer {name}", lambda q, impl=FP8_LAYER_IMPLS[name]: impl.run(q, x), w["layer"],
                       ours=True)
        theirs = gpu.ScaledMM(b.t(), sb.reshape(1, n).contiguous(), None, torch.bfloat16)
        time_layer(row, ctx, TORCH_LAYER, lambda q: gpu.linear_scaled_mm(q, x, None), theirs)
    dense, dense_c = p50(row, BF16, "single"), p50(row, BF16, "chain")
    us, chain_us = p50(row, FP8_GEMM, "single"), p50(row, FP8_GEMM, "chain")
    row.update(us=us, dense_us=dense, vs_dense=ratio(dense, us), chain_us=chain_us, chain_dense_us=dense_c,
               chain_vs_dense=ratio(dense_c, chain_us), scaled_mm_us=p50(row, SCALED_MM, "single"),
               vs_scaled_mm=ratio(p50(row, SCALED_MM, "single"), us),
               chain_vs_scaled_mm=ratio(p50(row, SCALED_MM, "chain"), chain_us),
               chain_vs_scaled_mm_fast_accum=ratio(p50(row, SCALED_MM_FAST, "chain"), chain_us))
    by_impl = {nm: ratio(dense_c, p50(row, f"layer {nm}", "chain")) for nm in layers
               if p50(row, f"layer {nm}", "chain")}
    if by_impl and dense_c:
        best = max(by_impl, key=by_impl.get)
        lus = p50(row, f"layer {best}", "single")
        row.update(layer_impl=best, layer_us=lus, layer_vs_dense=ratio(dense, lus),
                   chain_layer_us=p50(row, f"layer {best}", "chain"), chain_layer_vs_dense=by_impl[best],
                   chain_layer_vs_dense_by_impl=by_impl, scaled_mm_layer_us=p50(row, TORCH_LAYER, "single"),
                   chain_scaled_mm_layer_vs_dense=ratio(dense_c, p50(row, TORCH_LAYER, "chain")))


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
        row["timings"] = {"fp8 quantize": {"single": ctx.timer.single(lambda: ops.fp8_quantize_rows(x))}}
        row["quantize_us"] = row["timings"]["fp8 quantize"]["single"]["p50"]
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
          plant: str | None, flush: str = "read", chain_repeats: int = CHAIN_REPEATS) -> int:
    if dry:
        torch.set_num_threads(1)
    device = torch.device("cpu" if dry else "cuda")
    under_sanitizer = family.startswith("sanitizer:")
    # under compute-sanitizer the references run on the CPU: cuBLAS would be instrumented too, for minutes
    timer = None if under_sanitizer else Timer(device, 2 if dry else repeats, flush, 2 if dry else chain_repeats)
    ctx = Ctx(device, torch.device("cpu") if under_sanitizer else device, timer, seed)
    cases = family_cases(family, dry, quick)
    if timer is not None and start == 0:  # what this process's timings carry, before its first case
        try:
            found = harness(timer, device)
        except Exception as e:  # noqa: BLE001 - recorded; the cases still run
            found = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        emit(results, {"event": "harness", "family": family, **found})
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
               "--chain-repeats", str(self.args.chain_repeats), "--flush", self.args.flush]
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
    families = [f for f, syms in KERNEL_SYMBOLS.items() if any(sym in text for sym in syms)]
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


# The bars, in chain mode (what a decode step sees): (name, (N, K), M, at least) for our fastest W4A16
# implementation against bf16 F.linear on bf16 group-128 weights; the dispatcher's choice at every timed M up to
# DISPATCH_BAR's; our fastest fp8 W8A8 layer (per-token quantize + GEMM) on every shape at FP8_LAYER_BAR's M.
W4A16_BARS = (("w4a16_decode_large", (8192, 28672), 1, 3.0), ("w4a16_decode", (8192, 8192), 1, 2.6),
              ("w4a16_batch16", (8192, 8192), 16, 2.2))
DISPATCH_BAR = ("w4a16_dispatch", 4096, 0.9)
FP8_LAYER_BAR = ("fp8_layer_prefill", 4096, 1.4)


def bar_key(name: str, at_least: float) -> str:
    """The verdict key of a bar: w4a16_decode, 2.6 -> w4a16_decode_ge_2_6x."""
    return f"{name}_ge_{format(at_least, 'g').replace('.', '_')}x"


def _bar(out: dict, details: dict, name: str, at_least: float, rows: list[dict], value: str, impl: str,
         by_impl: str | None, single: str, baselines: str | None = None) -> None:
    """Bar `name` over `rows`: its value is the smallest row[value] (each row's best implementation, chained); the
    detail names the case it came from and its implementation (row[impl]), gives per implementation (row[by_impl])
    and per baseline the smallest ratio too, and the single-call ratio (row[single]) beside it."""
    worst = min(rows, key=lambda r: r[value])
    per_impl: dict[str, float] = {}
    for r in rows:
        for src in ([by_impl] if by_impl else []) + ([baselines] if baselines else []):
            for k, v in (r.get(src) or {}).items():
                if v is not None:
                    per_impl[k] = min(per_impl.get(k, v), v)
    singles = [r[single] for r in rows if r.get(single) is not None]
    out[bar_key(name, at_least)] = worst[value] >= at_least
    out[f"{name}_vs_bf16"] = worst[value]
    details[name] = {"value": worst[value], "at_least": at_least, "mode": "chain", "at": worst["case"],
                     "impl": worst.get(impl),
                     "per_implementation": per_impl, "single_call": min(singles) if singles else None,
                     "rows": len(rows)}


def verdicts(rows: list[dict]) -> dict:
    """The issue's bars (W4A16_BARS, DISPATCH_BAR, FP8_LAYER_BAR), from chain-mode timings of rows that passed
    correctness only; the bars of a kernel family with any failed case are NOT_EVALUATED, those with no measured rows
    absent. Each bar gives <name>_ge_<at least>x (pass / fail) and <name>_vs_bf16 (the value); bar_details has
    where it came from, each implementation's and baseline's own value, and the single-call ratio beside it."""
    failed = failed_kernels(rows)
    timed = [r for r in rows if r.get("ok") and r.get("chain_vs_dense") is not None]
    bad_baselines: dict[str, int] = {}
    for r in rows:
        for name, b in (r.get("baselines") or {}).items():
            if b.get("ok") is False:
                bad_baselines[name] = bad_baselines.get(name, 0) + 1
    out = {"all_correct": not failed and not any(r.get("not_run") for r in rows),
           "complete": not any(r.get("not_run") for r in rows), "failed_cases": failed,
           "inaccurate_baselines": bad_baselines}
    details: dict[str, dict] = {}
    if failed.get("w4a16"):
        for name, *_, at_least in W4A16_BARS + (DISPATCH_BAR,):
            out[bar_key(name, at_least)] = NOT_EVALUATED
    else:
        w4 = [r for r in timed if r["kernel"] == "w4a16"]
        for name, shape, m, at_least in W4A16_BARS:
            sel = [r for r in w4 if (r["N"], r["K"]) == shape and r["M"] == m and r["dtype"] == "bfloat16"
                   and r["group"] == 128 and not r.get("zeros")]
            if sel:
                _bar(out, details, name, at_least, sel, "chain_vs_dense", "best_impl", "chain_vs_dense_by_impl",
                     "best_single_vs_dense", "chain_vs_dense_baselines")
        name, max_m, at_least = DISPATCH_BAR
        disp = [r for r in w4 if r["M"] <= max_m and r.get("dispatch_vs_dense") is not None]
        if disp:
            _bar(out, details, name, at_least, disp, "dispatch_vs_dense", "dispatch_choice", None,
                 "dispatch_vs_dense_single")
    name, m, at_least = FP8_LAYER_BAR
    if failed.get("fp8_gemm") or failed.get("fp8_quantize"):  # a W8A8 layer runs both kernels
        out[bar_key(name, at_least)] = NOT_EVALUATED
    else:
        f8 = [r for r in timed if r["kernel"] == "fp8_gemm" and r["M"] == m]
        layers = [r for r in f8 if r.get("chain_layer_vs_dense") is not None]
        if layers:  # the layer's time includes the per-token quantize kernel
            _bar(out, details, name, at_least, layers, "chain_layer_vs_dense", "layer_impl",
                 "chain_layer_vs_dense_by_impl", "layer_vs_dense")
        for key, field in (("fp8_gemm_prefill_vs_bf16", "chain_vs_dense"),
                           ("fp8_gemm_prefill_vs_scaled_mm", "chain_vs_scaled_mm"),
                           ("fp8_gemm_prefill_vs_scaled_mm_fast_accum", "chain_vs_scaled_mm_fast_accum")):
            vals = [r[field] for r in f8 if r.get(field) is not None]
            if vals:  # not bars: where our GEMM stands against bf16 and cuBLASLt's two accumulation modes
                out[key] = min(vals)
    out["bar_details"] = details
    return out


def summarize(run: Run, env: dict) -> dict:
    records = read_results(run.results)
    rows = [r for r in records if "event" not in r]
    graphed = {"yes": 0, "no": 0}
    found: dict[str, dict] = {}
    for r in records:
        if r.get("event") == "timer":
            graphed = {k: graphed[k] + r["graphed"][k] for k in graphed}
        if r.get("event") == "harness":
            found[r["family"]] = {k: v for k, v in r.items() if k not in ("event", "family")}
    result = {"env": env, "build": env.get("build"), "harness": found, "rows": rows, "verdicts": verdicts(rows),
              "seconds": round(time.monotonic() - run.t0, 1), "budget_s": run.args.budget,
              "timing": {"graphed_calls": graphed, "repeats": run.args.repeats, "chain_repeats": run.args.chain_repeats,
                         "l2_flush_mib": 256, "time_cap_s": TIME_CAP_S, "min_samples": MIN_SAMPLES,
                         "chain_min_copies": CHAIN_MIN_COPIES, "chain_max_copies": CHAIN_MAX_COPIES,
                         "chain_cap_bytes": CHAIN_CAP_BYTES},
              "tolerances": {"whole_matrix": TOL, "tile_factor": TILE_TOL_FACTOR, "tile": TILE,
                             "element_eps": ELEM_EPS, "eps": EPS}}
    (run.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (run.out / "gpu_check.md").write_text(markdown(result))
    return result


def _fmt(v, spec=".1f") -> str:
    return "—" if v is None else format(v, spec)


def _stats(t: dict | None) -> str:
    return "—" if not t else f"{t['p50']:.1f} ({t['p10']:.1f}–{t['p90']:.1f})"


def markdown(result: dict) -> str:
    env, rows, v = result["env"], result["rows"], result["verdicts"]
    lines = [f"# GPU kernel check — {env['date']}, {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), "
             f"commit {env['commit']}, seed {env['seed']}", "",
             f"Build: {result['build']}. Wall time {result['seconds']} s of a {result['budget_s']} s budget.", "",
             "Times are µs, p50 (p10–p90). Single call: one call replayed from a CUDA graph, L2 flushed by a "
             f"{env.get('l2_flush', 'write')} of 256 MiB before each: it carries the harness floor below. Chain: one "
             "CUDA graph calling the layer on distinct weight copies (together at least twice the L2) back to back, "
             "time per layer, as a decode step runs its layers: the bars use it.", "",
             "## Harness", "",
             "| family | floor, single call | floor per call, chained | device-to-device copy | L2 |",
             "|---|---|---|---|---|"]
    for fam, h in result.get("harness", {}).items():
        if "error" in h:
            lines.append(f"| {fam} | {h['error']} | | | |")
            continue
        l2 = "—" if not h.get("l2_bytes") else f"{h['l2_bytes'] / 2 ** 20:.0f} MiB"
        lines.append(f"| {fam} | {_stats(h['floor_us'])} | {_stats(h['chain_floor_us'])} | "
                     f"{h['copy_tbps']:.2f} TB/s ({h['copy_bytes'] / 2 ** 30:.2f} GiB read + written in "
                     f"{_stats(h['copy_us'])} µs) | {l2} |")
    lines += ["", "## Bars", ""]
    details = v.get("bar_details", {})
    for k, val in v.items():
        if k == "bar_details":
            continue
        name = next((n for n in details if k.startswith(n + "_ge_")), None)
        if name is None:
            lines.append(f"- {k}: {val}")
            continue
        d = details[name]
        per = "".join(f"; {i} {r:.2f}×" for i, r in d["per_implementation"].items())
        lines.append(f"- {k}: {val} — {d['value']:.2f}× bf16 (chain; at least {d['at_least']:g}×) at {d['at']}, "
                     f"{d['impl']}; single call {_fmt(d['single_call'], '.2f')}×{per}")
    lines += ["", "## Failures", ""]
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
              "| case | rel. err | worst tile (err) | bad | same twice | ok | µs | bf16 µs | ×bf16 | chain ×bf16 "
              "| other |",
              "|---|---:|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        other = r.get("verdict") or r.get("refused") or r.get("not_run") or r.get("skipped") or ""
        if r.get("kernel") == "w4a16" and r.get("us") is not None:
            other = f"best {r['best_impl']}; dequant+matmul {_fmt(r['dequant_matmul_us'])} µs; dispatch → " \
                    f"{r.get('dispatch_choice')}"
            if r.get("splits", 1) > 1:
                other += f"; split-K {r['splits']} (unsplit {_fmt(r.get('us_no_split'))} µs)"
        elif r.get("kernel") == "fp8_gemm" and r.get("us") is not None:
            other = f"_scaled_mm {_fmt(r.get('scaled_mm_us'))} µs"
            if r.get("layer_us") is not None:
                other += (f"; layer (quantize + GEMM) {r['layer_us']:.1f} µs, chain "
                          f"{_fmt(r.get('chain_layer_vs_dense'), '.2f')}× bf16, torch layer "
                          f"{_fmt(r.get('scaled_mm_layer_us'))} µs")
        elif r.get("kernel") == "fp8_quantize" and "wrong_codes" in r:
            other = f"{r['wrong_codes']} wrong codes"
            if r.get("quantize_us") is not None:
                other += f"; {_stats(r['timings']['fp8 quantize']['single'])} µs ({r['quantize_tbps']:.2f} TB/s)"
        for name, b in (r.get("baselines") or {}).items():
            if b.get("ok") is False:
                other += f"; baseline {name} inaccurate: {'; '.join(b['why'])}"
        tile = f"{r['worst_tile'][0]},{r['worst_tile'][1]} ({r['tile_err']:.1e})" if "tile_err" in r else "—"
        ok = {True: "yes", False: "NO", None: "—"}[r.get("ok")]
        same = {True: "yes", False: "NO", None: "—"}[r.get("deterministic")]
        lines.append(f"| {r['case']} | {_fmt(r.get('rel_err'), '.1e')} | {tile} | {r.get('bad', '—')} | {same} "
                     f"| {ok} | {_fmt(r.get('us'))} | {_fmt(r.get('dense_us'))} | {_fmt(r.get('vs_dense'), '.2f')} "
                     f"| {_fmt(r.get('chain_vs_dense'), '.2f')} | {other} |")
    lines += ["", "## Timings", "",
              "Every implementation and baseline of every timed case (µs, p50 (p10–p90); chain: per layer).", "",
              "| case | implementation | single call | chain | copies | ×bf16 single | ×bf16 chain |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for name, t in (r.get("timings") or {}).items():
            c = t.get("chain")
            lines.append(f"| {r['case']} | {name} | {_stats(t.get('single'))} | {_stats(c)} | "
                         f"{c['copies'] if c else '—'}{' (' + c['note'] + ')' if c and c.get('note') else ''} | "
                         f"{_fmt(ratio(p50(r, BF16, 'single'), t['single']['p50']), '.2f')} | "
                         f"{_fmt(ratio(p50(r, BF16, 'chain'), c['p50'] if c else None), '.2f')} |")
        for name, e in (r.get("timing_errors") or {}).items():
            lines.append(f"| {r['case']} | {name} | {e} | | | | |")
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
    ap.add_argument("--repeats", type=int, default=30, help="single-call samples per measurement (Timer)")
    ap.add_argument("--chain-repeats", type=int, default=CHAIN_REPEATS,
                    help=f"replays of a chain's graph per measurement (default {CHAIN_REPEATS})")
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
                     args.plant, args.flush, args.chain_repeats)

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
    print(f"\nbars: {json.dumps({k: val for k, val in v.items() if k not in ('failed_cases', 'bar_details')})}")
    failures = [r for r in result["rows"] if r.get("ok") is False]
    for r in failures:
        print(f"FAILED {r['case']}: {'; '.join(r['why'])}")
    print(f"{len(result['rows'])} rows, {len(failures)} failed, {result['seconds']} s; results in {out}")
    return 0 if v["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
