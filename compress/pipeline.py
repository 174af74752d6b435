"""`compress run`: load -> plan -> calibrate block by block -> apply stages -> save -> evaluate -> report.

State is passed explicitly; the output folder is written under a temporary name and renamed into
place at the end, so a crash or Ctrl-C never leaves a half-written output.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ._version import __version__
from .arch import get_arch
from .blockwise import run_blockwise
from .data import calibration_windows, fingerprint
from .evaluate.memory import folder_bytes
from .evaluate.plots import plot_recovery
from .evaluate.report import evaluate_models, write_report
from .memory_plan import MemoryPlan, conversion_bytes, plan_memory
from .models import (checkpoint_files, load_compressed, load_config, load_model, quantized_skeleton, resolve_device,
                     resolve_dtype, save_compressed)
from .nn import QuantLinear, is_linear
from .observers import BlockObserver
from .outliers import plant_outliers
from .model_stages import run_model_stages, work_dir, world
from .recipe import Recipe, to_plain
from .stages.base import BlockState, Plan, RunContext, make_plan


def set_threads(n: int) -> None:
    torch.set_num_threads(n if n > 0 else (os.cpu_count() or 1))


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"output folder {out} exists; pass --overwrite (or output.overwrite: true) to replace it, "
                              "or choose another output.dir")


def calibration_samples(recipe: Recipe, model, tokenizer) -> tuple[torch.Tensor, dict]:
    cal = recipe.calibration
    samples = calibration_windows(cal.source(), tokenizer, model, cal.n_samples, cal.seq_len, cal.seed)
    info = {k: v for k, v in asdict(cal).items() if v not in (None, ())}
    info.update(fingerprint=fingerprint(samples), tokens=int(samples.numel()))
    return samples, info


class StagePass:
    """The block stages of a plan inside the calibration pass: per block, what to observe during its float forward
    (the statistics the stages' `needs` ask for, of the layers the plan quantizes, plus each stage's own
    `observing`), then each stage's `on_block` in recipe order."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.stages = [(i, ctx.plan.stages[i]) for i in ctx.plan.block_stages]
        self.needs = ctx.plan.needs()
        self.observed = ctx.plan.observed_layers()  # only the layers a stage will use statistics of

    def observe(self, i: int, prefix: str, block) -> "_Observing":
        linears = [n for n, m in block.named_modules() if n and is_linear(m) and not isinstance(m, QuantLinear)
                   and f"{prefix}.{n}" in self.observed]
        observer = None
        if linears and self.needs.any:
            nd = self.needs
            inspect = sorted({insp for _, _, insp in self.ctx.arch.awq}) if nd.replay_samples else []
            observer = BlockObserver(block, linears, inspect, abs_mean=nd.abs_mean, hessian=nd.hessian,
                                     keep_samples=nd.replay_samples, abs_max=nd.abs_max)
        state = BlockState(i, prefix, block, observer)
        return _Observing(state, ([observer] if observer is not None else []) +
                          [stage.observing(state, k) for k, stage in self.stages])

    def on_block(self, _i: int, _prefix: str, _block, _inputs, observing: "_Observing") -> None:
        for k, stage in self.stages:
            stage.on_block(self.ctx, observing.state, k)


class _Observing:
    """The context managers active during one block's float forward, and the block's state for the stages."""

    def __init__(self, state: BlockState, contexts: list):
        self.state, self.contexts = state, contexts
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "_Observing":
        for c in self.contexts:
            self._stack.enter_context(c)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


def start_stages(model, plan: Plan) -> RunContext:
    """The run context, after each block stage's `begin` (before the calibration pass, or instead of it)."""
    ctx = RunContext(model, plan)
    for i in plan.block_stages:
        plan.stages[i].begin(ctx, i)
    return ctx


def kept_in_float(model) -> list[str]:
    """Weight-holding modules outside the linear layers (embeddings, norms): reported, never silent."""
    kinds: dict[str, int] = {}
    for name, m in model.named_modules():
        if is_linear(m) or not isinstance(getattr(m, "weight", None), torch.Tensor) or list(m.children()):
            continue
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    return [f"{n}× {k} (weight-only integer schemes apply to linear layers)" for k, n in sorted(kinds.items())]


