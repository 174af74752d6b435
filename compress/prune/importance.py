"""Minitron importance scores from activations (Muralidharan et al., 2024, "Compact Language Models via
Pruning and Knowledge Distillation", section 2.2), computed with forward hooks over calibration windows.

- heads:   the L2 norm of each head's attention output (the input of the output projection, per head)
- mlp:     the magnitude of each intermediate channel (the input of the down projection)
- hidden:  the magnitude of each residual channel after every norm that reads the residual stream
           (summed over all those norms, the final norm included)
- depth:   block importance 1 - cos(block input, block output) averaged over tokens, and the perplexity
           of the model with that one block removed (what removing it costs)

Per-token scores are aggregated over the sequence, then over the batch, with `seq_agg` / `batch_agg`
in {mean, l2, max}; the defaults (mean over the sequence, L2 over the batch) are the paper's best.
Magnitudes (absolute values) are used so that opposite signs never cancel in a mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..arch import ArchSpec, get_module
from .slicing import prune_layout

Agg = Literal["mean", "l2", "max"]


def aggregate_seq(x: Tensor, how: Agg) -> Tensor:
    """[B, S, C] -> [B, C]"""
    if how == "mean":
        return x.mean(dim=1)
    if how == "l2":
        return x.norm(dim=1)
    if how == "max":
        return x.amax(dim=1)
    raise ValueError(f"aggregation {how!r}; use mean, l2 or max")


class BatchAggregate:
    """Running aggregate over batch rows of [B, C] scores -> [C]."""

    def __init__(self, how: Agg):
        if how not in ("mean", "l2", "max"):
            raise ValueError(f"aggregation {how!r}; use mean, l2 or max")
        self.how, self.total, self.rows = how, None, 0

    def add(self, x: Tensor) -> None:  # x: [B, C]
        x = x.double()
        part = x.amax(0) if self.how == "max" else (x.square() if self.how == "l2" else x).sum(0)
        if self.total is None:
            self.total = part
        else:
            self.total = torch.maximum(self.total, part) if self.how == "max" else self.total + part
        self.rows += x.shape[0]

    def value(self) -> Tensor:
        if self.total is None:
            raise RuntimeError("no activations were observed; is the module on the forward path?")
        if self.how == "mean":
            return (self.total / self.rows).float()
        return (self.total.sqrt() if self.how == "l2" else self.total).float()


@dataclass
class Importance:
    heads: list[Tensor] = field(default_factory=list)  # per layer [num_attention_heads]
    mlp: list[Tensor] = field(default_factory=list)  # per layer [intermediate_size]
    hidden: Tensor | None = None  # [hidden_size]
    depth_cosine: Tensor | None = None  # [num_layers]: 1 - cos(in, out), higher = more important
    depth_ppl: Tensor | None = None  # [num_layers]: perplexity with that block removed
    ppl: float | None = None  # perplexity of the unpruned model on the same windows


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


@torch.no_grad()
def activation_importance(model: nn.Module, arch: ArchSpec, samples: Tensor, axes: set[str], seq_agg: Agg = "mean",
                          batch_agg: Agg = "l2", batch_size: int = 4, progress: bool = True) -> Importance:
    """Score the requested width axes ({"heads", "mlp", "hidden"}) and depth's block-importance cosine."""
    blocks = arch.block_list(model)
    layouts = {a: prune_layout(model, a) for a in axes}
    cfg = model.config
    aggs: dict[tuple, BatchAggregate] = {}
    hooks = []

    rows = [0]  # the current batch size: some families (OPT) flatten [B, S, C] to [B * S, C] inside the MLP

    def record(key, scores: Tensor):  # scores [B, S, C] or [B * S, C]
        scores = scores.reshape(rows[0], -1, scores.shape[-1]).float()  # [B, S, C]
        aggs.setdefault(key, BatchAggregate(batch_agg)).add(aggregate_seq(scores, seq_agg))

    if "heads" in axes:
        n_q = cfg.num_attention_heads
        for i, block in enumerate(blocks):
            o = get_module(block, layouts["heads"]["attn"]["o"])

            def pre(_m, args, i=i):
                x = args[0]  # [B, S, n_q * head_dim]
                record(("heads", i), x.reshape(*x.shape[:2], n_q, -1).norm(dim=-1))  # [B, S, n_q]
            hooks.append(o.register_forward_pre_hook(pre))
    if "mlp" in axes:
        for i, block in enumerate(blocks):
            def pre(_m, args, i=i):
                record(("mlp", i), args[0].abs())  # [B, S, intermediate]
            hooks.append(get_module(block, layouts["mlp"]["mlp_out"]).register_forward_pre_hook(pre))
    if "hidden" in axes:
        norms = [get_module(block, n) for block in blocks for n in layouts["hidden"]["hidden_norms"]]
        for k, norm in enumerate(norms + [get_module(model, arch.final_norm)]):
            def post(_m, _args, out, k=k):
                record(("hidden", k), _first_tensor(out).abs())  # [B, S, hidden]
            hooks.append(norm.register_forward_hook(post))
    if "depth" in axes:
        for i, block in enumerate(blocks):
            def post(_m, args, kwargs, out, i=i):
                x = args[0] if args else kwargs["hidden_states"]
                y = _first_tensor(out)
                cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)  # [B, S]
                record(("depth", i), (1 - cos)[..., None])
            hooks.append(block.register_forward_hook(post, with_kwargs=True))
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, len(samples), batch_size), desc="importance", unit="batch", disable=not progress):
            batch = samples[start:start + batch_size]
            rows[0] = len(batch)
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = Importance()
    if "heads" in axes:
        out.heads = [aggs[("heads", i)].value() for i in range(len(blocks))]
    if "mlp" in axes:
        out.mlp = [aggs[("mlp", i)].value() for i in range(len(blocks))]
    if "hidden" in axes:
        out.hidden = sum(v.value() for k, v in aggs.items() if k[0] == "hidden")
    if "depth" in axes:
        out.depth_cosine = torch.stack([aggs[("depth", i)].value()[0] for i in range(len(blocks))])
    return out


@torch.no_grad()
def mean_nll(model: nn.Module, samples: Tensor, batch_size: int = 2) -> float:
    """Mean next-token negative log-likelihood (nats) over all windows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(samples), batch_size):
        ids = samples[start:start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [B, S-1, V]
        total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                   reduction="sum"))
        count += ids[:, 1:].numel()
    return total / count


@torch.no_grad()
def layer_drop_ppl(model: nn.Module, arch: ArchSpec, samples: Tensor, progress: bool = True) -> tuple[Tensor, float]:
    """Perplexity of the model with each single block removed ([num_layers]), and of the whole model."""
    blocks = arch.block_list(model)
    parent, _, name = arch.blocks.rpartition(".")
    holder = get_module(model, parent) if parent else model
    base = math.exp(mean_nll(model, samples))
    ppl = []
    try:
        for i in tqdm(range(len(blocks)), desc="depth: drop one block", unit="block", disable=not progress):
            setattr(holder, name, nn.ModuleList([b for j, b in enumerate(blocks) if j != i]))
            ppl.append(math.exp(min(mean_nll(model, samples), 50.0)))
    finally:
        setattr(holder, name, blocks)
    return torch.tensor(ppl), base
