"""What verifying K drafted tokens costs a float32 target on this CPU: one linear layer's time at M = 1..16 rows
against M = 1, for torch's F.linear (MKL), for MKL's prepacked weights (torch.ops.mkl._mkl_linear) and for compress's
few-row kernel (kernels/cpu_rows.c, weights in strips of 32 columns), with the weights out of cache (40 layers of
SmolLM2's 1536 × 576 MLP shape cycled, 141 MB) as in a real decode step.
A memory-bound GPU pays about the one-row cost up to dozens of rows; speculative decoding's verify step depends on it.

    OMP_NUM_THREADS=1 python bench/verify_matmul.py [--out bench/results/verify_matmul.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from compress.kernels.cpu_rows import load, rows_linear

ROOT = Path(__file__).resolve().parent.parent
N, K, LAYERS = 1536, 576, 40


def _linear_of(w: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    return layer


def median_us(fn, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/verify_matmul.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = [torch.randn(N, K) for _ in range(LAYERS)]
    lib = load()
    strips = [rows_linear(_linear_of(w), lib) for w in weights]  # the same weights, repacked
    rows = []
    for m in (*range(1, 10), 12, 16):
        x = torch.randn(m, K)
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
        plain = median_us(lambda: [F.linear(x, w) for w in weights]) / LAYERS
        pre = median_us(lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(packed, weights)]) / LAYERS
        few = median_us(lambda: [r(x) for r in strips]) / LAYERS
        rows.append({"rows": m, "f_linear_us": plain, "mkl_packed_us": pre, "cpu_rows_us": few})
    base, base_rows = rows[0]["f_linear_us"], rows[0]["cpu_rows_us"]
    print("| rows | F.linear µs | vs 1 row | MKL prepacked µs | vs 1 row (F.linear) | few-row kernel µs | vs its 1 row |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rows']} | {r['f_linear_us']:.0f} | {r['f_linear_us'] / base:.2f}× | {r['mkl_packed_us']:.0f} | "
              f"{r['mkl_packed_us'] / base:.2f}× | {r['cpu_rows_us']:.0f} | {r['cpu_rows_us'] / base_rows:.2f}× |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = ROOT / args.out
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit, "shape": [N, K],
                               "layers_cycled": LAYERS, "threads": 1, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
