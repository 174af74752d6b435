"""AWQ: scales help salient channels, smoothing preserves the function, clipping never hurts,
and every tiny architecture runs AWQ and GPTQ through the block-by-block runner."""
from __future__ import annotations

import math

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
from compress.core.scheme import FP8_W8A16, MXFP4A16, NVFP4A16, scheme
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.reference.naive_awq import naive_awq_search, naive_fake_quantize


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


def _grid_loss(curve):
    """A loss over the search's 20-point grid given as a list (the candidate's exponent read back from its scales:
    with x_mean 2.0 on one channel and 0.5 on the other, s = 4^r / 2), and the grid indices it was asked for."""
    asked = []

    def loss(s):
        r = round(float(torch.log(s[0] / s[1]) / math.log(4)) * 19)
        asked.append(r)
        return curve[r]
    return loss, asked


@pytest.mark.parametrize("best, left, right", [(0, 1, 1), (1, 1, 1), (7, 1, 1), (8, 1, 1), (12, 1, 1), (18, 1, 1),
                                               (19, 1, 1), (7, 3, 0.5), (8, 0.5, 3)])
def test_coarse_to_fine_search_finds_a_single_dips_minimum_with_fewer_losses(best, left, right):
    """search_step 3: 1 in 3 exponents, then those within 2 of the best: the full grid's choice wherever the loss
    falls then rises (the minimum at either end too, and two grid points from the best coarse point where the dip is
    lopsided), from at most 11 of the 20 losses; step 1 asks every loss in grid order (the paper's search). r = 0's
    loss is the identity's in both."""
    curve = [(i - best) ** 2 * (left if i < best else right) + 0.1 for i in range(20)]
    x_mean = torch.tensor([2.0, 0.5])
    full, asked_full = _grid_loss(curve)
    s1, r1, l1, id1 = search_scales(x_mean, full, 20)
    assert asked_full == list(range(20))
    coarse, asked = _grid_loss(curve)
    s3, r3, l3, id3 = search_scales(x_mean, coarse, 20, step=3)
    assert (r3, l3, id3) == (r1, l1, id1) == (torch.linspace(0, 1, 20)[best].item(), curve[best], curve[0])
    assert torch.equal(s3, s1)
    assert len(asked) == len(set(asked)) <= 11


def test_coarse_to_fine_search_settles_near_the_best_coarse_point():
    """With two dips the coarse pass picks the deeper-looking one (its 1-in-3 points) and the search keeps the best
    loss it tried, ties to the smaller exponent; a dip between coarse points elsewhere is not seen."""
    curve = [5.0] * 20
    curve[6], curve[10], curve[11] = 1.0, 0.5, 0.2  # 11 (a fine point) is the grid's minimum; 6 is a coarse one
    x_mean = torch.tensor([2.0, 0.5])
    loss, asked = _grid_loss(curve)
    _, r, best, _ = search_scales(x_mean, loss, 20, step=3)
    assert r == torch.linspace(0, 1, 20)[6].item() and best == 1.0 and 11 not in asked
    curve[5] = 1.0  # a tie with the coarse point: the smaller exponent, as the full grid
    loss, asked = _grid_loss(curve)
    assert search_scales(x_mean, loss, 20, step=3)[1] == torch.linspace(0, 1, 20)[5].item()
    with pytest.raises(ValueError, match="step"):
        search_scales(x_mean, loss, 20, step=0)


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


@pytest.mark.parametrize("sch, tokens", [(scheme("int4", "group", 64, False), 512), (scheme("int3", "group", 32, True), 96),
                                         (scheme("int4", "channel", symmetric=False), 64)],
                         ids=["int4-g64-asym", "int3-g32-sym", "int4-channel"])
