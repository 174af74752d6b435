"""Reading export formats back, for `compress verify`: through the format's own loader where it runs here
(transformers for dense, compressed-tensors and block-scaled fp8; llama-cpp-python for GGUF), else with the format's
published layout dequantized into a dense model (AWQ, GPTQ, per-tensor fp8, ModelOpt NVFP4: their serving kernels need
a GPU), and the description says which. Each EXPORTERS entry names its reader (a new format may keep its reader in its
own module, as native.py does, using the helpers here); every reader takes (folder, export.json's record) and returns
(loader description, model), or for GGUF (loader, path of the .gguf file)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from ..arch import auto_model_class
from ..arch.moe import unfuse_experts
from .shards import read_safetensors

# compressed-tensors' microscaling formats: its compressed-mode CPU forward runs them in bfloat16 whatever the
# model's dtype; the dequantizing load decompresses them once (the library's own decompress) into the weights
MICRO_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
READER = "compress reader (the format's layout, dequantized; its serving kernels need a GPU)"


def _needs_dequantize(config: dict) -> bool:
    """transformers' compressed layout for pack-quantized asymmetric weights expects an unpacked zero point,
    while compressed-tensors writes (and vLLM reads) it packed; the dequantizing load path reads it right."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any(g.get("format") == "pack-quantized" and not (g.get("weights") or {}).get("symmetric", True)
               or g.get("format") in MICRO_FORMATS for g in groups.values())


def _dense_from_tensors(folder: Path, dequantize_layer) -> nn.Module:
    """A float model of the export's config whose quantized layers are filled by `dequantize_layer`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = read_safetensors(folder)
    dense: dict[str, Tensor] = {}
    prefixes = {k.rsplit(".", 1)[0] for k in state
                if k.endswith((".qweight", ".weight_scale", ".weight_scale_inv", ".scales"))}  # .scales: mlx
    for k, v in state.items():
        module, _, leaf = k.rpartition(".")
        if module in prefixes and leaf != "bias":
            continue
        if leaf in ("k_scale", "v_scale"):
            continue
        dense[k] = v.float() if v.is_floating_point() else v
    for p in prefixes:
        dense[f"{p}.weight"] = dequantize_layer(p, state)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    unfuse_experts(model)  # exports name each expert's layers (experts.{e}.gate_proj, ...)
    missing, unexpected = model.load_state_dict(dense, strict=False)
    model.tie_weights()
    missing = [m for m in missing if not (getattr(config, "tie_word_embeddings", False) and "lm_head" in m)]
    if missing or unexpected:
        raise ValueError(f"{folder}: export does not match its config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    return model.eval()


def _without_input_quantization(model: nn.Module) -> nn.Module:
    """Switch off compressed-tensors' reference activation quantization in a reloaded model. Its CPU reference
    scales symmetric int8 by absmax / 127.5 (compressed_tensors.quantization.utils.calculate_qparams: half the
    255-code range), while vLLM's kernels and our model use absmax / 127, so the two cannot agree token for
    token; the stored weights are compared with float inputs on both sides, and the stored input scales are
    compared with ours exactly (verify_export)."""
    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is not None and scheme.input_activations is not None:
            m.quantization_scheme = scheme.model_copy(update={"input_activations": None})
    return model


def _without_offloading(model: nn.Module) -> nn.Module:
    """transformers 5.17 (the GPU machine's) leaves a compressed-tensors reload under compressed-tensors' own
    offloading: each module's parameters in a CPU cache, copied to its onload device at every access, and its inputs
    sent there; `.to(device)` and `.float()` then act on those copies, not on the weights. Removed, so that the model
    is moved and cast like any other (5.25 loads a plain model: nothing to remove)."""
    try:
        from compressed_tensors.offload import OffloadCache, remove_dispatch
    except ImportError:
        return model
    if any(isinstance(m._parameters, OffloadCache) for m in model.modules()):
        remove_dispatch(model)
    return model


def read_gguf(folder: Path, record: dict):
    return "llama-cpp-python", next(folder.glob("*.gguf"))


def read_transformers(folder: Path, record: dict):
    """transformers' own loader (compressed-tensors' for its format), in float32."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    fmt = record["format"]
    config = json.loads((folder / "config.json").read_text())
    kwargs = {}
    loader = "transformers"
    if fmt == "compressed-tensors":
        from transformers import CompressedTensorsConfig
        deq = _needs_dequantize(config)
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=deq)
        loader = "transformers + compressed-tensors" + (" (dequantize on load)" if deq else "")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the KV scales as unexpected: applied below
    try:
        with warnings.catch_warnings():  # "quantization_config from the model will be used": the point
            warnings.simplefilter("ignore", UserWarning)
            auto = auto_model_class(AutoConfig.from_pretrained(folder))
            model = auto.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    _without_offloading(model)
    if fmt == "compressed-tensors" and deq:
        # transformers 5.17's dequantizing load leaves NVFP4 weights decompressed in bfloat16 beside float32
        # activations (a dtype error at the first matmul); 5.25 gives float32. Compared in float32 either way
        # (transformers refuses .float() on a quantized model: the tensors are cast one by one)
        for t in [*model.parameters(), *model.buffers()]:
            if t.dtype in (torch.bfloat16, torch.float16):
                t.data = t.data.float()
    return loader, _without_input_quantization(model)


def read_awq(folder: Path, record: dict):
    from .awq import awq_dequantize
    return READER, _dense_from_tensors(folder, lambda p, s: awq_dequantize(
        s[f"{p}.qweight"], s[f"{p}.qzeros"], s[f"{p}.scales"]))


def read_gptq(folder: Path, record: dict):
    from .gptq import gptq_dequantize
    bits = json.loads((folder / "config.json").read_text())["quantization_config"]["bits"]
    return READER, _dense_from_tensors(folder, lambda p, s: gptq_dequantize(
        s[f"{p}.qweight"], s[f"{p}.qzeros"], s[f"{p}.scales"], s[f"{p}.g_idx"], bits))


def read_modelopt(folder: Path, record: dict):
    from .modelopt import dequantize_layer
    return ("compressed-tensors' ModelOpt NVFP4 converter + NVFP4 decompressor (TensorRT-LLM's and vLLM's "
            "kernels need a Blackwell GPU)"), _dense_from_tensors(folder, dequantize_layer)


def read_fp8(folder: Path, record: dict):
    """Block-scaled fp8 through transformers' own fp8 loader; per-tensor / per-channel fp8 from its layout."""
    quant = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("weight_block_size"):
        return read_transformers(folder, record)
    return READER, _dense_from_tensors(folder, lambda p, s: s[f"{p}.weight"].float() * s[f"{p}.weight_scale"])
