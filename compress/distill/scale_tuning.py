"""Scale tuning: a quantized model's scales trained end to end while its integer codes stay as they were rounded
(EfficientQAT's E2E-QP, Chen et al. 2024, section 3.3), here by distillation from the original model (distill.py).

Each tuned QuantLinear's scale s [out, groups] is read as s * exp(g) while tuning, g a float32 gain of the scale's
shape that starts at 0 (a multiplicative gain, so that one learning rate suits every layer whatever its scales'
magnitude, and no scale changes sign). The codes and the zero points are untouched, so the checkpoint keeps its
format, its size and every export; only the scale values change. A trellis-coded layer (core/trellis.py) has one
scale per row of its rotated weight, W = Q_out · diag(scale) C · Q_inᵀ: those are tuned the same way, its walks and
Hadamard signs untouched.

The low-rank repair terms the eora stage set (QuantLinear.lora_a / lora_b) can be trained the same way, beside the
scales or alone (`tuning`): the terms were fitted layer by layer to each layer's own error (or its KL Hessian's
two sides); trained end to end they are fitted to what the whole model computes. Their shapes, and so the bytes and
the adapter every export writes, stay as the eora stage set them.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..core.nn import QuantLinear
from ..core.trellis import TrellisLinear, decoded_walks


class ScaleGain(nn.Module):
    """The parametrization s -> s * exp(gain), computed in float32."""

    def __init__(self, shape: torch.Size):
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(shape, dtype=torch.float32))

    def forward(self, scale: Tensor) -> Tensor:
        return scale.float() * torch.exp(self.gain)


def tunable_layers(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """(names of the QuantLinears whose scales can be tuned, {name: why not} for the others)."""
    names, skipped = [], {}
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        if m.scheme.act is not None:
            skipped[name] = f"{m.scheme.name}: its activations are quantized too (the int8 matmul has no gradient)"
        elif m.scheme.is_micro:
            skipped[name] = f"{m.scheme.name}: its block scales are encoded ({m.scheme.scale_dtype}); a tuned value " \
                            "would be rounded back to that grid"
        else:
            names.append(name)
    return names, skipped


@contextlib.contextmanager
def scale_gains(model: nn.Module, names: list[str], decode_once: bool = True):
    """Within the block, the scales of the QuantLinears `names` read as scale * exp(gain); yields the gains (the
    only parameters that require gradients: the rest of the model is frozen). On exit each scale becomes its tuned
    value in its own dtype (also after an error: the model is left as tuned so far). `decode_once`: a trellis layer
    keeps its decoded walks for the whole block (core/trellis.decoded_walks: 4 bytes per weight of every trellis
    layer at once, where a forward's backward holds one layer's); off, each forward decodes them again (gradient
    checkpointing, where only one block's are meant to be held)."""
    modules = dict(model.named_modules())
    model.requires_grad_(False)
    gains = []
    # a trellis layer's walks decoded once for the whole tuning, not in every forward (only its row scales change)
    with decoded_walks([modules[n] for n in names if decode_once and isinstance(modules[n], TrellisLinear)]):
        for name in names:
            m = modules[name]
            # unsafe: the parametrized scale is float32 while the stored one keeps the scheme's scale_dtype (float16)
            parametrize.register_parametrization(m, "scale", ScaleGain(m.scale.shape).to(m.scale.device), unsafe=True)
            gains.append(m.parametrizations.scale[0].gain)
        try:
            yield gains
        finally:
            for name in names:
                m = modules[name]
                with torch.no_grad():
                    tuned = m.scale
                stored = m.parametrizations.scale.original
                parametrize.remove_parametrizations(m, "scale", leave_parametrized=False)
                m.scale = tuned.to(stored.dtype)


@contextlib.contextmanager
def tuning(model: nn.Module, scales: list[str], lowrank: list[str], decode_once: bool = True):
    """Within the block the model is frozen except the scale gains of the QuantLinears `scales` (scale_gains) and
    the low-rank terms A, B of the QuantLinears `lowrank` (trained in float32 in place, whatever their stored dtype);
    yields the trainable parameters. On exit the scales are stored as scale_gains stores them, each term goes back
    to its stored dtype, and nothing requires gradients (also after an error: the model is left as tuned so far)."""
    modules = dict(model.named_modules())
    with scale_gains(model, scales, decode_once) as gains:  # freezes the whole model first
        stored = {}
        try:
            for name in lowrank:
                m = modules[name]
                if not m.rank:
                    raise ValueError(f"{name} has no low-rank term to train")
                stored[name] = m.lora_a.dtype
                m.lora_a = nn.Parameter(m.lora_a.detach().float())
                m.lora_b = nn.Parameter(m.lora_b.detach().float())
            yield gains + [p for n in lowrank for p in (modules[n].lora_a, modules[n].lora_b)]
        finally:
            for name, dtype in stored.items():
                m = modules[name]
                m.set_lowrank(m.lora_a.detach().to(dtype), m.lora_b.detach().to(dtype))