def planned_model(model, plan: Plan) -> torch.nn.Module:
    """A meta-device copy of `model` with the planned QuantLinear layers: what the export checks see before
    any weight is quantized. A tied lm_head planned with tied_lm_head: untie is untied in the copy's config
    too, as apply_quantize will do to the model."""
    import copy

    entries = [e for stage, step in zip(plan.stages, plan.steps) if stage.stores_weights for e in step.quantized]
    config = copy.deepcopy(model.config)
    if any(e.untie for e in entries):
        for c in {id(c): c for c in (config, config.get_text_config())}.values():
            c.tie_word_embeddings = False
    return quantized_skeleton(config, {e.name: e.scheme for e in entries})


def check_formats(model, plan: Plan, formats: tuple[str, ...]) -> None:
    from .export import check_export
    if formats:
        meta = planned_model(model, plan)
        for fmt in formats:
            check_export(meta, fmt)


def verify_windows(recipe: Recipe, tokenizer, samples: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
    """Token windows the exports are compared on: WikiText-2 (the eval split) where it is available, else the
    calibration windows (both renderings of one model are compared, so held-out text is not essential)."""
    from .data import find_data_dir
    from .evaluate.report import eval_windows

    n = recipe.output.verify_windows
    if not n:
        return None, "not verified (output.verify_windows: 0)"
    if find_data_dir() is not None:
        return eval_windows(tokenizer, recipe.eval.split, recipe.eval.seq_len, n), f"WikiText-2 {recipe.eval.split}"
    if samples is not None:
        return samples[:n], "calibration windows (no local WikiText-2)"
    raise FileNotFoundError("verifying the exports needs text: the shared data folder (COMPRESS_DATA_DIR) or a "
                            "calibration set; or set output.verify_windows: 0")


def write_exports(model, tokenizer, tmp: Path, out: Path, recipe: Recipe, source: str, windows, text: str,
                  log) -> list[dict]:
    """Each format of output.formats into OUTPUT/exports/<format>/, reloaded and compared when asked."""
    from .export import export_model
    from .export.verify import verify_export

    # compared with the model as saved beside them (float tensors at output.save_dtype, as the exports store
    # them), which is also what `compress verify` reloads later
    source = load_compressed(tmp, next(model.parameters()).dtype) if windows is not None and \
        recipe.output.save_model else model
    exports = []
    for fmt in recipe.output.formats:
        log(f"exporting {fmt} ...")
        folder = tmp / "exports" / fmt
        folder.parent.mkdir(exist_ok=True)
        record = export_model(model, tokenizer, fmt, folder, {
            "recipe_sha256": recipe.sha256, "recipe": recipe.text, "source_model": str(out.resolve()),
            "original_model": source}, source_gguf=source if str(source).endswith(".gguf") else None,
            max_shard_bytes=recipe.output.max_shard_bytes)
        entry = {"format": fmt, "folder": f"exports/{fmt}", "loaders": record["loaders"],
                 "bytes": folder_bytes(folder), "notes": record.get("notes", [])}
        if windows is not None:
            log(f"verifying {fmt}: reloading it and comparing predictions on {windows.shape[0]} windows ...")
            entry["verify"] = {**verify_export(folder, source, windows), "text": text}
        exports.append(entry)
    return exports


def compress_model(model, tokenizer, recipe: Recipe, plan: Plan, device: str, model_reports: dict | None = None,
                   progress: bool = True, log=print, spill_dir: Path | None = None) -> tuple[dict, torch.Tensor | None]:
    """The recipe's calibration pass and block stages, applied to `model` in place (the whole-model stages, prune
    and distill, have run before). Returns the report's `calibration`, `block_errors`, `stages` and `kept_in_float`
    sections, and the calibration windows (None without a calibration pass)."""
    model_reports = model_reports or {}
    sections: dict = {}
    samples = None
    ctx = start_stages(model, plan)
    if recipe.calibration is not None and plan.block_stages:
        log("preparing calibration data ...")
        samples, sections["calibration"] = calibration_samples(recipe, model, tokenizer)
        set_threads(recipe.calibration.threads)
        log(f"calibrating block by block on {device} ({samples.shape[0]} × {samples.shape[1]} tokens, "
            f"{recipe.calibration.dtype} matmuls, {torch.get_num_threads()} threads) ...")
        stage_pass = StagePass(ctx)
        with contextlib.ExitStack() as stack:
            if recipe.calibration.offload == "disk":  # memory-mapped activations, removed after the pass
                if spill_dir is not None:
                    spill_dir.mkdir(parents=True, exist_ok=True)
                spill_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=spill_dir, prefix=".spill-")))
                log(f"calibration activations spill to {spill_dir}")
            sections["block_errors"] = run_blockwise(
                model, plan.arch, samples, stage_pass.on_block, device=device, progress=progress,
                observe=stage_pass.observe, compute_dtype=getattr(torch, recipe.calibration.dtype),
                spill_dir=spill_dir if recipe.calibration.offload == "disk" else None)
        ctx.calibrated = True
    for i in plan.block_stages:  # the whole model (what lies outside the blocks; all of it without calibration)
        plan.stages[i].finalize(ctx, i)
    sections["stages"] = [model_reports[i] if i in model_reports else stage.report(ctx, i)
                          for i, stage in enumerate(plan.stages)]
    sections["kept_in_float"] = kept_in_float(model)
    return sections, samples


