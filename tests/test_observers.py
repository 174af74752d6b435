"""The statistics the observers collect, against a direct computation on the same inputs: mean |x|, max |x|, the
Hessian 2XXᵀ/n and the kept samples; and, after AWQ has folded its scales, GPTQ's H / (s sᵀ) against the Hessian of
the inputs the smoothed layers really receive."""
from __future__ import annotations

import pytest
import torch

from compress.arch import get_arch
from compress.calibrate.blockwise import block_forward, capture_block_inputs
from compress.core.nn import is_linear
from compress.calibrate.observers import BlockObserver
from compress.quantizers.awq import awq_block
from compress.stages.awq import AWQStage
from compress.core.scheme import scheme
from tests.conftest import make_tiny_model


def _block0(family: str, n: int = 3, seq: int = 20):
    model = make_tiny_model(family)
    arch = get_arch(model)
    inputs, _ = capture_block_inputs(model, arch, torch.randint(0, 256, (n, seq)), "cpu")
    block = arch.block_list(model)[0]
    linears = [name for name, m in block.named_modules() if name and is_linear(m)]
    return arch, block, inputs, linears


def _direct_inputs(block, inputs, linears, compute_dtype=None) -> dict[str, torch.Tensor]:
    """Every linear's inputs, recorded by plain forward hooks, as float64 [tokens, K]."""
    seen: dict[str, list] = {n: [] for n in linears}
    handles = [block.get_submodule(n).register_forward_hook(
        lambda _m, args, _out, n=n: seen[n].append(args[0].detach().reshape(-1, args[0].shape[-1]).double()))
        for n in linears]
    try:
        block_forward(block, inputs, compute_dtype)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def _close(a: torch.Tensor, b: torch.Tensor, rtol=1e-5) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=rtol * float(b.abs().max()))


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "opt", "gpt_neox", "gpt2"])
def test_statistics_equal_a_direct_computation(family, compute_dtype):
    """Also under the calibration pass's bfloat16 autocast: the statistics of the inputs as computed there, summed
    in float32 (a bf16 XᵀX would not even be positive definite)."""
    _arch, block, inputs, linears = _block0(family)
    direct = _direct_inputs(block, inputs, linears, compute_dtype)
    obs = BlockObserver(block, linears, [], abs_mean=True, hessian=True, keep_samples=1, abs_max=True)
    with obs:
        block_forward(block, inputs, compute_dtype)
    seq = inputs.hidden[0].shape[1]
    for name in linears:
        x, st = direct[name], obs.stats[name]
        assert st.tokens == x.shape[0] == len(inputs.hidden) * seq
        _close(st.abs_mean, x.abs().mean(0))
        _close(st.abs_max, x.abs().amax(0))
        _close(st.hessian_mean(), 2 * x.T @ x / x.shape[0])
        assert len(st.kept) == 1
        _close(st.kept[0], x[:seq])  # the first sample's inputs, as they were


def test_shared_inputs_are_counted_once():
    """q/k/v read one tensor: one InputStats, whose token count is not tripled."""
    _arch, block, inputs, linears = _block0("llama")
    obs = BlockObserver(block, linears, [], abs_mean=True, hessian=True, keep_samples=0)
    with obs:
        block_forward(block, inputs)
    q, k, v = (obs.stats[f"self_attn.{p}_proj"] for p in "qkv")
    assert q is k is v and q.tokens == 3 * 20


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_gptq_hessian_after_awq_is_the_hessian_of_the_smoothed_inputs(family):
    arch, block, inputs, linears = _block0(family, n=4)
    sch = scheme("int4", "group", 16, symmetric=False)
    inspect = sorted({insp for _, _, insp in arch.awq})
    obs = BlockObserver(block, linears, inspect, abs_mean=True, hessian=True, keep_samples=2, abs_max=True)
    with obs:
        block_forward(block, inputs)
    divisor: dict[str, torch.Tensor] = {}
    # clip=False: clipping moves weights, which changes the inputs of the layers after them (v_proj -> o_proj);
    # the identity H / (s sᵀ) is exact for scaling alone
    awq_block(block, arch.awq, obs, AWQStage(scheme=sch, n_grid=6, search_samples=2, clip=False), sch,
              set(linears), arch.no_clip, arch.norm_offset, divisor)
    scaled = {n: s for n, s in divisor.items() if float((s - 1).abs().max()) > 0.05}
    assert len(scaled) >= 3  # the norm -> q/k/v, norm -> gate/up (or fc1) and up -> down pairs moved
    after = _direct_inputs(block, inputs, linears)
    for name, s in divisor.items():
        x = after[name]
        _close(obs.stats[name].hessian_mean(s), 2 * x.T @ x / x.shape[0], rtol=2e-4)
        _close(obs.stats[name].input_absmax(s), x.abs().amax(0), rtol=2e-4)
    # and without the correction the Hessian is measurably not the one the layer sees
    name = next(iter(scaled))
    x = after[name]
    h_true = 2 * x.T @ x / x.shape[0]
    assert float((obs.stats[name].hessian_mean().double() - h_true).abs().max()) > 0.01 * float(h_true.abs().max())
