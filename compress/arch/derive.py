"""AWQ scaling pairs derived from a decoder block's structure, for families without a table entry.

A scaling pair (arch/tables.py) is an op with per-channel outputs (a norm, a linear) and the linears that read
them: dividing the op's outputs by s and multiplying the linears' input columns by s leaves the model's function
unchanged. Where a family has no table entry, the pairs are found on its tiny model (arch/tiny.py: same config
class, small sizes), by running it once with a hook on every module of every block:

- direct pairs: a linear whose input is the output of a norm or linear of the block (the same tensor, or its rows:
  a MoE expert reads the rows routed to it) reads that op; all the linears reading one op form one pair (input norm
  -> q/k/v; post-attention norm -> gate/up, or -> every expert's gate/up and a shared expert's, the router's input
  columns following in float as for the table's MoE families);
- pairs through an op that passes per-channel scales on (v -> o through attention, up -> down through the gated
  activation, an expert's up -> down): for a linear that reads no norm or linear directly, each earlier linear
  beside it with as many outputs as it has inputs, latest first.

Every candidate is then CHECKED on the tiny model before it is used: its scales (a random positive vector) are
folded as AWQ folds them, into every block it applies to, and the model's logits must not move beyond float
rounding (and must move when only the linears' columns are scaled, so that the check saw the pair at all). A pair
through a q/k norm, a GELU, a clamp, or a norm whose output the residual also reads fails and is not used; the
reason goes into the spec's `awq_skip`, and from there into `compress inspect` and the run's report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from .moe import ROUTER_NAMES, ExpertLinears, any_expert
from ..core.nn import is_linear
from .tiny import VOCAB, tiny_config, tiny_model

NOT_PRESERVING = ("not function-preserving: folding random scales into it changes the tiny model's logits by "
                  "{moved:.1e} of their range (an op between them that does not commute with per-channel scales: a "
                  "norm, a GELU, a clamp, an offset, or another reader of its output)")
PRESERVED = 1e-4  # max |logits change| / max |logits| within which scaling counts as float rounding
SEEN = 1e-3  # ... and beyond which scaling the linears' columns alone counts as a change the check can see
NO_CLIP_LEAVES = ("q_proj", "k_proj", "query", "key", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack")


@dataclass(frozen=True)
class Derived:
    """What the structure of a family's blocks gives: its pairs, the pairs it cannot use (with why), the norms'
    offset (1 where they compute x * (1 + weight)), the linears the clipping search leaves alone (q/k)."""

    awq: tuple[tuple[str, tuple[str, ...], str], ...]
    awq_skip: tuple[tuple[str, str], ...]
    norm_offset: float
    no_clip: tuple[str, ...]


@dataclass
class _Call:
    order: int
    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    output: Tensor | None


def _first_tensor(value) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for v in value if (t := _first_tensor(v)) is not None), None)
    return None


def _input(call: _Call) -> Tensor | None:
    return _first_tensor(call.args) if call.args else _first_tensor(list(call.kwargs.values()))


def _record(model: nn.Module, blocks: nn.ModuleList, ids: Tensor) -> tuple[list[dict[str, _Call]], list]:
    """One forward with a hook on every module of every block: per block, each module's first call, and the
    block's input (its hidden states)."""
    calls: list[dict[str, _Call]] = [{} for _ in blocks]
    inputs: list = [None for _ in blocks]
    counter = [0]
    handles = []

    def block_input(i: int):
        def record(module, args, kwargs):
            if inputs[i] is None:
                inputs[i] = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
        return record

    def hook(i: int, name: str):
        def record(module, args, kwargs, output):
            counter[0] += 1
            calls[i].setdefault(name, _Call(counter[0], name, module, args, kwargs, _first_tensor(output)))
        return record

    try:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(block_input(i), with_kwargs=True))
            for name, m in block.named_modules():
                if name:
                    handles.append(m.register_forward_hook(hook(i, name), with_kwargs=True))
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls, inputs


def _is_norm(name: str, module: nn.Module) -> bool:
    leaf = name.rpartition(".")[2].lower()
    return not list(module.children()) and not is_linear(module) and (
        "norm" in type(module).__name__.lower() or "norm" in leaf or leaf.startswith("ln"))


