"""bench/gpu_decode.py's dry run: the end-to-end decode table's code on a CPU with a tiny Llama (the same variants,
quantization, forced kernels, static-cache decode, rows and files as on a GPU), and the pieces it relies on for an
8B model: QuantLinear placeholders built on the layer's device, the bytes a step reads."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from compress.core.nn import QuantLinear
from compress.core.scheme import W4A16

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "bench" / "gpu_decode.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_decode"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_writes_a_row_per_variant_and_batch(tmp_path):
    bench = _bench()
    variants = ["bf16", "W4A16 v1", "FP8 dynamic", "W4A16 v2"]
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--variants", ",".join(variants)]) == 0
    lines = (tmp_path / "gpu_decode.jsonl").read_text().splitlines()
    result = json.loads((tmp_path / "gpu_decode.json").read_text())
    rows = {(r["variant"], r["batch"]): r for r in result["rows"]}
    assert len(lines) == len(rows) == 8 and set(rows) == {(v, b) for v in variants for b in (1, 2)}
    for (variant, batch), r in rows.items():
        if variant == "W4A16 v2" and "compress w4a16 v2 (CUDA)" not in bench.registry():
            assert r["status"] == "not run" and "not in this build" in r["why"]
            continue
        assert r["status"] == "ok", r
        assert r["decode_tok_s"] > 0 and r["ms_per_token_p90"] >= r["ms_per_token_p50"] > 0
        assert r["graph_equals_eager"] and r["decode_mode"] == "eager steps (static KV cache)"
        assert r["vs_bf16"] > 0 and r["weight_gb_s"] > 0 and 0 < r["weight_bw_frac"]
        # 2 layers x 2 KV heads x 24 positions x 32 dims, keys and values, float32
        assert r["kv_bytes_per_step"] == 2 * batch * 2 * 24 * 32 * 2 * 4
    dense = rows[("bf16", 1)]["weight_bytes"]
    assert dense == 4 * (2 * (128 * 128 * 2 + 64 * 128 * 2 + 3 * 128 * 256) + 512 * 128)  # linears + head
    # the int4 layers run a CPU kernel standing in for the CUDA one, on its packed operands (the codes released)
    assert rows[("W4A16 v1", 1)]["kernel"].startswith("torch int4pack (CPU, bf16 activations) (dry-run stand-in")
    assert rows[("W4A16 v1", 1)]["weight_bytes"] < dense / 2
    assert "reference path (dry run" in rows[("FP8 dynamic", 1)]["kernel"]
    md = (tmp_path / "gpu_decode.md").read_text()
    assert "| W4A16 v1 | 2 |" in md and "not measured" in md  # no batch 16 / 64 in a dry run: the bars wait


def test_budget_skips_what_does_not_fit(tmp_path):
    bench = _bench()
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--variants", "bf16", "--budget", "0"]) == 0
    rows = json.loads((tmp_path / "gpu_decode.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["not run", "not run"] and "budget" in rows[0]["why"]


def test_quantized_placeholders_are_built_on_the_layers_device():
    """An 8B model's layers are quantized on the GPU; their placeholders must not be packed on the host first."""
    layer = QuantLinear(256, 512, W4A16, device="meta")
    assert {t.device.type for t in (layer.qdata, layer.scale)} == {"meta"}
