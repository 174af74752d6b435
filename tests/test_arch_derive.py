"""AWQ scaling pairs derived from a block's structure (compress/arch/derive.py) for families without a table entry:
the derivation finds every pair of the 16 table families on its own, each pair is checked function-preserving
before use (a pair through a q/k norm, a GELU or a weightless norm is refused, with the reason), the derived pairs
preserve the model a run quantizes, and a run says in its summary where AWQ only clipped."""
from __future__ import annotations

import pytest
import torch
import transformers

from compress.arch import ArchSpec, _generic, block_pairs, get_arch, is_vision_language
from compress.arch import derive as derive_module
from compress.arch.derive import derive_from_model
from compress.arch.tables import FAMILIES
from compress.arch.tiny import tiny_config, tiny_model
from compress.transforms.smoothing import apply_smoothing, out_channels, pair_skip_reason
from tests.conftest import TINY_CONFIGS, TINY_MOE_CONFIGS, TINY_PER_LAYER_CONFIGS, make_tiny_model

def blocks_path(model):
    """Where a tiny model's decoder blocks are, as the generic spec finds them (a vision-language model has two stacks,
    the vision tower's and the language model's: its table entry names the latter)."""
    if is_vision_language(model.config):
        return FAMILIES[model.config.model_type]["blocks"]
    return _generic(model, model.config.model_type, derive_pairs=False).blocks


# what the derivation finds beyond a table entry: DeepSeek-V3's table skips its multi-head latent attention
# ("not mapped yet"); the derivation maps it (the input norm -> q_a / kv_a, and the two low-rank norms -> q_b / kv_b)
BEYOND_TABLE = {"deepseek_v3": {("input_layernorm", frozenset({"self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"})),
                                ("self_attn.q_a_layernorm", frozenset({"self_attn.q_b_proj"})),
                                ("self_attn.kv_a_layernorm", frozenset({"self_attn.kv_b_proj"}))}}


def _derived(family: str, **overrides):
    model = tiny_model(tiny_config(transformers.AutoConfig.for_model(family), overrides))
    return model, derive_from_model(model, blocks_path(model))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_derivation_finds_every_pair_of_the_table(family):
    """On each of the 16 table families (its own config class, tiny), the pairs found from the structure and checked
    are the table's, with the same inspect modules, norm offset and no-clip layers; DeepSeek-V3 gets its attention
    pairs on top. The table's skips (fused q/k/v, GELU, gpt-oss's clamped up) are refused by the check too."""
    _, found = _derived(family)
    entry = FAMILIES[family]
    table = {(prev, frozenset(balance)): inspect for prev, balance, inspect in entry["awq"]}
    derived = {(prev, frozenset(balance)): inspect for prev, balance, inspect in found.awq}
    assert derived.keys() - table.keys() == BEYOND_TABLE.get(family, set())
    assert table.keys() <= derived.keys()
    assert {k: derived[k] for k in table} == table  # the module each search compares
    assert found.norm_offset == entry.get("norm_offset", 0.0)
    assert found.no_clip == entry.get("no_clip", ())


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS) + sorted(TINY_MOE_CONFIGS))
def test_table_families_keep_their_table_entry_and_derive_nothing(family, monkeypatch):
    """A table family's spec is its entry, exactly as before (the derivation never runs for it: the quantized
    tensors of the 15 test families were compared with main's, bit for bit, for AWQ, GPTQ, AWQ+GPTQ and
    SmoothQuant)."""
    from compress.arch.moe import unfuse_experts
    monkeypatch.setattr(derive_module, "derive", lambda *a: pytest.fail("derived pairs for a table family"))
    model = make_tiny_model(family)
    unfuse_experts(model)  # as load_model does
    arch = get_arch(model)
    assert arch == ArchSpec(family=family, **FAMILIES[family])


def _change(model, pair, offset: float, prev_too: bool = True) -> float:
    from compress.arch.derive import _Checker
    blocks = model.get_submodule(blocks_path(model))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    return _Checker(model, blocks, ids).change(pair, offset, prev_too)