def run(recipe: Recipe, progress: bool = True, log=print, resume: bool = False) -> dict:
    """Run the recipe. `resume` continues a crashed run's distill stage from its newest checkpoint."""
    out = Path(recipe.output.dir)
    check_output(out, recipe.output.overwrite)
    device = resolve_device(recipe.model.device)
    set_threads(recipe.model.threads)
    timings = Timings()
    memory = check_memory(recipe, device, log)  # before any weight is read: refuse a run that cannot fit
    with timings("load"):
        log(f"loading model {recipe.model.source!r} ...")
        loaded, planted = load_source(recipe, device)
    model, tokenizer = loaded.model, loaded.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    # strict-mode errors and impossible exports surface here, on the shapes after pruning, before any heavy work
    plan = make_plan(model, get_arch(model), recipe.stages)
    check_formats(plan.model, plan, recipe.output.formats)
    with timings("prune_distill", any(s.whole_model for s in recipe.stages)):
        model_reports, before_distill = run_model_stages(model, tokenizer, get_arch(model), recipe, out, resume,
                                                         progress, log)
    if world()[0] != 0:  # `accelerate launch`: the other processes only helped distill
        return {}
    if model_reports:  # planned again on the model as pruned and distilled
        plan = make_plan(model, get_arch(model), recipe.stages, model_stages_done=True)
        check_formats(model, plan, recipe.output.formats)
    report = run_header(recipe, loaded, model, plan.arch, n_params, device, planted)
    report["memory_plan"] = memory.to_dict()
    with timings("compress"):
        sections, samples = compress_model(model, tokenizer, recipe, plan, device, model_reports, progress, log,
                                           spill_dir=out.parent)
    report.update(sections)
    set_threads(recipe.model.threads)
    with staged_output(out) as tmp:
        report.update(save_and_evaluate(recipe, loaded, model, before_distill, plan.arch, samples, device, tmp, out,
                                        timings, progress, log))
        write_run_report(report, tmp)
    shutil.rmtree(work_dir(out), ignore_errors=True)  # distillation checkpoints: the run finished
    log(f"wrote {out}/report.md")
    return report


def write_run_report(report: dict, folder: Path) -> None:
    """report.json, report.md, and a recovery-curve plot for each stage section that has one (distill)."""
    write_report(report, folder)
    for section in report["stages"]:
        if any(p.get("ppl") is not None for p in section.get("curve") or ()):
            plot_recovery(section, folder / f"recovery_curve_stage{section['index']}.png")


class NotEnoughMemory(RuntimeError):
    pass


