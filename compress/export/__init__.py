"""Export a compressed model to the checkpoint formats serving stacks load.

EXPORTERS maps a format name to an Exporter: who loads it, what it refuses (checked before any file is
written), the function that writes it and the one that reads it back (`compress verify`); its keys are the list of
formats. `export_model` is the one way to write any of them: validate,
write into a temporary folder beside the target, add `export.json` (format, recipe sha256, toolkit
version, what happened to every tensor), then rename into place.
"""
from __future__ import annotations

import contextlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from .._version import __version__
from .errors import ExportError
from .gguf_mix import GGUF_TYPES
from .staging import staged

EXPORT_META = "export.json"


@dataclass(frozen=True)
class Exporter:
    name: str
    loaders: str  # who reads it, for --help and the README table
    problems: Callable[[nn.Module], list[str]]  # why this model cannot be exported (empty: it can), layer by layer
    # (model, tokenizer, folder, source_gguf=None, max_shard_bytes=..., parts=None) -> report
    write: Callable[..., dict]
    # (folder, export.json's record) -> (loader description, model), or (loader, .gguf path): `compress verify`
    read: Callable[[Path, dict], tuple]


def _lazy(module: str, function: str) -> Callable:
    """`module.function` of this package, imported on first call: the format modules import torch-heavy helpers,
    and the registry (and FORMAT_NAMES, which recipes and --help read) must not."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{function}"
    return call


def _gguf(qtype: str) -> Exporter:
    def problems(model):
        from .gguf import gguf_problems
        return gguf_problems(model, qtype)

    def write(model, tokenizer, folder, source_gguf=None, parts=None, **_):  # one .gguf file (llama.cpp reads one)
        from .gguf import write_gguf
        from .gguf_mix import K_FORMATS

        stats, note = {}, None
        if qtype in K_FORMATS:  # llama-quantize --imatrix's statistics, from the calibration text (gguf_calib.py)
            if parts is not None:
                note = "streamed model: no calibration pass, quantized without an importance matrix"
            else:
                from .gguf_calib import export_calibration
                stats, note = export_calibration(model, tokenizer)
        report = write_gguf(model, tokenizer, Path(folder) / f"model-{qtype}.gguf", qtype, source_gguf=source_gguf,
                            parts=parts, **stats)
        if note:
            report["calibration"] = note
            report["notes"].append(note)
        return report

    return Exporter(f"gguf-{qtype}", "llama.cpp, llama-cpp-python, Ollama, LM Studio", problems, write,
                    _lazy("readers", "read_gguf"))


# The formats: a new one is a module with problems / write (and a reader in readers.py) plus one line here.
EXPORTERS: dict[str, Exporter] = {e.name: e for e in (
    Exporter("dense", "transformers, vLLM, SGLang, TensorRT-LLM (plain float checkpoint)",
             _lazy("hf", "dense_problems"), _lazy("hf", "write_dense"), _lazy("readers", "read_transformers")),
    Exporter("compressed-tensors", "vLLM, SGLang, transformers (compressed-tensors)",
             _lazy("compressed_tensors", "problems"), _lazy("compressed_tensors", "write"),
             _lazy("readers", "read_transformers")),
    Exporter("awq", "vLLM, SGLang, transformers (AutoAWQ GEMM layout)",
             _lazy("hf", "awq_problems"), _lazy("hf", "write_awq"), _lazy("readers", "read_awq")),
    Exporter("gptq", "vLLM, SGLang, transformers (GPTQ v1 layout)",
             _lazy("hf", "gptq_problems"), _lazy("hf", "write_gptq"), _lazy("readers", "read_gptq")),
    Exporter("fp8", "vLLM (quant_method fp8), TensorRT-LLM / ModelOpt (hf_quant_config.json)",
             _lazy("fp8", "problems"), _lazy("fp8", "write"), _lazy("readers", "read_fp8")),
    Exporter("modelopt-nvfp4", "TensorRT-LLM, vLLM (ModelOpt NVFP4, Blackwell)",
             _lazy("modelopt", "problems"), _lazy("modelopt", "write"), _lazy("readers", "read_modelopt")),
    Exporter("mlx", "mlx-lm (Apple silicon; mlx-cpu on Linux)", _lazy("mlx", "problems"), _lazy("mlx", "write"),
             _lazy("mlx", "read")),
    Exporter("native", "compress (`compress eval` / `export` / `verify`; what `compress run` writes)",
             _lazy("native", "problems"), _lazy("native", "write"), _lazy("native", "read")),
    *(_gguf(qtype) for qtype in GGUF_TYPES),
)}
FORMAT_NAMES = tuple(EXPORTERS)


def get_exporter(name: str) -> Exporter:
    if name not in FORMAT_NAMES:
        raise ExportError(f"unknown export format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")
    return EXPORTERS[name]


def check_export(model: nn.Module, name: str) -> Exporter:
    """The exporter for `name`, after checking that this model can be written in it."""
    problems = export_problems(model, name)
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ExportError(f"cannot export to {name}:\n  {shown}")
    return get_exporter(name)


def export_problems(model: nn.Module, name: str) -> list[str]:
    """Why this model cannot be written as `name` (empty: it can), each with the way out."""
    from ..transforms.rotation import online_rotation_problem

    exporter = get_exporter(name)
    problems = exporter.problems(model)
    if (why := online_rotation_problem(model, exporter.loaders)) is not None:
        problems = [why] + problems
    if name not in ("native", "dense") and any(getattr(m, "trellis", None) is not None for m in model.modules()):
        problems = [f"the model's weights are trellis codes (method: trellis), which no {name} loader "
                    f"({exporter.loaders}) reads; export `native` (compress's own checkpoint, decoded by compress) "
                    "or `dense` (the decoded weights in float)"] + problems
    if int_kv := sorted({m.kv_quant.name for m in model.modules() if getattr(m, "kv_quant", None) is not None}):
        problems = [f"the model attends over a {', '.join(int_kv)} KV cache (the kv_cache stage), which no {name} "
                    f"loader ({exporter.loaders}) reads from a checkpoint: a serving engine chooses its KV cache at "
                    "run time; export a run without that stage (or with the fp8 kv_cache, whose scales they load)"] \
            + problems
    from .adapter import lowrank_layers
    if name != "native" and lowrank_layers(model):
        from ..arch.moe import hub_names
        if hub_names(model).fused:
            problems = [f"the eora stage's low-rank terms go beside a {name} export as a LoRA adapter named by "
                        f"layer, and {type(model).__name__} checkpoints fuse each MoE block's experts into one "
                        "tensor, which no adapter names; export `native`, or run without the eora stage"] + problems
    if name != "dense":
        from ..arch.moe import hub_names
        if hub_names(model).fused:
            problems = [f"{type(model).__name__} checkpoints store each MoE block's experts as fused 3-D tensors, "
                        f"which the {name} format has no layout for (its loaders read per-expert quantized "
                        "layers); export `dense` (the experts fused as transformers saves them)"] + problems
    return problems


def library_versions() -> dict[str, str]:
    """The versions of the libraries whose formats and loaders an export follows (those installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "transformers", "compressed-tensors", "safetensors", "gguf"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def export_model(model: nn.Module, tokenizer, name: str, out: str | Path, meta: dict | None = None,
                 overwrite: bool = False, source_gguf: str | None = None, max_shard_bytes: int | None = None,
                 parts=None) -> dict:
    """Write `model` as format `name` into folder `out` (atomically; safetensors formats in shards of at most
    `max_shard_bytes`, 5 GB by default). Returns the export record. `parts` streams the model: each of its steps
    puts one part of `model` in memory (streaming.stream_parts), and the exporter writes that part's tensors then,
    so a model larger than memory is exported with one decoder block resident."""
    out = Path(out)
    exporter = check_export(model, name)
    if out.exists() and not overwrite:
        raise FileExistsError(f"export folder {out} exists; pass --overwrite to replace it, or choose another "
                              "--output")
    from .adapter import ADAPTER_DIR, adapter_note, detached_lowrank, lowrank_layers, write_adapter
    adapter = name != "native" and bool(lowrank_layers(model))  # our own checkpoint keeps the terms in its layers
    if adapter and parts is not None:
        raise ExportError("a streamed run's low-rank terms (the eora stage) are exported as an adapter only from a "
                          "model in memory: run `compress export` on the run folder where it fits, or run without "
                          "the eora stage")
    with staged(out) as tmp:
        sharding = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        with detached_lowrank(model) if adapter else contextlib.nullcontext({}) as terms:
            report = exporter.write(model, tokenizer, tmp, source_gguf=source_gguf, parts=parts, **sharding)
        from .notes import CHECKED_WITH, serving_notes
        report["notes"] = list(report.get("notes") or []) + serving_notes(model, name)
        if terms:
            report["adapter"] = write_adapter(terms, tmp / ADAPTER_DIR)
            report["notes"].append(adapter_note(name))
        record = {"format": name, "loaders": exporter.loaders, "compress_version": __version__,
                  "written_with": library_versions(), "engines_checked": CHECKED_WITH, **(meta or {}), **report}
        (tmp / EXPORT_META).write_text(json.dumps(record, indent=2, default=str))
    return record


__all__ = ["EXPORTERS", "FORMAT_NAMES", "ExportError", "Exporter", "check_export", "export_model", "get_exporter"]
