"""Sweep the W4A16 kernel's split-K count on the model shapes and compare the automatic choice with the best one.

    python bench/w4a16_splits.py --out DIR       # on a GPU: about 30 s after the extension is built
    python bench/w4a16_splits.py --dry-run       # CPU: small shapes through the op's reference path (times mean nothing)
    COMPRESS_CUDA_FLAGS="-DCOMPRESS_W4A16_SPLIT_NS=2" COMPRESS_CUDA_BUILD_DIR=/tmp/ns2 \
        python bench/w4a16_splits.py --tag ns2 --ms 1,16    # a tuning build of the split-K blocks (w4a16.cu macros)

For each (N, K) of SHAPES (gpu_check.SHAPES but its Llama-3-70B ones, whose sweep the GPU session has no time for)
and M in MS: bf16 `F.linear` (cuBLAS) on the dequantized weight, then the kernel
at every split count in SPLITS that K allows (forced through the op's `splits` argument), each timed as gpu_check
times (CUDA graph replay, L2 flushed before each call, median), and checked against the unsplit output (split-K only
reorders fp32 sums: relative difference < 1e-2, else the row says so). Writes w4a16_splits.json and prints a table:
the automatic count (ops._auto_splits, i.e. prepack.w4a16_splits for this device), the best count and their times.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from datetime import date
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.kernels import cuda_ext, gpu, ops  # noqa: E402

_spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parent / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

MS = (1, 4, 16, 32, 64)
SHAPES = tuple(s for s in gpu_check.SHAPES if s not in gpu_check.LARGE_SHAPES)
SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
DRY_SHAPES, DRY_MS, DRY_SPLITS = ((64, 1280),), (1, 3), (1, 2, 6)


def sweep(shapes, ms, splits, device, repeats: int, flush: str = "read") -> list[dict]:
    timer = gpu_check.Timer(device, repeats, flush)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in shapes:
        u = torch.randint(0, 16, (n, k), generator=gen)
        scales = torch.rand(n, k // 128, generator=gen) * 0.02 + 0.001
        p = gpu.pack_w4a16(u, scales, None, 128, torch.bfloat16, device)
        dense = ((u.double() - 8) * scales.bfloat16().double().repeat_interleave(128, 1)).bfloat16().to(device)
        for m in ms:
            x = (torch.randn(m, k, generator=gen) * 0.5).bfloat16().to(device)
            base = gpu.linear_w4a16(p, x, None, 1).double()
            row = {"N": n, "K": k, "M": m, "bf16_us": timer(lambda: F.linear(x, dense)), "us": {}, "mismatch": []}
            if device.type == "cuda":
                row["auto"] = ops._auto_splits(m, n, p.k_padded, device.index or 0)
            for s in splits:
                if s > p.k_padded // 128:
                    continue
                y = gpu.linear_w4a16(p, x, None, s).double()
                if ((y - base).norm() / base.norm()).item() > 1e-2:
                    row["mismatch"].append(s)
                row["us"][s] = timer(lambda: gpu.linear_w4a16(p, x, None, s))
            best = min(row["us"], key=row["us"].get)
            row.update(best=best, best_us=row["us"][best])
            rows.append(row)
            auto = row.get("auto")
            print(f"{n}x{k} M={m}: bf16 {row['bf16_us']:.1f} µs, unsplit {row['us'][1]:.1f}, best s={best} "
                  f"{row['best_us']:.1f} ({row['bf16_us'] / row['best_us']:.2f}x bf16), auto s={auto} "
                  f"{row['us'].get(auto, float('nan')):.1f}"
                  + (f"; MISMATCH at splits {row['mismatch']}" if row["mismatch"] else ""), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, small shapes, reference path, meaningless times")
    ap.add_argument("--out", help="output folder (default $OUT, else bench/results)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--flush", choices=("read", "write"), default="read", help="L2 flush before each call (Timer)")
    ap.add_argument("--tag", default="", help="suffix of the results file (a tuning build's name)")
    ap.add_argument("--ms", help=f"comma-separated M values (default {','.join(map(str, MS))})")
    ap.add_argument("--splits", help=f"comma-separated split counts (default {','.join(map(str, SPLITS))})")
    args = ap.parse_args(argv)
    if args.dry_run:
        device, shapes, ms, splits = torch.device("cpu"), DRY_SHAPES, DRY_MS, DRY_SPLITS
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        ext = cuda_ext.load()
        if not ext.ok:
            print(ext.reason, file=sys.stderr)
            return 1
        device, shapes, ms, splits = torch.device("cuda", 0), SHAPES, MS, SPLITS
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else ms
    splits = tuple(int(v) for v in args.splits.split(",")) if args.splits else splits
    rows = sweep(shapes, ms, splits, device, 3 if args.dry_run else args.repeats, args.flush)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    env = {"date": date.today().isoformat(), "commit": gpu_check.commit(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
           "nvcc_flags": os.environ.get("COMPRESS_CUDA_FLAGS", ""), "l2_flush": args.flush}
    name = f"w4a16_splits{'_' + args.tag if args.tag else ''}.json"
    (out / name).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    bad = [r for r in rows if r["mismatch"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
