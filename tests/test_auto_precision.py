"""Mixed precision under a byte budget: the knapsack against brute force, the sensitivities against plain
references, per-layer schemes in the quantize and AWQ stages, and `stage: auto_precision` through `compress run`."""
from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml

from compress.arch import get_arch
from compress.arch.fused import fused_groups
from compress.precision.fisher_blocks import blocks_problem
from compress.arch.moe import unfuse_experts
from compress.core.nn import is_linear
from compress.precision.mixed import AWQModel, choose, choose_grouped, scheme_bytes, weight_error
from compress.precision.sensitivity import measure_sensitivity
from compress.quantizers.rtn import fake_quantize
from compress.quantizers.gptq import quantize_gptq
from compress.recipe import RecipeError, from_dict, to_plain
from compress.core.scheme import W4A16_ASYM_G64, W8A16, scheme
from compress.stages.quantize import LayerScheme, QuantizeStage, apply_quantize, plan_quantize
from compress.threads import cpu_threads
from tests.conftest import TINY_CONFIGS, TINY_MOE_CONFIGS, make_tiny_model
from tests.reference.naive_precision import (awq_layer_reference, brute_force_choice, fisher_token_by_token,
                                             kl_with_weight_replaced)

INT4 = scheme("int4", "group", 16, symmetric=False)
INT2 = scheme("int2", "group", 16, symmetric=False)
INT5 = scheme("int5", "group", 16, symmetric=False)
INT8 = W8A16
MENU = [INT8, INT4, INT2]


# ---------------------------------------------------------------- the knapsack

@pytest.mark.parametrize("seed", range(6))
def test_choice_equals_brute_force(seed):
    """With one byte a unit (resolution = budget) the dynamic programme is exact: the brute-force optimum."""
    rng = np.random.default_rng(seed)
    n_layers, n_opts = 5, 3
    nbytes = rng.integers(1, 40, size=(n_layers, n_opts))
    costs = rng.random((n_layers, n_opts)) * (50 - nbytes)  # bigger options tend to cost less
    if seed % 2:
        nbytes[0, 1], costs[0, 1] = -1, math.inf  # an option layer 0 cannot take
    budget = int(nbytes.clip(min=0).sum() * 0.45) + nbytes.max()
    best, combo = brute_force_choice(costs.tolist(), nbytes.tolist(), budget)
    got = choose(costs, nbytes, budget, resolution=budget)
    rows = np.arange(n_layers)
    assert nbytes[rows, got].sum() <= budget and (nbytes[rows, got] >= 0).all()
    assert costs[rows, got].sum() == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_grouped_choice_equals_brute_force_over_tied_layers(seed):
    """Layers of a fused group (q/k/v, gate/up) take one option: the optimum among the per-layer combinations that
    give every group's layers the same option."""
    rng = np.random.default_rng(seed)
    nbytes = rng.integers(1, 40, size=(6, 3))
    costs = rng.random((6, 3)) * (50 - nbytes)
    groups = [[0, 1, 2], [3], [4, 5]]
    tied = np.stack([nbytes[g].sum(0) for g in groups])  # [groups, options]
    budget = int(tied.min(1).sum() + 0.4 * (tied.max(1).sum() - tied.min(1).sum()))
    best = math.inf
    for combo in itertools.product(range(3), repeat=6):
        if all(len({combo[i] for i in g}) == 1 for g in groups):
            rows = np.arange(6)
            if nbytes[rows, combo].sum() <= budget:
                best = min(best, costs[rows, combo].sum())
    got = choose_grouped(costs, nbytes, budget, groups, resolution=budget)
    assert all(len({got[i] for i in g}) == 1 for g in groups)
    assert nbytes[np.arange(6), got].sum() <= budget
    assert costs[np.arange(6), got].sum() == pytest.approx(best, rel=1e-12)


