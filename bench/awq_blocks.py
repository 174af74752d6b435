"""The calibration pass of a recipe on the first few decoder blocks of the embedded model: each compress phase's
seconds (the run's profile) and a checksum of the compressed weights, so that a faster version of a stage can be
timed against the old one in minutes and shown to give the same tensors (the same checksum) or not.

    python bench/awq_blocks.py --blocks 6                       # recipes/awq_int4.yaml on blocks 0-5
    python bench/awq_blocks.py --blocks 6 --profile             # and the top operators of every thread

The evaluation is cut to one 128-token window (its figures mean nothing here); the calibration is the recipe's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PHASES = ("capture", "float forward", "statistics", "solves", "compressed forward")


def checksum(model: torch.nn.Module) -> float:
    """Sum of |w| over every weight of the compressed blocks, dequantized at float64 (equal tensors: equal sums)."""
    from compress.core.nn import QuantLinear
    total = 0.0
    for m in model.model.layers.modules():
        if isinstance(m, QuantLinear):
            total += float(m.qtensor().dequantize(torch.float64).abs().sum())
        elif isinstance(m, torch.nn.Linear):
            total += float(m.weight.double().abs().sum())
    return total


def main() -> None:
    import compress
    from compress.model.load import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "awq_int4.yaml"))
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--profile", action="store_true", help="print the top operators (torch.profiler, all threads)")
    ap.add_argument("--out", help="append the result as a JSON line to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("default")
    model = loaded.model.float()
    model.model.layers = model.model.layers[:args.blocks]
    model.config.num_hidden_layers = args.blocks
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.__enter__()
    result = compress.compress(model, loaded.tokenizer, args.recipe, progress=False, log=lambda *a: None,
                               overrides=["eval.max_windows=1", "eval.seq_len=128", "eval.speed=false",
                                          "eval.samples=0"])
    if prof:
        prof.__exit__(None, None, None)
    wall = time.perf_counter() - t0
    phases = {p["phase"]: p["seconds"] for p in result.report.data["profile"]["phases"]}
    row = {"recipe": Path(args.recipe).name, "blocks": args.blocks, "threads": args.threads,
           "wall_s": round(wall, 2), **{p: phases.get(p, 0.0) for p in PHASES},
           "checksum": round(checksum(result.model), 6)}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    if prof:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
