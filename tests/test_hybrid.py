"""Hybrid and heterogeneous decoder stacks (issue 45 item 4): Mamba and linear-attention layers beside attention
(Jamba, Bamba, Falcon-H1, Nemotron-H, Qwen3-Next, Qwen3.5, Kimi-Linear), blocks of several classes (Jamba), experts
fed only their routed tokens (Llama 4), a head_dim per layer and per-layer inputs computed outside the blocks
(Gemma 4). Each runs RTN and GPTQ through the runner with every block replayed as the model's forward runs it;
every parameter is quantized or listed with its reason (a recurrent layer's linears are quantized, its recurrence's
own parameters listed); what cannot be done is refused up front, naming the layer, the cause and the fix. Block
replay on these families: tests/test_blockwise.py (test_blocks_called_as_the_runner_calls_them_give_the_models_logits)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.arch import get_arch
from compress.arch.mixers import CONV, READ_AS_WEIGHT, RECURRENT
from compress.arch.moe import ROUTER_REASON, ExpertLinears, STACKED, expert_routing, moe_blocks, router_names, unfuse_experts
from compress.core.nn import QuantLinear, is_linear
from compress.core.scheme import QuantScheme
from compress.stages.quantize import PER_LAYER_INPUT_REASON, QuantizeStage, plan_quantize
from tests.conftest import TINY_HYBRID_CONFIGS, make_tiny_model
from tests.test_blockwise import METHODS, compress_tiny

HYBRID = sorted(TINY_HYBRID_CONFIGS) + ["gemma4_text"]
SCHEME = QuantScheme("int4", group_size=16)


def _model(family: str) -> nn.Module:
    model = make_tiny_model(family).float()
    unfuse_experts(model)  # as loading does
    return model


def _float_linears(model: nn.Module) -> dict[str, str]:
    """The linears inside the blocks that stay float by rule, with the rule's reason: routers, and the layers a
    recurrent layer reads the weight of (READ_AS_WEIGHT)."""
    routers = router_names(model)
    blocks = get_arch(model).blocks
    out = {}
    for name, m in model.named_modules():
        if is_linear(m) and name.startswith(blocks + "."):
            if name in routers:
                out[name] = ROUTER_REASON
            elif name.rpartition(".")[2] in READ_AS_WEIGHT:
                out[name] = READ_AS_WEIGHT[name.rpartition(".")[2]]
    return out


@pytest.mark.parametrize("family", HYBRID)
def test_every_parameter_is_quantized_or_listed_with_its_reason(family):
    """Quantized weights + parameters listed in float = all of the model's parameters; no parameter is listed under
    the catch-all reason (a module kind nobody looked at); the recurrent layers' A_log, D, dt_bias and convolutions
    with theirs; every linear in the blocks is quantized (Mamba's in/x/out projections, the DeltaNet projections,
    every expert) but the routers and Mamba-1's dt_proj (its weight is read, not called); Gemma 4's per-layer input
    projection outside the blocks is listed with its reason."""
    model = _model(family)
    plan = plan_quantize(model, get_arch(model), QuantizeStage(scheme=SCHEME))
    quantized = sum(e.shape[0] * e.shape[1] for e in plan.quantized)
    assert quantized + sum(n for _, n, _ in plan.float_params) == sum(p.numel() for p in model.parameters())
    reasons = {name: why for name, _, why in plan.float_params}
    assert not [n for n, why in reasons.items() if why.startswith("not a linear layer")], family
    recurrent = {n: why for n, why in reasons.items() if n.rpartition(".")[2] in RECURRENT}
    for name, why in recurrent.items():
        assert why == RECURRENT[name.rpartition(".")[2]]
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv1d)]
    for name in convs:
        assert reasons[f"{name}.weight"] == CONV.format(taps=model.get_submodule(name).kernel_size[0])
    has_recurrence = family not in ("llama4_text", "gemma4_text")
    assert bool(recurrent) == bool(convs) == has_recurrence
    skipped = {e.name: e.reason for e in plan.skipped}
    blocks = get_arch(model).blocks
    inside = {n for n, m in model.named_modules() if is_linear(m) and n.startswith(blocks + ".")}
    rules = _float_linears(model)
    assert inside - {e.name for e in plan.quantized} == set(rules)
    assert all(skipped[n].startswith(why) for n, why in rules.items())
    assert any(n.endswith("dt_proj") for n in rules) == (family == "jamba")
    for moe, experts in moe_blocks(model).items():  # every expert's layers are quantized
        assert {f"{moe}.{e}.down_proj" for e in range(len(experts))} <= {e.name for e in plan.quantized}
    if family == "gemma4_text":
        assert skipped["model.per_layer_model_projection"].startswith(PER_LAYER_INPUT_REASON)
        assert reasons["model.embed_tokens_per_layer.weight"] == "embedding: a lookup table, not a matmul"


@pytest.mark.parametrize("family", HYBRID)
def test_rtn_and_gptq_run_with_every_block_replayed_as_the_model_runs_it(family, tmp_path):
    """RTN and GPTQ through the runner on 2 windows of 24 tokens (Llama 4's chunks are 8 tokens): the replay is the
    model's own forward, every planned layer is quantized, the block errors are small (int4 g16 on random weights:
    measured up to 0.10, Gemma 4's first block under RTN), the quantized model runs and stays close, and the report
    lists the recurrent parameters kept in float with their reasons."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    for method in ("rtn", "gptq"):
        model = _model(family)
        with torch.no_grad():
            reference = model(input_ids=ids).logits
        sections = compress_tiny(model, METHODS[method], tmp_path, seq_len=24)
        assert sections["calibration"]["replay"] == "exact", method
        errors = sections["block_errors"]
        assert len(errors) == len(get_arch(model).block_list(model)) and all(0 < e < 0.2 for e in errors), errors
        stage = sections["stages"][-1]
        assert stage["quantized"] == len(stage["layers"]) > 0
        assert all(isinstance(model.get_submodule(n), QuantLinear) for n in stage["layers"])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        rel = float((logits - reference).norm() / reference.norm())
        # random weights calibrated on word text, scored on random ids: measured 0.05 (Jamba RTN) to 0.63 (Gemma 4
        # GPTQ, fitted closest to the calibration text); NaN or > 1 where the model is broken
        assert 0 < rel < 0.8, (method, rel)
        if family not in ("llama4_text", "gemma4_text"):
            kept = "; ".join(sections["kept_in_float"])
            assert RECURRENT["A_log"] in kept and "causal depthwise convolution" in kept


def test_llama4_experts_see_only_their_routed_tokens():
    """Llama 4 hands its experts every token stacked once per expert, the rows of experts a token was not routed to
    zeroed by its router score: each expert's layers compute (and a calibration hook sees) exactly the tokens the
    router chose for it, and the block's output is the fused module's."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    model = make_tiny_model("llama4_text").float()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    unfuse_experts(model)
    (name, experts), = moe_blocks(model).items()
    assert experts.routing == STACKED
    moe = model.get_submodule(name.rpartition(".")[0])
    seen, chosen = [0] * len(experts), []
    hooks = [experts[e].up_proj.register_forward_hook(lambda m, a, o, e=e: seen.__setitem__(e, seen[e] + a[0].shape[0]))
             for e in range(len(experts))]
    hooks.append(moe.router.register_forward_hook(lambda m, a, o: chosen.append(o[1].topk(1, dim=-1).indices)))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    routed = torch.bincount(torch.cat(chosen).reshape(-1), minlength=len(experts)).tolist()
    assert seen == routed and sum(seen) == ids.numel()  # top-1: each token once, not len(experts) times


class _OddExperts(nn.Module):
    """Fused experts whose forward routes by arguments compress/arch/moe.py does not know."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 8))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(4, 8))
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 16))

    def forward(self, hidden_states, expert_size):
        return hidden_states


