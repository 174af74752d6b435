"""Seconds per tune_scales step: a compressed checkpoint tuned against the embedded model for a few steps of
random-token windows (the same work per step as calibration text), each step timed on its own; the first includes
warm-up. Prints the step times, the minor page faults and a checksum of the tuned gains (two code versions that
compute the same thing give the same checksum).

    python -m compress run recipes/awq_gptq_tune_int4.yaml --output runs/tune   # any int-quantized run of `default`
    python bench/tune_step.py runs/tune --steps 4 --threads 2
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from compress.distill import kd
    from compress.distill.scale_tuning import scale_gains, tunable_layers
    from compress.export.native import load_compressed
    from compress.model.load import load_model
    from compress.stages.tune_scales import TuneScalesStage

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a compress run folder of the embedded model with weight-only int layers")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    teacher = load_model("default").model
    model = load_compressed(args.run)
    windows = args.steps * args.batch_size
    ids = torch.randint(0, teacher.config.vocab_size, (windows, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    cfg = TuneScalesStage(eval_windows=0, batch_size=args.batch_size).training(windows, args.seq_len)
    times, step = [], kd._Training.train_step

    def timed(self, *a):
        t0 = time.perf_counter()
        out = step(self, *a)
        times.append(time.perf_counter() - t0)
        return out

    kd._Training.train_step = timed
    names, _ = tunable_layers(model)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with scale_gains(model, names) as gains, tempfile.TemporaryDirectory() as tmp:
        kd.distill(model, teacher, ids, cfg, Path(tmp), progress=False, log=lambda *a: None)
        checksum = float(torch.cat([g.detach().flatten() for g in gains]).double().abs().sum())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"steps (s): {[round(t, 2) for t in times]}; after the first: {sum(times[1:]) / max(1, len(times) - 1):.2f} "
          f"s a step; minor page faults {faults:,}; gain checksum {checksum:.6e}")


if __name__ == "__main__":
    main()
