"""Mixed precision under a byte budget: how much each layer suffers under each scheme of a menu (its sensitivity),
and the choice of one scheme per layer that minimises the summed sensitivity within the bytes (a multiple-choice
knapsack, solved exactly by dynamic programming over the bytes).

Sensitivities (sensitivity.measure_sensitivity), each the cost of quantizing one layer alone, by round-to-nearest
or, with `error_method="gptq"`, by GPTQ: each layer's weight error Q(W) − W is then GPTQ's on the float model's inputs to that
layer (their Hessian accumulated over the same windows, a memory-bounded group of layers per pass), so a layer that
GPTQ repairs well looks cheap where round-to-nearest made it look expensive; with `awq_rtn` / `awq_gptq`, AWQ's
activation-aware scale and clipping search runs on each layer first (imitating the recipe's awq stage), so the
costs are those of the recipe's own quantizer chain. (AWQ+GPTQ and AutoRound runs repair
layers unevenly; a knapsack on round-to-nearest costs then mis-ranks them. The sequential effect, each layer seeing
the already quantized layers' outputs, is left out.)

- `fisher` (default): the second-order KL the layer's output error causes at the model's output,
  ½ Σ_t (g_t · δy_t)² / T, with δy_t = (Q(W) − W) x_t the layer's output error at position t and g_t the gradient,
  at the layer's output, of the window's log-likelihood of labels *sampled from the model's own prediction*. With
  sampled labels E[g_t g_tᵀ] is the Fisher of the output distribution with respect to y_t, so each term estimates
  without bias the KL(float ‖ quantized) (nats per token, to second order: what `compress run` measures afterwards,
  in the same units) that perturbing position t alone causes; the interaction of the errors at different positions
  of a window is left out. One forward and one backward per window, no weight gradients.
- `output_error`: the layer's relative output error Σ‖δy‖² / Σ‖y‖² (the input-Hessian proxy tr(ΔW H ΔWᵀ) over the
  layer's output energy): no backward, but blind to how much the rest of the network amplifies or hides the error;
  measured in the same pass, and reported beside `fisher` for comparison.
- `kl`: the measured KL(float ‖ quantized) of the model's next-token distribution with only that layer quantized:
  one forward of every window per layer and scheme (the most faithful and by far the slowest; the reference the
  proxies are compared with).

The fisher pass runs one decoder block at a time (fisher_blocks.py: memory bounded by a block, also for a model
streamed from disk) wherever the family's final hidden states go only through the final norm and the head; the
whole-model pass below (fisher_pass) is kept for the others and as the reference the tests compare it with.

The knapsack assumes the layers' costs add up (each was measured with the others in float); the report shows the
sum it predicted beside the KL measured on the whole quantized model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from ..core.nn import linear_weight
from ..core.primitives import shrink_range
from ..core.qtensor import QuantizedTensor
from ..quantizers.rtn import quantize_rtn
from ..core.scheme import QuantScheme

FLOAT = "float"  # the menu option of keeping a layer's weight in float (bfloat16 bytes)
FLOAT_BYTES = 2
SENSITIVITIES = ("fisher", "output_error", "kl")
ERROR_METHODS = ("rtn", "gptq", "awq_rtn", "awq_gptq")  # whose weight error Q(W) - W a sensitivity measures
HESSIAN_BUDGET = 2 * 2 ** 30  # bytes of input Hessians (float32 [in, in] per layer) one pass accumulates


@dataclass
class Sensitivity:
    """Per layer (rows) and menu option (columns): the stored weight bytes and the costs of each kind measured.
    An option a layer cannot take (a group size that does not divide it) has bytes -1 and cost inf."""

    layers: list[str]
    options: list[str]  # scheme names, FLOAT last when offered
    nbytes: np.ndarray  # int64 [L, S]
    costs: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> float64 [L, S]
    tokens: int = 0
    driver: str = "model"  # how the fisher pass ran: block by block (blocks) or whole-model (model)

    def to_dict(self) -> dict:
        return {"layers": self.layers, "options": self.options, "bytes": self.nbytes.tolist(), "tokens": self.tokens,
                "costs": {k: [[None if not math.isfinite(v) else float(v) for v in row] for row in c.tolist()]
                          for k, c in self.costs.items()}}


def option_name(option: QuantScheme | None) -> str:
    return FLOAT if option is None else option.name


def fits(w_shape: tuple[int, int], scheme: QuantScheme) -> bool:
    """Whether a [out, in] weight is a whole number of the scheme's groups (or blocks)."""
    if scheme.granularity == "group":
        return w_shape[1] % scheme.group_size == 0
    if scheme.granularity == "block":
        return w_shape[0] % scheme.group_size == 0 and w_shape[1] % scheme.group_size == 0
    return True


