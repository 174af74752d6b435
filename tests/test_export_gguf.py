"""GGUF export: block layouts decoded independently, tiny models and SmolLM2 run in llama-cpp-python."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import transformers

from compress.arch import get_arch
from compress.export import GGUF_TYPES
from compress.export.gguf import gguf_problems, write_gguf
from compress.export.gguf_llama_cpp import llama_cpp_logits, load_llama_cpp
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import W8A8, scheme
from tests.conftest import make_tiny_model
from tests.tiny_tokenizer import CHAT_TEMPLATE, byte_bpe_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
# Written for this test (not from a corpus): real English prose, ~270 SmolLM2 tokens.
PARAGRAPH = (
    "The old lighthouse at the edge of the bay had not guided a ship for almost forty years, but the town "
    "still painted it every spring. Children climbed the narrow stairs on school trips and counted the steps "
    "out loud, and every class came back down with a different number. From the top you could see the "
    "fishing boats leave before dawn, their lamps moving slowly across the dark water like a line of small "
    "stars. In the afternoon the wind usually turned, and the gulls gathered on the railings to wait for the "
    "boats to return with their catch. The keeper's cottage had become a museum with a few rooms of maps, "
    "brass instruments and photographs of storms that nobody in the town still remembered. Visitors often "
    "asked why the light had been switched off, and the answer was always the same: satellites and radio had "
    "made it unnecessary, and the cost of repairing the lens was more than the council could pay. Still, on "
    "the longest night of the year, a volunteer climbs to the lamp room and lights a single electric bulb, "
    "and for a few hours the beam sweeps across the harbour again while people stand on the pier and watch. "
    "Nobody remembers exactly when the custom began, but everyone agrees that it should continue, because a "
    "town that forgets its lights soon forgets its sailors as well.")


# ---------------------------------------------------------------- helpers

def quantized(family: str, sch, seed: int = 0):
    model = make_tiny_model(family, seed)
    stage = QuantizeStage(scheme=sch)
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    return model


def windows(n: int = 3, t: int = 64, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def hf_logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float()


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def read_tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation (interleaved pairs back to rotate-half halves)."""
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def decode(raw: np.ndarray, kind: str):
    """Independent block decoder from the format spec (ggml-common.h): uint8 [rows, bytes] ->
    (values float32 [rows, K], stored ints [rows, K], d [rows, K / 32], m [rows, K / 32] or None)."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
    d = b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)
    m = None
    if kind == "Q8_0":
        ints = b[..., 2:].copy().view(np.int8).astype(np.int32)
        vals = d[..., None] * ints.astype(np.float32)
    else:
        if kind == "Q4_1":
            m = b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        qs = b[..., -16:]
        ints = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)  # elements 0..15, then 16..31
        vals = d[..., None] * (ints - 8).astype(np.float32) if kind == "Q4_0" else \
            d[..., None] * ints.astype(np.float32) + m[..., None]
    rows = raw.shape[0]
    return vals.reshape(rows, -1), ints.reshape(rows, -1), d, m


def heads_for(gname: str, config) -> int | None:
    return {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(gname)


# ---------------------------------------------------------------- block formats (exact path)

@pytest.mark.parametrize("sch, qtype", [
    (scheme("int4", "group", 32), "q4_0"),
    (scheme("int8", "group", 32), "q8_0"),
    (scheme("int4", "group", 64), "q4_0"),  # one scale for two blocks: still exact
    (scheme("int8", "channel"), "q8_0"),
], ids=lambda x: getattr(x, "name", x))
def test_exact_blocks_decode_to_our_weights_bitwise(tmp_path, sch, qtype):
    model = quantized("llama", sch)
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", qtype)
    stored = read_tensors(tmp_path / "m.gguf")
    kind = qtype.upper()
    for i in range(model.config.num_hidden_layers):
        for hf, gname in HF_TO_GGUF.items():
            name = f"blk.{i}.{gname}.weight"
            assert report["tensors"][name]["path"] == "exact" and report["tensors"][name]["type"] == kind
            t = stored[name]
            assert t.tensor_type.name == kind
            vals, ints, d, _ = decode(np.array(t.data), kind)
            qt = model.get_submodule(f"model.layers.{i}.{hf}").qtensor()
            heads = heads_for(gname, model.config)
            w, ints = torch.from_numpy(vals), torch.from_numpy(ints)
            if heads:
                w, ints = unpermute_rows(w, heads), unpermute_rows(ints, heads)
            assert torch.equal(w, qt.dequantize(torch.float32)), name  # bitwise
            expect = qt.codes() + 8 if kind == "Q4_0" else qt.codes()
            assert torch.equal(ints, expect), name  # the stored nibbles / int8 are our codes (+ 8)
    assert report["counts"]["exact"] == 14 and "requantized" not in report["counts"]


def test_q4_1_keeps_codes_and_scales_and_rounds_m(tmp_path):
    model = quantized("llama", scheme("int4", "group", 32, symmetric=False))
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "q4_1")
    stored = read_tensors(tmp_path / "m.gguf")
    rounded = 0
    for i in range(model.config.num_hidden_layers):
        for hf, gname in HF_TO_GGUF.items():
            name = f"blk.{i}.{gname}.weight"
            vals, ints, d, m = decode(np.array(stored[name].data), "Q4_1")
            qt = model.get_submodule(f"model.layers.{i}.{hf}").qtensor()
            heads = heads_for(gname, model.config)
            w, ints, d, m = (torch.from_numpy(x) for x in (vals, ints, d, m))
            if heads:
                w, ints, d, m = (unpermute_rows(x, heads) for x in (w, ints, d, m))
            assert torch.equal(ints, qt.codes()), name  # nibbles = our unsigned codes, exactly
            assert torch.equal(d, qt.scale.float()), name  # d = our fp16 scale, exactly
            want_m = -qt.zero_point.float() * qt.scale.float()
            assert torch.equal(m, want_m.half().float()), name  # m = -zero * scale, rounded to fp16
            m_err = float((m - want_m).abs().max())
            assert float((w - qt.dequantize(torch.float32)).abs().max()) <= m_err * 1.001 + 1e-7, name
            entry = report["tensors"][name]
            assert entry["path"] == "exact"
            if m_err:
                rounded += 1
                assert entry["m_rounded_to_fp16_max_abs"] == pytest.approx(m_err)
    assert rounded > 0  # the report says where m was rounded


def test_other_grids_are_requantized_with_llama_cpps_reference_quantizer(tmp_path):
    model = quantized("llama", scheme("int4", "group", 16))  # groups of 16: not a Q4_0 grid
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "q4_0")
    stored = read_tensors(tmp_path / "m.gguf")
    entry = report["tensors"]["blk.0.attn_q.weight"]
    assert entry["path"] == "requantized" and "group_size=16" in entry["reason"]
    w = model.model.layers[0].self_attn.q_proj.qtensor().dequantize(torch.float32)
    heads = model.config.num_attention_heads  # llama.cpp's q row order: interleaved rotary pairs per head
    permuted = w.reshape(heads, 2, -1, w.shape[1]).transpose(1, 2).reshape(w.shape)
    expected = gguf.quants.quantize(permuted.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(np.array(stored["blk.0.attn_q.weight"].data), expected)
    assert report["counts"] == {"quantized-from-float": 1, "float": 5, "requantized": 14}
    assert report["tensors"]["token_embd.weight"]["type"] == "Q8_0"  # 4-bit exports keep the embedding in Q8_0
    assert "output.weight" not in report["tensors"]  # tied: llama.cpp reads token_embd for the output


# ---------------------------------------------------------------- tiny models in llama.cpp

@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tiny_float_model_in_llama_cpp(tmp_path, family):
    model = make_tiny_model(family)
    ids = windows()
    ref = hf_logits(model, ids)
    for qtype, max_rel in (("f16", 0.005), ("q8_0", 0.03)):  # measured f16 0.0005, q8_0 0.010-0.011
        path = tmp_path / f"{qtype}.gguf"
        report = write_gguf(model, byte_bpe_tokenizer(), path, qtype)
        assert ("output.weight" in report["tensors"]) == (not model.config.tie_word_embeddings)  # tied: llama
        out = llama_cpp_logits(path, ids)
        assert out.shape == ref.shape
        assert agreement(out, ref) >= 0.98, (qtype, agreement(out, ref))  # measured 1.0 (qwen2 q8_0: 0.984)
        assert rel_err(out, ref) < max_rel, (qtype, rel_err(out, ref))


def test_int4_model_exported_exactly_reproduces_its_logits(tmp_path):
    """Same weights in both runtimes: only llama.cpp's 8-bit activation blocks and fp16 KV cache differ."""
    ids = windows()
    exact = quantized("llama", scheme("int4", "group", 32))
    write_gguf(exact, byte_bpe_tokenizer(), tmp_path / "exact.gguf", "q4_0", embed_qtype="f16")
    rel_exact = rel_err(llama_cpp_logits(tmp_path / "exact.gguf", ids), hf_logits(exact, ids))
    # the same kind of model with groups of 16 must be requantized to Q4_0's grid: its weights change
    requant = quantized("llama", scheme("int4", "group", 16))
    write_gguf(requant, byte_bpe_tokenizer(), tmp_path / "requant.gguf", "q4_0", embed_qtype="f16")
    rel_requant = rel_err(llama_cpp_logits(tmp_path / "requant.gguf", ids), hf_logits(requant, ids))
    assert rel_exact < 0.01  # measured 0.0039
    assert rel_exact * 5 < rel_requant  # measured 0.069


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_tiny_moe_runs_in_llama_cpp_with_every_expert(tmp_path, family):
    """A mixture of experts in llama.cpp (Mixtral as its llama graph with experts, Qwen3-MoE as qwen3moe with its
    q/k norms): each MoE block's router as ffn_gate_inp and every expert's projection stacked into
    ffn_{gate,up,down}_exps [E, out, in], expert_count / expert_used_count in the header. Float weights at f16 and
    q8_0 reproduce transformers' logits; int4 g32 experts go in exactly (their Q4_0 blocks hold our codes) and
    llama.cpp reproduces our quantized model. A Qwen3-MoE that does not renormalise its top-k (llama.cpp always
    does) is refused."""
    from tests.conftest import TINY_MOE_CONFIGS

    from compress.arch.moe import unfuse_experts

    config = TINY_MOE_CONFIGS[family]()
    if family == "qwen3_moe":
        config.norm_topk_prob = False
        torch.manual_seed(0)
        unnormalised = transformers.AutoModelForCausalLM.from_config(config).eval()
        unfuse_experts(unnormalised)
        assert "norm_topk_prob" in gguf_problems(unnormalised, "f16")[0]
        config.norm_topk_prob = True  # as the released Qwen3-MoE models
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    unfuse_experts(model)
    ids = windows()
    ref = hf_logits(model, ids)
    for qtype, max_rel in (("f16", 0.005), ("q8_0", 0.03)):  # measured 0.0004 and 0.011
        path = tmp_path / f"{qtype}.gguf"
        write_gguf(model, byte_bpe_tokenizer(), path, qtype)
        out = llama_cpp_logits(path, ids)
        assert agreement(out, ref) >= 0.95 and rel_err(out, ref) < max_rel, (qtype, rel_err(out, ref))
    fields = gguf.GGUFReader(str(tmp_path / "f16.gguf")).fields
    arch = fields["general.architecture"].contents()
    assert fields[f"{arch}.expert_count"].contents() == 4 and fields[f"{arch}.expert_used_count"].contents() == 2
    stage = QuantizeStage(scheme=scheme("int4", "group", 32))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "q4.gguf", "q4_0", embed_qtype="f16")
    experts = {k: v for k, v in report["tensors"].items() if "_exps" in k}
    assert len(experts) == 6 and all(v["path"] == "exact" and v["shape"][0] == 4 for v in experts.values())
    assert rel_err(llama_cpp_logits(tmp_path / "q4.gguf", ids), hf_logits(model, ids)) < 0.01  # measured 0.0036


