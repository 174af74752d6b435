"""The `mlx` export served by mlx-lm itself (issue 48): SmolLM2-135M (`model: default`) compressed to int4 g64 (RTN
asymmetric and symmetric, GPTQ symmetric, and a mix with int8 g32 layers and a float layer), exported with
`compress export --format mlx`, loaded with `mlx_lm.load` (mlx-cpu on Linux, in its own virtual environment) and
scored on WikiText-2 test windows against our compressed model (float32) and against the float model.

Per run: KL(ours || mlx) and top-1 agreement, with mlx-lm computing in float32 (every float parameter cast up after
loading: the file's float16 scales and biases exactly), and the quantization's own KL(float model || ours) on the same
windows. Bars (issue 48): top-1 >= 0.99 and KL(ours || mlx) < 1% of the quantization's KL. Not in float16, the dtype
the export holds: mlx-cpu's float16 (bfloat16) quantized matmul is about 40x (10x) slower than its float32 one on
this CPU (64 x 576 x 1536 int4 g64: 1.56 s (0.35 s) against 0.037 s), too slow for 512-token windows; on Apple
silicon (Metal) mlx-lm computes in float16 as stored.

    COMPRESS_MLX_PYTHON=/work/venvs/mlx/bin/python OMP_NUM_THREADS=1 python bench/mlx_export.py
Writes bench/results/mlx_export.json and prints the table (docs/results.md holds it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

G64 = {"dtype": "int4", "granularity": "group", "group_size": 64}
RTN = {"stage": "quantize", "method": "rtn", "ignore": ["lm_head"]}
MIXED = [{"layer": "re:.*down_proj", "scheme": {"dtype": "int8", "granularity": "group", "group_size": 32}},
         {"layer": "model.layers.0.self_attn.o_proj", "scheme": None}]
RUNS = {
    "int4 g64 asym, RTN": [{**RTN, "scheme": {**G64, "symmetric": False}}],
    "int4 g64 sym, RTN": [{**RTN, "scheme": G64}],
    "int4 g64 asym RTN + int8 g32 down_proj + float layer 0 o_proj": [
        {**RTN, "scheme": {**G64, "symmetric": False}, "layer_schemes": MIXED}],
    "int4 g64 sym, GPTQ": [{**RTN, "method": "gptq", "scheme": G64}],
}
RUNS_DIR = ROOT / "runs" / "mlx_export"
RESULTS = ROOT / "bench" / "results" / "mlx_export.json"


def slug(name: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def compress_run(name: str, reuse: bool) -> Path:
    out = RUNS_DIR / slug(name)
    if reuse and (out / "compress.json").is_file():
        return out
    recipe = {"model": "default", "calibration": {"preset": "wikitext2", "n_samples": 16, "seq_len": 512},
              "stages": RUNS[name], "eval": {"perplexity": False, "speed": False},
              "output": {"dir": str(out), "overwrite": True, "save_dtype": "float32"}}
    path = RUNS_DIR / f"{slug(name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-m", "compress", "run", str(path), "--no-progress"], check=True, env=env,
                   cwd=ROOT)
    return out


def export(run_dir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "compress", "export", str(run_dir), "--format", "mlx", "--overwrite"],
                   check=True, cwd=ROOT, capture_output=True)
    return run_dir / "exports" / "mlx"


def _mean(figures: list[dict]) -> dict:
    n = sum(f["positions"] for f in figures)
    return {"kl": sum(f["kl"] * f["positions"] for f in figures) / n,
            "top1_agreement": sum(f["top1_agreement"] * f["positions"] for f in figures) / n, "positions": n}


def bench_run(name: str, baseline, windows, args) -> dict:
    import torch
    from compress.engines.mlx import iter_mlx_logits
    from compress.export.verify import compare_logits, model_logits
    from compress.model.load import load_model

    run_dir = compress_run(name, args.reuse)
    folder = export(run_dir)
    ours = load_model(str(run_dir)).model
    record = json.loads((folder / "export.json").read_text())
    served = {dtype: iter_mlx_logits(folder, windows, dtype, args.python) for dtype in ("float32",)}
    quant, vs = [], {dtype: [] for dtype in served}
    with torch.no_grad():
        for i, w in enumerate(windows):
            mine = model_logits(ours, w[None])[0]
            quant.append(compare_logits(model_logits(baseline, w[None])[0], mine))
            for dtype, logits in served.items():
                vs[dtype].append(compare_logits(mine, next(logits)))
    row = {"run": name, "quantization": record["quantization"], "quant_kl": _mean(quant)["kl"],
           **{f"mlx_{dtype}": _mean(f) for dtype, f in vs.items()}, "notes": record["notes"]}
    for dtype in served:
        r = row[f"mlx_{dtype}"]
        r["kl_share_of_quant_kl"] = r["kl"] / row["quant_kl"]
        r["bars_met"] = r["top1_agreement"] >= 0.99 and r["kl_share_of_quant_kl"] < 0.01
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | quantization KL (float model \\|\\| ours) | KL(ours \\|\\| mlx-lm) | share of the quantization's "
             "KL | top-1 agreement | bars |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        m = r["mlx_float32"]
        lines.append(f"| {r['run']} | {r['quant_kl']:.4f} | {m['kl']:.2e} | {100 * m['kl_share_of_quant_kl']:.4f}% | "
                     f"{m['top1_agreement']:.4f} | {'met' if m['bars_met'] else '**missed**'} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", help="mlx-lm's interpreter (its own virtual environment); default COMPRESS_MLX_PYTHON")
    p.add_argument("--select", help="run names separated by semicolons (default: all)")
    p.add_argument("--reuse", action="store_true", help="reuse runs/mlx_export/* that already exist")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--tabulate", action="store_true", help="only print the table of the results file")
    args = p.parse_args(argv)
    if not args.tabulate:
        import torch
        from compress.calibrate.data import eval_windows
        from compress.model.load import load_model

        torch.set_num_threads(1)
        loaded = load_model("default", "float32")
        windows = eval_windows(loaded.tokenizer, "test", args.seq_len, args.windows)
        names = args.select.split(";") if args.select else list(RUNS)
        rows = []
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        for name in names:  # the results file holds the rows as they complete
            rows.append(bench_run(name, loaded.model, windows, args))
            RESULTS.write_text(json.dumps({"windows": [args.windows, args.seq_len], "rows": rows}, indent=2))
    print("\n".join(table(json.loads(RESULTS.read_text())["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
