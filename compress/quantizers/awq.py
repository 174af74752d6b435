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

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..primitives import compute_qparams, dequantize_affine, group_view, quantize_affine
from ..scheme import QuantScheme


@dataclass(frozen=True)
class AWQStage:
    """Recipe entry `- stage: awq`; it must be followed by a `quantize` stage, whose scheme it uses
    unless `scheme` is given (then the two must agree)."""

    scheme: QuantScheme | None = None
    n_grid: int = 20  # scale exponents r in linspace(0, 1, n_grid)
    search_samples: int = 4  # windows the searches replay: 16 was no better on validation (3 seeds), 4x slower
    clip: bool = True
    clip_grid: int = 20  # shrink steps of 1/clip_grid ...
    max_shrink: float = 0.5  # ... down to (1 - max_shrink) of the original range
    clip_tokens: int = 512  # input tokens the clipping search uses per layer
    duo_scaling: bool = False  # AutoAWQ's s = x^r / w^(1-r); off = the paper's s = x^r

    def __post_init__(self):
        if self.n_grid < 2 or self.clip_grid < 1 or self.search_samples < 1 or self.clip_tokens < 1:
            raise ValueError("n_grid >= 2, clip_grid >= 1, search_samples >= 1 and clip_tokens >= 1 are required")
        if not 0 < self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in (0, 1), got {self.max_shrink}")


def fake_quantize(w: Tensor, scheme: QuantScheme) -> Tensor:
    """RTN round trip without packing: the same primitives as quantize_rtn, equal to
    quantize_rtn(w, scheme).dequantize() (tested)."""
    scale, zero = compute_qparams(w, scheme)
    return dequantize_affine(quantize_affine(w, scale, zero, scheme), scale, zero, scheme, w.dtype)


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
                  w_mean: Tensor | None = None) -> tuple[Tensor, float, float, float]:
    """Grid search; returns (best scales [K], best ratio, best loss, loss at r = 0)."""
    best = (None, 0.0, float("inf"))
    first_loss = None
    for ratio in torch.linspace(0, 1, n_grid).tolist():
        s = candidate_scales(x_mean, w_mean, ratio)
        loss = loss_fn(s)
        if first_loss is None:
            first_loss = loss
        if loss < best[2]:
            best = (s, ratio, loss)
    return best[0], best[1], best[2], first_loss


# ---------------------------------------------------------------- folding scales into modules

def in_weight(m: nn.Module) -> Tensor:
    """The weight as [out, in] (a view: Conv1D stores [in, out])."""
    return m.weight.t() if isinstance(m, Conv1D) else m.weight


@torch.no_grad()
def scale_inputs(m: nn.Module, s: Tensor) -> None:
    """Multiply the input columns of a linear by s."""
    in_weight(m).mul_(s.to(m.weight.dtype)[None, :])


@torch.no_grad()
def scale_outputs(m: nn.Module, s: Tensor, offset: float = 0.0) -> None:
    """Divide the outputs of a norm or linear by s. `offset` for norms computing x * (offset + weight)."""
    s = s.to(m.weight.dtype)
    if isinstance(m, (nn.Linear, Conv1D)):
        in_weight(m).div_(s[:, None])
    else:
        m.weight.copy_((m.weight + offset) / s - offset)
    if getattr(m, "bias", None) is not None:
        m.bias.div_(s)


def apply_smoothing(prev: nn.Module, balance: list[nn.Module], s: Tensor, norm_offset: float = 0.0) -> None:
    """Fold scales: prev's outputs / s, balance inputs * s. Function-preserving in exact arithmetic."""
    scale_outputs(prev, s, norm_offset if not isinstance(prev, (nn.Linear, Conv1D)) else 0.0)
    for m in balance:
        scale_inputs(m, s)


def out_channels(m: nn.Module) -> int | None:
    if isinstance(m, (nn.Linear, Conv1D)):
        return in_weight(m).shape[0]
    w = getattr(m, "weight", None)
    return w.shape[0] if isinstance(w, Tensor) and w.dim() == 1 else None


# ---------------------------------------------------------------- clipping

