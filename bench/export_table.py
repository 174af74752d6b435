"""Format × scheme × loader on SmolLM2-135M: every export reloaded by its loader and compared with the
compressed model as saved beside it (KL per token and top-1 agreement on the protocol's WikiText-2 test windows,
bench/protocol.py; the run saves float tensors in float32, so that model is the one in memory).

One `compress run` per scheme (its own process) with `output.formats` listing the exports; each run's
report.json carries the verification. Writes bench/results/export_table.json and prints a Markdown table.

    python bench/export_table.py            # about 30 minutes on 2 cores
    python bench/export_table.py --reuse    # tabulate runs/export_* that already exist
    python bench/export_table.py --select NVFP4,MXFP --out bench/results/export_microscale.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import protocol  # noqa: E402

CALIBRATION = {"preset": "wikitext2", "n_samples": 32, "seq_len": 512}
QUANTIZE = {"stage": "quantize", "method": "rtn", "ignore": ["lm_head"]}
RUNS = {  # name: (stages, formats)
    "int4 g32 sym, GPTQ": ([{**QUANTIZE, "method": "gptq", "scheme": {"dtype": "int4", "group_size": 32}}],
                           ["compressed-tensors", "gptq", "gguf-q4_0"]),
    "int4 g32 asym, AWQ": ([{"stage": "awq", "search_samples": 4},
                            {**QUANTIZE, "scheme": {"dtype": "int4", "group_size": 32, "symmetric": False}}],
                           ["compressed-tensors", "awq", "gguf-q4_1"]),
    "int8 g32 sym, RTN": ([{**QUANTIZE, "scheme": {"dtype": "int8", "group_size": 32}}],
                          ["compressed-tensors", "gguf-q8_0", "gguf-f16", "dense"]),
    "W8A8 int8, dynamic per token": ([{**QUANTIZE, "scheme": "W8A8"}], ["compressed-tensors"]),
    "fp8 static + fp8 KV cache": ([{**QUANTIZE, "scheme": "FP8"}, {"stage": "kv_cache", "dtype": "fp8_e4m3"}],
                                  ["compressed-tensors", "fp8"]),
    "fp8 dynamic (per channel)": ([{**QUANTIZE, "scheme": "FP8_DYNAMIC"}], ["compressed-tensors"]),
    # microscaling formats (issue 21): python bench/export_table.py --select NVFP4,MXFP --out bench/results/export_microscale.json
    "NVFP4 W4A4, RTN": ([{**QUANTIZE, "scheme": "NVFP4"}], ["compressed-tensors", "modelopt-nvfp4"]),
    "NVFP4A16, GPTQ": ([{**QUANTIZE, "method": "gptq", "scheme": "NVFP4A16"}], ["compressed-tensors", "modelopt-nvfp4"]),
    "MXFP4A16, GPTQ": ([{**QUANTIZE, "method": "gptq", "scheme": "MXFP4A16"}], ["compressed-tensors"]),
    "MXFP8 W8A8, RTN": ([{**QUANTIZE, "scheme": "MXFP8"}], ["compressed-tensors"]),
}
WINDOWS, SEQ_LEN = protocol.WINDOWS, protocol.SEQ_LEN


def folder(name: str) -> Path:
    return ROOT / "runs" / ("export_" + "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_"))


def run(name: str, stages: list, formats: list[str]) -> None:
    recipe = {"model": "default", "calibration": CALIBRATION, "stages": stages,
              "eval": {"perplexity": False, "speed": False, "baseline": False, "seq_len": SEQ_LEN},
              "output": {"dir": str(folder(name)), "overwrite": True, "formats": formats,
                         "verify_windows": WINDOWS, "save_dtype": "float32"}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(recipe, f, sort_keys=False)
    print(f"[{name}] compress run ({', '.join(formats)})", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "compress", "run", f.name, "--no-progress"], cwd=ROOT, check=True)


def paths(export: Path) -> dict:
    """How many tensors took each path (GGUF: exact / requantized / quantized-from-float / float; others: layers)."""
    record = json.loads((export / "export.json").read_text())
    layers = record.get("layers", {}).values()
    return record.get("counts") or {
        "layers copied exactly" if exact else "layers dequantized": n
        for exact, n in ((True, sum("exactly" in v for v in layers)), (False, sum("exactly" not in v for v in layers)))
        if n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reuse", action="store_true", help="only tabulate existing runs")
    ap.add_argument("--only", help="run only the schemes whose name contains one of these comma-separated texts; reuse the others")
    ap.add_argument("--select", help="run and tabulate only the schemes whose name contains one of these comma-separated texts")
    ap.add_argument("--out", default="bench/results/export_table.json")
    args = ap.parse_args()
    rows = []
    for name, (stages, formats) in RUNS.items():
        if args.select and not any(t in name for t in args.select.split(",")):
            continue
        if not args.reuse and (args.only is None or any(t in name for t in args.only.split(","))):
            run(name, stages, formats)
        report = json.loads((folder(name) / "report.json").read_text())
        for e in report["exports"]:
            v = e["verify"]
            rows.append({"scheme": name, "format": e["format"], "loader": v["loader"], "kl": v["kl"],
                         "top1_agreement": v["top1_agreement"], "positions": v["positions"], "text": v["text"],
                         "activations": v.get("activations", "as computed by the loader"),
                         "bytes": e["bytes"], "notes": e["notes"], "tensor_paths": paths(folder(name) / e["folder"])})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "model": "SmolLM2-135M-Instruct (default)",
              "windows": f"{WINDOWS} × {SEQ_LEN} tokens", "protocol": protocol.as_dict(), "rows": rows}
    out = ROOT / args.out
    out.write_text(json.dumps(result, indent=2))
    print("| scheme | format | size | reloaded with | KL (nats/token) | top-1 agreement | tensors |\n"
          "|---|---|---:|---|---:|---:|---|")
    for r in rows:
        counts = ", ".join(f"{v} {k}" for k, v in r["tensor_paths"].items())
        print(f"| {r['scheme']} | {r['format']} | {r['bytes'] / 1e6:.0f} MB | {r['loader']} | {r['kl']:.2e} | "
              f"{r['top1_agreement']:.4f} | {counts} |")
    print(f"\n{result['windows']} of WikiText-2 test, {result['date']}, commit {commit}")


if __name__ == "__main__":
    main()
