"""A block's windows on two worker threads (blockwise.block_forward on a CPU of more than one thread): the outputs
are a one-thread run's bit for bit, and what the hooks accumulate (the observers' sums and kept inputs, AutoRound's
kept windows) is a serial forward's, in the same order; a hook that cannot be deferred keeps the windows serial."""
from __future__ import annotations

import threading

import pytest
import torch

from compress.arch import get_arch
from compress.arch.moe import unfuse_experts
from compress.calibrate import deferred
from compress.calibrate.blockwise import block_forward, capture_block_inputs
from compress.calibrate.observers import BlockObserver
from compress.core.nn import is_linear
from compress.core.scheme import scheme
from compress.arch.paths import block_pairs
from compress.stages.base import BlockState
from compress.stages.quantize import _keep_block_samples
from compress.threads import cpu_threads
from tests.conftest import make_tiny_model

W4_G16 = scheme("int4", "group", 16, symmetric=False)


def _block0(family: str, n: int = 6, seq: int = 24):
    model = make_tiny_model(family)
    unfuse_experts(model)  # as the pipeline does: one linear per expert (a no-op on a dense model)
    arch = get_arch(model)
    inputs, _ = capture_block_inputs(model, arch, torch.randint(0, 256, (n, seq)), "cpu")
    return arch, arch.block_list(model)[0], inputs


def _observed(arch, block, inputs, threads: int, compute_dtype,
              hessian: bool = False) -> tuple[list, BlockObserver, object, int]:
    """The outputs, the observer (AWQ's statistics: |x| sums and maxima, two kept inputs, the replayed calls; GPTQ's
    Hessians with `hessian`), the AutoRound window keeper's samples, and how many windows ran off the caller's
    thread."""
    linears = [n for n, m in block.named_modules() if n and is_linear(m)]
    inspect = sorted({p[2] for p in block_pairs(block, arch.awq)})
    obs = BlockObserver(block, linears, inspect, abs_mean=True, hessian=hessian, keep_samples=2, abs_max=True)
    state = BlockState(0, "model.layers.0", block, obs)
    off_thread = []
    caller = threading.get_ident()
    counter = block.register_forward_pre_hook(deferred.deferrable(lambda *_: off_thread.append(1)))
    mark = block.register_forward_pre_hook(_thread_safe(lambda *_: off_thread.append(threading.get_ident() != caller)))
    try:
        with cpu_threads(threads), obs, _keep_block_samples(state, 0):
            outputs = block_forward(block, inputs, compute_dtype)
    finally:
        counter.remove()
        mark.remove()
    return outputs, obs, state.observed[0], sum(1 for x in off_thread if x is True)


def _thread_safe(hook):
    hook.thread_safe = True
    return hook


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("family,hessian", [("llama", False), ("qwen2", False), ("opt", False), ("mixtral", False),
                                            ("llama", True), ("mixtral", True)])
def test_two_workers_give_a_one_thread_forward_and_its_statistics(family, hessian, compute_dtype):
    arch, block, inputs = _block0(family)
    ref_out, ref_obs, (ref_samples, ref_dtype), ref_off = _observed(arch, block, inputs, 1, compute_dtype, hessian)
    out, obs, (samples, dtype), off = _observed(arch, block, inputs, 2, compute_dtype, hessian)
    assert ref_off == 0 and off == len(inputs.hidden)  # the parallel path really ran, every window on a worker
    for a, b in zip(ref_out, out, strict=True):
        assert torch.equal(a, b)
    assert ref_obs.stats.keys() == obs.stats.keys()
    for name, st in obs.stats.items():
        ref = ref_obs.stats[name]
        assert st.tokens == ref.tokens and torch.equal(st.abs_sum, ref.abs_sum) and torch.equal(st.abs_max, ref.abs_max)
        # GPTQ's Hessians: accumulated on the caller's thread in the windows' order, as one thread adds them
        assert (st.hessian is None) == (not hessian) and (not hessian or torch.equal(st.hessian, ref.hessian))
        assert st.kept_at == ref.kept_at == [0, 1][:len(st.kept_at)]
        for a, b in zip(ref.kept, st.kept, strict=True):
            assert torch.equal(a, b)
    for name, calls in obs.calls.items():  # AWQ's replayed inputs: the first two windows', in order
        assert len(calls) == len(ref_obs.calls[name]) == 2
        for a, b in zip(ref_obs.calls[name], calls):
            assert all(torch.equal(x, y) for x, y in zip(a.args, b.args) if isinstance(x, torch.Tensor))
    # AutoRound's kept windows: in the windows' order, with the autocast dtype the worker computed in
    assert dtype == ref_dtype == compute_dtype
    for kind in ("hidden", "target"):
        for a, b in zip(getattr(ref_samples, kind), getattr(samples, kind), strict=True):
            assert torch.equal(a, b)
    for a, h in zip(samples.hidden, inputs.hidden, strict=True):  # references to the pass's tensors, not copies
        assert a.data_ptr() == h.data_ptr()


