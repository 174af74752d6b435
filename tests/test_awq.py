"""AWQ: scales help salient channels, smoothing preserves the function, clipping never hurts,
and every tiny architecture runs AWQ and GPTQ through the block-by-block runner."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.arch import get_arch
from compress.calibrate.blockwise import BlockPass, run_blockwise
from compress.core.nn import QuantLinear
from compress.pipeline.calibration import StagePass, start_stages
from compress.stages import make_plan
from compress.quantizers import quantize_rtn
from compress.core.primitives import shrink_range
from compress.quantizers.awq import clip_factor, search_clip, search_scales
from compress.quantizers.rtn import fake_quantize
from compress.transforms.smoothing import apply_smoothing, in_weight, out_channels
from compress.recipe import from_dict
from compress.core.scheme import scheme
from tests.conftest import TINY_CONFIGS, make_tiny_model


def _salient_inputs(n=1024, k=256, salient=(3, 77, 150), factor=40.0):
    x = torch.randn(n, k)
    x[:, list(salient)] *= factor  # a few channels with large activations, as in real LLMs
    return x


@pytest.mark.parametrize("sch", [scheme("int4", "group", 64, True), scheme("int3", "group", 64, False),
                                 scheme("int4", "channel", symmetric=False)], ids=lambda s: s.name)
def test_awq_beats_rtn_on_salient_channels(sch):
    torch.manual_seed(0)
    x = _salient_inputs()
    w = torch.randn(128, 256) * 0.05
    ref = x @ w.T

    def loss(s):
        return float(((x / s) @ fake_quantize(w * s, sch).T - ref).pow(2).mean())

    s, ratio, best, at_identity = search_scales(x.abs().mean(0), loss, n_grid=20)
    err_rtn = float((x @ quantize_rtn(w, sch).dequantize().T - ref).pow(2).mean())
    assert at_identity == pytest.approx(err_rtn, rel=1e-5)  # r = 0 is plain RTN
    assert ratio > 0
    assert best < 0.5 * err_rtn  # measured 0.15-0.26x of RTN's error for these schemes


def test_smoothing_preserves_a_norm_linear_pair():
    norm = nn.LayerNorm(64)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    lin = nn.Linear(64, 32)
    x = torch.randn(5, 64)
    before = lin(norm(x))
    apply_smoothing(norm, [lin], torch.rand(64) * 4 + 0.1)
    torch.testing.assert_close(lin(norm(x)), before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_smoothing_every_pair_is_function_preserving(family):
    model = make_tiny_model(family)
    arch = get_arch(model)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        before = model(ids).logits
        for block in arch.block_list(model):
            for prev_name, balance_names, _ in arch.awq:
                prev = block.get_submodule(prev_name)
                balance = [block.get_submodule(n) for n in balance_names]
                if out_channels(prev) != in_weight(balance[0]).shape[1]:
                    continue  # grouped-query v -> o: the runner skips it too
                apply_smoothing(prev, balance, torch.rand(out_channels(prev)) * 3 + 0.2, arch.norm_offset)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_clip_search_never_increases_the_error():
    torch.manual_seed(0)
    sch = scheme("int3", "group", 32, False)
    w = torch.randn(64, 128) * 0.05
    w[:, 7] = 0.6  # one large weight per row stretches its group
    x = torch.randn(256, 128)
    lo, hi = search_clip(w, x, sch, grid=20, max_shrink=0.5)
    wg = w.reshape(64, 4, 32)
    clipped = torch.minimum(torch.maximum(wg, lo[..., None]), hi[..., None]).reshape(64, 128)
    xg = x.reshape(256, 4, 32)

    def group_err(v):  # per (row, group) output error, the quantity the search minimises
        q = fake_quantize(v, sch).reshape(64, 4, 32)
        return (torch.einsum("tgk,ngk->ntg", xg, q) - torch.einsum("tgk,ngk->ntg", xg, wg)).pow(2).mean(1)

    assert torch.all(group_err(clipped) <= group_err(w) * (1 + 1e-5))
    assert group_err(clipped).sum() < group_err(w).sum()
    assert (hi < wg.amax(-1)).any()  # some group was actually clipped
    # the same ranges as factors of each group's range (clip_to: grid hands these to GPTQ)
    f = clip_factor(w, lo, hi, sch)
    assert ((f > 0.45) & (f <= 1 + 1e-6)).all() and (f < 1).any()
    torch.testing.assert_close(shrink_range(w, f, sch), clipped, rtol=0, atol=1e-6)


def _recipe(stages):
    return from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 4, "seq_len": 16},
                      "stages": stages})


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("stages", [
    [{"stage": "awq", "n_grid": 5, "search_samples": 2},
     {"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16}}],
    [{"stage": "quantize", "method": "gptq", "scheme": {"dtype": "int4", "group_size": 16, "symmetric": False}}],
    [{"stage": "awq", "n_grid": 5, "search_samples": 2},
     {"stage": "quantize", "method": "gptq", "scheme": {"dtype": "int3", "group_size": 16}}],
    [{"stage": "awq", "n_grid": 5, "search_samples": 2, "clip_to": "grid"},
     {"stage": "quantize", "method": "gptq", "scheme": {"dtype": "int3", "group_size": 16}}],
], ids=["awq", "gptq", "awq+gptq", "awq(grid clip)+gptq"])
def test_every_architecture_runs_awq_and_gptq(family, stages):
    model = make_tiny_model(family)
    arch = get_arch(model)
    recipe = _recipe(stages)
    ids = torch.randint(0, 256, (4, 16))
    with torch.no_grad():
        before = model(ids).logits
    plan = make_plan(model, arch, recipe.stages)
    ctx = start_stages(model, plan)
    stage_pass = StagePass(ctx)
    errors = run_blockwise(model, arch, ids, stage_pass.on_block, BlockPass(observe=stage_pass.observe, progress=False))
    assert len(errors) == len(arch.block_list(model)) and all(e > 0 for e in errors)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == len(plan.steps[-1].quantized)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.isfinite(after).all()
    rel = float((after - before).norm() / before.norm())
    assert 0 < rel < 0.6  # measured 0.01-0.29 on these random tiny models at 3-4 bits
    if stages[0]["stage"] == "awq":
        pairs = [p for blk in ctx.records[0] for p in blk["pairs"]]
        assert pairs and all(p["skipped"] or p["loss"] <= p["loss_identity"] for p in pairs)


def test_awq_gqa_v_to_o_is_skipped_with_reason():
    model = make_tiny_model("llama")  # 4 heads, 2 kv heads: v_proj 32 outputs, o_proj reads 64
    arch = get_arch(model)
    recipe = _recipe([{"stage": "awq", "n_grid": 3, "search_samples": 1},
                      {"stage": "quantize", "scheme": {"dtype": "int4", "group_size": 16}}])
    ctx = start_stages(model, make_plan(model, arch, recipe.stages))
    stage_pass = StagePass(ctx)
    run_blockwise(model, arch, torch.randint(0, 256, (2, 8)), stage_pass.on_block,
                  BlockPass(observe=stage_pass.observe, progress=False))
    v_o = [p for p in ctx.records[0][0]["pairs"] if p["pair"].startswith("self_attn.v_proj")]
    assert v_o and "grouped-query attention" in v_o[0]["skipped"]


@pytest.mark.parametrize("stages, match", [
    ([{"stage": "awq"}], "a later `stage: quantize`"),
    ([{"stage": "awq", "scheme": "W4A16"}, {"stage": "quantize", "scheme": "W4A16_G64"}], "differs from"),
    ([{"stage": "awq", "clip_to": "grid"}, {"stage": "quantize", "method": "rtn"}],
     "hands the clipped ranges to GPTQ.*quantizes with rtn; use clip_to: weights"),
    ([{"stage": "awq", "clip_to": "codes"}, {"stage": "quantize", "method": "gptq"}], "clip_to is 'codes'"),
])
def test_awq_recipe_rules(stages, match):
    with pytest.raises(ValueError, match=match):
        _recipe(stages)


def test_awq_and_gptq_need_calibration():
    with pytest.raises(ValueError, match="needs calibration data"):
        from_dict({"model": "x", "stages": [{"stage": "quantize", "method": "gptq"}]})


def test_awq_searches_for_the_scheme_of_the_next_quantize_stage():
    """AWQ names no scheme of its own: the plan resolves its target, the next quantize stage, in one place (the
    same lookup SmoothQuant uses), and the report names that scheme."""
    recipe = _recipe([{"stage": "awq"}, {"stage": "kv_cache"}, {"stage": "quantize", "scheme": "W4A16_G64"},
                      {"stage": "quantize", "scheme": "W8A16", "targets": ["lm_head"], "ignore": []}])
    assert recipe.stages[0].scheme is None
    model = make_tiny_model("llama")
    plan = make_plan(model, get_arch(model), recipe.stages)
    assert plan.target(0) == (recipe.stages[2], plan.steps[2])
    assert recipe.stages[0].report(start_stages(model, plan), 0)["scheme"] == recipe.stages[2].scheme.name


@pytest.mark.parametrize("sch", [scheme("int4", "group", 64, True), scheme("int3", "group", 32, False),
                                 scheme("int8", "channel")], ids=lambda s: s.name)
def test_fake_quantize_is_the_rtn_round_trip(sch):
    w = torch.randn(48, 128)
    assert torch.equal(fake_quantize(w, sch), quantize_rtn(w, sch).dequantize())
