"""The `awq` stage: AWQ's activation-aware scale search and clipping (quantizers/awq.py), for the weights the next
`quantize` stage stores; that stage's scheme is the one searched for."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from ..quantizers.awq import awq_block
from ..arch import block_pairs
from ..arch.moe import any_expert
from ..transforms.smoothing import pair_label, pair_skip_reason
from ..core.scheme import QuantScheme
from ..measure.fmt import num
from .base import (BlockState, MemoryBasis, Needs, PassMemory, Plan, RunContext, StageBase, StageRecord, next_target,
        replay_memory)


@dataclass
class AWQRecord(StageRecord):
    """The awq stage's report section."""

    scheme: str  # the scheme searched for (the next quantize stage's)
    n_grid: int
    search_samples: int
    clip: bool
    clip_to: str
    quantized: int  # 0: it stores no weights
    skipped: list
    blocks: list  # per block: {"block": i, "pairs": [each scaling pair's result]}
    unscaled: list  # pairs no block scaled (unscaled_pairs)
    summary: str
    search_step: int = 1  # 1: the whole grid searched; k: coarse (every k-th exponent), then around the best


@dataclass(frozen=True)
class AWQStage(StageBase):
    """Recipe entry `- stage: awq`; it must be followed by a `quantize` stage, whose scheme it uses
    unless `scheme` is given (then the two must agree). clip_to: where the clipping search's ranges go: weights
    (clamp the float weights, AutoAWQ's way; any method) or grid (GPTQ's grid, the weights left whole, so that GPTQ
    carries a clipped weight's error to the columns after it)."""

    scheme: QuantScheme | None = None
    n_grid: int = 20  # scale exponents r in linspace(0, 1, n_grid)
    # 1: every exponent of the grid (the paper's search); k > 1: every k-th, then those within k - 1 of the best
    # (quantizers/awq.search_scales: 11 of 20 losses at k = 3, the same choice wherever the loss has one dip)
    search_step: int = 1
    search_samples: int = 4  # windows the searches replay: 16 was no better on validation (3 seeds), 4x slower
    clip: bool = True
    clip_grid: int = 20  # shrink steps of 1/clip_grid ...
    max_shrink: float = 0.5  # ... down to (1 - max_shrink) of the original range
    clip_tokens: int = 512  # input tokens the clipping search uses per layer
    duo_scaling: bool = False  # AutoAWQ's s = x^r / w^(1-r); off = the paper's s = x^r
    # weights: the clipped ranges clamp the float weights (AutoAWQ's way); grid: they become GPTQ's grid and the
    # weights stay whole, so GPTQ can carry a clipped weight's error to the columns after it
    clip_to: str = "weights"

    def __post_init__(self):
        if self.n_grid < 2 or self.clip_grid < 1 or self.search_samples < 1 or self.clip_tokens < 1 or \
                self.search_step < 1:
            raise ValueError("n_grid >= 2, clip_grid >= 1, search_samples >= 1, clip_tokens >= 1 and search_step >= 1 "
                             "are required")
        if self.clip_to not in ("weights", "grid"):
            raise ValueError(f"clip_to is {self.clip_to!r}; use weights (clamp the float weights) or grid (GPTQ's "
                             "grid from the clipped ranges)")
        if not 0 < self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in (0, 1), got {self.max_shrink}")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "awq"

    @property
    def needs_calibration(self) -> bool:
        return True

    def check(self, index: int, stages: tuple, calibrated: bool) -> "AWQStage":
        super().check(index, stages, calibrated)
        j = next_target(stages, index)
        if j is None:
            raise ValueError(f"`stages.{index}` (awq) only moves scales; a later `stage: quantize` must store the "
                             "weights")
        if self.scheme is not None and self.scheme != stages[j].scheme:
            raise ValueError(f"`stages.{index}.scheme` ({self.scheme.name}) differs from `stages.{j}.scheme` "
                             f"({stages[j].scheme.name}); AWQ must search for the format that is stored. "
                             "Remove the awq scheme to inherit it.")
        if self.clip and self.clip_to == "grid" and stages[j].method != "gptq":
            raise ValueError(f"`stages.{index}.clip_to: grid` hands the clipped ranges to GPTQ as its grid, and "
                             f"`stages.{j}` quantizes with {stages[j].method}; use clip_to: weights there")
        return self

    def describe(self, plan: Plan, index: int) -> tuple[list[str], list[dict]]:
        scheme = plan.target(index)[0].scheme
        clipping = "off" if not self.clip else "on, into GPTQ's grid" if self.clip_to == "grid" else "on"
        grid = f"grid {self.n_grid}" + (f" (coarse to fine: 1 in {self.search_step} exponents, then around the best)"
                                        if self.search_step > 1 else "")
        lines = [f"\nstage {index}: awq for {scheme.name}, {grid}, search on {self.search_samples} "
                 f"calibration windows, clipping {clipping}; scaling pairs per block:"]
        return describe_pairs(plan, index, lines, searched=True)

    def needs(self, plan: Plan, index: int) -> Needs:
        return Needs(abs_mean=True, replay_samples=self.search_samples)

    def pass_memory(self, basis: MemoryBasis) -> PassMemory:
        return replay_memory(basis, self.search_samples)

    def begin(self, ctx: RunContext, index: int) -> None:
        ctx.records[index] = []  # per block: the scaling pairs' results

    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        target, step = ctx.plan.target(index)
        arch = ctx.arch
        mine = [e for e in step.quantized if e.name.startswith(block.prefix + ".")]
        results = awq_block(block.module, arch.awq, block.observer, self, target.scheme,
                            block.under(e.name for e in mine), arch.no_clip, arch.norm_offset, block.divisor,
                            {e.name[len(block.prefix) + 1:]: e.scheme for e in mine},
                            block.clip if self.clip_to == "grid" else None)
        ctx.records[index].append({"block": block.index, "pairs": [asdict(r) for r in results]})

    def report(self, ctx: RunContext, index: int) -> dict:
        blocks = ctx.records.get(index, [])
        unscaled = unscaled_pairs(blocks, ctx.arch.awq_skip)
        return AWQRecord(index, "awq", ctx.plan.target(index)[0].scheme.name, self.n_grid, self.search_samples,
                         self.clip, self.clip_to, 0, [], blocks, unscaled,
                         pairs_summary("AWQ: clipping only" if self.clip else "AWQ: no scaling", unscaled),
                         self.search_step).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = ["", f"## Stage {section['index']}: awq (for {section['scheme']})", ""]
        if section.get("summary"):
            lines += [f"**{section['summary']}**", ""]
        return lines + pair_table(section.get("blocks", [])) + unfound_lines(section.get("unscaled"))


