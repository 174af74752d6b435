"""The `auto_precision` stage: mixed precision under a byte budget (compress/precision/mixed.py). Before calibration it
measures every targeted layer's sensitivity to each scheme of a menu, chooses one scheme per layer by a knapsack
within the budget, and writes the choice into the next `quantize` stage as its `layer_schemes`, which then quantizes
each layer in its own scheme by that stage's method (RTN, GPTQ, AutoRound, ...; an `awq` stage in between searches
each layer for its own scheme)."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import numpy as np
from torch import nn
from tqdm.auto import tqdm

from ..arch import ArchSpec, block_pairs
from ..calibrate.data import calibration_windows
from ..core.nn import linear_shape
from ..arch.fused import fused_groups
from ..precision.mixed import (ERROR_METHODS, AWQModel, FLOAT, SENSITIVITIES, budget_problem, choose_grouped, grouped,
        option_bytes, option_name)
from ..quantizers import get_quantizer
from ..core.scheme import W4A16_ASYM_G64, W8A16, QuantScheme
from ..precision.sensitivity import measure_sensitivity
from ..transforms.smoothing import pair_skip_reason
from ..threads import cpu_threads
from .base import MemoryBasis, MemoryPhase, ModelStageContext, Plan, StageBase, StageRecord, next_target
from .quantize import LayerScheme, plan_quantize

_DRIVERS = {"blocks": "one decoder block at a time", "model": "whole-model passes"}
_INT4_G128 = replace(W4A16_ASYM_G64, group_size=128)
_INT3_G64 = replace(W4A16_ASYM_G64, dtype="int3")
# int8 per channel, int6 / int5 / int4 g64, int4 g128, int3 g64 (zero-point). int5 and int6 are the cheap upgrades
# (1-2 bits where int8 costs 3.6): on SmolLM2-135M at int4 g64's bytes they cut the mix's KL after AWQ + GPTQ from
# 0.101 to 0.087 (README, "Mixed precision under a byte budget")
MENU_INT8_TO_INT3 = (W8A16, _INT4_G128, W4A16_ASYM_G64, _INT3_G64)  # the default until int5 / int6 existed
DEFAULT_MENU = (W8A16, replace(W4A16_ASYM_G64, dtype="int6"), replace(W4A16_ASYM_G64, dtype="int5"), _INT4_G128,
                W4A16_ASYM_G64, _INT3_G64)


@dataclass
class AutoPrecisionRecord(StageRecord):
    """The auto_precision stage's report section: the measurement, the budget, the choice and its prediction.
    resolve_stages reads `layer_schemes` back (also from a resumed streamed run's saved section)."""

    sensitivity: str
    error_method: str
    driver: str  # how the sensitivities were measured (block by block, or whole-model passes)
    threads: int
    menu: list  # option names, float as "bf16"
    layers: int
    weights: int
    groups: int  # layer groups that take one scheme together
    fused_groups: bool
    budget_bytes: int
    budget_bits_per_weight: float
    bytes: int  # of the choice
    bits_per_weight: float
    predicted: dict  # cost -> the choice's predicted total
    uniform: dict  # option -> bytes, bits per weight and predicted costs of every layer taking it
    seconds: float
    tokens: int
    counts: dict  # option -> layers that chose it
    assignment: dict  # layer -> option
    table: dict  # the sensitivities (Sensitivities.to_dict)
    layer_schemes: list  # [{"layer", "scheme"}] for the next quantize stage


@dataclass(frozen=True)
class AutoPrecisionStage(StageBase):
    """Recipe stage `auto_precision`, followed (after any awq stage) by the `quantize` stage whose layers it assigns.

    menu: the schemes a layer may take (weight-only; presets or mappings); keep_float: also offer bfloat16 (16 bits).
    The budget, exactly one of: bits_per_weight (stored bits per weight of the targeted layers, scales and zero points
    included), bytes (their stored bytes), bytes_of (the bytes uniform quantization with this scheme would take).
    sensitivity: fisher (predicted KL from one forward and backward per window; default), output_error (relative
    output error, no backward) or kl (measured KL with each layer quantized alone: one forward per layer and scheme,
    slow). error_method: whose weight error the sensitivity measures: rtn (round-to-nearest, default), gptq (GPTQ
    solved per layer and scheme on the float model's inputs: for recipes that quantize with GPTQ or AutoRound, which
    repair layers unevenly), or awq_rtn / awq_gptq (the recipe's `awq` stage imitated on each layer alone, with its
    settings, then round-to-nearest or GPTQ: for recipes with an awq stage, whose scales repair layers unevenly too).
    All but rtn are solved on gptq_samples windows of the calibration text, not the n_samples measured, so that the
    error is not the optimistic one on the text it was fitted to. The targeted layers are those the
    quantize stage's targets / ignore select; n_samples windows of the recipe's calibration text (seq_len tokens,
    the calibration's by default) are measured.
    """

    menu: tuple[QuantScheme, ...] = DEFAULT_MENU
    keep_float: bool = False
    bits_per_weight: float | None = None
    bytes: int | None = None
    bytes_of: QuantScheme | None = None
    sensitivity: Literal["fisher", "output_error", "kl"] = "fisher"
    error_method: Literal["rtn", "gptq", "awq_rtn", "awq_gptq"] = "rtn"
    gptq_samples: int = 32
    n_samples: int = 8
    seq_len: int | None = None
    seed: int = 0
    fused_groups: bool = True

    def __post_init__(self):
        given = [k for k in ("bits_per_weight", "bytes", "bytes_of") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("auto_precision needs exactly one budget: bits_per_weight (e.g. 4.25), bytes, or "
                             f"bytes_of (a scheme: the bytes uniform quantization with it takes); got {given or 'none'}")
        if self.bits_per_weight is not None and not self.bits_per_weight > 0:
            raise ValueError(f"bits_per_weight must be > 0, got {self.bits_per_weight}")
        if self.bytes is not None and self.bytes < 1:
            raise ValueError(f"bytes must be >= 1, got {self.bytes}")
        if not self.menu:
            raise ValueError("menu is empty; list the schemes a layer may take (e.g. [W8A16, W4A16_ASYM_G64])")
        if len(set(self.menu)) != len(self.menu):
            raise ValueError(f"menu lists a scheme twice: {[s.name for s in self.menu]}")
        for s in self.menu:
            if s.act is not None:
                raise ValueError(f"menu scheme {s.name} quantizes activations; auto_precision chooses weight formats "
                                 "(the sensitivity is measured on the weights alone): use weight-only schemes")
        if self.sensitivity not in SENSITIVITIES:
            raise ValueError(f"sensitivity {self.sensitivity!r}; choose one of {list(SENSITIVITIES)}")
        if self.error_method not in ERROR_METHODS:
            raise ValueError(f"error_method {self.error_method!r}; choose one of {list(ERROR_METHODS)} (the quantizer "
                             "whose weight error the sensitivity measures)")
        if self.n_samples < 1 or self.gptq_samples < 1 or (self.seq_len is not None and self.seq_len < 2):
            raise ValueError("n_samples and gptq_samples must be >= 1 and seq_len >= 2")

    name: ClassVar[str] = "auto_precision"
    whole_model: ClassVar[bool] = True

    @property
    def needs_calibration(self) -> bool:
        return True

    def stream_problem(self) -> str | None:
        """The fisher pass reads a streamed model's blocks one at a time (fisher_blocks.py); `kl` cannot."""
        if self.sensitivity == "kl":
            return ("auto_precision's sensitivity: kl runs the whole model once per layer and option (use fisher, "
                    "measured block by block in a streamed run, or run the choice where the model fits)")
        return None

    def export_problem(self, formats: tuple[str, ...], index: int, check) -> str | None:
        """The menu's schemes, which the next quantize stage's layers may take at run time, each alone and then all
        of them mixed across the layers (by fused group with fused_groups), must be what each format holds."""
        where = f"`stages.{index}` ({self.name})"
        for fmt in formats:
            fix = f"drop {fmt} from output.formats (the compress checkpoint and `dense` hold every scheme and any mix)"
            for scheme in self.menu:
                if problems := check(fmt, (scheme,), False):
                    return (f"cannot export to {fmt}: {where} may give layers {scheme.name}, which {fmt} cannot "
                            f"hold ({problems[0]}); remove it from that menu, or {fix}")
            if len(self.menu) > 1 and (problems := check(fmt, tuple(self.menu), self.fused_groups)):
                return (f"cannot export to {fmt}: {where} gives layers different schemes of its menu, and a "
                        f"{fmt} checkpoint cannot mix them ({problems[0]}); export compressed-tensors, or {fix}")
        return None

    def memory_phases(self, basis: MemoryBasis) -> list[MemoryPhase]:
        """The sensitivity pass block by block (fisher_blocks.py), besides the weights or, streamed, one block (and
        its copy) and the embedding and the head: every block's input kept for each window (and, with solved errors,
        the gradient at every block's output), one window's output errors of a block's layers under every option, the
        autograd graph of one block's forward, the logits at the top; with solved errors also the Hessians of a group
        of layers (precision.HESSIAN_BUDGET, or the widest layer's alone), the menu's solutions for one block and the
        Hessian windows' states. Listed after the calibration pass (the order the plan has always had)."""
        from ..precision.mixed import HESSIAN_BUDGET

        if basis.calibration is None:
            return []
        size, width = basis.size, basis.width
        seq_len = self.seq_len or basis.calibration.seq_len
        solved = self.error_method != "rtn"
        parts = {"kept states": (size.layers + 1) * self.n_samples * seq_len * size.hidden * width * (2 if solved else 1),
                 "output errors": 4 * len(self.options) * seq_len * size.output_features,
                 "one block's backward": 4 * 16 * seq_len * size.input_features,
                 "logits": 3 * 4 * seq_len * size.vocab}
        if solved:
            per_weight = sum(2 if o is None else o.bits / 8 + (4 / o.group_size if o.granularity == "group" else 0)
                             for o in self.options)
            parts.update({"Hessians": min(4 * size.layer_hessian_floats,
                                          max(HESSIAN_BUDGET, 4 * size.largest_hessian_floats)),
                          "one block's solutions": int(per_weight * size.block_linear_parameters / max(size.layers, 1)),
                          "Hessian windows": 2 * self.gptq_samples * seq_len * size.hidden * width})
        held = {"one block": 2 * size.block_parameters * width, "embedding and head": 2 * size.vocab * size.hidden *
                width} if basis.streamed else {"weights": basis.weights}
        return [MemoryPhase("sensitivity pass", {**held, **parts}, after_pass=True)]

    @property
    def options(self) -> list[QuantScheme | None]:
        return list(self.menu) + ([None] if self.keep_float else [])

    def check(self, index: int, stages: tuple, calibrated: bool) -> "AutoPrecisionStage":
        super().check(index, stages, calibrated)
        j = next_target(stages, index)
        if j is None:
            raise ValueError(f"`stages.{index}` (auto_precision) chooses a scheme per layer for a later "
                             "`stage: quantize`, and there is none; add one (its method quantizes every layer)")
        q = stages[j]
        if q.layer_schemes:
            raise ValueError(f"`stages.{j}` already has layer_schemes, which `stages.{index}` (auto_precision) would "
                             "replace; remove one of them")
        if self.error_method.startswith("awq") and self._awq_stage(stages, index) is None:
            raise ValueError(f"`stages.{index}.error_method` {self.error_method} imitates the recipe's awq stage, and "
                             f"there is none before `stages.{j}`; add `- stage: awq` there or use error_method "
                             f"{self.error_method[4:]}")
        method = get_quantizer(q.method)
        for s in self.menu:
            if (why := method.problem(s)) is not None:
                raise ValueError(f"`stages.{index}.menu`: method {q.method} of `stages.{j}` cannot store {s.name}: "
                                 f"{why}")
        return self

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> str:
        budget = (f"{self.bits_per_weight} bits per weight" if self.bits_per_weight is not None else
                  f"{self.bytes} bytes" if self.bytes is not None else f"the bytes of uniform {self.bytes_of.name}")
        how = "a whole-model forward per layer and option" if self.sensitivity == "kl" else "one block at a time"
        return (f"\nstage {index}: auto_precision, one scheme per layer of the next quantize stage from "
                f"[{', '.join(option_name(o) for o in self.options)}] within {budget}, by {self.sensitivity} "
                f"sensitivity to {self.error_method} weight errors on {self.n_samples} calibration windows, {how} "
                "(chosen at run time, before calibration; until then "
                "the quantize stage below lists its own scheme for every layer)")

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        return [plan.steps[index]], plan.steps[index].strip()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        q = ctx.stages[next_target(ctx.stages, index)]
        plan = plan_quantize(ctx.model, ctx.arch, replace(q, strict=False))
        # every layer the quantize stage selects, including those its own scheme's group size cannot divide
        names = [e.name for e in plan.layers if e.scheme is not None or e.reason.endswith("(strict: false)")]
        if not names:
            raise ValueError(f"stage {index} (auto_precision): the quantize stage after it selects no layer")
        shapes = [linear_shape(ctx.model.get_submodule(n)) for n in names]
        numel = np.array([o * i for o, i in shapes], dtype=np.int64)
        budget = self._budget(names, shapes)
        groups = self._groups(names)
        if (why := budget_problem(grouped(np.zeros((len(names), len(self.options))), option_bytes(shapes, self.options),
                                          groups)[1], budget)) is not None:
            raise ValueError(f"stage {index} (auto_precision): {why}")  # before the sensitivity pass, not after
        seq_len = self.seq_len or ctx.calibration.seq_len
        ctx.log(f"stage {index}: auto_precision — {self.sensitivity} sensitivity of {len(names)} layers to "
                f"{len(self.options)} options ({self.error_method} weight errors) on {self.n_samples} × {seq_len} "
                "calibration tokens ...")
        windows = calibration_windows(ctx.calibration.source(), ctx.tokenizer, ctx.model, self.n_samples, seq_len,
                                      ctx.calibration.seed)
        hessian_windows = None
        if self.error_method != "rtn":  # fitted on other windows than those its error is measured on
            more = calibration_windows(ctx.calibration.source(), ctx.tokenizer, ctx.model,
                                       self.n_samples + self.gptq_samples, seq_len, ctx.calibration.seed)
            hessian_windows = more[self.n_samples:]
        t0 = time.perf_counter()
        bars: dict = {}

        def progress(what: str, done: int, total: int) -> None:
            if what not in bars:
                bars[what] = tqdm(total=total, desc=what, unit="step", disable=not ctx.progress, leave=False)
            bars[what].update(done - bars[what].n)

        try:
            with cpu_threads(ctx.calibration.threads) as threads:  # calibration work, not model.threads
                sens = measure_sensitivity(ctx.model, windows, names, self.options, self.sensitivity, self.seed,
                                           progress, error_method=self.error_method,
                                           hessian_windows=hessian_windows, awq=self._awq_model(ctx, names, index),
                                           blocks=ctx.blocks, device=ctx.device)
        finally:
            for bar in bars.values():
                bar.close()
        seconds = time.perf_counter() - t0
        costs = sens.costs[self.sensitivity]
        picked = choose_grouped(costs, sens.nbytes, budget, groups)
        rows = np.arange(len(names))
        chosen_bytes = int(sens.nbytes[rows, picked].sum())
        predicted = {k: float(c[rows, picked].sum()) for k, c in sens.costs.items()}
        uniform = {}
        for j, opt in enumerate(sens.options):
            if (sens.nbytes[:, j] >= 0).all():
                uniform[opt] = {"bytes": int(sens.nbytes[:, j].sum()),
                                "bits_per_weight": float(sens.nbytes[:, j].sum() * 8 / numel.sum()),
                                **{f"predicted_{k}": float(c[:, j].sum()) for k, c in sens.costs.items()}}
        assignment = {n: sens.options[p] for n, p in zip(names, picked)}
        options = {option_name(o): o for o in self.options}
        return AutoPrecisionRecord(
            index, "auto_precision", self.sensitivity, self.error_method, sens.driver, threads, list(sens.options),
            len(names), int(numel.sum()), len(groups), self.fused_groups, budget_bytes=int(budget),
            budget_bits_per_weight=float(budget * 8 / numel.sum()), bytes=chosen_bytes,
            bits_per_weight=float(chosen_bytes * 8 / numel.sum()), predicted=predicted, uniform=uniform,
            seconds=seconds, tokens=sens.tokens,
            counts={o: int((np.array(picked) == j).sum()) for j, o in enumerate(sens.options)},
            assignment=assignment, table=sens.to_dict(),
            layer_schemes=[{"layer": n, "scheme": None if options[o] is None else options[o].to_dict()}
                           for n, o in assignment.items()]).to_json()

    def _groups(self, names: list[str]) -> list[list[int]]:
        """Row indices of the layers that take one scheme together (each layer alone when fused_groups is off)."""
        if not self.fused_groups:
            return [[i] for i in range(len(names))]
        index = {n: i for i, n in enumerate(names)}
        return [[index[n] for n in g] for g in fused_groups(names)]

    @staticmethod
    def _awq_stage(stages: tuple, index: int):
        from .awq import AWQStage
        return next((s for s in stages[index + 1:next_target(stages, index)] if isinstance(s, AWQStage)), None)

    def _awq_model(self, ctx: ModelStageContext, names: list[str], index: int) -> AWQModel | None:
        """The recipe's awq stage as error_method awq_* imitates it: the layers its usable scaling pairs scale,
        those its clipping leaves alone, its search settings."""
        if not self.error_method.startswith("awq"):
            return None
        stage, arch, wanted = self._awq_stage(ctx.stages, index), ctx.arch, set(names)
        scaled, no_clip = set(), set()
        for b, block in enumerate(arch.block_list(ctx.model)):
            prefix = f"{arch.blocks}.{b}."
            mine = {n[len(prefix):] for n in wanted if n.startswith(prefix)}
            for prev, balance, _inspect, _followers in block_pairs(block, arch.awq):
                if pair_skip_reason(block, prev, balance, mine) is None:
                    scaled.update(prefix + n for n in balance)
            no_clip.update(prefix + n for n in arch.no_clip)
        return AWQModel(frozenset(scaled), frozenset(no_clip), stage.n_grid, stage.clip, stage.clip_grid,
                        stage.max_shrink, stage.clip_tokens, stage.clip_to)

    def _budget(self, names: list[str], shapes: list[tuple[int, int]]) -> int:
        if self.bits_per_weight is not None:
            return int(self.bits_per_weight * sum(o * i for o, i in shapes) / 8)
        if self.bytes is not None:
            return self.bytes
        nbytes = option_bytes(shapes, [self.bytes_of])[:, 0]
        if (nbytes < 0).any():
            k = int(np.flatnonzero(nbytes < 0)[0])
            raise ValueError(f"bytes_of: {self.bytes_of.name} cannot hold {names[k]} {shapes[k]}; give the budget as "
                             "bits_per_weight or bytes, or a bytes_of scheme every layer fits")
        return int(nbytes.sum())

    def resolve_stages(self, stages: tuple, index: int, section: dict) -> tuple:
        """The recipe's stages with the choice written into the next quantize stage's layer_schemes."""
        j = next_target(stages, index)
        chosen = tuple(LayerScheme(e["layer"], None if e["scheme"] is None else QuantScheme.from_dict(e["scheme"]))
                       for e in section["layer_schemes"])
        return stages[:j] + (replace(stages[j], layer_schemes=chosen),) + stages[j + 1:]

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        measured = (models.get("compressed") or {}).get("kl")
        kind = section["sensitivity"]
        lines = ["", f"## Stage {section['index']}: auto_precision", "",
                 f"One scheme per layer for {section['layers']} layers ({section['weights']:,} weights) within "
                 f"{section['budget_bits_per_weight']:.3f} bits per weight ({section['budget_bytes']:,} bytes), by "
                 f"{kind} sensitivity to {section.get('error_method', 'rtn')} weight errors measured on "
                 f"{section['tokens']:,} calibration tokens in "
                 f"{section['seconds']:.0f} s ({_DRIVERS.get(section.get('driver'), 'whole-model passes')}): "
                 f"**{section['bits_per_weight']:.3f} bits per weight** "
                 f"({section['bytes']:,} bytes){_grouping(section)}.", "",
                 f"Predicted cost (sum over layers of the {kind} sensitivity of the chosen schemes): "
                 f"{section['predicted'][kind]:.4g}" +
                 (f"; measured KL of the quantized model: {measured:.4g} nats per token." if measured is not None
                  and kind != "output_error" else "."), "",
                 "| scheme | layers chosen | uniform: bits per weight | uniform: predicted |", "|---|---:|---:|---:|"]
        for opt in section["menu"]:
            u = section["uniform"].get(opt)
            lines.append(f"| {opt} | {section['counts'].get(opt, 0)} | "
                         f"{'—' if u is None else format(u['bits_per_weight'], '.3f')} | "
                         f"{'— (does not fit every layer)' if u is None else format(u['predicted_' + kind], '.4g')} |")
        lines += ["", "| layer | scheme |", "|---|---|"]
        lines += [f"| `{n}` | {o} |" for n, o in section["assignment"].items()]
        return lines


def _grouping(section: dict) -> str:
    if "groups" not in section:  # a report written before fused groups
        return ""
    if not section["fused_groups"]:
        return "; every layer chose alone (fused_groups: false)"
    return f"; {section['groups']} groups: the layers a serving engine fuses (q/k/v, gate/up, experts) took one scheme"


__all__ = ["AutoPrecisionStage", "DEFAULT_MENU", "FLOAT", "MENU_INT8_TO_INT3"]
