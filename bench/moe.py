"""A mixture-of-experts model through `compress run`: a Mixtral shape with random weights (hidden 1024, 8 blocks,
8 experts of width 2816, top-2, 16 heads / 8 KV heads, SmolLM2's vocabulary and tokenizer; 0.7B parameters, 1.4 GB
of bf16; nothing committed), quantized to int4 with RTN and with GPTQ by the shipped recipes, each in a fresh
process with its resident memory sampled. Records the weight bytes against bf16 (the quantized linears, and the
whole checkpoint: the embedding and the head stay bf16), the calibration tokens every expert saw, perplexity / KL on
a few WikiText-2 windows (a random model: they measure agreement, not quality) and decode speed.
Results go to bench/results/moe.json.

    python bench/moe.py [--runs rtn,gptq] [--models-dir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.large_models import run_watched  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
RUNS = {
    "rtn": ("recipes/int4_rtn.yaml", ["calibration.n_samples=16", "calibration.seq_len=256"]),
    "gptq": ("recipes/gptq_int4.yaml", ["calibration.n_samples=16", "calibration.seq_len=256"]),
}
COMMON = ["eval.max_windows=2", "eval.seq_len=256", "eval.speed=true", "eval.prefill_tokens=64",
          "eval.decode_tokens=8", "eval.speed_repeats=2", "calibration.threads=2", "eval.threads=2",
          "output.overwrite=true"]


def build(folder: Path) -> int:
    """The random Mixtral-shaped model, saved by transformers (its own checkpoint names). Returns its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig

    from compress.model.default_model import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = MixtralConfig(**SHAPE, vocab_size=len(tokenizer), max_position_embeddings=4096,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)
    return sum(p.numel() for p in model.parameters())


def run_one(model: Path, recipe: str, overrides: list[str], out: Path, log: Path) -> dict:
    cmd = [sys.executable, "-m", "compress", "run", recipe, "--no-progress", "--output", str(out),
           "--set", f"model={model}"] + [a for o in overrides + COMMON for a in ("--set", o)]
    row = run_watched(cmd, log)
    if row["exit"] != 0:
        return {**row, "log_tail": log.read_text()[-2000:]}
    report = json.loads((out / "report.json").read_text())
    models = report["eval"]["models"]
    stage = next(s for s in report["stages"] if s["stage"] == "quantize")
    weights = models["compressed"]["weights"]
    tokens = {moe: row["tokens"] for moe, row in stage["experts"].items()}
    return {**row, "timings": report["timings"],
            "checkpoint_bytes": report["memory"]["checkpoint_bytes"],
            "baseline_checkpoint_bf16_bytes": report["memory"]["baseline_checkpoint_bf16_bytes"],
            "checkpoint_over_bf16": report["memory"]["checkpoint_bytes"] /
            report["memory"]["baseline_checkpoint_bf16_bytes"],
            "quantized_linears_over_bf16": weights["quantized_over_bf16"],
            "layers_quantized": stage["quantized"], "left_in_float": stage["skipped"],
            "float_parameters": stage["float_parameters"],
            "expert_tokens": tokens, "experts_listed": sum(len(t) for t in tokens.values()),
            "fallbacks": {moe: r["fallback"] for moe, r in stage["experts"].items() if r["fallback"]},
            "ppl": {n: m.get("ppl") for n, m in models.items()}, "kl": models["compressed"].get("kl"),
            "top1": models["compressed"].get("top1_agreement"),
            "decode_tok_s": {n: (m.get("speed") or {}).get("decode_tok_s") for n, m in models.items()},
            "peak_rss_report": report["eval"]["peak_rss_bytes"],
            "memory_plan_peak": report.get("memory_plan", {}).get("peak_bytes")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="rtn,gptq")
    parser.add_argument("--models-dir", default="/tmp/compress-moe")
    parser.add_argument("--keep", action="store_true", help="keep the built model and the outputs")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    base = Path(args.models_dir)
    base.mkdir(parents=True, exist_ok=True)
    folder = base / "mixtral-1024x8"
    if not (folder / "config.json").exists():
        t = time.perf_counter()
        n = build(folder)
        print(f"built {folder}: {n / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s", flush=True)
    results_path = ROOT / "bench" / "results" / "moe.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"rows": []}
    for name in args.runs.split(","):
        recipe, overrides = RUNS[name]
        out = base / f"out-{name}"
        row = {"run": name, "model": "Mixtral shape (" + ", ".join(f"{k}={v}" for k, v in SHAPE.items()) +
               "), random bf16", "commit": commit, "date": datetime.date.today().isoformat(),
               **run_one(folder, recipe, overrides, out, base / f"log-{name}.txt")}
        print(json.dumps({k: v for k, v in row.items() if k not in ("expert_tokens", "float_parameters")}),
              flush=True)
        results["rows"] = [r for r in results["rows"] if r["run"] != name] + [row]
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