def _rows_of(x: Tensor, y: Tensor) -> bool:
    """Whether x is y, or (flattened to rows of its last dimension) equal to y or made of y's rows: the tokens a
    router sent to one expert, or those rows each times a number (Llama 4 weighs a token by its router score before
    the expert: a per-token factor, which per-channel scales pass through)."""
    if x is y:
        return True
    if x.shape[-1] != y.shape[-1] or x.dtype != y.dtype or x.numel() == 0:
        return False
    a, b = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    if a.shape == b.shape and torch.equal(a, b):
        return True
    if a.shape[0] > b.shape[0] * 4:
        return False
    if bool((a[:, None, :] == b[None, :, :]).all(-1).any(-1).all()):
        return True
    # rows proportional to y's rows (the zero rows of tokens not routed here included)
    a, b = a.double(), b.double()
    nonzero = a.abs().amax(-1) > 0
    if not bool(nonzero.any()):
        return False
    unit_a = a[nonzero] / a[nonzero].norm(dim=-1, keepdim=True)
    unit_b = b / b.norm(dim=-1, keepdim=True).clamp(min=1e-300)
    cosine = (unit_a @ unit_b.T).abs().amax(-1)
    return bool((cosine > 1 - 1e-6).all())


def _routers(block: nn.Module) -> set[str]:
    """Names (relative to the block) of the routers beside each experts module, and everything inside them."""
    out = set()
    for name, m in block.named_modules():
        if isinstance(m, ExpertLinears):
            parent = name.rpartition(".")[0]
            for r in ROUTER_NAMES:
                path = f"{parent}.{r}" if parent else r
                if isinstance(getattr(block.get_submodule(parent) if parent else block, r, None), nn.Module):
                    out |= {path} | {f"{path}.{n}" for n, _ in block.get_submodule(path).named_modules() if n}
    return out


def _out_width(m: nn.Module) -> int | None:
    from ..core.nn import linear_shape
    return linear_shape(m)[0] if is_linear(m) else None


def _in_width(m: nn.Module) -> int:
    from ..core.nn import linear_shape
    return linear_shape(m)[1]


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _common(names) -> str:
    """The deepest module path above all of `names` ('' for the block itself)."""
    parts = [n.split(".") for n in names]
    out = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        out.append(column[0])
    return ".".join(out)


def _inspect(balance: tuple[str, ...], followers: list[str], called: set[str]) -> str:
    """The module whose output the scale search compares, for a norm's pair: the deepest module the block calls
    above its linears (and routers), so that the search sees them through the attention or the activation (a
    single linear directly in the block: itself)."""
    path = _common([*balance, *followers])
    if path in balance:
        path = _parent(path) or path
    while path and any_expert(path) not in {any_expert(c) for c in called}:
        path = _parent(path)
    return path


