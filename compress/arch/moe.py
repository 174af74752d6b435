"""Mixture-of-experts blocks: fused expert tensors as one linear layer per expert projection.

transformers 5 stores a MoE block's experts as 3-D parameters in one module (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]; gpt-oss transposed, its gate and up interleaved, with biases). Nothing that looks
for linear layers sees them, so a quantizer would leave 90% of a MoE model in float without a word. `unfuse_experts`
replaces every such module by an `ExpertLinears`: one `nn.Linear` per expert and projection (`experts.{e}.gate_proj`,
`up_proj`, `down_proj`, the names of the per-expert checkpoints that vLLM loads and transformers' conversion mapping
merges back), whose weights are views of the fused tensors (no copy; gpt-oss's strided slices are copied, then the
fused tensors freed), and whose forward routes the tokens exactly as
the fused module's eager forward does. Every stage then treats an expert projection as the linear layer it is: it is
planned, quantized with the stage's scheme, calibrated on the tokens routed to it (the observer's hook on the
expert's linear sees only those), saved and reloaded under its own name.

The layout of a fused module is read from what transformers' `use_experts_implementation` records on it
(`has_gate`, `is_concatenated`, `is_transposed`, `has_bias`); a module without those attributes is recognised by the
generic rule (3-D `down_proj` and `gate_up_proj`/`up_proj` parameters whose shapes agree with the standard layout).
The routers (`gate`, `router`, Qwen2-MoE's `shared_expert_gate`) stay in float: `router_reason` says why.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ROUTER_NAMES = ("gate", "router", "shared_expert_gate")  # beside a MoE block's experts
EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")  # a layer of expert N: `...mlp.experts.N.gate_proj`
ROUTER_REASON = "router: it picks each token's experts, a top-k that a small weight error can flip"


@dataclass(frozen=True)
class ExpertLayout:
    """How one fused experts module stores its tensors."""

    experts: int
    has_gate: bool  # gate_up_proj (gated MLP) or up_proj alone
    concatenated: bool  # gate_up rows [gate; up] (True) or interleaved [g0, u0, g1, u1, ...]
    transposed: bool  # [E, in, out] (gpt-oss) instead of [E, out, in]
    bias: bool  # gate_up_proj_bias / down_proj_bias

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    def fused_names(self) -> tuple[str, ...]:
        names = (self.up_name, "down_proj")
        return names + tuple(f"{n}_bias" for n in names) if self.bias else names


def expert_layout(module: nn.Module) -> ExpertLayout | None:
    """The layout of a fused experts module, or None when `module` is not one. Raises ValueError for fused experts
    this module cannot represent (a post-expert norm)."""
    down = module._parameters.get("down_proj") if hasattr(module, "_parameters") else None
    if down is None or down.dim() != 3:
        return None
    has_gate = isinstance(module._parameters.get("gate_up_proj"), Tensor)
    up = module._parameters.get("gate_up_proj" if has_gate else "up_proj")
    if up is None or up.dim() != 3 or up.shape[0] != down.shape[0]:
        return None
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{type(module).__name__}: experts with a post-expert norm are not supported yet; leave "
                         "this model in float or add the norm to compress/arch/moe.py")
    width = 2 if has_gate else 1
    if hasattr(module, "is_transposed"):
        transposed = bool(module.is_transposed)
    else:  # the generic rule: [E, width*I, H] with down [E, H, I]; transposed [E, H, width*I] with down [E, I, H]
        standard = up.shape[1] == width * down.shape[2] and up.shape[2] == down.shape[1]
        flipped = up.shape[2] == width * down.shape[1] and up.shape[1] == down.shape[2]
        if standard == flipped:
            raise ValueError(f"{type(module).__name__}: cannot tell the layout of its expert tensors "
                             f"({tuple(up.shape)}, {tuple(down.shape)}); describe it in compress/arch/moe.py")
        transposed = flipped
    bias = isinstance(module._parameters.get("down_proj_bias"), Tensor)
    return ExpertLayout(int(down.shape[0]), has_gate, bool(getattr(module, "is_concatenated", True)), transposed, bias)


def split_expert(layout: ExpertLayout, fused: dict[str, Tensor], e: int) -> dict[str, Tensor]:
    """Expert `e`'s tensors (views) from a fused module's (`fused`: its fused_names -> tensor), under the names of
    an `Expert`: gate_proj.weight [I, H], up_proj.weight, down_proj.weight [H, I], and the biases."""
    up_w, down_w = fused[layout.up_name][e], fused["down_proj"][e]
    w = up_w.t() if layout.transposed else up_w  # [width*I, H]
    out = {"down_proj.weight": down_w.t() if layout.transposed else down_w}  # [H, I]
    b = fused[f"{layout.up_name}_bias"][e] if layout.bias else None
    if layout.bias:
        out["down_proj.bias"] = fused["down_proj_bias"][e]
    if layout.has_gate:
        half = w.shape[0] // 2
        gate, up = (slice(0, half), slice(half, None)) if layout.concatenated else (slice(0, None, 2), slice(1, None, 2))
        out |= {"gate_proj.weight": w[gate], "up_proj.weight": w[up]}
        if b is not None:
            out |= {"gate_proj.bias": b[gate], "up_proj.bias": b[up]}
    else:
        out["up_proj.weight"] = w
        if b is not None:
            out["up_proj.bias"] = b
    return out


class Expert(nn.Module):
    """One expert's projections as linear layers (gate_proj only for a gated MLP)."""

    def __init__(self, gate: nn.Linear | None, up: nn.Linear, down: nn.Linear):
        super().__init__()
        if gate is not None:
            self.gate_proj = gate
        self.up_proj, self.down_proj = up, down


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An nn.Linear whose weight (and bias) are the given tensors, [out, in]: shared where they are contiguous rows
    of the fused tensor; a strided slice (gpt-oss: transposed, gate and up interleaved) is copied contiguous, one
    expert at a time, so its matmuls run as a checkpoint read expert by expert would (streaming.py)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(weight if weight.is_contiguous() else weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias if bias.is_contiguous() else bias.contiguous(), requires_grad=False)
    return layer


