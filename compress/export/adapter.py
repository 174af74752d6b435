"""The eora stage's low-rank terms as a LoRA adapter beside an export (`adapter/`), in PEFT's layout: what peft
(`PeftModel.from_pretrained(base, folder / "adapter")`), transformers (`model.load_adapter`) and vLLM
(`--enable-lora --lora-modules repair=folder/adapter`) load on top of the quantized checkpoint.

- adapter_config.json: peft_type LORA, r, lora_alpha = r (PEFT scales B A by lora_alpha / r: by 1 here),
  target_modules: the full names of the repaired layers; rank_pattern / alpha_pattern where a layer's rank differs.
- adapter_model.safetensors: `base_model.model.{layer}.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from ..core.nn import QuantLinear

ADAPTER_DIR = "adapter"


def lowrank_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """The QuantLinear layers of `model` that carry a low-rank repair term."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.rank}


@contextlib.contextmanager
def detached_lowrank(model: nn.Module):
    """The model without its low-rank terms inside the block (what a base export holds and what a loader that
    cannot apply the adapter computes); yields {layer: (A, B)}, put back on exit."""
    terms = {n: (m.lora_a.detach(), m.lora_b.detach()) for n, m in lowrank_layers(model).items()}
    layers = dict(model.named_modules())
    try:
        for n in terms:
            layers[n].set_lowrank(None, None)
        yield terms
    finally:
        for n, (a, b) in terms.items():
            layers[n].set_lowrank(a, b)


def write_adapter(terms: dict[str, tuple[Tensor, Tensor]], folder: Path, dtype: torch.dtype = torch.bfloat16,
                  base: str | None = None) -> dict:
    """Write `terms` ({layer: (A [r, in], B [out, r])}) into `folder` as a PEFT LoRA adapter; returns its record."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    ranks = {n: a.shape[0] for n, (a, _) in terms.items()}
    r = max(set(ranks.values()), key=list(ranks.values()).count)  # the most common rank; the others by pattern
    odd = {re.escape(n): k for n, k in ranks.items() if k != r}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": r,
              "lora_alpha": r, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "target_modules": sorted(terms), "rank_pattern": odd, "alpha_pattern": dict(odd),
              "inference_mode": True, "modules_to_save": None}
    tensors = {}
    for n, (a, b) in terms.items():
        tensors[f"base_model.model.{n}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous()
        tensors[f"base_model.model.{n}.lora_B.weight"] = b.detach().to("cpu", dtype).contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return {"folder": folder.name, "format": "peft LoRA", "rank": r, "max_rank": max(ranks.values()),
            "layers": len(terms),
            "parameters": sum(a.numel() + b.numel() for a, b in terms.values()), "dtype": str(dtype).split(".")[-1]}


def apply_adapter(model: nn.Module, folder: Path) -> nn.Module:
    """A transformers model with the adapter at `folder` applied through peft (merged into no weight: its layers
    compute B A x beside the base layer, as at serving time)."""
    from peft import PeftModel  # a dependency of compress

    return PeftModel.from_pretrained(model, str(folder)).eval()


ADAPTER_NOTES = {
    "gguf": "llama.cpp does not read PEFT adapters: convert it with llama.cpp's convert_lora_to_gguf.py and pass "
            "--lora; the .gguf alone computes the model without its low-rank repair",
    "mlx": "mlx-lm reads its own adapter layout (adapters.safetensors): this PEFT adapter is not loaded by it, and "
           "the mlx export alone computes the model without its low-rank repair",
}


def adapter_note(fmt: str) -> str:
    """How the serving stacks of format `fmt` take the adapter."""
    for prefix, note in ADAPTER_NOTES.items():
        if fmt.startswith(prefix):
            return note
    return (f"the low-rank repair is the LoRA adapter in {ADAPTER_DIR}/: peft `PeftModel.from_pretrained(model, "
            f"'{ADAPTER_DIR}')`, transformers `model.load_adapter('{ADAPTER_DIR}')`, vLLM `--enable-lora "
            f"--lora-modules repair={ADAPTER_DIR}` (max_lora_rank at least its largest rank, the record's max_rank); "
            "without it the checkpoint computes the model without the repair")
