"""`compress run`: load -> plan -> calibrate block by block -> apply stages -> save -> evaluate -> report.

State is passed explicitly; the output folder is written under a temporary name and renamed into
place at the end, so a crash or Ctrl-C never leaves a half-written output.
"""
from __future__ import annotations

import datetime
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ._version import __version__
from .arch import get_arch, get_module, set_module
from .blockwise import run_blockwise
from .data import calibration_windows, fingerprint
from .evaluate.memory import folder_bytes
from .evaluate.plots import plot_recovery
from .evaluate.report import evaluate_models, write_report
from .models import load_compressed, load_model, resolve_device, save_compressed
from .nn import is_linear
from .nn import QuantLinear
from .observers import BlockObserver
from .outliers import plant_outliers
from .quantize import QuantizeStage, apply_quantize, plan_quantize
from .kv_cache import KVCacheStage, attention_modules, kv_layers, set_kv_scales, use_kv_attention
from .model_stages import run_model_stages, work_dir, world
from .quantizers import get_quantizer
from .quantizers.awq import AWQStage, awq_block
from .quantizers.smoothquant import SmoothQuantStage, smoothquant_block
from .recipe import MODEL_STAGES, Recipe, to_plain


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


def plan_stages(model, arch, recipe: Recipe) -> list:
    """One plan per quantize stage (None for other stages); a layer claimed by an earlier stage is not
    quantized again."""
    plans, claimed = [], {}
    for i, stage in enumerate(recipe.stages):
        if not isinstance(stage, QuantizeStage):  # including MODEL_STAGES (prune, distill)
            plans.append(None)
            continue
        plan = plan_quantize(model, arch, stage)
        for entry in plan.quantized:
            if entry.name in claimed:
                entry.scheme, entry.reason = None, f"quantized by stage {claimed[entry.name]}"
            else:
                claimed[entry.name] = i
        plans.append(plan)
    return plans


class BlockStages:
    """What the recipe's stages do to one decoder block: which statistics to observe, then apply in order."""

    def __init__(self, model, recipe: Recipe, arch, plans: list):
        self.model = model
        self.model_stages = list(zip(recipe.stages, plans))
        self.arch = arch
        stages = recipe.stages
        self.searchers = [s for s in stages if isinstance(s, AWQStage) or
                          (isinstance(s, SmoothQuantStage) and s.alpha_grid)]  # replay inspect modules
        self.abs_mean = any(isinstance(s, AWQStage) for s in stages)
        self.abs_max = any(isinstance(s, SmoothQuantStage) or (isinstance(s, QuantizeStage) and s.scheme.act)
                           for s in stages)
        self.hessian = any(isinstance(s, QuantizeStage) and get_quantizer(s.method).needs_hessian for s in stages)
        self.kv = any(isinstance(s, KVCacheStage) for s in stages)
        self.pair_report: dict[int, list] = {i: [] for i, s in enumerate(stages)
                                             if isinstance(s, (AWQStage, SmoothQuantStage))}
        self.layer_info: dict[int, dict] = {i: {} for i, s in enumerate(stages) if isinstance(s, QuantizeStage)}
        self.kv_report: dict[str, dict] = {}

    def observe(self, _i: int, prefix: str, block) -> BlockObserver | None:
        if not (self.searchers or self.abs_mean or self.abs_max or self.hessian or self.kv):
            return None
        planned = {e.name for _, plan in self.model_stages if plan is not None for e in plan.quantized
                   if e.scheme is not None}  # only the layers a stage will use statistics of
        linears = [n for n, m in block.named_modules() if n and is_linear(m) and not isinstance(m, QuantLinear)
                   and f"{prefix}.{n}" in planned]
        if not linears and not self.kv:
            return None
        inspect = sorted({insp for _, _, insp in self.arch.awq}) if self.searchers else []
        keep = max((s.search_samples for s in self.searchers), default=0)
        return BlockObserver(block, linears, inspect, abs_mean=self.abs_mean, hessian=self.hessian, keep_samples=keep,
                             abs_max=self.abs_max, kv=tuple(attention_modules(block)) if self.kv else ())

    def _next_quantized(self, k: int, prefix: str):
        stage, plan = next((s, p) for s, p in self.model_stages[k + 1:] if p is not None)
        return stage, {e.name[len(prefix) + 1:] for e in plan.quantized if e.name.startswith(prefix + ".")}

    def on_block(self, i: int, prefix: str, block, _inputs, observer) -> None:
        input_divisor: dict = {}
        for k, (stage, plan) in enumerate(self.model_stages):
            if isinstance(stage, MODEL_STAGES):
                continue  # ran on the whole model before calibration
            if isinstance(stage, AWQStage):
                _, quantized = self._next_quantized(k, prefix)
                results = awq_block(block, self.arch.awq, observer, stage, stage.scheme, quantized,
                                    self.arch.no_clip, self.arch.norm_offset, input_divisor)
                self.pair_report[k].append({"block": i, "pairs": [asdict(r) for r in results]})
            elif isinstance(stage, SmoothQuantStage):
                nxt, quantized = self._next_quantized(k, prefix)
                results = smoothquant_block(block, self.arch.awq, observer, stage, nxt.scheme, quantized,
                                            self.arch.norm_offset, input_divisor)
                self.pair_report[k].append({"block": i, "pairs": [asdict(r) for r in results]})
            elif isinstance(stage, KVCacheStage):
                for name, (k_max, v_max) in observer.kv_absmax.items():
                    set_kv_scales(block.get_submodule(name), k_max, v_max, stage.dtype)
            else:
                apply_quantize(self.model, plan, stage, prefix, observer, input_divisor, self.layer_info[k])


