"""The `smoothquant` stage: SmoothQuant's outlier migration (quantizers/smoothquant.py), for the activations the next
`quantize` stage quantizes."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from ..quantizers.smoothquant import smoothquant_block
from .awq import describe_pairs, pair_table, pairs_summary, unfound_lines, unscaled_pairs
from .base import (BlockState, MemoryBasis, Needs, PassMemory, Plan, RunContext, StageBase, StageRecord, next_target,
        replay_memory)


@dataclass
class SmoothQuantRecord(StageRecord):
    """The smoothquant stage's report section."""

    alpha: float
    alpha_grid: list
    quantized: int  # 0: it stores no weights
    skipped: list
    blocks: list  # per block: {"block": i, "pairs": [each scaling pair's result]}
    unscaled: list
    summary: str


@dataclass(frozen=True)
class SmoothQuantStage(StageBase):
    """Recipe entry `- stage: smoothquant`; a later `quantize` stage with activation quantization must follow."""

    alpha: float = 0.5
    alpha_grid: tuple[float, ...] = ()  # e.g. [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]: search per pair; empty = use alpha
    search_samples: int = 4  # calibration windows the search replays

    def __post_init__(self):
        for a in (self.alpha, *self.alpha_grid):
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {a}")
        if self.search_samples < 1:
            raise ValueError("search_samples must be >= 1")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "smoothquant"

    @property
    def needs_calibration(self) -> bool:
        return True

    def check(self, index: int, stages: tuple, calibrated: bool) -> "SmoothQuantStage":
        super().check(index, stages, calibrated)
        j = next_target(stages, index)
        act = None if j is None else stages[j].scheme.act
        if act is None or act.outlier_threshold is not None:
            raise ValueError(f"`stages.{index}` (smoothquant) migrates activation outliers into the weights; a later "
                             "`stage: quantize` must quantize activations without LLM.int8's outlier split (e.g. "
                             "scheme: W8A8 or FP8_DYNAMIC)")
        return self

    def describe(self, plan: Plan, index: int) -> tuple[list[str], list[dict]]:
        how = f"alpha searched over {list(self.alpha_grid)}" if self.alpha_grid else f"alpha {self.alpha}"
        return describe_pairs(plan, index, [f"\nstage {index}: smoothquant, {how}; scaling pairs per block:"],
                              searched=bool(self.alpha_grid))

    def needs(self, plan: Plan, index: int) -> Needs:
        return Needs(abs_max=True, replay_samples=self.search_samples if self.alpha_grid else 0)

    def pass_memory(self, basis: MemoryBasis) -> PassMemory:
        return replay_memory(basis, self.search_samples if self.alpha_grid else 0)

    def begin(self, ctx: RunContext, index: int) -> None:
        ctx.records[index] = []

    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        target, step = ctx.plan.target(index)
        results = smoothquant_block(block.module, ctx.arch.awq, block.observer, self, target.scheme,
                                    block.under(e.name for e in step.quantized), ctx.arch.norm_offset, block.divisor)
        ctx.records[index].append({"block": block.index, "pairs": [asdict(r) for r in results]})

    def report(self, ctx: RunContext, index: int) -> dict:
        blocks = ctx.records.get(index, [])
        unscaled = unscaled_pairs(blocks, ctx.arch.awq_skip)
        return SmoothQuantRecord(index, "smoothquant", self.alpha, list(self.alpha_grid), 0, [], blocks, unscaled,
                                 pairs_summary("SmoothQuant: no smoothing", unscaled)).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        how = f"alpha searched over {section['alpha_grid']}" if section["alpha_grid"] else f"alpha {section['alpha']}"
        lines = ["", f"## Stage {section['index']}: smoothquant ({how})", ""]
        if section.get("summary"):
            lines += [f"**{section['summary']}**", ""]
        return lines + pair_table(section.get("blocks", []), "mean alpha") + unfound_lines(section.get("unscaled"))
