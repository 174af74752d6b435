"""The `prune` stage: Minitron importance scores, targets (ratios, a shape, or a parameter budget), slicing.

Width axes keep the same size in every layer (the config holds one size) but each layer keeps its own
most important channels / heads; the hidden size is one set of channels for the whole residual stream;
depth drops the blocks whose removal costs least. All axes are scored on the original model, in one pass.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..arch import ArchSpec
from .importance import Importance, activation_importance, layer_drop_ppl
from .slicing import prune_heads, prune_hidden, prune_layers, prune_layout, prune_mlp

AXES = ("heads", "mlp", "hidden", "depth")


@dataclass(frozen=True)
class TargetShape:
    """An explicit target: any subset of the config sizes."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if v is not None and v < 1}
        if bad:
            raise ValueError(f"target sizes must be >= 1, got {bad}")


# ---------------------------------------------------------------- sizes and parameter counts

@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    intermediate: int
    hidden: int
    layers: int


def model_shape(model: nn.Module, arch: ArchSpec) -> Shape:
    shape = model_shape_from_config(model.config, prune_layout(model, "mlp"))
    if shape.layers != len(arch.block_list(model)):
        raise ValueError(f"config says {shape.layers} layers but the model has {len(arch.block_list(model))} blocks")
    return shape


def shaped_config(model: nn.Module, shape: Shape):
    cfg = copy.deepcopy(model.config)
    layout = prune_layout(model, "mlp")
    keys = layout["config"]
    old = model_shape_from_config(cfg, layout)
    if (shape.heads, shape.kv_heads, shape.hidden) != (old.heads, old.kv_heads, old.hidden):
        if getattr(cfg, "head_dim", None) is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size = shape.heads, shape.kv_heads, shape.hidden
    setattr(cfg, keys["intermediate"], shape.intermediate)
    setattr(cfg, keys["layers"], shape.layers)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)):
        cfg.layer_types = list(types)[:shape.layers]
    return cfg


def model_shape_from_config(cfg, layout) -> Shape:
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    inter = getattr(cfg, layout["config"]["intermediate"], None) or 4 * hidden
    return Shape(heads, getattr(cfg, "num_key_value_heads", None) or heads, inter, hidden,
                 getattr(cfg, layout["config"]["layers"]))


def count_params(config) -> int:
    """Parameters of the model `config` describes (tied weights once), built on the meta device."""
    from ..arch import auto_model_class

    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


def _round(x: float, multiple: int, limit: int) -> int:
    return int(min(limit, max(multiple, multiple * round(x / multiple)))) if limit >= multiple else limit


def shape_from_ratios(orig: Shape, ratios: dict[str, float], heads_mode: str, multiple_of: int) -> Shape:
    heads, kv = orig.heads, orig.kv_heads
    if "heads" in ratios:
        group = orig.heads // orig.kv_heads
        if heads_mode == "query" and group > 1:  # without GQA (group 1) a head is its own KV group
            heads = orig.kv_heads * max(1, round(group * ratios["heads"]))
        else:
            kv = max(1, round(orig.kv_heads * ratios["heads"]))
            heads = kv * group
    return Shape(heads, kv,
                 _round(orig.intermediate * ratios.get("mlp", 1.0), multiple_of, orig.intermediate)
                 if "mlp" in ratios else orig.intermediate,
                 # transformers' config validation wants hidden_size divisible by num_attention_heads
                 _round(orig.hidden * ratios.get("hidden", 1.0), math.lcm(multiple_of, heads), orig.hidden)
                 if "hidden" in ratios else orig.hidden,
                 max(1, round(orig.layers * ratios.get("depth", 1.0))))