def weight_error(w: Tensor, option: QuantScheme | None) -> tuple[Tensor | None, int]:
    """(Q(W) − W by round-to-nearest, or None for float, the stored bytes of the option) for a float32 weight."""
    if option is None:
        return None, w.numel() * FLOAT_BYTES
    qt = quantize_rtn(w, option)
    return qt.dequantize(torch.float32) - w, qt.nbytes


@dataclass(frozen=True)
class AWQModel:
    """How error_methods awq_rtn and awq_gptq imitate the recipe's `awq` stage one layer at a time: which layers a
    scaling pair scales the input of (`scaled`: full names; a pair AWQ skips, e.g. under grouped-query attention,
    scales none), which it leaves unclipped (`no_clip`), and the stage's search settings."""

    scaled: frozenset = frozenset()
    no_clip: frozenset = frozenset()
    n_grid: int = 20
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    clip_to: str = "weights"  # the stage's: clamp the weights, or (grid, with GPTQ) only GPTQ's grid


@dataclass
class _Inputs:
    """What one pass gathers of a layer's float inputs: H = Σ x xᵀ, Σ |x| per channel, rows kept for clipping."""

    hessian: Tensor | None = None
    abs_sum: Tensor | None = None
    count: int = 0
    rows: list = field(default_factory=list)