def test_default_resolution_fits_and_is_within_the_rounding_of_the_optimum():
    """Bytes are rounded up to units of budget / (100 × layers): the choice always fits, and costs no more than the
    exact optimum of a budget 1% smaller."""
    rng = np.random.default_rng(7)
    nbytes = rng.integers(1000, 40000, size=(6, 3))
    costs = rng.random((6, 3))
    budget = int(nbytes.sum(1).mean() * 2)
    got = choose(costs, nbytes, budget)
    rows = np.arange(6)
    assert nbytes[rows, got].sum() <= budget
    assert costs[rows, got].sum() <= brute_force_choice(costs.tolist(), nbytes.tolist(), 0.99 * budget)[0] + 1e-12


def test_a_budget_below_the_narrowest_menu_is_an_error_naming_the_minimum():
    nbytes = np.array([[10, 4], [10, 4]])
    with pytest.raises(ValueError, match=r"smallest the menu allows \(8 bytes"):
        choose(np.ones((2, 2)), nbytes, 7)


# ---------------------------------------------------------------- sensitivities

@pytest.fixture
def llama():
    model = make_tiny_model("llama").float()
    model.requires_grad_(False)
    return model


def _windows(n=2, t=12):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(3))


def test_fisher_equals_the_token_by_token_reference(llama):
    names = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    ids = _windows()
    sens = measure_sensitivity(llama, ids, names, MENU, "fisher", seed=5)
    for i, name in enumerate(names):
        w = llama.get_submodule(name).weight.detach().float()
        for j, option in enumerate(MENU):
            ref = fisher_token_by_token(llama, ids, name, w + weight_error(w, option)[0], seed=5)
            assert sens.costs["fisher"][i, j] == pytest.approx(ref, rel=1e-4)


