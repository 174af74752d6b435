"""mlx-lm checkpoints (MLX's affine quantization): what `mlx_lm.load` reads on Apple silicon (and mlx-cpu on Linux).

Layout, as MLX's `mx.quantize` writes it and `nn.QuantizedLinear` / `mx.quantized_matmul` read it (mlx 0.32.4,
checked against the library itself in tests/test_export_mlx.py), for a weight [N, K] (out, in) with b-bit codes and
group size G in {32, 64, 128}, b in {2, 3, 4, 5, 6, 8}:

    weight  uint32 [N, K * b / 32]   each row's unsigned codes as one little-endian bit stream: code k occupies bits
                                     b*k .. b*k + b - 1 of the row, bit i of the stream is bit i % 32 of word i // 32
                                     (so 3-, 5- and 6-bit codes straddle word boundaries)
    scales  float  [N, K / G]
    biases  float  [N, K / G]        w = scales * q + biases, q unsigned in [0, 2**b)

Our grids map onto it exactly: w = (u - z) * s = s * u - s * z, so scales = s and biases = -s * z, with u = q - qmin
(asymmetric: u = q and z the zero point, fractional for HQQ; symmetric: u = q + 2**(b-1), z = 2**(b-1)). In float32
-s * z is exact (an fp16 scale times an 8-bit or fp16 zero fits in 24 bits); in float16 it is exact for symmetric
grids (a power of two) and rounded to 11 bits for asymmetric ones (the report says by how much).

Names are the Hugging Face checkpoint's (`model.layers.N.self_attn.q_proj.weight` ...), which is what mlx-lm's
model classes read (mlx_lm/models/llama.py; `sanitize` drops a tied lm_head.weight and rotary buffers). config.json
is the Hugging Face config (with transformers 4's top-level `rope_theta` / `rope_scaling`, which mlx-lm reads and
transformers 5 nests in `rope_parameters`) plus mlx-lm's `quantization` entry (and the same dict as
`quantization_config`, as mlx_lm.utils.save_config writes it): {"group_size": G, "bits": b} for the most common
pair, plus one entry per layer whose pair differs, keyed by its module path; a layer without `.scales` stays float
(mlx_lm.utils.load_model's class_predicate). "mode" is left out: it defaults to affine, and mlx-lm versions before
the mode argument pass each entry to `to_quantized` as keyword arguments.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor, nn

from ..core.nn import QuantLinear
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme
from .hf import (config_dtype, conv1d_problems, float_tensors, kv_modules, quant_layers, resident_layers,
                 write_hf)
from .shards import MAX_SHARD_BYTES

MLX_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes in affine mode (and 1, which no scheme of ours has)
MLX_GROUPS = (32, 64, 128)
FMT = "mlx"


def scheme_problem(scheme: QuantScheme) -> str | None:
    """None if MLX's affine format holds weights quantized with `scheme` exactly, else why not and what to change."""
    if scheme.is_micro:
        what = scheme.micro_name or f"{scheme.dtype} with {scheme.scale_dtype} block scales"
        return (f"microscaled values ({what}) are not MLX's affine integers, the only layers this exporter writes "
                "(mlx-lm reads NVFP4 / MXFP4 from a compressed-tensors export, mapped to its own nvfp4 / mxfp4 "
                "modes); export compressed-tensors, or quantize to an integer scheme (W4A16_G64)")
    if scheme.is_float:
        return (f"{scheme.dtype} values have no MLX affine encoding (MLX's float modes are microscaled: mxfp8 / "
                "nvfp4); quantize to an integer scheme (int4 or int8, granularity: group) or export dense")
    if scheme.act is not None:
        return (f"mlx-lm's quantized layers are weight-only, and this scheme also quantizes activations "
                f"({scheme.act.name}); use a weight-only scheme (act: null) such as W4A16_G64")
    if scheme.bits not in MLX_BITS:
        return (f"MLX packs {', '.join(map(str, MLX_BITS))} bits, not {scheme.bits}; use dtype: int6 or int8")
    if scheme.granularity != "group":
        return (f"MLX's affine format has one scale and bias per group of 32, 64 or 128 inputs, not per "
                f"{scheme.granularity}; set granularity: group, group_size: 64")
    if scheme.group_size not in MLX_GROUPS:
        return (f"MLX's affine kernels take group_size 32, 64 or 128, not {scheme.group_size}; "
                "set group_size: 64 (or 32 / 128)")
    return None


