"""What every stage has in common: the lifecycle it implements, what it asks of the calibration pass, and the
context the runner hands it.

A stage is a frozen dataclass (its recipe settings) with these methods; `StageBase` gives the defaults, so a stage
writes only what it does:

- `check(index, stages, calibrated)`: validate against the stages around it (raise ValueError naming the fix).
- `needs_calibration`: whether the recipe must have a `calibration:` section.
- `plan(model, arch, claimed, index)`: what it will do to this model, computed without data (`compress inspect`
  prints it, `compress run` follows it); `describe(...)` renders it.
- Whole-model stages (`whole_model = True`: prune, distill) run once, before the calibration pass (or after it,
  with `after_calibration = True`: tune_scales, on the compressed model, with the original as its teacher):
  `run_model(ctx, index)` returns the stage's report section, and `resolve_stages(stages, index, section)` may
  write what it decided into the later stages (auto_precision: the quantize stage's per-layer schemes).
- Block stages act inside the calibration pass: `needs(plan, index)` says which statistics the pass must gather,
  `observing(block)` may add a stage's own observation of the block's float forward, `on_block(ctx, block, index)`
  changes the block, `finalize(ctx, index)` acts on the whole model afterwards, `report(ctx, index)` returns the
  report section and the static `render(section, models)` turns a section (also one read back from report.json)
  into markdown. Each stage types its section as a StageRecord of its own (`run_model`'s too), written by
  `to_json()`.

- What the runner must know of a stage before it runs, the stage answers itself: `stream_problem()` (why it cannot
  run on a model streamed block by block), `export_problem(formats, index, check)` (why the run cannot be exported
  to those formats), and its memory for the memory plan (pipeline/memory_plan.py), from the model's sizes alone:
  `stored_bytes` (the model as it stores it), `added_bytes` (what it stores beside that: eora's terms), `pass_memory` (its share of the calibration pass: the statistics it
  asks for, its own work), `memory_phases` (phases of its own: distillation, a sensitivity pass) and `memory_fix`
  (what shrinks its share when the run does not fit).

`STAGES` in `compress/stages/__init__.py` is the only list of stages. Nothing outside a stage's own file knows
its class or its settings (tests/test_stage_memory.py checks the runner's files).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from torch import Tensor, nn

from ..arch import ArchSpec
from ..calibrate.observers import BlockObserver
from ..quantizers import LayerInputs


@dataclass(frozen=True)
class Needs:
    """What a block stage needs the calibration pass to record for the layers the plan will quantize."""

    abs_mean: bool = False  # mean |x| per input channel (AWQ)
    abs_max: bool = False  # max |x| per input channel (SmoothQuant, static activation scales, LLM.int8)
    hessian: bool = False  # sum x xᵀ (GPTQ)
    replay_samples: int = 0  # windows whose inspect-module calls are kept for a scale search (AWQ, SmoothQuant)
    tokens: bool = False  # only how many tokens each layer saw (a MoE expert's calibration coverage)

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(self.abs_mean or other.abs_mean, self.abs_max or other.abs_max, self.hessian or other.hessian,
                     max(self.replay_samples, other.replay_samples), self.tokens or other.tokens)

    @property
    def any(self) -> bool:
        return self.abs_mean or self.abs_max or self.hessian or self.replay_samples > 0 or self.tokens


NO_NEEDS = Needs()


@dataclass(frozen=True)
class MemoryBasis:
    """What a stage's memory terms are computed from, before any weight is read (pipeline/memory_plan.py): the
    model's sizes (a memory_plan.ModelSize, read from its config), the bytes of one value at the run's dtype, the
    recipe's calibration section (None without one), whether the model is streamed block by block, and the whole
    model's bytes as compressed by the recipe."""

    size: Any
    width: int
    calibration: Any = None
    streamed: bool = False
    compressed: int = 0
    device: str = "cpu"  # where the pass computes (a CPU solves two GPTQ layers at once on two threads)
    added: int = 0  # what the stages add beside the weights (added_bytes: eora's low-rank terms), in `compressed`

    @property
    def weights(self) -> int:
        """The whole model's bytes at the run's dtype."""
        return self.size.parameters * self.width


