"""Minitron structured pruning: shapes, reload with plain transformers, exactness, importance, targets."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from compress.arch import get_arch
from compress.prune import TargetShape, count_params, minitron_prune, resolve_shape
from compress.stages.prune import PruneStage
from compress.prune.importance import BatchAggregate, activation_importance, aggregate_seq
from compress.prune.slicing import prune_heads, prune_hidden, prune_layers, prune_mlp
from tests.conftest import TINY_CONFIGS, make_tiny_model

FAMILIES = list(TINY_CONFIGS)
FULL = ("llama", "qwen2", "mistral", "gemma", "gemma2", "phi3")  # every axis; the others: mlp and depth only
QUIET = dict(progress=False, log=lambda *_: None)


def _ids(n=6, s=24, seed=1):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(seed))


def _prune(model, **stage):
    stage = {"n_samples": 6, "depth_samples": 3, "multiple_of": 8, **stage}
    return minitron_prune(model, get_arch(model), _ids(), PruneStage(**stage), **QUIET)


AXIS_CASES = {
    "mlp": (dict(mlp=0.5), dict(intermediate=64)),
    "heads": (dict(heads=0.5), dict(heads=2, kv_heads=2)),
    "heads_kv_group": (dict(heads=0.5, heads_mode="kv_group"), dict(heads=2, kv_heads=1)),
    "hidden": (dict(hidden=0.5), dict(hidden=32)),
    "depth": (dict(depth=0.5), dict(layers=1)),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(AXIS_CASES))
def test_each_axis_gives_the_target_shape_and_reloads_with_plain_transformers(family, case, tmp_path):
    stage, expect = AXIS_CASES[case]
    model = make_tiny_model(family)
    if family not in FULL and case.startswith(("heads", "hidden")):
        with pytest.raises(ValueError, match="cannot prune .* Prune `mlp` or `depth` instead"):
            _prune(model, **stage)
        return
    if family in ("opt", "gpt_neox", "gpt2") and case == "mlp":
        expect = dict(intermediate={"gpt2": 128}.get(family, 64))  # GPT-2's MLP is 4 x 64 = 256 wide
    report = _prune(model, **stage)
    for key, value in expect.items():
        assert report["pruned"][key] == value
    assert report["parameters_after"] == sum(p.numel() for p in model.parameters()) < report["parameters_before"]
    assert report["parameters_after"] == count_params(model.config)  # the config describes the sliced model
    ids = _ids(2, 16, seed=5)
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no custom code
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, logits, rtol=0, atol=1e-5)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_slicing_that_keeps_everything_reproduces_the_logits_exactly(family):
    model = make_tiny_model(family)
    reference = make_tiny_model(family)
    arch = get_arch(model)
    cfg = model.config
    layers = len(arch.block_list(model))
    inter = model_shape_intermediate(model)
    prune_mlp(model, arch, [torch.arange(inter)] * layers)
    if family in FULL:
        prune_heads(model, arch, [torch.arange(cfg.num_attention_heads)] * layers,
                    [torch.arange(cfg.num_key_value_heads)] * layers)
        prune_hidden(model, arch, torch.arange(cfg.hidden_size))
    prune_layers(model, arch, list(range(layers)))
    ids = _ids(2, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def model_shape_intermediate(model) -> int:
    from compress.prune.minitron import model_shape
    return model_shape(model, get_arch(model)).intermediate


def test_ratios_of_one_prune_nothing():
    model, reference = make_tiny_model("qwen2"), make_tiny_model("qwen2")
    report = _prune(model, mlp=1.0, heads=1.0, hidden=1.0, depth=1.0)
    assert report["axes"] == [] and report["parameter_ratio"] == 1.0
    ids = _ids(2, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


# ---------------------------------------------------------------- importance is meaningful

def test_inert_mlp_channels_are_the_ones_pruned_and_the_output_is_unchanged():
    model = make_tiny_model("llama")
    inert = [torch.tensor([3, 17, 40, 41, 90, 127, 5, 60]), torch.tensor([0, 1, 2, 50, 51, 99, 100, 126])]
    with torch.no_grad():
        for block, idx in zip(model.model.layers, inert):
            block.mlp.up_proj.weight[idx] = 0  # silu(gate) * 0 = 0: these channels never fire
    ids = _ids(2, 16)
    with torch.no_grad():
        before = model(ids).logits
    report = _prune(model, target={"intermediate_size": 120})
    assert report["pruned"]["intermediate"] == 120
    for block, idx in zip(model.model.layers, inert):
        assert block.mlp.down_proj.weight.shape[1] == 120
    importance = report["mlp"]["kept_score_share"]
    assert all(share == pytest.approx(1.0) for share in importance)  # everything dropped scored 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-5)


def test_inert_kv_group_is_the_one_pruned():
    model = make_tiny_model("llama")  # 4 query heads over 2 KV heads, head_dim 16
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[16:32] = 0  # KV head 1 of layer 0 outputs nothing
        model.model.layers[1].self_attn.v_proj.weight[0:16] = 0  # KV head 0 of layer 1
    ids = _ids(2, 16)
    with torch.no_grad():
        before = model(ids).logits
    report = _prune(model, heads=0.5, heads_mode="kv_group")
    assert report["heads"]["kept_kv"] == [[0], [1]]
    assert report["heads"]["kept_query"] == [[0, 1], [2, 3]]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-5)


def test_query_heads_are_chosen_within_each_kv_group():
    model = make_tiny_model("qwen2")
    report = _prune(model, heads=0.5)
    for q, kv in zip(report["heads"]["kept_query"], report["heads"]["kept_kv"]):
        assert kv == [0, 1] and len(q) == 2 and q[0] in (0, 1) and q[1] in (2, 3)


def test_silent_residual_channels_are_the_hidden_channels_pruned():
    model = make_tiny_model("mistral")
    dead = torch.tensor([2, 9, 33, 63])
    with torch.no_grad():  # nothing ever writes these residual channels
        model.model.embed_tokens.weight[:, dead] = 0
        for block in model.model.layers:
            block.self_attn.o_proj.weight[dead] = 0
            block.mlp.down_proj.weight[dead] = 0
    imp = activation_importance(model, get_arch(model), _ids(), {"hidden"}, progress=False)
    assert set(imp.hidden.topk(4, largest=False).indices.tolist()) == set(dead.tolist())
    assert imp.hidden[dead].abs().max() == 0


def test_an_identity_block_is_the_one_dropped_and_the_output_is_unchanged():
    config = TINY_CONFIGS["llama"]()
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    with torch.no_grad():  # block 1 adds nothing to the residual stream
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
        model.model.norm.weight.mul_(8)  # confident predictions, so that a working block's removal shows
    ids = _ids(2, 16)
    with torch.no_grad():
        before = model(ids).logits
    # text sampled from the model itself: there, every working block helps and the identity one does not
    torch.manual_seed(0)
    own_text = model.generate(_ids(4, 1), max_new_tokens=23, do_sample=True, pad_token_id=0)
    for metric in ("ppl", "cosine"):
        candidate = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
        candidate.load_state_dict(model.state_dict())
        stage = PruneStage(target=TargetShape(num_hidden_layers=2), depth_metric=metric, depth_samples=4)
        report = minitron_prune(candidate, get_arch(candidate), own_text, stage, **QUIET)
        assert report["depth"]["dropped"] == [1]
        assert report["depth"]["cosine"][1] == pytest.approx(0.0, abs=1e-6)
        if metric == "ppl":
            assert report["depth"]["ppl"] == pytest.approx(report["depth"]["ppl_without_block"][1], rel=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(candidate(ids).logits, before, rtol=0, atol=1e-5)
    assert candidate.config.num_hidden_layers == 2
    assert [b.self_attn.layer_idx for b in candidate.model.layers] == [0, 1]


# ---------------------------------------------------------------- aggregation against plain formulas

@pytest.mark.parametrize("seq_agg", ["mean", "l2", "max"])
@pytest.mark.parametrize("batch_agg", ["mean", "l2", "max"])
def test_aggregation_matches_plain_formulas(seq_agg, batch_agg):
    x = torch.rand(5, 7, 3, dtype=torch.float64)  # [B, S, C]
    per_row = {"mean": x.mean(1), "l2": (x ** 2).sum(1).sqrt(), "max": x.max(1).values}[seq_agg]  # [B, C]
    expect = {"mean": per_row.mean(0), "l2": (per_row ** 2).sum(0).sqrt(), "max": per_row.max(0).values}[batch_agg]
    agg = BatchAggregate(batch_agg)
    agg.add(aggregate_seq(x[:2], seq_agg))  # two batches: the running aggregate must not depend on the split
    agg.add(aggregate_seq(x[2:], seq_agg))
    torch.testing.assert_close(agg.value().double(), expect, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- targets

def test_parameter_budget_picks_the_largest_shape_that_fits():
    model = make_tiny_model("llama")
    total = count_params(model.config)
    orig, new, changed = resolve_shape(model, get_arch(model), PruneStage(params=0.8, axes=("mlp",), multiple_of=8))
    assert changed == ["mlp"]
    from compress.prune.minitron import shaped_config
    from dataclasses import replace
    assert count_params(shaped_config(model, new)) <= 0.8 * total
    assert count_params(shaped_config(model, replace(new, intermediate=new.intermediate + 8))) > 0.8 * total


def test_explicit_target_shape():
    model = make_tiny_model("phi3")
    report = _prune(model, target={"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 96,
                                   "hidden_size": 48, "num_hidden_layers": 1})
    assert report["pruned"] == {"heads": 2, "kv_heads": 1, "intermediate": 96, "hidden": 48, "layers": 1}
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.hidden_size,
            c.num_hidden_layers, c.head_dim) == (2, 1, 96, 48, 1, 16)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of"),
    ({"mlp": 0.5, "params": 0.5, "axes": ("mlp",)}, "exactly one of"),
    ({"mlp": 1.5}, r"fraction to keep, in \(0, 1\]"),
    ({"params": 0.5}, "needs a positive budget and `axes`"),
    ({"params": 0.5, "axes": ("width",)}, "unknown axis 'width'"),
    ({"mlp": 0.5, "axes": ("mlp",)}, "applies to a `params` budget only"),
])
def test_bad_prune_stage_errors_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PruneStage(**kwargs)


def test_targets_that_grow_or_break_groups_are_refused():
    model = make_tiny_model("llama")
    arch = get_arch(model)
    with pytest.raises(ValueError, match="can only shrink"):
        resolve_shape(model, arch, PruneStage(target=TargetShape(intermediate_size=4096)))
    with pytest.raises(ValueError, match="whole KV groups"):
        resolve_shape(model, arch, PruneStage(target=TargetShape(num_attention_heads=3)))


def test_unknown_family_names_the_table():
    model = make_tiny_model("llama")
    model.config.model_type = "mystery"
    with pytest.raises(ValueError, match="add prune= to its FAMILIES entry"):
        prune_mlp(model, get_arch(make_tiny_model("llama")), [torch.arange(8)] * 2)


def test_hidden_size_stays_a_multiple_of_the_heads():
    """transformers validates hidden_size % num_attention_heads == 0 at save/load, even with an explicit head_dim."""
    model = make_tiny_model("llama")  # 4 heads
    orig, new, _ = resolve_shape(model, get_arch(model), PruneStage(hidden=0.6, multiple_of=6))
    assert new.hidden % 4 == 0 and new.hidden % 6 == 0
    with pytest.raises(ValueError, match="not a multiple of the 4 attention heads"):
        resolve_shape(model, get_arch(model), PruneStage(target=TargetShape(hidden_size=50)))