def resolve_shape(model: nn.Module, arch: ArchSpec, stage) -> tuple[Shape, Shape, list[str]]:
    """(original shape, target shape, axes that change)."""
    orig = model_shape(model, arch)
    if stage.target is not None:
        t = stage.target
        heads = t.num_attention_heads or orig.heads
        kv = t.num_key_value_heads or (orig.kv_heads if stage.heads_mode == "query" or heads == orig.heads
                                       else heads // (orig.heads // orig.kv_heads))
        new = Shape(heads, kv, t.intermediate_size or orig.intermediate, t.hidden_size or orig.hidden,
                    t.num_hidden_layers or orig.layers)
    elif stage.params is None:
        new = shape_from_ratios(orig, {a: getattr(stage, a) for a in AXES if getattr(stage, a) is not None},
                                stage.heads_mode, stage.multiple_of)
    else:
        new = _fit_budget(model, orig, stage)
    _check_shape(orig, new)
    changed = [a for a, (o, n) in {"heads": ((orig.heads, orig.kv_heads), (new.heads, new.kv_heads)),
                                    "mlp": (orig.intermediate, new.intermediate), "hidden": (orig.hidden, new.hidden),
                                    "depth": (orig.layers, new.layers)}.items() if o != n]
    return orig, new, changed


def _check_shape(orig: Shape, new: Shape) -> None:
    grow = [f for f in ("heads", "kv_heads", "intermediate", "hidden", "layers") if getattr(new, f) > getattr(orig, f)]
    if grow:
        raise ValueError(f"pruning can only shrink; target {grow[0]}={getattr(new, grow[0])} exceeds the original "
                         f"{getattr(orig, grow[0])}")
    if new.hidden != orig.hidden and new.hidden % new.heads:
        raise ValueError(f"hidden_size {new.hidden} is not a multiple of the {new.heads} attention heads; transformers "
                         f"refuses such a config at save/load. Pick a multiple of {new.heads}")
    group = orig.heads // orig.kv_heads
    if new.heads % new.kv_heads or new.heads // new.kv_heads > group:
        raise ValueError(f"{new.heads} query heads over {new.kv_heads} KV heads: query heads must fill whole KV groups "
                         f"of at most {group} (the original {orig.heads} query heads over {orig.kv_heads} KV heads)")


def _fit_budget(model: nn.Module, orig: Shape, stage) -> Shape:
    """The largest uniform keep ratio over `stage.axes` whose model fits the parameter budget."""
    total = count_params(model.config)
    budget = stage.params * total if stage.params <= 1 else stage.params
    lo, hi, best = 0.0, 1.0, None
    for _ in range(24):
        mid = (lo + hi) / 2
        shape = shape_from_ratios(orig, {a: mid for a in stage.axes}, stage.heads_mode, stage.multiple_of)
        if count_params(shaped_config(model, shape)) <= budget:
            lo, best = mid, shape
        else:
            hi = mid
    if best is None:
        raise ValueError(f"no shape shrinking {list(stage.axes)} fits {int(budget):,} parameters (the model has "
                         f"{total:,}); allow more axes or a larger budget")
    return best


# ---------------------------------------------------------------- choosing what to keep

def _top(scores: Tensor, k: int) -> Tensor:
    return scores.topk(k).indices.sort().values


def keep_heads(scores: list[Tensor], orig: Shape, new: Shape) -> tuple[list[Tensor], list[Tensor]]:
    """Per layer: the kept query heads and KV heads. Query heads are chosen within their KV group."""
    group = orig.heads // orig.kv_heads
    keep_q, keep_kv = [], []
    for s in scores:
        by_group = s.reshape(orig.kv_heads, group)  # [n_kv, group]
        kv = _top(by_group.sum(1), new.kv_heads) if new.kv_heads < orig.kv_heads else torch.arange(orig.kv_heads)
        per = new.heads // new.kv_heads
        q = torch.cat([g * group + _top(by_group[g], per) for g in kv.tolist()])
        keep_q.append(q)
        keep_kv.append(kv)
    return keep_q, keep_kv


@torch.no_grad()
def minitron_prune(model: nn.Module, arch: ArchSpec, samples: Tensor, stage, progress: bool = True,
                   log=print) -> dict:
    """Score, choose and slice in place. Returns the stage's report."""
    t0 = time.perf_counter()
    n_before = sum(p.numel() for p in model.parameters())
    orig, new, changed = resolve_shape(model, arch, stage)
    for axis in set(changed) | {a for a in AXES if getattr(stage, a) is not None} | set(stage.axes):
        prune_layout(model, axis)  # unsupported axes fail before the slow scoring pass
    log(f"prune: {_fmt(orig)} -> {_fmt(new)} (axes: {', '.join(changed) or 'none'})")
    imp = activation_importance(model, arch, samples[:stage.n_samples], set(changed), stage.seq_agg, stage.batch_agg,
                                stage.batch_size, progress) if changed else Importance()
    report: dict = {"stage": "prune", "original": asdict(orig), "pruned": asdict(new), "axes": changed,
                    "seq_agg": stage.seq_agg, "batch_agg": stage.batch_agg, "heads_mode": stage.heads_mode,
                    "samples": [min(stage.n_samples, len(samples)), int(samples.shape[1])], "notes": []}
    if "depth" in changed:
        depth_samples = samples[:stage.depth_samples]
        if stage.depth_metric == "ppl":
            imp.depth_ppl, imp.ppl = layer_drop_ppl(model, arch, depth_samples, progress)
        scores = imp.depth_ppl if stage.depth_metric == "ppl" else imp.depth_cosine
        keep_layers = _top(scores, new.layers).tolist()
        report["depth"] = {"metric": stage.depth_metric, "cosine": _r(imp.depth_cosine),
                           "ppl_without_block": _r(imp.depth_ppl), "ppl": imp.ppl,
                           "dropped": sorted(set(range(orig.layers)) - set(keep_layers))}
    if "heads" in changed:
        keep_q, keep_kv = keep_heads(imp.heads, orig, new)
        prune_heads(model, arch, keep_q, keep_kv)
        report["heads"] = {"kept_query": [q.tolist() for q in keep_q], "kept_kv": [k.tolist() for k in keep_kv],
                           "scores": [_r(s) for s in imp.heads]}
    if "mlp" in changed:
        prune_mlp(model, arch, [_top(s, new.intermediate) for s in imp.mlp])
        report["mlp"] = {"kept_per_layer": new.intermediate,
                         "kept_score_share": _r(torch.stack([s.topk(new.intermediate).values.sum() / s.sum()
                                                             for s in imp.mlp]))}
    if "hidden" in changed:
        report["notes"] += prune_hidden(model, arch, _top(imp.hidden, new.hidden))
        report["hidden"] = {"kept_score_share": float(imp.hidden.topk(new.hidden).values.sum() / imp.hidden.sum())}
    if "depth" in changed:
        prune_layers(model, arch, keep_layers)
    n_after = sum(p.numel() for p in model.parameters())
    report.update(parameters_before=n_before, parameters_after=n_after, parameter_ratio=n_after / n_before,
                  seconds=time.perf_counter() - t0)
    log(f"prune: {n_before:,} -> {n_after:,} parameters ({n_after / n_before:.1%})")
    return report


def _fmt(s: Shape) -> str:
    return f"{s.layers}L h{s.hidden} {s.heads}q/{s.kv_heads}kv mlp{s.intermediate}"


def _r(t: Tensor | None) -> list | None:
    return None if t is None else [round(float(x), 5) for x in t.flatten()]
