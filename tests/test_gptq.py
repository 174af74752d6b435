"""GPTQ against the naive column-by-column reference, error vs RTN, and its failure modes."""
from __future__ import annotations

import pytest
import torch

from compress.quantizers import quantize_rtn
from compress.quantizers.gptq import GPTQConfig, SingularHessianError, quantize_gptq
from compress.core.scheme import scheme
from tests.reference.naive import naive_quantize
from tests.reference.naive_gptq import naive_gptq


def _correlated_inputs(n_tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    scales = torch.rand(k, generator=g) * 3 + 0.1
    return (torch.randn(n_tokens, k, generator=g) @ mix) * scales  # [T, K], correlated channels


@pytest.mark.parametrize("sch, act_order, k, block", [
    (scheme("int4", "group", 32, True), False, 64, 128),
    (scheme("int4", "group", 32, False), False, 256, 128),   # two lazy-update blocks
    (scheme("int3", "group", 32, False), False, 128, 32),    # block = group
    (scheme("int4", "group", 32, True), True, 128, 64),      # act order, static groups
    (scheme("int4", "channel", symmetric=False), False, 96, 32),
    (scheme("int2", "channel", symmetric=True), True, 64, 16),
])
def test_gptq_matches_naive_reference(sch, act_order, k, block):
    torch.manual_seed(1)
    w = torch.randn(12, k, dtype=torch.float64) * 0.1
    x = _correlated_inputs(400, k).double()
    h = 2 * x.T @ x / x.shape[0]
    qt = quantize_gptq(w, h, sch, GPTQConfig(dampening=0.01, block_size=block, act_order=act_order))
    ref = naive_gptq(w, h, sch.bits, sch.group_size, sch.symmetric, damp=0.01, act_order=act_order)
    assert torch.equal(qt.codes().to(torch.int64), ref)


@pytest.mark.parametrize("sch", [scheme("int4", "group", 64, False), scheme("int3", "group", 64, True),
                                 scheme("int4", "channel", symmetric=True)], ids=lambda s: s.name)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reconstruction_beats_rtn(sch, act_order):
    w = torch.randn(256, 576) * 0.05
    x = _correlated_inputs(2048, 576)
    h = 2 * x.T @ x / x.shape[0]
    err_gptq = ((w - quantize_gptq(w, h, sch, GPTQConfig(act_order=act_order)).dequantize()) @ x.T).pow(2).mean()
    err_rtn = ((w - quantize_rtn(w, sch).dequantize()) @ x.T).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn  # measured 0.28-0.65x of RTN on these correlated inputs (act order lower)


def _clamped(w, f, sch):
    """Each group of w clamped to its range (±absmax, or [min ∧ 0, max ∨ 0]) times f, by plain loops."""
    out = w.clone()
    g = sch.group_size
    for r in range(w.shape[0]):
        for t in range(w.shape[1] // g):
            vals = w[r, t * g:(t + 1) * g]
            hi, lo = (float(vals.abs().max()), -float(vals.abs().max())) if sch.symmetric else \
                (max(float(vals.max()), 0.0), min(float(vals.min()), 0.0))
            out[r, t * g:(t + 1) * g] = vals.clamp(lo * float(f[r, t]), hi * float(f[r, t]))
    return out


@pytest.mark.parametrize("sch", [scheme("int4", "group", 32, False), scheme("int3", "group", 32, True)],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("act_order", [False, True])
def test_clip_grid_is_the_shrunk_range_and_the_weights_stay_whole(sch, act_order):
    """With a diagonal Hessian GPTQ propagates nothing, so with `clip` it is round-to-nearest of the whole weights
    onto each group's grid of the range shrunk by its factor: the plain reference's scales from the clamped weights,
    its codes from the unclamped ones (clamped to the code range)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 64, generator=g) * 0.1
    f = 0.5 + 0.5 * torch.rand(8, 2, generator=g)
    h = torch.diag(torch.rand(64, generator=g) + 0.5)
    qt = quantize_gptq(w, h, sch, GPTQConfig(act_order=act_order), clip=f)
    _, scales, zeros = naive_quantize(_clamped(w, f, sch), sch.bits, "group", 32, sch.symmetric)
    s = scales.repeat_interleave(32, dim=1)
    z = 0.0 if zeros is None else zeros.repeat_interleave(32, dim=1)
    ref = torch.clamp(torch.round(w / s) + z, sch.qmin, sch.qmax)
    assert torch.equal(qt.codes().float(), ref)
    assert (ref == sch.qmax).sum() > (naive_quantize(w, sch.bits, "group", 32, sch.symmetric)[0] == sch.qmax).sum()


@pytest.mark.parametrize("act_order", [False, True])
def test_clip_grid_repairs_what_clamped_weights_cannot(act_order):
    """The same shrunk grid two ways: GPTQ of the clamped weights (their clamping error is GPTQ's target, never
    repaired) against GPTQ of the whole weights on that grid (a clipped weight's error goes to later columns). The
    second reproduces the layer's outputs better on correlated inputs."""
    sch = scheme("int4", "group", 64, False)
    w = torch.randn(128, 256) * 0.05
    x = _correlated_inputs(2048, 256)
    h = 2 * x.T @ x / x.shape[0]
    f = torch.full((128, 4), 0.7)
    cfg = GPTQConfig(act_order=act_order)
    grid = ((w - quantize_gptq(w, h, sch, cfg, clip=f).dequantize()) @ x.T).pow(2).mean()
    clamped = ((w - quantize_gptq(_clamped(w, f, sch), h, sch, cfg).dequantize()) @ x.T).pow(2).mean()
    assert grid < 0.8 * clamped


def test_act_order_keeps_the_standard_layout():
    w = torch.randn(32, 128)
    x = _correlated_inputs(512, 128)
    sch = scheme("int4", "group", 32, False)
    qt = quantize_gptq(w, 2 * x.T @ x / 512, sch, GPTQConfig(act_order=True))
    assert qt.scale.shape == (32, 4) and qt.zero_point.shape == (32, 4)
    # static groups: the scales are RTN's scales of the original weight, in the original column order
    torch.testing.assert_close(qt.scale, quantize_rtn(w, sch).scale, rtol=0, atol=0)


def test_dead_inputs_are_zeroed_not_an_error():
    w = torch.randn(8, 64)
    x = _correlated_inputs(256, 64)
    x[:, 5] = 0.0
    h = 2 * x.T @ x / 256
    qt = quantize_gptq(w, h, scheme("int4", "group", 32, False))
    assert torch.all(qt.dequantize()[:, 5] == 0)


def test_singular_hessian_is_a_clear_error():
    h = -torch.eye(64)  # negative definite: no dampening of 1% of the (negative) mean diagonal fixes it
    with pytest.raises(SingularHessianError, match="`options.dampening`"):
        quantize_gptq(torch.randn(8, 64), h, scheme("int4", "group", 32), name="model.layers.0.mlp.up_proj")


def test_config_validation():
    with pytest.raises(ValueError, match="dampening"):
        GPTQConfig(dampening=1.5)
    with pytest.raises(ValueError, match="block_size"):
        GPTQConfig(block_size=0)


def test_in_place_solve_equals_the_copying_one():
    """`overwrite_hessian` (what the runner uses: the Hessian is a fresh H/n each call) solves inside the caller's
    buffer instead of copying it; the codes must be the same bit for bit, and the buffer is consumed."""
    w = torch.randn(24, 128)
    x = _correlated_inputs(512, 128)
    h = 2 * x.T @ x / 512
    for sch in (scheme("int4", "group", 32, False), scheme("int4", "channel", symmetric=True)):
        kept = h.clone()
        copy = quantize_gptq(w, kept, sch, GPTQConfig(act_order=True))
        assert torch.equal(kept, h)  # the default leaves the caller's Hessian alone
        mine = h.clone()
        inplace = quantize_gptq(w, mine, sch, GPTQConfig(act_order=True), overwrite_hessian=True)
        assert torch.equal(copy.qdata, inplace.qdata) and torch.equal(copy.scale, inplace.scale)
        assert not torch.equal(mine, h)  # the solve ran in it


def test_in_place_permutations_match_indexing():
    from compress.quantizers.gptq import _permute_columns_, _permute_rows_

    g = torch.Generator().manual_seed(0)
    t = torch.randn(300, 300, generator=g)
    perm = torch.randperm(300, generator=g)
    a = t.clone()
    _permute_columns_(a, perm, rows=64)
    _permute_rows_(a, perm)
    assert torch.equal(a, t[perm][:, perm])
    b = a.clone()
    _permute_rows_(b, torch.arange(300))  # the identity moves nothing
    assert torch.equal(a, b)
