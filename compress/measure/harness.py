"""lm-evaluation-harness on models in memory, offline on the local benchmark files.

The task files in eval/lm_eval/ include the installed harness's official task configs (prompts, choices,
splits, metrics) and change only where the data comes from: the data folder (`find_data_dir`, i.e.
COMPRESS_DATA_DIR or ../shared/data), through the adapters beside them. They are rendered into a temporary
folder with the harness's task directory and the data folder filled in. Without a data folder the official
tasks run from the hub. Every model goes through the same HFLM wrapper with the same settings, so baseline
and compressed scores are comparable; the result records the harness and task versions, the few-shot
count, the limit and the BOS handling.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

TASKS = ("arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "lambada_openai", "wikitext")
LOWER_IS_BETTER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")


def _harness():
    try:
        import lm_eval
    except ImportError as exc:
        raise ImportError("lm-eval tasks need lm-evaluation-harness: pip install 'compress[eval]' "
                          "(or pip install lm-eval)") from exc
    return lm_eval


@contextlib.contextmanager
def task_folder(data_dir: Path):
    """The local task files, rendered for this harness install and data folder, in a temporary folder."""
    from ..resources import resource_dir

    lm_eval = _harness()
    task_dir = resource_dir("eval") / "lm_eval"
    if not task_dir.is_dir():
        raise FileNotFoundError(f"the lm-eval task files are missing ({task_dir}); reinstall compress")
    official = Path(lm_eval.__file__).parent / "tasks"
    with tempfile.TemporaryDirectory(prefix="compress-lm-eval-") as tmp:
        for f in task_dir.iterdir():
            if f.suffix == ".yaml":
                text = f.read_text().replace("${LM_EVAL_TASKS}", str(official)).replace("${DATA_DIR}", str(data_dir))
                (Path(tmp) / f.name).write_text(text)
            elif f.name == "adapters.py":
                shutil.copy(f, tmp)
        yield Path(tmp)


@contextlib.contextmanager
def _offline(on: bool):
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE while local tasks run: `datasets` otherwise pings a usage counter."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    if on:
        os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_tasks(tasks) -> None:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown lm-eval task {unknown[0]!r}; compress runs {', '.join(TASKS)}")


def _scores(results: dict, name: str) -> dict:
    """{metric: {value, stderr}} from one task's lm-eval result ('acc,none', 'acc_stderr,none', ...)."""
    out = {}
    for key, value in results[name].items():
        metric, comma, _filter = key.partition(",")  # metrics are "name,filter"; "alias", "sample_len" are not
        if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
            continue
        stderr = results[name].get(f"{metric}_stderr,{_filter}")
        out[metric] = {"value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
    return out


def evaluate_tasks(models: dict[str, nn.Module], tokenizer, tasks, limit: int | None = None, num_fewshot: int = 0,
                   batch_size: int = 8, data_dir: Path | None = None, baseline: str | None = None,
                   max_length: int | None = None) -> dict:
    """Score every model on `tasks` with the same harness settings. Against the baseline: the difference with its
    standard error (`vs_baseline`; reports show this), and the ratio (`recovery`, compressed ÷ baseline, inverted
    for perplexities: kept in the JSON, not shown, since a ratio of two noisy scores hides the noise)."""
    from ..calibrate.data import DATA_ENV, find_data_dir

    check_tasks(tasks)
    lm_eval = _harness()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    data_dir = data_dir or find_data_dir()
    no_data = (f"no local benchmark folder ({DATA_ENV} unset and no ../shared/data), and the official lm-eval tasks "
               f"need the Hugging Face hub")
    if data_dir is None and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        raise RuntimeError(f"{no_data}, which HF_HUB_OFFLINE forbids; set {DATA_ENV} to the data folder")
    names = {t: f"{t}_local" if data_dir is not None else t for t in tasks}
    scores: dict[str, dict] = {}
    versions: dict = {}
    with contextlib.ExitStack() as stack:
        include = stack.enter_context(task_folder(data_dir)) if data_dir is not None else None
        stack.enter_context(_offline(data_dir is not None))
        manager = TaskManager(include_path=str(include) if include else None)
        for model_name, model in models.items():
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                      **({"max_length": max_length} if max_length else {}))  # None: the model's context
            if lm.device.type == "meta":  # offloaded to disk on a CPU (compress eval --offload): model.device is
                lm._device = torch.device("cpu")  # meta, but accelerate's hooks compute on the CPU; no public setter
            try:
                out = lm_eval.simple_evaluate(model=lm, tasks=list(names.values()), num_fewshot=num_fewshot,
                                              limit=limit, task_manager=manager, log_samples=False,
                                              bootstrap_iters=1000)
            except ConnectionError as exc:
                raise RuntimeError(f"{no_data}, which did not answer ({exc}); set {DATA_ENV} to the data "
                                   "folder") from exc
            scores[model_name] = {t: _scores(out["results"], n) for t, n in names.items()}
            versions = {t: out["versions"].get(n) for t, n in names.items()}
            bos = bool(getattr(lm, "add_bos_token", False))
    result = {"harness": f"lm-eval {lm_eval.__version__}" if hasattr(lm_eval, "__version__") else "lm-eval",
              "tasks": {t: {"name": n, "version": versions.get(t)} for t, n in names.items()},
              "data": str(data_dir) if data_dir is not None else "Hugging Face hub (official tasks)",
              "num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size,
              "bos": "added" if bos else "not added (HFLM default for this tokenizer)", "scores": scores}
    if baseline is not None and baseline in scores:
        result["vs_baseline"] = {
            m: {t: {k: difference(scores[baseline][t][k], v) for k, v in per.items()} for t, per in by_task.items()}
            for m, by_task in scores.items() if m != baseline}
        result["recovery"] = {
            m: {t: {k: _recovery(k, scores[baseline][t][k]["value"], v["value"]) for k, v in per.items()}
                for t, per in by_task.items()}
            for m, by_task in scores.items() if m != baseline}
    return result


def difference(base: dict, other: dict) -> dict:
    """other − baseline with the standard error of the difference, sqrt(se_base² + se_other²) (the two runs score
    the same documents, so this overstates the error a little; it never understates it). `within_noise`: the
    difference is under two standard errors, i.e. not distinguishable from zero at this document count."""
    delta = other["value"] - base["value"]
    if base["stderr"] is None or other["stderr"] is None:
        return {"delta": delta, "stderr": None, "within_noise": None}
    se = (base["stderr"] ** 2 + other["stderr"] ** 2) ** 0.5
    return {"delta": delta, "stderr": se, "within_noise": abs(delta) < 2 * se}


def _recovery(metric: str, base: float, value: float) -> float | None:
    if metric in LOWER_IS_BETTER:
        return base / value if value else None
    return value / base if base else None