def test_a_pair_through_a_q_norm_a_gelu_or_a_norm_without_weight_is_refused_by_the_check():
    """The check folds random positive scales into the tiny model and compares logits: v -> o and up -> down through
    SiLU preserve them (float rounding), q -> o through Qwen3's q_norm and the softmax does not, nor GPT-NeoX's
    h_to_4h -> 4h_to_h through its GELU; OPT's fc1 -> fc2 through a ReLU does. A norm without weight (OLMo) has
    nothing to fold into, and is said so."""
    model, found = _derived("qwen3")
    assert _change(model, ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"), 0.0) < 1e-5
    assert _change(model, ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"), 0.0) < 1e-5
    assert _change(model, ("self_attn.q_proj", ("self_attn.o_proj",), "self_attn.o_proj"), 0.0) > 1e-2
    assert _change(model, ("mlp.gate_proj", ("mlp.down_proj",), "mlp.down_proj"), 0.0) > 1e-2  # SiLU(x / s)
    assert not any(prev.endswith(("q_norm", "k_norm")) or prev == "self_attn.q_proj" for prev, _, _ in found.awq)
    assert _change(model, ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"), 0.0, prev_too=False) > 1e-3

    neox, found = _derived("gpt_neox")
    assert [why for pair, why in found.awq_skip if pair == "mlp.dense_h_to_4h -> mlp.dense_4h_to_h"][0].startswith(
        "not function-preserving")
    _, found = _derived("opt")
    assert ("fc1", ("fc2",), "fc2") in found.awq

    _, found = _derived("olmo")  # OlmoLayerNorm: no weight, no bias
    assert dict(found.awq_skip)["input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj"] == \
        "input_layernorm has no per-channel weight to fold the scales into"
    assert [p[0] for p in found.awq] == ["self_attn.v_proj", "mlp.up_proj"]


def test_norm_offsets_and_norms_inside_attention():
    """Gemma 3's norms compute x * (1 + weight): found, and folded that way; its q_norm / k_norm (inside the
    attention, after q / k) start no pair, and q -> o through them is refused; OLMo 2 has no norm before its
    attention or MLP (they read the residual stream): its q/k/v and gate/up get no pair, and the reason says so."""
    _, found = _derived("gemma3_text")
    assert found.norm_offset == 1.0
    assert [p[:2] for p in found.awq] == [
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)), ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",))]
    _, found = _derived("olmo2")
    why = dict(found.awq_skip)
    assert "the residual stream itself (no norm before it)" in why["-> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj"]
    assert "-> mlp.gate_proj, mlp.up_proj" in why
    assert [p[:2] for p in found.awq] == [("self_attn.v_proj", ("self_attn.o_proj",)),
                                          ("mlp.up_proj", ("mlp.down_proj",))]


@pytest.mark.parametrize("family", sorted(TINY_PER_LAYER_CONFIGS))
def test_derived_pairs_preserve_the_model_a_run_quantizes(family):
    """The pairs found on the family's tiny model (4 key/value heads) applied to the test's model (2: v -> o is
    skipped there for grouped heads, as for the table families), each with random scales, in every block: the
    logits do not move beyond float rounding."""
    model = make_tiny_model(family)
    arch = get_arch(model)
    assert arch.family == f"generic:{model.config.model_type}" and arch.awq
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        before = model(ids).logits
        scaled = 0
        for block in arch.block_list(model):
            linears = {n for n, _ in block.named_modules()}
            for prev, balance, _, followers in block_pairs(block, arch.awq):
                if pair_skip_reason(block, prev, balance, linears) is not None:
                    continue
                p = block.get_submodule(prev)
                mods = [block.get_submodule(n) for n in (*balance, *followers)]
                apply_smoothing(p, mods, torch.rand(out_channels(p)) * 3 + 0.2, arch.norm_offset)
                scaled += 1
        after = model(ids).logits
    assert scaled >= len(arch.block_list(model))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_deriving_leaves_the_callers_random_stream_alone():
    model = make_tiny_model("gemma3_text")
    derive_module._DERIVED.clear()
    torch.manual_seed(5)
    get_arch(model)
    got = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(got, torch.rand(3))


def _awq_run(model):
    from compress.recipe import from_dict
    from compress.pipeline.calibration import compress_model
    from compress.stages import make_plan
    from tests.tiny_tokenizer import make_tiny_tokenizer
    recipe = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 2, "seq_len": 16},
                        "stages": [{"stage": "awq", "n_grid": 3, "search_samples": 1},
                                   {"stage": "quantize", "scheme": {"dtype": "int4", "group_size": 16}}]})
    lines: list[str] = []
    sections, _ = compress_model(model, make_tiny_tokenizer(), recipe, make_plan(model, get_arch(model), recipe.stages),
                                 "cpu", progress=False, log=lines.append)
    return sections, lines


