"""fp8: saturating casts bit-exact against a table-lookup reference, fp8 weights per tensor / channel / 128x128
block against naive loops, activations per token and static, and storage as real float8 tensors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from compress.core.nn import QuantLinear
from compress.core.primitives import cast_fp8, fake_quantize_activation
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.quantizers.rtn import quantize_rtn
from compress.core.scheme import FP8, FP8_BLOCK, FP8_DYNAMIC, FP8_E5M2_DYNAMIC, FP8_W8A16, ActScheme, QuantScheme, scheme
from tests.reference.naive_8bit import fp8_table, naive_cast_fp8, naive_fp8_weight
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cast_matches_round_to_nearest_even_with_saturation(dtype):
    values = [v for v, _ in fp8_table(dtype)]
    midpoints = [(a + b) / 2 for a, b in zip(values, values[1:])]  # every tie
    xs = values + midpoints + [1e6, -1e6, 3e-9, -3e-9, 0.0, -0.0] + (torch.randn(1000) * 60).tolist()
    ours = cast_fp8(torch.tensor(xs), dtype).view(torch.uint8).tolist()
    assert ours == naive_cast_fp8(xs, dtype)


def test_cast_agrees_with_torch_in_range_and_saturates_beyond():
    x = torch.randn(4096) * 100
    inside = x.clamp(-448, 448)
    assert torch.equal(cast_fp8(inside, "fp8_e4m3").view(torch.uint8), inside.to(torch.float8_e4m3fn).view(torch.uint8))
    assert cast_fp8(torch.tensor([1e9, -1e9]), "fp8_e5m2").float().tolist() == [57344.0, -57344.0]
    assert torch.isnan(cast_fp8(torch.tensor([float("nan")]), "fp8_e4m3").float()).all()


@pytest.mark.parametrize("granularity,shape", [("tensor", (48, 80)), ("channel", (33, 80)), ("block", (256, 384))])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_weights_match_naive_reference(dtype, granularity, shape):
    w = torch.randn(*shape) * torch.rand(shape[0], 1) * 3
    sch = scheme(dtype, granularity, 128 if granularity == "block" else None, scale_dtype="float32")
    qt = quantize_rtn(w, sch)
    values, scales = naive_fp8_weight(w, dtype, granularity, 128)
    assert qt.qdata.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype]
    assert torch.equal(qt.qdata.float(), values)
    torch.testing.assert_close(qt.scale.reshape(-1), torch.tensor(scales), rtol=0, atol=0)
    n_scales = {"tensor": 1, "channel": shape[0], "block": (shape[0] // 128) * (shape[1] // 128)}[granularity]
    assert qt.scale.numel() == n_scales
    # dequantize = value * its scale; relative error of e4m3 is at most 2**-4 per element (3 mantissa bits)
    err = (qt.dequantize() - w).abs()
    assert float(err.max()) <= float(w.abs().max()) * 2 ** -3


def test_block_granularity_needs_whole_tiles():
    with pytest.raises(ValueError, match="block"):
        quantize_rtn(torch.randn(100, 256), FP8_BLOCK)
    with pytest.raises(ValueError, match="fp8"):
        QuantScheme("int8", "block", 128)


def test_fp8_scheme_validation():
    with pytest.raises(ValueError, match="symmetric"):
        QuantScheme("fp8_e4m3", "channel", None, symmetric=False)
    with pytest.raises(ValueError, match="per tensor"):
        ActScheme("fp8_e4m3", "token", dynamic=False)
    with pytest.raises(ValueError, match="gptq"):
        QuantizeStage(method="gptq", scheme=FP8_BLOCK)


def test_dynamic_per_token_activations_match_rowwise_reference():
    x = torch.randn(5, 7, 64) * torch.rand(5, 7, 1) * 10
    fq = fake_quantize_activation(x, FP8_DYNAMIC.act)
    for row_in, row_out in zip(x.reshape(-1, 64), fq.reshape(-1, 64)):
        s = float(row_in.abs().max()) / 448
        expect = torch.tensor(naive_cast_fp8((row_in / s).tolist(), "fp8_e4m3"), dtype=torch.int32)
        expect = expect.to(torch.uint8).view(torch.float8_e4m3fn).float() * s
        torch.testing.assert_close(row_out, expect, rtol=1e-6, atol=0)


def test_static_activation_scale_is_calibrated_and_used(tiny_llama):
    from compress.arch import get_arch
    from compress.calibrate.blockwise import BlockPass, run_blockwise
    from compress.calibrate.observers import BlockObserver

    stage = QuantizeStage(scheme=FP8)
    arch = get_arch(tiny_llama)
    plan = plan_quantize(tiny_llama, arch, stage)
    seen = {}

    def observe(_i, _prefix, block):
        return BlockObserver(block, [n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)], [],
                             abs_mean=False, hessian=False, keep_samples=0, abs_max=True)

    def on_block(_i, prefix, block, inputs, observer):
        seen[prefix] = {n: float(st.abs_max.max()) for n, st in observer.stats.items()}
        apply_quantize(tiny_llama, plan, stage, prefix, observer)

    samples = torch.randint(0, 256, (2, 16))
    direct = []  # block 0's down_proj inputs from a plain hook on an untouched float copy (no quantization upstream)
    plain = make_tiny_model("llama")
    hook = plain.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, a, _o: direct.append(float(a[0].abs().max())))
    with torch.no_grad():
        for row in samples:
            plain(row[None])
    hook.remove()
    run_blockwise(tiny_llama, arch, samples, on_block, BlockPass(progress=False, observe=observe))
    layer0 = tiny_llama.model.layers[0].mlp.down_proj
    assert float(layer0.input_scale) == pytest.approx(max(direct) / 448, rel=1e-6)
    layer = tiny_llama.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.input_scale.dim() == 0
    torch.testing.assert_close(float(layer.input_scale), seen["model.layers.1"]["mlp.down_proj"] / 448)
    x = torch.randn(3, 128)
    expect = torch.nn.functional.linear(fake_quantize_activation(x, FP8.act, layer.input_scale),
                                        layer.qtensor().dequantize())
    torch.testing.assert_close(layer(x), expect)


def test_outside_blocks_a_static_scheme_is_a_clear_error(tiny_llama):
    from compress.arch import get_arch

    stage = QuantizeStage(scheme=FP8, ignore=())
    arch = get_arch(tiny_llama)
    tiny_llama.config.tie_word_embeddings = False
    tiny_llama.lm_head.weight = torch.nn.Parameter(tiny_llama.lm_head.weight.detach().clone())
    plan = plan_quantize(tiny_llama, arch, stage)
    with pytest.raises(ValueError, match="calibration inputs"):
        apply_quantize(tiny_llama, plan, stage)


@pytest.mark.parametrize("sch", [FP8_W8A16, FP8_DYNAMIC, FP8_E5M2_DYNAMIC])
def test_fp8_model_saves_real_float8_tensors_and_reloads(tmp_path, tiny_llama, sch):
    from compress.arch import get_arch
    from compress.export.native import load_compressed, save_compressed

    stage = QuantizeStage(scheme=sch)
    apply_quantize(tiny_llama, plan_quantize(tiny_llama, get_arch(tiny_llama), stage), stage)
    ids = torch.randint(0, 256, (1, 12))
    before = tiny_llama(ids).logits
    save_compressed(tiny_llama, None, tmp_path, {}, save_dtype="float32")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.qdata")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.scale")
    assert q.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[sch.dtype]
    assert s.dtype == torch.float32 and q.shape == (64, 64)
    assert json.loads((tmp_path / "compress.json").read_text())["layers"]["model.layers.0.mlp.up_proj"]["act"] == \
        (None if sch.act is None else json.loads(json.dumps(sch.to_dict()))["act"])
    reloaded = load_compressed(tmp_path)
    torch.testing.assert_close(reloaded(ids).logits, before, rtol=0, atol=1e-5)  # eager vs sdpa attention


def test_gptq_on_the_fp8_grid_lowers_the_output_error():
    """GPTQ with fp8 rounding: values stay on the float8 grid, and the layer's output error on the calibration
    inputs drops below round-to-nearest's (GPTQ's own objective)."""
    from compress.quantizers.gptq import quantize_gptq

    torch.manual_seed(0)
    x = torch.randn(512, 96) @ (torch.randn(96, 96) * 0.3 + torch.eye(96))  # correlated inputs
    w = torch.randn(48, 96)
    h = 2 * x.T @ x / x.shape[0]
    rtn, gptq = quantize_rtn(w, FP8_W8A16), quantize_gptq(w, h, FP8_W8A16)
    assert gptq.qdata.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(gptq.scale, rtn.scale, rtol=0, atol=0)  # per-channel scales from the weights
    def err(qt):
        return float((x @ (qt.dequantize() - w).T).pow(2).mean())
    assert err(gptq) < 0.7 * err(rtn)