# how a MoE block calls its fused experts module, by the names of the fused forward's arguments after the hidden
# states: with each token's chosen experts and their weights (most families), or with nothing else (Llama 4: the
# hidden states arrive stacked once per expert, [experts * tokens, hidden], each row already scaled by its router
# score, which is 0 where the expert was not chosen)
ROUTED = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"),
          ("selected_experts", "routing_weights"))
STACKED = ()


def expert_routing(module: nn.Module, name: str = "") -> tuple[str, ...]:
    """The routing arguments of a fused experts module's forward (one of ROUTED, or STACKED). Raises ValueError naming
    the module, the cause and the way out for a forward this module cannot reproduce."""
    params = list(inspect.signature(type(module).forward).parameters.values())[2:]  # after self, hidden_states
    names = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if names in ROUTED or names == STACKED:
        return names
    raise ValueError(f"{name or type(module).__name__}: {type(module).__name__}.forward takes {list(names)} besides "
                     "the hidden states, a routing compress/arch/moe.py does not reproduce (it knows the chosen experts "
                     "with their weights, or Llama 4's stacked rows); leave this model in float, or describe the "
                     "routing in compress/arch/moe.py (ExpertLinears.forward)")


class ExpertLinears(nn.ModuleList):
    """A fused experts module as one `Expert` per expert; same forward signature and result as the fused module's
    eager forward: (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], or for Llama 4's
    (`routing` STACKED) hidden_states [E * T, H] -> [E * T, H], where each expert computes only the rows routed to it
    (the others are zero rows, which a bias-free expert maps to zero): its calibration sees only its tokens."""

    def __init__(self, fused: nn.Module, layout: ExpertLayout, routing: tuple[str, ...] = ROUTED[0]):
        experts = []
        for e in range(layout.experts):
            t = split_expert(layout, {n: fused._parameters[n] for n in layout.fused_names()}, e)
            gate = _linear(t["gate_proj.weight"], t.get("gate_proj.bias")) if layout.has_gate else None
            experts.append(Expert(gate, _linear(t["up_proj.weight"], t.get("up_proj.bias")),
                                  _linear(t["down_proj.weight"], t.get("down_proj.bias"))))
        super().__init__(experts)
        self.layout, self.routing = layout, routing
        for name in layout.fused_names():  # the fused module keeps its activation and gating, not its tensors
            del fused._parameters[name]
        self.__dict__["_fused"] = fused  # not a submodule: it holds no tensors now, only act_fn and _apply_gate

    def _activate(self, gate: Tensor | None, up: Tensor) -> Tensor:
        fused = self._fused
        if gate is None:
            return fused.act_fn(up)
        if self.layout.concatenated:
            gate_up = torch.cat([gate, up], dim=-1)
        else:
            gate_up = torch.stack([gate, up], dim=-1).flatten(-2)
        apply = getattr(type(fused), "_apply_gate", None)
        if apply is None:  # transformers' default gating
            return fused.act_fn(gate) * up
        return apply(fused, gate_up)

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        given = dict(zip(self.routing, args)) | kwargs
        if len(args) > len(self.routing) or set(given) != set(self.routing):
            raise TypeError(f"{type(self._fused).__name__} (as ExpertLinears) takes hidden_states and "
                            f"{list(self.routing)}, got {len(args)} more positional and {sorted(kwargs)} by name")
        if self.routing == STACKED:
            return self._stacked(hidden_states)
        top_k_index, top_k_weights = (given[n] for n in self.routing)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.unique(top_k_index).tolist()
        for e in hit:
            if e == len(self):  # the expert-parallel sentinel, skipped as transformers' eager forward does
                continue
            if not 0 <= e < len(self):
                raise IndexError(f"the router chose expert {e} of {len(self)}: its rows and the experts disagree")
            token, pos = torch.where(top_k_index == e)
            y = self._expert(e, hidden_states[token])
            out.index_add_(0, token, (y * top_k_weights[token, pos, None]).to(out.dtype))
        return out

    def _expert(self, e: int, x: Tensor) -> Tensor:
        expert = self[e]
        gate = expert.gate_proj(x) if self.layout.has_gate else None
        return expert.down_proj(self._activate(gate, expert.up_proj(x)))

    def _stacked(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.view(len(self), -1, hidden_states.shape[-1])
        out = torch.zeros_like(x)
        for e in range(len(self)):
            with torch.no_grad():
                rows = torch.nonzero(x[e].ne(0).any(-1)).reshape(-1)  # the tokens routed to expert e
            if rows.numel():
                out[e].index_copy_(0, rows, self._expert(e, x[e, rows]).to(out.dtype))
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"experts={lay.experts}, from {type(self._fused).__name__} ({'gated' if lay.has_gate else 'ungated'}"
                f"{', interleaved' if lay.has_gate and not lay.concatenated else ''}"
                f"{', transposed' if lay.transposed else ''}{', biases' if lay.bias else ''})")