def test_clip_search_picks_the_least_direct_error(sch, tokens):
    """search_clip computes each group's error as d^T (X^T X / T) d (d = q - w: the Gram form, for groups smaller than
    the token count) or directly (per channel); either way it picks, per (row, group), the first shrink step with the
    least output error mean_t (x_t . (q - w))^2, here computed directly in float64. Ties within float32 rounding may go
    either way: every differing choice must be such a tie (rel 1e-5; measured: none differ)."""
    torch.manual_seed(1)
    n, k, grid, steps = 48, 256, 20, 10
    w = torch.randn(n, k) * 0.05
    w[:, 5] = 0.5  # a large weight stretches its group
    x = torch.randn(tokens, k) * (1 + 8 * (torch.rand(k) > 0.95))  # salient input channels
    lo, hi = search_clip(w, x, sch, grid=grid, max_shrink=0.5)
    gsz = sch.group_size if sch.granularity == "group" else k
    wg, xg = w.reshape(n, k // gsz, gsz), x.double().reshape(tokens, k // gsz, gsz)
    lo0, hi0 = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sch.symmetric:
        hi0 = wg.abs().amax(-1)
        lo0 = -hi0
    errs = []
    for step in range(steps):
        f = 1 - step / grid
        clipped = torch.minimum(torch.maximum(wg, (lo0 * f)[..., None]), (hi0 * f)[..., None]).reshape(n, k)
        d = (fake_quantize(clipped, sch) - w).double().reshape(wg.shape)
        errs.append(torch.einsum("tgk,ngk->ntg", xg, d).pow(2).mean(1))  # [n, groups], float64
    errs = torch.stack(errs)  # [steps, n, groups]
    best = errs.argmin(0)  # the first least
    f_best = 1 - best.float() / grid
    want_hi = hi0 * f_best
    chosen = ((hi / hi0.clamp(min=1e-12) * grid).round().long() - grid).neg()  # search_clip's step per (row, group)
    err_chosen = errs.gather(0, chosen.clamp(0, steps - 1)[None])[0]
    differ = ~torch.isclose(hi, want_hi, rtol=1e-6, atol=0)
    assert torch.all(err_chosen[differ] <= errs.amin(0)[differ] * (1 + 1e-5))
    assert differ.float().mean() < 0.01
    assert (best > 0).any()  # some group was clipped: the choice is not trivially the full range


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
                                 scheme("int8", "channel"), scheme("int4", "channel", symmetric=False),
                                 scheme("int8", "group", 16, False)], ids=lambda s: s.name)
def test_fake_quantize_is_the_rtn_round_trip(sch):
    """Bit for bit (fake_quantize skips the integer codes for integer schemes: the same float operations)."""
    w = torch.randn(48, 128)
    w[3, :40] = 0.0  # an all-zero group (scale 1)
    assert torch.equal(fake_quantize(w, sch), quantize_rtn(w, sch).dequantize())


# ---------------------------------------------------------------- awq_block against a plain grid search
# A tiny block (a norm, then an MLP down(silu(gate(h)) * up(h)), x + mlp(norm(x))) with salient input channels, its
# statistics and replay calls taken by the real BlockObserver, searched by awq_block; the same search written out in
# tests/reference/naive_awq.py, its losses computed here in float64 from plain functions of the weights.

K, N, G = 64, 32, 16  # hidden, intermediate, group size
NORM_PAIR = ("norm", ("mlp.gate", "mlp.up"), "mlp")
DOWN_PAIR = ("mlp.up", ("mlp.down",), "mlp.down")


class _Norm(nn.Module):
    def __init__(self, offset: float):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.rand(K) + 0.5 - offset)  # gains in [0.5, 1.5] (+ offset: Gemma's form)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (self.offset + self.weight)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(K, N), nn.Linear(K, N), nn.Linear(N, K)

    def forward(self, h):
        return self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class _Block(nn.Module):
    def __init__(self, offset: float):
        super().__init__()
        self.norm, self.mlp = _Norm(offset), _MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _mlp64(h, wg, bg, wu, bu, wd, bd):
    """The MLP in float64 from its weights."""
    h = h.double()
    a = nn.functional.silu(h @ wg.double().T + bg.double()) * (h @ wu.double().T + bu.double())
    return a @ wd.double().T + bd.double()