def layer_problem(m: QuantLinear) -> str | None:
    if (why := scheme_problem(m.scheme)) is not None:
        return why
    if m.in_features % m.scheme.group_size:
        return (f"in_features={m.in_features} is not divisible by group_size={m.scheme.group_size}; pick a "
                "group_size of 32, 64 or 128 that divides it, or leave this layer in float")
    return None


def problems(model: nn.Module) -> list[str]:
    """Why this model cannot be written for mlx-lm (empty: it can), layer by layer. Float layers stay float, and
    layers of different bit widths and group sizes are fine (per-layer config entries)."""
    return conv1d_problems(model, FMT) + \
        [f"{n} ({m.scheme.name}): {why}" for n, m in quant_layers(model).items() if (why := layer_problem(m))]


# ------------------------------------------------------------------ the bit stream

def pack_mlx(u: Tensor, bits: int, rows: int = 256) -> Tensor:
    """Unsigned codes [N, K] (values < 2**bits, K * bits a multiple of 32) -> uint32 [N, K * bits / 32], each row a
    little-endian bit stream (the module docstring). `rows` rows at a time: the per-bit temporaries stay small."""
    n, k = u.shape
    if (k * bits) % 32:
        raise ValueError(f"{k} codes of {bits} bits do not fill whole uint32 words")
    bit = torch.arange(bits, device=u.device, dtype=torch.int64)
    place = torch.arange(32, device=u.device, dtype=torch.int64)
    out = []
    for r in range(0, n, rows):
        stream = (u[r:r + rows].to(torch.int64)[..., None] >> bit) & 1  # [n, K, bits]: bit i of code k
        words = (stream.reshape(stream.shape[0], -1, 32) << place).sum(-1)  # [n, W] in [0, 2**32)
        out.append(torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32))  # the same 32 bits
    return torch.cat(out).view(torch.uint32)


def unpack_mlx(words: Tensor, bits: int) -> Tensor:
    """Inverse of pack_mlx: uint32 (or int32) [N, W] -> int64 codes [N, W * 32 / bits]."""
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    stream = (w[..., None] >> torch.arange(32, device=w.device)) & 1  # [N, W, 32]
    codes = stream.reshape(w.shape[0], -1, bits)  # [N, K, bits]
    return (codes << torch.arange(bits, device=w.device)).sum(-1)


def mlx_tensors(qt: QuantizedTensor, dtype: torch.dtype = torch.float16) -> dict[str, Tensor]:
    """The `weight`, `scales` and `biases` tensors of one MLX affine linear layer (bias is the caller's)."""
    if (why := scheme_problem(qt.scheme)) is not None:
        raise ValueError(why)
    u = qt.codes() - qt.scheme.qmin  # unsigned codes [N, K]
    s = qt.scale.float()  # [N, K / G]
    z = qt.zero_point.float() if qt.zero_point is not None else torch.full_like(s, -qt.scheme.qmin)
    return {"weight": pack_mlx(u, qt.scheme.bits), "scales": s.to(dtype).contiguous(),
            "biases": (-s * z).to(dtype).contiguous()}  # -s * z exact in float32 (module docstring)


def mlx_dequantize(weight: Tensor, scales: Tensor, biases: Tensor, bits: int) -> Tensor:
    """Read one MLX affine layer back: float32 [N, K], w = scales * q + biases per group."""
    q = unpack_mlx(weight, bits).float()
    group = q.shape[1] // scales.shape[1]
    return q * scales.float().repeat_interleave(group, 1) + biases.float().repeat_interleave(group, 1)


# ------------------------------------------------------------------ the config

def quantization_entry(model: nn.Module) -> dict:
    """mlx-lm's `quantization` dict: the most common (group_size, bits) of the quantized layers, and an entry for
    each layer whose pair differs (keyed by its module path). Empty for a model with no quantized layer."""
    pairs = {n: (m.scheme.group_size, m.scheme.bits) for n, m in quant_layers(model).items()}
    if not pairs:
        return {}
    (group, bits), _ = Counter(pairs.values()).most_common(1)[0]
    entry: dict = {"group_size": group, "bits": bits}
    entry.update({n: {"group_size": g, "bits": b} for n, (g, b) in pairs.items() if (g, b) != (group, bits)})
    return entry