@dataclass(frozen=True)
class PassMemory:
    """What a block stage adds to the calibration pass's memory, besides the block and the activations. Each dict
    maps what is held to its bytes; where several stages name the same thing, the largest counts (one allocation)."""

    statistics: dict[str, int] = field(default_factory=dict)  # what the pass records for it (Hessians, kept windows)
    during: dict[str, int] = field(default_factory=dict)  # its own work while the block's forwards are held
    between: dict[str, int] = field(default_factory=dict)  # its own work between them (a streamed run's own phase)


def replay_memory(basis: MemoryBasis, windows: int) -> PassMemory:
    """A scale search's kept windows (AWQ, SmoothQuant's alpha grid): `windows` calibration windows of every linear
    input of the block, float32 (the block's distinct linear inputs, summed, wide)."""
    return PassMemory(statistics={"kept windows": 4 * windows * basis.calibration.seq_len * basis.size.input_features}
                      if windows else {})


@dataclass(frozen=True)
class MemoryPhase:
    """A phase of the run a stage holds memory in, outside the calibration pass (distillation, a sensitivity pass),
    or what it adds to a phase the runner plans (`evaluation`). `parts` maps what is held to its bytes. The plan
    lists a new phase after the load, before the calibration pass, or after it with `after_pass` (before the
    evaluation)."""

    name: str
    parts: dict[str, int]
    after_pass: bool = False


def inline(**kw):
    """A StageRecord field that is a mapping another module computed (a training run's curve, a rotation's counts):
    its keys are written into the section itself, in their order."""
    return field(default_factory=dict, metadata={"inline": True}, **kw)


def optional():
    """A StageRecord field written only when it is not None (a setting that only some runs of the stage have)."""
    return field(default=None, metadata={"optional": True})


@dataclass
class StageRecord:
    """A stage's report section, typed: each stage's own record adds its fields after these. `to_json()` writes
    the section report.json holds: the fields in order, an `inline` field's keys in its place, an `optional` one
    only when set; values as they are (the stage puts JSON-able values in)."""

    index: int
    stage: str

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("inline"):
                out |= value
            elif not (f.metadata.get("optional") and value is None):
                out[f.name] = value
        return out


def next_target(stages: tuple, index: int) -> int | None:
    """Index of the first stage after `index` that stores weights (a `quantize` stage): the one whose scheme a
    smoothing stage prepares the weights for. The only place this is decided."""
    return next((j for j in range(index + 1, len(stages)) if getattr(stages[j], "stores_weights", False)), None)


@dataclass
class Plan:
    """What a recipe will do to a model, per stage, computed without data. Built by `make_plan`; `compress inspect`
    renders it and `compress run` executes it."""

    stages: tuple
    steps: list  # per stage: its plan (a QuantPlan for quantize, pairs for awq, ...), or None
    model: nn.Module  # the model the later stages were planned on (a meta model of the pruned shape after prune)
    arch: ArchSpec

    def target(self, index: int) -> tuple[Any, Any]:
        """(stage, plan) of the stage that stores the weights stage `index` prepares."""
        j = next_target(self.stages, index)
        return self.stages[j], self.steps[j]

    def observed_layers(self) -> set[str]:
        """Full names of the linears whose calibration inputs some stage will use."""
        return {n for stage, step in zip(self.stages, self.steps) for n in stage.observed_layers(step)}

    def needs(self) -> Needs:
        out = NO_NEEDS
        for i, stage in enumerate(self.stages):
            if not stage.whole_model:
                out = out | stage.needs(self, i)
        return out

    @property
    def block_stages(self) -> list[int]:
        return [i for i, s in enumerate(self.stages) if not s.whole_model]


