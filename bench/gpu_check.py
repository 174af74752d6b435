"""One GPU run that builds the CUDA extension, checks every kernel against the reference, and times it.

    python bench/gpu_check.py                 # on an H100 / H200: about 3-5 minutes, nothing to install
    python bench/gpu_check.py --dry-run       # on CPU: the same code paths on small shapes (the ops' reference
                                              # paths; its times mean nothing) - run by tests/test_gpu_check.py

What it does, in order (results go to $OUT when set, else bench/results/gpu_check/, as gpu_check.json + .md,
stamped with date, GPU, torch, CUDA and commit):
1. Builds compress/kernels/cuda with torch's JIT `load()` (cuda_ext.py; sm_90 as sm_90a) and records the time.
2. Correctness, on fresh random inputs (never zeros), the output memory poisoned with NaN before each call,
   against the float64 dequantize-then-matmul reference: W4A16 for bf16 and fp16, group 128 / 64 / 32 / per
   channel, symmetric and zero-point; fp8 W8A8 per-tensor and per-row/per-channel scales, and the per-token
   quantization kernel against its reference. M in {1, 2, 4, 8, 16, 32, 64, 128, 512, 4096} on the real model
   shapes N x K = 4096x4096, 8192x8192, 14336x4096 (up-projection) and 4096x14336 (down-projection).
   Tolerances (KERNELS.md): norm-relative error <= 1e-3 for fp16 W4A16, <= 5e-3 for bf16 (bf16 rounding of
   the weight and the output alone reaches ~2e-3), <= 1e-2 for fp8.
3. Timing with CUDA events, median of 30 calls after warm-up, each call replayed from a CUDA graph (so Python
   overhead is not timed) with L2 flushed (a 256 MiB write) before it so weights come from HBM, against bf16
   `F.linear` (cuBLAS) and, for fp8, `torch._scaled_mm` (cuBLASLt), all in the same run.
4. The issue's bars, evaluated and printed: W4A16 >= 3x bf16 at M <= 16 on 8192x8192; fp8 >= 1.5x bf16 at
   M = 4096 and within 10% of torch._scaled_mm; and the dispatcher's choice (fastest of our kernel and the
   dequantize-then-matmul reference) never slower than bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.kernels import cuda_ext, ops  # noqa: E402
from compress.kernels.fp8_layout import fp8_reference, fp8_quantize_rows_reference  # noqa: E402
from compress.kernels.prepack import prepack_w4a16, w4a16_reference  # noqa: E402

MS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)
SHAPES = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336))  # (N, K)
TOL_W4A16 = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
TOL_FP8 = 1e-2


def commit() -> str:
    env = os.environ.get("COMPRESS_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


class Timer:
    """CUDA events around the call only; L2 flushed before each call (CPU: perf_counter, for --dry-run).

    On CUDA the call is captured once in a CUDA graph and replayed, so the events time the GPU work, not the Python
    around a custom op (input checks, allocation: tens of µs, more than a decode-sized GEMM). Calls that cannot be
    captured are timed directly; `graphed` counts which were."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        self.flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        self.graphed = {"yes": 0, "no": 0}

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
                self.flush.zero_()
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


def poison(shape, dtype, device) -> None:
    """Fill a freed block of the output's size with NaN, so an output the kernel fails to write shows up."""
    if device.type == "cuda":
        torch.full(shape, float("nan"), dtype=dtype, device=device)  # freed at once; the allocator reuses it


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).norm() / ref.norm().clamp(min=1e-30))


def w4a16_cases(shapes, full: bool):
    """(N, K, dtype, group, zeros): every shape with bf16 g128 symmetric; variants on the first shape."""
    cases = [(n, k, torch.bfloat16, 128, False) for n, k in shapes]
    n, k = shapes[0]
    variants = [(torch.float16, 128, False), (torch.bfloat16, 128, True), (torch.bfloat16, 64, False),
                (torch.bfloat16, 32, True), (torch.bfloat16, -1, False), (torch.float16, -1, True)]
    return cases + [(n, k, dt, g, z) for dt, g, z in (variants if full else variants[:3])]


