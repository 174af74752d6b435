"""Expert pruning for mixture-of-experts models: score each expert on calibration text, keep the best per block.

Scores (per MoE block, per expert j, over the calibration tokens routed to it, X_j):
- `reap` (REAP, Lasby et al. 2025, arXiv:2510.13999): the router-weighted expert activation,
  S_j = 1/|X_j| · Σ_{x ∈ X_j} g_j(x) · ‖f_j(x)‖₂, with g_j(x) the routing weight the block multiplies expert j's
  output f_j(x) by. An expert that is rarely chosen, weighted little, or adds little is cheap to lose.
- `frequency`: |X_j|, how many tokens the router sent to it.

Pruning keeps the same number of experts in every block (the config holds one count), those with the highest
scores: the experts leave the model, the router loses their rows (and gpt-oss's bias, DeepSeek-V3's correction bias
entries), and the config and modules their count. What the router chose among the kept experts is unchanged; a token
whose top-k held a dropped expert takes its next choice. Plain transformers loads the saved result.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ..arch.moe import ROUTER_NAMES, ExpertLinears, moe_blocks

Score = Literal["reap", "frequency"]
COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # config / module attributes holding E


@torch.no_grad()
def expert_scores(model: nn.Module, samples: Tensor, score: Score = "reap", batch_size: int = 4) -> dict:
    """{experts module name: {"score": [E], "tokens": [E]}} over the calibration windows `samples` [n, T]."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("expert pruning needs a mixture-of-experts model; this one has no experts")
    sums = {n: torch.zeros(len(b), dtype=torch.float64) for n, b in blocks.items()}
    counts = {n: torch.zeros(len(b), dtype=torch.int64) for n, b in blocks.items()}
    routing: dict[str, tuple[Tensor, Tensor]] = {}
    handles = []

    def stash(name):
        def hook(_module, args):
            routing[name] = (args[1], args[2])  # top_k_index [T, k], top_k_weights [T, k]
        return hook

    def measure(name, e):
        def hook(_module, _args, y):
            index, weights = routing[name]
            token, pos = torch.where(index == e)  # the rows of this call, in the order ExpertLinears gathered them
            g = weights[token, pos].double()
            sums[name][e] += float((g * y.double().norm(dim=-1)).sum())
            counts[name][e] += y.shape[0]
        return hook

    for name, block in blocks.items():
        handles.append(block.register_forward_pre_hook(stash(name)))
        handles += [expert.down_proj.register_forward_hook(measure(name, e)) for e, expert in enumerate(block)]
    try:
        device = next(model.parameters()).device
        for i in range(0, samples.shape[0], batch_size):
            model(input_ids=samples[i:i + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name in blocks:
        tokens = counts[name]
        value = sums[name] / tokens.clamp(min=1) if score == "reap" else tokens.double()
        out[name] = {"score": value.tolist(), "tokens": tokens.tolist()}
    return out


def kept_experts(scores: dict, keep: int) -> dict[str, list[int]]:
    """The `keep` highest-scoring experts of every block, in their original order (ties: the lower index)."""
    out = {}
    for name, row in scores.items():
        s = torch.tensor(row["score"], dtype=torch.float64)
        order = sorted(range(len(s)), key=lambda j: (-float(s[j]), j))
        out[name] = sorted(order[:keep])
    return out


def _set_count(obj, old: int, new: int) -> None:
    for key in COUNT_KEYS:
        if getattr(obj, key, None) == old:
            setattr(obj, key, new)


@torch.no_grad()
def prune_experts(model: nn.Module, keep: dict[str, list[int]]) -> None:
    """Keep only the listed experts of each block (same count everywhere), in place: experts, router rows, counts."""
    counts = {len(k) for k in keep.values()}
    if len(counts) != 1:
        raise ValueError(f"every MoE block must keep the same number of experts (the config holds one); got {counts}")
    new = counts.pop()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    top_k = getattr(config, "num_experts_per_tok", 1)
    if new < top_k:
        raise ValueError(f"keeping {new} experts per block, fewer than the {top_k} each token is routed to "
                         "(num_experts_per_tok); keep at least that many")
    groups = getattr(config, "n_group", None) or 1
    blocks = moe_blocks(model)
    old = len(next(iter(blocks.values())))
    if new % groups:
        raise ValueError(f"the router picks experts in {groups} groups (n_group): keep a multiple of {groups}")
    for name, block in blocks.items():
        idx = keep[name]
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        routers = [getattr(parent, r) for r in ROUTER_NAMES if r != "shared_expert_gate" and
                   isinstance(getattr(parent, r, None), nn.Module)]
        for router in routers:
            rows = torch.tensor(idx)
            router.weight = nn.Parameter(router.weight.data[rows].clone(), requires_grad=False)
            if isinstance(getattr(router, "bias", None), Tensor) and router.bias.shape[0] == old:
                router.bias = nn.Parameter(router.bias.data[rows].clone(), requires_grad=False)
            if isinstance(getattr(router, "e_score_correction_bias", None), Tensor):
                router.e_score_correction_bias = router.e_score_correction_bias[rows].clone()
            _set_count(router, old, new)
        kept = ExpertLinears.__new__(ExpertLinears)
        nn.ModuleList.__init__(kept, [block[j] for j in idx])
        kept.layout = type(block.layout)(new, *[getattr(block.layout, f) for f in
                                                ("has_gate", "concatenated", "transposed", "bias")])
        kept.routing = block.routing
        kept.__dict__["_fused"] = block._fused
        _set_count(block._fused, old, new)
        _set_count(parent, old, new)
        setattr(parent, name.rpartition(".")[2], kept)
    for cfg in {id(c): c for c in (model.config, config)}.values():
        _set_count(cfg, old, new)
