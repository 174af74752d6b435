"""Plain references for mixed precision (compress/precision/mixed.py), written for clarity, not speed: the knapsack by
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
    from compress.core.nn import linear_weight

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


def awq_layer_reference(x, w, scheme, scaled, clip, n_grid=20, clip_grid=20, max_shrink=0.5):
    """AWQ on one layer alone, plainly, from every input row x [T, K] in float64: s = mean|x|^r / sqrt(max·min) for
    r = 0, 1/(n_grid−1), ..., 1, keeping the first r with the least Σ_t ‖(Q(W·s)/s − W) x_t‖² (Q round-to-nearest);
    then for every (row, group) the first shrink factor f = 1 − step/clip_grid of its range [min, max] (both
    shrunk towards 0) with the least Σ_t (q·x_t − w·x_t)² over that group's inputs. Returns (clipped W·s, s or
    None, W·s unclipped, the chosen factors f [rows, groups] or None)."""
    from compress.quantizers.rtn import fake_quantize

    x, w = x.double(), w.double()
    s = None
    if scaled:
        mean = x.abs().mean(0)
        best = math.inf
        for k in range(n_grid):
            cand = mean ** (k / (n_grid - 1))
            cand = cand.clamp(min=1e-4)
            cand = cand / math.sqrt(float(cand.max()) * float(cand.min()))
            err = fake_quantize((w * cand).float(), scheme).double() / cand - w
            loss = float(((x @ err.t()) ** 2).sum())
            if loss < best:
                best, s = loss, cand
    ws = w if s is None else w * s
    xs = x if s is None else x / s
    factors = None
    if clip:
        g = scheme.group_size if scheme.granularity == "group" else w.shape[1]
        out = ws.clone()
        factors = torch.ones(ws.shape[0], ws.shape[1] // g, dtype=torch.float64)
        for r in range(ws.shape[0]):
            for c0 in range(0, ws.shape[1], g):
                row, xg = ws[r, c0:c0 + g], xs[:, c0:c0 + g]
                hi0, lo0 = max(float(row.max()), 0.0), min(float(row.min()), 0.0)
                if scheme.symmetric:
                    hi0 = float(row.abs().max())
                    lo0 = -hi0
                best = (math.inf, None)
                for step in range(int(max_shrink * clip_grid)):
                    f = 1 - step / clip_grid
                    cl = row.clamp(lo0 * f, hi0 * f)
                    full = ws[r].clone()
                    full[c0:c0 + g] = cl
                    q = fake_quantize(full[None].float(), scheme).double()[0, c0:c0 + g]
                    err = float(((xg @ q - xg @ row) ** 2).sum())
                    if err < best[0]:
                        best = (err, cl, f)
                out[r, c0:c0 + g] = best[1]
                factors[r, c0 // g] = best[2]
        return out, s, ws, factors
    return ws, s, ws, factors
