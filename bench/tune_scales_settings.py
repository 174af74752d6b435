"""Choose tune_scales' settings on validation text, never on test: one quantized run (calibrated on the first half
of the WikiText-2 validation rows) is tuned with each setting by the stage itself, on that run's own calibration
windows (rebuilt from its recipe.resolved.yaml and checked against the report's fingerprint), and every tuned copy
is scored beside the untuned one on the first 8 windows of 2048 tokens of the second half (`validation[50%:]`)
against the float32 baseline. The stage's held-out curve (which reads the test split) is switched off.

    python -m compress run recipes/awq_gptq_int4.yaml --output runs/val_tune/awq_gptq_int4 --no-progress \\
        --set calibration.split='validation[:50%]' --set output.save_dtype=float32 --set eval.perplexity=false \\
        --set eval.speed=false --set eval.baseline=false
    python bench/tune_scales_settings.py runs/val_tune/awq_gptq_int4 --settings "lr=1e-3" "lr=3e-3" \\
        "lr=1e-3 epochs=2" --out bench/results/tune_scales_validation.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EVAL_SPLIT, EVAL_WINDOWS, EVAL_SEQ = "validation[50%:]", 8, 2048


def parse_setting(text: str) -> dict:
    """`lr=1e-3 epochs=2` -> {"lr": 0.001, "epochs": 2}."""
    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in text.split())}


def main() -> None:
    from compress.arch import get_arch
    from compress.calibrate.data import fingerprint
    from compress.measure.ppl import score_windows
    from compress.pipeline.report import eval_windows
    from compress.model.load import load_model
    from compress.export.native import load_compressed
    from compress.recipe import build, load_recipe
    from compress.pipeline.calibration import calibration_samples
    from compress.stages.base import ModelStageContext
    from compress.stages.tune_scales import TuneScalesStage

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a compress run folder (saved with float32 float tensors)")
    ap.add_argument("--settings", nargs="+", required=True, help='tune_scales fields, e.g. "lr=3e-3 epochs=2"')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/tune_scales_validation.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    recipe = load_recipe(run / "recipe.resolved.yaml")
    report = json.loads((run / "report.json").read_text())
    if "test" in recipe.calibration.split:
        raise SystemExit(f"{run} was calibrated on {recipe.calibration.split}; choose settings on a validation run")
    base = load_model("default")
    samples, _ = calibration_samples(recipe, base.model, base.tokenizer)
    if fingerprint(samples) != report["calibration"]["fingerprint"]:
        raise SystemExit("the rebuilt calibration windows differ from the run's (fingerprint); same data folder?")
    models, runs = {"baseline (float32)": base.model, "untuned": load_compressed(run)}, {}
    for text in args.settings:
        # through the recipe's validation, as `--set stages.N.lr=3e-3` would be
        stage = build(TuneScalesStage, {"eval_windows": 0, **parse_setting(text)}, "tune_scales", "--settings")
        model = load_compressed(run)
        with tempfile.TemporaryDirectory() as tmp:
            ctx = ModelStageContext(model, base.tokenizer, get_arch(model), recipe.calibration, Path(tmp) / "out",
                                    False, False, lambda m: None, teacher=base.model, samples=samples)
            t0 = time.perf_counter()
            section = stage.run_model(ctx, len(recipe.stages))
        runs[text] = {"seconds": time.perf_counter() - t0, "steps": section["steps"], "settings": parse_setting(text),
                      "train_loss": [p["train_loss"] for p in section["curve"]]}
        models[text] = model
        print(f"{text}: {section['steps']} steps in {runs[text]['seconds']:.0f} s", flush=True)
    windows = eval_windows(base.tokenizer, EVAL_SPLIT, EVAL_SEQ, EVAL_WINDOWS)
    scores = score_windows(models, windows, baseline="baseline (float32)", progress=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "run": str(run),
              "calibration": recipe.calibration.split, "eval": {"split": EVAL_SPLIT, "windows": EVAL_WINDOWS,
                                                                "seq_len": EVAL_SEQ},
              "threads": args.threads, "runs": runs,
              "scores": {n: {"ppl": s.ppl, "kl": s.kl, "top1": s.top1_agreement} for n, s in scores.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    ref = scores["baseline (float32)"].ppl
    print("| tune_scales setting | validation ppl | Δ ppl | KL | top-1 | tuning time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in scores.items():
        t = f"{runs[name]['seconds']:.0f} s" if name in runs else "—"
        print(f"| {name} | {s.ppl:.3f} | {100 * (s.ppl / ref - 1):+.1f}% | {s.kl:.4f} | {s.top1_agreement:.2%} | {t} |")


if __name__ == "__main__":
    main()