def test_a_tensor_gguf_has_no_name_for_is_refused():
    """The writer names its tensors by gguf's own table (TensorNameMap, as llama.cpp's converter): a Qwen3-MoE with
    a dense MLP block has tensors qwen3moe's table does not name (llama.cpp's graph expects experts in every block);
    refused, naming the tensor."""
    from compress.arch.moe import unfuse_experts

    model = make_tiny_model("qwen3_moe", norm_topk_prob=True, mlp_only_layers=[0])
    unfuse_experts(model)
    problems = gguf_problems(model, "f16")
    assert len(problems) == 2 and "blocks [0] have a dense MLP" in problems[0]
    assert "has no name for model.layers.0.mlp.gate_proj.weight" in problems[1] and "export `dense`" in problems[1]


def test_llama_cpp_reads_the_tokenizer_and_chat_template(tmp_path):
    tok = byte_bpe_tokenizer()
    report = write_gguf(make_tiny_model("llama"), tok, tmp_path / "m.gguf", "f16")
    assert "tokenizer.ggml.pre='gpt-2'" in report["tokenizer"]
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    assert fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == 256 and tokens[255] == "[PAD255]" and types[255] == 5  # padded to the embedding: UNUSED
    assert types[tok.convert_tokens_to_ids("<|endoftext|>")] == 3  # CONTROL
    llm = load_llama_cpp(tmp_path / "m.gguf", n_ctx=64, vocab_only=True)
    try:
        text = "the quick brown fox jumps over a lazy dog, and then it runs to the river"
        assert llm.tokenize(text.encode(), add_bos=False) == tok(text, add_special_tokens=False).input_ids
        assert llm.metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
    finally:
        llm.close()


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_unsupported_architecture_is_named(tmp_path, family):
    model = make_tiny_model(family)
    problems = gguf_problems(model, "q8_0")
    assert len(problems) == 1 and type(model).__name__ in problems[0]
    assert "the model types llama, " in problems[0] and "convert_hf_to_gguf.py" in problems[0]
    with pytest.raises(ValueError, match="is not an architecture the GGUF exporter writes"):
        write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "q8_0")
    assert not (tmp_path / "m.gguf").exists()


