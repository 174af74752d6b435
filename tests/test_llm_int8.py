"""LLM.int8() and int8 W8A8: the decomposition against a naive float64 reference, the int8 matmul against
the float oracle, static outlier features from calibration, and agreement with bitsandbytes (which runs
on CPU here) on the same weights and on whole models."""
from __future__ import annotations

import copy

import pytest
import torch

from compress.arch import get_arch
from compress.core.reference import linear_bitsandbytes, linear_llm_int8, linear_w8a8_int8, outlier_columns
from compress.core.nn import QuantLinear
from compress.transforms.outliers import PlantSpec, plant_outliers
from compress.core.primitives import activation_qparams, fake_quantize_activation, quantize_activation
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.quantizers.rtn import quantize_rtn
from compress.core.scheme import (LLM_INT8, LLM_INT8_BNB, LLM_INT8_STATIC, W8A8, W8A8_ASYM, W8A8_STATIC, ActScheme,
                             QuantScheme)
from tests.conftest import make_tiny_model
from tests.reference.naive_8bit import naive_int8_per_token, naive_llm_int8

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the [test] extra")


def _x_with_outliers(m=24, k=96, cols=(3, 50, 77), magnitude=20.0):
    x = torch.randn(m, k)
    x[:, list(cols)] *= magnitude
    return x


def test_per_token_int8_codes_match_rowwise_reference():
    x = torch.randn(9, 40) * torch.rand(9, 1) * 5
    scale, zero = activation_qparams(x, W8A8.act)
    codes = quantize_activation(x, W8A8.act, scale)
    ref_codes, ref_scales = naive_int8_per_token(x)
    assert zero is None and torch.equal(codes.long(), ref_codes)
    torch.testing.assert_close(scale.reshape(-1), ref_scales, rtol=1e-7, atol=0)


def test_zero_point_activations_use_the_full_unsigned_range():
    x = torch.rand(6, 32) * 4 + 1  # all positive: absmax wastes half the grid, zero-point does not
    asym = fake_quantize_activation(x, W8A8_ASYM.act)
    sym = fake_quantize_activation(x, W8A8.act)
    assert (asym - x).abs().max() <= (x.amax(dim=1) - 0).max() / 255 / 2 + 1e-6
    assert (asym - x).pow(2).mean() < (sym - x).pow(2).mean()


@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_int8_matmul_equals_the_fake_quantized_oracle(m):
    lin = torch.nn.Linear(96, 72)
    qt = quantize_rtn(lin.weight.detach(), W8A8)
    x = torch.randn(m, 96)
    ours = linear_w8a8_int8(x, qt.qdata, qt.scale, W8A8.act, None, lin.bias)
    oracle = torch.nn.functional.linear(fake_quantize_activation(x, W8A8.act), qt.dequantize(), lin.bias)
    torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=1e-5)  # int32 vs float32 accumulation order


@pytest.mark.parametrize("m", [1, 5, 24])
def test_llm_int8_matches_naive_decomposition(m):
    x = _x_with_outliers(m)
    w = torch.randn(72, 96) * 0.1
    qt = quantize_rtn(w, LLM_INT8)
    ours, n = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None)
    ref = naive_llm_int8(x, w, 6.0)
    assert n == len(outlier_columns(x, 6.0)) >= 3
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


def test_int_mm_and_float_routes_of_llm_int8_agree():
    x, w = _x_with_outliers(), torch.randn(64, 96)
    qt = quantize_rtn(w, LLM_INT8)
    a, _ = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None, use_int_mm=True)
    b, _ = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None, use_int_mm=False)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_outlier_split_beats_plain_int8_on_outlier_inputs():
    x, w = _x_with_outliers(magnitude=40.0), torch.randn(64, 96) * 0.05
    exact = x @ w.T
    qt = quantize_rtn(w, LLM_INT8)
    mixed, _ = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None)
    plain = linear_w8a8_int8(x, qt.qdata, qt.scale, W8A8.act, None, None)
    assert (mixed - exact).pow(2).mean() * 10 < (plain - exact).pow(2).mean()


def test_static_columns_come_from_calibration_and_stay_fixed():
    x = _x_with_outliers(cols=(5, 9))
    qt = quantize_rtn(torch.randn(32, 96), LLM_INT8_STATIC)
    y_static, n = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, torch.tensor([5, 9]), None)
    y_dynamic, n_dyn = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None)
    assert n == 2
    if n_dyn == 2:  # the dynamic rule found exactly the same columns
        torch.testing.assert_close(y_static, y_dynamic)
    quiet = torch.randn(4, 96) * 0.1  # nothing crosses the threshold: static still splits columns 5 and 9
    _, n_quiet = linear_llm_int8(quiet, qt.qdata, qt.scale, 6.0, torch.tensor([5, 9]), None)
    assert n_quiet == 2 and len(outlier_columns(quiet, 6.0)) == 0


