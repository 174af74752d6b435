"""AWQ (Lin et al., 2023, arXiv:2306.00978): activation-aware per-input-channel scaling.

Salient input channels (large mean |x|) lose less to rounding when their weights are scaled up by
s and their inputs down by 1/s. For each scaling pair (previous op -> the linears that read its
output) AWQ grid-searches s = mean|x|^r, r in [0, 1], normalised so sqrt(max * min) = 1, keeping the
r whose fake-quantized weights reproduce the float output of the pair's "inspect" module best
(r = 0 is the identity, so the search never does worse than RTN on its own loss). The scale is
folded into the previous op (norm weight / linear rows divided by s) and the balance linears
(columns multiplied by s): the float model's function is unchanged. Then a clipping search shrinks
each group's range where that lowers the layer's output error. AWQ only moves and clips weights;
the following `quantize` stage stores them (RTN or GPTQ), so there is one RTN, in rtn.py.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..calibrate.blockwise import linear_weights_in
from ..calibrate.deferred import map_windows
from ..calibrate.distributed import all_windows, mean_over_ranks, total_over_ranks
from ..core.primitives import group_range, group_view
from ..core.scheme import QuantScheme
from ..kernels.cpu_quant import fake_quantize_rows
from ..transforms.smoothing import (replay_dtype, PairResult, fold_scales, in_weight, pooled_stats, replay,
        replay_autocast, usable_pairs)
from ..threads import cpu_threads, run_groups, window_workers
from .rtn import fake_quantize


def weight_mean(weights: list[Tensor], scheme: QuantScheme) -> Tensor:
    """Mean over output rows of |w| normalised by its group's max: [K]."""
    w = torch.cat([x.float() for x in weights], dim=0)  # [sum N, K]
    g = group_view(w.abs(), scheme)  # [rows, n_groups, G]
    g = g / (g.amax(dim=-1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(dim=0)


def candidate_scales(x_mean: Tensor, w_mean: Tensor | None, ratio: float) -> Tensor:
    s = x_mean.float().pow(ratio)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - ratio) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / math.sqrt(float(s.max()) * float(s.min()))


def search_scales(x_mean: Tensor, loss_fn: Callable[[Tensor], float], n_grid: int,
                  w_mean: Tensor | None = None, step: int = 1) -> tuple[Tensor, float, float, float]:
    """Grid search over r in linspace(0, 1, n_grid); returns (best scales [K], best ratio, best loss, loss at r = 0).

    `step` > 1: coarse to fine. Every step-th exponent of the grid first (r = 0 among them), then the exponents within
    step - 1 grid points of the best of those; the best of all tried wins (ties: the smaller r, as in the full grid).
    Where the loss falls then rises along the grid this finds the full grid's choice exactly, with about
    n_grid / step + 2 (step - 1) losses instead of n_grid (20 -> 11 at step 3); where it has several dips it may
    settle in a local one near the best coarse point (on the embedded model's awq_int4 recipe: 89 of 90 pairs chose
    as the full grid did)."""
    if step < 1:
        raise ValueError(f"the search step must be >= 1, got {step}")
    ratios = torch.linspace(0, 1, n_grid).tolist()
    losses: dict[int, float] = {}

    def tried(i: int) -> float:
        if i not in losses:
            losses[i] = loss_fn(candidate_scales(x_mean, w_mean, ratios[i]))
        return losses[i]

    coarse = list(range(0, n_grid, step))
    best = min(coarse, key=lambda i: (tried(i), i))
    for i in range(max(0, best - step + 1), min(n_grid, best + step)):
        tried(i)
    best = min(losses, key=lambda i: (losses[i], i))
    return candidate_scales(x_mean, w_mean, ratios[best]), ratios[best], losses[best], losses[0]


# ---------------------------------------------------------------- clipping

@torch.no_grad()
def search_clip(w: Tensor, x: Tensor, scheme: QuantScheme, grid: int = 20, max_shrink: float = 0.5,
                row_batch: int = 256) -> tuple[Tensor, Tensor]:
    """Per-(row, group) clipping range (lo, hi) minimising the group's output error on inputs x [T, K].

    Symmetric schemes shrink +-absmax; asymmetric ones shrink min and max together. Returns lo, hi of
    shape [N, n_groups]; the original range is a candidate, so clipping never increases the error.
    The error of a group is mean_t (x_t . (q - w))^2 = d^T (X^T X / T) d with d = q - w: per group a G x G Gram
    matrix of the inputs, computed once, instead of a [T, G] product per candidate (8x fewer FLOPs at T = 512,
    G = 64; the same error up to float32 rounding, tested against the direct form). Where a group is not smaller
    than the token count (per-channel scales) the direct form is cheaper and is used.
    """
    w = w.float()
    if scheme.granularity == "tensor":
        raise ValueError("the clipping search needs per-channel or per-group scales, not one per tensor")
    xg = group_view(x.float(), scheme)  # [T, groups, G]
    gram = xg.shape[-1] < xg.shape[0] and scheme.granularity != "block"
    if gram:
        xt = xg.transpose(0, 1)  # [groups, T, G]
        h = torch.bmm(xt.transpose(1, 2), xt) / xg.shape[0]  # [groups, G, G]
    lo_all, hi_all = [], []
    for r0 in range(0, w.shape[0], row_batch):
        wb = w[r0:r0 + row_batch]
        wg = group_view(wb, scheme)  # [n, groups, G]
        if not gram:
            ref = torch.einsum("tgk,ngk->ntg", xg, wg)  # [n, T, groups]
        lo0, hi0 = group_range(wg, scheme.symmetric)
        best_err = torch.full_like(hi0, float("inf"))
        best_lo, best_hi = lo0.clone(), hi0.clone()
        for step in range(int(max_shrink * grid)):
            f = 1 - step / grid
            lo, hi = lo0 * f, hi0 * f
            # Q(clamp(w, lo, hi)) - w in one pass per row where cpu_quant.c applies (the same values as torch's)
            d = fake_quantize_rows(wb, scheme, clip=(lo, hi), minus_w=True) if gram else None
            if d is None:
                clipped = torch.minimum(torch.maximum(wg, lo[..., None]), hi[..., None])
                q = fake_quantize(clipped.reshape(wb.shape), scheme).reshape(wg.shape)
            if gram:
                d = (q - wg if d is None else d.view(wg.shape)).transpose(0, 1)  # [groups, n, G]
                err = (torch.bmm(d, h) * d).sum(dim=-1).t()  # [n, groups]
            else:
                err = (torch.einsum("tgk,ngk->ntg", xg, q) - ref).pow(2).mean(dim=1)  # [n, groups]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        lo_all.append(best_lo)
        hi_all.append(best_hi)
    return torch.cat(lo_all), torch.cat(hi_all)


def clip_factor(w: Tensor, lo: Tensor, hi: Tensor, scheme: QuantScheme) -> Tensor:
    """search_clip's ranges as the factor [N, groups] by which each (row, group)'s range was shrunk (1: unclipped),
    for primitives.shrink_range."""
    lo0, hi0 = group_range(group_view(w.float(), scheme), scheme.symmetric)
    width0 = hi0 - lo0
    return torch.where(width0 > 0, (hi - lo) / width0.clamp(min=1e-30), torch.ones_like(width0))


@torch.no_grad()
def apply_clip(m: nn.Module, lo: Tensor, hi: Tensor, scheme: QuantScheme) -> None:
    w = in_weight(m)
    wg = group_view(w.float(), scheme)
    clipped = torch.minimum(torch.maximum(wg, lo[..., None]), hi[..., None])
    w.copy_(clipped.reshape(w.shape).to(w.dtype))


# ---------------------------------------------------------------- one decoder block

SLICE_VALUES = 1 << 16  # values in one slice of a trial weight (slice_rows)


def slice_rows(w: Tensor, scheme: QuantScheme) -> int:
    """Rows of a [out, in] weight that fake_quantize may take at a time with the whole weight's result bit for bit
    (every operation is per row group): on a CPU about 64K values, so that a slice's temporaries stay in the core's
    cache (a 1536 x 576 trial: 3.6 ms in slices against 7.0 ms whole, one thread); the whole weight on an
    accelerator, or where the scales span rows (per tensor, 2-D blocks) or there is a per-tensor scale (NVFP4)."""
    if w.device.type != "cpu" or scheme.granularity not in ("group", "channel") or scheme.has_global_scale:
        return w.shape[0]
    return max(1, SLICE_VALUES // w.shape[1])


def one_thread(device: torch.device):
    """torch's CPU threads at one for a burst of element-wise work on cache-sized slices (the trial weights, the
    clipping search): on the 2-core machines we measure, such work is 1.3-2.5x slower on two OpenMP threads than on
    one, and slower still split between two Python threads (each small operation hands the interpreter lock over).
    A CPU of many cores gives up its intra-op threads here; the replays, most of the search, keep them. Unchanged
    on an accelerator."""
    return cpu_threads(1) if device.type == "cpu" else contextlib.nullcontext()


@torch.no_grad()
def scaled_trials(balance: list[nn.Module], s: Tensor, schemes: list[QuantScheme], dtype: torch.dtype) -> list[Tensor]:
    """The scale search's trial weights of the linears in `balance`: Q(W * s) / s (s [K] per input channel), each in
    its module's own weight layout, as `dtype`. On a CPU, where kernels/cpu_quant.c applies (integer codes by group
    or channel; a float32 or bfloat16 trial in the [out, in] layout), one pass per row on every thread (3x faster
    than torch's dozen passes on one thread); else in slices of slice_rows rows on one_thread. The same values as
    fake_quantize on the whole weights, bit for bit (tested)."""
    outs = []
    threads = torch.get_num_threads()
    with one_thread(s.device):
        for m, sch in zip(balance, schemes):
            w = in_weight(m)
            out = torch.empty(m.weight.shape, dtype=dtype, device=w.device)
            if not isinstance(m, Conv1D) and dtype in (torch.float32, torch.bfloat16) and \
                    fake_quantize_rows(w.float(), sch, s, out, threads) is not None:
                outs.append(out)
                continue
            view = out.t() if isinstance(m, Conv1D) else out  # [out, in], written in the module's layout
            rows = slice_rows(w, sch)
            for r in range(0, w.shape[0], rows):
                view[r:r + rows] = fake_quantize(w[r:r + rows].float() * s[None, :], sch).div_(s[None, :])
            outs.append(out)
    return outs


@torch.no_grad()
def _replay_loss(inspect: nn.Module, calls, reference: list[Tensor], balance: list[nn.Module], s: Tensor,
                 schemes: list[QuantScheme]) -> float:
    """MSE of the inspect module's output with balance weights fake-quantized as Q(W * s) / s, each in its scheme."""
    originals = [m.weight.data for m in balance]
    try:
        # held in the replay's matmul dtype: the same values autocast would produce, cast once, not per call
        for m, trial in zip(balance, scaled_trials(balance, s, schemes, replay_dtype(originals[0]))):
            m.weight.data = trial
        def loss(k: int) -> float:  # a replay's output compared as it comes (on a worker thread: map_windows)
            with replay_autocast(originals[0]):
                out = inspect(*calls[k].args, **calls[k].kwargs)
                # a bfloat16 output minus the float32 reference is computed in float32: (out.float() - ref) exactly
                return float(((out[0] if isinstance(out, (tuple, list)) else out) - reference[k]).pow_(2).mean())
        return mean_over_ranks(list(map_windows(inspect, range(len(calls)), loss, originals[0].device.type)))
    finally:
        for m, w0 in zip(balance, originals):
            m.weight.data = w0


def awq_block(block: nn.Module, pairs, observer, stage, scheme: QuantScheme, quantized: set[str],
              no_clip: tuple[str, ...], norm_offset: float, input_divisor: dict[str, Tensor],
              schemes: dict[str, QuantScheme] | None = None,
              clip_into: dict[str, Tensor] | None = None) -> list[PairResult]:
    """Search and fold the scales of every pair of one block, then clip. `quantized` holds the block-relative
    names the next quantize stage will quantize; `input_divisor` collects what each linear's inputs were
    divided by (GPTQ and clipping read their recorded inputs through it). `schemes` (block-relative name -> scheme):
    layers the quantize stage stores in another scheme than `scheme` (mixed precision); each is searched and clipped
    for its own. `clip_into` (the stage's clip_to: grid): each clipped layer's range factors go there, for GPTQ's
    grid, instead of clamping its weight."""
    schemes = {name: (schemes or {}).get(name, scheme) for name in quantized}
    results = []
    for pair in usable_pairs(block, pairs, quantized, results, observer):
        balance = pair.balance
        stats = pooled_stats(observer, pair.balance_names)
        calls = observer.calls[pair.inspect_name]
        if total_over_ranks(len(calls)) == 0:  # an expert whose tokens all came after the replayed windows
            results.append(PairResult(pair.label, skipped="no replayed calibration window reached it (raise "
                                                          "search_samples)"))
            continue
        balance_schemes = [schemes[n] for n in pair.balance_names]
        w_mean = weight_mean([in_weight(m) for m in balance], balance_schemes[0]) if stage.duo_scaling else None
        inspect = block.get_submodule(pair.inspect_name)
        dtype = replay_dtype(balance[0].weight)
        # the inspect module's other linears (o_proj after q/k/v, down_proj after gate/up) held in the replays'
        # matmul dtype for the search: the values autocast casts them to, once instead of in every replay
        with linear_weights_in(inspect, dtype, exclude=tuple(balance)) if dtype != torch.float32 else \
                contextlib.nullcontext():
            with replay_autocast(balance[0].weight):
                reference = replay(inspect, calls)
            s, ratio, loss, loss0 = search_scales(
                stats.abs_mean, lambda sc: _replay_loss(inspect, calls, reference, balance, sc, balance_schemes),
                stage.n_grid, w_mean, stage.search_step)
        fold_scales(pair, s, norm_offset, input_divisor)
        results.append(PairResult(pair.label, ratio, loss, loss0))
    if stage.clip:
        names = [name for name in sorted(quantized) if name not in no_clip and name in observer.stats
                 and schemes[name].granularity != "tensor"]
        device = next(block.parameters()).device
        workers = max(1, window_workers(device.type, torch.get_num_threads(), len(names)))

        def clip_search(job):
            name, m, x = job[0]
            return [search_clip(in_weight(m), x, schemes[name], stage.clip_grid, stage.max_shrink)]
        # a few layers at a time: their inputs gathered here, in order (with several processes every rank gathers
        # the same layer at the same time), two searched at once on a CPU of more than one thread, each on half the
        # threads (one each on two cores, where these small operations run 1.7-2x faster than on two threads; the
        # ranges do not depend on the threads, tested); a MoE block's hundreds of experts never hold all their
        # inputs at once
        for at in range(0, len(names), 2 * workers):
            jobs = []  # (name, its module, its inputs as it sees them now)
            for name in names[at:at + 2 * workers]:
                st = observer.stats[name]
                kept = all_windows(st.kept, st.kept_at)
                if not kept:  # an expert no replayed window reached: its range stays as it is
                    continue
                x = torch.cat(kept)  # [T, K]; with several processes, every rank's windows
                x = x[:: max(1, x.shape[0] // stage.clip_tokens)][: stage.clip_tokens]
                if name in input_divisor:
                    x = x / input_divisor[name][None, :]
                jobs.append((name, block.get_submodule(name), x))
            ranges = run_groups([[job] for job in jobs], clip_search, workers,
                                cost=lambda g: g[0][1].weight.numel())
            for (name, m, _), [(lo, hi)] in zip(jobs, ranges):
                if clip_into is not None:
                    clip_into[name] = clip_factor(in_weight(m), lo, hi, schemes[name])
                else:
                    apply_clip(m, lo, hi, schemes[name])
    return results