def test_a_plain_hook_keeps_the_windows_serial():
    """A hook nobody wrapped may change its module's output or keep state: it runs the windows one at a time, on the
    caller's thread. The observers' hooks, Hessians included, are deferred and leave them parallel."""
    _arch, block, inputs = _block0("llama")
    assert deferred.parallel_safe(block)
    linears = [n for n, m in block.named_modules() if n and is_linear(m)]
    for hessian in (True, False):
        with BlockObserver(block, linears, [], abs_mean=True, hessian=hessian, keep_samples=1):
            assert deferred.parallel_safe(block)
    threads = []
    handle = block.mlp.register_forward_hook(lambda *_: threads.append(threading.get_ident()))
    try:
        assert not deferred.parallel_safe(block)
        with cpu_threads(2):
            block_forward(block, inputs)
    finally:
        handle.remove()
    assert threads == [threading.get_ident()] * len(inputs.hidden)


def test_a_deferred_call_replays_under_the_autocast_it_was_made_in():
    seen = []
    hook = deferred.deferrable(lambda: seen.append(torch.get_autocast_dtype("cpu") if
                                                   torch.is_autocast_enabled("cpu") else None))
    with deferred.recording() as calls:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hook()
        hook()
    assert seen == [] and len(calls) == 2
    deferred.replay(calls)
    assert seen == [torch.bfloat16, None]
    hook()  # outside a recording: run at once
    assert seen == [torch.bfloat16, None, None]


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_the_scale_searchs_replays_on_two_workers_are_a_one_thread_runs(family):
    """AWQ's replays of the kept calls (the reference outputs and each candidate's loss) go through map_windows too."""
    from compress.quantizers.awq import _replay_loss
    from compress.transforms.smoothing import replay, replay_autocast
    arch, block, inputs = _block0(family)
    inspect_names = sorted({p[2] for p in block_pairs(block, arch.awq)})
    obs = BlockObserver(block, [], inspect_names, abs_mean=False, hessian=False, keep_samples=4)
    with obs:
        block_forward(block, inputs, torch.bfloat16)
    caller, workers = threading.get_ident(), []
    for name in inspect_names:
        inspect, calls = block.get_submodule(name), obs.calls[name]
        balance = [m for m in inspect.modules() if is_linear(m)][:1]
        handle = inspect.register_forward_pre_hook(_thread_safe(lambda *_: workers.append(threading.get_ident())))
        s = torch.rand(balance[0].in_features) + 0.5
        runs = []
        try:
            for threads in (1, 2):
                with cpu_threads(threads), replay_autocast(balance[0].weight):
                    ref = replay(inspect, calls)
                with cpu_threads(threads):
                    runs.append((ref, _replay_loss(inspect, calls, ref, balance, s, [W4_G16])))
        finally:
            handle.remove()
        (ref1, loss1), (ref2, loss2) = runs
        assert all(torch.equal(a, b) for a, b in zip(ref1, ref2, strict=True)) and loss1 == loss2
    assert sum(t != caller for t in workers) == 2 * len(inspect_names) * 4  # the two-thread runs' replays: on workers


def test_windows_go_to_workers_only_on_a_cpu_of_more_than_one_thread():
    """CUDA keeps one stream of windows; one thread, or one window, runs on the caller's thread."""
    from compress.threads import window_workers
    assert window_workers("cpu", 2, 64) == window_workers("cpu", 16, 64) == 2
    assert window_workers("cpu", 1, 64) == window_workers("cuda", 16, 64) == window_workers("cpu", 2, 1) == 1


@pytest.mark.parametrize("heavy", [True, False])
def test_a_heavy_hook_replays_between_pairs_on_all_threads(heavy):
    """A heavy deferred hook (a Hessian's float32 X^T X) is replayed on the caller's thread with its two threads,
    between pairs of windows, while no window runs; a light one beside the workers, on the caller's one thread."""
    _arch, block, inputs = _block0("llama")
    seen, running, lock = [], [0], threading.Lock()

    def count(delta):
        def hook(*_):
            with lock:
                running[0] += delta
        return _thread_safe(hook)

    def watch(*_):
        seen.append((threading.get_ident(), torch.get_num_threads(), running[0]))
    handles = [block.register_forward_pre_hook(count(1)), block.register_forward_hook(count(-1)),
               block.register_forward_hook(deferred.deferrable(watch, heavy=heavy))]
    try:
        with cpu_threads(2):
            block_forward(block, inputs)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(inputs.hidden) and {s[0] for s in seen} == {threading.get_ident()}
    if heavy:
        assert {s[1] for s in seen} == {2} and {s[2] for s in seen} == {0}
    else:
        assert {s[1] for s in seen} == {1}


def test_light_statistics_are_summed_on_the_workers():
    """Without a Hessian, each window's |x| sums and maxima are computed on the worker that ran the window (the
    caller's thread only adds them up, in order), once per input tensor (q/k/v share theirs); the statistics are the
    one-thread run's (test above)."""
    arch, block, inputs = _block0("llama")
    linears = [n for n, m in block.named_modules() if n and is_linear(m)]
    obs = BlockObserver(block, linears, [], abs_mean=True, hessian=False, keep_samples=0, abs_max=True)
    where, sums = [], obs._sums
    obs._sums = lambda x2: (where.append(threading.get_ident()), sums(x2))[1]
    with cpu_threads(2), obs:
        block_forward(block, inputs, None)
    distinct_inputs = len({id(st) for st in obs.stats.values()})  # q/k/v and gate/up share
    assert len(where) == distinct_inputs * len(inputs.hidden)
    assert threading.get_ident() not in where
