"""compress / evaluate / load / run: the Python API's functions (api/__init__.py shows them in use).

`compress` runs the recipe's sequence (pipeline/source.py run_source, the same code `compress run` runs) on a
model the caller already holds: `InMemorySource` is the resident source whose `open` copies that model instead of
loading one. The caller's model is never modified: a copy on the CPU is compressed (as `compress run` loads its
model on the CPU; the calibration pass moves each block to the device for its turn) and the caller's model is the
baseline the report compares with.
"""
from __future__ import annotations

import copy
import dataclasses
import tempfile
from pathlib import Path

import yaml
from torch import nn

from ..arch.moe import unfuse_experts
from ..model.load import load_model, resolve_device
from ..pipeline.options import RunOptions
from ..pipeline.resident import NotEnoughMemory, ResidentSource, run as run_recipe
from ..pipeline.source import run_source
from ..recipe import EvalSpec, Recipe, RecipeError, build, from_dict, load_recipe
from .result import Report, Result

IN_MEMORY = "in-memory"  # the recipe's model.source when a dict or YAML text names none


def as_recipe(recipe, overrides=()) -> Recipe:
    """A Recipe from a Recipe, a dict, a path to a YAML file or YAML text, with `key.path=value` overrides."""
    from ..recipe import apply_override

    if isinstance(recipe, Recipe):
        if overrides:
            raise RecipeError("overrides apply to a recipe's file, text or dict; a Recipe object is already built "
                              "(edit it with dataclasses.replace, or pass its dict)")
        return recipe
    if isinstance(recipe, (str, Path)) and _is_path(str(recipe)):
        return load_recipe(recipe, overrides)
    if isinstance(recipe, str):
        try:
            data = yaml.safe_load(recipe)
        except yaml.YAMLError as exc:
            raise RecipeError(f"the recipe text is not valid YAML (and names no recipe file): {exc}") from None
        text, where = recipe, "<recipe text>"
    elif isinstance(recipe, dict):
        data, text, where = copy.deepcopy(recipe), None, "<recipe dict>"
    else:
        raise RecipeError(f"a recipe is a path, YAML text, a dict or a compress Recipe, not {type(recipe).__name__}")
    if isinstance(data, dict):
        data.setdefault("model", IN_MEMORY)
    for item in overrides:
        apply_override(data, item, where)
    return from_dict(data, where, text if text is not None and not overrides else yaml.safe_dump(data, sort_keys=False),
                     tuple(overrides))


def _is_path(text: str) -> bool:
    """A recipe file's name rather than YAML text: one line that ends in .yaml/.yml, names a file, or has no `key:`
    in it (a missing file then gets load_recipe's error, which lists the shipped recipes)."""
    return "\n" not in text and (text.endswith((".yaml", ".yml")) or Path(text).is_file() or ":" not in text)


def with_dataset(recipe: Recipe, dataset) -> Recipe:
    """The recipe with its calibration text replaced by `dataset`: texts (a list of strings, or a `datasets.Dataset`
    with the recipe's text_field column) or a hub dataset id. The recipe's window count, length and seed stay."""
    if dataset is None:
        return recipe
    cal = recipe.calibration
    if cal is None:
        raise RecipeError("dataset= gives calibration text, and this recipe has no calibration pass (its stages "
                          "need none): leave dataset out")
    if cal.kind == "images":
        raise RecipeError(f"dataset= gives calibration text, and this recipe calibrates on the image-caption pairs of "
                          f"calibration.folder ({cal.folder}): leave dataset out, or use a text calibration kind")
    if isinstance(dataset, str):
        return dataclasses.replace(recipe, calibration=dataclasses.replace(cal, kind="hub", dataset=dataset))
    if hasattr(dataset, "column_names"):  # a datasets.Dataset
        if cal.text_field not in dataset.column_names:
            raise ValueError(f"dataset has no column {cal.text_field!r} (the recipe's calibration.text_field); its "
                             f"columns: {dataset.column_names}")
        dataset = dataset[cal.text_field]
    texts = tuple(dataset)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("dataset= is a hub dataset id, a datasets.Dataset, or a non-empty list of strings")
    return dataclasses.replace(recipe, calibration=dataclasses.replace(cal, kind="texts", texts=texts))


