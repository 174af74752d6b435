"""Plain references for mixed precision (compress/precision.py), written for clarity, not speed: the knapsack by
trying every combination, the Fisher sensitivity token by token in float64 with a model copy per layer and option,
and the measured KL with the weight itself replaced."""
from __future__ import annotations

import copy
import itertools
import math

import torch
from torch import nn


def brute_force_choice(costs, nbytes, budget):
    """(least total cost, its choice) over every combination of one option per layer within `budget` bytes."""
    best = (math.inf, None)
    for combo in itertools.product(*[range(len(row)) for row in costs]):
        if any(nbytes[layer][c] < 0 for layer, c in enumerate(combo)):
            continue
        size = sum(nbytes[layer][c] for layer, c in enumerate(combo))
        cost = sum(costs[layer][c] for layer, c in enumerate(combo))
        if size <= budget and cost < best[0]:
            best = (cost, list(combo))
    return best


def _set_weight(module: nn.Module, w: torch.Tensor) -> None:
    from transformers.pytorch_utils import Conv1D
    module.weight = nn.Parameter((w.t() if isinstance(module, Conv1D) else w).contiguous(), requires_grad=False)


def fisher_token_by_token(model, ids, name, quantized_weight, seed=0):
    """½ Σ_t (g_t · δy_t)² / T for one layer: labels sampled from the float model with the same generator sequence as
    the implementation (one window at a time), g_t the gradient of the sampled labels' summed log-loss at the
    layer's output (autograd on that output tensor, kept with retain_grad), δy_t = (Q(W) − W) x_t one token at a
    time in float64."""
    from compress.nn import linear_weight

    gen = torch.Generator().manual_seed(seed)
    module = model.get_submodule(name)
    w = linear_weight(module).detach().double()
    delta = quantized_weight.double() - w
    total = 0.0
    for k in range(ids.shape[0]):
        seen = {}

        def hook(_m, args, output):
            seen["x"] = args[0].detach()
            output.retain_grad()
            seen["y"] = output

        h = module.register_forward_hook(hook)
        embed_h = model.get_input_embeddings().register_forward_hook(lambda _m, _a, out: out.requires_grad_())
        try:
            logits = model(input_ids=ids[k:k + 1], use_cache=False).logits.float()
            labels = torch.multinomial(torch.softmax(logits[0].detach(), -1), 1, generator=gen).reshape(-1)
            nn.functional.cross_entropy(logits[0], labels, reduction="sum").backward()
        finally:
            h.remove()
            embed_h.remove()
        x, g = seen["x"][0].double(), seen["y"].grad[0].double()  # [T, in], [T, out]
        for t in range(x.shape[0]):
            dy = delta @ x[t]
            total += 0.5 * float(g[t] @ dy) ** 2
    return total / ids.numel()


@torch.no_grad()
def kl_with_weight_replaced(model, ids, name, quantized_weight):
    """KL(float ‖ a copy of the model whose layer `name` holds `quantized_weight`), mean per token."""
    other = copy.deepcopy(model)
    _set_weight(other.get_submodule(name), quantized_weight.float())
    total = 0.0
    for k in range(ids.shape[0]):
        p = torch.log_softmax(model(input_ids=ids[k:k + 1], use_cache=False).logits.double(), -1)
        q = torch.log_softmax(other(input_ids=ids[k:k + 1], use_cache=False).logits.double(), -1)
        total += float((p.exp() * (p - q)).sum())
    return total / ids.numel()
