"""Statistics collected by hooks during a block's float forward, kept apart from the solvers.

One `BlockObserver` per decoder block watches the linear layers (input |x| mean and max per channel,
Hessian X^T X, a few kept inputs) and the AWQ "inspect" modules (their call arguments for the
first samples, to replay them). Linears that read the very same tensor (q/k/v, gate/up) share one
set of statistics, so the Hessian of a shared input is accumulated once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..core.profile import phase_of
from .deferred import deferrable


@dataclass
class InputStats:
    """Per-input-channel statistics of one linear layer's input."""

    abs_sum: Tensor | None = None  # [K] sum of |x| over tokens
    abs_max: Tensor | None = None  # [K] max of |x| over tokens
    hessian: Tensor | None = None  # [K, K] sum of x x^T over tokens (float32)
    tokens: int = 0
    kept: list[Tensor] = field(default_factory=list)  # inputs of the first samples, [T, K] each
    kept_at: list[int] = field(default_factory=list)  # the sample each kept input came from (a MoE expert skips some)

    @property
    def abs_mean(self) -> Tensor:
        return self.abs_sum / max(self.tokens, 1)

    def hessian_mean(self, divisor: Tensor | None = None) -> Tensor:
        """H = 2/n sum x x^T, the GPTQ Hessian of ||W X - W' X||^2. Where an earlier stage (AWQ, SmoothQuant) has
        since divided the layer's inputs by s per channel (`divisor`), the inputs it sees now are x / s and their
        Hessian is H / (s s^T)."""
        h = self.hessian * (2.0 / max(self.tokens, 1))
        return h if divisor is None else h / (divisor[:, None] * divisor[None, :])

    def input_absmax(self, divisor: Tensor | None = None) -> Tensor:
        """max |x| per input channel, of the inputs as the layer sees them now (x / s after a smoothing stage)."""
        return self.abs_max if divisor is None else self.abs_max / divisor


@dataclass
class Call:
    args: tuple
    kwargs: dict