def make_plan(model: nn.Module, arch: ArchSpec, stages: tuple, model_stages_done: bool = False) -> Plan:
    """Plan every stage in order. A whole-model stage that changes shapes (prune) returns a meta model of the new
    shape, and the stages after it are planned on that; after the whole-model stages have run for real
    (`model_stages_done`), the later stages are planned on the model as it now is. Strict-mode errors (a layer the
    scheme cannot hold) surface here, before any heavy work."""
    from ..arch import get_arch

    steps, claimed = [], {}
    for i, stage in enumerate(stages):
        if stage.whole_model and model_stages_done:
            steps.append(None)
            continue
        step = stage.plan(model, arch, claimed, i)
        reshaped = getattr(step, "reshaped", None)
        if reshaped is not None:
            model, arch = reshaped, get_arch(reshaped)
        steps.append(step)
    return Plan(tuple(stages), steps, model, arch)


@dataclass
class BlockState:
    """One decoder block as the stages see it during the calibration pass."""

    index: int
    prefix: str  # the block's full name, e.g. model.layers.3
    module: nn.Module
    observer: BlockObserver | None  # the linears' input statistics and the inspect modules' calls
    # block-relative linear name -> what its inputs are divided by since the pass observed them (a smoothing stage
    # folded 1/s into the op before it): every reader of the statistics goes through `inputs()`, which corrects them
    divisor: dict[str, Tensor] = field(default_factory=dict)
    # block-relative linear name -> AWQ's clipping as range factors, for the quantize stage's grid (clip_to: grid)
    clip: dict[str, Tensor] = field(default_factory=dict)
    observed: dict[int, Any] = field(default_factory=dict)  # stage index -> what its own `observing` recorded

    def inputs(self, name: str) -> LayerInputs:
        """The calibration inputs of linear `name` (relative to the block), corrected for folded scales."""
        stats = None if self.observer is None else self.observer.stats.get(name)
        return LayerInputs(f"{self.prefix}.{name}", stats, self.divisor.get(name), self.clip.get(name))

    def under(self, names) -> set[str]:
        """Block-relative names of the full names in `names` that lie in this block."""
        return {n[len(self.prefix) + 1:] for n in names if n.startswith(self.prefix + ".")}


@dataclass
class RunContext:
    """What the runner threads through the stages: the model, its plan, and each stage's running record (filled
    block by block, read by `report`)."""

    model: nn.Module
    plan: Plan
    records: dict[int, Any] = field(default_factory=dict)  # stage index -> that stage's record
    # stage index -> what a stage carries from one block to the next that is not part of its record (AutoRound's
    # `target: model`: the float model's activations at the next block's input)
    carried: dict[int, Any] = field(default_factory=dict)
    calibrated: bool = False  # the calibration pass has run (every decoder block went through the stages)
    profile: Any = None  # the run's core.profile.Profile (None: not timed): stages time their finer phases in it

    @property
    def arch(self) -> ArchSpec:
        return self.plan.arch


def work_dir(out: Path) -> Path:
    """Checkpoints live beside the output (which only appears, renamed, at the very end) so that a crashed
    run can `--resume`; the folder is removed after a successful run."""
    return out.parent / f"{out.name}.work"


@dataclass
class ModelStageContext:
    """What the whole-model stages (prune, distill) share: the model, the teacher (a copy taken before the first
    of them), the calibration text, the output folder (distillation checkpoints), logging."""

    model: nn.Module
    tokenizer: Any
    arch: ArchSpec
    calibration: Any  # the recipe's CalibrationSpec
    out: Any  # Path of the output folder
    resume: bool
    progress: bool
    log: Any
    teacher: nn.Module | None = None
    before_distill: nn.Module | None = None  # the pruned model before distillation, for the before/after evaluation
    stages: tuple = ()  # the recipe's stages, as resolved by the whole-model stages run so far
    samples: Any = None  # the calibration windows [n, seq_len], for the stages after the pass (tune_scales)
    blocks: Any = None  # a streamed run's block source (fisher_blocks.StreamedReads); None: the model's own blocks
    device: Any = None  # where a streamed run's blocks compute


