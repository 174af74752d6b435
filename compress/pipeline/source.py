"""One run over a model source: `run_source` is the sequence both runs follow (plan, whole-model stages, calibration
pass, after-stages, save, evaluate, export, report); a `ModelSource` is what differs between a model loaded whole
(resident.ResidentSource, `run`) and one streamed from disk block by block (streamed.StreamedSource, `run_streamed`).
The sources live beside their runs (this module imports neither: resident.py and streamed.py import it).

The two sequences as they were, each difference and where it went ([source]: a ModelSource method or attribute;
[shared]: one step of run_source for both):
 1. Refusals before any work: a streamed run refuses what it cannot do (a source kind loaded whole, a stage's
    stream_problem, exports without a saved checkpoint, eval.tasks, self-generated calibration), the resident run
    nothing. [source] StreamedSource.refusals (stream_blockers), checked by run_streamed and by choose_plan.
 2. Before opening: the resident run checks a resumed run's work folder (in `run`, before the memory plan); the
    streamed run reads its pass's checkpoint state, removes a stale work folder and creates OUTPUT.work/output.
    [source] `prepare` (a no-op for the resident source; `run` keeps its check where it was).
 3. Opening: load_model and the planted outliers, against open_streamed; each logs its own line. [source] `open`,
    timed as "load" [shared].
 4. What the report and the provenance record name: loaded.source / loaded.kind / the planted outliers, against
    streamed.source_name / streamed.kind / None. [source] `name`, `kind`, `planted`; provenance [shared].
 5. The parameter count: sum over model.parameters() against parameters() — the same count (both count each
    shared tensor once; meta tensors have their numel). [shared] `parameters`.
 6. The architecture: get_arch(model) each time (a prune changes the block list) against the streamed model's.
    [source] `arch`.
 7. Refusals on the plan: the formats the planned model cannot be written in (check_formats), against a quantized
    per-layer input (its streamed evaluation would see the float layer). [source] `check_plan`, called after each
    plan [shared]: the streamed check now also sees the plan as the whole-model stages resolved it (it ran only on
    the first), the formats check is still the resident run's alone (see below).
 8. Whole-model stages: run_model_stages on the model (prune, distill, auto_precision; the model before distillation
    for the before/after evaluation), against streamed_model_stages (auto_precision reading the blocks from disk, its
    choice kept for --resume, only the main process writes it); timed as "prune_distill" against "model_stages".
    [source] `model_stages` and `stages_timing`; planning again on their result [shared].
 9. The report's header and memory plan: the same calls (the streamed run took plan.arch's equal, streamed.arch).
    [shared].
10. The calibration pass's extras: the spill folder, against the spill folder, the block source, the evaluation
    windows carried through the pass (and the baseline's figures taken before it), the shard writer and the
    pass's checkpoint. [source] `pass_extras`; the pass itself [shared].
11. A pass that stops: the streamed run logs how to resume it. [source] `stopped`.
12. The other processes of a torchrun stop after the pass. [shared].
13. Stages after calibration (tune_scales): their teacher is the original model reloaded; a streamed run refuses
    them (1), so the step runs for both and finds none there. [source] `reload` (the streamed source refuses);
    the step [shared].
14. Threads back to model.threads after the pass: before the save (resident), before the evaluation (streamed).
    [shared], before the save.
15. Staging: a fresh temporary sibling, removed on failure, against OUTPUT.work/output, written block by block and
    kept for --resume; the streamed run wrapped only the report's writing in `staged`. [source] `staging`; `staged`
    wraps the whole tail for both [shared] (a failure leaves the streamed folder in place either way).
16. Saving: save_compressed, against the tensors outside the blocks added to the shards already written, the
    shards closed and the model files written. [source] `save`, timed as "save" when output.save_model [shared].
17. Evaluating: the baseline reloaded, both models evaluated on the device and moved back to the CPU, against the
    scores of the hidden states carried through the pass; the baseline's bf16 bytes (of the reloaded baseline,
    against 2 x the parameter count). [source] `evaluate`, timed as "eval" [shared].
18. The report's memory section: the same fields [shared]; the streamed run measured checkpoint_bytes after the
    exports were written into the output (folder_bytes counts their shards too): now both measure the checkpoint
    alone, before the exports.
19. Order: the streamed run exported before it evaluated; now both save, evaluate, export (a streamed report's
    keys and timings come in that order; its values are unchanged but for 18).
20. Exporting: written from the model and verified on reloading, against written from the saved checkpoint block by
    block, not verified. [source] `export`, timed as "export" when output.formats [shared].
21. The streamed run's own report section (where the weights came from, a resumed block, what was not measured).
    [source] `sections`.
22. Timings and the profile (every phase's seconds against this machine's measured peaks, core/profile.py and
    measure/machine.py), the recipe files, the report, removing OUTPUT.work, the last log line. [shared].
Left as it was: the formats check (7) could be shared (a streamed run writes the same formats, from the checkpoint,
and today meets an unwritable one only at its end); that would refuse some streamed runs up front that run today.
"""
from __future__ import annotations

