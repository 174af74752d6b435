"""The `tune_scales` stage: after the calibration pass, the quantized model's scales are trained end to end by
distillation from the original model while every integer code stays as the quantizer rounded it (EfficientQAT's
E2E-QP; the parametrization is in scale_tuning.py, the training loop is the distill stage's, distill.py).

It trains on the calibration windows (the text the recipe already chose), `epochs` passes over them. The checkpoint
keeps its format and size: only scale values change, so every export that held the quantized model holds the tuned
one. It needs the whole model and the original beside it (the teacher, reloaded from the source), so a streamed run
refuses it.

`train: [scales, lowrank]` (or `[lowrank]`) also trains the low-rank repair terms an `eora` stage set, end to end
against the original model instead of layer by layer: the same bytes and the same adapter, fitted to the whole
model's output (distill/scale_tuning.py: tuning)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..calibrate.data import eval_windows
from ..distill.kd import distill
from ..calibrate.distributed import world
from ..distill.scale_tuning import tunable_layers, tuning
from ..export.adapter import lowrank_layers
from .base import MemoryBasis, MemoryPhase, ModelStageContext, Plan, StageBase, StageRecord, inline, work_dir
from .distill import DistillStage, _render, teacher_casts_bytes


TRAINABLE = ("scales", "lowrank")
WHAT = {"scales": "every weight-only quantized layer's scales", "lowrank": "the eora stage's low-rank terms"}


@dataclass
class TuneScalesRecord(StageRecord):
    """The tune_scales stage's report section: what was tuned, and the training run's record (kd.distill)."""

    data: str
    layers: int
    parameters: int  # scales tuned
    not_tuned: dict  # layer -> why its scales were not tuned
    epochs: int
    eval_windows: list  # [windows, tokens each] of the before/after points
    training: dict = inline()
    train: list = field(default_factory=lambda: ["scales"])  # what was trained: scales, lowrank
    lowrank_layers: int = 0  # layers whose low-rank terms were trained
    lowrank_parameters: int = 0  # their A and B values


@dataclass(frozen=True)
class TuneScalesStage(StageBase):
    """Recipe stage `tune_scales`: end-to-end scale tuning of the quantized model by distillation (codes frozen)."""
    epochs: int = 1  # passes over the calibration windows
    steps: int = 0  # optimizer steps instead (0: epochs' worth); fewer than an epoch's draw distinct windows
    batch_size: int = 4  # windows per optimizer step
    lr: float = 1e-3  # peak learning rate (AdamW) of the log-gains: 1e-3 moves a scale by about 0.1% per step
    min_lr: float = 1e-4  # cosine decays to this
    warmup_steps: int = 0
    temperature: float = 1.0  # KD temperature (loss times T**2)
    max_grad_norm: float = 1.0
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # auto: bf16 where the hardware has it
    # recompute each block's forward in the backward: one block's dequantized weights and activations are held at
    # a time instead of every block's (large models), for about a third more time
    gradient_checkpointing: bool = False
    seed: int = 0
    eval_windows: int = 2  # before/after points on held-out WikiText-2 test windows (never trained on); 0 = none
    eval_seq_len: int = 1024
    eval_every: int = 0  # a curve point every N steps (0 = only before and after)
    # what is trained: "scales" (every weight-only quantized layer's scales), "lowrank" (the terms an earlier eora
    # stage set, A and B, trained end to end instead of fitted layer by layer), or both
    train: tuple[str, ...] = ("scales",)

    def __post_init__(self):
        if not self.train or len(set(self.train)) != len(self.train) or \
                not set(self.train) <= set(TRAINABLE):
            raise ValueError(f"tune_scales train={list(self.train)!r}; name one or both of {list(TRAINABLE)} once "
                             "(e.g. train: [scales, lowrank])")
        if not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1:
            raise ValueError(f"tune_scales epochs={self.epochs!r}; use a positive integer")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"tune_scales steps={self.steps!r}; use a positive integer (or 0: epochs' worth)")
        if self.steps and self.epochs != 1:
            raise ValueError(f"tune_scales sets both epochs={self.epochs} and steps={self.steps}; set one of them")
        self.training(windows=max(self.batch_size, 1) * (self.warmup_steps + 1), seq_len=1)  # checks the rest

    def training(self, windows: int, seq_len: int) -> DistillStage:
        """The distill loop's settings for `windows` calibration windows of `seq_len` tokens, checked by its rules."""
        try:
            return DistillStage(steps=self.steps or max(1, self.epochs * windows // max(self.batch_size, 1)),
                                batch_size=self.batch_size, seq_len=seq_len, lr=self.lr, min_lr=self.min_lr,
                                warmup_steps=self.warmup_steps, temperature=self.temperature,
                                eval_every=self.eval_every, checkpoint_every=0, mixed_precision=self.mixed_precision,
                                max_grad_norm=self.max_grad_norm, seed=self.seed,
                                gradient_checkpointing=self.gradient_checkpointing, eval_windows=self.eval_windows,
                                eval_seq_len=self.eval_seq_len)
        except ValueError as exc:
            raise ValueError(str(exc).replace("distill ", "tune_scales ", 1)) from None

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "tune_scales"
    whole_model: ClassVar[bool] = True
    after_calibration: ClassVar[bool] = True  # runs on the compressed model, after the calibration pass

    @property
    def needs_calibration(self) -> bool:
        return True  # it trains on the calibration windows

    def check(self, index: int, stages: tuple, calibrated: bool) -> "TuneScalesStage":
        super().check(index, stages, calibrated)
        if world()[1] > 1:
            raise ValueError(f"`stages.{index}` (tune_scales) runs in one process; run this recipe without torchrun "
                             "/ accelerate launch (or drop the stage)")
        if "lowrank" in self.train and not any(s.name == "eora" for s in stages[:index]):
            raise ValueError(f"`stages.{index}` (tune_scales) trains low-rank terms (train: [lowrank]), but no "
                             "`stage: eora` before it sets any; add one after the quantize stage, or train: [scales]")
        if not any(getattr(s, "stores_weights", False) for s in stages[:index]):
            raise ValueError(f"`stages.{index}` (tune_scales) tunes the scales of quantized layers; put a "
                             "`stage: quantize` before it")
        later = [s.name for s in stages[index + 1:] if not getattr(s, "after_calibration", False)]
        if later:
            raise ValueError(f"`stages.{index}` (tune_scales) runs after the calibration pass, but {later} come "
                             "after it in the recipe; make tune_scales the last stage")
        return self

    def stream_problem(self) -> str | None:
        return ("tune_scales trains the whole compressed model beside the original (run it where both fit, with "
                "gradient_checkpointing: true; or drop the stage)")

    def memory_phases(self, basis: MemoryBasis) -> list[MemoryPhase]:
        """After the calibration pass: the compressed model, the original as its teacher, and the training
        (tune_scales_bytes). (A streamed run refuses it.)"""
        if basis.streamed or basis.calibration is None:
            return []
        return [MemoryPhase("tune_scales", {"compressed model": basis.compressed, "teacher": basis.weights,
                                            **teacher_casts_bytes(basis, self.mixed_precision),
                                            **self.tuning_bytes(basis.size, basis.calibration.seq_len),
                                            **self.lowrank_bytes(basis)},
                            after_pass=True)]

    def lowrank_bytes(self, basis: MemoryBasis) -> dict[str, int]:
        """train: [lowrank]: the terms the stages added (basis.added, at the run's dtype) trained in float32: the
        float32 copy where the run's dtype is narrower, their gradients and AdamW's two moments."""
        if "lowrank" not in self.train or not basis.added:
            return {}
        values = basis.added // basis.width
        return {"low-rank terms' training": values * 4 * (3 + (basis.width < 4))}

    def tuning_bytes(self, size, seq_len: int) -> dict[str, int]:
        """The training beside both models (`size`: a pipeline.memory_plan.ModelSize): each linear's dequantized
        weight (float32, and its bfloat16 copy under autocast) kept for the backward, in every block or, with gradient
        checkpointing, in one block at a time; one step's activations, about 6 float32 values per token and input
        feature of a block (with checkpointing: one block's, plus every block's input); both models' logits and the
        student's logit gradient, which kd_loss forms chunk by chunk (float32 at most; bf16 autocast holds half).
        A trellis layer's backward also holds its decoded walks (4 bytes per weight; without gradient checkpointing
        every trellis layer's, kept for the whole tuning): not counted, since the plan is not told the method here.
        Measured on the embedded model (4 × 512 tokens a step, bf16 autocast): 5.5 GB peak RSS, where this plans
        7.9 GB (the activations, about 5 values per token and feature, are most of it)."""
        tokens = self.batch_size * seq_len
        blocks = 1 if self.gradient_checkpointing else size.layers
        kept = 4 * tokens * size.hidden * size.layers if self.gradient_checkpointing else 0
        return {"dequantized weights": 6 * size.block_linear_parameters * blocks // size.layers,
                "activations": 4 * 6 * tokens * size.input_features * blocks + kept,
                "logits": 3 * 4 * tokens * size.vocab}

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        what = " and ".join(WHAT[t] for t in TRAINABLE if t in self.train)
        line = (f"\nstage {index}: tune_scales: {what} trained by distillation from the original, codes fixed: "
                + (f"{self.steps} steps" if self.steps else f"{self.epochs} epoch(s)") + " over the calibration windows, "
                f"{self.batch_size} windows per step, lr {self.lr}")
        return [line], line.strip()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        names, skipped = tunable_layers(ctx.model) if "scales" in self.train else ([], {})
        if "scales" in self.train and not names:
            raise ValueError("tune_scales found no weight-only quantized layer to tune "
                             f"({len(skipped)} quantized layers, none weight-only integer or fp8); drop the stage")
        terms = list(lowrank_layers(ctx.model)) if "lowrank" in self.train else []
        if "lowrank" in self.train and not terms:
            raise ValueError("tune_scales train: [lowrank] found no low-rank term (the eora stage set none: see its "
                             "report section); train: [scales], or drop the stage")
        windows = ctx.samples
        if windows.shape[0] < self.batch_size:
            raise ValueError(f"tune_scales batch_size={self.batch_size} but the calibration pass has "
                             f"{windows.shape[0]} windows; lower batch_size or raise calibration.n_samples")
        cfg = self.training(windows.shape[0], windows.shape[1])
        held_out = eval_windows(ctx.tokenizer, "test", self.eval_seq_len, self.eval_windows) \
            if self.eval_windows else None
        what = " and ".join([f"{len(names)} layers' scales"] * bool(names) +
                            [f"{len(terms)} layers' low-rank terms"] * bool(terms))
        ctx.log(f"stage {index}: tune_scales - {what}, {cfg.steps} steps × {cfg.batch_size} calibration windows of "
                f"{cfg.seq_len} tokens" + (f"; not tuned: {len(skipped)} layers" if skipped else ""))
        with tuning(ctx.model, names, terms, decode_once=not self.gradient_checkpointing) as params:
            result = distill(ctx.model, ctx.teacher, windows, cfg, work_dir(ctx.out) / f"tune-{index}",
                             eval_ids=held_out, progress=ctx.progress, log=ctx.log)
            n_lowrank = sum(p.numel() for p in params[len(names):])
            n_gains = sum(p.numel() for p in params[:len(names)])
        ctx.model.eval()
        return TuneScalesRecord(index, "tune_scales", "calibration windows", len(names), n_gains, skipped,
                                self.epochs, [self.eval_windows, self.eval_seq_len], result, list(self.train),
                                len(terms), n_lowrank).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = _render(section)
        what = " and ".join(("the quantized scales", "the low-rank terms")[TRAINABLE.index(t)]
                            for t in section.get("train", ["scales"]))
        lines[1] = (f"## Stage {section['index']}: tune_scales ({what} trained by distillation from the original, "
                    "codes fixed)")
        lowrank = (f"; {section['lowrank_layers']} layers' low-rank terms trained ({section['lowrank_parameters']:,} "
                   "values, the eora stage's shapes)") if section.get("lowrank_layers") else ""
        lines.insert(3, f"{section['layers']} layers, {section['parameters']:,} scales tuned{lowrank}.")
        lines.insert(4, "")
        if section.get("not_tuned"):
            lines += ["", "Not tuned:", ""] + [f"- `{n}`: {why}" for n, why in section["not_tuned"].items()]
        return lines
