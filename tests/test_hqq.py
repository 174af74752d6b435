"""HQQ (method: hqq) against a group-by-group reference, what its solve buys over its own starting point, fractional
zero points through save/load and the CPU kernel, exports that cannot hold them refusing before anything is
written, and the recipe path: no calibration, options validated."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from compress.arch import get_arch
from compress.export import ExportError, check_export, export_model
from compress.export.native import load_compressed, save_compressed
from compress.core.nn import QuantLinear
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.quantizers import QUANTIZERS, get_quantizer, quantize_rtn
from compress.quantizers.hqq import HQQOptions, quantize_hqq
from compress.recipe import RecipeError, load_recipe
from compress.core.scheme import QuantScheme
from tests.conftest import make_tiny_model
from tests.reference.naive_hqq import naive_hqq
from tests.tiny_tokenizer import make_tiny_tokenizer


def fz16(bits: int, group: int | None, fractional: bool = True) -> QuantScheme:
    gran = "group" if group else "channel"
    return QuantScheme(f"int{bits}", gran, group, False, zero_point_dtype="float16" if fractional else "uint8")


def laplace(n: int = 16, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed weights, like a trained layer's: HQQ's l_p (p < 1) error is meant for these."""
    u = torch.rand(n, k, generator=torch.Generator().manual_seed(seed)) - 0.5
    return -0.02 * torch.sign(u) * torch.log1p(-2 * u.abs())  # Laplace(0, 0.02) by inverse CDF


@pytest.mark.parametrize("bits, group, fractional, size", [
    (4, 32, True, 1), (3, 64, True, 1), (2, 64, True, 1), (4, 32, False, 1), (4, None, True, 1),
    # At a trained layer's scale (|w| ~ 0.02) every rounding error is below the shrink threshold
    # (1/beta) |e|^(p-1), which passes only |e| > 0.17 at beta 10, so W_e = 0 and the solve is the closed-form
    # zero point alone; weights 50x larger put errors above it, so the shrink step is checked too.
    (3, 64, True, 50), (2, 32, True, 50)])
def test_hqq_matches_group_by_group_reference(bits, group, fractional, size):
    w = laplace() * size
    qt = quantize_hqq(w, fz16(bits, group, fractional))
    ref, zeros = naive_hqq(w, bits, group or w.shape[1], round_zero=not fractional)
    assert torch.allclose(qt.dequantize().double(), ref, rtol=0, atol=1e-7)
    assert torch.equal(qt.zero_point.double().reshape(zeros.shape), zeros)
    assert qt.zero_point.dtype == (torch.float16 if fractional else torch.uint8)


@pytest.mark.parametrize("bits", [4, 3])
def test_hqq_solve_lowers_the_error_it_minimises(bits):
    """The zero-point solve must beat its own starting point (min/max, the first iterate) and round-to-nearest on
    heavy-tailed weights; a solver that did not move the zero points would tie the first iterate."""
    w = laplace(64, 256, seed=1)
    sch = fz16(bits, 64)
    err = {n: float((w - q.dequantize()).abs().mean()) for n, q in {
        "hqq": quantize_hqq(w, sch), "start": quantize_hqq(w, sch, HQQOptions(iters=1)),
        "rtn": quantize_rtn(w, replace(sch, zero_point_dtype="uint8"))}.items()}
    assert err["hqq"] < 0.97 * err["start"], err
    assert err["hqq"] < 0.97 * err["rtn"], err


def test_hqq_refuses_schemes_it_cannot_produce():
    with pytest.raises(ValueError, match="symmetric: false"):
        QuantizeStage(method="hqq", scheme=QuantScheme("int4", "group", 64, True))
    with pytest.raises(ValueError, match="method: rtn or gptq"):
        QuantizeStage(method="hqq", scheme=QuantScheme("fp8_e4m3", "channel", None, True, "float32"))
    with pytest.raises(ValueError, match="asymmetric integer scheme"):
        QuantScheme("int4", "group", 64, True, zero_point_dtype="float16")
    with pytest.raises(ValueError, match="fractional zero points"):
        QuantizeStage(method="gptq", scheme=fz16(4, 64))


