"""threads.run_groups: independent groups of CPU work on worker threads (the quantize stage's GPTQ solves);
threads.ordered_map: items on worker threads, results in order (AutoRound's windows)."""
from __future__ import annotations

import threading

import pytest
import torch

import time

from compress.threads import cpu_threads, ordered_map, run_groups


def test_results_come_back_in_the_groups_order_largest_first_on_workers():
    started = []

    def work(group):
        started.append(group[0])
        return [(g * 2, threading.current_thread().name.split("_")[0], torch.get_num_threads()) for g in group]

    with cpu_threads(2):
        out = run_groups([[1], [5, 6], [3]], work, 2, cost=lambda g: sum(g))
        assert torch.get_num_threads() == 2  # the caller's count comes back
    assert [[r[0] for r in rs] for rs in out] == [[2], [10, 12], [6]]
    assert started[0] == 5  # the largest group first
    assert {r[1] for rs in out for r in rs} == {"compress-solve"} and {r[2] for rs in out for r in rs} == {1}


def test_one_worker_runs_in_the_callers_thread_in_order():
    names = run_groups([[1], [2]], lambda g: threading.current_thread().name, 1)
    assert names == ["MainThread", "MainThread"]


def test_workers_run_under_the_callers_grad_mode():
    """torch's grad mode is per thread: a solve called under no_grad must not record a graph on a worker (GPTQ's
    out= operations refuse a tensor that requires grad)."""
    w = torch.ones(3, requires_grad=True)

    def work(group):
        return (w * group[0]).requires_grad

    with torch.no_grad():
        assert run_groups([[1], [2]], work, 2) == [False, False]
    assert run_groups([[1], [2]], work, 2) == [True, True]


def test_an_error_in_a_worker_is_raised_in_the_caller():
    def work(group):
        if group[0] == 2:
            raise ValueError("group 2 failed")
        return group[0]

    with pytest.raises(ValueError, match="group 2 failed"):
        run_groups([[1], [2], [3]], work, 2)


def test_ordered_map_yields_in_order_with_at_most_workers_in_flight():
    """The first item is the slowest, so the others finish first; the results still come in the items' order, no
    more than two items run at once, each on one of the two threads, under the caller's grad mode."""
    lock, running, most = threading.Lock(), [0], [0]

    def work(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2 if i == 0 else 0.01)
        with lock:
            running[0] -= 1
        return i, threading.current_thread().name.split("_")[0], torch.get_num_threads(), torch.is_grad_enabled()

    with cpu_threads(2), torch.no_grad():
        out = list(ordered_map(list(range(6)), work, 2))
    assert [o[0] for o in out] == list(range(6))
    assert {o[1] for o in out} == {"compress-window"} and {o[2] for o in out} == {1} and not any(o[3] for o in out)
    assert most[0] == 2
    assert [o[1] for o in ordered_map([1, 2], work, 1)] == [threading.current_thread().name.split("_")[0]] * 2


def test_ordered_batches_yield_pairs_in_order_with_the_workers_idle_in_between():
    """A batch of two items at a time on the two one-thread workers, its results in the items' order; while the
    caller holds a batch nothing runs on the workers, and the caller is back on its two threads (where a Hessian's
    replay runs: calibrate/deferred.py); the last, odd item makes a batch of one."""
    from compress.threads import ordered_batches

    lock, running, calls = threading.Lock(), [0], []

    def work(i):
        with lock:
            running[0] += 1
        time.sleep(0.05 if i % 2 == 0 else 0.01)  # the first of each pair finishes last
        with lock:
            running[0] -= 1
            calls.append(i)
        return i, threading.current_thread().name.split("_")[0], torch.get_num_threads()

    seen = []
    with cpu_threads(2), torch.no_grad():
        for batch in ordered_batches(list(range(5)), work, 2):
            assert running[0] == 0 and torch.get_num_threads() == 2
            seen.append([b[0] for b in batch])
            assert {b[1] for b in batch} == {"compress-window"} and {b[2] for b in batch} == {1}
        assert torch.get_num_threads() == 2
    assert seen == [[0, 1], [2, 3], [4]] and sorted(calls) == list(range(5))
    assert list(ordered_batches([1, 2], lambda i: i * 3, 1)) == [[3], [6]]