def stage_summary(i: int, stage, plan, blocks: BlockStages | None, model) -> dict:
    if isinstance(stage, AWQStage):
        return {"index": i, "stage": "awq", "scheme": stage.scheme.name, "n_grid": stage.n_grid,
                "search_samples": stage.search_samples, "clip": stage.clip, "quantized": 0, "skipped": [],
                "blocks": blocks.pair_report[i] if blocks else []}
    if isinstance(stage, SmoothQuantStage):
        return {"index": i, "stage": "smoothquant", "alpha": stage.alpha, "alpha_grid": list(stage.alpha_grid),
                "quantized": 0, "skipped": [], "blocks": blocks.pair_report[i] if blocks else []}
    if isinstance(stage, KVCacheStage):
        return {"index": i, "stage": "kv_cache", "dtype": stage.dtype, "quantized": 0, "skipped": [],
                "layers": kv_layers(model)}
    return {"index": i, "stage": "quantize", "method": stage.method, "scheme": stage.scheme.name,
            "scheme_fields": asdict(stage.scheme), "quantized": len(plan.quantized),
            "skipped": [{"name": e.name, "reason": e.reason} for e in plan.skipped],
            "layers": {e.name: e.scheme.name for e in plan.quantized},
            "untied": {e.name: {"extra_bytes": e.untied_bytes, "note": e.note} for e in plan.quantized
                       if e.untied_bytes is not None},
            "layer_info": blocks.layer_info.get(i, {}) if blocks else {}}


def kept_in_float(model, arch) -> list[str]:
    """Weight-holding modules outside the linear layers (embeddings, norms): reported, never silent."""
    kinds: dict[str, int] = {}
    for name, m in model.named_modules():
        if is_linear(m) or not isinstance(getattr(m, "weight", None), torch.Tensor) or list(m.children()):
            continue
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    return [f"{n}× {k} (weight-only integer schemes apply to linear layers)" for k, n in sorted(kinds.items())]


