"""CUDA graphs for decoding and for timing kernels: capture a function of fixed-address tensors once, replay it.

A captured function must not read a device value on the host (`.item()`, `bool(t)`, `nonzero`, boolean indexing:
each is a host sync, which capture forbids, and a data-dependent Python branch besides), nor copy between devices
(`.cpu()`, `.tolist()`, `torch.tensor(...)` of host data: the graph would replay a stale copy, and capture refuses
pageable host memory). `no_host_sync` raises on those operations as they are dispatched, on any device, so the same
check runs on this CPU-only machine's tests and, before each capture, on the GPU (`capture_problem`): a function
that would break capture is run eagerly instead, with the reason recorded, rather than failing inside the capture.
New tensors inside the function are fine: during capture they come from the graph's private memory pool, and the
same addresses are reused by every replay.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operations whose result size or value the host must read back: each synchronizes with the device.
SYNC_OPS = {aten._local_scalar_dense: "reads a device value on the host (.item(), int(t), bool(t), `if t:`)",
            aten.nonzero: "nonzero (its output size is data-dependent)",
            aten.masked_select: "masked_select (its output size is data-dependent)",
            aten.is_nonzero: "is_nonzero (`if t:`)",
            aten.equal: "torch.equal (returns a host bool)",
            aten._unique2: "unique (its output size is data-dependent)",
            aten.unique_dim: "unique (its output size is data-dependent)",
            aten.unique_consecutive: "unique_consecutive (its output size is data-dependent)"}


NOT_KERNELS = {aten._unsafe_view, aten.detach, aten.alias}  # views in all but name: launch nothing


class HostSync(RuntimeError):
    """An operation that a CUDA graph cannot capture, found by `no_host_sync`."""


def _devices(args) -> set[str]:
    return {a.device.type for a in args if isinstance(a, torch.Tensor)}


class _NoHostSync(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0  # operations that compute (views excluded): about the kernels a captured graph launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if not getattr(func, "is_view", False) and packet not in NOT_KERNELS:
            self.ops += 1
        if packet in SYNC_OPS:
            raise HostSync(f"{func}: {SYNC_OPS[packet]}")
        if packet is aten.lift_fresh and args[0].dim() > 0:  # a 0-dim host scalar is passed by value: fine
            raise HostSync(f"{func}: torch.tensor(host data) inside the step (a host-to-device copy)")
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None and \
                isinstance(args[0], torch.Tensor) and len(args) == 1:
            raise HostSync(f"{func} without output_size (its output size is data-dependent)")
        if packet in (aten.index, aten.index_put, aten.index_put_):
            for idx in (args[1] if len(args) > 1 else ()):
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    raise HostSync(f"{func} with a boolean mask (its output size is data-dependent; use "
                                   "masked_fill / torch.where)")
        if packet is aten._to_copy:
            src = args[0]
            dst = kwargs.get("device")
            if dst is not None and torch.device(dst).type != src.device.type:
                raise HostSync(f"{func}: a copy from {src.device.type} to {torch.device(dst).type} inside the step")
        if packet is aten.copy_ and len(_devices(args[:2])) > 1:
            raise HostSync(f"{func}: a copy between {sorted(_devices(args[:2]))} inside the step")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync():
    """Raise HostSync on every operation inside the block that a CUDA graph cannot capture (see the module doc).
    Yields the checker; its `ops` counts the operations that ran (views excluded)."""
    with _NoHostSync() as mode:
        yield mode


def capture_problem(fn: Callable[[], object], stats: dict | None = None) -> str | None:
    """Run `fn` once under `no_host_sync`: None when it is capture-safe, else what broke (its side effects happen).
    `stats["ops"]`: the operations it ran (views excluded), a count of the kernels a graph of it launches."""
    mode = _NoHostSync()
    try:
        with mode:
            fn()
    except HostSync as e:
        return str(e)
    finally:
        if stats is not None:
            stats["ops"] = mode.ops
    return None


def capture(fn: Callable[[], object], warmup: int = 1, reset: Callable[[], object] | None = None,
            pool=None) -> torch.cuda.CUDAGraph:
    """Capture `fn` in a CUDA graph after `warmup` eager calls on a side stream (cuBLAS handles, lazy
    initialisation, autotuning happen there, not in the graph). `reset` runs eagerly after each warm-up call and
    after the capture: what undoes the state `fn` advances (a decoder's position). Raises what capture raises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
            if reset is not None:
                reset()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    if reset is not None:
        reset()
    return graph


class StepTimer:
    """Per-call times of a sequence of calls on one device without a host sync between them: CUDA events around
    each call (read after one synchronize at the end), perf_counter on other devices. `span()` is the whole
    sequence, gaps between calls included."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def call(self, fn: Callable[[], object]) -> None:
        a = self._mark()
        fn()
        self.marks.append((a, self._mark()))

    def _between(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def times(self) -> list[float]:
        """Seconds of each call."""
        if self.cuda:
            torch.cuda.synchronize()
        return [self._between(a, b) for a, b in self.marks]

    def span(self) -> float:
        """Seconds from the first call's start to the last call's end."""
        if not self.marks:
            return 0.0
        if self.cuda:
            torch.cuda.synchronize()
        return self._between(self.marks[0][0], self.marks[-1][1])


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    if not v:
        raise ValueError("percentile of no values")
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def time_replays(graph: torch.cuda.CUDAGraph, repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median seconds of `repeats` replays of `graph`, each timed with CUDA events; `before` runs eagerly ahead of
    each replay, outside the timed interval (an L2 flush: while the device reads it the host queues the replay, so
    the launch latency is hidden, as in a decode loop)."""
    timer = StepTimer(torch.device("cuda"))
    for _ in range(repeats):
        if before is not None:
            before()
        timer.call(graph.replay)
    return statistics.median(timer.times())