def check_memory(recipe: Recipe, device: str, log) -> MemoryPlan:
    """The run's memory plan from the model's config (memory_plan.py), logged; raises NotEnoughMemory, naming the
    settings that would make it fit, when the predicted peak exceeds what the machine has (unless
    model.check_memory is false)."""
    spec = recipe.model
    config = load_config(spec.source, spec.revision, spec.trust_remote_code)
    dtype = resolve_dtype(spec.dtype, device)
    memory = plan_memory(recipe, config, dtype, device,
                         conversion=conversion_bytes(checkpoint_files(spec.source), config, dtype))
    for line in memory.lines():
        log(line)
    if spec.check_memory and (why := memory.problem(recipe)):
        raise NotEnoughMemory(why)
    return memory


class Timings(dict):
    """Seconds per phase of a run: `with timings("load"): ...` (not recorded when `when` is false)."""

    @contextlib.contextmanager
    def __call__(self, key: str, when: bool = True):
        t = time.perf_counter()
        yield
        if when:
            self[key] = time.perf_counter() - t


def load_source(recipe: Recipe, device: str):
    """The recipe's model (and its planted outliers, a benchmark aid: see outliers.py)."""
    spec = recipe.model
    loaded = load_model(spec.source, spec.dtype, device, spec.revision, spec.trust_remote_code)
    planted = plant_outliers(loaded.model, get_arch(loaded.model), spec.plant_outliers) if spec.plant_outliers \
        else None
    return loaded, planted


def run_header(recipe: Recipe, loaded, model, arch, n_params: int, device: str, planted) -> dict:
    """The report's provenance: compress version, time, the recipe as written and as resolved, the model."""
    return {
        "compress_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"path": recipe.path, "sha256": recipe.sha256, "overrides": list(recipe.overrides),
                   "text": recipe.text, "resolved": to_plain(recipe, skip=("path", "text", "sha256", "overrides"))},
        "model": {"source": loaded.source, "kind": loaded.kind, "family": arch.family, "parameters": n_params,
                  "parameters_after": sum(p.numel() for p in model.parameters()),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
                  "threads": torch.get_num_threads(), "planted_outliers": planted},
    }


@contextlib.contextmanager
def staged_output(out: Path):
    """A temporary folder beside `out`, renamed into place when the block completes; removed on any error or
    Ctrl-C, so a failed run never leaves a half-written output (nor replaces an existing one)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_and_evaluate(recipe: Recipe, loaded, model, before_distill, arch, samples, device: str, tmp: Path, out: Path,
                      timings: Timings, progress: bool, log) -> dict:
    """Save the compressed model into `tmp`, evaluate it beside the baseline (and the pruned model before
    distillation), write the exports, then the report; returns the report sections added here."""
    report: dict = {}
    if recipe.output.save_model:
        with timings("save"):
            log("saving the compressed model ...")
            save_compressed(model, loaded.tokenizer, tmp, {"compress_version": __version__,
                                                           "recipe_sha256": recipe.sha256, "recipe": recipe.text,
                                                           "source": loaded.source}, recipe.output.save_dtype,
                            recipe.output.max_shard_bytes)
    with timings("eval"):
        baseline = None
        if recipe.eval.baseline:  # reloaded rather than copied up front: keeps the calibration pass's peak low
            log("reloading the original model as the baseline ...")
            baseline = load_source(recipe, device)[0].model
        log("evaluating ...")
        models = {"baseline": baseline} if baseline is not None else {}
        if before_distill is not None:
            models["pruned"] = before_distill  # the same windows before and after distillation
        models["compressed"] = model
        report["eval"] = evaluate_models(models, loaded.tokenizer, recipe.eval, device,
                                         baseline="baseline" if baseline is not None else None, progress=progress)
    report["memory"] = {"checkpoint_bytes": folder_bytes(tmp) if recipe.output.save_model else None,
                        "baseline_checkpoint_bf16_bytes": _bf16_bytes(baseline or model)}
    if recipe.output.formats:
        with timings("export"):
            windows, text = verify_windows(recipe, loaded.tokenizer, samples)
            report["exports"] = write_exports(model, loaded.tokenizer, tmp, out, recipe, loaded.source, windows,
                                              text, log)
    report["timings"] = dict(timings)
    (tmp / "recipe.yaml").write_text(recipe.text or recipe.resolved_yaml())
    (tmp / "recipe.resolved.yaml").write_text(recipe.resolved_yaml())
    return report


def _bf16_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * 2
    return total


__all__ = ["run", "compress_model", "make_plan"]