def awq_weight(w: Tensor, inputs: _Inputs, option: QuantScheme, scaled: bool, clip: bool,
               awq: AWQModel) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """AWQ on one layer alone, for the sensitivities: (the weight in the scaled basis W·diag(s), s or None, the
    clipping's range factors [rows, groups] or None).
    s = mean|x|^r over r in a grid of awq.n_grid (quantizers/awq.py's candidates), the r whose round-to-nearest
    error has the least output error tr(E H Eᵀ) on these inputs (r = 0, no scaling, is a candidate); then AWQ's
    clipping search on the kept input rows. The stage searches a pair's layers together, on the output of the
    module that reads them; this searches each layer for itself (a layer measured alone, as every sensitivity is)."""
    from ..quantizers.awq import candidate_scales, clip_factor, search_clip
    from ..quantizers.rtn import fake_quantize
    s = None
    if scaled:
        x_mean = inputs.abs_sum / max(inputs.count, 1)
        best = math.inf
        for ratio in torch.linspace(0, 1, awq.n_grid).tolist():
            cand = candidate_scales(x_mean, None, ratio)
            e = fake_quantize(w * cand, option) / cand - w
            loss = float(((e @ inputs.hessian) * e).sum())
            if loss < best:
                best, s = loss, cand
    ws = w if s is None else w * s
    factor = None
    if clip and option.granularity != "tensor":
        x = torch.cat(inputs.rows)
        x = x[:: max(1, x.shape[0] // awq.clip_tokens)][: awq.clip_tokens]
        lo, hi = search_clip(ws, x if s is None else x / s, option, awq.clip_grid, awq.max_shrink)
        factor = clip_factor(ws, lo, hi, option)
    return ws, s, factor


def _groups(layers: dict[int, tuple[str, nn.Module]], hessian_budget: int) -> list[list[int]]:
    """The layers in consecutive groups whose float32 input Hessians together fit `hessian_budget` bytes."""
    groups, cur, used = [], [], 0
    for i, (_name, module) in layers.items():
        size = linear_weight(module).shape[1] ** 2 * 4
        if cur and used + size > hessian_budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += size
    return groups + [cur] if cur else groups


@torch.no_grad()
def solve_layers(forward, layers: dict[int, tuple[str, nn.Module]], menu, nbytes: np.ndarray, tokens: int,
                 method: str = "gptq", awq: AWQModel | None = None, hessian_budget: int = HESSIAN_BUDGET,
                 on_solved=None) -> dict[tuple[int, int], tuple[QuantizedTensor, Tensor | None]]:
    """Every (layer, option)'s quantized weight as `method` leaves it, from the layers' float inputs in one or more
    calls of `forward()` (which runs the Hessian windows, `tokens` tokens, through the whole model or through the
    block that holds `layers`: {row of nbytes: (name, module)}): gptq (GPTQ with H = Σ x xᵀ; its solution does not
    depend on H's scale), awq_rtn (awq_weight then round-to-nearest) or awq_gptq (awq_weight then GPTQ with the
    scaled inputs' Hessian diag(s)⁻¹ H diag(s)⁻¹). Each value is (the quantized weight in the scaled basis, s or
    None): the layer computes x (Q/s)ᵀ. The layers are taken in groups whose Hessians fit `hessian_budget` bytes,
    one `forward()` per group, so memory stays bounded; the solutions are kept quantized (their codes and scales:
    the menu's stored bytes summed, about 2.5 bytes per weight for auto_precision's default menu, plus s).
    `on_solved()` is called after each layer."""
    from ..quantizers.gptq import quantize_gptq
    awq = awq or AWQModel()
    smooth = method.startswith("awq")
    stride = max(1, tokens // awq.clip_tokens)  # rows kept per window for the clipping search
    out = {}
    for group in _groups(layers, hessian_budget):
        seen = {i: _Inputs() for i in group}

        def attach(i: int):
            def hook(_m, args, _output):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                acc = seen[i]
                acc.hessian = x.t() @ x if acc.hessian is None else acc.hessian.addmm_(x.t(), x)
                if smooth:
                    a = x.abs().sum(0)
                    acc.abs_sum = a if acc.abs_sum is None else acc.abs_sum + a
                    acc.count += x.shape[0]
                    acc.rows.append(x[::stride].clone())
            return layers[i][1].register_forward_hook(hook)

        handles = [attach(i) for i in group]
        try:
            forward()
        finally:
            for h in handles:
                h.remove()
        for i in group:
            name, module = layers[i]
            w = linear_weight(module).detach().float()
            for j, option in enumerate(menu):
                if option is None or nbytes[i, j] < 0:
                    continue
                if not smooth:
                    out[i, j] = quantize_gptq(w, seen[i].hessian, option, name=name), None
                    continue
                ws, s, factor = awq_weight(w, seen[i], option, name in awq.scaled,
                                           awq.clip and name not in awq.no_clip, awq)
                grid = method == "awq_gptq" and awq.clip_to == "grid"
                if factor is not None and not grid:
                    ws = shrink_range(ws, factor, option)
                if method == "awq_rtn":
                    out[i, j] = quantize_rtn(ws, option), s
                else:
                    h = seen[i].hessian if s is None else seen[i].hessian / (s[:, None] * s[None, :])
                    out[i, j] = quantize_gptq(ws, h, option, name=name, clip=factor if grid else None), s
            seen[i] = None
            if on_solved is not None:
                on_solved()
    return out


def solved_error(solved: dict) -> Callable[[int, int, Tensor], Tensor]:
    """The weight error Q(W) − W of solve_layers' solutions, in the layer's own basis (Q/s − W)."""
    def error(i: int, j: int, w: Tensor) -> Tensor:
        q, s = solved[i, j]
        q = q.dequantize(torch.float32)
        return (q if s is None else q / s) - w
    return error


def rtn_error(menu) -> Callable[[int, int, Tensor], Tensor]:
    def error(_i: int, j: int, w: Tensor) -> Tensor:
        return weight_error(w, menu[j])[0]
    return error


def scheme_bytes(shape: tuple[int, int], scheme: QuantScheme) -> int:
    """Stored bytes of a [out, in] weight in `scheme` (codes, scales, zero points), from an all-zero weight."""
    return quantize_rtn(torch.zeros(shape), scheme).nbytes


class FisherSums:
    """The sums a fisher pass accumulates, per layer (rows) and option: ½ Σ_t (g_t · δy_t)² (fisher), Σ ‖δy_t‖²
    (output error) and each layer's Σ ‖y_t‖²; `attach` hooks a layer so that its forward and backward add to them."""

    def __init__(self, nbytes: np.ndarray, menu):
        self.nbytes, self.menu = nbytes, menu
        self.fisher = np.zeros(nbytes.shape)
        self.err = np.zeros(nbytes.shape)
        self.energy = np.zeros(nbytes.shape[0])

    def attach(self, i: int, module: nn.Module, error) -> torch.utils.hooks.RemovableHandle:
        """Layer i's forward hook: every option's output error δy = x (Q(W) − W)ᵀ, `error(i, j, W)`, and a hook on
        the output's gradient g (when it has one) that adds ½ Σ_t (g_t · δy_t)²."""
        def hook(_m, args, output):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [T, in]
            y = output if isinstance(output, Tensor) else output[0]
            self.energy[i] += float(y.detach().float().pow(2).sum())
            deltas = []
            w = linear_weight(module).detach().float()
            for j, option in enumerate(self.menu):
                if option is None or self.nbytes[i, j] < 0:
                    deltas.append(None)
                    continue
                d = x @ error(i, j, w).t()  # [T, out]
                self.err[i, j] += float(d.pow(2).sum())
                deltas.append(d)

            def grad_hook(g):
                g = g.detach().float().reshape(-1, g.shape[-1])  # [T, out]
                for j, d in enumerate(deltas):
                    if d is not None:
                        self.fisher[i, j] += 0.5 * float((g * d).sum(-1).pow(2).sum())

            if y.requires_grad:
                y.register_hook(grad_hook)
        return module.register_forward_hook(hook)

    def costs(self, tokens: int) -> dict[str, np.ndarray]:
        """{fisher: nats per token, output_error: relative}; inf where an option does not fit, 0 for float."""
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = self.err / np.maximum(self.energy, 1e-30)[:, None]
        fisher = self.fisher / tokens
        for arr in (fisher, rel):
            arr[self.nbytes < 0] = math.inf
            for j, option in enumerate(self.menu):
                if option is None:
                    arr[:, j] = 0.0
        return {"fisher": fisher, "output_error": rel}


def sample_labels(logits: Tensor, gen: torch.Generator) -> Tensor:
    """One label per position [T] drawn from the model's own prediction (logits [T, V]): with them the squared
    gradient of the log-likelihood is, in expectation, the Fisher of the output distribution."""
    with torch.no_grad():
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).reshape(-1)


def fisher_pass(model: nn.Module, windows: Tensor, modules: dict[str, nn.Module], menu, nbytes: np.ndarray,
                 seed: int, progress, error) -> dict[str, np.ndarray]:
    """One whole-model forward and backward per window with labels sampled from the model's prediction, every
    planned linear hooked (FisherSums)."""
    sums = FisherSums(nbytes, menu)
    gen = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings()
    handles = [embed.register_forward_hook(lambda _m, _a, out: out.requires_grad_())]
    handles += [sums.attach(i, m, error) for i, m in enumerate(modules.values())]
    params = [p for p in model.parameters()]
    grads = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        for k in range(windows.shape[0]):
            ids = windows[k:k + 1]
            logits = model(input_ids=ids, use_cache=False).logits.float()  # [1, T, V]
            labels = sample_labels(logits[0], gen)
            loss = nn.functional.cross_entropy(logits[0], labels, reduction="sum")
            loss.backward()
            if progress is not None:
                progress("fisher windows", k + 1, windows.shape[0])
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, grads):
            p.requires_grad_(g)
    return sums.costs(windows.numel())


@torch.no_grad()
def measured_kl(model: nn.Module, windows: Tensor, modules: dict[str, nn.Module], menu, nbytes: np.ndarray,
                 progress, error) -> np.ndarray:
    """KL(float ‖ model with one layer quantized), mean over the windows' tokens, for every layer and option. The
    layer's output gets its error x (Q(W) − W)ᵀ added by a hook: no weight is changed, so a head that shares its
    matrix with the embedding is quantized as a head only."""
    ref = [torch.log_softmax(model(input_ids=windows[k:k + 1], use_cache=False).logits.double(), -1)
           for k in range(windows.shape[0])]
    out = np.zeros(nbytes.shape)
    steps, done = int(sum(1 for o in menu if o is not None) * len(modules)), 0
    for i, module in enumerate(modules.values()):
        w = linear_weight(module).detach().float()
        for j, option in enumerate(menu):
            if option is None:
                continue
            if nbytes[i, j] < 0:
                out[i, j] = math.inf
                continue
            delta = error(i, j, w)

            def add_error(_m, args, output, delta=delta):
                return output + (args[0].float() @ delta.t()).to(output.dtype)

            handle = module.register_forward_hook(add_error)
            try:
                total = 0.0
                for k in range(windows.shape[0]):
                    lq = torch.log_softmax(model(input_ids=windows[k:k + 1], use_cache=False).logits.double(), -1)
                    total += float((ref[k].exp() * (ref[k] - lq)).sum())
            finally:
                handle.remove()
            out[i, j] = total / windows.numel()
            done += 1
            if progress is not None:
                progress("kl layer × option", done, steps)
    return out


# ---------------------------------------------------------------- the choice

def option_bytes(shapes: list[tuple[int, int]], menu) -> np.ndarray:
    """int64 [L, S]: the stored bytes of each [out, in] weight under each option (None = float), -1 where the
    option cannot hold it."""
    nbytes = np.full((len(shapes), len(menu)), -1, dtype=np.int64)
    for i, shape in enumerate(shapes):
        for j, o in enumerate(menu):
            if o is None:
                nbytes[i, j] = shape[0] * shape[1] * FLOAT_BYTES
            elif fits(shape, o):
                nbytes[i, j] = scheme_bytes(shape, o)
    return nbytes


def budget_problem(nbytes: np.ndarray, budget: int, costs: np.ndarray | None = None) -> str | None:
    """Why no choice of options fits `budget` bytes (None when one does): a layer no option holds, or a budget below
    the narrowest option of every layer."""
    ok = nbytes >= 0 if costs is None else (nbytes >= 0) & np.isfinite(costs)
    if not ok.any(axis=1).all():
        bad = int(np.flatnonzero(~ok.any(axis=1))[0])
        return f"layer {bad} can take none of the menu's options; add an option that fits it"
    smallest = int(np.where(ok, nbytes, np.iinfo(np.int64).max).min(axis=1).sum())
    if smallest > budget:
        return (f"the budget of {budget} bytes is below the smallest the menu allows ({smallest} bytes: the "
                "narrowest option for every layer); raise the budget or add a narrower scheme to the menu")
    return None


def choose(costs: np.ndarray, nbytes: np.ndarray, budget: int, resolution: int | None = None) -> list[int]:
    """One option per layer minimising Σ costs[l, c_l] subject to Σ nbytes[l, c_l] <= budget (bytes).

    Dynamic programming over the bytes in `resolution` units of budget / resolution each, every option's bytes
    rounded *up* to whole units, so the choice always fits the budget exactly and is optimal for the rounded sizes
    (default resolution 100 × layers: at most 1% of the budget lost to rounding). Options with bytes < 0 or an
    infinite cost are unavailable. Raises ValueError when even the smallest option of every layer does not fit."""
    costs, nbytes = np.asarray(costs, dtype=np.float64), np.asarray(nbytes, dtype=np.int64)
    n_layers, n_opts = costs.shape
    ok = (nbytes >= 0) & np.isfinite(costs)
    if (why := budget_problem(nbytes, budget, costs)) is not None:
        raise ValueError(why)
    units = resolution or min(max(4096, 100 * n_layers), 200_000)
    unit = budget / units
    size = np.where(ok, np.ceil(nbytes / unit - 1e-9).astype(np.int64), units + 1)  # [L, S] units
    size = np.clip(size, 0, units + 1)
    inf = math.inf
    best = np.zeros(units + 1)  # best[u]: least cost of the layers so far within u units
    pick = np.zeros((n_layers, units + 1), dtype=np.int16)
    for layer in range(n_layers):
        new = np.full(units + 1, inf)
        for opt in range(n_opts):
            s = int(size[layer, opt])
            if not ok[layer, opt] or s > units:
                continue
            cand = np.full(units + 1, inf)
            cand[s:] = best[:units + 1 - s] + costs[layer, opt]
            better = cand < new
            new[better] = cand[better]
            pick[layer, better] = opt
        best = new
    if not math.isfinite(best[units]):
        raise ValueError(f"no choice fits {budget} bytes at this resolution; raise the budget slightly")
    u, chosen = units, [0] * n_layers
    for layer in range(n_layers - 1, -1, -1):
        chosen[layer] = int(pick[layer, u])
        u -= int(size[layer, chosen[layer]])
    return chosen


def grouped(costs: np.ndarray, nbytes: np.ndarray, groups: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[G, S] costs and bytes of layer groups that take one option together: the sums over each group's layers, an
    option unavailable (bytes -1) where it cannot hold one of them."""
    costs, nbytes = np.asarray(costs, dtype=np.float64), np.asarray(nbytes, dtype=np.int64)
    g_costs = np.stack([costs[g].sum(0) for g in groups])
    g_bytes = np.stack([np.where((nbytes[g] < 0).any(0), -1, nbytes[g].sum(0)) for g in groups])
    return g_costs, g_bytes


def choose_grouped(costs: np.ndarray, nbytes: np.ndarray, budget: int, groups: list[list[int]],
                   resolution: int | None = None) -> list[int]:
    """`choose` with the layers of each group (indices into the rows) given one option together: the knapsack runs
    over groups, each costing the sum of its layers."""
    g_costs, g_bytes = grouped(costs, nbytes, groups)
    picked = choose(g_costs, g_bytes, budget, resolution)
    out = [0] * len(costs)
    for group, p in zip(groups, picked):
        for i in group:
            out[i] = p
    return out
