"""Seconds per AutoRound step on one decoder block of the embedded model: the block's inputs and float outputs on a
few random-token windows (the same work per step as calibration text), captured under the pass's bf16 autocast, then
`tune_block` for a few steps, timed. Prints seconds per step and a checksum of the last step's codes (not the best
step's, which on random tokens is often the first: every step counts; two code versions that compute the same thing
give the same checksum), and with --profile the top operators.

    python bench/autoround_step.py --steps 6 --threads 2
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from compress.core.scheme import QuantScheme
    from compress.model.load import load_model
    from compress.quantizers.autoround import AutoRoundOptions, BlockSamples, tune_block

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("default").model.float()
    block = model.model.layers[args.block]
    windows = max(args.batch_size * 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (windows, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    samples = BlockSamples([], [], [])

    def hook(_m, a, kw, out):
        samples.hidden.append((a[0] if a else kw["hidden_states"]).detach())
        samples.kwargs.append({k: v for k, v in kw.items() if k != "hidden_states"})
        samples.target.append((out[0] if isinstance(out, tuple) else out).detach())

    h = block.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for w in ids:
            model(w[None], use_cache=False)
    h.remove()
    weights = {n: m.weight.detach() for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    scheme = QuantScheme(dtype="int4", granularity="group", group_size=64, symmetric=False)
    opts = AutoRoundOptions(iters=args.steps, batch_size=args.batch_size, best=False)  # the last step: all count
    tune_block(block, weights, scheme, AutoRoundOptions(iters=1, batch_size=args.batch_size), samples,
               torch.bfloat16)  # warm-up
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.__enter__()
    out, record = tune_block(block, weights, scheme, opts, samples, torch.bfloat16)
    if prof:
        prof.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    checksum = sum(float(q.dequantize(torch.float64).abs().sum()) for q in out.values())
    print(f"{seconds / args.steps:.3f} s/step over {args.steps} steps of {args.batch_size} x {args.seq_len} tokens, "
          f"{args.threads} threads; loss {record['first_loss']:.6g} -> {record['kept_loss']:.6g}; "
          f"checksum {checksum:.6f}")
    if prof:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
