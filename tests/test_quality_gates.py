"""Quality gates on the real embedded model (SmolLM2-135M-Instruct): AWQ, GPTQ and AWQ+GPTQ int4 each beat
round-to-nearest int4 on held-out KL, through the shipped recipes and the pipeline's own calibration pass.

To stay near two minutes on 2 cores, the recipes quantize 5 of the 30 decoder blocks, spread over the depth (the
others stay float, so every difference in KL comes from those blocks), calibrate on 16 × 256 WikiText-2
validation tokens, and are scored on 4 × 512 WikiText-2 *test* tokens (held out) against the float model.
A no-op AWQ or a GPTQ that does not propagate its rounding error gives RTN's KL (ratio 1.0); the bars below
sit well under 1 and well above what each method measures (0.51-0.63), so they fail for a broken algorithm and
not for noise. AWQ+GPTQ is not asserted below AWQ alone: on these 5 blocks they tie (0.0289 vs 0.0278); on the
whole model AWQ+GPTQ is clearly better (validation KL 0.097 vs 0.139, bench/validation_defaults.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

from compress.arch import get_arch
from compress.measure.ppl import score_windows
from compress.pipeline.report import eval_windows
from compress.core.nn import QuantLinear
from compress.pipeline.calibration import compress_model
from compress.stages import make_plan
from compress.recipe import load_recipe
from tests.conftest import requires_data

# slow (about 2 minutes): the default suite keeps under 15 minutes on 2 cores; each method's algorithm is checked
# against its plain reference there (test_awq.py, test_gptq.py, test_gptq_fast.py)
pytestmark = [requires_data, pytest.mark.slow]

BLOCKS = (0, 6, 12, 18, 24)
TARGETS = "[re:model\\.layers\\.(" + "|".join(map(str, BLOCKS)) + ")\\..*]"
CALIBRATION = ["calibration.n_samples=16", "calibration.seq_len=256", "calibration.seed=0"]
RUNS = {  # name: (recipe, index of its quantize stage, extra overrides)
    "rtn": ("recipes/int4_rtn.yaml", 0, []),
    "awq": ("recipes/awq_int4.yaml", 1, []),
    "gptq": ("recipes/gptq_int4.yaml", 0, []),
    "awq+gptq": ("recipes/awq_gptq_int4.yaml", 1, []),
}


@pytest.fixture(scope="module")
def scores():
    return compress_and_score()


def compress_and_score(runs: dict = RUNS):
    """Each recipe on a copy of the float model; all of them scored in one pass over the held-out windows."""
    from compress.model.load import load_model

    loaded = load_model("default")
    base, tokenizer = loaded.model, loaded.tokenizer
    arch = get_arch(base)
    models = {"float": base}
    reports = {}
    for name, (recipe_file, q, extra) in runs.items():
        recipe = load_recipe(recipe_file, CALIBRATION + extra + [f"stages.{q}.targets={TARGETS}"])
        model = copy.deepcopy(base)
        plan = make_plan(model, arch, recipe.stages)
        reports[name], _ = compress_model(model, tokenizer, recipe, plan, "cpu", progress=False,
                                          log=lambda m: None)
        models[name] = model
    windows = eval_windows(tokenizer, "test", 512, 4)
    with torch.no_grad():
        result = score_windows(models, windows, baseline="float", progress=False)
    return result, models, reports


def test_the_recipes_quantize_exactly_the_chosen_blocks(scores):
    _, models, reports = scores
    for name in RUNS:
        quantized = [n for n, m in models[name].named_modules() if isinstance(m, QuantLinear)]
        assert len(quantized) == 7 * len(BLOCKS), name
        assert {int(n.split(".")[2]) for n in quantized} == set(BLOCKS)
        stage = reports[name]["stages"][RUNS[name][1]]
        assert stage["quantized"] == 7 * len(BLOCKS)
        assert all("not matched by targets" in s["reason"] or s["name"] == "lm_head" for s in stage["skipped"])


def test_awq_beats_rtn(scores):
    s = scores[0]
    assert s["awq"].kl < 0.75 * s["rtn"].kl  # measured 0.0278 vs 0.0545 (ratio 0.51)
    assert s["awq"].top1_agreement > s["rtn"].top1_agreement  # measured 91.1% vs 86.0%


def test_gptq_beats_rtn(scores):
    """With act order (the default, chosen on validation); without it GPTQ loses to RTN on these blocks (block 18's
    v_proj alone: KL 0.021 against RTN's 0.0035), which bench/validation_defaults.py measured on the whole model."""
    s = scores[0]
    assert s["gptq"].kl < 0.85 * s["rtn"].kl  # measured 0.0343 vs 0.0545 (ratio 0.63)
    assert s["gptq"].top1_agreement > s["rtn"].top1_agreement  # measured 89.9% vs 86.0%


def test_awq_then_gptq_beats_rtn(scores):
    s = scores[0]
    assert s["awq+gptq"].kl < 0.75 * s["rtn"].kl  # measured 0.0289 vs 0.0545 (ratio 0.53)
    assert s["awq+gptq"].top1_agreement > s["rtn"].top1_agreement  # measured 91.2% vs 86.0%


def test_awq_scaled_every_scalable_pair_of_the_chosen_blocks(scores):
    _, _, reports = scores
    pairs = [p for blk in reports["awq"]["stages"][0]["blocks"] for p in blk["pairs"]
             if blk["block"] in BLOCKS]
    scaled = [p for p in pairs if not p["skipped"]]
    assert len(scaled) == 3 * len(BLOCKS)  # q/k/v, gate/up, up -> down; v -> o is grouped-query (skipped)
    assert all(p["loss"] <= p["loss_identity"] for p in scaled)
    assert sum(p["ratio"] > 0 for p in scaled) >= 2 * len(BLOCKS)  # the search moved off the identity (r = 0)


def test_autoround_beats_rtn_and_gptq():
    """AutoRound through the pipeline on the same 5 blocks and windows (50 steps of 2 windows: the shipped recipe
    takes 200; this keeps the test near a minute). Slow: it adds a minute to the default suite's budget."""
    runs = {"rtn": RUNS["rtn"], "gptq": RUNS["gptq"],
            "autoround": ("recipes/gptq_int4.yaml", 0, ["stages.0.method=autoround",
                                                        "stages.0.options={iters: 50, batch_size: 2}"])}
    s, _, reports = compress_and_score(runs)
    assert s["autoround"].kl < 0.75 * s["rtn"].kl  # measured 0.0243 vs 0.0545 (ratio 0.45)
    assert s["autoround"].kl < s["gptq"].kl  # measured 0.0243 vs 0.0343
    tuning = reports["autoround"]["stages"][0]["tuning"]
    assert set(tuning) == {f"model.layers.{b}" for b in BLOCKS}
    assert all(r["kept_loss"] < r["first_loss"] for r in tuning.values())
