"""The int8 / int4 KIVI KV cache: key chunks and value groups against loop references, attention over the cache
against a per-query reference that builds each query's cache as a serving engine holds it, one forward equal to
token-by-token decoding from the cache, on real tiny models, and through a recipe."""
from __future__ import annotations

import pytest
import torch

from compress.kv.cache import attach_kv_quant, restore_attention, use_kv_attention
from compress.kv.kivi import KVQuant, kivi_attention, quantize_keys, quantize_values
from tests.conftest import make_tiny_model, run_tiny_recipe


def _ref_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """One range over all of x: asymmetric min/max round to nearest."""
    lo, hi = float(x.min()), float(x.max())
    scale = max((hi - lo) / (2 ** bits - 1), 1e-8)
    return torch.round((x - lo) / scale).clamp(0, 2 ** bits - 1) * scale + lo


def test_format_is_validated():
    with pytest.raises(ValueError, match="use 8 or 4"):
        KVQuant(bits=2)
    with pytest.raises(ValueError, match="positive"):
        KVQuant(group=0)
    with pytest.raises(ValueError, match="residual"):
        KVQuant(residual=-1)
    assert KVQuant(4, 32).bytes_per_element() == 0.5 + 4 / 32 and KVQuant(8, 64).bytes_per_element() == 1 + 1 / 16


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_per_channel_over_chunks_and_values_per_token_over_groups(bits):
    kv = KVQuant(bits, group=4)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64) * torch.linspace(0.1, 5, 8, dtype=torch.float64)
    got_k, got_v = quantize_keys(k, kv), quantize_values(k, kv)
    want_k, want_v = torch.empty_like(k), torch.empty_like(k)
    for h in range(2):
        for c0 in range(0, 10, 4):  # chunks of 4 tokens (the last has 2), each channel its own range
            for d in range(8):
                want_k[0, h, c0:c0 + 4, d] = _ref_fake_quant(k[0, h, c0:c0 + 4, d], bits)
        for t in range(10):  # each token, groups of 4 channels
            for g0 in (0, 4):
                want_v[0, h, t, g0:g0 + 4] = _ref_fake_quant(k[0, h, t, g0:g0 + 4], bits)
    assert torch.allclose(got_k, want_k, atol=1e-12) and torch.allclose(got_v, want_v, atol=1e-12)
    err = (got_k - k).abs().max() / (k.abs().max())
    assert 0 < err < (0.01 if bits == 8 else 0.2)
    with pytest.raises(ValueError, match="does not divide the head dimension"):
        quantize_values(k, KVQuant(bits, group=3))


class _Attn(torch.nn.Module):
    pass