def _mse(outs, refs) -> float:
    """Mean over windows of each window's mean squared error: the search's loss."""
    return sum(float((o - r).pow(2).mean()) for o, r in zip(outs, refs)) / len(outs)


def _awq_case(offset: float, seed: int = 0):
    torch.manual_seed(seed)
    block = _Block(offset)
    with torch.no_grad():
        block.mlp.up.weight[[5, 20]] *= 8  # two intermediate channels far larger than the rest: down's salient inputs
    samples = [torch.randn(1, 24, K) for _ in range(3)]
    for x in samples:
        x[..., [3, 17, 40]] *= 25  # salient hidden channels, as in real LLMs
    return block, samples


def _observe(block, samples, keep: int):
    from compress.calibrate.observers import BlockObserver

    obs = BlockObserver(block, ["mlp.gate", "mlp.up", "mlp.down"], ["mlp", "mlp.down"], abs_mean=True,
                        hessian=False, keep_samples=keep)
    with obs, torch.no_grad():
        for x in samples:
            block(x)
    return obs


def _abs_mean(inputs: list[torch.Tensor]) -> torch.Tensor:
    """mean |x| per channel over every token of every window, summed per window in float32 then over windows (the
    observer's order, so the scales' float32 bits and with them every rounding decision are the same)."""
    total = sum(t.reshape(-1, t.shape[-1]).abs().sum(0, dtype=torch.float32) for t in inputs)
    return total / sum(t.reshape(-1, t.shape[-1]).shape[0] for t in inputs)


def _reference(block, samples, pair, sch, n_grid, keep, duo):
    """The plain search for one pair of the untouched block: (s, r, loss, loss at r = 0, every r's loss)."""
    m = block.mlp
    wg, bg, wu, bu, wd, bd = (t.detach().clone() for t in (m.gate.weight, m.gate.bias, m.up.weight, m.up.bias,
                                                           m.down.weight, m.down.bias))
    with torch.no_grad():
        hs = [block.norm(x) for x in samples]  # the MLP's inputs
        acts = [nn.functional.silu(m.gate(h)) * m.up(h) for h in hs]  # down's inputs
    if pair == NORM_PAIR:
        refs = [_mlp64(h, wg, bg, wu, bu, wd, bd) for h in hs[:keep]]
        return naive_awq_search(_abs_mean(hs), [wg, wu], sch, n_grid, duo=duo, loss_of=lambda t: _mse(
            [_mlp64(h, t[0], bg, t[1], bu, wd, bd) for h in hs[:keep]], refs))
    refs = [a.double() @ wd.double().T for a in acts[:keep]]  # the bias cancels in the error
    return naive_awq_search(_abs_mean(acts), [wd], sch, n_grid, duo=duo, loss_of=lambda t: _mse(
        [a.double() @ t[0].double().T for a in acts[:keep]], refs))


@pytest.fixture
def float32_replay(monkeypatch):
    """The search's float32 path (a CPU without bf16 instructions): the reference's float64 losses then agree to
    ~1e-6 relative; under bf16 autocast the candidates' losses move by bf16's 4e-3 and the choice is no longer the
    reference's to predict."""
    import compress.core.nn

    monkeypatch.setattr(compress.core.nn, "cpu_has_bf16", lambda: False)


