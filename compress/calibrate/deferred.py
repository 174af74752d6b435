"""A module's windows on worker threads (`map_windows`), and the forward hooks that may fire there: recorded on the
worker, run later in the windows' order.

A block's calibration windows are independent, and on a CPU of more than one thread two of them at once on one
thread each are faster than one at a time on both (many small operations; blockwise.block_forward). What watches
the forward (the observers' statistics, AutoRound's kept windows) accumulates in the order the windows come, so
its hooks are wrapped in `deferrable`: on a thread inside `recording()` a call is kept with its arguments instead
of run, and `replay` runs the kept calls on the caller's thread, window after window. The statistics are then the
ones a one-window-at-a-time forward gives, in the same order. A hook that is not wrapped (one that changes an output,
or any other library's) keeps the block's windows one at a time (`parallel_safe`).

The record rides on the thread (a threading.local), as torch's grad mode does: a hook is handed only the module
and its arguments, so the worker's record cannot be passed to it.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as _module

from ..threads import ordered_batches, ordered_map, window_workers

_local = threading.local()

# attributes that make a module's forward record into shared state outside hooks (kv/cache.py's running maxima of
# the keys and values, read by its attention wrapper) or move its weights per call (accelerate's offload hooks)
_STATEFUL = ("_compress_kv_record", "kv_record", "_hf_hook")


def deferrable(hook: Callable, heavy: bool = False, prepare: Callable | None = None) -> Callable:
    """`hook` (a forward or pre-forward hook that returns None), recorded instead of run on a thread inside
    `recording()`. `heavy`: its calls are float32 matmul work that wants all of the caller's threads (a Hessian's
    X^T X): a module with such a hook runs its windows a pair at a time and replays the pair's calls between pairs,
    with the workers idle (map_windows), not beside them on one core. `prepare` (called with the hook's arguments):
    the part of the hook's work that depends on its window alone, done on the worker as the call is recorded and
    handed to the replayed hook as `prepared=` (run directly, the hook gets no `prepared` and does it all itself);
    it must give the values the hook would compute (a per-window statistic whose result does not depend on the
    thread count), so that only the order-dependent rest waits for the caller's thread."""
    @functools.wraps(hook)
    def wrapped(*args, **kwargs):
        record = getattr(_local, "record", None)
        if record is None:
            return hook(*args, **kwargs)
        call = hook if prepare is None else functools.partial(hook, prepared=prepare(*args, **kwargs))
        # the worker's CPU autocast state goes with the call (a hook may read it: AutoRound's kept windows)
        record.append((call, args, kwargs, torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")))
        return None
    wrapped.deferrable = True
    wrapped.heavy = heavy
    return wrapped


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """On this thread, deferrable hooks append their calls to the yielded list instead of running."""
    saved = getattr(_local, "record", None)
    _local.record = record = []
    try:
        yield record
    finally:
        _local.record = saved


def replay(record: list) -> None:
    """Run the calls a `recording()` kept, in the order they came, each under the CPU autocast it was made in."""
    for hook, args, kwargs, autocast in record:
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            hook(*args, **kwargs)


def parallel_safe(block: nn.Module) -> bool:
    """Whether the windows of `block` may run on worker threads: every hook on it and its submodules is deferrable
    or marked `thread_safe` (a function of its arguments alone, as core/nn.py's input rotation), no global module hook
    is registered, and no module carries per-call state (_STATEFUL) or says its forward changes it (a true
    `parallel_unsafe`: an LLM.int8 layer counting its outliers, a layer running a dispatch plan's kernels)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    for m in block.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            if any(not (getattr(h, "deferrable", False) or getattr(h, "thread_safe", False)) for h in hooks.values()):
                return False
        if any(getattr(m, a, None) is not None for a in _STATEFUL) or getattr(m, "parallel_unsafe", False):
            return False
    return True


def _heavy(module: nn.Module) -> bool:
    """Whether a hook on `module` or its submodules was made deferrable with heavy=True."""
    return any(getattr(h, "heavy", False) for m in module.modules()
               for hooks in (m._forward_hooks, m._forward_pre_hooks) for h in hooks.values())


def map_windows(module: nn.Module, items: Iterable, work: Callable, device: str) -> Iterator:
    """work(item) for each item (a window through `module`), the results yielded in the items' order: two at a time
    on worker threads of one thread each where threads.window_workers says so (a CPU of more than one thread) and
    `module` is parallel_safe, the deferrable hooks' calls run on this thread as each result is yielded; else one at
    a time on this thread. A worker's torch thread count and grad mode are as threads.ordered_map sets them; any other
    per-thread state (autocast) is the work's to enter."""
    items = list(items)
    workers = window_workers(device, torch.get_num_threads(), len(items)) if parallel_safe(module) else 1
    if workers == 1:
        yield from map(work, items)
        return

    def recorded(item):
        with recording() as calls:
            return work(item), calls
    if _heavy(module):  # a Hessian: a pair of windows at a time, its calls replayed on all threads in between
        for batch in ordered_batches(items, recorded, workers):
            for result, calls in batch:
                replay(calls)
                yield result
        return
    for result, calls in ordered_map(items, recorded, workers):
        replay(calls)
        yield result
