"""The stage protocol's memory, streaming and export answers.

The memory plan of every shipped recipe (and the variants that take other branches of a stage's terms: fsdp,
gradient checkpointing, solved sensitivities, AutoRound) on Llama-2-7B's and a small Mixtral's config, host and
device, resident and streamed, is the one recorded in tests/data/stage_memory_plans.json, computed before the
stages answered their own terms (`python tests/test_stage_memory.py --write` rewrites it: only when a plan is meant
to change)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from compress.pipeline.memory_plan import GB, plan_memory
from compress.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path(__file__).parent / "data" / "stage_memory_plans.json"
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
MIXTRAL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
               max_position_embeddings=4096)
VARIANTS = {  # recipe -> extra override sets (each planned like the recipe itself)
    "minitron_prune_distill.yaml": [["stages.1.fsdp=true"]],
    "awq_gptq_tune_int4.yaml": [["stages.2.gradient_checkpointing=true"]],
    "auto_precision_4bit.yaml": [["stages.0.error_method=gptq"], ["stages.0.error_method=awq_gptq",
                                                                   "stages.0.seq_len=256"]],
    "autoround_int4.yaml": [["calibration.offload=disk"]],
}


def plans() -> dict:
    out = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        config = MixtralConfig(**MIXTRAL) if "moe" in path.name else LlamaConfig(**LLAMA2_7B)
        for extra in [[], *VARIANTS.get(path.name, [])]:
            recipe = load_recipe(path, extra)
            for dtype, device, streamed in ((torch.float32, "cpu", False), (torch.bfloat16, "cuda:0", False),
                                            (torch.bfloat16, "cpu", True)):
                plan = plan_memory(recipe, config, dtype, device, available=int(64 * GB),
                                   device_available=int(80 * GB), conversion=12345, streamed=streamed)
                tight = plan_memory(recipe, config, dtype, device, available=int(2 * GB),
                                    device_available=int(1 * GB), streamed=streamed)
                key = f"{path.name} {' '.join(extra)} {dtype} {device}{' streamed' if streamed else ''}"
                out[key] = {"plan": plan.to_dict(), "lines": plan.lines(), "problem": tight.problem(recipe)}
    return out


def test_every_shipped_recipe_plans_as_before():
    reference = json.loads(REFERENCE.read_text())
    now = json.loads(json.dumps(plans()))
    assert sorted(now) == sorted(reference)
    changed = [k for k in reference if now[k] != reference[k]]
    assert not changed, f"{len(changed)} plans changed, e.g. {changed[0]}: {now[changed[0]]} != {reference[changed[0]]}"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(plans(), indent=1) + "\n")