import dataclasses
import os
import shutil

from torch import nn

from ..core.profile import Profile, phase_of
from ..measure.machine import machine_peaks, profile_section
from ..measure.memory import folder_bytes
from ..export.card import write_run_cards
from ..export.staging import staged
from ..stages.base import make_plan
from .calibration import PassExtras, Timings, compress_model, run_header, set_threads, write_run_report
from .model_stages import run_after_stages, work_dir, world
from .options import RunOptions
from .provenance import provenance


class ModelSource:
    """Where a run's model comes from and what that changes. After `open`: `model`, `tokenizer`, `name` (the source
    as resolved, for the provenance record), `kind` (how it was loaded) and `planted` (outliers planted on load)."""

    stages_timing = "model_stages"  # the timings key of the whole-model stages
    staging = None  # the folder the output is staged in (None: a fresh temporary sibling, export.staging.staged)
    planted = None

    def prepare(self, opts: RunOptions) -> None:
        """What comes before opening the model (nothing, by default)."""

    def open(self, opts: RunOptions) -> None:
        """Load the model, or open it for streaming."""
        raise NotImplementedError

    @property
    def arch(self):
        raise NotImplementedError

    def check_plan(self, plan, formats: tuple[str, ...]) -> None:
        """Refuse, before any heavy work, a plan this source cannot run (or whose `formats` it cannot write)."""

    def model_stages(self, opts: RunOptions) -> tuple[dict, nn.Module | None, tuple]:
        """The whole-model stages run before the calibration pass: run_model_stages's (reports, the model before
        distillation, the stages as they resolved them)."""
        raise NotImplementedError

    def pass_extras(self, opts: RunOptions, model_reports: dict) -> PassExtras:
        """What the calibration pass takes beyond the model (calibration.PassExtras)."""
        raise NotImplementedError

    def stopped(self, opts: RunOptions) -> None:
        """The calibration pass stopped with an error (or Ctrl-C), which is raised after this."""

    def reload(self, opts: RunOptions) -> nn.Module:
        """The original model again (a teacher after the pass)."""
        raise NotImplementedError

    def save(self, tmp, opts: RunOptions, record: dict) -> None:
        """The compressed model into the staging folder `tmp` (output.save_model)."""
        raise NotImplementedError

    def evaluate(self, opts: RunOptions, before_distill: nn.Module | None) -> tuple[dict, int]:
        """The report's `eval` section and the baseline's size in bfloat16."""
        raise NotImplementedError

    def export(self, tmp, opts: RunOptions, record: dict, samples) -> list[dict]:
        """Each format of output.formats into tmp/exports/<format>/: the report's `exports` section."""
        raise NotImplementedError

    def sections(self, opts: RunOptions) -> dict:
        """The report sections of this source alone."""
        return {}


