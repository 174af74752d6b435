"""bench/gpu_run.sh is the one call a GPU session makes (minutes of device time, nothing to fix there): its dry run
runs every step's --dry-run on the CPU through the same script, and what it leaves in OUT is what the device tool
brings back (at most 8 files)."""
from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_run.sh"


def test_dry_run_runs_every_step_and_packs_each(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_FAMILIES="fp8_quantize", OMP_NUM_THREADS="1",
               GPU_RUN_WORK=str(tmp_path / "work"),  # short: each step's full dry run has its own test
               GPU_RECIPES_ARGS="--in-process --recipes fp8_dynamic --parts recipes")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if line.startswith("| gpu_")}
    assert rows["gpu_check"].split("|")[2].strip() == "0" and "0 failed" in rows["gpu_check"]
    assert rows["gpu_decode"].split("|")[2].strip() == "0" and "Bars (issue 44)" in rows["gpu_decode"]
    assert rows["gpu_recipes"].split("|")[2].strip() == "0" and "Verdicts" in rows["gpu_recipes"]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.md", "run.log", "results.tar.gz", "gpu_check.md", "gpu_decode.md"} <= set(files)
    assert any(f.startswith("gpu_recipes") for f in files)
    with tarfile.open(out / "results.tar.gz") as tar:
        names = set(tar.getnames())
        assert {"./gpu_check/gpu_check.json", "./gpu_decode/gpu_decode.json", "./gpu_check/stdout.txt"} <= names
        check = json.load(tar.extractfile("./gpu_check/gpu_check.json"))
    assert check["verdicts"]["all_correct"] and check["verdicts"]["complete"]