@torch.no_grad()
def search_clip(w: Tensor, x: Tensor, scheme: QuantScheme, grid: int = 20, max_shrink: float = 0.5,
                row_batch: int = 256) -> tuple[Tensor, Tensor]:
    """Per-(row, group) clipping range (lo, hi) minimising the group's output error on inputs x [T, K].

    Symmetric schemes shrink +-absmax; asymmetric ones shrink min and max together. Returns lo, hi of
    shape [N, n_groups]; the original range is a candidate, so clipping never increases the error.
    """
    w = w.float()
    if scheme.granularity == "tensor":
        raise ValueError("the clipping search needs per-channel or per-group scales, not one per tensor")
    xg = group_view(x.float(), scheme)  # [T, groups, G]
    lo_all, hi_all = [], []
    for r0 in range(0, w.shape[0], row_batch):
        wb = w[r0:r0 + row_batch]
        wg = group_view(wb, scheme)  # [n, groups, G]
        ref = torch.einsum("tgk,ngk->ntg", xg, wg)  # [n, T, groups]
        if scheme.symmetric:
            hi0 = wg.abs().amax(dim=-1)
            lo0 = -hi0
        else:
            hi0, lo0 = wg.amax(dim=-1).clamp(min=0), wg.amin(dim=-1).clamp(max=0)
        best_err = torch.full_like(hi0, float("inf"))
        best_lo, best_hi = lo0.clone(), hi0.clone()
        for step in range(int(max_shrink * grid)):
            f = 1 - step / grid
            lo, hi = lo0 * f, hi0 * f
            clipped = torch.minimum(torch.maximum(wg, lo[..., None]), hi[..., None])
            q = fake_quantize(clipped.reshape(wb.shape), scheme).reshape(wg.shape)
            err = (torch.einsum("tgk,ngk->ntg", xg, q) - ref).pow(2).mean(dim=1)  # [n, groups]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        lo_all.append(best_lo)
        hi_all.append(best_hi)
    return torch.cat(lo_all), torch.cat(hi_all)


@torch.no_grad()
def apply_clip(m: nn.Module, lo: Tensor, hi: Tensor, scheme: QuantScheme) -> None:
    w = in_weight(m)
    wg = group_view(w.float(), scheme)
    clipped = torch.minimum(torch.maximum(wg, lo[..., None]), hi[..., None])
    w.copy_(clipped.reshape(w.shape).to(w.dtype))


# ---------------------------------------------------------------- one decoder block

@dataclass
class PairResult:
    pair: str
    ratio: float | None = None
    loss: float | None = None
    loss_identity: float | None = None
    skipped: str = ""  # reason, when the pair was not scaled
    grid: dict[float, float] | None = None  # SmoothQuant's alpha search: the loss at every grid point


def pair_label(prev_name: str, balance_names) -> str:
    return f"{prev_name} -> {', '.join(balance_names)}"


def pair_skip_reason(block: nn.Module, prev_name: str, balance_names, quantized: set[str]) -> str | None:
    """Why a scaling pair cannot be used in this block, or None."""
    missing = [n for n in balance_names if n not in quantized]
    if missing:
        return f"{', '.join(missing)} not quantized by the next stage"
    prev = block.get_submodule(prev_name)
    width = {in_weight(block.get_submodule(n)).shape[1] for n in balance_names}
    if out_channels(prev) is None:
        return f"{prev_name} has no per-channel weight to fold the scales into"
    if len(width) != 1 or out_channels(prev) not in width:
        return (f"{prev_name} has {out_channels(prev)} outputs but {', '.join(balance_names)} read "
                f"{sorted(width)} (grouped-query attention)")
    return None


def usable_pairs(block: nn.Module, pairs, quantized: set[str], results: list[PairResult]):
    """Yield (label, prev, balance modules, balance names, inspect name) for each pair this block can scale;
    a pair it cannot scale is appended to `results` as skipped, with the reason."""
    for prev_name, balance_names, inspect_name in pairs:
        label = pair_label(prev_name, balance_names)
        reason = pair_skip_reason(block, prev_name, balance_names, quantized)
        if reason:
            results.append(PairResult(label, skipped=reason))
            continue
        yield (label, block.get_submodule(prev_name), [block.get_submodule(n) for n in balance_names],
               balance_names, inspect_name)


