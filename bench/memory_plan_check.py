"""How close the memory plan's predicted peak is to the measured one.

Builds Llama-shaped models with random weights from configs (bfloat16 safetensors in a temporary folder, with
SmolLM2's tokenizer; nothing is committed), runs `compress run` on each in a fresh process (int4 RTN and GPTQ with a
small calibration and evaluation), and compares the report's `memory_plan.peak_bytes` with the process's peak
anonymous memory, sampled from /proc every 50 ms (the report's peak RSS is recorded too: it also counts the
memory-mapped checkpoint's file pages, which the kernel can drop). Results go to bench/results/memory_plan.json.

    python bench/memory_plan_check.py [--sizes 0.5b,1b] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {  # Llama shapes (hidden, MLP, blocks, heads, KV heads); SmolLM2's vocabulary
    "0.5b": (1024, 2816, 24, 16, 16),
    "1b": (2048, 5632, 16, 32, 8),
    "1.5b": (2048, 5632, 24, 32, 8),
}
RUNS = {  # name -> (recipe, overrides)
    "int4 RTN, bf16": ("recipes/int4_rtn.yaml", ["model.dtype=bfloat16"]),
    "int4 RTN, float32": ("recipes/int4_rtn.yaml", ["model.dtype=float32"]),
    "int4 GPTQ, bf16": ("recipes/gptq_int4.yaml", ["model.dtype=bfloat16", "calibration.n_samples=8",
                                                   "calibration.seq_len=256"]),
}
COMMON = ["eval.max_windows=2", "eval.seq_len=512", "eval.speed=false", "calibration.threads=2", "eval.threads=2"]


def build(name: str, folder: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from large_models import llama_config  # bench/: the same shapes' configs

    config, tokenizer = llama_config(SIZES[name], max_positions=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def watch_anonymous_peak(proc: subprocess.Popen, every: float = 0.05) -> int:
    """Peak anonymous resident memory (RssAnon) of a running process, sampled from /proc until it exits. The
    report's peak RSS also counts the memory-mapped checkpoint's file pages, which the kernel can drop under
    pressure; what must fit in memory is the anonymous part, and that is what the plan predicts."""
    peak = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(every)
    proc.wait()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--keep", action="store_true", help="keep the built models and outputs")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="memory_plan_"))
    rows = []
    try:
        for size in args.sizes.split(","):
            folder = work / f"llama-{size}"
            params = build(size, folder)
            for run, (recipe, overrides) in RUNS.items():
                out = work / f"out-{size}-{len(rows)}"
                cmd = [sys.executable, "-m", "compress", "run", recipe, "--no-progress", "--output", str(out),
                       "--set", f"model={folder}", *[x for o in overrides + COMMON for x in ("--set", o)]]
                t = time.perf_counter()
                with open(work / "stderr.txt", "w") as err:
                    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
                    anon = watch_anonymous_peak(proc)
                wall = time.perf_counter() - t
                if proc.returncode != 0:
                    raise SystemExit(f"{size} {run} failed:\n{(work / 'stderr.txt').read_text()[-3000:]}")
                report = json.loads((out / "report.json").read_text())
                plan = report["memory_plan"]
                rss = report["eval"]["peak_rss_bytes"]
                rows.append({"model": f"Llama {size} ({params / 1e9:.2f}B parameters)", "run": run,
                             "predicted_peak_bytes": plan["peak_bytes"], "predicted_phase": plan["peak_phase"],
                             "measured_peak_anonymous_bytes": anon, "measured_peak_rss_bytes": rss,
                             "predicted_over_anonymous": plan["peak_bytes"] / anon, "phases": plan["phases"],
                             "wall_s": wall})
                print(f"{size:>5} {run:<20} predicted {plan['peak_bytes'] / 1e9:6.2f} GB ({plan['peak_phase']}), "
                      f"measured anonymous {anon / 1e9:6.2f} GB (RSS with file pages {rss / 1e9:6.2f} GB), "
                      f"ratio {plan['peak_bytes'] / anon:.2f}, {wall:.0f} s", flush=True)
                if not args.keep:
                    shutil.rmtree(out)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results = ROOT / "bench" / "results" / "memory_plan.json"
    results.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "common": COMMON,
                                   "rows": rows}, indent=1))
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
