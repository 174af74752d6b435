"""Where a run's time goes: wall seconds per phase, each second counted once.

A `Profile` is passed explicitly to what does the work (the run, the block runner, the stages, the writers), which
wrap each piece in `with profile.phase("read", nbytes=...)`. Phases nest and the accounting is exclusive: a second
spent in `statistics` inside `float forward` counts to statistics only, so the phases of the main thread add up to
the time the profile ran minus what no phase covered (reported as such, never folded in). Work done on a helper
thread (the next block read while this one computes) is recorded apart, as overlapped time, since it hides behind
the main thread's. Each phase may carry its work (floating-point operations, bytes) for a rate against the machine's
measured peak (measure/machine.py). `sync` (the GPU's synchronize) runs at every phase boundary, so a phase owns the
kernels it launched.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch


def device_sync() -> None:
    """Wait for the GPU's queued work (a no-op without CUDA, or before it is first used): a phase's time includes
    the kernels it launched, not only their launching."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Profile:
    """Seconds and work per phase of one run (see the module docstring)."""

    def __init__(self, sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 startup: float = 0.0):
        """`sync`: called at every phase boundary (default: device_sync); `startup`: seconds the process spent
        before the profile began (its interpreter and imports), recorded as phase `startup` and part of the wall."""
        self.clock, self.sync = clock, sync or device_sync
        self.started = clock() - startup
        self.seconds: dict[str, float] = {"startup": startup} if startup > 0 else {}
        self.overlapped: dict[str, float] = {}  # seconds on helper threads, hidden behind the main thread's
        self.work: dict[str, dict[str, float]] = {}  # phase -> {"flop": ..., "bytes": ...}
        self._owner = threading.get_ident()
        self._stack: list[list] = []  # [name, since] of the main thread's open phases, innermost last
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str, flop: float = 0, nbytes: float = 0, dtype: str | None = None):
        """Time what runs inside as phase `name` (exclusive of nested phases), with its work (`dtype`: what its
        floating-point operations ran in, for the peak that applies)."""
        self.add_work(name, flop, nbytes, dtype)
        if threading.get_ident() != self._owner:  # a helper thread: overlapped with the main thread's phases
            t = self.clock()
            try:
                yield
            finally:
                with self._lock:
                    self.overlapped[name] = self.overlapped.get(name, 0.0) + self.clock() - t
            return
        self.sync()
        now = self.clock()
        if self._stack:  # the enclosing phase pauses
            self._charge(self._stack[-1], now)
        self._stack.append([name, now])
        try:
            yield
        finally:
            self.sync()
            now = self.clock()
            self._charge(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1] = now  # the enclosing phase resumes

    def _charge(self, entry: list, now: float) -> None:
        name, since = entry
        self.seconds[name] = self.seconds.get(name, 0.0) + now - since
        entry[1] = now

    def add_work(self, name: str, flop: float = 0, nbytes: float = 0, dtype: str | None = None) -> None:
        """Work done in phase `name` (counted for its rate) besides what `phase` was given."""
        if not (flop or nbytes):
            return
        with self._lock:
            w = self.work.setdefault(name, {"flop": 0.0, "bytes": 0.0})
            w["flop"] += flop
            w["bytes"] += nbytes
            if dtype is not None:
                w["dtype"] = dtype

    def elapsed(self) -> float:
        """Seconds since the profile started."""
        return self.clock() - self.started


def phase_of(profile: Profile | None, name: str, flop: float = 0, nbytes: float = 0, dtype: str | None = None):
    """`profile.phase(name, ...)`, or a context that does nothing when there is no profile (None)."""
    return contextlib.nullcontext() if profile is None else profile.phase(name, flop, nbytes, dtype)
