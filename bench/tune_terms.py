"""What `tune_scales` trains, compared on one finished run of the embedded model (issue 50: EoRA's bar): the run's
low-rank terms trained end to end (`train: [lowrank]`), its scales (`[scales]`), both, or its scales with the terms
removed (`--strip`: what the same bytes as the base buy without the repair). Each variant starts from a fresh copy of
RUN, trains with the stage's defaults (one epoch over the 128 × 512 WikiText-2 validation windows the recipes
calibrate on, 4 a step, lr 1e-3, bf16 autocast where the CPU has it) and is scored on the issue-19 protocol
(bench/protocol.py) against the float32 model.

    python bench/tune_terms.py RUN --variants lowrank scales+strip lowrank+scales --out FILE

RUN: a `compress run` folder with an eora stage, e.g. bench/awq_gptq_table.py's
"kl+awq(grid clip)+gptq+eora(kl alloc) r8 int3".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402


def main() -> None:
    from awq_gptq_table import linear_bits
    from compress.calibrate.data import calibration_windows
    from compress.core.nn import QuantLinear
    from compress.distill.kd import distill
    from compress.distill.scale_tuning import tunable_layers, tuning
    from compress.export.adapter import lowrank_layers
    from compress.export.native import load_compressed
    from compress.measure.ppl import score_windows
    from compress.model.load import load_model
    from compress.recipe import CalibrationSpec
    from compress.stages.tune_scales import TuneScalesStage

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--variants", nargs="+", default=["lowrank", "scales+strip", "lowrank+scales"],
                    help="'+'-joined: lowrank, scales (what is trained), strip (the terms removed first)")
    ap.add_argument("--lr", type=float, default=TuneScalesStage.lr)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/tune_terms.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_model("default")
    cal = CalibrationSpec()
    ids = calibration_windows(cal.source(), base.tokenizer, base.model, cal.n_samples, cal.seq_len, cal.seed)
    cfg = TuneScalesStage(eval_windows=0, lr=args.lr).training(ids.shape[0], ids.shape[1])
    models, notes = {"baseline (float32)": base.model, "as run": load_compressed(args.run)}, {}
    for variant in args.variants:
        parts = set(variant.split("+"))
        if not parts <= {"lowrank", "scales", "strip"} or not parts & {"lowrank", "scales"}:
            raise SystemExit(f"variant {variant!r}: join lowrank, scales and strip with '+'")
        model = load_compressed(args.run)
        if "strip" in parts:
            for m in model.modules():
                if isinstance(m, QuantLinear) and m.rank:
                    m.set_lowrank(None, None)
        scales = tunable_layers(model)[0] if "scales" in parts else []
        terms = list(lowrank_layers(model)) if "lowrank" in parts else []
        t0 = time.perf_counter()
        with tuning(model, scales, terms), tempfile.TemporaryDirectory() as tmp:
            distill(model, base.model, ids, cfg, Path(tmp), progress=False, log=lambda *a: None)
        notes[variant] = {"tune_s": round(time.perf_counter() - t0, 1), "steps": cfg.steps, "lr": args.lr}
        print(variant, notes[variant], flush=True)
        models[variant] = model.eval()
    scores = score_windows(models, protocol.windows(base.tokenizer), baseline="baseline (float32)")
    rows = {n: {"ppl": s.ppl, "kl": s.kl, "top1": s.top1_agreement, **linear_bits(models[n]), **notes.get(n, {})}
            for n, s in scores.items()}
    for n, r in rows.items():
        print(f"{n:>24}: ppl {r['ppl']:.3f} KL {r['kl']:.4f} top-1 {r['top1']:.2%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": str(args.run), "protocol": protocol.DESCRIPTION, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