def test_registry_is_the_one_list():
    assert set(QUANTIZERS) == {"rtn", "gptq", "hqq", "autoround", "trellis"}
    assert get_quantizer("hqq").quantize is quantize_hqq and not get_quantizer("hqq").needs_hessian
    assert get_quantizer("gptq").needs_hessian
    assert get_quantizer("autoround").tune_block is not None and not get_quantizer("autoround").needs_hessian
    assert get_quantizer("trellis").needs_hessian and get_quantizer("trellis").code is not None
    with pytest.raises(ValueError, match="known: \\['autoround', 'gptq', 'hqq', 'rtn', 'trellis'\\]"):
        get_quantizer("signround")


def _hqq_model(family: str = "llama", fractional: bool = True):
    model = make_tiny_model(family)
    stage = QuantizeStage(method="hqq", scheme=fz16(4, 32, fractional))
    plan = plan_quantize(model, get_arch(model), stage)
    assert apply_quantize(model, plan, stage) == len(plan.quantized) > 0  # no calibration pass needed
    return model


def test_fractional_zero_points_survive_save_and_load(tmp_path):
    model = _hqq_model()
    layer = next(m for m in model.modules() if isinstance(m, QuantLinear))
    assert layer.zero_point.dtype == torch.float16
    assert not torch.equal(layer.zero_point.float(), layer.zero_point.float().round())  # really fractional
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before = model(x).logits
    save_compressed(model, make_tiny_tokenizer(), tmp_path / "m", {}, save_dtype="float32")
    again = load_compressed(tmp_path / "m")
    reloaded = next(m for m in again.modules() if isinstance(m, QuantLinear))
    assert reloaded.scheme == layer.scheme and reloaded.zero_point.dtype == torch.float16
    assert torch.equal(reloaded.zero_point, layer.zero_point)
    again.set_attn_implementation("eager")  # from_config picks sdpa; the tiny models run eager
    with torch.no_grad():
        assert torch.equal(again(x).logits, before)


def test_cpu_int4_kernel_takes_fractional_zero_points():
    from compress.kernels.cpu import int4pack_reason, linear_int4pack, prepare_int4pack
    w = laplace(32, 128, seed=2)
    qt = quantize_hqq(w, fz16(4, 32))
    if int4pack_reason(qt, torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch's CPU int4 kernel is not available in this build")
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    y = linear_int4pack(prepare_int4pack(qt, torch.bfloat16), x, None).float()
    ref = x.float() @ qt.dequantize().t()
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_exports_that_store_integer_zero_points_refuse_fractional_ones(fmt, tmp_path):
    model = _hqq_model()
    with pytest.raises(ExportError, match="fractional|zero_point_dtype"):
        export_model(model, make_tiny_tokenizer(), fmt, tmp_path / fmt)
    assert not (tmp_path / fmt).exists()


def test_gguf_keeps_fractional_zero_points_only_in_q4_1():
    """Q4_1 stores w = d * n + m with a float minimum, so m = -z * d holds a fractional z; Q8_0 has no minimum and
    requantizes such a layer from its float weights (reported per tensor)."""
    from compress.export.gguf_encode import exact_fit
    qt = quantize_hqq(laplace(8, 64), fz16(4, 32))
    assert exact_fit(qt, "q4_1") is None
    assert "Q4_1" in exact_fit(qt, "q8_0")


def test_rounded_hqq_exports_and_dense_takes_fractional(tmp_path):
    check_export(_hqq_model(fractional=False), "compressed-tensors")  # uint8 zero points: the usual layout
    check_export(_hqq_model(fractional=False), "awq")
    export_model(_hqq_model(), make_tiny_tokenizer(), "dense", tmp_path / "dense")


def test_recipe_hqq_needs_no_calibration_and_checks_its_options(tmp_path):
    path = tmp_path / "hqq.yaml"
    path.write_text("model: default\nstages:\n  - stage: quantize\n    method: hqq\n"
                    "    scheme: {dtype: int4, group_size: 64, symmetric: false, zero_point_dtype: float16}\n"
                    "    options: {iters: 10}\n")
    stage = load_recipe(path).stages[0]
    assert stage.options == HQQOptions(iters=10) and not stage.needs_calibration
    with pytest.raises(RecipeError, match="unknown option `act_order` for method hqq"):
        load_recipe(path, ["stages.0.options.act_order=false"])
    with pytest.raises(RecipeError, match="iters must be >= 1"):
        load_recipe(path, ["stages.0.options.iters=0"])
    with pytest.raises(RecipeError, match="must be float"):
        load_recipe(path, ["stages.0.options.lp_norm=high"])
    assert load_recipe("recipes/gptq_int4.yaml", ["stages.0.options.act_order=false"]).stages[0].options.act_order \
        is False