def planned_model(model, plans: list) -> torch.nn.Module:
    """A meta-device copy of `model` with the planned QuantLinear layers: what the export checks see before
    any weight is quantized. A tied lm_head planned with tied_lm_head: untie is untied in the copy's config
    too, as apply_quantize will do to the model."""
    import copy

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .nn import QuantLinear, linear_shape

    config = copy.deepcopy(model.config)
    if any(e.untie for plan in plans if plan is not None for e in plan.quantized):
        for c in {id(c): c for c in (config, config.get_text_config())}.values():
            c.tie_word_embeddings = False
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config)
    for plan in plans:
        for e in (plan.quantized if plan is not None else ()):
            old = get_module(meta, e.name)
            out_features, in_features = linear_shape(old)
            set_module(meta, e.name, QuantLinear(in_features, out_features, e.scheme, bias=old.bias is not None,
                                                 device="meta"))
    return meta


def check_formats(model, plans: list, formats: tuple[str, ...]) -> None:
    from .export import check_export
    if formats:
        meta = planned_model(model, plans)
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
            "original_model": source}, source_gguf=source if str(source).endswith(".gguf") else None)
        entry = {"format": fmt, "folder": f"exports/{fmt}", "loaders": record["loaders"],
                 "bytes": folder_bytes(folder), "notes": record.get("notes", [])}
        if windows is not None:
            log(f"verifying {fmt}: reloading it and comparing predictions on {windows.shape[0]} windows ...")
            entry["verify"] = {**verify_export(folder, source, windows), "text": text}
        exports.append(entry)
    return exports


def compress_model(model, tokenizer, arch, recipe: Recipe, plans: list, device: str, model_reports: dict | None = None,
                   progress: bool = True, log=print) -> tuple[dict, torch.Tensor | None]:
    """The recipe's calibration pass and quantization stages, applied to `model` in place (prune and distill, the
    model stages, have run before). Returns the report's `calibration`, `block_errors`, `stages` and
    `kept_in_float` sections, and the calibration windows (None without a calibration pass)."""
    model_reports = model_reports or {}
    sections: dict = {}
    samples, block_stages = None, None
    if recipe.calibration is not None and any(not isinstance(s, MODEL_STAGES) for s in recipe.stages):
        log("preparing calibration data ...")
        samples, sections["calibration"] = calibration_samples(recipe, model, tokenizer)
        set_threads(recipe.calibration.threads)
        log(f"calibrating block by block on {device} ({samples.shape[0]} × {samples.shape[1]} tokens, "
            f"{recipe.calibration.dtype} matmuls, {torch.get_num_threads()} threads) ...")
        block_stages = BlockStages(model, recipe, arch, plans)
        if block_stages.kv:
            use_kv_attention(model)
        sections["block_errors"] = run_blockwise(model, arch, samples, block_stages.on_block, device=device,
                                                 progress=progress, observe=block_stages.observe,
                                                 compute_dtype=getattr(torch, recipe.calibration.dtype))
    for stage, plan in zip(recipe.stages, plans):  # everything outside the blocks (or all, without calibration)
        if plan is not None:
            apply_quantize(model, plan, stage)
    sections["stages"] = [model_reports[i] if i in model_reports else stage_summary(i, s, p, block_stages, model)
                          for i, (s, p) in enumerate(zip(recipe.stages, plans))]
    sections["kept_in_float"] = kept_in_float(model, arch)
    return sections, samples