def unfuse_experts(model: nn.Module) -> list[str]:
    """Replace every fused experts module under `model` by an ExpertLinears (in place, weights shared); returns
    their names. A model without fused experts is left as it is."""
    found = []
    for name, module in list(model.named_modules()):
        if isinstance(module, ExpertLinears):
            continue
        layout = expert_layout(module)
        if layout is None:
            continue
        routing = expert_routing(module, name)
        if routing == STACKED and layout.bias:
            raise ValueError(f"{name}: {type(module).__name__} takes every token for every expert (its unrouted "
                             "rows zero) and has biases, which turn zero rows into outputs: computing only the routed "
                             "rows would change the model; leave this model in float, or route it in compress/arch/moe.py")
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, ExpertLinears(module, layout, routing))
        found.append(name)
    return found


def moe_blocks(model: nn.Module) -> dict[str, ExpertLinears]:
    """name -> ExpertLinears for every (unfused) experts module."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertLinears)}


def router_names(model: nn.Module) -> set[str]:
    """Full names of the routers: the modules named in ROUTER_NAMES beside an experts module."""
    out = set()
    for name in moe_blocks(model):
        parent = name.rpartition(".")[0]
        owner = model.get_submodule(parent) if parent else model
        out |= {f"{parent}.{r}" if parent else r for r in ROUTER_NAMES if isinstance(getattr(owner, r, None),
                                                                                     nn.Module)}
    return out


def any_expert(name: str) -> str:
    """`name` with its expert index replaced by `*` (model.layers.0.mlp.experts.*.gate_proj)."""
    return EXPERT.sub(lambda m: m.group(0).replace(m.group(1), "*"), name, count=1)


# ---------------------------------------------------------------- the names serving stacks load

_PROJECTION = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")


@dataclass(frozen=True)
class HubNames:
    """How a family's checkpoints on the hub (and transformers' `save_pretrained`, and vLLM's loaders) name what
    compress calls `experts.{e}.gate_proj` etc.: per-expert tensors under the family's own projection names
    (Mixtral `block_sparse_moe.experts.{e}.w1`; Qwen-MoE, OLMoE, DeepSeek `mlp.experts.{e}.gate_proj`), or the fused
    3-D tensors (`fused`: gpt-oss). Read from transformers' conversion mapping for the family, so it follows
    transformers rather than a table of ours."""

    projections: dict  # compress projection -> the checkpoint's (gate_proj -> w1)
    renamings: tuple  # transformers' reversed renamings (Mixtral: .mlp. -> .block_sparse_moe.)
    fused: bool  # the checkpoint stores the experts fused (no per-expert names exist for this family)

    def tensor(self, key: str) -> str:
        m = _PROJECTION.search(key)
        if m and m.group(2) in self.projections:
            key = key[:m.start(2)] + self.projections[m.group(2)] + key[m.end(2):]
        for r in self.renamings:
            key = r.rename_source_key(key)[0]
        return key

    def module(self, name: str) -> str:
        return self.tensor(name + ".weight")[:-len(".weight")]


def hub_names(model: nn.Module) -> HubNames:
    """The checkpoint names of `model`'s family (identity for a model without experts)."""
    if not moe_blocks(model):
        return HubNames({}, (), False)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    projections = {}
    for c in conversions:
        if not isinstance(c, WeightConverter):
            continue
        target = c.target_patterns[0]
        names = [m.group(1) for s in c.source_patterns if (m := re.search(r"\*\.([^.*]+)\.weight$", s))]
        if target.endswith("experts.gate_up_proj") and len(names) == 2:
            projections.update(gate_proj=names[0], up_proj=names[1])
        elif target.endswith("experts.up_proj") and len(names) == 1:
            projections["up_proj"] = names[0]
        elif target.endswith("experts.down_proj") and len(names) == 1:
            projections["down_proj"] = names[0]
    renamings = tuple(c.reverse_transform() for c in reversed(conversions) if type(c) is WeightRenaming)
    return HubNames(projections, renamings, fused=not projections)


