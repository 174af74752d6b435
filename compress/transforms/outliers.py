"""Outlier features on purpose: a function-preserving transform that plants them in a small model.

Models from about 6.7B parameters up develop a few hidden dimensions whose activations reach 20-60+ in
almost every layer and token (Dettmers et al. 2022, "LLM.int8()", section 4); absmax int8 activations
then spend their whole range on those dimensions and round the rest to a handful of levels. Small models
have no such features, so to test the methods that handle them we make some: for a few channels c, every
norm that feeds linear layers gets its gain for c multiplied by `factor` and every linear reading that
norm's output gets its input column c divided by `factor`. The product is unchanged (exactly, up to float
rounding), while the activations entering q/k/v and the MLP's first projections carry outliers in the same
dimensions in every layer, as in the large models.

(Scaling the residual stream itself would not preserve the function: RMSNorm and LayerNorm divide by a
statistic of all channels, which a scaled channel changes.)

A test and benchmark aid, not a compression step: a recipe's `model.plant_outliers` applies it right after loading
(to the baseline too, and the report records it); no shipped recipe uses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..arch import ArchSpec
from ..arch import block_pairs
from .smoothing import apply_smoothing, in_weight, pair_skip_reason


@dataclass(frozen=True)
class PlantSpec:
    """`model.plant_outliers`: how many hidden channels to turn into outlier features, and by how much."""

    channels: int = 4
    factor: float = 40.0
    seed: int = 0

    def __post_init__(self):
        if self.channels < 1 or not self.factor > 1:
            raise ValueError(f"plant_outliers needs channels >= 1 and factor > 1, got {self.channels}, {self.factor}")


@torch.no_grad()
def plant_outliers(model: nn.Module, arch: ArchSpec, spec: PlantSpec = PlantSpec()) -> dict:
    """Plant outlier features in place. Returns {"channels": [...], "factor": f, "pairs": n scaled}."""
    hidden = model.get_input_embeddings().weight.shape[1]
    if spec.channels > hidden:
        raise ValueError(f"plant_outliers.channels={spec.channels} exceeds the hidden size {hidden}")
    gen = torch.Generator().manual_seed(spec.seed)
    channels = sorted(torch.randperm(hidden, generator=gen)[: spec.channels].tolist())
    pairs = 0
    for block in arch.block_list(model):
        for prev_name, balance_names, _, followers in block_pairs(block, arch.awq):
            prev = block.get_submodule(prev_name)
            if isinstance(prev, nn.Linear) or type(prev).__name__ == "Conv1D":
                continue  # only norms: their outputs are what the projections read
            if pair_skip_reason(block, prev_name, balance_names, set(balance_names)):
                continue
            balance = [block.get_submodule(n) for n in balance_names + followers]  # routers: same routing
            s = torch.ones(in_weight(balance[0]).shape[1], dtype=torch.float32, device=prev.weight.device)
            if s.numel() != hidden:
                continue
            s[channels] = 1.0 / spec.factor  # prev outputs / s = x * factor; balance columns * s
            apply_smoothing(prev, balance, s, arch.norm_offset)
            pairs += 1
    if pairs == 0:
        raise ValueError(f"{arch.family}: no norm -> linear pair to plant outliers in (arch table `awq` pairs)")
    return {"channels": channels, "factor": spec.factor, "pairs": pairs}
