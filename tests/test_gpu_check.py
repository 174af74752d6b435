"""bench/gpu_check.py is run once per GPU session with no chance to fix it there: its dry run exercises every
code path on CPU (the ops' reference paths, which decode the W4A16 layout as the kernel reads it)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def test_gpu_check_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    kinds = {(r["kernel"], r.get("dtype") or r.get("scales"), r.get("group")) for r in result["rows"]}
    assert ("w4a16", "float16", -1) in kinds and ("fp8", "tensor", None) in kinds
    assert result["verdicts"]["all_correct"]
    assert all("us" in r and r["rel_err"] < 5e-3 for r in result["rows"])
    assert all(r["quantize_exact"] for r in result["rows"] if r["kernel"] == "fp8")
    assert "| kernel | N×K | M |" in (tmp_path / "gpu_check.md").read_text()
    # the bars are computed from timed rows of the real shapes only
    assert "w4a16_ge_3x" not in result["verdicts"] and "w4a16_dispatch_never_slower" in result["verdicts"]


def test_bars_read_the_right_rows():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = dict(kernel="w4a16", N=8192, K=8192, dtype="bfloat16", group=128, ok=True, us=10.0, dense_us=29.0,
               dispatch_vs_dense=2.9)
    rows = [dict(row, M=1, vs_dense=3.2), dict(row, M=16, vs_dense=2.9), dict(row, M=64, vs_dense=1.1),
            dict(kernel="fp8", N=4096, K=4096, M=4096, ok=True, us=1.0, vs_dense=1.6, vs_scaled_mm=0.85)]
    v = mod.verdicts(rows)
    assert v["w4a16_min_speedup_m_le_16_8192"] == 2.9 and not v["w4a16_ge_3x"]  # M = 64 is outside the bar
    assert v["fp8_ge_1_5x"] and not v["fp8_within_10pct_of_scaled_mm"] and v["all_correct"]