class StageBase:
    """Default lifecycle: a stage that needs nothing, plans nothing and changes nothing."""

    name: ClassVar[str] = ""
    whole_model: ClassVar[bool] = False  # runs on the whole model before the calibration pass (prune, distill)
    after_calibration: ClassVar[bool] = False  # a whole-model stage that runs after the pass instead (tune_scales)
    data_parallel: ClassVar[bool] = True  # what it observes is reduced over processes (distributed.py)
    stores_weights: ClassVar[bool] = False  # replaces linears by quantized ones (the target of a smoothing stage)
    needs_teacher: ClassVar[bool] = False  # the whole-model stages keep a copy of the original model (distill)

    @property
    def needs_calibration(self) -> bool:
        return False

    def stream_problem(self) -> str | None:
        """Why this stage cannot run on a model streamed from disk block by block (None when it can): a
        whole-model stage acts on the model as a whole, unless it overrides this (auto_precision)."""
        if self.whole_model and not self.after_calibration:
            return (f"{self.name} acts on the whole model (run it on a machine where it fits, then stream the "
                    "quantization of its output)")
        return None

    def export_problem(self, formats: tuple[str, ...], index: int, check) -> str | None:
        """Why a run with this stage cannot be exported to `formats` (the recipe's output.formats), as the whole
        message naming the format and the fix; None when it can. Asked before calibration starts, after the planned
        model passed the formats' checks. `check(fmt, offered, together)`: the problems `fmt` finds in the planned
        model when the layers of the quantize stage this stage prepares take the schemes `offered` at run time, dealt
        out in turn (by fused group when `together`; one scheme: every layer that can hold it takes it)."""
        return None

    def stored_bytes(self, basis: MemoryBasis) -> int | None:
        """The whole model's bytes once this stage has stored its weights; None when it stores none (the memory
        plan takes the first stage that answers, else the model at the run's dtype)."""
        return None

    def added_bytes(self, basis: MemoryBasis) -> int:
        """Bytes this stage adds to the model as stored, beside the weights of the stage that stores them (eora's
        low-rank terms); 0 for most stages."""
        return 0

    def pass_memory(self, basis: MemoryBasis) -> PassMemory:
        """What this block stage adds to the calibration pass's memory. Asked without a plan (the memory plan comes
        before any model is loaded), so it depends on the stage's settings and the model's sizes alone."""
        return PassMemory()

    def memory_phases(self, basis: MemoryBasis) -> list[MemoryPhase]:
        """The phases this stage holds memory in outside the calibration pass, or adds to (see MemoryPhase)."""
        return []

    def memory_fix(self, parts: dict[str, int]) -> str | None:
        """What would shrink this stage's share of `parts` (the phase of the run that does not fit), for the
        memory plan's refusal; None when none of them is this stage's."""
        return None

    def check(self, index: int, stages: tuple, calibrated: bool):
        """Validate against the other stages; return the stage (a resolved copy where something is inherited)."""
        if self.needs_calibration and not calibrated:
            raise ValueError(f"`stages.{index}` ({self.name}) needs calibration data; add a `calibration:` section "
                             "(e.g. `calibration: {preset: wikitext2}`)")
        return self

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int):
        return None

    def describe(self, plan: Plan, index: int) -> tuple[list[str], Any]:
        """(lines for `compress inspect`, the same as JSON-able data)."""
        return [f"\nstage {index}: {self.name}"], None

    def observed_layers(self, step) -> set[str]:
        return set()

    def needs(self, plan: Plan, index: int) -> Needs:
        return NO_NEEDS

    def begin(self, ctx: RunContext, index: int) -> None:
        """Before the calibration pass (or instead of it, when there is none)."""

    def observing(self, block: BlockState, index: int):
        """A context manager active during the block's float forward (its own observation of the block)."""
        return contextlib.nullcontext()

    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        pass

    def finalize(self, ctx: RunContext, index: int) -> None:
        pass

    def report(self, ctx: RunContext, index: int) -> dict:
        """The stage's report section (its StageRecord's to_json())."""
        return StageRecord(index, self.name).to_json()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        raise NotImplementedError(f"{self.name} is not a whole-model stage")

    def resolve_stages(self, stages: tuple, index: int, section: dict) -> tuple:
        """After `run_model`: the recipe's stages with what this stage decided written into them (auto_precision
        sets the next quantize stage's layer_schemes); the run continues with these, and recipe.resolved.yaml holds
        them, so the resolved recipe reproduces the decision without measuring again."""
        return stages

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        return ["", f"## Stage {section['index']}: {section['stage']}"]