def _rows(model, ids, name):
    """Every input row [T, in] the layer sees over the windows, from a plain capture."""
    rows = []
    h = model.get_submodule(name).register_forward_hook(
        lambda _m, args, _o: rows.append(args[0].detach().float().reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for k in range(ids.shape[0]):
            model(input_ids=ids[k:k + 1], use_cache=False)
    h.remove()
    return torch.cat(rows)


def _plain_hessian(model, ids, name):
    """Σ x xᵀ of the layer's inputs over the windows, from a plain capture of every input row."""
    x = _rows(model, ids, name).double()
    return (x.t() @ x).float()


def test_fisher_of_gptq_errors_equals_the_token_by_token_reference(llama):
    """error_method="gptq": the sensitivity of each layer is that of GPTQ's solution, solved with the Hessian of the
    layer's float inputs over the same windows (a one-layer Hessian budget, one group per pass, changes nothing)."""
    names = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    ids = _windows()
    sens = measure_sensitivity(llama, ids, names, MENU, "fisher", seed=5, error_method="gptq")
    small = measure_sensitivity(llama, ids, names, MENU, "fisher", seed=5, error_method="gptq", hessian_budget=1)
    np.testing.assert_array_equal(sens.costs["fisher"], small.costs["fisher"])
    for i, name in enumerate(names):
        w = llama.get_submodule(name).weight.detach().float()
        hess = _plain_hessian(llama, ids, name)
        for j, option in enumerate(MENU):
            q = quantize_gptq(w, hess, option).dequantize(torch.float32)
            ref = fisher_token_by_token(llama, ids, name, q, seed=5)
            assert sens.costs["fisher"][i, j] == pytest.approx(ref, rel=1e-3)
    with pytest.raises(ValueError, match="error_method 'awq'"):
        measure_sensitivity(llama, ids, names, MENU, "fisher", error_method="awq")


def test_fisher_of_awq_errors_equals_the_plain_reference(llama):
    """error_method awq_rtn / awq_gptq: each layer's weight error is that of AWQ's scale search and clipping done on
    the layer alone (a plain float64 reference over every input row), then round-to-nearest or GPTQ in the scaled
    basis; a layer outside every scaling pair (here q_proj, as if its pair were skipped) is only clipped, one in
    no_clip only scaled."""
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    awq = AWQModel(scaled=frozenset(names[1:]), no_clip=frozenset(names[1:2]), n_grid=5, clip_grid=10)
    ids = _windows()
    for method, clip_to in (("awq_rtn", "weights"), ("awq_gptq", "weights"), ("awq_gptq", "grid")):
        awq = replace(awq, clip_to=clip_to)
        sens = measure_sensitivity(llama, ids, names, MENU, "fisher", seed=5, error_method=method, awq=awq)
        for i, name in enumerate(names):
            w = llama.get_submodule(name).weight.detach().float()
            x = _rows(llama, ids, name)
            for j, option in enumerate(MENU):
                ws, s, whole, factors = awq_layer_reference(x, w, option, name in awq.scaled,
                                                            name not in awq.no_clip, n_grid=5, clip_grid=10)
                s = torch.ones(w.shape[1], dtype=torch.float64) if s is None else s
                if method == "awq_rtn":
                    q = fake_quantize(ws.float(), option).double()
                else:
                    xs = (x.double() / s).float()
                    if clip_to == "grid":  # GPTQ of the whole weights on the clipped ranges' grid
                        q = quantize_gptq(whole.float(), xs.t() @ xs, option,
                                          clip=None if factors is None else factors.float()).dequantize(torch.float64)
                    else:
                        q = quantize_gptq(ws.float(), xs.t() @ xs, option).dequantize(torch.float64)
                ref = fisher_token_by_token(llama, ids, name, (q / s).float(), seed=5)
                assert sens.costs["fisher"][i, j] == pytest.approx(ref, rel=1e-3), (method, clip_to, name,
                                                                                     option.name)


def test_awq_errors_never_cost_more_output_error_than_round_to_nearest(llama):
    """AWQ's searches keep r = 0 (no scaling) and the unclipped range as candidates, on the very inputs measured
    here, so awq_rtn's output error is at most round-to-nearest's for every layer and option, and lower in sum."""
    names = [n for n, m in llama.named_modules() if n.startswith("model.layers.1.") and isinstance(m, torch.nn.Linear)]
    ids = _windows(4, 24)
    awq = AWQModel(scaled=frozenset(names))
    rtn = measure_sensitivity(llama, ids, names, MENU, "fisher").costs["output_error"]
    smoothed = measure_sensitivity(llama, ids, names, MENU, "fisher", error_method="awq_rtn",
                                   awq=awq).costs["output_error"]
    assert (smoothed <= rtn * (1 + 1e-5)).all(), (smoothed, rtn)
    assert smoothed.sum() < 0.9 * rtn.sum()


def test_gptq_errors_cost_less_output_error_than_round_to_nearest(llama):
    """GPTQ minimises each layer's output error on these inputs, so its output-error sensitivity, summed over a
    block's layers, is below round-to-nearest's at every bit width (at 2 bits by a wide margin)."""
    names = [n for n, m in llama.named_modules() if n.startswith("model.layers.1.") and isinstance(m, torch.nn.Linear)]
    ids = _windows(4, 24)
    rtn = measure_sensitivity(llama, ids, names, MENU, "fisher").costs["output_error"].sum(0)
    gptq = measure_sensitivity(llama, ids, names, MENU, "fisher", error_method="gptq").costs["output_error"].sum(0)
    assert (gptq < rtn).all(), (gptq, rtn)
    assert gptq[2] < 0.8 * rtn[2]


def test_measured_kl_equals_replacing_the_weight(llama):
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    ids = _windows()
    sens = measure_sensitivity(llama, ids, names, MENU + [None], "kl")
    for i, name in enumerate(names):
        w = llama.get_submodule(name).weight.detach().float()
        for j, option in enumerate(MENU):
            ref = kl_with_weight_replaced(llama, ids, name, w + weight_error(w, option)[0])
            assert sens.costs["kl"][i, j] == pytest.approx(ref, rel=2e-3, abs=1e-9)
        assert sens.costs["kl"][i, 3] == 0  # float costs nothing
    assert sens.nbytes[0, 3] == llama.get_submodule(names[0]).weight.numel() * 2


def test_fisher_predicts_the_measured_kl_of_a_small_error(llama):
    """For a small weight error the second-order estimate is the KL itself: int8 on every layer of a block, predicted
    with sampled labels on 16 windows, within 35% of the measured value (the estimator's sampling error at 16 × 24
    tokens; measured: within 10-20%)."""
    names = [n for n, m in llama.named_modules() if n.startswith("model.layers.1.") and isinstance(m, torch.nn.Linear)]
    ids = _windows(16, 24)
    fisher = measure_sensitivity(llama, ids, names, [INT8], "fisher", seed=1).costs["fisher"][:, 0]
    kl = measure_sensitivity(llama, ids, names, [INT8], "kl").costs["kl"][:, 0]
    assert fisher.sum() == pytest.approx(kl.sum(), rel=0.35)


def test_sensitivities_grow_as_the_bits_shrink(llama):
    names = [n for n, m in llama.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")]
    sens = measure_sensitivity(llama, _windows(), names, MENU, "fisher")
    for kind in ("fisher", "output_error"):
        c = sens.costs[kind]
        assert (c[:, 0] < c[:, 1]).all() and (c[:, 1] < c[:, 2]).all(), kind
    assert (sens.nbytes[:, 0] > sens.nbytes[:, 1]).all() and (sens.nbytes[:, 1] > sens.nbytes[:, 2]).all()
    assert sens.nbytes[0, 1] == scheme_bytes((64, 64), INT4) == 64 * 64 // 2 + 64 * 4 * 3  # codes, fp16 scale, zero


def test_int5_to_int7_sit_between_int4_and_int8(llama):
    """The widths between int4 and int8, mixed precision's cheaper upgrades: on the same grid (group 16, zero
    point), each bit more costs more bytes and less sensitivity, on every layer."""
    names = [n for n, m in llama.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")]
    menu = [scheme(f"int{b}", "group", 16, symmetric=False) for b in (7, 6, 5)] + [INT4]
    sens = measure_sensitivity(llama, _windows(), names, menu, "fisher")
    c, nbytes = sens.costs["fisher"], sens.nbytes
    assert (np.diff(c, axis=1) > 0).all() and (np.diff(nbytes, axis=1) < 0).all()
    assert nbytes[0, 2] == scheme_bytes((64, 64), INT5) == 64 * 64 * 5 // 8 + 64 * 4 * 3


def test_an_option_a_layer_cannot_hold_is_unavailable(llama):
    g48 = scheme("int4", "group", 48, symmetric=False)  # 64 is not a multiple of 48; 128 (down_proj's) neither
    sens = measure_sensitivity(llama, _windows(1, 8), ["model.layers.0.mlp.down_proj"], [INT4, g48], "fisher")
    assert sens.nbytes[0, 1] == -1 and sens.costs["fisher"][0, 1] == math.inf
    assert choose(sens.costs["fisher"], sens.nbytes, 10 ** 9) == [0]


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS) + sorted(TINY_MOE_CONFIGS))
def test_the_block_by_block_pass_equals_the_whole_model_pass(family):
    """fisher_blocks cuts the backward at the decoder blocks and keeps one block's output errors at a time; by the
    chain rule every layer's costs are the whole-model pass's: every linear (experts, shared experts and the head
    included), round-to-nearest errors on every family, solved errors (GPTQ; AWQ then GPTQ) on two."""
    model = make_tiny_model(family).float()
    unfuse_experts(model)
    names = [n for n, m in model.named_modules() if is_linear(m)]
    assert model.get_submodule(names[-1]) is model.get_output_embeddings()
    ids = _windows(2, 10)
    methods = ["rtn"] + (["gptq", "awq_gptq"] if family in ("llama", "qwen2_moe") else [])
    for method in methods:
        awq = AWQModel(scaled=frozenset(names[::2]), n_grid=4, clip_grid=5)
        # one thread: the block pass would otherwise run its windows on two workers of one thread each
        # (blockwise.block_forward) and the whole-model pass on two threads, whose float32 matmuls round differently
        # (3e-6 relative on one tiny cost of qwen2_moe), which is not what this test is about
        with cpu_threads(1):
            got = {d: measure_sensitivity(model, ids, names, MENU, "fisher", seed=2, error_method=method, awq=awq,
                                          driver=d, hessian_windows=_windows(2, 10) + 1) for d in ("blocks", "model")}
        assert got["blocks"].driver == "blocks" and got["model"].driver == "model"
        for kind in ("fisher", "output_error"):
            np.testing.assert_allclose(got["blocks"].costs[kind], got["model"].costs[kind], rtol=1e-6, atol=0,
                                       err_msg=f"{method} {kind}")
        assert np.isfinite(got["blocks"].costs["fisher"]).sum() > len(names)


def test_the_block_by_block_pass_gives_each_block_its_own_arguments():
    """Gemma 3's local and global layers take different rotary embeddings, and masks past the local window (4 tokens
    here, windows of 10): the block-by-block pass replays each block with its own and gives the whole-model pass's
    costs; Gemma 4's KV-sharing layers read keys and values of
    earlier blocks, so the gradient crosses blocks: its pass runs on the whole model (and refuses to run by blocks,
    saying why)."""
    model = make_tiny_model("gemma3_text", sliding_window=4).float()
    names = [n for n, m in model.named_modules() if is_linear(m)]
    got = {d: measure_sensitivity(model, _windows(2, 10), names, MENU, "fisher", seed=2, driver=d).costs["fisher"]
           for d in ("blocks", "model")}
    np.testing.assert_allclose(got["blocks"], got["model"], rtol=1e-6, atol=0)
    shared = make_tiny_model("gemma4_kv_shared").float()
    names = ["model.layers.3.mlp.down_proj"]
    assert measure_sensitivity(shared, _windows(1, 8), names, [INT4], "fisher").driver == "model"
    with pytest.raises(ValueError, match=r"last 2 layers read the keys and values of earlier layers"):
        measure_sensitivity(shared, _windows(1, 8), names, [INT4], "fisher", driver="blocks")


def test_the_pass_runs_block_by_block_where_the_family_allows(llama):
    names = ["model.layers.0.self_attn.v_proj", "lm_head"]
    assert measure_sensitivity(llama, _windows(1, 8), names, [INT4], "fisher").driver == "blocks"
    assert measure_sensitivity(llama, _windows(1, 8), names, [INT4], "kl").driver == "model"
    with pytest.raises(ValueError, match="cannot be measured block by block: the measured KL"):
        measure_sensitivity(llama, _windows(1, 8), names, [INT4], "kl", driver="blocks")
    assert blocks_problem(llama, ["model.embed_tokens"]) == ("model.embed_tokens lies outside the decoder blocks and "
                                                             "is not the head")


# ---------------------------------------------------------------- per-layer schemes in the quantize stage

def test_layer_schemes_set_schemes_per_layer_first_match_wins(llama):
    stage = QuantizeStage(scheme=INT4, layer_schemes=(
        LayerScheme("model.layers.0.mlp.down_proj", INT8), LayerScheme("re:.*down_proj", INT2),
        LayerScheme("re:.*k_proj", None)))
    plan = plan_quantize(llama, get_arch(llama), stage)
    got = {e.name: e.scheme for e in plan.layers}
    assert got["model.layers.0.mlp.down_proj"] == INT8 and got["model.layers.1.mlp.down_proj"] == INT2
    assert got["model.layers.0.self_attn.q_proj"] == INT4 and got["model.layers.1.self_attn.k_proj"] is None
    reasons = {e.name: e.reason for e in plan.skipped}
    assert reasons["model.layers.0.self_attn.k_proj"] == "left in float by layer_schemes (re:.*k_proj)"
    apply_quantize(llama, plan, stage)
    assert llama.get_submodule("model.layers.0.mlp.down_proj").scheme == INT8
    assert llama.get_submodule("model.layers.1.mlp.up_proj").scheme == INT4
    assert isinstance(llama.get_submodule("model.layers.0.self_attn.k_proj"), torch.nn.Linear)


def test_layer_schemes_are_checked_like_the_stage_scheme(llama):
    g48 = scheme("int4", "group", 48)
    with pytest.raises(ValueError, match="group_size=48"):
        plan_quantize(llama, get_arch(llama), QuantizeStage(scheme=INT4, layer_schemes=(
            LayerScheme("model.layers.0.mlp.up_proj", g48),)))
    with pytest.raises(ValueError, match="method gptq with scheme"):
        QuantizeStage(method="gptq", layer_schemes=(
            LayerScheme("x", replace(INT4, zero_point_dtype="float16")),))


def test_layer_schemes_round_trip_through_a_recipe():
    data = {"model": "unused", "stages": [{"stage": "quantize", "scheme": "W4A16_G64", "layer_schemes": [
        {"layer": "model.layers.0.mlp.down_proj", "scheme": "W8A16"}, {"layer": "re:.*k_proj", "scheme": None}]}]}
    recipe = from_dict(data)
    assert recipe.stages[0].layer_schemes == (LayerScheme("model.layers.0.mlp.down_proj", W8A16),
                                              LayerScheme("re:.*k_proj", None))
    again = from_dict(yaml.safe_load(yaml.safe_dump(to_plain(recipe, skip=("path", "text", "sha256", "overrides")))))
    assert again.stages == recipe.stages


def test_awq_searches_each_layer_for_its_own_scheme():
    """AWQ on a block whose MLP layers are int2 and the rest int8 folds other scales than AWQ for uniform int8, and
    the same as uniform int8 when every layer is int8 by layer_schemes."""
    from compress.calibrate.blockwise import BlockPass, run_blockwise
    from compress.pipeline.calibration import StagePass, start_stages
    from compress.stages import make_plan
    from compress.stages.awq import AWQStage

    def run(layer_schemes):
        model = make_tiny_model("llama").float()
        stages = (AWQStage(n_grid=6, search_samples=2, clip=False),
                  QuantizeStage(scheme=INT8, layer_schemes=layer_schemes))
        plan = make_plan(model, get_arch(model), stages)
        ctx = start_stages(model, plan)
        sp = StagePass(ctx)
        run_blockwise(model, get_arch(model), _windows(2, 16), sp.on_block,
                      BlockPass(observe=sp.observe, progress=False))
        return model.model.layers[0].post_attention_layernorm.weight.detach().clone()

    uniform = run(())
    same = run((LayerScheme("re:.*", INT8),))
    mixed = run((LayerScheme("re:.*mlp.*", INT2),))
    assert torch.equal(uniform, same)
    assert not torch.allclose(uniform, mixed)


# ---------------------------------------------------------------- the stage

def test_stage_needs_one_budget_and_weight_only_menus():
    base = {"model": "unused", "calibration": {"kind": "self", "n_samples": 2, "seq_len": 8}}
    with pytest.raises(RecipeError, match="exactly one budget"):
        from_dict({**base, "stages": [{"stage": "auto_precision"}, {"stage": "quantize"}]})
    with pytest.raises(RecipeError, match="exactly one budget"):
        from_dict({**base, "stages": [{"stage": "auto_precision", "bytes": 10, "bits_per_weight": 4},
                                      {"stage": "quantize"}]})
    with pytest.raises(RecipeError, match="quantizes activations"):
        from_dict({**base, "stages": [{"stage": "auto_precision", "bits_per_weight": 4, "menu": ["W8A8"]},
                                      {"stage": "quantize"}]})
    with pytest.raises(RecipeError, match="a later `stage: quantize`"):
        from_dict({**base, "stages": [{"stage": "auto_precision", "bits_per_weight": 4}]})
    with pytest.raises(RecipeError, match="needs calibration data"):
        from_dict({"model": "unused", "stages": [{"stage": "auto_precision", "bits_per_weight": 4},
                                                 {"stage": "quantize"}]})
    with pytest.raises(RecipeError, match="cannot store"):
        from_dict({**base, "stages": [{"stage": "auto_precision", "bits_per_weight": 4, "menu": [
            {"dtype": "int4", "group_size": 16, "symmetric": False, "zero_point_dtype": "float16"}]},
            {"stage": "quantize", "method": "gptq"}]})
    with pytest.raises(RecipeError, match="imitates the recipe's awq stage, and there is none.*use error_method gptq"):
        from_dict({**base, "stages": [{"stage": "auto_precision", "bits_per_weight": 4, "error_method": "awq_gptq"},
                                      {"stage": "quantize", "method": "gptq"}]})


@pytest.fixture(scope="module", params=["rtn", "gptq", "awq_gptq"])
def run_auto(tmp_path_factory, request):
    """`compress run` of auto_precision (fisher, 4.5 bits per weight, menu int8 / int4 g16 / int2 g16 / int5 g16; sensitivity to
    round-to-nearest's, GPTQ's, or AWQ then GPTQ's weight errors) then GPTQ on the tiny llama (after an awq stage
    for awq_gptq); returns (output folder, report)."""
    from compress.cli.commands import main
    from tests.test_cli import N_SAMPLES, SEQ_LEN, _recipe, make_tiny_tokenizer, word_text

    root = tmp_path_factory.mktemp("auto")
    model_dir = root / "model"
    make_tiny_model("llama").save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    calib = root / "calib.txt"
    calib.write_text(word_text(4 * N_SAMPLES * SEQ_LEN) + "\n")
    recipe = _recipe(model_dir, calib, root / "out", method="gptq")
    recipe["stages"].insert(0, {"stage": "auto_precision", "menu": [to_plain(s) for s in MENU + [INT5]],
                                "bits_per_weight": 4.5, "n_samples": 2, "error_method": request.param,
                                "gptq_samples": 2})
    if request.param.startswith("awq"):
        recipe["stages"].insert(1, {"stage": "awq", "n_grid": 4, "search_samples": 1})
    recipe["eval"] = {"perplexity": True, "max_windows": 1, "seq_len": 16, "speed": False, "split": "test", "samples": 0}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    return root / "out", json.loads((root / "out" / "report.json").read_text()), recipe, root


def test_run_quantizes_each_layer_in_the_scheme_chosen_within_the_budget(run_auto):
    out, report, recipe, _ = run_auto
    section, quantize = report["stages"][0], report["stages"][-1]
    assert section["stage"] == "auto_precision" and section["layers"] == 14
    assert section["error_method"] == recipe["stages"][0]["error_method"]
    assert section["bytes"] <= section["budget_bytes"] == int(4.5 * section["weights"] / 8)
    assert section["bits_per_weight"] > 4.4  # the budget is used, not left idle
    assert len({v for v in section["assignment"].values()}) >= 2  # mixed
    assert section["counts"][INT5.name] >= 1  # so int5 is stored, reloaded and counted to the byte below
    assert quantize["layers"] == section["assignment"]  # the quantize stage stored what was chosen
    groups = fused_groups(section["assignment"])  # q/k/v and gate/up of each block: one scheme each (vLLM fuses them)
    assert section["groups"] == len(groups) == 8 and section["fused_groups"]
    assert all(len({section["assignment"][n] for n in g}) == 1 for g in groups)
    from compress.export.native import load_compressed
    model = load_compressed(out)
    from compress.core.nn import QuantLinear
    stored = sum(m.qtensor().nbytes for m in model.modules() if isinstance(m, QuantLinear))
    assert stored == section["bytes"]
    md = (out / "report.md").read_text()
    assert "## Stage 0: auto_precision" in md and "measured KL of the quantized model" in md
    assert section["driver"] == "blocks" and "one decoder block at a time" in md
    assert section["threads"] == (recipe["calibration"].get("threads") or os.cpu_count())  # not model.threads (1)
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    assert len(resolved["stages"][-1]["layer_schemes"]) == 14


def test_the_resolved_recipe_reproduces_the_choice_without_measuring(run_auto):
    """recipe.resolved.yaml less its auto_precision stage quantizes every layer as the run did, to the byte; kept
    as it is, it is refused with that fix named."""
    from compress.cli.commands import main
    out, report, recipe, root = run_auto
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    with pytest.raises(RecipeError, match="already has layer_schemes"):
        from_dict(resolved)
    resolved["stages"] = resolved["stages"][1:]
    resolved["output"]["dir"] = str(root / "again")
    resolved["eval"]["perplexity"] = False
    path = root / "again.yaml"
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    again = json.loads((root / "again" / "report.json").read_text())
    assert again["stages"][-1]["layers"] == report["stages"][0]["assignment"]
    from safetensors.torch import load_file
    a, b = load_file(out / "model.safetensors"), load_file(root / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
