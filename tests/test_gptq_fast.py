"""GPTQ's fast solve is bit for bit the plain one: the column loop worked on transposed blocks, and one factor of H
shared by the layers that read one input (q/k/v, gate/up), against tests/reference/gptq_plain.py (the code before
the speed work, each layer factoring its own copy of H)."""
from __future__ import annotations

import pytest
import torch

import compress.quantizers.gptq as gptq
from compress.arch import get_arch, get_module
from compress.calibrate.blockwise import BlockPass, run_blockwise
from compress.calibrate.observers import BlockObserver
from compress.core.nn import QuantLinear, linear_weight
from compress.core.scheme import FP8_W8A16, MXFP4A16, NVFP4A16, scheme
from compress.quantizers.gptq import GPTQConfig, hessian_factor, quantize_gptq
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from tests.conftest import make_tiny_model
from tests.reference.gptq_plain import plain_gptq

SCHEMES = {"int4_g32_asym": scheme("int4", "group", 32, False), "int3_g64": scheme("int3", "group", 64, True),
           "int4_channel": scheme("int4", "channel", symmetric=False), "int8_tensor": scheme("int8", "tensor"),
           "fp8_channel": FP8_W8A16, "nvfp4": NVFP4A16, "mxfp4": MXFP4A16}


def _tensors(qt) -> list:
    return [qt.qdata, qt.scale, qt.zero_point, qt.global_scale]


def _same(a, b) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(_tensors(a), _tensors(b)))


def _problem(k: int = 192, n: int = 40, seed: int = 0, dtype=torch.float32):
    """Correlated low-rank-plus-noise inputs with one dead input channel; its Hessian and a weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 48, generator=g) @ torch.randn(48, k, generator=g) + 0.1 * torch.randn(300, k, generator=g)
    x[:, 5] = 0.0
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype), (2 * x.T @ x / 300).to(dtype)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("block", [128, 24])  # 24: blocks that cut groups, and a last short block
def test_fast_solve_is_bit_for_bit_the_plain_one(name, act_order, block):
    sch = SCHEMES[name]
    w, h = _problem()
    clip = 0.7 + 0.3 * torch.rand(w.shape[0], w.shape[1] // 32) if name == "int4_g32_asym" else None
    cfg = GPTQConfig(block_size=block, act_order=act_order)
    fast = quantize_gptq(w, h.clone(), sch, cfg, clip=clip)
    assert _same(fast, plain_gptq(w, h.clone(), sch, cfg, clip=clip))


def test_float64_solve_is_bit_for_bit_the_plain_one():
    w, h = _problem(dtype=torch.float64)
    for act_order in (True, False):
        cfg = GPTQConfig(block_size=32, act_order=act_order)
        sch = SCHEMES["int4_g32_asym"]
        assert _same(quantize_gptq(w, h, sch, cfg), plain_gptq(w, h, sch, cfg))


def test_one_factor_serves_every_layer_of_an_input():
    """q/k/v (and gate/up) read one input: one factor of its Hessian gives each of them what its own solve gives."""
    _, h = _problem()
    cfg = GPTQConfig(block_size=64)
    factor = hessian_factor(h.clone(), cfg)
    for seed, sch in enumerate((SCHEMES["int4_g32_asym"], SCHEMES["int3_g64"], SCHEMES["nvfp4"])):
        w = torch.randn(24 + 8 * seed, h.shape[0], generator=torch.Generator().manual_seed(seed)) * 0.05
        assert _same(quantize_gptq(w, factor, sch, cfg), plain_gptq(w, h.clone(), sch, cfg))
    with pytest.raises(ValueError, match="act_order True.*act_order False"):
        quantize_gptq(w, factor, SCHEMES["int3_g64"], GPTQConfig(act_order=False))


@pytest.mark.parametrize("act_order", [True, False])
def test_quantize_stage_factors_each_input_once_bit_for_bit(monkeypatch, act_order):
    """Through the quantize stage on a tiny Llama's blocks: 4 factors per block (q/k/v, o, gate/up, down) instead
    of 7, and every layer's codes, scales and zero points exactly those of its own plain solve."""
    made = []
    real = gptq.hessian_factor
    monkeypatch.setattr(gptq, "hessian_factor", lambda *a, **kw: made.append(kw.get("name")) or real(*a, **kw))
    model = make_tiny_model("llama")
    arch = get_arch(model)
    sch, cfg = scheme("int4", "group", 16, False), GPTQConfig(block_size=16, act_order=act_order)
    stage = QuantizeStage(method="gptq", scheme=sch, options=cfg)
    plan = plan_quantize(model, arch, stage)
    expected, checked = {}, []

    def observe(_i, _prefix, block):
        return BlockObserver(block, [n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)], [],
                             abs_mean=False, hessian=True, keep_samples=0)

    def on_block(_i, prefix, _block, _x, observer):
        for entry in plan.quantized:
            if entry.name.startswith(prefix + "."):
                h = observer.stats[entry.name[len(prefix) + 1:]].hessian_mean()
                expected[entry.name] = plain_gptq(linear_weight(get_module(model, entry.name)).detach(), h, sch, cfg)
        apply_quantize(model, plan, stage, prefix, observer)
        for name, ref in expected.items():
            layer = get_module(model, name)
            assert isinstance(layer, QuantLinear), name
            assert torch.equal(layer.qdata, ref.qdata) and torch.equal(layer.scale, ref.scale), name
            assert torch.equal(layer.zero_point, ref.zero_point), name
            checked.append(name)
        expected.clear()

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    run_blockwise(model, arch, ids, on_block, BlockPass(progress=False, observe=observe))
    blocks = len(arch.block_list(model))
    assert len(checked) == 7 * blocks
    assert len(made) == 4 * blocks, made
