"""fp8 KV cache: the attention wrapper is exact without scales on every family, the recorded maxima are those
of the keys (after the rotary embedding) and values attention reads, the scales change the output the way
fp8 rounding should, and they survive save/load."""
from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from compress.arch import get_arch
from compress.kv.cache import fake_quantize_kv, recording_kv, restore_attention, set_kv_scales, use_kv_attention
from compress.core.primitives import cast_fp8
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import FP8_DYNAMIC
from tests.conftest import TINY_CONFIGS, make_tiny_model

_CAPTURED: list = []


def _capture(module, query, key, value, attention_mask, **kwargs):
    _CAPTURED.append((module, key.detach().clone(), value.detach().clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("test_capture_kv", _capture)


def _record(model, ids):
    arch = get_arch(model)
    out = {}
    with contextlib.ExitStack() as stack:
        for i, block in enumerate(arch.block_list(model)):
            records = stack.enter_context(recording_kv(block, {}))
            out.update({f"{arch.blocks}.{i}.{n}": r for n, r in records.items()})
        with torch.no_grad():
            model(ids)
    return {n: list(r) for n, r in out.items()}


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_wrapper_without_scales_changes_nothing(family):
    model = make_tiny_model(family)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        before = model(ids).logits
        use_kv_attention(model)
        after = model(ids).logits
    assert model.config._attn_implementation.startswith("compress_kv_")
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    restore_attention(model)
    assert model.config._attn_implementation == "eager"


def test_recorded_maxima_are_those_of_the_post_rotary_keys_and_values():
    model = make_tiny_model("llama")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 256, (2, 16))
    _CAPTURED.clear()
    model.set_attn_implementation("test_capture_kv")
    with torch.no_grad():
        model(ids)
    expect = {id(m): (float(k.abs().max()), float(v.abs().max())) for m, k, v in _CAPTURED}
    model.set_attn_implementation("sdpa")
    use_kv_attention(model)
    recorded = _record(model, ids)
    for name, (k, v) in recorded.items():
        assert (k, v) == pytest.approx(expect[id(model.get_submodule(name))], rel=1e-6)


def test_kv_fake_quantization_is_fp8_rounding_with_the_layer_scale():
    t = torch.randn(2, 4, 16, 8) * 3
    scale = torch.tensor(float(t.abs().max()) / 448)
    q = fake_quantize_kv(t, scale, "fp8_e4m3")
    torch.testing.assert_close(q, cast_fp8(t / scale, "fp8_e4m3").float() * scale)
    assert (q - t).abs().max() <= t.abs().max() * 2 ** -4 + 1e-6  # e4m3: 3 mantissa bits
    torch.testing.assert_close(fake_quantize_kv(q, scale, "fp8_e4m3"), q)  # cached entries re-quantize to themselves


def test_scales_are_applied_in_the_forward():
    model = make_tiny_model("llama")
    with torch.no_grad():  # sharper attention than a random init's near-uniform one, so the keys matter too
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    use_kv_attention(model)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        before = model(ids).logits
    recorded = _record(model, ids)
    for name, (k, v) in recorded.items():
        set_kv_scales(model.get_submodule(name), k, v, "fp8_e4m3")
    with torch.no_grad():
        calibrated = model(ids).logits
    err = (calibrated - before).abs().max()
    assert 0 < err < 0.05 * before.abs().max()
    # keys and values are each quantized with their own scale: one of them 100x too small (everything of it
    # saturates, the other calibrated) must wreck the output on its own
    for k_div, v_div in ((100, 1), (1, 100)):
        for name, (k, v) in recorded.items():
            set_kv_scales(model.get_submodule(name), k / k_div, v / v_div, "fp8_e4m3")
        with torch.no_grad():
            saturated = model(ids).logits
        assert (saturated - before).abs().max() > 5 * err, (k_div, v_div)


def test_kv_run_saves_scales_and_reloads_them(tmp_path):
    from compress.export.native import load_compressed, save_compressed

    model = make_tiny_model("llama")
    stage = QuantizeStage(scheme=FP8_DYNAMIC)
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    use_kv_attention(model)
    ids = torch.randint(0, 256, (1, 16))
    for name, (k, v) in _record(model, ids).items():
        set_kv_scales(model.get_submodule(name), k, v, "fp8_e4m3")
    with torch.no_grad():
        before = model(ids).logits
    save_compressed(model, None, tmp_path, {}, save_dtype="float32")
    reloaded = load_compressed(tmp_path)
    assert float(reloaded.model.layers[1].self_attn.k_scale) == float(model.model.layers[1].self_attn.k_scale)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, before, rtol=0, atol=1e-5)  # eager vs sdpa attention


# ---------------------------------------------------------------- NVFP4 KV cache (issue 21)

def test_nvfp4_kv_is_blockwise_e2m1_under_the_layer_tensor_scale():
    from compress.core import microscale as mx

    torch.manual_seed(0)
    t = torch.randn(2, 4, 16, 32) * torch.logspace(-1, 1, 32)  # [B, H, S, D]
    scale = torch.tensor(float(t.abs().max()) / (448 * 6))  # k_scale as set_kv_scales sets it
    q = fake_quantize_kv(t, scale, "nvfp4")
    blocks = t.reshape(2, 4, 16, 2, 16)  # each token's vector in two blocks of 16 channels
    g = 1 / scale
    s = mx.round_e4m3(blocks.abs().amax(-1, keepdim=True) / 6 * g).clamp(min=2.0 ** -9) / g
    torch.testing.assert_close(q, (mx.round_e2m1(blocks / s) * s).reshape(t.shape), rtol=0, atol=0)
    torch.testing.assert_close(fake_quantize_kv(q, scale, "nvfp4"), q)  # cached entries re-quantize to themselves
    with pytest.raises(ValueError, match="divisible by 16"):
        fake_quantize_kv(torch.randn(1, 1, 4, 24), scale, "nvfp4")


def test_nvfp4_kv_run_applies_saves_reloads_and_exports_refuse(tmp_path):
    from compress.export import ExportError, export_model
    from compress.export.native import load_compressed, save_compressed
    from compress.stages.kv_cache import KVCacheStage

    model = make_tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    stage = QuantizeStage(scheme=FP8_DYNAMIC)
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    use_kv_attention(model)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        plain = model(ids).logits
    recorded = _record(model, ids)
    for dtype in ("fp8_e4m3", "nvfp4"):
        for name, (k, v) in recorded.items():
            set_kv_scales(model.get_submodule(name), k, v, dtype)
        with torch.no_grad():
            out = model(ids).logits
        err = float((out - plain).abs().max())
        if dtype == "fp8_e4m3":
            fp8_err = err
    assert err > fp8_err > 0  # 4-bit values cost more than 8-bit ones, and the wrapper applied both
    assert float(model.model.layers[0].self_attn.k_scale) == pytest.approx(recorded["model.layers.0.self_attn"][0] / 2688)
    save_compressed(model, None, tmp_path / "run", {}, save_dtype="float32")
    reloaded = load_compressed(tmp_path / "run")
    assert reloaded.model.layers[1].self_attn.kv_cache_dtype == "nvfp4"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, out, rtol=0, atol=1e-5)
    with pytest.raises(ExportError, match="KV cache nvfp4"):
        export_model(model, None, "compressed-tensors", tmp_path / "ct")
    assert KVCacheStage(dtype="nvfp4").needs_calibration
    with pytest.raises(ValueError, match="nvfp4"):
        KVCacheStage(dtype="fp4")
