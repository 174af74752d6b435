"""NVFP4 checkpoints in NVIDIA ModelOpt's layout, as TensorRT-LLM and vLLM's ModelOpt loader read them.

Per quantized layer (ModelOpt modelopt/torch/quantization/qtensor/nvfp4_tensor.py and export/unified_export_hf.py,
NVIDIA/TensorRT-Model-Optimizer @5a4242fa):
  weight          uint8 [N, K/2]        e2m1 codes, two per byte, the even column in the low nibble
  weight_scale    float8_e4m3fn [N, K/16]  block scales
  weight_scale_2  float32 []            the tensor scale as a multiplier: amax / (6 * 448), so
                                        w = e2m1 * weight_scale * weight_scale_2 (compressed-tensors keeps 1 / it)
  input_scale     float32 []            W4A4 only: the activations' tensor scale, amax / (6 * 448), the same
                                        number our QuantLinear holds as `input_scale`
`hf_quant_config.json` is {"producer", "quantization": {"quant_algo": "NVFP4" (W4A4) or "W4A16_NVFP4"
(weight-only), "kv_cache_quant_algo", "group_size": 16, "exclude_modules"}} (export/quant_utils.py), and
config.json carries the same fields under quantization_config with quant_method "modelopt", which vLLM's
ModelOptNvFp4Config reads (vllm/model_executor/layers/quantization/modelopt.py).

Our codes and block scales are copied as they are; weight_scale_2 is 1 / our global scale, rounded once in
float32 (a relative 2^-24 at most).
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
from .hf import config_dtype, conv1d_problems, float_linears, float_tensors, fused_problems, kv_modules, \
    quant_layers, resident_layers, write_hf

HF_QUANT_CONFIG = "hf_quant_config.json"


def quant_algo(m: QuantLinear) -> str:
    return "W4A16_NVFP4" if m.scheme.act is None else "NVFP4"


def layer_problem(m: QuantLinear) -> str | None:
    s, act = m.scheme, m.scheme.act
    if s.micro_name != "NVFP4":
        return ("the ModelOpt NVFP4 layout holds NVFP4 weights (fp4 e2m1, e4m3 scales per 16, one fp32 scale per "
                "tensor); quantize with the NVFP4 or NVFP4A16 preset, or export compressed-tensors")
    if act is not None and (act.scale_dtype != "float8_e4m3" or act.group_size != 16 or act.dynamic):
        return ("ModelOpt's NVFP4 activations are NVFP4 blocks with a calibrated tensor scale (input_scale); use the "
                "NVFP4 preset (act.dynamic: false)")
    return None


def problems(model: nn.Module) -> list[str]:
    out = conv1d_problems(model, "modelopt-nvfp4") + fused_problems(model, "modelopt-nvfp4")
    layers = quant_layers(model)
    if not layers:
        out.append("no layer is quantized; quantize with NVFP4 or NVFP4A16 (recipes/nvfp4.yaml) first")
    out += [f"{n} ({m.scheme.name}): {why}" for n, m in layers.items() if (why := layer_problem(m))]
    if len({quant_algo(m) for m in layers.values()}) > 1:
        out.append("this model mixes NVFP4 (W4A4) and W4A16_NVFP4 layers; ModelOpt writes that as MIXED_PRECISION "
                   "with a per-layer table, which this exporter does not: quantize every layer alike")
    if kv_modules(model):
        out.append("fp8 KV-cache scales are not written in this layout here; export compressed-tensors for them, or "
                   "let the engine take its own KV cache")
    return out


def layer_tensors(m: QuantLinear) -> dict[str, torch.Tensor]:
    qt = m.qtensor()
    out = {"weight": qt.qdata.contiguous(), "weight_scale": qt.scale.contiguous(),
           "weight_scale_2": (1.0 / qt.global_scale.float()).reshape(())}
    if m.input_scale is not None:
        out["input_scale"] = m.input_scale.detach().float().reshape(())
    return out


def write(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.bfloat16,
          max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    layers = quant_layers(model)
    report = {}

    def tensors() -> dict[str, torch.Tensor]:
        out = float_tensors(model, dtype)
        for name, m in resident_layers(model).items():
            for k, v in layer_tensors(m).items():
                out[f"{name}.{k}"] = v
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias.detach().to(dtype)
            report[name] = f"{m.scheme.name} -> ModelOpt {quant_algo(m)} (codes and block scales copied exactly)"
        return out

    algo = quant_algo(next(iter(layers.values())))
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                    "exclude_modules": sorted(float_linears(model))}
    config = {"quant_method": "modelopt", **quantization}
    write_hf(model, tokenizer, folder, tensors, config, dtype, max_shard_bytes=max_shard_bytes, parts=parts)
    hf_quant = {"producer": {"name": "compress", "version": __version__}, "quantization": quantization}
    (Path(folder) / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2))
    return {"layers": report, "kv_cache_layers": [], "float_dtype": config_dtype(dtype),
            "quantization_config": config,
            "notes": ["weight_scale_2 = 1 / our fp32 global scale (ModelOpt's convention), rounded once in float32",
                      "served by TensorRT-LLM and vLLM (ModelOpt NVFP4) on Blackwell; reloaded here through "
                      "compressed-tensors' own ModelOpt converter and NVFP4 decompressor (compress verify)"]}


def dequantize_layer(prefix: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A layer's float weight read back the way compressed-tensors reads a ModelOpt NVFP4 checkpoint: its
    ModelOptNvfp4Converter maps the tensors to its own convention (weight -> weight_packed, 1 / weight_scale_2 ->
    weight_global_scale), then NVFP4PackedCompressor.decompress dequantizes them."""
    try:
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4A16
    except ImportError as exc:
        raise ImportError("reading a ModelOpt NVFP4 checkpoint back needs compressed-tensors >= 0.20 (its converter "
                          "and decompressor): pip install -U compressed-tensors") from exc
    names = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    mine = {f"{prefix}.{n}": state[f"{prefix}.{n}"] for n in names if f"{prefix}.{n}" in state}
    converted = ModelOptNvfp4Converter(targets=[f"re:^{prefix}$"]).validate(mine)
    local = {k.rpartition(".")[-1]: v for k, v in converted.items()}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**NVFP4A16["weights"].model_dump()))
    dense = NVFP4PackedCompressor.decompress({k: local[k] for k in ("weight_packed", "weight_scale",
                                                                     "weight_global_scale")}, scheme)
    return dense["weight"].float()
