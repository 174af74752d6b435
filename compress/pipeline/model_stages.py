"""Running the whole-model stages (prune, distill: `whole_model = True`), in recipe order, before calibration; and
those that act on the compressed model after it (`after_calibration = True`: tune_scales).

The teacher is a copy of the model taken before the first of them, when a stage asks for one. Under
`accelerate launch` every process runs the same deterministic pruning, distillation is data-parallel, and only the
main process goes on to quantize, save and evaluate.
"""
from __future__ import annotations

import copy

from torch import nn

from ..calibrate.distributed import world  # noqa: F401 (the model stages' processes are the launcher's)
from ..stages.base import work_dir  # noqa: F401 (the runs clean it up)
from .options import RunOptions


def run_model_stages(model: nn.Module, tokenizer, arch, opts: RunOptions,
                     blocks=None) -> tuple[dict[int, dict], nn.Module | None, tuple]:
    """Run the recipe's whole-model stages in order (their files under `opts.out`). Returns {stage index: report
    section}, the model as it was before distillation (for the before/after evaluation) or None when nothing was
    distilled, and the recipe's stages as the whole-model stages resolved them (`resolve_stages`: auto_precision's
    per-layer schemes). A streamed run passes its block source (`blocks`): auto_precision, the one such stage it
    allows, reads the blocks from there and computes them on `opts.device` (a resident model's where it is)."""
    from ..arch import get_arch
    from ..stages.base import ModelStageContext

    recipe = opts.recipe
    stages = [(i, s) for i, s in enumerate(recipe.stages) if s.whole_model and not s.after_calibration]
    if not stages:
        return {}, None, recipe.stages
    rank, _ = world()
    main = rank == 0
    ctx = ModelStageContext(model, tokenizer, arch, recipe.calibration, opts.out, opts.resume, opts.progress and main,
                            opts.log if main else (lambda *_: None), stages=recipe.stages, blocks=blocks,
                            device=opts.device if blocks is not None else None)
    if any(s.needs_teacher for _, s in stages):
        ctx.teacher = copy.deepcopy(model).eval()
    reports = {}
    for i, stage in stages:
        reports[i] = stage.run_model(ctx, i)
        ctx.stages = stage.resolve_stages(ctx.stages, i, reports[i])
        ctx.arch = get_arch(model)  # a prune changes the block list
    return reports, ctx.before_distill, ctx.stages


def run_after_stages(model: nn.Module, tokenizer, opts: RunOptions, samples, load_teacher) -> dict[int, dict]:
    """Run the stages that act on the compressed model after the calibration pass, in recipe order, with the
    original model as their teacher (`load_teacher()`: reloaded from the source, as the evaluation's baseline is,
    rather than copied before the pass, which would double the pass's peak). Returns {stage index: report section}."""
    from ..arch import get_arch
    from ..stages.base import ModelStageContext

    recipe = opts.recipe
    stages = [(i, s) for i, s in enumerate(recipe.stages) if s.after_calibration]
    if not stages:
        return {}
    opts.log("reloading the original model as the teacher ...")
    ctx = ModelStageContext(model, tokenizer, get_arch(model), recipe.calibration, opts.out, False, opts.progress,
                            opts.log, teacher=load_teacher().eval(), stages=recipe.stages, samples=samples)
    return {i: stage.run_model(ctx, i) for i, stage in stages}