def run(recipe: Recipe, progress: bool = True, log=print, resume: bool = False) -> dict:
    """Run the recipe. `resume` continues a crashed run's distill stage from its newest checkpoint."""
    out = Path(recipe.output.dir)
    check_output(out, recipe.output.overwrite)
    device = resolve_device(recipe.model.device)
    set_threads(recipe.model.threads)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    log(f"loading model {recipe.model.source!r} ...")
    loaded = load_model(recipe.model.source, recipe.model.dtype, device, recipe.model.revision,
                        recipe.model.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    arch = get_arch(model)
    planted = plant_outliers(model, arch, recipe.model.plant_outliers) if recipe.model.plant_outliers else None
    timings["load"] = time.perf_counter() - t
    plans = plan_stages(model, arch, recipe)  # strict-mode errors surface here, before any heavy work
    n_params = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    model_reports, before_distill = run_model_stages(model, tokenizer, arch, recipe, recipe.calibration.source()
                                                     if recipe.calibration else None, out, resume, progress, log)
    if model_reports:
        timings["prune_distill"] = time.perf_counter() - t
    rank, _ = world()
    if rank != 0:  # `accelerate launch`: the other processes only helped distill
        return {}
    if model_reports:
        arch = get_arch(model)
        plans = plan_stages(model, arch, recipe)  # on the pruned shapes
    check_formats(model, plans, recipe.output.formats)  # an impossible export fails before the calibration pass

    report: dict = {
        "compress_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"path": recipe.path, "sha256": recipe.sha256, "overrides": list(recipe.overrides),
                   "text": recipe.text, "resolved": to_plain(recipe, skip=("path", "text", "sha256", "overrides"))},
        "model": {"source": loaded.source, "kind": loaded.kind, "family": arch.family, "parameters": n_params,
                  "parameters_after": sum(p.numel() for p in model.parameters()),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
                  "threads": torch.get_num_threads(), "planted_outliers": planted},
    }

    t = time.perf_counter()
    sections, samples = compress_model(model, tokenizer, arch, recipe, plans, device, model_reports, progress, log)
    report.update(sections)
    timings["compress"] = time.perf_counter() - t
    set_threads(recipe.model.threads)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if recipe.output.save_model:
            t = time.perf_counter()
            log(f"saving the compressed model ...")
            save_compressed(model, tokenizer, tmp, {"compress_version": __version__, "recipe_sha256": recipe.sha256,
                                                    "recipe": recipe.text, "source": loaded.source},
                            recipe.output.save_dtype)
            timings["save"] = time.perf_counter() - t
        t = time.perf_counter()
        baseline = None
        if recipe.eval.baseline:  # reloaded rather than copied up front: keeps the calibration pass's peak low
            log("reloading the original model as the baseline ...")
            baseline = load_model(recipe.model.source, recipe.model.dtype, device, recipe.model.revision,
                                  recipe.model.trust_remote_code).model
            if recipe.model.plant_outliers:
                plant_outliers(baseline, arch, recipe.model.plant_outliers)
        log("evaluating ...")
        models = {"baseline": baseline} if baseline is not None else {}
        if before_distill is not None:
            models["pruned"] = before_distill  # the same windows before and after distillation
        models["compressed"] = model
        report["eval"] = evaluate_models(models, tokenizer, recipe.eval, device,
                                         baseline="baseline" if baseline is not None else None, progress=progress)
        timings["eval"] = time.perf_counter() - t
        report["memory"] = {
            "checkpoint_bytes": folder_bytes(tmp) if recipe.output.save_model else None,
            "baseline_checkpoint_bf16_bytes": _bf16_bytes(baseline or model),
        }
        if recipe.output.formats:
            t = time.perf_counter()
            windows, text = verify_windows(recipe, tokenizer, samples)
            report["exports"] = write_exports(model, tokenizer, tmp, out, recipe, loaded.source, windows, text, log)
            timings["export"] = time.perf_counter() - t
        report["timings"] = timings
        (tmp / "recipe.yaml").write_text(recipe.text or recipe.resolved_yaml())
        (tmp / "recipe.resolved.yaml").write_text(recipe.resolved_yaml())
        write_report(report, tmp)
        for stage in report["stages"]:
            if any(p.get("ppl") is not None for p in stage.get("curve") or ()):
                plot_recovery(stage, tmp / f"recovery_curve_stage{stage['index']}.png")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(work_dir(out), ignore_errors=True)  # distillation checkpoints: the run finished
    log(f"wrote {out}/report.md")
    return report


def _bf16_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * 2
    return total


__all__ = ["run", "QuantizeStage"]