def _reference_attention(q, k, v, kv: KVQuant, scaling):
    """Per query i: the cache a KIVI engine holds then (full chunks quantized once flushed out of the residual
    window, the rest float) and plain causal softmax attention over it."""
    B, Hq, T, D = q.shape
    S, n_rep = k.shape[2], q.shape[1] // k.shape[1]
    kq, vq = quantize_keys(k, kv), quantize_values(v, kv)
    out = torch.zeros(B, T, Hq, D, dtype=q.dtype)
    for t in range(T):
        i = S - T + t  # the query's position
        flushed = max(0, (i - kv.residual + 1) // kv.group * kv.group)  # tokens in chunks that left the window
        keys = torch.cat([kq[:, :, :flushed], k[:, :, flushed:i + 1]], 2).repeat_interleave(n_rep, 1)
        vals = torch.cat([vq[:, :, :flushed], v[:, :, flushed:i + 1]], 2).repeat_interleave(n_rep, 1)
        p = torch.softmax(q[:, :, t:t + 1] @ keys.transpose(-1, -2) * scaling, -1)
        out[:, t] = (p @ vals)[:, :, 0]
    return out


@pytest.mark.parametrize("kv", [KVQuant(4, 4, 0), KVQuant(4, 4, 6), KVQuant(8, 4, 5), KVQuant(4, 8, 3)],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("T", [23, 1])  # a prefill of the whole cache; one decode step over it
def test_attention_matches_the_per_query_cache(kv, T):
    g = torch.Generator().manual_seed(0)
    S, D = 23, 8
    q = torch.randn(1, 4, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, S, D, generator=g, dtype=torch.float64) * 3
    v = torch.randn(1, 2, S, D, generator=g, dtype=torch.float64)
    got, _ = kivi_attention(_Attn(), q, k, v, None, kv, scaling=0.3)
    want = _reference_attention(q, k, v, kv, 0.3)
    assert torch.allclose(got, want, atol=1e-10)
    # and a residual window covering everything is plain attention
    plain, _ = kivi_attention(_Attn(), q, k, v, None, KVQuant(kv.bits, kv.group, S + kv.group), scaling=0.3)
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=causal, scale=0.3).transpose(1, 2)
    assert torch.allclose(plain, ref, atol=1e-10)
    assert (T == 1 and kv.residual >= S) or not torch.allclose(got, plain, atol=1e-6)


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits.double()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3", "opt", "gpt_neox"])
def test_on_models_int8_is_closer_than_int4_and_a_forward_equals_decoding(family):
    from transformers import DynamicCache

    model = make_tiny_model(family).double()
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    use_kv_attention(model)
    errs = {}
    for bits in (8, 4):
        attach_kv_quant(model, KVQuant(bits, group=8, residual=8))
        got = _logits(model, ids)
        errs[bits] = float((got - ref).abs().max())
        # the last token's logits from one forward = prefill of 39 tokens, then one decode step over the cache
        cache = DynamicCache(config=model.config)
        _logits(model, ids[:, :-1], cache=cache, use_cache=True)
        step = _logits(model, ids[:, -1:], cache=cache, use_cache=True)
        assert torch.allclose(step[0, -1], got[0, -1], atol=1e-9)
    assert 0 < errs[8] < errs[4]
    attach_kv_quant(model, KVQuant(4, group=8, residual=64))  # the window holds all 40 tokens: exact (up to the
    assert torch.allclose(_logits(model, ids), ref, atol=1e-6)  # eager reference's float32 softmax)
    restore_attention(model)


def test_a_recipe_stage_applies_it_and_the_checkpoint_keeps_it(tmp_path):
    import json

    from compress.export import ExportError, check_export
    from compress.export.native import load_compressed
    from compress.stages.kv_cache import KVCacheStage

    out = run_tiny_recipe(tmp_path, [{"stage": "kv_cache", "dtype": "int4", "group": 16, "residual": 16}],
                          {"perplexity": False, "speed": False, "samples": 0})
    report = json.loads((out / "report.json").read_text())
    section = next(s for s in report["stages"] if s["stage"] == "kv_cache")
    assert section["format"] == "int4-kivi-g16-r16" and len(section["layers"]) == 2
    model = load_compressed(tmp_path / "out")
    assert model.model.layers[1].self_attn.kv_quant == KVQuant(4, 16, 16)
    # the reloaded model attends over the cache: its logits are those of its own weights under the emulation, and
    # not those without it
    import copy
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if hasattr(m, "kv_quant"):
            del m.kv_quant
    restore_attention(plain)
    emulated = copy.deepcopy(plain)
    use_kv_attention(emulated)
    attach_kv_quant(emulated, KVQuant(4, 16, 16))
    assert torch.allclose(_logits(model, ids), _logits(emulated, ids), atol=1e-6)
    assert not torch.allclose(_logits(model, ids), _logits(plain, ids), atol=1e-4)
    with pytest.raises(ExportError, match="KV cache"):
        check_export(model, "compressed-tensors")
    with pytest.raises(ValueError, match="int8 or int4 only"):
        KVCacheStage(dtype="fp8_e4m3", group=16)