def parameters(model: nn.Module) -> int:
    """Parameter count including the meta-device ones, each shared tensor once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def run_source(source: ModelSource, opts: RunOptions, memory=None) -> dict:
    """The run on `source`, given the options the entry point resolved (and its memory plan, for the report): see the
    module docstring."""
    if opts.profile is None:
        opts = dataclasses.replace(opts, profile=Profile())
    recipe, log = opts.recipe, opts.log
    source.prepare(opts)
    set_threads(recipe.model.threads)
    timings = Timings(opts.profile)
    with timings("load"):
        source.open(opts)
    model, tokenizer = source.model, source.tokenizer
    record = provenance(recipe, source.name)
    n_params = parameters(model)
    # strict-mode errors and impossible exports surface here, on the shapes after pruning, before any heavy work
    plan = make_plan(model, source.arch, recipe.stages)
    source.check_plan(plan, recipe.output.formats)
    with timings(source.stages_timing, any(s.whole_model and not s.after_calibration for s in recipe.stages)):
        model_reports, before_distill, stages = source.model_stages(opts)
    if model_reports:  # planned again on the model as pruned and distilled, with the stages as they resolved them
        recipe = dataclasses.replace(recipe, stages=stages)
        opts = dataclasses.replace(opts, recipe=recipe)
        plan = make_plan(model, source.arch, recipe.stages, model_stages_done=True)
        source.check_plan(plan, recipe.output.formats)
    report = run_header(record, recipe, source.kind, model, plan.arch, n_params, opts.device, source.planted)
    if memory is not None:
        report["memory_plan"] = memory.to_dict()
    with phase_of(opts.profile, "pass setup"):  # a streamed run's evaluation windows and baseline figures
        extras = dataclasses.replace(source.pass_extras(opts, model_reports), profile=opts.profile)
    try:
        with timings("compress"):
            sections, samples = compress_model(model, tokenizer, recipe, plan, opts.device, opts.progress, log,
                                               extras)
    except BaseException:
        source.stopped(opts)
        raise
    if world()[0] != 0:  # torchrun / `accelerate launch`: the other processes helped distill and calibrate
        return {}
    with timings("tune", any(s.after_calibration for s in recipe.stages)):
        for i, section in run_after_stages(model, tokenizer, opts, samples, lambda: source.reload(opts)).items():
            sections["stages"][i] = section
    report.update(sections)
    set_threads(recipe.model.threads)
    with staged(opts.out, source.staging) as tmp:
        report.update(write_output(source, opts, record, before_distill, samples, tmp, timings))
        write_run_report(report, tmp)
        write_run_cards(report, tmp)  # README.md, the Hub's model card, in the run folder and each export
    shutil.rmtree(work_dir(opts.out), ignore_errors=True)  # distillation checkpoints, a streamed pass's: finished
    log(f"wrote {opts.out}/report.md")
    return report


def write_output(source: ModelSource, opts: RunOptions, record: dict, before_distill, samples, tmp,
                 timings: Timings) -> dict:
    """Save the compressed model into `tmp`, evaluate it (beside the baseline, and the pruned model before
    distillation), write the exports and the recipe files; returns the report sections added here."""
    recipe = opts.recipe
    report: dict = {}
    if recipe.output.save_model:
        with timings("save"):
            source.save(tmp, opts, record)
    with timings("eval"):
        report["eval"], baseline_bytes = source.evaluate(opts, before_distill)
    report["memory"] = {"checkpoint_bytes": folder_bytes(tmp) if recipe.output.save_model else None,
                        "baseline_checkpoint_bf16_bytes": baseline_bytes}
    if recipe.output.formats:
        with timings("export"):
            report["exports"] = source.export(tmp, opts, record, samples)
    report.update(source.sections(opts))
    report["timings"] = dict(timings)
    with phase_of(opts.profile, "machine probe"):  # this machine's peaks, cached after the first run
        threads = (recipe.calibration or recipe.model).threads  # the pass's, where most of the work is
        peaks = machine_peaks(opts.device, threads if threads > 0 else os.cpu_count() or 1)
    report["profile"] = profile_section(opts.profile, peaks)
    (tmp / "recipe.yaml").write_text(recipe.text or recipe.resolved_yaml())
    (tmp / "recipe.resolved.yaml").write_text(recipe.resolved_yaml())
    return report