def block0_pairs(plan: Plan, index: int) -> list[tuple]:
    """(prev, balance, inspect, skip reason or None) of the scaling pairs of the stage at `index`: on block 0, and
    where a later block differs in kind (DeepSeek-V3's expert blocks after its dense ones), on the first such
    block too. A pair over experts is shown once, with `*` for the expert index."""
    step = plan.target(index)[1]
    blocks = plan.arch.block_list(plan.model)
    shown, seen = [], set()
    for i, block in enumerate(blocks):
        pairs = block_pairs(block, plan.arch.awq)
        kinds = tuple(any_expert(p[0]) for p in pairs)
        if kinds in seen:
            continue
        seen.add(kinds)
        prefix = f"{plan.arch.blocks}.{i}"
        quantized = {e.name[len(prefix) + 1:] for e in step.quantized if e.name.startswith(prefix + ".")}
        rows = {}
        for prev, bal, insp, _ in pairs:
            key = (any_expert(prev), tuple(dict.fromkeys(any_expert(b) for b in bal)), any_expert(insp))
            rows.setdefault(key, pair_skip_reason(block, prev, bal, quantized))
        shown += [(*key, reason) for key, reason in rows.items()]
    return list(dict.fromkeys(shown))


def describe_pairs(plan: Plan, index: int, lines: list[str], searched: bool) -> tuple[list[str], list[dict]]:
    """`compress inspect`'s lines for a smoothing stage (AWQ, SmoothQuant): each pair scaled or skipped."""
    pairs = block0_pairs(plan, index)
    for prev, balance, inspect_name, reason in pairs:
        compared = f"`{inspect_name}`" if inspect_name else "the whole block's"  # a parallel block's norm pair
        what = f"skipped: {reason}" if reason else \
            f"scaled (search compares {compared} outputs)" if searched else "scaled"
        lines.append(f"  {pair_label(prev, balance):<70} {what}")
    for pair, reason in plan.arch.awq_skip:
        lines.append(f"  {pair:<70} skipped: {reason}")
    return lines, [{"prev": a, "balance": b, "inspect": c, "skipped": r} for a, b, c, r in pairs]


