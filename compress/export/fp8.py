"""fp8 checkpoints for vLLM (`quant_method: fp8`) and TensorRT-LLM / ModelOpt (`hf_quant_config.json`).

Tensors per quantized layer: `weight` float8_e4m3fn [N, K] and `weight_scale` float32 [1] (per tensor; vLLM's
Fp8LinearMethod reads one scale per weight), or `weight_scale_inv` float32 [N/B, K/B] for B×B blocks
(`weight_block_size`, DeepSeek-V3 style, also read by transformers' FineGrainedFP8); static activations add
`input_scale` float32 [1]. KV-cache scales use ModelOpt's names `<attention>.k_proj.k_scale` and
`.v_proj.v_scale`, which vLLM remaps too (vllm/model_executor/model_loader/weight_utils.py,
maybe_remap_kv_scale_name). `hf_quant_config.json` ({"producer", "quantization": {"quant_algo": "FP8",
"kv_cache_quant_algo", "exclude_modules"}}) is written when TensorRT-LLM's FP8 recipe applies: per-tensor
weights with static per-tensor input scales.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from .._version import __version__
from ..core.nn import QuantLinear
from .shards import MAX_SHARD_BYTES
from .hf import (config_dtype, conv1d_problems, float_linears, float_tensors, fused_problems, head_problems,
                 kv_modules, quant_layers, resident, resident_layers, write_hf)

HF_QUANT_CONFIG = "hf_quant_config.json"


def layer_problem(m: QuantLinear) -> str | None:
    s, act = m.scheme, m.scheme.act
    if s.dtype != "fp8_e4m3":
        return "the fp8 format holds fp8 e4m3 weights; use compressed-tensors (int) or quantize with FP8 / FP8_BLOCK"
    if s.granularity == "channel":
        return "vLLM's fp8 format has one weight scale per tensor (or per block); per-channel fp8 " \
               "(FP8_DYNAMIC) is served from compressed-tensors: export compressed-tensors"
    if s.granularity == "block" and (act is None or not act.dynamic):
        return "block-scaled fp8 weights go with dynamic activations in vLLM"
    if act is not None and act.dtype != "fp8_e4m3":
        return "fp8 weights go with fp8 e4m3 activations"
    return None


def problems(model: nn.Module) -> list[str]:
    out = conv1d_problems(model, "fp8") + fused_problems(model, "fp8")
    layers = quant_layers(model)
    if not layers:
        out.append("no layer is quantized; quantize with an fp8 scheme (recipes/fp8_dynamic.yaml) first")
    out += [f"{n} ({m.scheme.name}): {why}" for n, m in layers.items() if (why := layer_problem(m))]
    out += head_problems(model, "the fp8 format's loaders keep the output projection in float (vLLM's Fp8 "
                         "quantizes linear layers only; transformers skips the output embeddings)")
    static = {m.scheme.act is not None and not m.scheme.act.dynamic for m in layers.values()}
    if len(static) > 1:
        out.append("the fp8 config has one activation_scheme for the whole model, and this model mixes static "
                   "and dynamic activation scales; export compressed-tensors")
    blocks = {m.scheme.group_size for m in layers.values() if m.scheme.granularity == "block"}
    if blocks and (len(blocks) > 1 or len(blocks) != len({m.scheme.granularity for m in layers.values()})):
        out.append("the fp8 config has one weight_block_size for the whole model; quantize every layer alike")
    for n, m in kv_modules(model).items():
        if m.kv_cache_dtype != "fp8_e4m3":
            out.append(f"{n}: KV cache {m.kv_cache_dtype}; the fp8 format carries e4m3 KV-cache scales only")
    return out


def _kv_scale_name(model: nn.Module, attention: str, which: str) -> str:
    proj = f"{which}_proj"
    has_proj = hasattr(model.get_submodule(attention), proj)
    return f"{attention}.{proj}.{which}_scale" if has_proj else f"{attention}.{which}_scale"


def write(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.bfloat16,
          max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    kv = kv_modules(model)
    layers = quant_layers(model)
    report = {}
    blocks = {m.scheme.group_size for m in layers.values() if m.scheme.granularity == "block"}
    block = blocks.pop() if blocks else None  # problems() allows one block size

    def tensors() -> dict[str, torch.Tensor]:
        out = float_tensors(model, dtype)
        for name, m in resident_layers(model).items():
            qt = m.qtensor()
            out[f"{name}.weight"] = qt.qdata
            if m.scheme.granularity == "block":
                out[f"{name}.weight_scale_inv"] = qt.scale.float().contiguous()
            else:
                out[f"{name}.weight_scale"] = qt.scale.float().reshape(1)
            if m.input_scale is not None:
                out[f"{name}.input_scale"] = m.input_scale.detach().float().reshape(1)
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias.detach().to(dtype)
            report[name] = f"{m.scheme.name} -> fp8 (values and scales copied exactly)"
        for name, m in kv.items():
            if resident(m):
                out[_kv_scale_name(model, name, "k")] = m.k_scale.detach().float().reshape(1)
                out[_kv_scale_name(model, name, "v")] = m.v_scale.detach().float().reshape(1)
        return out

    static = any(m.scheme.act is not None and not m.scheme.act.dynamic for m in layers.values())
    ignored = sorted(float_linears(model))
    config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
              "ignored_layers": ignored}
    if block is not None:
        config["weight_block_size"] = [block, block]
        config["modules_to_not_convert"] = ignored  # transformers' FineGrainedFP8Config name for the same list
    write_hf(model, tokenizer, folder, tensors, config, dtype, max_shard_bytes=max_shard_bytes, parts=parts)
    notes = []
    per_tensor_static = all(m.scheme.granularity == "tensor" and m.input_scale is not None for m in layers.values())
    if per_tensor_static:
        hf_quant = {"producer": {"name": "compress", "version": __version__},
                    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv else None,
                                     "exclude_modules": ignored}}
        (Path(folder) / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2))
    else:
        notes.append(f"{HF_QUANT_CONFIG} not written: TensorRT-LLM's FP8 recipe needs per-tensor weights with static "
                     "per-tensor input scales (the FP8 preset); vLLM reads this checkpoint as it is")
    if kv:
        notes.append("vLLM uses the KV-cache scales when served with --kv-cache-dtype fp8")
    return {"layers": report, "kv_cache_layers": sorted(kv), "float_dtype": config_dtype(dtype),
            "quantization_config": config, "notes": notes}
