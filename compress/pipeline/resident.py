"""`compress run`: the entry point `run` (refuse what cannot fit, then run the model loaded whole, or streamed from
disk: streamed.run_streamed), and `ResidentSource`, the model loaded whole, that source.run_source runs: load -> plan
-> whole-model stages -> calibrate block by block -> after-stages -> save -> evaluate -> export -> report.

State is passed explicitly; the output folder is written under a temporary name and renamed into
place at the end, so a crash or Ctrl-C never leaves a half-written output.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..arch import get_arch
from ..measure.memory import folder_bytes
from .report import evaluate_models
from ..model.integrity import check_resume_dir
from .memory_plan import MemoryPlan, conversion_bytes
from ..model.load import checkpoint_files, load_config, load_model, resolve_device, resolve_dtype
from ..export.native import load_compressed, quantized_skeleton, save_compressed
from ..transforms.outliers import plant_outliers
from .model_stages import run_model_stages, work_dir
from ..precision.mixed import fits
from ..recipe import Recipe
from ..core.scheme import QuantScheme
from ..stages.base import Plan, make_plan, next_target
from .calibration import PassExtras, check_output, set_threads
from .options import RunOptions
from .provenance import export_provenance
from .source import ModelSource, run_source


def planned_model(model, plan: Plan, offered: tuple[QuantScheme, ...] = (), target: int | None = None,
                  together: bool = False) -> torch.nn.Module:
    """A meta-device copy of `model` with the planned QuantLinear layers: what the export checks see before
    any weight is quantized. A tied lm_head planned with tied_lm_head: untie is untied in the copy's config
    too, as apply_quantize will do to the model. `offered`: schemes an auto_precision menu may give the layers of
    stage `target` at run time, dealt out in turn to those that can hold them (one scheme: every such layer takes it),
    by fused group when `together` (auto_precision's fused_groups)."""
    import copy

    entries = [(j, e) for j, (stage, step) in enumerate(zip(plan.stages, plan.steps)) if stage.stores_weights
               for e in step.quantized]
    config = copy.deepcopy(model.config)
    if any(e.untie for _, e in entries):
        for c in {id(c): c for c in (config, config.get_text_config())}.values():
            c.tie_word_embeddings = False
    schemes = {}
    turn = _turns([e.name for _, e in entries], together)
    for j, e in entries:
        held = [o for o in offered if fits(e.shape, o)] if j == target else []
        schemes[e.name] = held[turn[e.name] % len(held)] if held else e.scheme
    return quantized_skeleton(config, schemes, codes={e.name: e.code for _, e in entries if e.code is not None})


def _turns(names: list[str], together: bool) -> dict[str, int]:
    """Each layer's turn in dealing out a menu: its own index, or its fused group's (q/k/v, gate/up, a MoE block's
    experts: one scheme each when the stage keeps them together)."""
    if not together:
        return {n: k for k, n in enumerate(names)}
    from ..arch.fused import fused_groups
    return {n: k for k, group in enumerate(fused_groups(names)) for n in group}


def check_formats(model, plan: Plan, formats: tuple[str, ...]) -> None:
    """Refuse, before anything runs, the formats the planned model cannot be written in, then those a stage refuses
    (stage.export_problem: the rotate stage's online Hadamard, the schemes an auto_precision menu may give the
    layers at run time)."""
    from ..export import ExportError, check_export, export_problems
    if not formats:
        return
    meta = planned_model(model, plan)
    for fmt in formats:
        check_export(meta, fmt)
    for i, stage in enumerate(plan.stages):
        target = next_target(plan.stages, i)

        def check(fmt: str, offered: tuple[QuantScheme, ...], together: bool) -> list[str]:
            return export_problems(planned_model(model, plan, offered, target, together), fmt)

        if (why := stage.export_problem(tuple(formats), i, check)) is not None:
            raise ExportError(why)


def verify_windows(recipe: Recipe, tokenizer, samples: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
    """Token windows the exports are compared on: WikiText-2 (the eval split) where it is available, else the
    calibration windows (both renderings of one model are compared, so held-out text is not essential)."""
    from ..calibrate.data import find_data_dir
    from .report import eval_windows

    n = recipe.output.verify_windows
    if not n:
        return None, "not verified (output.verify_windows: 0)"
    if find_data_dir() is not None:
        return eval_windows(tokenizer, recipe.eval.split, recipe.eval.seq_len, n), f"WikiText-2 {recipe.eval.split}"
    if samples is not None:
        return samples[:n], "calibration windows (no local WikiText-2)"
    raise FileNotFoundError("verifying the exports needs text: the shared data folder (COMPRESS_DATA_DIR) or a "
                            "calibration set; or set output.verify_windows: 0")


def write_exports(model, tokenizer, tmp: Path, opts: RunOptions, record: dict, windows, text: str) -> list[dict]:
    """Each format of output.formats into OUTPUT/exports/<format>/ (staged in `tmp`; written from `model` where it
    is: the CPU after the evaluation), reloaded and compared on `opts.device` on `windows` when asked."""
    from ..export import export_model
    from ..export.verify import verify_export

    recipe, log = opts.recipe, opts.log
    # compared with the model as saved beside them (float tensors at output.save_dtype, as the exports store
    # them), which is also what `compress verify` reloads later
    reference = load_compressed(tmp, next(model.parameters()).dtype) if windows is not None and \
        recipe.output.save_model else model
    if windows is not None and reference is not model:
        reference.to(opts.device)  # verify_export runs the export's reload where the reference is
    exports = []
    for fmt in recipe.output.formats:
        log(f"exporting {fmt} ...")
        folder = tmp / "exports" / fmt
        folder.parent.mkdir(exist_ok=True)
        source = record["source"]
        written = export_model(model, tokenizer, fmt, folder, export_provenance(record, opts.out),
                               source_gguf=source if source.endswith(".gguf") else None,
                               max_shard_bytes=recipe.output.max_shard_bytes)
        entry = {"format": fmt, "folder": f"exports/{fmt}", "loaders": written["loaders"],
                 "bytes": folder_bytes(folder), "notes": written.get("notes", [])}
        if written.get("adapter"):  # the eora stage's terms, a LoRA adapter in the folder (counted in its bytes)
            entry["adapter"] = written["adapter"]
        if windows is not None and (missing := verifier_missing(fmt)):
            log(f"WARNING: {fmt} written, not verified: {missing}")
            entry["notes"].append(f"not verified: {missing}")
        elif windows is not None:
            log(f"verifying {fmt}: reloading it and comparing predictions on {windows.shape[0]} windows ...")
            entry["verify"] = {**verify_export(folder, reference, windows), "text": text}
        exports.append(entry)
    return exports


def verifier_missing(fmt: str) -> str | None:
    """Why an export cannot be run here (None: it can): a GGUF file runs in llama.cpp, through llama-cpp-python,
    which is an optional extra (it builds from source); a plain install writes the file and says it was not run."""
    if not fmt.startswith("gguf"):
        return None
    try:
        import llama_cpp  # noqa: F401 - the verification imports it next
    except ImportError:
        return "llama-cpp-python is not installed (pip install 'compress[export]' runs GGUF exports in llama.cpp)"
    return None


def run(recipe: Recipe, progress: bool = True, log=print, resume: bool = False, profile=None) -> dict:
    """Run the recipe. `resume` continues a crashed run: its distill stage from its newest checkpoint, or a streamed
    run (model.stream) at the block where it stopped. `profile` (core.profile.Profile): where the run's phases are
    timed (None: a new one, started here)."""
    out = Path(recipe.output.dir)
    check_output(out, recipe.output.overwrite)
    if resume:  # what a resume reads, checked before any work (integrity.py)
        check_resume_dir(work_dir(out))
    device = resolve_device(recipe.model.device)
    set_threads(recipe.model.threads)
    memory, recipe, streamed = check_memory(recipe, device, log)  # before any weight is read: refuse what cannot fit
    if streamed:
        from .streamed import run_streamed
        return run_streamed(recipe, progress, log, memory, resume, profile)
    return run_source(ResidentSource(), RunOptions(recipe, out, device, progress, log, resume, profile), memory)


class ResidentSource(ModelSource):
    """The model loaded whole into memory (model/load.py): every stage runs, the baseline is reloaded for the
    evaluation and the exports are verified on reloading (see source.py for what a streamed source does instead)."""

    stages_timing = "prune_distill"

    def open(self, opts: RunOptions) -> None:
        opts.log(f"loading model {opts.recipe.model.source!r} ...")
        loaded, self.planted = load_source(opts.recipe, opts.device)
        self.model, self.tokenizer, self.name, self.kind = loaded.model, loaded.tokenizer, loaded.source, loaded.kind

    @property
    def arch(self):
        return get_arch(self.model)  # a prune changes the block list

    def check_plan(self, plan: Plan, formats: tuple[str, ...]) -> None:
        check_formats(plan.model, plan, formats)

    def model_stages(self, opts: RunOptions) -> tuple[dict, torch.nn.Module | None, tuple]:
        return run_model_stages(self.model, self.tokenizer, self.arch, opts)

    def pass_extras(self, opts: RunOptions, model_reports: dict) -> PassExtras:
        return PassExtras(model_reports, spill_dir=opts.out.parent)

    def reload(self, opts: RunOptions) -> torch.nn.Module:
        return load_source(opts.recipe, opts.device)[0].model

    def save(self, tmp: Path, opts: RunOptions, record: dict) -> None:
        output = opts.recipe.output
        opts.log("saving the compressed model ...")
        save_compressed(self.model, self.tokenizer, tmp, record, output.save_dtype, output.max_shard_bytes)

    def evaluate(self, opts: RunOptions, before_distill: torch.nn.Module | None) -> tuple[dict, int]:
        """The compressed model evaluated beside the baseline (reloaded rather than copied up front: that keeps the
        calibration pass's peak low) and the pruned model before distillation, on the same windows; afterwards the
        compressed model is back in host memory (the exporters read it from there) and the others are freed."""
        recipe, device, log = opts.recipe, opts.device, opts.log
        baseline = None
        if recipe.eval.baseline:
            log("reloading the original model as the baseline ...")
            baseline = self.reload(opts)
        log("evaluating ...")
        models = {"baseline": baseline} if baseline is not None else {}
        if before_distill is not None:
            models["pruned"] = before_distill
        models["compressed"] = self.model
        on_device(models, device)
        section = evaluate_models(models, self.tokenizer, recipe.eval, device,
                                  baseline="baseline" if baseline is not None else None, progress=opts.progress,
                                  profile=opts.profile)
        baseline_bytes = _bf16_bytes(baseline or self.model)
        models.pop("baseline", None)
        del baseline  # freed, not moved back
        on_device(models, "cpu")  # device memory is freed
        return section, baseline_bytes

    def export(self, tmp: Path, opts: RunOptions, record: dict, samples) -> list[dict]:
        windows, text = verify_windows(opts.recipe, self.tokenizer, samples)
        return write_exports(self.model, self.tokenizer, tmp, opts, record, windows, text)


class NotEnoughMemory(RuntimeError):
    pass


def check_memory(recipe: Recipe, device: str, log) -> tuple[MemoryPlan, Recipe, bool]:
    """The run's memory plan from the model's config (memory_plan.py), logged; the recipe to run (its calibration
    activations moved to disk when only that makes it fit) and whether to stream the model block by block
    (stream_run.choose_plan). Raises NotEnoughMemory, naming the settings that would make it fit, when the
    predicted peak exceeds what the machine has (unless model.check_memory is false)."""
    from .streamed import choose_plan

    spec = recipe.model
    config = load_config(spec.source, spec.revision, spec.trust_remote_code)
    dtype = resolve_dtype(spec.dtype, device)
    memory, recipe, stream, notes = choose_plan(recipe, config, dtype, device,
                                                conversion_bytes(checkpoint_files(spec.source), config, dtype))
    for line in notes + memory.lines():
        log(line)
    if spec.check_memory and (why := memory.problem(recipe)):
        raise NotEnoughMemory(why)
    return memory, recipe, stream


def load_source(recipe: Recipe, device: str):
    """The recipe's model (and its planted outliers, a benchmark aid: see outliers.py)."""
    spec = recipe.model
    loaded = load_model(spec.source, spec.dtype, device, spec.revision, spec.trust_remote_code)
    planted = plant_outliers(loaded.model, get_arch(loaded.model), spec.plant_outliers) if spec.plant_outliers \
        else None
    return loaded, planted


def on_device(models: dict, device: str) -> None:
    """Move each model to `device` (in place; tied weights stay tied). The calibration pass hands every block back
    to the CPU after its turn and the baseline is loaded there, so a CUDA run's evaluation moves them to the GPU
    first, and the compressed model back afterwards; the caching allocator's free blocks go back to the device."""
    for m in models.values():
        if m is not None:
            m.to(device)
    if torch.device(device).type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _bf16_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * 2
    return total


__all__ = ["run", "ResidentSource", "make_plan"]
