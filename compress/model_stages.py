"""Whole-model stages that run before calibration: `prune` (Minitron importance + slicing) and `distill`
(knowledge-distillation repair from the original model).

The teacher is a copy of the model taken before the first prune. Under `accelerate launch` every
process runs the same deterministic pruning, distillation is data-parallel, and only the main process
goes on to quantize, save and evaluate.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from .data import calibration_windows, load_texts, sample_from_model, sequential_windows, tokenize_joined
from .distill import DistillStage, distill
from .evaluate.report import eval_windows
from .prune.minitron import PruneStage, minitron_prune


def world() -> tuple[int, int]:
    """(rank, processes) as `accelerate launch` / torchrun set them; (0, 1) in a plain run."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def work_dir(out: Path) -> Path:
    """Checkpoints live beside the output (which only appears, renamed, at the very end) so that a crashed
    run can `--resume`; the folder is removed after a successful run."""
    return out.parent / f"{out.name}.work"


def distill_texts(stage: DistillStage, teacher: nn.Module, tokenizer, rows_needed: int) -> torch.Tensor:
    """Training windows [N, seq_len] for the distill stage."""
    if stage.data.kind == "self":
        return sample_from_model(teacher, rows_needed, stage.seq_len, stage.seed)
    return sequential_windows(tokenize_joined(load_texts(stage.data), tokenizer), stage.seq_len)


def run_model_stages(model: nn.Module, tokenizer, arch, recipe, calib_source, out: Path, resume: bool,
                     progress: bool, log) -> tuple[dict[int, dict], nn.Module | None]:
    """Run the recipe's prune/distill stages in order. Returns {stage index: report} and the pruned model as
    it was before distillation (for the before/after evaluation), or None when nothing was distilled."""
    stages = [(i, s) for i, s in enumerate(recipe.stages) if isinstance(s, (PruneStage, DistillStage))]
    reports: dict[int, dict] = {}
    if not stages:
        return reports, None
    rank, processes = world()
    teacher = copy.deepcopy(model).eval() if any(isinstance(s, DistillStage) for _, s in stages) else None
    before_distill = None
    for i, stage in stages:
        if isinstance(stage, PruneStage):
            n = max(stage.n_samples, stage.depth_samples)
            log(f"stage {i}: prune — scoring importance on {n} × {stage.seq_len} calibration tokens ...")
            samples = calibration_windows(calib_source, tokenizer, model, n, stage.seq_len, recipe.calibration.seed)
            reports[i] = {"index": i, **minitron_prune(model, arch, samples, stage, progress=progress and rank == 0,
                                                       log=log if rank == 0 else (lambda *_: None))}
            continue
        if before_distill is None:
            before_distill = copy.deepcopy(model).eval()
        rows = stage.steps * stage.batch_size * stage.grad_accum * processes
        train = distill_texts(stage, teacher, tokenizer, rows)
        held_out = eval_windows(tokenizer, "test", stage.eval_seq_len, stage.eval_windows) \
            if stage.eval_windows else None
        log(f"stage {i}: distill — {stage.steps} steps × {rows // stage.steps * stage.seq_len:,} tokens "
            f"({rows * stage.seq_len:,} tokens) from {stage.data.kind}, {len(train)} windows of {stage.seq_len}")
        model.requires_grad_(True)
        result = distill(model, teacher, train, stage, work_dir(out) / f"distill-{i}",
                         eval_ids=held_out, resume=resume, progress=progress and rank == 0,
                         log=log if rank == 0 else (lambda *_: None))
        model.requires_grad_(False).eval()
        reports[i] = {"index": i, "stage": "distill", "data": stage.data.kind, "windows_available": len(train),
                      "eval_windows": [stage.eval_windows, stage.eval_seq_len], **result}
    return reports, before_distill
