"""SmoothQuant: the scale formula against a naive reference, the W8A8 gain on a
model with planted outliers, the alpha search, and the recipe rules. (Folding the scales is apply_smoothing, tested
on every family in test_awq.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

from compress.arch import get_arch
from compress.calibrate.blockwise import BlockPass, run_blockwise
from compress.calibrate.observers import BlockObserver
from compress.transforms.outliers import PlantSpec, plant_outliers
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.quantizers.smoothquant import smoothing_scales, smoothquant_block
from compress.stages.smoothquant import SmoothQuantStage
from compress.recipe import RecipeError, from_dict
from compress.core.scheme import W8A8
from tests.conftest import make_tiny_model
from tests.reference.naive_8bit import naive_smoothing_scales


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.85, 1.0])
def test_scales_match_reference(alpha):
    x = torch.rand(50) * 30
    x[3] = 0.0  # a channel that never fires keeps s = 1
    w = torch.rand(50) * 0.2
    ours = smoothing_scales(x, w, alpha)
    torch.testing.assert_close(ours, torch.tensor(naive_smoothing_scales(x.tolist(), w.tolist(), alpha)),
                               rtol=1e-6, atol=0)
    assert ours[3] == 1.0


def _smooth(model, stage, scheme=W8A8, samples=None):
    """Run only the smoothquant step of the block loop (and optionally quantize); returns per-block errors."""
    arch = get_arch(model)
    qstage = QuantizeStage(scheme=scheme)
    plan = plan_quantize(model, arch, qstage)
    samples = samples if samples is not None else torch.randint(0, 256, (2, 24))
    results = []

    def observe(_i, _prefix, block):
        linears = [n for n, m in block.named_modules() if n and type(m).__name__ in ("Linear", "Conv1D")]
        inspect = sorted({insp for _, _, insp in arch.awq})
        return BlockObserver(block, linears, inspect, abs_mean=False, hessian=False, keep_samples=2, abs_max=True)

    def on_block(_i, prefix, block, _inputs, observer):
        quantized = {e.name[len(prefix) + 1:] for e in plan.quantized if e.name.startswith(prefix + ".")}
        divisor = {}
        if stage is not None:
            results.append(smoothquant_block(block, arch.awq, observer, stage, scheme, quantized, arch.norm_offset,
                                             divisor))
        apply_quantize(model, plan, qstage, prefix, observer, divisor)

    errors = run_blockwise(model, arch, samples, on_block, BlockPass(progress=False, observe=observe))
    return errors, results


def test_smoothquant_cuts_w8a8_error_on_planted_outliers():
    model = make_tiny_model("llama")
    plant_outliers(model, get_arch(model), PlantSpec(channels=3, factor=40.0))
    samples = torch.randint(0, 256, (2, 24))
    plain, _ = _smooth(copy.deepcopy(model), None, samples=samples)
    smooth, results = _smooth(model, SmoothQuantStage(alpha=0.5), samples=samples)
    assert sum(smooth) < sum(plain) / 3
    pairs = results[0]
    assert [p.skipped == "" for p in pairs] == [True, False, True, True]  # v_proj -> o_proj: grouped-query
    assert "grouped-query" in pairs[1].skipped


def test_alpha_search_keeps_the_best_grid_point():
    model = make_tiny_model("llama")
    plant_outliers(model, get_arch(model), PlantSpec(channels=3, factor=40.0))
    grid = (0.2, 0.5, 0.8)
    _, results = _smooth(model, SmoothQuantStage(alpha_grid=grid))
    searched = [p for block in results for p in block if not p.skipped]
    assert len(searched) == 2 * 3  # q/k/v, gate/up and up -> down in both blocks
    for p in searched:
        assert sorted(p.grid) == sorted(grid)
        assert p.ratio == min(p.grid, key=p.grid.get) and p.loss == min(p.grid.values())
        assert len(set(p.grid.values())) == len(grid)  # the loss depends on alpha: the search has something to pick
    # on planted outliers the identity (alpha 0 is not it: s = 1/max|W|) loses to the chosen scales somewhere
    assert any(p.loss < p.loss_identity for p in searched)


def test_alpha_search_picks_what_a_fixed_alpha_run_confirms():
    """The alpha the search keeps for the first pair (input norm -> q/k/v of block 0, which no earlier smoothing
    touched) gives that pair the lowest loss: re-running with each grid alpha fixed, the first pair's search
    loss at the chosen alpha is the smallest of the fixed runs' losses."""
    grid = (0.2, 0.5, 0.8)
    model = make_tiny_model("llama")
    plant_outliers(model, get_arch(model), PlantSpec(channels=3, factor=40.0))
    samples = torch.randint(0, 256, (2, 24))
    _, searched = _smooth(copy.deepcopy(model), SmoothQuantStage(alpha_grid=grid), samples=samples)
    fixed = {}
    for a in grid:
        _, res = _smooth(copy.deepcopy(model), SmoothQuantStage(alpha=a, alpha_grid=(a,)), samples=samples)
        fixed[a] = res[0][0].loss
    first = searched[0][0]
    assert first.grid == pytest.approx(fixed, rel=1e-5)
    assert first.ratio == min(fixed, key=fixed.get)


def _recipe(stages):
    return {"model": "default", "calibration": {"kind": "self", "n_samples": 1, "seq_len": 8}, "stages": stages}


def test_recipe_rules():
    ok = from_dict(_recipe([{"stage": "smoothquant", "alpha_grid": [0.4, 0.6]},
                            {"stage": "quantize", "scheme": "W8A8"}]))
    assert isinstance(ok.stages[0], SmoothQuantStage) and ok.stages[0].alpha_grid == (0.4, 0.6)
    with pytest.raises(RecipeError, match="quantize activations"):
        from_dict(_recipe([{"stage": "smoothquant"}, {"stage": "quantize", "scheme": "W4A16_G64"}]))
    with pytest.raises(RecipeError, match="quantize activations"):
        from_dict(_recipe([{"stage": "smoothquant"}, {"stage": "quantize", "scheme": "LLM_INT8"}]))
    with pytest.raises(RecipeError, match="alpha"):
        from_dict(_recipe([{"stage": "smoothquant", "alpha": 1.5}, {"stage": "quantize", "scheme": "W8A8"}]))
    with pytest.raises(RecipeError, match="calibration"):
        from_dict({**_recipe([{"stage": "smoothquant"}, {"stage": "quantize", "scheme": "W8A8"}]),
                   "calibration": None})