def test_bitsandbytes_and_ours_agree_on_the_same_int8_weights():
    """Whole-column outliers: then bitsandbytes' row absmax (outlier elements zeroed) equals ours (outlier
    columns zeroed), and the two differ only by bitsandbytes quantizing activations from float16."""
    x = torch.randn(40, 96).clamp(-5.5, 5.5)
    x[:, [7, 61]] = torch.sign(torch.randn(40, 2)) * (10 + 20 * torch.rand(40, 2))
    w = torch.randn(80, 96) * 0.1
    qt = quantize_rtn(w, LLM_INT8)
    ours, _ = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None)
    theirs = linear_bitsandbytes(x, qt.qdata, qt.scale, 6.0, None).float()
    exact = x @ w.T
    assert float((ours - theirs).pow(2).mean()) < 0.05 * float((ours - exact).pow(2).mean())


def test_bitsandbytes_rule_reproduces_bitsandbytes_on_any_input():
    """With outlier_scaling='exclude_elements' the row scale is bitsandbytes' (sub-threshold values of outlier
    columns count, float16 inputs): the outputs then match up to an occasional one-code flip."""
    x = torch.randn(64, 96)
    x[:, 5] *= 4
    x[3, 5] = 9.0  # column 5 is an outlier column because of one element; its other values stay in the row scale
    x[:, 40] *= 20
    w = torch.randn(80, 96) * 0.1
    qt = quantize_rtn(w, LLM_INT8_BNB)
    ours, n = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None, scaling="exclude_elements")
    theirs = linear_bitsandbytes(x, qt.qdata, qt.scale, 6.0, None).float()
    paper, _ = linear_llm_int8(x, qt.qdata, qt.scale, 6.0, None, None)
    exact = x @ w.T
    assert n == 2
    assert float((ours - theirs).pow(2).mean()) < 0.01 * float((theirs - exact).pow(2).mean())
    assert float((paper - exact).pow(2).mean()) < float((theirs - exact).pow(2).mean())  # the paper's row scale


def test_bitsandbytes_whole_model_agrees_with_ours_on_a_planted_model():
    from tests.reference.bnb_llm_int8 import to_bitsandbytes_int8

    model = make_tiny_model("llama")
    arch = get_arch(model)
    plant_outliers(model, arch, PlantSpec(channels=3, factor=30.0))
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ref = model(ids).logits.log_softmax(-1)
        variants = {}
        for name, sch in (("ours", LLM_INT8), ("ours-bnb-rule", LLM_INT8_BNB), ("absmax", W8A8)):
            m = copy.deepcopy(model)
            stage = QuantizeStage(scheme=sch)
            apply_quantize(m, plan_quantize(m, arch, stage), stage)
            variants[name] = m(ids).logits.log_softmax(-1)
        theirs = copy.deepcopy(model)
        to_bitsandbytes_int8(theirs, arch.blocks, 6.0)
        variants["bnb"] = theirs(ids).logits.log_softmax(-1)

    def kl(p):
        return float((ref.exp() * (ref - p)).sum(-1).mean())

    assert kl(variants["ours"]) < kl(variants["absmax"]) / 5
    assert kl(variants["bnb"]) < kl(variants["absmax"]) / 5
    assert abs(kl(variants["ours"]) - kl(variants["bnb"])) < 0.5 * max(kl(variants["ours"]), kl(variants["bnb"]))
    assert abs(kl(variants["ours-bnb-rule"]) - kl(variants["bnb"])) < 0.05 * kl(variants["bnb"])


def test_dynamic_layers_log_outlier_counts():
    layer = QuantLinear.from_module(torch.nn.Linear(96, 32), quantize_rtn(torch.randn(32, 96), LLM_INT8))
    layer(_x_with_outliers(cols=(1, 2, 3, 4)))
    layer(torch.randn(5, 96) * 0.1)
    assert layer.outlier_counts == {"forwards": 2, "total": 4, "max": 4} and "llm.int8" in layer.kernel


def test_llm_int8_scheme_rules():
    with pytest.raises(ValueError, match="per-channel"):
        QuantScheme("int8", "group", 32, True, act=ActScheme(outlier_threshold=6.0))
    with pytest.raises(ValueError, match="> 0"):
        ActScheme(outlier_threshold=0.0)
    with pytest.raises(ValueError, match="symmetric"):
        ActScheme("int8", "tensor", dynamic=False, symmetric=False)
    assert W8A8_STATIC.act.granularity == "tensor" and not W8A8_STATIC.act.dynamic
    with pytest.raises(ValueError, match="exclude_columns"):
        ActScheme(outlier_threshold=6.0, outlier_scaling="rows")
    assert LLM_INT8_BNB.name.endswith("-bnb") and not LLM_INT8.name.endswith("-bnb")
