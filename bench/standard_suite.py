"""The standard evaluation of SmolLM2-135M and its compressed versions, side by side in one report: perplexity,
KL and top-1 against the original, lm-eval task scores ± standard error, memory, measured decode tokens/s at batch 1 and
16, roofline predictions for the H100 and H200; then the Pareto page (`compress report`).

eval/standard.yaml is the whole protocol (full splits: about 8 hours per model on this CPU). This script runs it
with the CPU-sized limits below, which the report states: 8 perplexity windows of 2048, 20 documents per task,
six tasks (wikitext's page-level task alone takes ~12 minutes per model here; our own perplexity covers that
text). Models come from earlier runs: bench/export_table.py (int8 g32, GPTQ and AWQ int4 g32, fp8 + fp8 KV) and
bench/minitron_table.py (MLP-pruned and distilled); int4 RTN g64 is quantized here.

    python bench/standard_suite.py      # about 40 minutes on one CPU core
    python bench/standard_suite.py --rerender   # re-render bench/results/standard_suite from its report.json:
                                                # differences to the baseline ± their standard error, no ratios
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.arch import get_arch  # noqa: E402
from compress.measure.pareto import write as write_pareto  # noqa: E402
from compress.pipeline.report import evaluate_models, write_report  # noqa: E402
from compress.model.load import load_model  # noqa: E402
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize  # noqa: E402
from compress.recipe import from_dict  # noqa: E402
from compress.core.scheme import scheme  # noqa: E402

RUNS = {"int8 g32 (RTN)": "runs/export_int8_g32_sym__rtn", "int4 g32 (GPTQ)": "runs/export_int4_g32_sym__gptq",
        "int4 g32 (AWQ)": "runs/export_int4_g32_asym__awq", "fp8 + fp8 KV cache": "runs/export_fp8_static___fp8_kv_cache",
        "MLP pruned to 74% + distilled": "runs/minitron_mlp"}
LIMITS = {"max_windows": 8, "task_limit": 20, "speed_batches": [1, 16], "speed_contexts": [512],
          "tasks": ["arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "lambada_openai"]}


RESULTS = ROOT / "bench" / "results" / "standard_suite"


def rerender() -> None:
    """Rebuild the published pages from the stored scores (no model is run): lm-eval differences to the baseline
    with their standard errors replace the recovery ratios of the first render."""
    from compress.measure.harness import difference

    report = json.loads((RESULTS / "report.json").read_text())
    lm = report["eval"]["lm_eval"]
    scores = lm["scores"]
    lm.pop("recovery", None)
    lm["vs_baseline"] = {m: {t: {k: difference(scores["baseline"][t][k], v) for k, v in per.items()}
                             for t, per in by_task.items()} for m, by_task in scores.items() if m != "baseline"}
    publish(report)


def publish(report: dict) -> None:
    """report.json + suite_report.md, then the Pareto page, into bench/results/standard_suite."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_report(report, RESULTS)
    (RESULTS / "report.md").replace(RESULTS / "suite_report.md")
    tmp = ROOT / "runs" / "standard_suite_render"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "report.json").write_text((RESULTS / "report.json").read_text())
    write_pareto([tmp], tmp / "pareto")
    shutil.copy(tmp / "pareto" / "report.md", RESULTS / "pareto_report.md")
    for png in (tmp / "pareto").glob("*.png"):
        shutil.copy(png, RESULTS / png.name)
    print((RESULTS / "pareto_report.md").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rerender", action="store_true", help="only re-render the stored results")
    if ap.parse_args().rerender:
        return rerender()
    torch.set_num_threads(1)
    spec = from_dict({"model": "default", "stages": [{"stage": "quantize", "scheme": "W8A16"}],
                      "eval": {"suite": "standard", **LIMITS}}).eval
    base = load_model("default")
    models = {"baseline": base.model}
    rtn = load_model("default").model
    stage = QuantizeStage(scheme=scheme("int4", "group", 64, symmetric=False), ignore=("lm_head",))
    apply_quantize(rtn, plan_quantize(rtn, get_arch(rtn), stage), stage)
    models["int4 g64 (RTN)"] = rtn
    for name, folder in RUNS.items():
        models[name] = load_model(str(ROOT / folder)).model
    result = evaluate_models(models, base.tokenizer, spec, "cpu", baseline="baseline")
    publish({"model": {"source": base.source, "kind": base.kind}, "eval": result,
             "suite": {"name": "standard", "cpu_limits": LIMITS}})


if __name__ == "__main__":
    main()
