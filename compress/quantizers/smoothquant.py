"""SmoothQuant (Xiao et al., 2023, arXiv:2211.10438): migrate activation outliers into the weights.

Per input channel j of a group of linears that read the same tensor,

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)

divides the activations (folded into the previous norm or linear) and multiplies the weight columns,
so X W^T is unchanged in exact arithmetic while the activations' per-channel range flattens: int8
per-token activations then lose far less to one large channel. alpha = 0.5 splits the difficulty evenly
(the paper's default); with `alpha_grid`, each pair keeps the alpha whose W8A8 fake-quantized output of
the pair's inspect module is closest to the float output. The following `quantize` stage stores the
weights (RTN or GPTQ) and quantizes the activations at run time.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..calibrate.distributed import mean_over_ranks, total_over_ranks
from ..core.primitives import fake_quantize_activation
from ..core.scheme import QuantScheme
from ..transforms.smoothing import PairResult, fold_scales, in_weight, pooled_stats, replay, usable_pairs
from .rtn import fake_quantize

MIN_SCALE = 1e-5


def smoothing_scales(x_absmax: Tensor, w_absmax: Tensor, alpha: float) -> Tensor:
    """s = max|X|^alpha / max|W|^(1 - alpha) per input channel [K]; channels that never fire keep s = 1."""
    x = x_absmax.float().clamp(min=MIN_SCALE)
    w = w_absmax.float().clamp(min=MIN_SCALE)
    s = (x.pow(alpha) / w.pow(1 - alpha)).clamp(min=MIN_SCALE)
    return torch.where(x_absmax > 0, s, torch.ones_like(s))


def weight_absmax(balance: list[nn.Module]) -> Tensor:
    """max over all balance linears' output rows of |W[:, j]|: [K]."""
    return torch.stack([in_weight(m).detach().float().abs().amax(dim=0) for m in balance]).amax(dim=0)


@torch.no_grad()
def _w8a8_replay_loss(inspect: nn.Module, calls, reference: list[Tensor], balance: list[nn.Module], s: Tensor,
                      scheme: QuantScheme) -> float:
    """MSE of the inspect module's output with smoothed balance linears whose weights are fake-quantized
    (Q(W * s)) and whose inputs (X / s) are fake-quantized by the scheme's activation format (a static
    per-tensor scale is stood in for by the batch's own range, as it is not calibrated yet)."""
    act = replace(scheme.act, dynamic=True)
    originals = [m.weight.data for m in balance]
    hooks = []
    try:
        for m, w0 in zip(balance, originals):
            trial = fake_quantize(in_weight(m).float() * s[None, :], scheme)
            m.weight.data = (trial.t() if isinstance(m, Conv1D) else trial).to(w0.dtype).contiguous()
            hooks.append(m.register_forward_pre_hook(
                lambda _m, args: (fake_quantize_activation(args[0] / s.to(args[0].dtype), act),)))
        outs = replay(inspect, calls)
        return mean_over_ranks([float((o - r).pow(2).mean()) for o, r in zip(outs, reference)])
    finally:
        for h in hooks:
            h.remove()
        for m, w0 in zip(balance, originals):
            m.weight.data = w0


def smoothquant_block(block: nn.Module, pairs, observer, stage, scheme: QuantScheme,
                      quantized: set[str], norm_offset: float, input_divisor: dict[str, Tensor]) -> list[PairResult]:
    """Smooth every usable pair of one block in place; record what each linear's inputs were divided by."""
    results = []
    for pair in usable_pairs(block, pairs, quantized, results, observer):
        label, balance, balance_names, inspect_name = pair.label, pair.balance, pair.balance_names, pair.inspect_name
        x_absmax = pooled_stats(observer, balance_names).input_absmax(input_divisor.get(balance_names[0]))
        w_absmax = weight_absmax(balance)
        alpha, loss, loss0 = stage.alpha, None, None
        calls = observer.calls.get(inspect_name, [])
        if stage.alpha_grid and total_over_ranks(len(calls)):  # (an expert no replayed window reached: fixed alpha)
            inspect = block.get_submodule(inspect_name)
            reference = replay(inspect, calls)
            loss0 = _w8a8_replay_loss(inspect, calls, reference, balance, torch.ones_like(x_absmax), scheme)
            losses = {a: _w8a8_replay_loss(inspect, calls, reference, balance,
                                           smoothing_scales(x_absmax, w_absmax, a), scheme) for a in stage.alpha_grid}
            alpha = min(losses, key=losses.get)
            loss = losses[alpha]
        s = smoothing_scales(x_absmax, w_absmax, alpha)
        fold_scales(pair, s, norm_offset, input_divisor)
        results.append(PairResult(label, alpha, loss, loss0, grid=losses if stage.alpha_grid else None))
    return results