class BlockObserver:
    """Attach hooks to a block; after the float forward, read `stats[name]` and `calls[name]`."""

    def __init__(self, block: nn.Module, linears: list[str], inspect: list[str], *, abs_mean: bool,
                 hessian: bool, keep_samples: int, abs_max: bool = False, kv: tuple[str, ...] = ()):
        self.block, self.linears, self.inspect = block, linears, inspect
        self.profile = None  # a core.profile.Profile: the statistics' time and FLOPs as its phase `statistics`
        self.want_abs, self.want_hessian, self.keep = abs_mean, hessian, keep_samples
        self.want_max = abs_max
        # attention modules whose key/value maxima the kv_cache attention wrapper records: name -> [k, v]
        self.kv_absmax: dict[str, list[float]] = {n: [0.0, 0.0] for n in kv}
        self.stats: dict[str, InputStats] = {}
        self.calls: dict[str, list[Call]] = {n: [] for n in inspect}
        self._sample = -1
        self._dtype: torch.dtype | None = None
        self._seen: list[tuple[Tensor, str]] = []  # inputs of the current sample and their first reader
        self._worker = threading.local()  # per worker thread: its last input and its window sums (_window_sums)
        self._handles: list = []

    def empty_stats(self, linear: nn.Module) -> InputStats:
        """Statistics of no input (zeros of the shapes this observer gathers): what a process contributes for a
        layer it saw nothing of (a MoE expert no token of its windows was routed to) when the ranks' are summed."""
        from ..core.nn import linear_shape
        k = linear_shape(linear)[1]
        device = next(linear.parameters()).device  # where the other ranks' statistics of it are: reduced together
        zeros = torch.zeros(k, dtype=torch.float32, device=device)
        return InputStats(abs_sum=zeros.clone() if self.want_abs else None,
                          abs_max=zeros.clone() if self.want_max else None,
                          hessian=torch.zeros(k, k, dtype=torch.float32, device=device) if self.want_hessian else None)

    def __enter__(self) -> "BlockObserver":
        # deferrable: on the worker threads of a parallel block forward, kept and run in the windows' order
        # (calibrate/deferred.py), so the sums, the Hessians and the kept samples are a one-window-at-a-time
        # forward's. With a Hessian the hooks are heavy: its float32 X^T X runs between pairs of windows on all
        # threads (on the embedded model's awq_gptq_tune recipe, the float forward and the statistics 145 -> 109 s on
        # the AMX Xeon; they were serial on two threads before, where this machine runs a forward's small operations
        # slowly)
        # (the key/value maxima ride on the attention modules instead, which keeps windows serial: deferred.py)
        wrap = (lambda hook: deferrable(hook, heavy=True)) if self.want_hessian else deferrable
        self._handles.append(self.block.register_forward_pre_hook(wrap(self._new_sample)))
        for name, record in self.kv_absmax.items():
            self.block.get_submodule(name).kv_record = record
        # without a Hessian the hooks are light: each window's |x| sums and maxima are computed on the worker that ran
        # the window (_window_sums; the caller's thread only adds them up in order), not on the caller's thread beside
        # the two busy workers (float forward and statistics 22 -> 18 s on the embedded model's awq_int4 recipe)
        prepare = None if self.want_hessian else self._window_sums
        for name in self.linears:
            mod = self.block.get_submodule(name)
            hook = self._linear_hook(name)
            self._handles.append(mod.register_forward_hook(
                deferrable(hook, heavy=True) if self.want_hessian else deferrable(hook, prepare=prepare)))
        for name in self.inspect:
            mod = self.block.get_submodule(name)
            self._handles.append(mod.register_forward_pre_hook(wrap(self._inspect_hook(name)), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for name in self.kv_absmax:
            self.block.get_submodule(name).kv_record = None
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _new_sample(self, _module, args) -> None:
        self._sample += 1
        self._seen = []
        self._dtype = args[0].dtype if args and isinstance(args[0], Tensor) else None  # the residual stream's

    def _window_sums(self, _module, args, _output) -> tuple[Tensor | None, Tensor | None]:
        """A window's (sum over tokens of |x| in float32, max of |x| in float32) per input channel, as _accumulate
        computes them (the same values on any thread count: a reduction over the token rows). Linears that read the
        same tensor (q/k/v) get the first one's, from this thread's last input."""
        x = args[0]
        last = getattr(self._worker, "last", None)
        if last is not None and last[0] is x:
            return last[1]
        sums = self._sums(x.detach().reshape(-1, x.shape[-1]))
        self._worker.last = (x, sums)
        return sums

    def _sums(self, x2: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a = x2.abs() if self.want_abs or self.want_max else None
        return (a.sum(dim=0, dtype=torch.float32) if self.want_abs else None,
                a.amax(dim=0).float() if self.want_max else None)

    def _linear_hook(self, name: str):
        def hook(_module, args, _output, prepared=None):
            x = args[0]
            # The same tensor object feeds several linears (q/k/v): share one InputStats. Holding the
            # reference until the next sample also stops its memory being reused by a later input.
            first = next((n for t, n in self._seen if t is x), None)
            if first is not None:
                self.stats[name] = self.stats[first]
                return
            self._seen.append((x, name))
            # statistics in float32 even when the pass runs under bfloat16 autocast (a bf16 X^T X over thousands
            # of tokens is not even positive definite)
            flop = 2 * x.numel() * x.shape[-1] if self.want_hessian else 0  # X^T X: [T, K] x [T, K]
            with torch.autocast(device_type=x.device.type, enabled=False), \
                    phase_of(self.profile, "statistics", flop, dtype="float32"):
                self._accumulate(self.stats.setdefault(name, InputStats()), x, prepared)
        return hook

    def _accumulate(self, st: InputStats, x: Tensor, sums: tuple | None = None) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1])  # [T, K], in the pass's dtype; sums accumulate in float32
        s, m = sums if sums is not None else self._sums(x2)  # this window's, computed on its worker or here
        if self.want_abs:
            st.abs_sum = s if st.abs_sum is None else st.abs_sum + s
        if self.want_max:
            st.abs_max = m if st.abs_max is None else torch.maximum(st.abs_max, m)
        if self.want_hessian or self._sample < self.keep:
            x2 = x2.float()
        if self.want_hessian:  # [K, K]; later windows added in place by the matmul (no K² temporary: for a 7B
            # down_proj, 485 MB allocated and faulted in per window; 1.5x faster on one CPU thread and on two)
            st.hessian = x2.T @ x2 if st.hessian is None else st.hessian.addmm_(x2.T, x2)
        if self._sample < self.keep:
            st.kept.append(x2)
            st.kept_at.append(self._sample)
        st.tokens += x2.shape[0]

    def _inspect_hook(self, name: str):
        def hook(_module, args, kwargs):
            if self._sample < self.keep:
                # a float32 block observed under bfloat16 autocast passes some bf16 tensors: keep them in the
                # block's own dtype (that of its input; lossless), so a replay outside autocast runs too
                self.calls[name].append(Call(_to_dtype(args, self._dtype), _to_dtype(dict(kwargs), self._dtype)))
        return hook


def _to_dtype(value, dtype):
    """Floating tensors in a (nested) call argument, cast to `dtype` (None: as they are)."""
    if dtype is None:
        return value
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to_dtype(v, dtype) for k, v in value.items()}
    return value
