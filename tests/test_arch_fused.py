"""The layers a serving engine fuses into one module (compress/arch/fused.py) on real tiny models: q/k/v and gate/up
of each block, and all of a MoE block's experts (vLLM gives them one scheme, read from expert 0)."""
from __future__ import annotations

import pytest

from compress.arch.fused import fused_groups, fused_label
from compress.arch.moe import unfuse_experts
from compress.core.nn import is_linear
from tests.conftest import make_tiny_model


def _linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if is_linear(m) and "lm_head" not in n]


def test_dense_blocks_fuse_qkv_and_gate_up():
    names = _linears(make_tiny_model("llama"))
    groups = {fused_label(g): g for g in fused_groups(names)}
    for b in range(2):
        p = f"model.layers.{b}"
        assert groups[f"{p}.self_attn.{{q_proj,k_proj,v_proj}}"] == [f"{p}.self_attn.{x}_proj" for x in "qkv"]
        assert groups[f"{p}.mlp.{{gate_proj,up_proj}}"] == [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
        assert groups[f"{p}.self_attn.o_proj"] == [f"{p}.self_attn.o_proj"]
        assert groups[f"{p}.mlp.down_proj"] == [f"{p}.mlp.down_proj"]
    assert sum(map(len, groups.values())) == len(names) == 14


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_moe_blocks_experts_take_one_scheme(family):
    model = make_tiny_model(family)
    unfuse_experts(model)
    names = _linears(model)
    groups = fused_groups(names)
    experts = [g for g in groups if ".experts." in g[0]]
    assert len(experts) == 2  # one per block
    for b, g in enumerate(experts):
        assert len(g) == 4 * 3 and all(n.startswith(f"model.layers.{b}.mlp.experts.") for n in g)
    if family == "qwen2_moe":  # the shared expert is a plain MLP: its gate/up fuse, its down stays alone
        assert ["model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj"] in groups
    assert sorted(n for g in groups for n in g) == sorted(names)