def pair_table(blocks: list[dict], what: str = "mean exponent r") -> list[str]:
    """Per scaling pair: blocks scaled, mean chosen exponent (AWQ) or alpha (SmoothQuant), search loss vs no
    scaling; skips with reasons."""
    by_pair: dict[str, list[dict]] = {}
    for blk in blocks:
        for p in blk["pairs"]:
            by_pair.setdefault(p["pair"], []).append(p)
    lines = [f"| scaling pair | blocks scaled | {what} | search loss / unscaled loss | skipped |",
             "|---|---:|---:|---:|---|"]
    for pair, rows in by_pair.items():
        done = [r for r in rows if not r["skipped"]]
        ratio = sum(r["ratio"] for r in done) / len(done) if done else None
        searched = [r for r in done if r["loss"] is not None]
        gain = (sum(r["loss"] for r in searched) / max(sum(r["loss_identity"] for r in searched), 1e-30)) \
            if searched else None
        skipped = sorted({r["skipped"] for r in rows if r["skipped"]})
        lines.append(f"| `{pair}` | {len(done)}/{len(rows)} | {num(ratio, '{:.2f}')} | {num(gain, '{:.3f}')} | "
                     f"{'; '.join(skipped) or '—'} |")
    return lines


def unscaled_pairs(blocks: list[dict], arch_skips: tuple[tuple[str, str], ...]) -> dict:
    """What a smoothing stage did not scale, for the report's summary: `pairs` (the pair instances of every block:
    those its blocks tried, and the family's pairs that could not be found or used at all, arch.awq_skip, once per
    block), `scaled`, `blocks` and `unscaled_blocks` (blocks where nothing was scaled), and `reasons`: [pair, why,
    how many blocks], the family's first."""
    n = len(blocks)
    listed = [(p, why) for p, why in arch_skips if p != "all pairs"] or list(arch_skips)
    reasons: dict[tuple[str, str], int] = {(p, why): n for p, why in listed} if n else {}
    scaled = 0
    unscaled_blocks = 0
    for blk in blocks:
        done = sum(not p["skipped"] for p in blk["pairs"])
        scaled += done
        unscaled_blocks += done == 0
        for p in blk["pairs"]:
            if p["skipped"]:
                reasons[p["pair"], p["skipped"]] = reasons.get((p["pair"], p["skipped"]), 0) + 1
    total = scaled + sum(reasons.values())
    return {"pairs": total, "scaled": scaled, "blocks": n, "unscaled_blocks": unscaled_blocks,
            "reasons": [[p, why, k] for (p, why), k in reasons.items()], "not_found": [list(x) for x in listed]}


def pairs_summary(what: str, unscaled: dict) -> str | None:
    """One line for the report's summary when some scaling pairs were not scaled: `what` on N of M pairs, because
    ... (None when every pair was scaled, or there were no blocks)."""
    if not unscaled["blocks"] or unscaled["scaled"] == unscaled["pairs"]:
        return None
    n, m = unscaled["pairs"] - unscaled["scaled"], unscaled["pairs"]
    blocks = (f"; {unscaled['unscaled_blocks']} of {unscaled['blocks']} blocks had no pair scaled"
              if unscaled["unscaled_blocks"] else "")
    why = "; ".join(f"`{p}`: {reason}" + (f" ({k} blocks)" if k > 1 else "") for p, reason, k in unscaled["reasons"])
    return f"{what} on {n} of {m} scaling pairs{blocks}, because: {why}"


def unfound_lines(unscaled: dict | None) -> list[str]:
    """The family's pairs that could not be found or used at all (arch.awq_skip), under the pair table."""
    if not unscaled:
        return []
    return [""] + [f"- not scaled in any block: `{p}`: {why}" for p, why in unscaled.get("not_found", [])] \
        if unscaled.get("not_found") else []
