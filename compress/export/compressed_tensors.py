"""compressed-tensors checkpoints, as vLLM, SGLang and transformers read them.

Three on-disk formats, one per kind of layer (names from compressed_tensors.config.CompressionFormat):
  pack-quantized   weight-only int2 ... int8: `weight_packed` int32 [N, ceil(K*b/32)] (codes + 2^(b-1), packed
                   densely along K, a code may straddle two words: compressed-tensors' pack_to_int32),
                   `weight_scale` [N, K/G] or [N, 1], `weight_shape` int64 [2], and for asymmetric grids
                   `weight_zero_point` packed along N (int32 [ceil(N*b/32), K/G]).
  int-quantized    W8A8 int8: `weight` int8 [N, K], `weight_scale` [N, 1] (or [1]), static `input_scale` [1].
  float-quantized  fp8 e4m3: `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1] / [1] / [N/B, K/B], static
                   `input_scale` [1].
  nvfp4-pack-quantized  NVFP4 (compressed_tensors/compressors/nvfp4/base.py): `weight_packed` uint8 [N, K/2] (e2m1
                   codes, the even column in the low nibble), `weight_scale` float8_e4m3fn [N, K/16],
                   `weight_global_scale` float32 [1] (448*6/amax; w = e2m1 * weight_scale / weight_global_scale),
                   and for W4A4 `input_global_scale` float32 [1] (the activations' tensor scale, same convention).
  mxfp4-pack-quantized  MXFP4 (compressors/mxfp4/base.py): `weight_packed` as NVFP4, `weight_scale` uint8 e8m0
                   [N, K/32] (127 + log2 scale), no global scale.
  mxfp8-quantized  MXFP8 (compressors/mxfp8/base.py): `weight` float8_e4m3fn [N, K], `weight_scale` uint8 e8m0.
KV-cache scales are `<attention>.k_scale` / `.v_scale` with `kv_cache_scheme` in the config.
The config and the bit packing come from the compressed-tensors library itself (QuantizationConfig,
pack_to_int32), so field names and layouts are the ones its loaders expect. Layers sharing a scheme share
a config group; layers left in float are listed in `ignore`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from ..core.nn import QuantLinear
from ..core.scheme import QuantScheme
from .awq import fractional_zero_problem
from .shards import MAX_SHARD_BYTES
from .hf import (config_dtype, conv1d_problems, float_linears, fused_problems, float_tensors, kv_modules, quant_layers,
                 quantized_head, resident, resident_layers, write_hf)

FORMATS = {"pack": "pack-quantized", "int": "int-quantized", "float": "float-quantized",
           "NVFP4": "nvfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized", "MXFP8": "mxfp8-quantized"}


def _library():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as exc:
        raise ImportError("the compressed-tensors export needs the `compressed-tensors` package: "
                          "pip install compressed-tensors") from exc


def layer_format(scheme: QuantScheme) -> str:
    if scheme.is_micro:
        return FORMATS[scheme.micro_name]
    if scheme.is_float:
        return FORMATS["float"]
    return FORMATS["int"] if scheme.act is not None else FORMATS["pack"]


def scheme_problem(scheme: QuantScheme) -> str | None:
    """Why vLLM could not serve this layer from a compressed-tensors checkpoint (None: it can)."""
    act = scheme.act
    if act is not None and act.outlier_threshold is not None:
        return "LLM.int8 outlier decomposition has no compressed-tensors format; export `dense` or use W8A8"
    if scheme.is_micro or (act is not None and act.granularity == "group"):
        return _micro_problem(scheme)
    if scheme.is_float:
        if scheme.dtype != "fp8_e4m3":
            return "vLLM serves fp8 e4m3 weights only; use dtype fp8_e4m3"
        if act is not None and act.dtype != "fp8_e4m3":
            return "fp8 weights go with fp8 e4m3 activations (or none)"
        return None
    if act is not None:  # W8A8 int
        if scheme.dtype != "int8" or act.dtype != "int8":
            return "quantized activations go with int8 weights in compressed-tensors (W8A8); use dtype int8"
        if not scheme.symmetric:
            return "vLLM's W8A8 int8 kernels need symmetric weights; set symmetric: true (activations may stay " \
                   "asymmetric)"
        if scheme.granularity not in ("channel", "tensor"):
            return "W8A8 int8 weights are per channel or per tensor; set granularity: channel"
        return None
    if (why := fractional_zero_problem(scheme, "compressed-tensors")) is not None:
        return why
    if scheme.granularity not in ("group", "channel"):
        return "weight-only int checkpoints are per group or per channel; set granularity: group or channel"
    return None


def _micro_problem(scheme: QuantScheme) -> str | None:
    """The microscaling layouts compressed-tensors defines: NVFP4 (g16, e4m3 scales), MXFP4 and MXFP8 (g32, e8m0),
    each weight-only or with activations of the same format (NVFP4: calibrated tensor scale, dynamic blocks)."""
    name, act = scheme.micro_name, scheme.act
    if name is None:
        return (f"{scheme.name}: compressed-tensors' microscaling formats are NVFP4 (group_size 16, float8_e4m3 "
                "scales) and MXFP4 / MXFP8 (group_size 32, e8m0 scales); use a preset (NVFP4, MXFP4, MXFP8, ...A16)")
    if act is None:
        return None
    if act.granularity != "group" or act.dtype != scheme.dtype or act.group_size != scheme.group_size or \
            act.scale_dtype != scheme.scale_dtype:
        return f"{name} weights go with {name} activations (or none) in compressed-tensors; use the {name} preset"
    if name == "NVFP4" and act.dynamic:
        return ("NVFP4 activations in compressed-tensors have a calibrated tensor scale (input_global_scale); set "
                "act.dynamic: false (the NVFP4 preset)")
    return None


def problems(model: nn.Module) -> list[str]:
    try:
        _library()
    except ImportError as exc:
        return [str(exc)]
    out = conv1d_problems(model, "compressed-tensors") + fused_problems(model, "compressed-tensors")
    if not quant_layers(model) and not kv_modules(model):
        out.append("no layer is quantized; export `dense` for a float model")
    out += [f"{n} ({m.scheme.name}): {why}" for n, m in quant_layers(model).items()
            if (why := scheme_problem(m.scheme))]
    for n, m in kv_modules(model).items():
        if m.kv_cache_dtype != "fp8_e4m3":
            out.append(f"{n}: KV cache {m.kv_cache_dtype}; vLLM reads fp8 e4m3 KV-cache scales only")
    return out


def quant_args(scheme: QuantScheme) -> dict:
    """The weight and input QuantizationArgs fields of a scheme (compressed-tensors' vocabulary)."""
    if scheme.is_micro:
        return _micro_args(scheme)
    w = {"num_bits": scheme.bits, "type": "float" if scheme.is_float else "int", "symmetric": scheme.symmetric,
         "strategy": scheme.granularity, "dynamic": False}
    if scheme.granularity == "group":
        w["group_size"] = scheme.group_size
    if scheme.granularity == "block":
        w["block_structure"] = [scheme.group_size, scheme.group_size]
    act = scheme.act
    a = None if act is None else {
        "num_bits": 8, "type": "int" if act.dtype == "int8" else "float", "symmetric": act.symmetric,
        "strategy": act.granularity, "dynamic": act.dynamic}
    return {"weights": w, "input_activations": a}


def _micro_args(scheme: QuantScheme) -> dict:
    """compressed-tensors' NVFP4 / MXFP4 / MXFP8 presets (quantization/quant_scheme.py): NVFP4 is strategy
    tensor_group (block scales plus a tensor scale) with float8_e4m3fn scales, activations dynamic "local" (blocks
    on the fly, the tensor scale calibrated); MX is strategy group with uint8 (e8m0) scales, activations dynamic."""
    nv = scheme.has_global_scale
    common = {"num_bits": scheme.bits, "type": "float", "symmetric": True, "group_size": scheme.group_size,
              "strategy": "tensor_group" if nv else "group",
              "scale_dtype": torch.float8_e4m3fn if nv else torch.uint8,
              "zp_dtype": torch.float8_e4m3fn if nv else torch.uint8}
    w = {**common, "dynamic": False}
    a = None if scheme.act is None else {**common, "dynamic": "local" if nv else True}
    if a is not None and nv:
        a["observer"] = "static_minmax"
    return {"weights": w, "input_activations": a}


def scale_dtype(scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype vLLM allocates `weight_scale` in, so the file holds what it computes with: the model's dtype for
    weight-only (pack-quantized) layers (CompressedTensorsWNA16: params_dtype), float32 for W8A8 int8 and fp8
    (CompressedTensorsW8A8Int8 / W8A8Fp8: torch.float32); vllm/model_executor/layers/quantization/
    compressed_tensors/schemes/, checked against vLLM 0.33."""
    return model_dtype if layer_format(scheme) == FORMATS["pack"] else torch.float32


def layer_tensors(m: QuantLinear, model_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    qt, s = m.qtensor(), m.scheme
    if s.is_micro:  # the stored codes and encoded block scales are already the engines' layout: copied as they are
        out = {"weight_scale": qt.scale.contiguous()}
        out["weight_packed" if s.dtype == "fp4_e2m1" else "weight"] = qt.qdata.contiguous()
        if qt.global_scale is not None:
            out["weight_global_scale"] = qt.global_scale.float().reshape(1)
        if m.input_scale is not None:  # ours is amax / (448 * 6); compressed-tensors keeps its inverse
            out["input_global_scale"] = (1.0 / m.input_scale.detach().float()).reshape(1)
        return out
    scale = qt.scale.reshape(1) if qt.scale.dim() == 0 else qt.scale
    out: dict[str, torch.Tensor] = {"weight_scale": scale.to(scale_dtype(s, model_dtype)).contiguous()}
    if layer_format(s) == FORMATS["pack"]:
        half = 1 << (s.bits - 1)
        signed = qt.codes() - (half if not s.symmetric else 0)  # compressed-tensors keeps codes signed
        out["weight_packed"] = pack_to_int32(signed.to(torch.int8), s.bits)
        out["weight_shape"] = torch.tensor([m.out_features, m.in_features], dtype=torch.int64)
        if not s.symmetric:
            zp = qt.zero_point.to(torch.int32) - half
            out["weight_zero_point"] = pack_to_int32(zp.to(torch.int8), s.bits, packed_dim=0)
    else:
        out["weight"] = qt.codes().to(torch.int8) if not s.is_float else qt.qdata
    if m.input_scale is not None:
        out["input_scale"] = m.input_scale.detach().float().reshape(1)
    return out


def quantization_config(model: nn.Module) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    by_scheme: dict[QuantScheme, list[str]] = {}
    for n, m in quant_layers(model).items():
        by_scheme.setdefault(m.scheme, []).append(n)
    groups = {}
    for i, (scheme, names) in enumerate(by_scheme.items()):
        args = quant_args(scheme)
        targets = ["Linear"] if len(by_scheme) == 1 else sorted(names)
        groups[f"group_{i}"] = QuantizationScheme(
            targets=targets, weights=QuantizationArgs(**args["weights"]),
            input_activations=None if args["input_activations"] is None else
            QuantizationArgs(**args["input_activations"]), format=layer_format(scheme))
    formats = {layer_format(s) for s in by_scheme}
    kv = None
    if kv_modules(model):
        kv = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    config = QuantizationConfig(config_groups=groups, format=formats.pop() if len(formats) == 1 else
                                "mixed-precision", ignore=sorted(float_linears(model)), kv_cache_scheme=kv,
                                quantization_status="compressed")
    return {**config.model_dump(exclude_none=False), "quant_method": "compressed-tensors"}


def _scale_rounding(m: QuantLinear, written: torch.Tensor) -> float:
    """Largest relative change of a layer's scales between the model and the file (0.0: written exactly)."""
    ours = m.qtensor().scale.float().reshape(written.shape)
    return float(((written.float() - ours).abs() / ours.abs().clamp(min=1e-30)).max())


def write(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.bfloat16,
          max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    kv = kv_modules(model)
    _library()
    layers = {}
    rounded, worst = 0, 0.0

    def tensors() -> dict[str, torch.Tensor]:
        nonlocal rounded, worst
        out = float_tensors(model, dtype)
        for name, m in resident_layers(model).items():
            for k, v in layer_tensors(m, dtype).items():
                out[f"{name}.{k}"] = v
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias.detach().to(dtype)
            change = _scale_rounding(m, out[f"{name}.weight_scale"])
            if change:
                rounded, worst = rounded + 1, max(worst, change)
                layers[name] = (f"{m.scheme.name} -> {layer_format(m.scheme)} (codes copied exactly; "
                                f"{m.scheme.scale_dtype} scales written as {config_dtype(dtype)}, the dtype vLLM "
                                f"computes them in: up to {change:.2%} apart)")
            else:
                layers[name] = f"{m.scheme.name} -> {layer_format(m.scheme)} (codes and scales copied exactly)"
        for name, m in kv.items():
            if resident(m):
                out[f"{name}.k_scale"] = m.k_scale.detach().float().reshape(1)
                out[f"{name}.v_scale"] = m.v_scale.detach().float().reshape(1)
        return out

    config = quantization_config(model)
    write_hf(model, tokenizer, folder, tensors, config, dtype, max_shard_bytes=max_shard_bytes, parts=parts)
    notes = []
    if rounded:
        notes.append(f"{rounded} layers' scales were rounded to {config_dtype(dtype)} (at most {worst:.2%}), the dtype "
                     "vLLM holds weight-only scales in for this model; quantize with `scale_dtype: "
                     f"{config_dtype(dtype)}` in the scheme for an export that is bit for bit the compressed model")
    if (head := quantized_head(model)) is not None:
        notes.append(f"{head} is quantized ({layers[head].split(' ')[0]}); transformers' compressed-tensors loader "
                     "reads it (compress verify); vLLM serving a quantized lm_head from this format was not checked")
    return {"layers": layers, "kv_cache_layers": sorted(kv), "float_dtype": config_dtype(dtype),
            "quantization_config": config, "notes": notes}
