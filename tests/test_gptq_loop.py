"""GPTQ's compiled column loop (quantizers/gptq_loop.py): the TorchScript function is the Python one bit for bit,
and its fused in-block update moves only near-tie codes, by one step, against the plain two-rounding update."""
from __future__ import annotations

import threading

import pytest
import torch

import compress.quantizers.gptq as gptq
from compress.quantizers.gptq import GPTQConfig, quantize_gptq
from compress.quantizers.gptq_loop import compiled_integer_block, integer_block
from compress.core.scheme import scheme


def unfused_block(wt, et, s_t, z_t, hb, qmin: float, qmax: float) -> None:
    """integer_block with the plain form's update (multiply, round, subtract): what gptq.py ran before the loop was
    fused, and what tests/reference/gptq_plain.py does; the bit-for-bit tests of the solve's structure use it."""
    for jj in range(wt.shape[0]):
        col = wt[jj]
        q = torch.round(col / s_t[jj])
        if z_t is not None:
            q += z_t[jj]
        q.clamp_(qmin, qmax)
        deq = (q - z_t[jj]) * s_t[jj] if z_t is not None else q * s_t[jj]
        torch.sub(col, deq, out=et[jj])
        et[jj].div_(hb[jj, jj])
        if jj + 1 < wt.shape[0]:
            wt[jj + 1:] -= hb[jj, jj + 1:, None] * et[jj]
        wt[jj] = q


def _block(n: int, b: int = 32, zero: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wt = torch.randn(b, n, generator=g)
    s_t = torch.rand(b, n, generator=g) * 0.2 + 0.1
    z_t = torch.full((b, n), 8.0) if zero else None
    a = torch.randn(b, b, generator=g)
    hb = torch.linalg.cholesky(a @ a.T + b * torch.eye(b)).T.contiguous()
    return wt, s_t, z_t, hb


def _run(loop, wt, s_t, z_t, hb, qmin, qmax):
    wt, et = wt.clone(), torch.empty_like(wt)
    loop(wt, et, s_t, z_t, hb, qmin, qmax)
    return wt, et


@pytest.mark.parametrize("zero", [True, False])
def test_the_compiled_loop_is_the_python_one_bit_for_bit(zero):
    compiled = compiled_integer_block()
    assert isinstance(compiled, torch.jit.ScriptFunction)  # this torch scripts it: the fast path is what runs
    wt, s_t, z_t, hb = _block(300, zero=zero)
    qmin, qmax = (0.0, 15.0) if zero else (-8.0, 7.0)
    a, b = _run(compiled, wt, s_t, z_t, hb, qmin, qmax), _run(integer_block, wt, s_t, z_t, hb, qmin, qmax)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    codes = a[0]
    assert torch.equal(codes, codes.round()) and codes.min() >= qmin and codes.max() <= qmax


def test_two_threads_running_the_compiled_loop_get_what_one_gets():
    """Two workers solve two layers at once (stages/quantize.py): the compiled function holds no shared state."""
    compiled = compiled_integer_block()
    problems = [_block(500, seed=s) for s in (1, 2)]
    alone = [_run(compiled, *p, 0.0, 15.0) for p in problems]
    together: list = [None, None]

    def work(i):
        together[i] = _run(compiled, *problems[i], 0.0, 15.0)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for (a, ea), (b, eb) in zip(alone, together):
        assert torch.equal(a, b) and torch.equal(ea, eb)


def _problem(k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, 48, generator=g) @ torch.randn(48, k, generator=g) + 0.1 * torch.randn(400, k, generator=g)
    return torch.randn(n, k, generator=g) * 0.05, 2 * x.T @ x / 400


@pytest.mark.parametrize("sch", [scheme("int8", "tensor"), scheme("int4", "group", 32, False),
                                 scheme("int3", "group", 64, True), scheme("int4", "channel", symmetric=False)],
                         ids=lambda s: s.name)
def test_the_fused_update_moves_only_near_ties_by_one_step(monkeypatch, sch):
    """Against the unfused loop on the same solve (act_order: the static grids the compiled loop serves): at most
    0.2% of the codes differ, each by one step, and the layer's Hessian-weighted error is within 1% (measured: 0 to
    0.05% of the codes, the error within 0.3%, on int8 per tensor, where a step is smallest)."""
    for seed in range(3):
        w, h = _problem(192, 48, seed)
        cfg = GPTQConfig(block_size=24, act_order=True)
        fused = quantize_gptq(w, h.clone(), sch, cfg)
        with monkeypatch.context() as m:
            m.setattr(gptq, "compiled_integer_block", lambda: unfused_block)
            plain = quantize_gptq(w, h.clone(), sch, cfg)
        assert torch.equal(fused.scale, plain.scale)  # static grids: from the original weights
        diff = (fused.codes().long() - plain.codes().long()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.002
        errs = []
        for qt in (fused, plain):
            d = qt.dequantize(torch.float64) - w.double()
            errs.append(float((d @ h.double() * d).sum()))
        assert abs(errs[0] / errs[1] - 1) <= 0.01
