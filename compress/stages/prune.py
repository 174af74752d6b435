"""The `prune` stage: Minitron-style importance pruning (prune/minitron.py) of the whole model, before calibration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from ..arch import ArchSpec
from ..calibrate.data import calibration_windows
from ..prune.importance import Agg
from ..prune.minitron import AXES, TargetShape, count_params, minitron_prune, resolve_shape, shaped_config
from .base import ModelStageContext, Plan, StageBase, StageRecord, inline


@dataclass
class PrunePlan:
    line: str  # what `compress inspect` prints
    reshaped: nn.Module  # a meta-device model of the pruned shape: the later stages are planned on it


@dataclass
class PruneRecord(StageRecord):
    """The prune stage's report section: what minitron_prune did (shapes before and after, the axes, the kept
    channels, heads or blocks, parameter counts, notes)."""

    pruning: dict = inline()


@dataclass(frozen=True)
class PruneStage(StageBase):
    """Recipe stage `prune`. Give exactly one of: per-axis keep ratios (heads/mlp/hidden/depth, each in (0, 1]),
    `target` (explicit sizes), or `params` (a budget: a fraction <= 1 of the original parameter count, or an
    absolute count) with the `axes` it may shrink (uniformly)."""

    heads: float | None = None
    mlp: float | None = None
    hidden: float | None = None
    depth: float | None = None
    target: TargetShape | None = None
    params: float | None = None
    axes: tuple[str, ...] = ()
    heads_mode: Literal["query", "kv_group"] = "query"  # query: drop query heads evenly within every KV group
    depth_metric: Literal["ppl", "cosine"] = "ppl"  # ppl: perplexity with the block removed; cosine: 1 - cos(in, out)
    seq_agg: Agg = "mean"
    batch_agg: Agg = "l2"
    multiple_of: int = 32  # MLP and hidden widths are rounded to this (kernel- and group-quantization-friendly)
    n_samples: int = 64  # calibration windows for the importance pass (the paper uses 1024)
    seq_len: int = 512
    depth_samples: int = 8  # windows for the drop-one-block perplexity
    batch_size: int = 4

    def __post_init__(self):
        if isinstance(self.target, dict):  # Python callers may pass a plain mapping
            object.__setattr__(self, "target", TargetShape(**self.target))
        object.__setattr__(self, "axes", tuple(self.axes))
        ratios = {a: getattr(self, a) for a in AXES if getattr(self, a) is not None}
        given = [name for name, on in (("ratios", bool(ratios)), ("target", self.target is not None),
                                       ("params", self.params is not None)) if on]
        if len(given) != 1:
            raise ValueError("prune needs exactly one of: keep ratios (heads/mlp/hidden/depth), `target` (sizes) or "
                             f"`params` (a budget, with `axes`); got {given or 'none'}")
        for axis, r in ratios.items():
            if not 0 < r <= 1:
                raise ValueError(f"prune.{axis} is the fraction to keep, in (0, 1]; got {r}")
        unknown = [a for a in self.axes if a not in AXES]
        if unknown:
            raise ValueError(f"prune.axes: unknown axis {unknown[0]!r}; use any of {list(AXES)}")
        if self.params is not None and (self.params <= 0 or not self.axes):
            raise ValueError("prune.params needs a positive budget and `axes` (which axes may shrink), "
                             "e.g. params: 0.75, axes: [mlp]")
        if self.params is None and self.axes:
            raise ValueError("prune.axes applies to a `params` budget only; with ratios or target it is implied")
        if self.multiple_of < 1 or self.n_samples < 1 or self.depth_samples < 1:
            raise ValueError("multiple_of, n_samples and depth_samples must be >= 1")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "prune"
    whole_model: ClassVar[bool] = True
    reshapes: ClassVar[bool] = True  # changes the model's shapes (what a distill stage repairs)

    @property
    def needs_calibration(self) -> bool:
        return True

    def check(self, index: int, stages: tuple, calibrated: bool) -> "PruneStage":
        if not calibrated:
            raise ValueError(f"`stages.{index}` (prune) scores importance on calibration text; add a `calibration:` "
                             "section (e.g. `calibration: {preset: wikitext2}`)")
        return self

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> PrunePlan:
        """The shapes and parameter counts after pruning (no data needed), and a meta model of that shape."""
        from ..arch import auto_model_class

        orig, new, changed = resolve_shape(model, arch, self)
        before, config = count_params(model.config), shaped_config(model, new)
        after = count_params(config)
        line = (f"\nstage {index}: prune (Minitron), axes {', '.join(changed) or 'none'}: "
                f"{orig.layers} blocks, hidden {orig.hidden}, {orig.heads}q/{orig.kv_heads}kv heads, MLP "
                f"{orig.intermediate} -> {new.layers} blocks, hidden {new.hidden}, {new.heads}q/{new.kv_heads}kv "
                f"heads, MLP {new.intermediate}; parameters {before:,} -> {after:,} ({after / before:.1%})")
        with torch.device("meta"):
            reshaped = auto_model_class(config).from_config(config)
        return PrunePlan(line, reshaped)

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        line = plan.steps[index].line
        return [line], line.strip()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        from ..transforms.rotation import online_rotations
        if online_rotations(ctx.model):
            raise ValueError(f"stage {index} (prune): the MLP's down projections rotate their input at run time "
                             "(rotate.online_hadamard: true); cutting MLP channels would cut through that rotation. "
                             "Prune first in another run, or use rotate.online_hadamard: false")
        n = max(self.n_samples, self.depth_samples)
        ctx.log(f"stage {index}: prune — scoring importance on {n} × {self.seq_len} calibration tokens ...")
        samples = calibration_windows(ctx.calibration.source(), ctx.tokenizer, ctx.model, n, self.seq_len,
                                      ctx.calibration.seed)
        done = minitron_prune(ctx.model, ctx.arch, samples, self, progress=ctx.progress, log=ctx.log)
        return PruneRecord(index, done.pop("stage"), done).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        return _render(section)


_SHAPE = (("layers", "decoder blocks"), ("hidden", "hidden size"), ("heads", "query heads"),
          ("kv_heads", "KV heads"), ("intermediate", "MLP channels"))


def _render(stage: dict) -> list[str]:
    o, n = stage["original"], stage["pruned"]
    lines = ["", f"## Stage {stage['index']}: prune (Minitron; axes: {', '.join(stage['axes']) or 'none'})", "",
             f"Importance from activations on {stage['samples'][0]} × {stage['samples'][1]} calibration tokens "
             f"(sequence {stage['seq_agg']}, batch {stage['batch_agg']}); parameters "
             f"{stage['parameters_before']:,} → {stage['parameters_after']:,} ({stage['parameter_ratio']:.1%}).", "",
             "| axis | original | pruned |", "|---|---:|---:|"]
    lines += [f"| {label} | {o[k]} | {n[k]} |" for k, label in _SHAPE]
    depth = stage.get("depth")
    if depth:
        lines += ["", f"Depth ({depth['metric']}): dropped blocks {depth['dropped']}."]
        if depth.get("ppl_without_block"):
            lines += [f"Perplexity on the scoring windows {depth['ppl']:.2f}; without each block: " +
                      ", ".join(f"{i}: {p:.1f}" for i, p in enumerate(depth["ppl_without_block"]))]
    if stage.get("heads"):
        lines += ["", f"Heads ({stage['heads_mode']}): kept query heads per layer "
                      f"{stage['heads']['kept_query'][:4]}{' …' if len(stage['heads']['kept_query']) > 4 else ''}"]
    lines += [f"\nNote: {note}" for note in stage.get("notes", [])]
    return lines