def test_activation_quantized_model_is_refused(tmp_path):
    model = quantized("llama", W8A8)
    for qtype in GGUF_TYPES:
        (msg,) = gguf_problems(model, qtype)
        assert msg.startswith("14 layers quantize their activations") and W8A8.name in msg
        assert "GGUF stores weight-only formats; export the dense or compressed-tensors format instead" in msg
    with pytest.raises(ValueError, match="weight-only"):
        write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "f16")


def test_rows_that_are_not_whole_blocks_are_refused_for_block_types():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    stage = QuantizeStage(scheme=scheme("int4", "group", 16))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    (msg,) = gguf_problems(model, "q4_0")
    assert "model.layers.0.mlp.down_proj (in_features=80)" in msg and "export gguf-f16" in msg
    assert gguf_problems(model, "f16") == []


def test_unknown_gguf_type_and_tokenizers_llama_cpp_cannot_read(tmp_path):
    from tests.tiny_tokenizer import make_tiny_tokenizer

    model = make_tiny_model("llama")
    assert "choose one of f16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, q4_k_m, q5_k_m" in gguf_problems(model, "q3_k")[0]
    with pytest.raises(ValueError, match="builds byte-level BPE"):  # a WordLevel tokenizer
        write_gguf(model, make_tiny_tokenizer(), tmp_path / "m.gguf", "f16")
    tok = byte_bpe_tokenizer()
    from tokenizers import pre_tokenizers
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    with pytest.raises(ValueError, match="unknown pre-tokenizer .* Pass pre=") as err:
        write_gguf(model, tok, tmp_path / "m.gguf", "f16")
    assert "smollm" in str(err.value)
    report = write_gguf(model, tok, tmp_path / "m.gguf", "f16", pre="default")  # the caller names it
    assert "tokenizer.ggml.pre='default'" in report["tokenizer"]