def cpu_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every parameter and buffer on the CPU, copied from wherever it is one tensor at a
    time (a model on the GPU is not duplicated there); tied tensors stay tied."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            data = t.detach().to("cpu", copy=True)
            memo[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    return copy.deepcopy(model, memo)


class InMemorySource(ResidentSource):
    """The caller's model: a CPU copy is compressed, the caller's model is the baseline (`reload`), left where it
    was."""

    kind = "in-memory"

    def __init__(self, model: nn.Module, tokenizer, name: str):
        self.original, self.tokenizer, self.name = model, tokenizer, name

    def open(self, opts: RunOptions) -> None:
        from ..arch import get_arch
        from ..transforms.outliers import plant_outliers

        opts.log(f"copying the model ({self.name}) to compress it ...")
        self.model = cpu_copy(self.original).eval()
        unfuse_experts(self.model)  # as load_model does: a MoE block's fused expert tensors as one linear each
        spec = opts.recipe.model
        self.planted = plant_outliers(self.model, get_arch(self.model), spec.plant_outliers) \
            if spec.plant_outliers else None

    def reload(self, opts: RunOptions) -> nn.Module:
        if opts.recipe.model.plant_outliers:
            raise RecipeError("model.plant_outliers changes the model the baseline must equal; the API keeps no "
                              "such copy: run the recipe with `compress run` (or compress.run)")
        return self.original

    def evaluate(self, opts: RunOptions, before_distill):
        where = next(self.original.parameters()).device
        try:
            return super().evaluate(opts, before_distill)
        finally:  # the evaluation moved the baseline to the run's device: the caller's model goes back
            self.original.to(where)


def _device(model: nn.Module, recipe: Recipe, device: str | None) -> str:
    if device is not None:
        return resolve_device(device)
    where = next(model.parameters()).device
    return str(where) if where.type == "cuda" else resolve_device(recipe.model.device)


def _check_memory(model: nn.Module, recipe: Recipe, device: str, log):
    """The memory plan of `compress run` for this model and recipe, the model held whole (no streaming: it is in
    memory already); refuses what would not fit unless model.check_memory is false."""
    from ..pipeline.streamed import choose_plan

    never = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, stream="never"))
    memory, recipe, _, notes = choose_plan(never, model.config, next(model.parameters()).dtype, device)
    for line in notes + memory.lines():
        log(line)
    if recipe.model.check_memory and (why := memory.problem(recipe)):
        raise NotEnoughMemory(why)
    return memory, recipe