def fold_scales(prev: nn.Module, balance: list[nn.Module], balance_names, s: Tensor, norm_offset: float,
                input_divisor: dict[str, Tensor]) -> None:
    """apply_smoothing, and record that the balance linears' inputs are now divided by s (GPTQ's Hessian,
    clipping and later smoothing stages read the recorded inputs through `input_divisor`)."""
    apply_smoothing(prev, balance, s, norm_offset)
    for n in balance_names:
        input_divisor[n] = input_divisor.get(n, torch.ones_like(s)) * s


REPLAY_DTYPE = torch.bfloat16


def _autocast(t: Tensor):
    """The scale search compares candidates in bfloat16 (AMX / tensor cores: ~4x the float32 matmul rate
    here). Candidates and the reference are computed the same way, so the comparison stays fair;
    the chosen scales are folded into the float32 weights."""
    return torch.autocast(device_type=t.device.type, dtype=REPLAY_DTYPE)


@torch.no_grad()
def _replay(inspect: nn.Module, calls) -> list[Tensor]:
    outs = []
    for call in calls:
        out = inspect(*call.args, **call.kwargs)
        outs.append((out[0] if isinstance(out, (tuple, list)) else out).float())
    return outs


@torch.no_grad()
def _replay_loss(inspect: nn.Module, calls, reference: list[Tensor], balance: list[nn.Module], s: Tensor,
                 scheme: QuantScheme) -> float:
    """MSE of the inspect module's output with balance weights fake-quantized as Q(W * s) / s."""
    originals = [m.weight.data for m in balance]
    try:
        for m, w0 in zip(balance, originals):
            w = in_weight(m).float()
            trial = fake_quantize(w * s[None, :], scheme) / s[None, :]
            # held in the replay's matmul dtype: the same values autocast would produce, cast once, not per call
            m.weight.data = (trial.t() if isinstance(m, Conv1D) else trial).to(REPLAY_DTYPE).contiguous()
        with _autocast(originals[0]):
            outs = _replay(inspect, calls)
        return sum(float((o - r).pow(2).mean()) for o, r in zip(outs, reference)) / len(calls)
    finally:
        for m, w0 in zip(balance, originals):
            m.weight.data = w0


def awq_block(block: nn.Module, pairs, observer, stage: AWQStage, scheme: QuantScheme, quantized: set[str],
              no_clip: tuple[str, ...], norm_offset: float, input_divisor: dict[str, Tensor]) -> list[PairResult]:
    """Search and fold the scales of every pair of one block, then clip. `quantized` holds the block-relative
    names the next quantize stage will quantize; `input_divisor` collects what each linear's inputs were
    divided by (GPTQ and clipping read their recorded inputs through it)."""
    results = []
    for label, prev, balance, balance_names, inspect_name in usable_pairs(block, pairs, quantized, results):
        stats = observer.stats[balance_names[0]]
        calls = observer.calls[inspect_name]
        w_mean = weight_mean([in_weight(m) for m in balance], scheme) if stage.duo_scaling else None
        inspect = block.get_submodule(inspect_name)
        with _autocast(balance[0].weight):
            reference = _replay(inspect, calls)
        s, ratio, loss, loss0 = search_scales(
            stats.abs_mean, lambda sc: _replay_loss(inspect, calls, reference, balance, sc, scheme), stage.n_grid,
            w_mean)
        fold_scales(prev, balance, balance_names, s, norm_offset, input_divisor)
        results.append(PairResult(label, ratio, loss, loss0))
    if stage.clip and scheme.granularity != "tensor":
        for name in sorted(quantized):
            if name in no_clip or name not in observer.stats:
                continue
            st = observer.stats[name]
            x = torch.cat(st.kept)  # [T, K]
            x = x[:: max(1, x.shape[0] // stage.clip_tokens)][: stage.clip_tokens]
            if name in input_divisor:
                x = x / input_divisor[name][None, :]
            m = block.get_submodule(name)
            lo, hi = search_clip(in_weight(m), x, scheme, stage.clip_grid, stage.max_shrink)
            apply_clip(m, lo, hi, scheme)
    return results
