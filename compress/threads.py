"""torch's CPU thread count: set for a run's phase (0 = all cores), or for a while and restored."""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
from typing import Callable, Iterator

import torch


def set_threads(n: int) -> None:
    torch.set_num_threads(n if n > 0 else (os.cpu_count() or 1))


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch's CPU threads set to n for a while (0: all cores; None: unchanged)."""
    saved = torch.get_num_threads()
    if n is not None:
        set_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def window_workers(device: str, threads: int, windows: int) -> int:
    """How many windows (independent forwards of one block) run at once: two on a CPU of more than one thread, each
    worker on half the threads, else one. A window's forward is many small operations that a second torch thread
    barely speeds up, while two windows on one thread each keep both cores busy (a SmolLM2 block, 32 windows of 512
    tokens at bf16 on the 2-core EPYC: 0.73-0.85 s on two threads, 0.54-0.62 s on two workers). Two, not one per
    thread: each worker holds a window's activations."""
    return min(windows, 2) if device == "cpu" and threads > 1 else 1


def _under_callers_grad_mode(work: Callable) -> Callable:
    """`work` run under the grad mode of the thread calling this (torch keeps it per thread: a worker would start with
    gradients on whatever the caller set)."""
    grad = torch.is_grad_enabled()

    def in_worker(item):
        with torch.set_grad_enabled(grad):
            return work(item)
    return in_worker


def run_groups(groups: list[list], work: Callable[[list], list], workers: int,
               cost: Callable[[list], float] | None = None) -> list[list]:
    """work(group) for each group, on up to `workers` threads at once; the results in the groups' order.

    For independent CPU work made of many small torch operations (GPTQ's column loop), where one thread per
    group beats all threads on one group: each worker runs its group's operations with torch's threads divided
    between the workers (one each on two cores), so a group's result is the one a run on that many threads
    makes, whatever the other workers do. The largest groups (by `cost`) start first, so the last to finish is
    small. The workers run under the caller's grad mode (torch keeps it per thread). workers <= 1 or a single
    group: in the caller's thread, in order."""
    if workers <= 1 or len(groups) <= 1:
        return [work(g) for g in groups]
    workers = min(workers, len(groups))
    order = sorted(range(len(groups)), key=lambda i: -cost(groups[i]) if cost else i)
    results: list = [None] * len(groups)
    in_worker = _under_callers_grad_mode(work)
    # torch's thread count is one setting per process that a new thread takes up on its first parallel operation;
    # the pool's threads are new, and the caller's count comes back afterwards
    with cpu_threads(max(1, torch.get_num_threads() // workers)), \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compress-solve") as pool:
        futures = {pool.submit(in_worker, groups[i]): i for i in order}
        try:
            for f in concurrent.futures.as_completed(futures):
                results[futures[f]] = f.result()
        except BaseException:
            for f in futures:
                f.cancel()  # what has not started does not start; what has, finishes before the error is raised
            raise
    return results


def ordered_map(items: list, work: Callable, workers: int, threads_each: int | None = None) -> Iterator:
    """work(item) for each item on up to `workers` threads, the results yielded in the items' order, with at most
    `workers` items in flight (an item starts once the result `workers` places before it has been taken), so a
    caller that folds the results in order gets what one thread gives however the workers finish, holding at most
    `workers` results. torch's threads are divided between the workers as in run_groups, or `threads_each` each
    (the caller's count, where each worker must compute as the caller would alone); each worker runs under the
    caller's grad mode. workers <= 1 or one item: in the caller's thread."""
    if workers <= 1 or len(items) <= 1:
        for item in items:
            yield work(item)
        return
    workers = min(workers, len(items))
    in_worker = _under_callers_grad_mode(work)
    with cpu_threads(threads_each or max(1, torch.get_num_threads() // workers)), \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compress-window") as pool:
        pending = collections.deque(pool.submit(in_worker, item) for item in items[:workers])
        rest = iter(items[workers:])
        try:
            while pending:
                result = pending.popleft().result()
                following = next(rest, _NONE)
                if following is not _NONE:
                    pending.append(pool.submit(in_worker, following))
                yield result
        finally:
            for f in pending:
                f.cancel()


def ordered_batches(items: list, work: Callable, workers: int) -> Iterator[list]:
    """work(item) for each item on up to `workers` threads, as ordered_map, but a batch of `workers` items at a time:
    each batch's results are yielded together, in the items' order, once the whole batch is done, and the workers
    idle until the caller takes the next batch, so that between batches the caller runs on all of its threads (a
    Hessian's float32 matmuls, which a lone caller thread beside two busy workers would leave to one core:
    calibrate/deferred.py). Each worker runs on its share of the threads, as in ordered_map (it takes up the
    count set when it first computes, which is set again before each batch), under the caller's grad mode; one pool
    serves every batch. workers <= 1 or one item: in the caller's thread, batches of one."""
    if workers <= 1 or len(items) <= 1:
        for item in items:
            yield [work(item)]
        return
    workers = min(workers, len(items))
    caller, in_worker = torch.get_num_threads(), _under_callers_grad_mode(work)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compress-window") as pool:
        for start in range(0, len(items), workers):
            torch.set_num_threads(max(1, caller // workers))  # what a new worker thread takes up
            try:
                futures = [pool.submit(in_worker, item) for item in items[start:start + workers]]
                results = [f.result() for f in futures]
            finally:
                torch.set_num_threads(caller)
            yield results


_NONE = object()