def test_missing_llama_cpp_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match="pip install llama-cpp-python"):
        llama_cpp_logits(tmp_path / "m.gguf", windows(1, 4))


# ---------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def smollm2_int8(tmp_path_factory):
    """SmolLM2-135M-Instruct quantized int8 symmetric g32 (Q8_0's grid), exported to Q8_0 with the tokenizer of
    the .gguf it came from; two 128-token windows of real text and our model's logits on them."""
    from compress.model.load import default_model_path, load_model

    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    stage = QuantizeStage(scheme=scheme("int8", "group", 32))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    ids = tok(PARAGRAPH, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] >= 256
    win = ids[:, :256].reshape(2, 128)
    path = tmp_path_factory.mktemp("smollm2") / "smollm2-q8_0.gguf"
    report = write_gguf(model, tok, path, "q8_0", source_gguf=str(default_model_path()))
    return {"model": model, "tok": tok, "win": win, "ref": hf_logits(model, win), "path": path, "report": report}


def test_smollm2_q8_0_export_matches_our_model(smollm2_int8):
    s = smollm2_int8
    report = s["report"]
    assert report["counts"] == {"quantized-from-float": 1, "float": 61, "exact": 210}  # embed, norms, linears
    assert "output.weight" not in report["tensors"] and report["tied_embeddings"]
    out = llama_cpp_logits(s["path"], s["win"])
    ref = s["ref"]
    # Every linear weight in the file is ours bit for bit (the block tests above), yet llama.cpp multiplies Q8_0
    # weights with activations it quantizes to 8-bit blocks of 32 (ggml's vec_dot_type for Q8_0), and keeps the
    # KV cache in fp16: over 30 layers the logits move by ~3% (measured 0.029). Plain top-1 agreement on these
    # 256 tokens is 0.953 (llama.cpp running the source Q4_1 file vs transformers on the very same weights: 0.961,
    # the runtime's own floor); every flip is at a near-tie of our model (top-2 gap <= 0.18 logit). So the 0.98
    # bar is asserted where our top-1 leads by at least 0.1 logit (92% of positions; measured 0.996), and the F16
    # test below holds the plain 0.98 bar.
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) >= 0.1
    same = out.argmax(-1) == ref.argmax(-1)
    assert float(decided.float().mean()) > 0.85  # measured 0.918
    assert float(same[decided].float().mean()) >= 0.98  # measured 0.996
    assert agreement(out, ref) >= 0.93  # measured 0.953
    picked = ref.gather(-1, out.argmax(-1, keepdim=True)).squeeze(-1)
    assert float((ref.max(-1).values - picked).max()) < 0.5  # measured 0.18: llama.cpp's pick is never far off
    assert rel_err(out, ref) < 0.05  # measured 0.029