def compress(model: nn.Module, tokenizer, recipe, dataset=None, output: str | Path | None = None, *,
             overrides=(), device: str | None = None, progress: bool = True, log=print) -> Result:
    """Compress `model` (a transformers causal LM already loaded, at the dtype it has) with `recipe` (a path, YAML
    text, a dict or a Recipe; the recipe's `model:` is not loaded) and return a `Result`: the compressed model in
    memory, its report (the baseline is `model` itself, which is never modified) and `.save()` / `.export()`.

    `dataset`: calibration text instead of the recipe's (a list of strings, a datasets.Dataset, or a hub dataset
    id). `output`: a folder to write the run into, as `compress run` does (checkpoint, report, the recipe's
    output.formats exports); None writes nothing. `device`: where to calibrate and evaluate (default: the model's
    GPU, else the recipe's model.device)."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("an encoder-decoder model; compress handles decoder-only causal LMs")
    recipe = with_dataset(as_recipe(recipe, overrides), dataset)
    device = _device(model, recipe, device)
    memory, recipe = _check_memory(model, recipe, device, log)
    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or \
        f"{IN_MEMORY} {type(model).__name__}"
    with tempfile.TemporaryDirectory(prefix="compress-api-") as scratch:
        if output is None:  # the run's folder is a scratch one: nothing saved or exported, the report read back
            out = Path(scratch) / "run"
            recipe = dataclasses.replace(recipe, output=dataclasses.replace(
                recipe.output, dir=str(out), save_model=False, formats=(), overwrite=True))
        else:
            out = Path(output)
            recipe = dataclasses.replace(recipe, output=dataclasses.replace(recipe.output, dir=str(out)))
            from ..pipeline.calibration import check_output
            check_output(out, recipe.output.overwrite)
        source = InMemorySource(model, tokenizer, str(name))
        report = run_source(source, RunOptions(recipe, out, device, progress, log), memory)
    from ..pipeline.provenance import provenance
    return Result(source.model, tokenizer, recipe, Report(report), out if output is not None else None,
                  provenance(recipe, str(name)))


def run(recipe, overrides=(), *, progress: bool = True, log=print, resume: bool = False, profile=None) -> Report:
    """`compress run`: the recipe's model loaded from its `model:` source, compressed, saved to output.dir,
    evaluated and exported; returns the report. `profile` (core.profile.Profile): where the run's phases are timed
    (None: one started when the run starts; the CLI starts one with the process's start-up in it)."""
    return Report(run_recipe(as_recipe(recipe, overrides), progress=progress, log=log, resume=resume,
                             profile=profile))


def load(path: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False):
    """(model, tokenizer) from a compress run folder or export, a Hugging Face folder, a .gguf file, `default` or a
    hub id: what `compress eval` and `compress generate` read. A compress checkpoint loads with its QuantLinear
    layers (the same numbers as when it was saved)."""
    loaded = load_model(str(path), dtype, resolve_device(device) if device == "auto" else device,
                        trust_remote_code=trust_remote_code)
    return loaded.model, loaded.tokenizer


def evaluate(model, baseline=None, tokenizer=None, *, device: str | None = None, progress: bool = True,
             **settings) -> Report:
    """Perplexity (and KL / top-1 against `baseline`), weight bytes and speed, on the same windows, as `compress eval`
    reports them. `model` and `baseline`: a loaded model, a `Result`, or anything `load` reads. `tokenizer`: needed
    when no argument brings one (a path or a Result does). `settings`: the recipe's `eval:` keys (max_windows=4,
    speed=False, tasks=["arc_easy"], ...), or `spec=` an EvalSpec."""
    spec = settings.pop("spec", None) or build(EvalSpec, settings, "eval", "compress.evaluate")
    models, source = {}, None
    for role, item in (("baseline", baseline), ("model", model)):
        if item is None:
            continue
        if isinstance(item, Result):
            item, tokenizer = item.model, tokenizer or item.tokenizer
        elif isinstance(item, (str, Path)):
            loaded = load_model(str(item), "auto", device or "cpu")
            item, tokenizer = loaded.model, tokenizer or loaded.tokenizer
            source = source if role == "baseline" else {"source": loaded.source, "kind": loaded.kind}
        models[role] = item
    if tokenizer is None:
        raise ValueError("evaluate() needs a tokenizer: pass tokenizer=, or give a path or a Result")
    device = device or _device(models["model"], Recipe(), None)
    return Report(evaluate_loaded(models, tokenizer, spec, device, progress, source))


def evaluate_loaded(models: dict, tokenizer, spec: EvalSpec, device: str, progress: bool = True,
                    source: dict | None = None) -> dict:
    """The report of `compress eval` for models already loaded ({"baseline": ..., "model": ...}; the baseline
    optional): each is moved to `device` (unless accelerate offloads it) and evaluated on the same windows."""
    from ..model.load import offloaded
    from ..pipeline.report import evaluate_models

    for m in models.values():
        if not offloaded(m):  # accelerate's hooks place an offloaded model's weights themselves
            m.to(device)
    report = {"model": source or {"source": IN_MEMORY, "kind": IN_MEMORY}}
    report["eval"] = evaluate_models(models, tokenizer, spec, device,
                                     baseline="baseline" if "baseline" in models else None, progress=progress)
    return report


__all__ = ["compress", "evaluate", "load", "run", "as_recipe", "cpu_copy", "InMemorySource", "evaluate_loaded"]
