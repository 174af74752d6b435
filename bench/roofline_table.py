"""Roofline predictions on an H100 SXM for SmolLM2-135M and its compressed versions (no GPU needed: bytes and
FLOPs from each model, bandwidth and peaks from the datasheet table in compress/serving/roofline.py).

Reads the run folders of bench/export_table.py (run that first). Writes bench/results/roofline_table.json.

    python bench/roofline_table.py
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `compress` from a checkout, installed or not

from compress.measure.memory import serving_bytes  # noqa: E402
from compress.serving.roofline import ACCELERATORS, model_facts, roofline  # noqa: E402
from compress.kv.cache import kv_layers  # noqa: E402
from compress.model.load import load_model  # noqa: E402
MODELS = {"baseline (bf16)": "default", "int8 g32": "runs/export_int8_g32_sym__rtn",
          "int4 g32 (GPTQ)": "runs/export_int4_g32_sym__gptq", "fp8 static + fp8 KV cache": "runs/export_fp8_static___fp8_kv_cache"}
ACCELERATOR, CONTEXT, BATCHES = "H100-SXM", 1024, (1, 16, 64)


def main() -> None:
    torch.set_num_threads(1)
    rows = {}
    print(f"| model | weights (bf16 floats) | KV / token | latency B=1 | " + " | ".join(f"tok/s B={b}" for b in BATCHES)
          + f" | max batch at {CONTEXT} |\n|---|---:|---:|---:|" + "---:|" * len(BATCHES) + "---:|")
    for name, src in MODELS.items():
        model = load_model(src if src == "default" else str(ROOT / src)).model
        facts = model_facts(model.config, serving_bytes(model))
        r = roofline(facts, ACCELERATORS[ACCELERATOR], BATCHES, CONTEXT, 1 if kv_layers(model) else 2)
        rows[name] = r
        d = r["decode"]
        print(f"| {name} | {facts.weight_bytes / 1e6:.1f} MB | {r['kv_bytes_per_token'] / 1e3:.1f} kB | "
              f"{d[1]['latency_s'] * 1e6:.1f} µs | " + " | ".join(f"{d[b]['tokens_per_s']:,.0f}" for b in BATCHES)
              + f" | {r['max_batch']:,} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    (ROOT / "bench" / "results" / "roofline_table.json").write_text(json.dumps(
        {"date": datetime.date.today().isoformat(), "commit": commit, "accelerator": ACCELERATOR, "context": CONTEXT,
         "models": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
