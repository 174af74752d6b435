"""Export a compressed model to the checkpoint formats serving stacks load.

EXPORTERS maps a format name to an Exporter: who loads it, what it refuses (checked before any file is
written) and the function that writes it. `export_model` is the one way to write any of them: validate,
write into a temporary folder beside the target, add `export.json` (format, recipe sha256, toolkit
version, what happened to every tensor), then rename into place.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from .._version import __version__
from .errors import ExportError
from .staging import staged

EXPORT_META = "export.json"
# llama.cpp block formats we write; the K-quant ones with llama-quantize's per-tensor mixes (gguf_mix.py)
GGUF_TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")


@dataclass(frozen=True)
class Exporter:
    name: str
    loaders: str  # who reads it, for --help and the README table
    problems: Callable[[nn.Module], list[str]]  # why this model cannot be exported (empty: it can)
    # (model, tokenizer, folder, source_gguf=None, max_shard_bytes=..., parts=None) -> report
    write: Callable[..., dict]


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

    return Exporter(f"gguf-{qtype}", "llama.cpp, llama-cpp-python, Ollama, LM Studio", problems, write)


def _registry() -> dict[str, Exporter]:
    from . import compressed_tensors, fp8, hf, modelopt

    table = {
        "dense": Exporter("dense", "transformers, vLLM, SGLang, TensorRT-LLM (plain float checkpoint)",
                          hf.dense_problems, hf.write_dense),
        "compressed-tensors": Exporter("compressed-tensors", "vLLM, SGLang, transformers (compressed-tensors)",
                                       compressed_tensors.problems, compressed_tensors.write),
        "awq": Exporter("awq", "vLLM, SGLang, transformers (AutoAWQ GEMM layout)", hf.awq_problems, hf.write_awq),
        "gptq": Exporter("gptq", "vLLM, SGLang, transformers (GPTQ v1 layout)", hf.gptq_problems, hf.write_gptq),
        "fp8": Exporter("fp8", "vLLM (quant_method fp8), TensorRT-LLM / ModelOpt (hf_quant_config.json)",
                        fp8.problems, fp8.write),
        "modelopt-nvfp4": Exporter("modelopt-nvfp4", "TensorRT-LLM, vLLM (ModelOpt NVFP4, Blackwell)",
                                   modelopt.problems, modelopt.write),
    }
    for qtype in GGUF_TYPES:
        table[f"gguf-{qtype}"] = _gguf(qtype)
    return table


FORMAT_NAMES = ("dense", "compressed-tensors", "awq", "gptq", "fp8", "modelopt-nvfp4") + tuple(f"gguf-{t}" for t in GGUF_TYPES)


def get_exporter(name: str) -> Exporter:
    if name not in FORMAT_NAMES:
        raise ExportError(f"unknown export format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")
    return _registry()[name]


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
    if int_kv := sorted({m.kv_quant.name for m in model.modules() if getattr(m, "kv_quant", None) is not None}):
        problems = [f"the model attends over a {', '.join(int_kv)} KV cache (the kv_cache stage), which no {name} "
                    f"loader ({exporter.loaders}) reads from a checkpoint: a serving engine chooses its KV cache at "
                    "run time; export a run without that stage (or with the fp8 kv_cache, whose scales they load)"] \
            + problems
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
    with staged(out) as tmp:
        sharding = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        report = exporter.write(model, tokenizer, tmp, source_gguf=source_gguf, parts=parts, **sharding)
        from .notes import CHECKED_WITH, serving_notes
        report["notes"] = list(report.get("notes") or []) + serving_notes(model, name)
        record = {"format": name, "loaders": exporter.loaders, "compress_version": __version__,
                  "written_with": library_versions(), "engines_checked": CHECKED_WITH, **(meta or {}), **report}
        (tmp / EXPORT_META).write_text(json.dumps(record, indent=2, default=str))
    return record


__all__ = ["EXPORTERS", "FORMAT_NAMES", "ExportError", "Exporter", "check_export", "export_model", "get_exporter"]


def __getattr__(attr):  # EXPORTERS is built on first use: the format modules import torch-heavy helpers
    if attr == "EXPORTERS":
        return _registry()
    raise AttributeError(attr)
