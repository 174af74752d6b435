"""Folding per-channel scales into layers: dividing an op's outputs by s and multiplying the input columns of the
linears that read them by s leaves the function unchanged. Smoothing, AWQ, SmoothQuant, planted outliers and the
derivation of an architecture's scaling pairs all fold through these."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D


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
