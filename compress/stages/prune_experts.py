"""The `prune_experts` stage: drop each mixture-of-experts block's least salient experts (prune/experts.py), before
calibration; the router loses their rows and the config their count, so plain transformers loads the result."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from ..arch import ArchSpec
from ..calibrate.data import calibration_windows
from ..arch.moe import moe_blocks, unfuse_experts
from ..prune.experts import COUNT_KEYS, expert_scores, kept_experts, prune_experts
from .base import ModelStageContext, Plan, StageBase, StageRecord


@dataclass
class ExpertPrunePlan:
    line: str
    reshaped: nn.Module  # a meta model with the kept number of experts: the later stages are planned on it


@dataclass
class PruneExpertsRecord(StageRecord):
    """The prune_experts stage's report section."""

    score: str
    experts_before: int  # per MoE block
    experts_after: int
    samples: list  # [windows, tokens each] the experts were scored on
    parameters_before: int
    parameters_after: int
    blocks: dict  # MoE block -> each expert's score and tokens, and the experts kept


@dataclass(frozen=True)
class PruneExpertsStage(StageBase):
    """Recipe stage `prune_experts`: keep `keep` experts per MoE block (a count), or the fraction `ratio` of them,
    chosen by `score`: `reap` (router-weighted mean output norm over the tokens routed to the expert, REAP) or
    `frequency` (tokens routed to it), on `n_samples` × `seq_len` calibration tokens."""

    keep: int | None = None
    ratio: float | None = None
    score: Literal["reap", "frequency"] = "reap"
    n_samples: int = 32
    seq_len: int = 512
    batch_size: int = 4

    def __post_init__(self):
        if (self.keep is None) == (self.ratio is None):
            raise ValueError("prune_experts needs exactly one of `keep` (experts per block) or `ratio` (the fraction "
                             "to keep, in (0, 1])")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"prune_experts.keep must be at least 1, got {self.keep}")
        if self.ratio is not None and not 0 < self.ratio <= 1:
            raise ValueError(f"prune_experts.ratio is the fraction of experts to keep, in (0, 1]; got {self.ratio}")
        if self.score not in ("reap", "frequency"):
            raise ValueError(f"prune_experts.score is 'reap' or 'frequency', got {self.score!r}")
        if self.n_samples < 1 or self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("prune_experts: n_samples, seq_len and batch_size must be >= 1")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "prune_experts"
    whole_model: ClassVar[bool] = True
    reshapes: ClassVar[bool] = True

    @property
    def needs_calibration(self) -> bool:
        return True

    def check(self, index: int, stages: tuple, calibrated: bool) -> "PruneExpertsStage":
        if not calibrated:
            raise ValueError(f"`stages.{index}` (prune_experts) scores the experts on calibration text; add a "
                             "`calibration:` section (e.g. `calibration: {preset: wikitext2}`)")
        return self

    def kept_count(self, model: nn.Module) -> tuple[int, int]:
        """(experts per block now, experts kept)."""
        blocks = moe_blocks(model)
        if not blocks:
            raise ValueError(f"prune_experts: {type(model).__name__} has no mixture-of-experts blocks; remove the "
                             "stage or use `prune` (Minitron) for a dense model")
        now = len(next(iter(blocks.values())))
        keep = self.keep if self.keep is not None else max(1, round(now * self.ratio))
        if keep > now:
            raise ValueError(f"prune_experts.keep={keep} exceeds the {now} experts per block")
        return now, keep

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> ExpertPrunePlan:
        from ..arch import auto_model_class

        now, keep = self.kept_count(model)
        config = copy.deepcopy(model.config)
        for key in COUNT_KEYS:
            if getattr(config, key, None) == now:
                setattr(config, key, keep)
        top_k = getattr(config, "num_experts_per_tok", 1)
        if keep < top_k:
            raise ValueError(f"prune_experts keeps {keep} experts per block, fewer than the {top_k} each token is "
                             "routed to (num_experts_per_tok)")
        with torch.device("meta"):
            reshaped = auto_model_class(config).from_config(config)
        unfuse_experts(reshaped)
        before = sum(p.numel() for p in model.parameters())
        after = sum(p.numel() for p in reshaped.parameters())
        line = (f"\nstage {index}: prune_experts ({self.score}): {now} -> {keep} experts in each of "
                f"{len(moe_blocks(model))} MoE blocks; parameters {before:,} -> {after:,} ({after / before:.1%})")
        return ExpertPrunePlan(line, reshaped)

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        line = plan.steps[index].line
        return [line], line.strip()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        now, keep = self.kept_count(ctx.model)
        ctx.log(f"stage {index}: prune_experts — scoring {now} experts per block on {self.n_samples} × "
                f"{self.seq_len} calibration tokens ...")
        samples = calibration_windows(ctx.calibration.source(), ctx.tokenizer, ctx.model, self.n_samples,
                                      self.seq_len, ctx.calibration.seed)
        before = sum(p.numel() for p in ctx.model.parameters())
        scores = expert_scores(ctx.model, samples, self.score, self.batch_size)
        kept = kept_experts(scores, keep)
        prune_experts(ctx.model, kept)
        after = sum(p.numel() for p in ctx.model.parameters())
        return PruneExpertsRecord(index, self.name, self.score, now, keep, [self.n_samples, self.seq_len], before,
                                  after, {n: {**row, "kept": kept[n]} for n, row in scores.items()}).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = ["", f"## Stage {section['index']}: prune_experts ({section['score']})", "",
                 f"{section['experts_before']} → {section['experts_after']} experts per MoE block, scored on "
                 f"{section['samples'][0]} × {section['samples'][1]} calibration tokens; parameters "
                 f"{section['parameters_before']:,} → {section['parameters_after']:,} "
                 f"({section['parameters_after'] / section['parameters_before']:.1%}).", "",
                 "| experts | kept | dropped (score, tokens) |", "|---|---|---|"]
        for name, row in section["blocks"].items():
            dropped = [j for j in range(len(row["score"])) if j not in row["kept"]]
            lines.append(f"| `{name}` | {' '.join(map(str, row['kept']))} | " +
                         ", ".join(f"{j} ({row['score'][j]:.3g}, {row['tokens'][j]})" for j in dropped) + " |")
        return lines
