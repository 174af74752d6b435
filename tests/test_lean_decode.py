"""The lean decode path reproduces transformers' logits on each family it accepts, across cache appends and crops,
refuses the rest with the reason, and keeps speculative decoding exact."""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config)

from compress.measure.speculation import int4_copy
from compress.serving.lean_decode import LeanStream, lean_problem
from compress.serving.speculative import generate_plain, generate_speculative, make_stream

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def tiny(config_cls, **kw):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**{**SMALL, **kw}), attn_implementation="sdpa").eval()


FAMILIES = {"llama": (LlamaConfig, {}), "qwen2": (Qwen2Config, {}),  # Qwen2: q/k/v biases
            "mistral": (MistralConfig, {"sliding_window": None}),
            "llama-mha-rope-scaled": (LlamaConfig, {"num_key_value_heads": 4,
                                                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}})}


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_logits_equal_transformers_across_appends_and_crops(family):
    cls, kw = FAMILIES[family]
    model = tiny(cls, **kw)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits[0]
    s = LeanStream(model, max_len=64)
    a = s.forward(ids[0, :17].tolist())  # a prefill
    b = s.forward(ids[0, 17:18].tolist())  # one decode step
    c = s.forward(ids[0, 18:25].tolist())  # a verify step of 7 tokens ...
    s.crop(21)  # ... of which 3 were accepted
    d = s.forward(ids[0, 21:].tolist())
    got = torch.cat([a, b, c[:3], d])
    assert s.length == 40
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    s.crop(10)
    torch.testing.assert_close(s.forward(ids[0, 10:12].tolist(), logits="last"), ref[11:12], rtol=1e-4, atol=1e-4)
    assert s.forward([3], logits="none") is None


def test_refuses_what_it_does_not_reproduce():
    assert "gemma" in lean_problem(tiny(GemmaConfig, head_dim=16), 64)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=320))
    assert "gpt2" in lean_problem(gpt2, 64)
    windowed = tiny(MistralConfig, sliding_window=32)
    assert "sliding" in lean_problem(windowed, 64) and lean_problem(windowed, 32) is None
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanStream(gpt2)
    s = LeanStream(tiny(LlamaConfig), max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        s.forward(list(range(9)))
    with pytest.raises(ValueError, match=">= 0"):
        s.crop(-1)
    s.crop(3)  # past the end: nothing to forget
    assert s.length == 0
    # the speculative loop falls back to transformers for a family the lean path refuses
    assert type(make_stream(gpt2, 64)).__name__ == "_Stream"
    assert isinstance(make_stream(tiny(LlamaConfig), 64), LeanStream)


@torch.no_grad()
def test_speculative_greedy_on_the_lean_path_equals_plain_decoding():
    target = tiny(LlamaConfig, num_hidden_layers=4, initializer_range=0.2)  # varied outputs, not a 2-token loop
    draft, _ = int4_copy(target, dtype=torch.float32)
    prompt = list(range(5, 30))
    plain = generate_plain(target, prompt, 24, runtime="transformers").tokens
    assert generate_plain(target, prompt, 24, runtime="lean").tokens == plain
    for k in (1, 3, 5):
        got = generate_speculative(target, draft, prompt, 24, k=k, runtime="lean")
        assert got.tokens == plain
        assert got.runtime == "lean"
    with pytest.raises(ValueError, match="runtime"):
        generate_plain(target, prompt, 4, runtime="fast")


@pytest.mark.parametrize("quantized", [False, True])
@torch.no_grad()
def test_fused_projections_compute_what_the_separate_ones_did(quantized):
    """q/k/v and gate/up fused into one linear each: the same logits on the lean path (3 matmuls a block) and through
    transformers' forward (the Slices), float or int4 (Qwen2: q/k/v biases)."""
    from compress.serving.lean_decode import Slice, fuse_projections

    model = tiny(Qwen2Config, hidden_size=128, intermediate_size=256, initializer_range=0.2)
    if quantized:
        model, _ = int4_copy(model, dtype=torch.float32, fuse=False)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits[0]
    assert fuse_projections(model) == []
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, Slice) and attn.qkv_proj.out_features == 128 + 2 * 64
    torch.testing.assert_close(model(ids).logits[0], ref, rtol=1e-4, atol=1e-4)
    s = LeanStream(model, 16)
    torch.testing.assert_close(torch.cat([s.forward(ids[0, :5].tolist()), s.forward(ids[0, 5:].tolist())]), ref,
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="lean decode path"):
        fuse_projections(AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=320)))
