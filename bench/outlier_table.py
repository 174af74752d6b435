"""8-bit and outliers on SmolLM2-135M and on its planted-outlier version (the shape of the LLM.int8 paper's
table): absmax and zero-point int8 W8A8, SmoothQuant, LLM.int8 (ours and bitsandbytes'), fp8.

Phase 1 runs each recipe with `compress run` in its own process (evaluation off) and saves the model.
Phase 2 scores, per variant, the baseline, every saved model and bitsandbytes' own LLM.int8 (Linear8bitLt
quantizing the float weights itself, on CPU) in one loop over the same WikiText-2 test windows.

    python bench/outlier_table.py       # the README protocol (bench/protocol.py)

LLM.int8 rows also get the share of their int8 layers' matmul work that ran in float (outlier features ÷ input
features, per layer and overall): where it is large, "LLM.int8 holds" means "the layer ran in float".
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `compress` and tests.reference from a checkout, installed or not

from bench import protocol  # noqa: E402

PLANT = {"channels": 4, "factor": 40.0, "seed": 0}
NO_CALIB = ["calibration=null"]
RTN = ["stages.0.method=rtn", *NO_CALIB]  # recipes/fp8_dynamic.yaml uses GPTQ (64 x 512 calibration)
ROWS = {  # name: (recipe, --set overrides)
    "int8 absmax W8A8 (per-token)": ("recipes/llm_int8.yaml", ["stages.0.scheme=W8A8", *NO_CALIB]),
    "int8 zero-point W8A8 (per-token)": ("recipes/llm_int8.yaml", ["stages.0.scheme=W8A8_ASYM", *NO_CALIB]),
    "SmoothQuant W8A8 (RTN)": ("recipes/smoothquant_w8a8.yaml", ["stages.1.method=rtn"]),
    "SmoothQuant W8A8 + GPTQ": ("recipes/smoothquant_w8a8.yaml", []),
    "LLM.int8 dynamic (ours)": ("recipes/llm_int8.yaml", []),
    "LLM.int8 static (ours)": ("recipes/llm_int8.yaml", ["stages.0.scheme=LLM_INT8_STATIC"]),
    "LLM.int8 dynamic, bitsandbytes' row scale (ours)": ("recipes/llm_int8.yaml",
                                                         ["stages.0.scheme=LLM_INT8_BNB", *NO_CALIB]),
    "fp8 weight-only (per-channel)": ("recipes/fp8_dynamic.yaml", ["stages.0.scheme=FP8_W8A16", *RTN]),
    "fp8 dynamic (per-channel W, per-token A)": ("recipes/fp8_dynamic.yaml", RTN),
    "fp8 static (per-tensor) + fp8 KV cache": ("recipes/fp8_static_kv.yaml", []),
    "fp8 weight-only + GPTQ": ("recipes/fp8_dynamic.yaml", ["stages.0.scheme=FP8_W8A16"]),
    "fp8 dynamic + GPTQ": ("recipes/fp8_dynamic.yaml", []),
    # GPTQ's act_order default was chosen on int4 (validation); these two rows check it on the fp8 grid
    "fp8 weight-only + GPTQ, no act order": ("recipes/fp8_dynamic.yaml",
                                             ["stages.0.scheme=FP8_W8A16", "stages.0.options.act_order=false"]),
    "fp8 dynamic + GPTQ, no act order": ("recipes/fp8_dynamic.yaml", ["stages.0.options.act_order=false"]),
    "fp8 dynamic + fp8 KV cache": ("recipes/fp8_static_kv.yaml", ["stages.0.scheme=FP8_DYNAMIC"]),
}
BNB = "LLM.int8 (bitsandbytes Linear8bitLt)"


def slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s).strip("_")


def plant_spec(variant: str) -> dict | None:
    """'original' -> None; 'planted' -> PLANT; 'planted:80' -> PLANT with factor 80."""
    if variant == "original":
        return None
    name, _, factor = variant.partition(":")
    if name != "planted":
        raise SystemExit(f"unknown variant {variant!r}: use original, planted or planted:FACTOR")
    return {**PLANT, "factor": float(factor)} if factor else dict(PLANT)


def summary(stage: dict) -> dict:
    """A stage's report, reduced to counts (the full per-layer detail stays in the run's report.json)."""
    info = stage.get("layer_info") or {}
    out = {"stage": stage["stage"], "layers": len(info or stage.get("layers") or {})}
    counts = [v["outlier_features_calibration"] for v in info.values() if "outlier_features_calibration" in v]
    if counts:
        out["outlier_features_calibration"] = {"total": sum(counts), "max": max(counts),
                                               "layers_with_any": sum(1 for c in counts if c)}
    return out


def compress_all(out_root: Path, variant: str, only: list[str], reuse: bool) -> dict:
    info = {}
    for name, (recipe, sets) in ROWS.items():
        if only and name not in only:
            continue
        out = out_root / slug(variant) / slug(name)
        if reuse and (out / "report.json").is_file():
            info[name] = json.loads((out / "bench_info.json").read_text())
            continue
        cmd = [sys.executable, "-m", "compress", "run", recipe, "--output", str(out), "--overwrite", "--no-progress",
               "--set", "eval.perplexity=false", "--set", "eval.speed=false", "--set", "eval.baseline=false",
               "--set", "output.save_dtype=float32"]  # embeddings and norms stay exact: only the quantization differs
        plant = plant_spec(variant)
        for s in sets + ([f"model.plant_outliers={json.dumps(plant)}"] if plant else []):
            cmd += ["--set", s]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        report = json.loads((out / "report.json").read_text())
        info[name] = {"dir": str(out), "wall_s": time.perf_counter() - t0, "compress_s": report["timings"]["compress"],
                      "stages": [summary(s) for s in report["stages"] if s["stage"] in ("quantize", "kv_cache")]}
        (out / "bench_info.json").write_text(json.dumps(info[name]))
        print(f"[{variant}] {name}: compress {info[name]['compress_s']:.0f} s", flush=True)
    return info


def score_variant(info: dict, variant: str, max_windows: int, with_bnb: bool) -> dict:
    from compress.arch import get_arch
    from compress.measure.ppl import score_windows
    from compress.pipeline.report import eval_windows, llm_int8_float_share
    from compress.model.load import load_model
    from compress.export.native import load_compressed
    from compress.transforms.outliers import PlantSpec, plant_outliers
    from tests.reference.bnb_llm_int8 import to_bitsandbytes_int8

    def baseline():
        loaded = load_model("default")
        if plant_spec(variant):
            plant_outliers(loaded.model, get_arch(loaded.model), PlantSpec(**plant_spec(variant)))
        return loaded

    base = baseline()
    models = {"baseline (float32)": base.model}
    if with_bnb:
        bnb = baseline().model
        to_bitsandbytes_int8(bnb, get_arch(bnb).blocks, threshold=6.0)
        models[BNB] = bnb
    models.update({name: load_compressed(i["dir"]) for name, i in info.items()})
    windows = eval_windows(base.tokenizer, protocol.SPLIT, protocol.SEQ_LEN, max_windows)
    t0 = time.perf_counter()
    scores = score_windows(models, windows, baseline="baseline (float32)")
    print(f"[{variant}] scored {len(models)} models on {windows.shape[0]} windows in {time.perf_counter() - t0:.0f} s",
          flush=True)
    out = {n: {"ppl": s.ppl, "kl": s.kl, "top1": s.top1_agreement, "tokens": s.tokens} for n, s in scores.items()}
    for n, m in models.items():  # LLM.int8: outlier counts accumulated over these windows (dynamic) or fixed
        share = llm_int8_float_share(m)
        if share is not None:
            heavy = sorted(share["layers"].items(), key=lambda kv: -kv[1])
            out[n]["float_share"] = {"overall": share["overall"], "max_layer": heavy[0][0],
                                     "max_layer_share": heavy[0][1],
                                     "layers_over_half": sum(v > 0.5 for v in share["layers"].values()),
                                     "layers": share["layers"]}
    return out


def table(scores: dict) -> list[str]:
    base = scores["baseline (float32)"]["ppl"]
    lines = ["| method | WikiText-2 ppl | Δ ppl | KL (nats/token) | top-1 agreement | matmul work in float |",
             "|---|---:|---:|---:|---:|---:|"]
    for n, s in scores.items():
        d = "—" if n.startswith("baseline") else f"{100 * (s['ppl'] / base - 1):+.2f}%"
        f = s.get("float_share")
        share = "—" if f is None else f"{f['overall']:.1%} (max {f['max_layer_share']:.0%})"
        lines.append(f"| {n} | {s['ppl']:.3f} | {d} | {s['kl']:.4f} | {s['top1']:.2%} | {share} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=protocol.WINDOWS)
    ap.add_argument("--variants", nargs="*", default=["original", "planted"],
                    help="original, planted (factor 40) or planted:FACTOR")
    ap.add_argument("--only", nargs="*", default=[], help="subset of row names")
    ap.add_argument("--no-bnb", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep compressed models already in --runs-dir")
    ap.add_argument("--threads", type=int, default=2, help="scoring threads (accuracy does not depend on it)")
    ap.add_argument("--runs-dir", default="runs/bench_outliers")
    ap.add_argument("--out", default="bench/results/outlier_table.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "windows": args.max_windows,
              "seq_len": protocol.SEQ_LEN, "protocol": protocol.as_dict(),
              "plant": {v: plant_spec(v) for v in args.variants}, "variants": {}}
    for variant in args.variants:
        info = compress_all(Path(args.runs_dir), variant, args.only, args.reuse)
        scores = score_variant(info, variant, args.max_windows, not args.no_bnb)
        result["variants"][variant] = {"runs": info, "scores": scores}
        print(f"\n{variant}:\n" + "\n".join(table(scores)), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