def _norm_offset(call: _Call) -> float | None:
    """o where the norm computes normalised(x) * (o + weight): from its output with weight 0 and weight 1. None
    when its output is not of that form."""
    m = call.module
    w = getattr(m, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 1:
        return None
    b = getattr(m, "bias", None)
    b = b if isinstance(b, Tensor) else None
    saved = [t.data.clone() for t in (w, b) if t is not None]
    try:
        with torch.no_grad():
            if b is not None:  # a LayerNorm's bias: divided by the scales as well (smoothing.scale_outputs)
                b.data.zero_()
            outs = []
            for value in (0.0, 1.0):
                w.data.fill_(value)
                outs.append(_first_tensor(m(*call.args, **call.kwargs)).float())
    finally:
        for t, v in zip((t for t in (w, b) if t is not None), saved):
            t.data.copy_(v)
    y0, y1 = outs
    unit = y1 - y0  # normalised(x)
    if float(unit.abs().max()) == 0:
        return None
    if float(y0.abs().max()) <= 1e-6 * float(unit.abs().max()):
        return 0.0
    offset = float((y0 * unit).sum() / (unit * unit).sum())
    return offset if torch.allclose(y0, offset * unit, rtol=1e-4, atol=1e-6) else None


class _Checker:
    """Folds a candidate pair's scales into every block of the tiny model it applies to, and compares logits."""

    def __init__(self, model: nn.Module, blocks: nn.ModuleList, ids: Tensor):
        self.model, self.blocks, self.ids = model, blocks, ids
        self.saved = [p.detach().clone() for p in model.parameters()]
        self.reference = self._logits()

    def _logits(self) -> Tensor:
        with torch.no_grad():
            return self.model(input_ids=self.ids, use_cache=False).logits.float()

    def _restore(self) -> None:
        with torch.no_grad():
            for p, s in zip(self.model.parameters(), self.saved):
                p.copy_(s)

    def change(self, pair, offset: float, prev_too: bool = True) -> float:
        """max |logits change| / max |logits| with the pair's scales folded (only the linears' columns scaled when
        not `prev_too`). Raises what folding raises (a previous op without per-channel weights)."""
        from .paths import block_pairs
        from ..core.fold import apply_smoothing, scale_inputs
        g = torch.Generator().manual_seed(0)
        try:
            applied = False
            for block in self.blocks:
                for prev, balance, _inspect_name, followers in block_pairs(block, (pair,)):
                    p = block.get_submodule(prev)
                    mods = [block.get_submodule(n) for n in (*balance, *followers)]
                    width = _out_width(p) if is_linear(p) else p.weight.shape[0]
                    s = torch.exp(torch.rand(width, generator=g) * 2 - 1)
                    if prev_too:
                        apply_smoothing(p, mods, s, 0.0 if is_linear(p) else offset)
                    else:
                        with torch.no_grad():
                            for m in mods:
                                scale_inputs(m, s)
                    applied = True
            if not applied:
                return math.nan
            out = self._logits()
            return float((out - self.reference).abs().max() / self.reference.abs().max().clamp(min=1e-30))
        finally:
            self._restore()

    def verdict(self, pair, offset: float) -> str | None:
        """None when the pair preserves the function (and the check could see it), else why not."""
        try:
            moved = self.change(pair, offset)
        except Exception as e:  # a previous op that has no per-channel weight to fold into, shapes that disagree
            return f"its scales cannot be folded ({type(e).__name__}: {e})"
        if math.isnan(moved):
            return "it applies to no block of the family's tiny model"
        if not moved <= PRESERVED:
            return NOT_PRESERVING.format(moved=moved)
        if not self.change(pair, offset, prev_too=False) > SEEN:
            return "the check cannot see it: the tiny model's logits do not depend on these linears"
        return None


def _label(prev: str, balance) -> str:
    return f"{prev} -> {', '.join(balance)}"


def derive_from_model(model: nn.Module, blocks_path: str) -> Derived:
    """The pairs of `model`, a tiny float32 model (eager attention, experts unfused), whose blocks are at
    `blocks_path`."""
    from .paths import get_module
    blocks = get_module(model, blocks_path)
    ids = torch.randint(0, min(VOCAB, model.get_input_embeddings().num_embeddings), (2, 24),
                        generator=torch.Generator().manual_seed(0))
    calls, block_inputs = _record(model, blocks, ids)
    checker = _Checker(model, blocks, ids)
    direct: dict[tuple, int] = {}  # (prev, balance, inspect) -> where it comes in the block's forward
    indirect: dict[str, tuple[int, list[tuple]]] = {}  # a linear -> (where, its candidate pairs, latest prev first)
    unread: dict[str, str] = {}  # a linear no pair can reach -> why
    offsets: dict[str, float | None] = {}
    for i, block in enumerate(blocks):
        seen = calls[i]
        routers = _routers(block)
        producers = sorted((c for n, c in seen.items() if n not in routers and c.output is not None and
                            (is_linear(c.module) or _is_norm(n, c.module))), key=lambda p: -p.order)
        readers: dict[str, list[str]] = {}
        followers: dict[str, list[str]] = {}
        for name, c in sorted(seen.items(), key=lambda kv: kv[1].order):
            router = name in routers and _parent(name) not in routers  # the router itself, not a part of it
            if not is_linear(c.module) and not router:
                continue
            x = _input(c)
            source = next((p for p in producers if p.order < c.order and p.name != name and x is not None
                           and _rows_of(x, p.output)), None)
            if router:
                if source is not None:
                    followers.setdefault(source.name, []).append(name)
                continue
            if name in routers:
                continue
            if source is not None:
                readers.setdefault(source.name, []).append(name)
                continue
            if x is not None and block_inputs[i] is not None and _rows_of(x, block_inputs[i]):
                unread.setdefault(any_expert(name), "it reads the block's input, the residual stream itself (no "
                                                    "norm before it): the block has no op to fold scales into")
                continue
            reshaped = next((p for p in producers if p.order < c.order and x is not None and p.output is not None
                             and p.output.numel() == x.numel() and torch.equal(p.output.flatten(), x.flatten())),
                            None)
            if reshaped is not None:
                unread.setdefault(any_expert(name), (
                    f"it reads {any_expert(reshaped.name)}'s output reshaped ({reshaped.output.shape[-1]} channels "
                    f"per row there, {x.shape[-1]} here: a norm over each head), so one per-channel scale cannot "
                    "be folded into both"))
                continue
            before = [p for p in producers if is_linear(p.module) and p.order < c.order and
                      _parent(any_expert(p.name)) == _parent(any_expert(name)) and
                      _out_width(p.module) == _in_width(c.module)]
            if not before:
                unread.setdefault(any_expert(name), (
                    "it reads no norm's or linear's output (the residual stream, or an op without per-channel "
                    "weights), and no linear beside it has as many outputs as it has inputs (fused projections, "
                    "grouped heads)"))
                continue
            tries = indirect.setdefault(any_expert(name), (c.order + 1000 * i, []))[1]
            tries += [p for p in ((any_expert(p.name), (any_expert(name),), any_expert(name)) for p in before)
                      if p not in tries]
        for prev, names in readers.items():
            balance = tuple(dict.fromkeys(any_expert(n) for n in names))
            routed = followers.get(prev, [])
            inspect = balance[0] if is_linear(seen[prev].module) and len(balance) == 1 and not routed else \
                _inspect(balance, routed, set(seen))
            direct.setdefault((any_expert(prev), balance, inspect), seen[prev].order + 1000 * i)
            if not is_linear(seen[prev].module):
                offsets.setdefault(any_expert(prev), _norm_offset(seen[prev]))

    # a block kind where some of an op's readers are not called (Gemma 4's KV-sharing layers leave k/v unused)
    # sees a part of the pair another kind sees whole: the whole pair covers it
    direct = {pair: order for pair, order in direct.items()
              if not any(o[0] == pair[0] and set(pair[1]) < set(o[1]) for o in direct)}
    known = [o for o in offsets.values() if o is not None]
    norm_offset = max(set(known), key=known.count) if known else 0.0
    steps = [(order, [pair]) for pair, order in direct.items()] + list(indirect.values())
    awq, skip = [], []
    for _, tries in sorted(steps, key=lambda step: step[0]):
        reasons = []
        for pair in tries:
            why = _unusable(pair[0], offsets, norm_offset, blocks[0]) or checker.verdict(pair, norm_offset)
            if why is None:
                awq.append(pair)
                break
            reasons.append((pair, why))
        else:
            if len(tries) == 1:
                skip.append((_label(*tries[0][:2]), reasons[0][1]))
            else:
                short = "; ".join(f"{p[0]}: {why.split(' (an op between')[0]}" for p, why in reasons)
                skip.append((f"-> {tries[0][1][0]}", "no linear before it passes per-channel scales on to it (a "
                             "norm, a GELU, a clamp or an offset between them); tried " + short))
    grouped: dict[tuple[str, str], list[str]] = {}  # linears beside each other that miss a pair for one reason
    for name, why in unread.items():
        grouped.setdefault((_parent(name), why), []).append(name)
    skip += [(f"-> {', '.join(names)}", why) for (_, why), names in grouped.items()]
    no_clip = tuple(dict.fromkeys(b for _, balance, _ in awq for b in balance
                                  if b.rpartition(".")[2] in NO_CLIP_LEAVES))
    return Derived(tuple(awq), tuple(skip), norm_offset, no_clip)


def _unusable(prev: str, offsets: dict, norm_offset: float, block: nn.Module) -> str | None:
    """Why a norm cannot be a pair's previous op, before any check: it has no weight, or computes x * (o + weight)
    with another o than the family's other norms (the spec holds one norm_offset)."""
    if prev not in offsets:
        return None
    if offsets[prev] is None:
        w = getattr(block.get_submodule(prev), "weight", None) if "*" not in prev and _has_path(block, prev) else 0
        if not isinstance(w, Tensor):
            return f"{prev} has no per-channel weight to fold the scales into"
        return f"{prev}'s output is not normalised(x) * (offset + weight)"
    if abs(offsets[prev] - norm_offset) > 1e-6:
        return (f"{prev} computes normalised(x) * ({offsets[prev]:g} + weight), the family's other norms "
                f"normalised(x) * ({norm_offset:g} + weight); one offset is folded per family")
    return None


def _has_path(block: nn.Module, path: str) -> bool:
    from .paths import resolve
    return bool(resolve(block, path))


def derive(model: nn.Module, find_blocks: Callable[[nn.Module], str]) -> Derived:
    """The pairs of `model`'s family, found and checked on its tiny model (built from its config with small
    sizes; the real weights are never needed, so a meta-device or streamed model works as well). `find_blocks`
    gives the path of a model's decoder blocks (the generic spec's search: arch._generic). Raises what building or
    running the tiny model raises."""
    key = (type(model).__name__, model.config.to_json_string(use_diff=False))
    if key not in _DERIVED:
        with torch.random.fork_rng(devices=[]):  # leave the caller's random stream as it was
            config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            tiny = tiny_model(tiny_config(config))
            _DERIVED[key] = derive_from_model(tiny, find_blocks(tiny))
        while len(_DERIVED) > 32:
            _DERIVED.pop(next(iter(_DERIVED)))
    return _DERIVED[key]


# derived pairs per (model class, config): get_arch is called many times for one model
_DERIVED: dict[tuple, Derived] = {}
