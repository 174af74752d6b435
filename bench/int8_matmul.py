"""CPU int8 matmul paths against float F.linear at decode shapes, one thread, ratios from the same run.

Shapes: SmolLM2-135M's real linears (N x K: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536)
and 4096x4096; M = 1 and 16 tokens. Each figure is the median of --repeats timed batches after a warm-up.

    python bench/int8_matmul.py --out bench/results/int8_matmul.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compress.core.reference import linear_llm_int8, linear_w8a8_int8  # noqa: E402
from compress.quantizers.rtn import quantize_rtn  # noqa: E402
from compress.core.scheme import FP8_DYNAMIC, LLM_INT8, W8A8  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096)]  # (N, K)


def timeit(fn, repeats: int) -> float:
    """Median seconds per call; each sample times enough calls to last about 20 ms."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(0.02 / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/int8_matmul.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for m in (1, 16):
        for n, k in SHAPES:
            w = torch.randn(n, k) * 0.05
            x = torch.randn(m, k)
            x_out = x.clone()
            x_out[:, :4] *= 40  # four outlier features for the LLM.int8 row
            w_bf16, x_bf16 = w.bfloat16(), x.bfloat16()
            q8 = quantize_rtn(w, W8A8)
            qf8 = quantize_rtn(w, FP8_DYNAMIC)
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            paths = {
                "fp32 F.linear": lambda: torch.nn.functional.linear(x, w),
                "bf16 F.linear": lambda: torch.nn.functional.linear(x_bf16, w_bf16),
                "int8 _int_mm (codes only)": lambda: torch._int_mm(xq, q8.qdata.t()),
                "W8A8 linear (quantize x + _int_mm + scales)":
                    lambda: linear_w8a8_int8(x, q8.qdata, q8.scale, W8A8.act, None, None),
                "LLM.int8 linear, no outliers": lambda: linear_llm_int8(x, q8.qdata, q8.scale, 6.0, None, None),
                "LLM.int8 linear, 4 outlier features":
                    lambda: linear_llm_int8(x_out, q8.qdata, q8.scale, 6.0, None, None),
                "fp8 weight dequantize + fp32 matmul (reference)":
                    lambda: torch.nn.functional.linear(x, qf8.dequantize()),
            }
            times = {name: timeit(fn, args.repeats) for name, fn in paths.items()}
            base = times["fp32 F.linear"]
            rows.append({"M": m, "N": n, "K": k, "seconds": times,
                         "vs_fp32": {name: base / t for name, t in times.items()}})
            print(f"M={m:<3} N={n:<5} K={k:<5} " + "  ".join(f"{name}: {base / t:.2f}x" for name, t in times.items()),
                  flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "threads": 1, "torch": torch.__version__,
              "note": "speed-up over fp32 F.linear (>1 = faster), median of repeats", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
