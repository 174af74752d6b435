"""`compress run`: load -> plan -> calibrate block by block -> apply stages -> save -> evaluate -> report.

State is passed explicitly; the output folder is written under a temporary name and renamed into
place at the end, so a crash or Ctrl-C never leaves a half-written output.
"""
from __future__ import annotations

import copy
import datetime
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import __version__
from .arch import get_arch
from .blockwise import run_blockwise
from .data import fingerprint, load_texts, random_windows, sample_from_model, tokenize_joined
from .evaluate.memory import folder_bytes
from .evaluate.report import evaluate_models, write_report
from .models import load_model, resolve_device, save_compressed
from .nn import is_linear
from .quantize import QuantizeStage, apply_quantize, plan_quantize
from .recipe import Recipe, to_plain


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"output folder {out} exists; pass --overwrite (or output.overwrite: true) to replace it, "
                              "or choose another output.dir")


def calibration_samples(recipe: Recipe, model, tokenizer) -> tuple[torch.Tensor, dict]:
    cal = recipe.calibration
    if cal.kind == "self":
        samples = sample_from_model(model, cal.n_samples, cal.seq_len, cal.seed)
    else:
        samples = random_windows(tokenize_joined(load_texts(cal.source()), tokenizer), cal.n_samples, cal.seq_len,
                                 cal.seed)
    info = {k: v for k, v in asdict(cal).items() if v not in (None, ())}
    info.update(fingerprint=fingerprint(samples), tokens=int(samples.numel()))
    return samples, info


def plan_stages(model, arch, recipe: Recipe) -> list:
    """One plan per stage; a layer claimed by an earlier stage is not quantized again."""
    plans, claimed = [], {}
    for i, stage in enumerate(recipe.stages):
        plan = plan_quantize(model, arch, stage)
        for entry in plan.quantized:
            if entry.name in claimed:
                entry.scheme, entry.reason = None, f"quantized by stage {claimed[entry.name]}"
            else:
                claimed[entry.name] = i
        plans.append(plan)
    return plans


def kept_in_float(model, arch) -> list[str]:
    """Weight-holding modules outside the linear layers (embeddings, norms): reported, never silent."""
    kinds: dict[str, int] = {}
    for name, m in model.named_modules():
        if is_linear(m) or not isinstance(getattr(m, "weight", None), torch.Tensor) or list(m.children()):
            continue
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    return [f"{n}× {k} (weight-only integer schemes apply to linear layers)" for k, n in sorted(kinds.items())]


def run(recipe: Recipe, progress: bool = True, log=print) -> dict:
    out = Path(recipe.output.dir)
    check_output(out, recipe.output.overwrite)
    device = resolve_device(recipe.model.device)
    if recipe.model.threads > 0:
        torch.set_num_threads(recipe.model.threads)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    log(f"loading model {recipe.model.source!r} ...")
    loaded = load_model(recipe.model.source, recipe.model.dtype, device, recipe.model.revision,
                        recipe.model.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    arch = get_arch(model)
    timings["load"] = time.perf_counter() - t
    plans = plan_stages(model, arch, recipe)  # strict-mode errors surface here, before any heavy work
    n_params = sum(p.numel() for p in model.parameters())
    baseline = copy.deepcopy(model) if recipe.eval.baseline else None

    report: dict = {
        "compress_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"path": recipe.path, "sha256": recipe.sha256, "overrides": list(recipe.overrides),
                   "text": recipe.text, "resolved": to_plain(recipe, skip=("path", "text", "sha256", "overrides"))},
        "model": {"source": loaded.source, "kind": loaded.kind, "family": arch.family, "parameters": n_params,
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
                  "threads": torch.get_num_threads()},
    }

    t = time.perf_counter()
    if recipe.calibration is not None:
        log("preparing calibration data ...")
        samples, report["calibration"] = calibration_samples(recipe, model, tokenizer)

        def on_block(_i, prefix, _block, _inputs):
            for stage, plan in zip(recipe.stages, plans):
                apply_quantize(model, plan, stage, prefix=prefix)

        log(f"calibrating block by block on {device} ({samples.shape[0]} × {samples.shape[1]} tokens) ...")
        report["block_errors"] = run_blockwise(model, arch, samples, on_block, device=device, progress=progress)
    for stage, plan in zip(recipe.stages, plans):  # everything outside the blocks (or all, without calibration)
        apply_quantize(model, plan, stage)
    timings["compress"] = time.perf_counter() - t
    report["stages"] = [
        {"index": i, "stage": "quantize", "method": s.method, "scheme": s.scheme.name, "scheme_fields": asdict(s.scheme),
         "quantized": len(p.quantized), "skipped": [{"name": e.name, "reason": e.reason} for e in p.skipped],
         "layers": {e.name: e.scheme.name for e in p.quantized}}
        for i, (s, p) in enumerate(zip(recipe.stages, plans))]
    report["kept_in_float"] = kept_in_float(model, arch)

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
        log("evaluating ...")
        models = {"baseline": baseline, "compressed": model} if baseline is not None else {"compressed": model}
        report["eval"] = evaluate_models(models, tokenizer, recipe.eval, device,
                                         baseline="baseline" if baseline is not None else None, progress=progress)
        timings["eval"] = time.perf_counter() - t
        report["memory"] = {
            "checkpoint_bytes": folder_bytes(tmp) if recipe.output.save_model else None,
            "baseline_checkpoint_bf16_bytes": _bf16_bytes(baseline or model),
        }
        report["timings"] = timings
        (tmp / "recipe.yaml").write_text(recipe.text or recipe.resolved_yaml())
        (tmp / "recipe.resolved.yaml").write_text(recipe.resolved_yaml())
        write_report(report, tmp)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