def legacy_rope(config: dict) -> str | None:
    """transformers 5 writes the rotary settings nested (`rope_parameters`); mlx-lm's model classes read the top-level
    `rope_theta` and `rope_scaling` of transformers 4 configs (mlx_lm/models/llama.py ModelArgs, default theta 10000),
    so a config without them loads with the wrong rotary base and serves another model. Adds them, unless already
    there; a per-layer-type `rope_parameters` (Gemma 3 style) is left as it is, and the returned note says so."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config:
        return None
    if "rope_theta" not in rope:
        return ("rope_parameters is per layer type; mlx-lm reads its own per-family keys for these models (not "
                "checked here): serve-check this export with `compress verify --engine mlx`")
    config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return None


def _bias_rounding(qt: QuantizedTensor, stored: Tensor) -> float:
    """The largest |stored bias - (-s z)| of one layer, in quantization steps (units of its scale)."""
    s = qt.scale.float()
    z = qt.zero_point.float() if qt.zero_point is not None else torch.full_like(s, -qt.scheme.qmin)
    return float(((stored.float() + s * z).abs() / s.clamp_min(torch.finfo(torch.float32).tiny)).max())


def write(model: nn.Module, tokenizer, folder: Path, dtype: torch.dtype = torch.float16,
          max_shard_bytes: int = MAX_SHARD_BYTES, parts: Iterable | None = None, **_) -> dict:
    """Float tensors, scales and biases in `dtype` (mlx-lm computes in what the file holds); codes as uint32."""
    layers: dict[str, str] = {}
    worst = {"bias": 0.0}

    def tensors() -> dict[str, Tensor]:
        out = float_tensors(model, dtype)
        for name, m in resident_layers(model).items():
            qt = m.qtensor()
            for k, v in mlx_tensors(qt, dtype).items():
                out[f"{name}.{k}"] = v
            worst["bias"] = max(worst["bias"], _bias_rounding(qt, out[f"{name}.biases"]))
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias.detach().to(dtype)
            copied = "codes and scales copied exactly" if torch.equal(out[f"{name}.scales"].float(), qt.scale.float()) \
                else f"codes copied exactly, scales rounded to {config_dtype(dtype)}"  # a float32 scale_dtype
            layers[name] = (f"{m.scheme.name} -> mlx affine {m.scheme.bits}-bit g{m.scheme.group_size} "
                            f"({copied}; biases = -scale * zero)")
        return out

    quantization = quantization_entry(model)
    write_hf(model, tokenizer, folder, tensors, None, dtype, max_shard_bytes=max_shard_bytes, parts=parts)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    rope_note = legacy_rope(config)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    notes = [rope_note] if rope_note else []
    notes += ["mlx-lm loads this folder with mlx_lm.load (Apple silicon; the mlx-cpu build on Linux) and computes in "
             f"the dtype it holds ({config_dtype(dtype)}); layers without .scales stay float"]
    if worst["bias"] > 0:
        notes.append(f"biases = -scale * zero rounded to {config_dtype(dtype)}: at most {worst['bias']:.2g} of a "
                     "quantization step off (asymmetric grids; symmetric ones are exact: -2**(b-1) * scale)")
    if kv_modules(model):
        notes.append("fp8 KV-cache scales are not part of an mlx-lm checkpoint; they were left out")
    return {"layers": layers, "float_dtype": config_dtype(dtype), "quantization": quantization,
            "bias_rounding_steps": worst["bias"], "notes": notes}


def read(folder: Path, record: dict):
    """The export dequantized into a transformers model (w = scales * q + biases, in float32): `compress verify`."""
    from .readers import _dense_from_tensors

    quantization = json.loads((Path(folder) / "config.json").read_text()).get("quantization") or {}

    def layer(p: str, state: dict) -> Tensor:
        entry = quantization.get(p) if isinstance(quantization.get(p), dict) else quantization
        return mlx_dequantize(state[f"{p}.weight"], state[f"{p}.scales"], state[f"{p}.biases"], entry["bits"])

    return ("compress reader (MLX's affine layout, dequantized in torch; mlx-lm itself: --engine mlx)",
            _dense_from_tensors(Path(folder), layer))


__all__ = ["mlx_dequantize", "mlx_tensors", "pack_mlx", "problems", "quantization_entry", "read", "unpack_mlx",
           "write"]