def test_smollm2_tokenizer_and_chat_template(smollm2_int8, tmp_path):
    s = smollm2_int8
    tok = s["tok"]
    text = "SmolLM2 runs in llama.cpp: the quick brown fox, 2024 edition, isn't it? Ça va.\n\n<|im_start|>user"
    expect = tok(text, add_special_tokens=False).input_ids
    # the copied tokenizer, and one built from the Hugging Face tokenizer
    built = tmp_path / "hf-vocab.gguf"
    report = write_gguf(s["model"], tok, built, "q8_0")
    assert "built from the Hugging Face tokenizer" in report["tokenizer"]
    for path in (s["path"], built):
        fields = gguf.GGUFReader(str(path)).fields
        assert "<|im_start|>" in fields["tokenizer.chat_template"].contents()
        assert fields["tokenizer.chat_template"].contents() == tok.chat_template
        llm = load_llama_cpp(path, n_ctx=64, vocab_only=True)
        try:
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == expect, path
        finally:
            llm.close()


def test_smollm2_f16_export_matches_our_model(smollm2_int8, tmp_path):
    """F16 weights (our int8 weights dequantized): llama.cpp's activations stay 16-bit, the plain 0.98 bar holds."""
    s = smollm2_int8
    path = tmp_path / "smollm2-f16.gguf"
    report = write_gguf(s["model"], s["tok"], path, "f16")
    assert report["counts"] == {"float": 62, "dequantized": 210}
    out = llama_cpp_logits(path, s["win"])
    assert agreement(out, s["ref"]) >= 0.98  # measured 1.0
    assert rel_err(out, s["ref"]) < 0.005  # measured 0.0012


def test_pruned_and_quantized_model_exports_dense_and_gguf(tmp_path):
    """A Minitron-pruned model (MLP 128 -> 64 channels, 2 -> 1 blocks), then int4 g32: the dense export is a
    plain checkpoint transformers loads, and the GGUF file holds the pruned shapes and runs in llama.cpp."""
    from transformers import AutoModelForCausalLM

    from compress.export import export_model
    from compress.prune.slicing import prune_layers, prune_mlp

    model = make_tiny_model("llama")
    arch = get_arch(model)
    prune_mlp(model, arch, [torch.arange(0, 128, 2)] * 2)
    prune_layers(model, arch, [1])
    stage = QuantizeStage(scheme=scheme("int4", "group", 32))
    apply_quantize(model, plan_quantize(model, arch, stage), stage)
    ids = windows()
    ref = hf_logits(model, ids)
    export_model(model, byte_bpe_tokenizer(), "dense", tmp_path / "dense")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    assert (plain.config.intermediate_size, plain.config.num_hidden_layers) == (64, 1)
    assert rel_err(hf_logits(plain, ids), ref) < 0.01  # measured 0.0022: float tensors stored in bfloat16
    record = export_model(model, byte_bpe_tokenizer(), "gguf-q4_0", tmp_path / "gguf")
    assert record["counts"]["exact"] == 7  # q, k, v, o, gate, up, down of the one block left
    out = llama_cpp_logits(next((tmp_path / "gguf").glob("*.gguf")), ids)
    assert agreement(out, ref) >= 0.98 and rel_err(out, ref) < 0.05  # measured 1.0 and 0.0084