def test_the_report_says_where_awq_only_clipped(monkeypatch):
    """Where pairs cannot be scaled the run says so in its summary and log, with the reasons: OLMo 2 (no norm before
    its attention and MLP, grouped v -> o) scales 2 of 8 pair slots; a family whose pairs cannot be derived at
    all scales none, and the summary says why; with every pair scaled (4 key/value heads) nothing is said."""
    from compress.pipeline.report import _header_lines

    sections, log = _awq_run(tiny_model(tiny_config(transformers.AutoConfig.for_model("olmo2"),
                                                    {"num_key_value_heads": 2})))
    summary = sections["stages"][0]["summary"]
    assert summary.startswith("AWQ: clipping only on 6 of 8 scaling pairs, because: "
                              "`-> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj`: it reads the block's input")
    assert "grouped-query attention" in summary and f"WARNING: {summary}" in log
    assert f"- **{summary}**" in _header_lines({"stages": sections["stages"]})

    monkeypatch.setattr(derive_module, "tiny_model", lambda *a: (_ for _ in ()).throw(RuntimeError("no tiny model")))
    derive_module._DERIVED.clear()
    sections, _ = _awq_run(make_tiny_model("gemma3_text"))
    assert sections["stages"][0]["summary"].startswith(
        "AWQ: clipping only on 2 of 2 scaling pairs; 2 of 2 blocks had no pair scaled, because: `all pairs`: no "
        "scaling pairs are known for model_type 'gemma3_text', and deriving them from its blocks' structure failed "
        "on its tiny model (RuntimeError: no tiny model)")
    monkeypatch.undo()
    derive_module._DERIVED.clear()

    sections, log = _awq_run(make_tiny_model("llama", num_key_value_heads=4))
    assert sections["stages"][0]["summary"] is None and not [x for x in log if x.startswith("WARNING: AWQ")]
    assert sections["stages"][0]["unscaled"]["scaled"] == sections["stages"][0]["unscaled"]["pairs"] == 8


def test_the_summary_counts_every_pair_slot_of_every_block():
    """Pairs a block tried (scaled or skipped) and the family's pairs that could not be found at all (arch.awq_skip,
    once per block) are the slots; the summary names each reason with the number of blocks it held in."""
    from compress.stages.awq import pairs_summary, unscaled_pairs
    blocks = [{"block": i, "pairs": [{"pair": "a -> b", "skipped": ""},
                                     {"pair": "v -> o", "skipped": "grouped heads" if i else ""}]} for i in range(3)]
    unscaled = unscaled_pairs(blocks, (("-> q", "reads the residual stream"),))
    assert (unscaled["pairs"], unscaled["scaled"], unscaled["unscaled_blocks"]) == (9, 4, 0)
    assert pairs_summary("AWQ: clipping only", unscaled) == (
        "AWQ: clipping only on 5 of 9 scaling pairs, because: `-> q`: reads the residual stream (3 blocks); "
        "`v -> o`: grouped heads (2 blocks)")
    nothing = unscaled_pairs([{"block": 0, "pairs": []}], (("all pairs", "no pairs known"),))
    assert pairs_summary("AWQ: clipping only", nothing) == \
        "AWQ: clipping only on 1 of 1 scaling pairs; 1 of 1 blocks had no pair scaled, because: `all pairs`: no pairs known"
    assert pairs_summary("AWQ", unscaled_pairs(blocks[:1], ())) is None
