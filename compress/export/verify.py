"""`compress verify`: reload an export through its target's own loader where that loader runs here, and
measure KL divergence and top-1 agreement of its next-token predictions against the source model.

Loaders: transformers (dense, compressed-tensors, block-scaled fp8), llama-cpp-python (GGUF). vLLM's
AWQ / GPTQ / per-tensor fp8 kernels need a GPU, so those exports are read back with the format's
published layout (awq_dequantize, gptq_dequantize, fp8 value × scale) into a dense model, and the
result says so.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from .shards import read_tensor, tensor_names
from . import EXPORT_META

def read_record(folder: str | Path) -> dict:
    path = Path(folder) / EXPORT_META
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {EXPORT_META}; is it a folder written by `compress export`?")
    return json.loads(path.read_text())


def apply_kv_scales(model: nn.Module, folder: Path, record: dict) -> bool:
    """Quantize the reloaded model's KV cache with the fp8 scales stored in the export, as vLLM does when it
    serves it (transformers reads the weights but leaves these scales unused). True when there were any."""
    from ..kv.cache import set_kv_scales, use_kv_attention
    from ..core.scheme import FP8_MAX

    layers = record.get("kv_cache_layers") or []
    if not layers:
        return False
    names = tensor_names(folder)

    def scale(attention: str, which: str) -> float:
        for key in (f"{attention}.{which}_scale", f"{attention}.{which}_proj.{which}_scale"):
            if key in names:
                return float(read_tensor(folder, key))
        raise ValueError(f"{folder}: export.json lists KV-cache scales for {attention}, and the weights "
                         f"have no {which}_scale for it")

    for attention in layers:
        set_kv_scales(model.get_submodule(attention), scale(attention, "k") * FP8_MAX["fp8_e4m3"],
                      scale(attention, "v") * FP8_MAX["fp8_e4m3"], "fp8_e4m3")
    use_kv_attention(model)
    return True


def input_scales_match(folder: Path, source: nn.Module) -> bool | None:
    """Whether every static input scale in the export equals the source's (None: there are none)."""
    from ..core.nn import QuantLinear

    static = {n: m.input_scale for n, m in source.named_modules()
              if isinstance(m, QuantLinear) and m.input_scale is not None}
    if not static or not any(folder.glob("*.safetensors")):
        return None
    keys = tensor_names(folder)

    def same(n: str, s: Tensor) -> bool:
        if f"{n}.input_global_scale" in keys:  # compressed-tensors' NVFP4: the inverse of ours (amax / (448 * 6))
            return float(read_tensor(folder, f"{n}.input_global_scale")) == float(1.0 / s.float())
        return f"{n}.input_scale" in keys and float(read_tensor(folder, f"{n}.input_scale")) == float(s)

    return all(same(n, s) for n, s in static.items())


def load_export(folder: str | Path):
    """(loader description, model) — a transformers-style model whose forward gives logits — or, for GGUF,
    (loader, path of the .gguf file). Stored fp8 KV-cache scales are applied to the reloaded model."""
    folder = Path(folder)
    record = read_record(folder)
    loader, model = _load(folder, record)
    if not isinstance(model, Path) and apply_kv_scales(model, folder, record):
        loader += " + the file's fp8 KV-cache scales"
    if record.get("adapter") and _takes_adapter(model):
        from .adapter import ADAPTER_DIR, apply_adapter
        model = apply_adapter(model, folder / ADAPTER_DIR)
        loader += ADAPTER_LOADED
    return loader, model


ADAPTER_LOADED = " + its LoRA adapter (peft)"


def _takes_adapter(model) -> bool:
    """Whether the reloaded export is a transformers model, which peft wraps with the export's adapter (llama.cpp and
    mlx read other adapter layouts)."""
    from transformers import PreTrainedModel
    return isinstance(model, PreTrainedModel)


def _load(folder: Path, record: dict):
    """(loader description, model or GGUF path): the export's own exporter reads it back."""
    from . import get_exporter

    return get_exporter(record["format"]).read(folder, record)


@torch.no_grad()
def model_logits(model: nn.Module, windows: Tensor) -> Tensor:
    """float32 logits [B, T, V] of a transformers-style model, one window at a time."""
    return torch.stack([model(input_ids=w[None]).logits[0].float() for w in windows])