def fuse_tensors(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Float per-expert tensors (`experts.{e}.gate_proj.weight`, ...) stacked back into each experts module's fused
    layout (gate_up_proj [E, 2I, H] or gpt-oss's transposed, interleaved one, with biases): for families whose
    checkpoints store them fused. Experts modules not (fully) among `tensors` are left as they are."""
    out = dict(tensors)
    for name, block in moe_blocks(model).items():
        lay = block.layout
        keys = [f"{name}.{e}.{p}.{leaf}" for e in range(lay.experts)
                for p in (("gate_proj", "up_proj", "down_proj") if lay.has_gate else ("up_proj", "down_proj"))
                for leaf in (("weight", "bias") if lay.bias else ("weight",))]
        if not all(k in out for k in keys):
            continue
        t = {k: out.pop(k) for k in keys}

        def stack(leaf: str, proj: str) -> Tensor:
            return torch.stack([t[f"{name}.{e}.{proj}.{leaf}"] for e in range(lay.experts)])

        for leaf, suffix in (("weight", ""), ("bias", "_bias")) if lay.bias else (("weight", ""),):
            if lay.has_gate:
                gate, up = stack(leaf, "gate_proj"), stack(leaf, "up_proj")  # [E, I, H] / [E, I]
                both = torch.cat([gate, up], dim=1) if lay.concatenated else \
                    torch.stack([gate, up], dim=2).flatten(1, 2)
            else:
                both = stack(leaf, "up_proj")
            down = stack(leaf, "down_proj")
            if lay.transposed and leaf == "weight":
                both, down = both.transpose(1, 2), down.transpose(1, 2)
            out[f"{name}.{lay.up_name}{suffix}"] = both.contiguous()
            out[f"{name}.down_proj{suffix}"] = down.contiguous()
    return out


def checkpoint_tensors(model: nn.Module, tensors: dict[str, Tensor], names: HubNames | None = None) -> dict:
    """`tensors` (compress's names) as the family's hub checkpoints name and lay them out."""
    names = names or hub_names(model)
    if names.fused:
        tensors = fuse_tensors(model, tensors)
    return {names.tensor(k): v for k, v in tensors.items()}