def check_w4a16(n, k, dtype, group, zeros, ms, device, timer, gen) -> list[dict]:
    g = k if group == -1 else group
    u = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001)
    z = torch.randint(0, 16, (n, k // g), generator=gen).float() if zeros else None
    p = prepack_w4a16(u, scales, z, group, dtype)
    wq, sc = p["wq"].to(device), p["scales"].to(device)
    zz = None if p["zeros"] is None else p["zeros"].to(device)
    # the reference uses the scales / zeros as the kernel sees them (rounded to the activation dtype)
    s_ref = p["scales"].t().double().to(device)
    z_ref = None if p["zeros"] is None else p["zeros"].t().double().to(device)
    u_dev = u.to(device)
    w_bf16 = ((u_dev.double() - (8.0 if z_ref is None else z_ref.repeat_interleave(g, 1))) *
              s_ref.repeat_interleave(g, 1)).to(dtype)  # the dense layer it replaces, same values
    rows = []
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 0.5).to(dtype).to(device)
        poison((m, n), dtype, device)
        y = ops.w4a16_gemm(x, wq, sc, zz, n, group)
        ref = w4a16_reference(x, u_dev, s_ref, z_ref, group)
        err = rel_err(y, ref)
        row = {"kernel": "w4a16", "N": n, "K": k, "M": m, "dtype": str(dtype).replace("torch.", ""),
               "group": group, "zeros": zeros, "rel_err": err, "ok": err <= TOL_W4A16[dtype]}
        if timer is not None:
            ours = timer(lambda: ops.w4a16_gemm(x, wq, sc, zz, n, group))
            dense = timer(lambda: F.linear(x, w_bf16))
            deq = timer(lambda: F.linear(x, ((u_dev.to(dtype) - (8 if zz is None else zz.t().repeat_interleave(g, 1)))
                                             * sc.t().repeat_interleave(g, 1))))
            best = min(ours, deq)
            row.update(us=ours, dense_us=dense, dequant_matmul_us=deq, vs_dense=dense / ours,
                       dispatch_vs_dense=dense / best, dispatch_choice="w4a16" if ours <= deq else "dequant+matmul")
        rows.append(row)
    return rows


def check_fp8(n, k, per_channel, ms, device, timer, gen) -> list[dict]:
    w = torch.randn(n, k, generator=gen) * 0.05
    b_scale = (w.abs().amax(dim=1) / 448).clamp(min=1e-12) if per_channel else (w.abs().amax() / 448).reshape(1)
    b = (w / b_scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    b_scale = b_scale.float().to(device)
    b_t = b.t()  # column-major view for torch._scaled_mm
    w_bf16 = (b.float() * b_scale.reshape(-1, 1)).to(torch.bfloat16)
    rows = []
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 0.5).to(torch.bfloat16).to(device)
        q, sa = ops.fp8_quantize_rows(x)
        q_ref, sa_ref = fp8_quantize_rows_reference(x)
        quant_ok = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))) and \
            bool(torch.allclose(sa, sa_ref, rtol=1e-6, atol=0))
        a_scale = sa if per_channel else sa.amax().reshape(1)
        a = q if per_channel else (x.float() / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        poison((m, n), torch.bfloat16, device)
        y = ops.fp8_gemm(a, b, a_scale, b_scale)
        err = rel_err(y, fp8_reference(a, b, a_scale, b_scale))
        row = {"kernel": "fp8", "N": n, "K": k, "M": m, "scales": "row x channel" if per_channel else "tensor",
               "rel_err": err, "quantize_exact": quant_ok, "ok": err <= TOL_FP8 and quant_ok}
        if timer is not None:
            # rowwise scales as [M, 1] and [1, N]; per-tensor as scalars (torch._scaled_mm's two accepted forms)
            sa2 = a_scale.reshape(m, 1).contiguous() if per_channel else a_scale.reshape(())
            sb2 = b_scale.reshape(1, n).contiguous() if per_channel else b_scale.reshape(())
            ours = timer(lambda: ops.fp8_gemm(a, b, a_scale, b_scale))
            dense = timer(lambda: F.linear(x, w_bf16))
            try:
                cublas = timer(lambda: torch._scaled_mm(a, b_t, scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16))
            except (RuntimeError, ValueError) as e:  # a scale layout this torch's _scaled_mm refuses
                cublas, row["scaled_mm_error"] = None, str(e)[:200]
            quant = timer(lambda: ops.fp8_quantize_rows(x))
            row.update(us=ours, quantize_us=quant, dense_us=dense, scaled_mm_us=cublas, vs_dense=dense / ours,
                       vs_dense_with_quantize=dense / (ours + quant),
                       vs_scaled_mm=None if cublas is None else cublas / ours)
        rows.append(row)
    return rows


def verdicts(rows: list[dict]) -> dict:
    """The issue's bars, from the measured rows (None where nothing was measured)."""
    timed = [r for r in rows if "us" in r]
    w4 = [r for r in timed if r["kernel"] == "w4a16" and (r["N"], r["K"]) == (8192, 8192) and r["M"] <= 16
          and r["dtype"] == "bfloat16" and r["group"] == 128]
    f8 = [r for r in timed if r["kernel"] == "fp8" and r["M"] == 4096]
    out = {"all_correct": all(r["ok"] for r in rows)}
    if w4:
        out["w4a16_min_speedup_m_le_16_8192"] = min(r["vs_dense"] for r in w4)
        out["w4a16_ge_3x"] = out["w4a16_min_speedup_m_le_16_8192"] >= 3.0
    disp = [r["dispatch_vs_dense"] for r in timed if r["kernel"] == "w4a16"]
    if disp:
        out["w4a16_dispatch_min_vs_dense"] = min(disp)
        out["w4a16_dispatch_never_slower"] = min(disp) >= 1.0
    if f8:
        out["fp8_min_speedup_m4096"] = min(r["vs_dense"] for r in f8)
        out["fp8_ge_1_5x"] = out["fp8_min_speedup_m4096"] >= 1.5
        ratios = [r["vs_scaled_mm"] for r in f8 if r.get("vs_scaled_mm") is not None]
        if ratios:
            out["fp8_min_vs_scaled_mm_m4096"] = min(ratios)
            out["fp8_within_10pct_of_scaled_mm"] = min(ratios) >= 0.9
    return out


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# GPU kernel check — {env['date']}, {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), "
             f"commit {env['commit']}", "", f"Build: {result['build']}", "",
             "| kernel | N×K | M | dtype / scales | group | rel. error | ok | µs | bf16 µs | ×bf16 | other |",
             "|---|---|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        what = r.get("dtype", r.get("scales"))
        other = ""
        if r["kernel"] == "w4a16" and "us" in r:
            other = f"dequant+matmul {r['dequant_matmul_us']:.1f} µs; dispatch → {r['dispatch_choice']}"
        elif r["kernel"] == "fp8" and "us" in r:
            sm = r.get("scaled_mm_us")
            other = (f"_scaled_mm {sm:.1f} µs ({r['vs_scaled_mm']:.2f}×)" if sm else "_scaled_mm n/a") + \
                f"; quantize {r['quantize_us']:.1f} µs"
        us = f"{r['us']:.1f}" if "us" in r else "—"
        dense = f"{r['dense_us']:.1f}" if "us" in r else "—"
        vs = f"{r['vs_dense']:.2f}" if "us" in r else "—"
        lines.append(f"| {r['kernel']} | {r['N']}×{r['K']} | {r['M']} | {what} | {r.get('group', '—')}"
                     f"{' +z' if r.get('zeros') else ''} | {r['rel_err']:.1e} | {'yes' if r['ok'] else 'NO'} | "
                     f"{us} | {dense} | {vs} | {other} |")
    lines += ["", "Bars: " + json.dumps(result["verdicts"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, small shapes, reference paths, no timing")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer W4A16 variants and M values")
    ap.add_argument("--out", help="output folder (default $OUT, else bench/results/gpu_check)")
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(int(time.time()))  # fresh inputs every run
    if args.dry_run:
        device, shapes, ms = torch.device("cpu"), ((64, 256), (96, 128)), (1, 3, 16)
        timer = Timer(device, 2)  # exercises the timing code; CPU times of reference paths mean nothing
        build = "dry run on CPU: ops' reference paths, nothing built"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device, shapes, ms = torch.device("cuda"), SHAPES, MS if not args.quick else (1, 16, 64, 4096)
        ext = cuda_ext.load()
        build = f"built in {ext.build_seconds:.0f} s" if ext.ok else f"FAILED: {ext.reason}"
        print(build, flush=True)
        if not ext.ok:
            (out / "gpu_check.json").write_text(json.dumps({"build": build}, indent=1))
            return 1
        timer = Timer(device, args.repeats)
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    env = {"date": date.today().isoformat(), "commit": commit(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "gpu": props.name if props else "cpu (dry run)",
           "sm": f"{props.major}{props.minor}" if props else None}
    rows, t0 = [], time.perf_counter()
    for n, k, dtype, group, zeros in w4a16_cases(shapes, full=not args.quick):
        rows += check_w4a16(n, k, dtype, group, zeros, ms, device, timer, gen)
        print(f"w4a16 {n}x{k} {dtype} g{group}{' +z' if zeros else ''}: "
              f"{'ok' if all(r['ok'] for r in rows[-len(ms):]) else 'ERRORS'} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    fp8_ok = device.type == "cpu" or (props.major, props.minor) >= (8, 9)
    if fp8_ok:
        for n, k in shapes:
            for per_channel in (True, False):
                rows += check_fp8(n, k, per_channel, ms, device, timer, gen)
                print(f"fp8 {n}x{k} {'row x channel' if per_channel else 'tensor'}: "
                      f"{'ok' if all(r['ok'] for r in rows[-len(ms):]) else 'ERRORS'} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {"env": env, "build": build, "rows": rows, "verdicts": verdicts(rows),
              "timing": {"graphed_calls": timer.graphed, "repeats": timer.repeats, "l2_flush_mib": 256},
              "fp8": "checked" if fp8_ok else "skipped: needs sm_89 or newer"}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["verdicts"]["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
