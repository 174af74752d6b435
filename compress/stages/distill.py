"""The `distill` stage: knowledge-distillation repair (distill.py) of a pruned model from the original, before
calibration. Under `accelerate launch` distillation is data-parallel; only the main process goes on."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from ..calibrate.data import (TextSource, eval_windows, load_texts, sample_from_model, sequential_windows,
        tokenize_joined)
from ..distill.kd import distill
from ..measure.fmt import num
from ..calibrate.distributed import world
from .base import MemoryBasis, MemoryPhase, ModelStageContext, Plan, StageBase, StageRecord, inline, work_dir


def teacher_casts_bytes(basis: MemoryBasis, mixed_precision: str) -> dict[str, int]:
    """The teacher's linear weights cast once to bfloat16 for its forwards under autocast (distill/kd.py,
    core/nn.py: cast_linear_weights), where the run's dtype is wider and mixed precision may be on: the blocks'
    linears and the output head, two bytes each."""
    if mixed_precision == "no" or basis.width <= 2:
        return {}
    size = basis.size
    return {"teacher's bf16 weights": 2 * (size.block_linear_parameters + size.vocab * size.hidden)}


@dataclass
class DistillRecord(StageRecord):
    """The distill stage's report section: what it trained on, and the training run's record (kd.distill: steps,
    losses, the recovery curve, ...)."""

    data: str
    windows_available: int
    eval_windows: list  # [windows, tokens each] of the recovery curve
    training: dict = inline()


@dataclass(frozen=True)
class DistillStage(StageBase):
    """Recipe stage `distill`: repair a pruned student by distilling the original model (the teacher) into it."""
    steps: int = 100  # optimizer steps
    batch_size: int = 4  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 256
    lr: float = 1e-4  # peak learning rate (AdamW)
    min_lr: float = 1e-5  # cosine decays to this
    warmup_steps: int = 10  # linear warm-up from 0
    weight_decay: float = 0.0
    temperature: float = 1.0  # KD temperature; loss is multiplied by T**2 (Hinton)
    hidden_weight: float = 0.0  # weight of the final-hidden-state MSE (needs equal hidden sizes)
    eval_every: int = 25  # recovery-curve point every N steps (0 = only at start and end)
    checkpoint_every: int = 50  # accelerator.save_state every N steps and at the end (0 = never)
    keep_checkpoints: int = 2
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # auto: bf16 where the hardware has it (native_bf16)
    gradient_checkpointing: bool = False
    # several processes: shard student and teacher parameters, gradients and AdamW moments over them (torch FSDP2)
    # instead of a full copy of each on every process (DDP); no effect in one process
    fsdp: bool = False
    max_grad_norm: float = 1.0
    seed: int = 0
    # training text (the pipeline cuts it into seq_len windows); kind `self` samples it from the teacher
    data: TextSource = TextSource("wikitext2", "validation")
    eval_windows: int = 4  # recovery curve: WikiText-2 test windows (never trained on); 0 = no curve
    eval_seq_len: int = 1024

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "keep_checkpoints"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"distill {name}={v!r}; use a positive integer")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed", "eval_windows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"distill {name}={v!r}; use an integer >= 0")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"distill warmup_steps={self.warmup_steps} >= steps={self.steps}; "
                             f"use warmup_steps < steps (e.g. {self.steps // 10})")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"distill min_lr={self.min_lr}, lr={self.lr}; need 0 < min_lr <= lr")
        if not self.temperature > 0:
            raise ValueError(f"distill temperature={self.temperature}; use a temperature > 0 (1.0 = plain KL)")
        for name in ("weight_decay", "hidden_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"distill {name}={getattr(self, name)}; use a value >= 0")
        if not self.max_grad_norm > 0:
            raise ValueError(f"distill max_grad_norm={self.max_grad_norm}; use a value > 0 (e.g. 1.0)")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise ValueError(f"distill mixed_precision={self.mixed_precision!r}; use 'auto', 'no' or 'bf16'")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "distill"
    whole_model: ClassVar[bool] = True
    needs_teacher: ClassVar[bool] = True  # the model as it was before the first whole-model stage

    def check(self, index: int, stages: tuple, calibrated: bool) -> "DistillStage":
        if not any(getattr(s, "reshapes", False) for s in stages[:index]):
            raise ValueError(f"`stages.{index}` (distill) repairs a pruned model from the original; put a "
                             "`stage: prune` before it")
        return self

    def memory_phases(self, basis: MemoryBasis) -> list[MemoryPhase]:
        """Distillation holds the teacher, the student's copy before distillation, gradients and AdamW's two moments
        (float32); with fsdp over several processes the teacher, gradients and moments are sharded over them
        (fsdp.py). The evaluation holds the pruned model before distillation too. (A streamed run refuses it.)"""
        if basis.streamed:
            return []
        share = world()[1] if self.fsdp else 1
        weights = basis.weights
        casts = teacher_casts_bytes(basis, self.mixed_precision) if share == 1 else {}  # not on sharded teachers
        return [MemoryPhase("distill", {"weights": weights, "teacher and optimizer":
                                        weights + (weights + basis.size.parameters * 12) // share, **casts}),
                MemoryPhase("evaluation", {"pruned copy": basis.compressed}, after_pass=True)]

    def memory_fix(self, parts: dict[str, int]) -> str | None:
        if parts.get("teacher and optimizer"):
            return ("Distillation holds the teacher and AdamW states beside the student: fewer parameters after "
                    "pruning, or distill on a larger machine.")
        return None

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        tokens = self.steps * self.batch_size * self.grad_accum * self.seq_len
        line = (f"\nstage {index}: distill from the original: {self.steps} steps × {self.batch_size} × "
                f"{self.grad_accum} × {self.seq_len} = {tokens:,} tokens per process from {self.data.kind}, "
                f"lr {self.lr}, temperature {self.temperature}")
        return [line], line.strip()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        if ctx.before_distill is None:
            ctx.before_distill = copy.deepcopy(ctx.model).eval()
        _, processes = world()
        rows = self.steps * self.batch_size * self.grad_accum * processes
        train = distill_texts(self, ctx.teacher, ctx.tokenizer, rows)
        held_out = eval_windows(ctx.tokenizer, "test", self.eval_seq_len, self.eval_windows) \
            if self.eval_windows else None
        ctx.log(f"stage {index}: distill — {self.steps} steps × {rows // self.steps * self.seq_len:,} tokens "
                f"({rows * self.seq_len:,} tokens) from {self.data.kind}, {len(train)} windows of {self.seq_len}")
        ctx.model.requires_grad_(True)
        result = distill(ctx.model, ctx.teacher, train, self, work_dir(ctx.out) / f"distill-{index}",
                         eval_ids=held_out, resume=ctx.resume, progress=ctx.progress, log=ctx.log)
        ctx.model.requires_grad_(False).eval()
        return DistillRecord(index, "distill", self.data.kind, len(train), [self.eval_windows, self.eval_seq_len],
                             result).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        return _render(section)


def distill_texts(stage: DistillStage, teacher: nn.Module, tokenizer, rows_needed: int) -> torch.Tensor:
    """Training windows [N, seq_len] for the distill stage."""
    if stage.data.kind == "self":
        return sample_from_model(teacher, rows_needed, stage.seq_len, stage.seed)
    return sequential_windows(tokenize_joined(load_texts(stage.data), tokenizer), stage.seq_len)


def _render(stage: dict) -> list[str]:
    lines = ["", f"## Stage {stage['index']}: distill (knowledge distillation from the original)", "",
             f"{stage['steps']} steps, {stage['tokens']:,} training tokens from {stage['data']} in "
             f"{stage['seconds'] / 60:.1f} min ({stage['tokens_per_s']:.0f} tokens/s, {stage['processes']} "
             f"process{'es' if stage['processes'] > 1 else ''}"
             f"{', sharded with FSDP' if stage.get('sharded') == 'fsdp' else ''}, "
             f"mixed precision {stage['mixed_precision']})"
             + (f"; resumed from step {stage['resumed_from']}" if stage.get("resumed_from") else "") + "."]
    curve = stage.get("curve") or []
    if curve:  # without eval_windows only the training loss is known
        teacher = (stage.get("teacher") or {}).get("ppl")
        windows, seq = stage.get("eval_windows", ["?", "?"])
        lines += ["", f"Recovery curve on {windows} held-out WikiText-2 test windows of {seq} tokens"
                  + (f" (teacher perplexity {teacher:.3f})" if teacher else "") + ":", "",
                  "| step | tokens | minutes | perplexity | KL to teacher | train loss |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['step']} | {p['tokens']:,} | {p['seconds'] / 60:.1f} | {num(p['ppl'], '{:.3f}')} | "
                  f"{num(p['kl'])} | {num(p.get('train_loss'))} |" for p in curve]
        if any(p["ppl"] is not None for p in curve):
            lines += ["", f"![recovery curve](recovery_curve_stage{stage['index']}.png)"]
    return lines
