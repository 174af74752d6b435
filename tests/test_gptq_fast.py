"""GPTQ's fast solve against tests/reference/gptq_plain.py (the code before the speed work, each layer factoring its
own copy of H): the column loop worked on transposed blocks and one factor shared by the layers that read one input
(q/k/v, gate/up) are bit for bit the plain solve; the cheaper factor (fast_factor, the default since issue 49: one
Cholesky and one triangular inverse) is within a measured bound of the float64 one, as the textbook one is."""
from __future__ import annotations

import threading

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
from compress.threads import cpu_threads
from tests.conftest import make_tiny_model
from tests.reference import gptq_plain
from tests.test_gptq_loop import unfused_block

SCHEMES = {"int4_g32_asym": scheme("int4", "group", 32, False), "int3_g64": scheme("int3", "group", 64, True),
           "int4_channel": scheme("int4", "channel", symmetric=False), "int8_tensor": scheme("int8", "tensor"),
           "fp8_channel": FP8_W8A16, "nvfp4": NVFP4A16, "mxfp4": MXFP4A16}


@pytest.fixture(autouse=True)
def unfused_loop(monkeypatch):
    """These tests hold the solve's structure (transposed blocks, shared factors, workers) to the plain form bit for
    bit: the integer grids' loop runs unfused here, as the plain form's update does (its fused update, which moves
    near-tie codes, is bounded in tests/test_gptq_loop.py)."""
    monkeypatch.setattr(gptq, "compiled_integer_block", lambda: unfused_block)


def plain_gptq(*args, **kw):
    """The plain solve with compress's factor: what the fast solve must equal bit for bit (the textbook factor by
    default; the cheaper one where the GPTQConfig asks for it)."""
    cfg = args[3] if len(args) > 3 else kw.get("cfg", GPTQConfig())

    def factor(h, dampening, name):
        return gptq._inverse_hessian_factor(h, dampening, name, fast=cfg.fast_factor)
    return gptq_plain.plain_gptq(*args, inverse_factor=factor, **kw)


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
    cfg = GPTQConfig(block_size=block, act_order=act_order, fast_factor=False)  # the textbook factor
    fast = quantize_gptq(w, h.clone(), sch, cfg, clip=clip)
    assert _same(fast, gptq_plain.plain_gptq(w, h.clone(), sch, cfg, clip=clip))  # the base commit's own code
    cheaper = GPTQConfig(block_size=block, act_order=act_order, fast_factor=True)
    assert _same(quantize_gptq(w, h.clone(), sch, cheaper, clip=clip), plain_gptq(w, h.clone(), sch, cheaper, clip=clip))


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
    with pytest.raises(ValueError, match=r"\(0.01, True, True\).*\(0.01, False, True\)"):
        quantize_gptq(w, factor, SCHEMES["int3_g64"], GPTQConfig(act_order=False))


@pytest.mark.parametrize("act_order,threads", [(True, 1), (False, 1), (True, 2)])
def test_quantize_stage_factors_each_input_once_bit_for_bit(monkeypatch, act_order, threads):
    """Through the quantize stage on a tiny Llama's blocks: 4 factors per block (q/k/v, o, gate/up, down) instead
    of 7, and every layer's codes, scales and zero points exactly those of its own plain solve. On two threads the
    four inputs' solves run on two worker threads (threads.run_groups), with the same results."""
    made, where = [], set()
    real = gptq.hessian_factor

    def spy(*a, **kw):
        made.append(kw.get("name"))
        where.add(threading.current_thread().name.split("_")[0])
        return real(*a, **kw)
    monkeypatch.setattr(gptq, "hessian_factor", spy)
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
        with cpu_threads(threads):
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
    assert where == ({"MainThread"} if threads == 1 else {"compress-solve"}), where


def _ill_conditioned_hessian(k: int, seed: int) -> torch.Tensor:
    """H of rank-64-plus-5%-noise inputs with channel scales over two decades (a real layer's is as skewed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, k, generator=g) / 8 + 0.05 * torch.randn(512, k, generator=g)
    x *= torch.exp(torch.rand(k, generator=g) * 4.6 - 2.3)
    return 2 * x.T @ x / 512


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cheaper_factor_is_as_close_to_float64_as_the_textbook_one(seed):
    """U = J chol(J H J)^-1 J against the float64 Cholesky, cholesky_inverse, Cholesky: measured 5.8e-6 to 7.6e-6 of
    the largest entry at K = 256 in float32, the textbook float32 form 4.7e-6 to 6.9e-6 (K = 1024: 6-8e-5 and
    4-6e-5). The bound 2e-5 holds both; the factor is upper triangular, as the column loop assumes."""
    h = _ill_conditioned_hessian(256, seed)
    damped = h.double().clone()
    damped.diagonal().add_(0.01 * damped.diagonal().mean())
    u64 = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    for fast in (True, False):
        u = gptq._inverse_hessian_factor(h.clone(), 0.01, "layer", fast=fast)
        assert float((u.double() - u64).abs().max() / u64.abs().max()) < 2e-5, fast
        assert torch.equal(u.tril(-1), torch.zeros_like(u))


def test_the_cheaper_factor_changes_a_tiny_fraction_of_the_codes():
    """GPTQ carries every rounding error on, so a factor that differs in its last bits flips a few codes, and each
    flip a few more along its row: measured 0 to 0.35 % of the packed bytes at K = 512 and 1024 (int4 g64 asym)."""
    h = _ill_conditioned_hessian(512, 2)
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 0.02
    sch = scheme("int4", "group", 64, False)
    textbook = gptq_plain.plain_gptq(w, h.clone(), sch).qdata
    cheaper = quantize_gptq(w, h.clone(), sch, GPTQConfig(fast_factor=True)).qdata
    assert float((textbook != cheaper).float().mean()) < 0.01


def test_the_shared_slot_lets_the_old_factor_go_before_making_the_next(monkeypatch):
    """One factor held at a time (the memory plan counts one solve): by the time the next input's factor is made,
    the previous one is unreferenced; the same input, divisor and options get the held one back."""
    import weakref

    from compress.calibrate.observers import InputStats
    from compress.quantizers import LayerInputs
    _, h = _problem()
    first, second = (InputStats(hessian=h * 300 / 2, tokens=300) for _ in range(2))
    slot, cfg, alive_when_made = {}, GPTQConfig(), []
    held = []
    real = gptq.hessian_factor
    monkeypatch.setattr(gptq, "hessian_factor",
                        lambda *a, **kw: alive_when_made.append(any(r() is not None for r in held)) or real(*a, **kw))
    f1 = gptq._shared_factor(slot, cfg, torch.float32, LayerInputs("q", first, torch.ones(h.shape[0])))
    assert gptq._shared_factor(slot, cfg, torch.float32, LayerInputs("k", first, torch.ones(h.shape[0]))) is f1
    held.append(weakref.ref(f1.u))
    del f1
    gptq._shared_factor(slot, cfg, torch.float32, LayerInputs("o", second))
    assert alive_when_made == [False, False]