class _StackedExperts(_OddExperts):
    def forward(self, hidden_states):
        return hidden_states


def test_experts_routed_in_an_unknown_way_are_refused_naming_the_layer_the_cause_and_the_fix():
    """Unfusing experts whose routing the unfused module would not reproduce stops at loading with the module's name,
    why and what to do, instead of a TypeError from inside a block's forward in the middle of a run."""
    holder = nn.Module()
    holder.experts = _OddExperts()
    with pytest.raises(ValueError, match=r"^experts: _OddExperts\.forward takes \['expert_size'\].*leave this model "
                                         r"in float, or describe the routing in compress/arch/moe.py"):
        unfuse_experts(holder)
    holder.experts = _StackedExperts(bias=True)
    with pytest.raises(ValueError, match=r"^experts: _StackedExperts takes every token for every expert .* biases"):
        unfuse_experts(holder)
    assert expert_routing(_StackedExperts()) == STACKED
    assert isinstance(holder.experts, _StackedExperts)  # nothing was replaced


def test_a_heterogeneous_stack_is_found_and_named():
    """Jamba's blocks are of two classes (a Mamba layer, then an attention layer with experts): the generic spec
    finds them, with the final norm, and lists the Mamba layer's linears among the token mixers."""
    model = make_tiny_model("jamba")
    arch = get_arch(model)
    assert len({type(b) for b in arch.block_list(model)}) == 2
    assert (arch.blocks, arch.final_norm) == ("model.layers", "model.final_layernorm")
    assert {"mamba.in_proj", "mamba.out_proj", "self_attn.q_proj"} <= set(arch.attention)
    assert "feed_forward.down_proj" in arch.mlp


def test_a_per_layer_input_projection_named_in_targets_is_quantized_in_memory_and_refused_streamed(tmp_path):
    """Gemma 4's per_layer_model_projection stays float by default (listed); named in `targets:` it is quantized in a
    run held in memory, and a streamed run refuses it up front: its evaluation would see the float layer."""
    from compress.pipeline.resident import run
    from compress.recipe import from_dict
    from tests.tiny_tokenizer import make_tiny_tokenizer

    model = _model("gemma4_text")
    stage = QuantizeStage(scheme=SCHEME, targets=("Linear", "re:model.per_layer_model_projection"))
    plan = plan_quantize(model, get_arch(model), stage)
    assert "model.per_layer_model_projection" in {e.name for e in plan.quantized}
    folder = tmp_path / "gemma4"
    make_tiny_model("gemma4_text").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    recipe = from_dict({"model": {"source": str(folder), "stream": "always", "dtype": "float32"},
                        "stages": [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16},
                                    "targets": ["Linear", "re:model.per_layer_model_projection"]}],
                        "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(tmp_path / "out")}})
    with pytest.raises(ValueError, match=r"model.per_layer_model_projection is quantized by the recipe, but a "
                                         r"streamed run .*\(model.stream: false\)"):
        run(recipe, progress=False, log=lambda *a: None)
