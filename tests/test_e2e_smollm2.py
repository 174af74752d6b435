"""End to end on the real embedded model (SmolLM2-135M-Instruct) with a few short windows."""
from __future__ import annotations

import json

import pytest

from compress.pipeline.resident import run
from compress.recipe import load_recipe
from tests.conftest import requires_data


def _int4_bytes(report):
    assert report["eval"]["models"]["compressed"]["weights"]["quantized_over_bf16"] <= 0.3


def _llm_int8_outliers(report):
    """The last blocks' down_proj inputs reach ~480: outlier features are found in calibration and used in the
    evaluation, and the report says how much of the int8 layers' work ran in float."""
    counts = report["stages"][0]["layer_info"]["model.layers.29.mlp.down_proj"]
    assert counts["outlier_features_calibration"] > 0
    comp = report["eval"]["models"]["compressed"]
    assert comp["llm_int8_outliers"]["model.layers.29.mlp.down_proj"]["max"] > 0
    share = comp["llm_int8_float_share"]
    assert len(share["layers"]) == 210 and 0 < share["overall"] < 1
    assert share["layers"]["model.layers.29.mlp.down_proj"] > 0


def _kv_scales(report):
    assert len(report["stages"][1]["layers"]) == 30


@requires_data
@pytest.mark.parametrize("recipe_file, max_ppl_increase, check", [
    # the bar (0.5%); measured -0.06% on these 2 × 512 windows. slow (50 s): the default suite keeps under 15
    # minutes on 2 cores; bench/quant_table.py measures int8 absmax on 8 × 2048 test windows
    pytest.param("recipes/int8_absmax.yaml", 0.005, None, marks=pytest.mark.slow),
    ("recipes/int4_rtn.yaml", 0.60, _int4_bytes),  # int4 g64 zero-point RTN: measured +37.7% on these windows
    # slow too (55 s each): LLM.int8 and fp8 + KV scales are checked on tiny models in the default suite
    # (test_llm_int8.py, test_kv_cache.py); LLM.int8 dynamic: measured +1.41% on these windows
    pytest.param("recipes/llm_int8.yaml", 0.05, _llm_int8_outliers, marks=pytest.mark.slow),
    # fp8 static + fp8 KV cache: measured +2.66% on these windows
    pytest.param("recipes/fp8_static_kv.yaml", 0.10, _kv_scales, marks=pytest.mark.slow),
], ids=["int8_absmax", "int4_rtn", "llm_int8", "fp8_static_kv"])
def test_recipe_on_smollm2(tmp_path, recipe_file, max_ppl_increase, check):
    out = tmp_path / "run"
    recipe = load_recipe(recipe_file, [f"output.dir={out}", "calibration.n_samples=2", "calibration.seq_len=128",
                                       "eval.seq_len=512", "eval.max_windows=2", "eval.speed=false", "eval.samples=0"])
    report = run(recipe, progress=False, log=lambda m: None)
    models = report["eval"]["models"]
    base, comp = models["baseline"], models["compressed"]
    assert 5 < base["ppl"] < 60  # a real language model on WikiText-2, not noise (vocab 49k)
    assert comp["ppl"] / base["ppl"] - 1 < max_ppl_increase
    assert 0 < comp["kl"] and 0 < comp["top1_agreement"] <= 1
    assert report["stages"][0]["quantized"] == 210  # 30 blocks × 7 linears
    assert [s["name"] for s in report["stages"][0]["skipped"]] == ["lm_head"]
    saved = json.loads((out / "report.json").read_text())
    assert saved["recipe"]["sha256"] == recipe.sha256
    assert saved["calibration"]["fingerprint"] and len(saved["block_errors"]) == 30
    assert (out / "model.safetensors").is_file() and (out / "report.md").is_file()
    if check is not None:
        check(report)


@requires_data
@pytest.mark.slow  # 150-320 s on 2 cores (two full runs, AWQ search); bench/awq_gptq_table.py measures the same claim
def test_awq_then_gptq_on_smollm2(tmp_path):
    """The headline pipeline on the real model with a small calibration set; RTN on the same windows as the bar."""
    common = ["calibration.n_samples=8", "calibration.seq_len=256", "eval.seq_len=512", "eval.max_windows=2",
              "eval.speed=false", "output.save_model=false",
              "eval.samples=0"]
    rtn = run(load_recipe("recipes/int4_rtn.yaml", common + [f"output.dir={tmp_path / 'rtn'}", "calibration=null"]),
              progress=False, log=lambda m: None)
    both = run(load_recipe("recipes/awq_gptq_int4.yaml", common + [f"output.dir={tmp_path / 'awq_gptq'}",
                                                                   "stages.0.search_samples=2"]),
               progress=False, log=lambda m: None)
    r, b = rtn["eval"]["models"]["compressed"], both["eval"]["models"]["compressed"]
    assert b["ppl"] < r["ppl"] and b["kl"] < r["kl"]  # measured ppl 34.25 vs 38.87, KL 0.191 vs 0.381 (base 28.23)
    pairs = [p for blk in both["stages"][0]["blocks"] for p in blk["pairs"]]
    assert sum(1 for p in pairs if not p["skipped"]) == 3 * 30  # q/k/v, gate/up, up->down scaled in every block
    assert all("grouped-query attention" in p["skipped"] for p in pairs if p["pair"].startswith("self_attn.v_proj"))


@pytest.mark.slow  # 82 s on 2 cores; pruning, distillation and their reload are tested on tiny models by default
@requires_data
def test_minitron_prune_distill_on_smollm2_loads_with_plain_transformers(tmp_path):
    """The recipe on the real model, shortened: the pruned model is smaller, distillation lowers its perplexity,
    and the output folder is a plain Hugging Face checkpoint."""
    import transformers

    out = tmp_path / "run"
    recipe = load_recipe("recipes/minitron_prune_distill.yaml", [
        f"output.dir={out}", "stages.0.n_samples=4", "stages.0.seq_len=256", "stages.1.steps=6",
        "stages.1.batch_size=2", "stages.1.seq_len=128", "stages.1.warmup_steps=1", "stages.1.eval_every=3",
        "stages.1.eval_windows=1", "stages.1.eval_seq_len=256", "stages.1.checkpoint_every=0",
        "eval.seq_len=512", "eval.max_windows=2", "eval.speed=false", "eval.samples=0"])
    report = run(recipe, progress=False, log=lambda m: None)
    prune, distill = report["stages"]
    assert prune["pruned"]["intermediate"] == 864 and 0.73 < prune["parameter_ratio"] <= 0.75
    models = report["eval"]["models"]
    assert models["compressed"]["ppl"] < models["pruned"]["ppl"]  # 6 steps of 256 tokens already help
    assert distill["curve"][-1]["kl"] < distill["curve"][0]["kl"]
    plain = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert plain.config.intermediate_size == 864
    assert sum(p.numel() for p in plain.parameters()) == prune["parameters_after"]


@requires_data
@pytest.mark.slow
def test_minitron_default_budget_closes_half_the_gap(tmp_path):
    """The issue's bar, with the recipe's default distillation budget (65,536 tokens, ~10 min on one CPU core)."""
    report = run(load_recipe("recipes/minitron_prune_distill.yaml", [f"output.dir={tmp_path / 'run'}"]),
                 progress=False, log=lambda m: None)
    m = report["eval"]["models"]
    closed = (m["pruned"]["ppl"] - m["compressed"]["ppl"]) / (m["pruned"]["ppl"] - m["baseline"]["ppl"])
    assert closed >= 0.5  # measured 70% (64.19 -> 32.71, baseline 19.13) on 8 × 2048 test tokens