@pytest.mark.parametrize("duo", [False, True], ids=["paper", "duo"])
@pytest.mark.parametrize("sch", [scheme("int4", "group", G, True), scheme("int3", "group", G, False)],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("pair, offset", [(NORM_PAIR, 0.0), (NORM_PAIR, 1.0), (DOWN_PAIR, 0.0)],
                         ids=["norm->gate,up", "norm(offset 1)->gate,up", "up->down"])
def test_awq_block_search_equals_a_plain_grid_search(pair, offset, sch, duo, float32_replay):
    """awq_block picks the reference's exponent with the reference's loss (and RTN's at r = 0), folds exactly the
    reference's scales (balance columns x s, the previous op's outputs / s), keeps the float block's function, and
    the weights it leaves, quantized by round-to-nearest and fed the previous op's divided outputs, have the loss it
    reported: the search was for the weights the quantize stage stores.

    Tolerances: the losses are float32 MSEs in the code against float64 here (the codes and scales are bit-equal),
    rel 1e-5 (measured up to 1.1e-6); the reference's best loss beats every other r by more than 1e-3 (measured 2% to
    54%), so the choice is well determined. Folded weights: the same float32 products, rtol 1e-6."""
    from compress.quantizers.awq import awq_block
    from compress.stages.awq import AWQStage

    n_grid, keep = 8, 2  # the search replays the first 2 of 3 windows; mean |x| is over all 3
    block, samples = _awq_case(offset)
    s_ref, r_ref, loss_ref, loss0_ref, losses = _reference(block, samples, pair, sch, n_grid, keep, duo)
    assert r_ref > 0 and loss_ref < 0.9 * loss0_ref  # scaling helps here: a search that never scales cannot pass
    assert sorted(losses)[1] > loss_ref * (1 + 1e-3)

    m = block.mlp
    with torch.no_grad():
        before = [block(x) for x in samples]
        if pair == NORM_PAIR:  # the float output of the pair's inspect module on the replayed windows
            refs = [(b - x).double() for b, x in zip(before, samples[:keep])]
        else:
            refs = [m.down(nn.functional.silu(m.gate(h)) * m.up(h)).double() - m.down.bias.double()
                    for h in (block.norm(x) for x in samples[:keep])]
    prev_name, balance_names, _ = pair
    prev, balance = block.get_submodule(prev_name), [block.get_submodule(n) for n in balance_names]
    prev_w0 = prev.weight.detach().clone()
    prev_b0 = prev.bias.detach().clone() if getattr(prev, "bias", None) is not None else None
    balance_w0 = [lin.weight.detach().clone() for lin in balance]
    obs = _observe(block, samples, keep)
    divisor = {}
    stage = AWQStage(n_grid=n_grid, search_samples=keep, clip=False, duo_scaling=duo)
    with torch.no_grad():  # as the runner calls it
        results = awq_block(block, (pair,), obs, stage, sch, {"mlp.gate", "mlp.up", "mlp.down"}, (), offset, divisor)

    (res,) = results
    assert not res.skipped
    assert res.ratio == pytest.approx(r_ref, abs=1e-12)
    assert res.loss == pytest.approx(loss_ref, rel=1e-5)
    assert res.loss_identity == pytest.approx(loss0_ref, rel=1e-5)
    with torch.no_grad():  # the scales folded: balance columns x s, the previous op's outputs / s
        for lin, w0 in zip(balance, balance_w0):
            torch.testing.assert_close(lin.weight, w0 * s_ref[None, :], rtol=1e-6, atol=0)
        if isinstance(prev, nn.Linear):
            torch.testing.assert_close(prev.weight, prev_w0 / s_ref[:, None], rtol=1e-6, atol=0)
            torch.testing.assert_close(prev.bias, prev_b0 / s_ref, rtol=1e-6, atol=0)
        else:
            torch.testing.assert_close(prev.weight + offset, (prev_w0 + offset) / s_ref, rtol=1e-6, atol=1e-7)
        for n in balance_names:
            torch.testing.assert_close(divisor[n], s_ref, rtol=1e-6, atol=0)
        after = [block(x) for x in samples]
    for a, b in zip(after, before):  # function preserved in float, before any quantization
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    # what the quantize stage will store: RTN of the folded weights, fed the previous op's new (divided) outputs
    with torch.no_grad():
        if pair == NORM_PAIR:
            hs = [block.norm(x) for x in samples[:keep]]  # h / s
            outs = [_mlp64(h, naive_fake_quantize(m.gate.weight, sch), m.gate.bias,
                           naive_fake_quantize(m.up.weight, sch), m.up.bias, m.down.weight, m.down.bias) for h in hs]
        else:
            acts = [nn.functional.silu(m.gate(h)) * m.up(h) for h in (block.norm(x) for x in samples[:keep])]  # a / s
            outs = [a.double() @ naive_fake_quantize(m.down.weight, sch).double().T for a in acts]
    assert _mse(outs, refs) == pytest.approx(res.loss, rel=1e-5)


# ---------------------------------------------------------------- the search's work in slices, on one thread

@pytest.mark.parametrize("sch", [scheme("int4", "group", 64, False), scheme("int3", "group", 32, True),
                                 scheme("int8", "channel"), FP8_W8A16, MXFP4A16, NVFP4A16], ids=lambda s: s.name)
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
def test_scaled_trials_are_the_whole_weight_computation_bit_for_bit(monkeypatch, sch, conv1d):
    """The scale search's trial weights, Q(W s) / s in the module's layout, computed in slices of a few rows (here
    7 rows a slice and a short last one) are the whole weight's, bit for bit; NVFP4's per-tensor scale keeps it whole."""
    import compress.quantizers.awq as awq
    from transformers.pytorch_utils import Conv1D

    monkeypatch.setattr(awq, "SLICE_VALUES", 1000)
    torch.manual_seed(0)
    m = Conv1D(200, 128) if conv1d else nn.Linear(128, 200, bias=False)
    nn.init.normal_(m.weight, std=0.05)
    s = torch.rand(128) + 0.5
    whole = fake_quantize(in_weight(m).float() * s[None, :], sch).div_(s[None, :])
    whole = whole.t() if conv1d else whole
    for dtype in (torch.bfloat16, torch.float32):
        (got,) = awq.scaled_trials([m], s, [sch], dtype)
        assert got.shape == m.weight.shape and got.is_contiguous()
        assert torch.equal(got, whole.to(dtype))
    assert awq.slice_rows(in_weight(m), sch) == (200 if sch.has_global_scale else 7)


def test_clip_search_does_not_depend_on_the_thread_count():
    """awq_block runs the clipping search on one thread (quantizers/awq.one_thread): the ranges are those of two."""
    from compress.threads import cpu_threads

    torch.manual_seed(1)
    w, x = torch.randn(300, 256) * 0.05, _salient_inputs(n=512, k=256)
    for sch in (scheme("int4", "group", 64, False), scheme("int3", "group", 32, True)):
        with cpu_threads(1):
            one = search_clip(w, x, sch)
        with cpu_threads(2):
            two = search_clip(w, x, sch)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_holding_the_inspect_modules_other_linears_in_bf16_changes_nothing(monkeypatch):
    """On the bf16 replay path awq_block holds the inspect module's linears other than the balance ones (here the MLP's
    down after gate/up) in bf16 for the search, the values autocast would cast them to: the chosen exponent, its loss
    and the folded weights are those of a search that lets autocast cast them per replay, bit for bit. (Holding the
    balance linears too would give the trials bf16-rounded weights to start from.)"""
    import contextlib

    import compress.core.nn
    import compress.quantizers.awq as awq
    from compress.stages.awq import AWQStage

    monkeypatch.setattr(compress.core.nn, "cpu_has_bf16", lambda: True)  # the bf16 path, whatever this CPU has
    sch, stage, outcomes = scheme("int4", "group", G, True), AWQStage(n_grid=8, search_samples=2, clip=False), []
    for hold in (True, False):
        if not hold:
            monkeypatch.setattr(awq, "linear_weights_in", lambda *a, **k: contextlib.nullcontext())
        block, samples = _awq_case(0.0)
        obs = _observe(block, samples, 2)
        with torch.no_grad():
            (res,) = awq.awq_block(block, (NORM_PAIR,), obs, stage, sch, {"mlp.gate", "mlp.up", "mlp.down"}, (),
                                   0.0, {})
        assert not res.skipped and res.ratio > 0
        outcomes.append((res.ratio, res.loss, [p.detach().clone() for p in block.parameters()]))
    (r1, l1, p1), (r2, l2, p2) = outcomes
    assert r1 == r2 and l1 == l2
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
