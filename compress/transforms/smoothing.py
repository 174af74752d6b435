"""Smoothing: folding per-channel scales between an op and the linears that read its output, the machinery AWQ
(quantizers/awq.py) and SmoothQuant (quantizers/smoothquant.py) share.

A scaling pair is (previous op -> the linears that read its output, the module whose output a search compares):
dividing the previous op's outputs by s and multiplying the linears' input columns by s leaves the float model's
function unchanged. Which pairs a family has is in arch/tables.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..arch.paths import block_pairs
from ..arch.moe import any_expert
from ..calibrate.deferred import map_windows
from ..calibrate.observers import InputStats
# re-exported: AWQ, SmoothQuant and planted outliers fold through smoothing
from ..core.fold import apply_smoothing, in_weight, out_channels, scale_inputs, scale_outputs  # noqa: F401


# ---------------------------------------------------------------- scaling pairs of one block

@dataclass
class PairResult:
    pair: str
    ratio: float | None = None
    loss: float | None = None
    loss_identity: float | None = None
    skipped: str = ""  # reason, when the pair was not scaled
    grid: dict[float, float] | None = None  # SmoothQuant's alpha search: the loss at every grid point


def pair_label(prev_name: str, balance_names) -> str:
    """`prev -> balance, ...`, the experts of a MoE block written once as `experts.*`."""
    names = dict.fromkeys(any_expert(n) for n in balance_names)
    return f"{any_expert(prev_name)} -> {', '.join(names)}"


def pair_skip_reason(block: nn.Module, prev_name: str, balance_names, quantized: set[str]) -> str | None:
    """Why a scaling pair cannot be used in this block, or None."""
    missing = [n for n in balance_names if n not in quantized]
    if missing:
        return f"{', '.join(missing)} not quantized by the next stage"
    rotated = [n for n in balance_names if getattr(block.get_submodule(n), "input_rotation", None) is not None]
    if rotated:
        return (f"{', '.join(rotated)} rotates its input at run time (rotate.online_hadamard): a per-channel scale "
                f"folded into {prev_name} does not pass through the Hadamard")
    prev = block.get_submodule(prev_name)
    width = {in_weight(block.get_submodule(n)).shape[1] for n in balance_names}
    if out_channels(prev) is None:
        return f"{prev_name} has no per-channel weight to fold the scales into"
    if len(width) != 1 or out_channels(prev) not in width:
        return (f"{prev_name} has {out_channels(prev)} outputs but {', '.join(balance_names)} read "
                f"{sorted(width)} (grouped-query attention)")
    return None


@dataclass
class Pair:
    """One scaling pair as it applies to one block (arch.block_pairs): modules and names."""

    label: str
    prev: nn.Module
    balance: list[nn.Module]
    balance_names: tuple[str, ...]
    inspect_name: str
    followers: list[nn.Module]  # routers reading prev's output: their input columns take s too (float)


def usable_pairs(block: nn.Module, pairs, quantized: set[str], results: list[PairResult], observer=None):
    """Yield a Pair for each pair of the family's table that this block can scale; a pair it cannot scale is
    appended to `results` as skipped, with the reason. With an observer, a pair whose linears saw no calibration
    input (an expert no token was routed to) is skipped too."""
    for prev_name, balance_names, inspect_name, followers in block_pairs(block, pairs):
        label = pair_label(prev_name, balance_names)
        reason = pair_skip_reason(block, prev_name, balance_names, quantized)
        if reason is None and observer is not None and pooled_stats(observer, balance_names) is None:
            reason = "no calibration input reached these layers (no token was routed to this expert)"
        if reason:
            results.append(PairResult(label, skipped=reason))
            continue
        yield Pair(label, block.get_submodule(prev_name), [block.get_submodule(n) for n in balance_names],
                   balance_names, inspect_name, [block.get_submodule(n) for n in followers])


def pooled_stats(observer, names) -> InputStats | None:
    """The input statistics of the linears `names` pooled: one set where they read one tensor (q/k/v), and over
    every expert of a MoE block where each reads the tokens routed to it (every token reaches top-k experts, so
    the pooled mean |x| is the mean over all the block's tokens). None when none of them saw an input."""
    distinct = list({id(st): st for n in names if (st := observer.stats.get(n)) is not None and st.tokens}.values())
    if not distinct:
        return None
    if len(distinct) == 1:
        return distinct[0]
    sums = [st.abs_sum for st in distinct if st.abs_sum is not None]
    maxima = [st.abs_max for st in distinct if st.abs_max is not None]
    return InputStats(abs_sum=torch.stack(sums).sum(0) if sums else None,
                      abs_max=torch.stack(maxima).amax(0) if maxima else None,
                      tokens=sum(st.tokens for st in distinct))


def fold_scales(pair: Pair, s: Tensor, norm_offset: float, input_divisor: dict[str, Tensor]) -> None:
    """apply_smoothing (the followers' input columns too), and record that the balance linears' inputs are now
    divided by s (GPTQ's Hessian, clipping and later smoothing stages read the recorded inputs through
    `input_divisor`)."""
    apply_smoothing(pair.prev, pair.balance + pair.followers, s, norm_offset)
    for n in pair.balance_names:
        input_divisor[n] = input_divisor.get(n, torch.ones_like(s)) * s


# ---------------------------------------------------------------- replaying an inspect module

def replay_dtype(t: Tensor) -> torch.dtype:
    """The scale search compares candidates in bfloat16 where the hardware multiplies it natively (AMX / tensor cores:
    ~4x the float32 matmul rate on an AMX Xeon), else in float32 (an AVX2 CPU emulates bf16 at 7x the float32 time).
    Candidates and the reference are computed the same way, so the comparison stays fair; the chosen scales are folded
    into the float32 weights."""
    from ..core.nn import native_bf16
    return torch.bfloat16 if native_bf16(t.device.type) else torch.float32


def replay_autocast(t: Tensor):
    """bfloat16 autocast for the replays where replay_dtype says so (off otherwise)."""
    return torch.autocast(device_type=t.device.type, dtype=torch.bfloat16,
                          enabled=replay_dtype(t) is torch.bfloat16)


@torch.no_grad()
def replay(inspect: nn.Module, calls) -> list[Tensor]:
    """The inspect module's float32 outputs on the calls the observer kept (observers.Call)."""
    device = next(iter(inspect.parameters()), torch.empty(0)).device.type
    autocast, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

    def output(call) -> Tensor:  # on a worker thread where map_windows says so: the caller's autocast entered there
        with torch.autocast(device_type=device, dtype=dtype, enabled=autocast):
            out = inspect(*call.args, **call.kwargs)
        return (out[0] if isinstance(out, (tuple, list)) else out).float()
    return list(map_windows(inspect, calls, output, device))