def compare_logits(reference: Tensor, test: Tensor) -> dict:
    """Mean KL(reference || test) per position (nats) and top-1 agreement, over all positions."""
    ref = torch.log_softmax(reference.float(), -1)
    out = torch.log_softmax(test.float(), -1)
    kl = (ref.exp() * (ref - out)).sum(-1)
    return {"kl": float(kl.mean()), "top1_agreement": float((ref.argmax(-1) == out.argmax(-1)).float().mean()),
            "positions": int(kl.numel())}


def export_logits(folder: str | Path, windows: Tensor) -> tuple[str, Tensor]:
    loader, model = load_export(folder)
    if loader == "llama-cpp-python":
        from .gguf_llama_cpp import llama_cpp_logits
        return loader, llama_cpp_logits(str(model), windows)
    return loader, model_logits(model, windows)


@contextlib.contextmanager
def float_activations(model: nn.Module):
    """Run `model`'s quantized layers with float inputs (weights stay quantized) inside the block."""
    from ..core.nn import QuantLinear

    layers = [(m, m.scheme) for m in model.modules() if isinstance(m, QuantLinear) and m.scheme.act is not None]
    try:
        for m, s in layers:
            m.scheme = replace(s, act=None)
        yield bool(layers)
    finally:
        for m, s in layers:
            m.scheme = s


def _device_of(model: nn.Module) -> torch.device:
    """Where a model computes: its first parameter's device (the CPU for one without parameters, or all on meta)."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def verify_export(folder: str | Path, source: nn.Module, windows: Tensor) -> dict:
    """Reload the export at `folder` and compare its predictions with `source` on `windows` [B, T].

    Where layers quantize their activations, both sides run them with float inputs (the layout readers have no
    activation quantization, and compressed-tensors' CPU reference rounds differently from vLLM: see
    _without_input_quantization), so the comparison is of the stored weights, the static input scales are
    checked for equality, and the result says so. llama.cpp computes as it serves and is compared with the
    source as it runs. Both run where `source` is (a CUDA run verifies on the GPU): the reloaded export is moved
    there (llama.cpp stays on the CPU), and the windows go to each model's device."""
    loader, model = load_export(folder)
    where = _device_of(source)
    record = read_record(folder)
    if record.get("adapter") and not loader.endswith(ADAPTER_LOADED):  # the export alone: against the source without it
        from .adapter import detached_lowrank
        with detached_lowrank(source):
            result = verify_export_logits(folder, loader, model, source, windows, where)
        result["adapter"] = ("not applied: this loader does not read PEFT adapters; compared with the source model "
                             "without its low-rank terms")
        return result
    return verify_export_logits(folder, loader, model, source, windows, where)


def verify_export_logits(folder, loader: str, model, source: nn.Module, windows: Tensor, where) -> dict:
    """verify_export's comparison, once the export at `folder` is loaded by `loader` (`model`: a module, or the
    .gguf path for llama.cpp)."""
    gguf = loader == "llama-cpp-python"
    if gguf:
        from .gguf_llama_cpp import iter_llama_cpp_logits
        theirs = iter_llama_cpp_logits(str(model), windows.cpu())
    else:
        model.to(where)
        theirs = (model_logits(model, w[None].to(where))[0] for w in windows)
    kl = agree = positions = 0.0
    floated = False
    for w, logits in zip(windows, theirs):  # one window at a time: [T, vocab] logits, never [B, T, vocab]
        with contextlib.nullcontext(False) if gguf else float_activations(source) as floated:
            reference = model_logits(source, w[None].to(where))[0]
        c = compare_logits(reference, logits.to(reference.device))
        kl, agree, positions = kl + c["kl"] * c["positions"], agree + c["top1_agreement"] * c["positions"], \
            positions + c["positions"]
    result = {"loader": loader, "kl": kl / positions, "top1_agreement": agree / positions,
              "positions": int(positions), "windows": list(windows.shape)}
    if floated:
        result["activations"] = ("weights compared with float activations on both sides (vLLM quantizes them from "
                                 "the stored config and input scales; no loader here does it as vLLM does)")
        result["input_scales_match"] = input_scales_match(Path(folder), source)
    return result
