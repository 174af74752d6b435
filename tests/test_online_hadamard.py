"""The online Hadamard on the MLP down projection's input (rotate.online_hadamard; QuaRot's online Hadamard,
SpinQuant's R4): the fast transform against a dense matrix, the float function unchanged with it, the rotation
surviving quantization and a save/load round trip, and the refusals (exports, AWQ pairs, pruning)."""
from __future__ import annotations

import pytest
import torch
import yaml

from compress.arch import get_arch, get_module
from compress.arch.tables import FAMILIES
from compress.export import ExportError, check_export
from compress.transforms.rotation import (OnlineHadamard, hadamard, hadamard_factors, online_rotations, rotate_mlp_inputs,
                               rotate_model)
from compress.transforms.smoothing import pair_skip_reason

from .conftest import TINY_CONFIGS, make_tiny_model

ROTATABLE = sorted(f for f in TINY_CONFIGS if not isinstance(FAMILIES[f]["rotate"], str))


def dense_q(rot: OnlineHadamard) -> torch.Tensor:
    """The reference: the n × n matrix H·diag(signs)/√k, H = hadamard(n) (k = n), or block-diagonal copies of a
    Sylvester matrix of order k when no Hadamard matrix of order n can be built."""
    n = rot.n
    h = hadamard(n)
    if h is None:
        block = hadamard(hadamard_factors(n)[0][1].shape[0])
        h = torch.block_diag(*[block] * (n // block.shape[0]))
    k = int((h[0] != 0).sum())
    return h * rot.signs.double()[None, :] / k ** 0.5


@pytest.mark.parametrize("n", [8, 92, 96, 576, 1536])
def test_the_fast_transform_equals_the_dense_matrix(n):
    rot = OnlineHadamard(n, seed=5).double()
    x = torch.randn(2, 3, n, dtype=torch.float64)
    q = dense_q(rot)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)  # orthogonal
    assert float((rot(x) - x @ q).abs().max()) < 1e-12
    assert ("block-diagonal" in rot.what) == (n == 92)  # 92 = 4 · 23: no construction here, blocks of 4
    bf16 = OnlineHadamard(n, seed=5)(x.to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16  # computed in float32, returned in the input's dtype


@pytest.mark.parametrize("family", ROTATABLE)
def test_the_float_function_is_unchanged_with_the_online_hadamard(family):
    model = make_tiny_model(family).double()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    arch = get_arch(model)
    rotate_model(model, arch, seed=0)
    name = arch.blocks + ".0.mlp.down_proj"
    folded_residual = model.get_submodule(name).weight.clone()
    info = rotate_mlp_inputs(model, arch, seed=0)
    assert sorted(online_rotations(model)) == [f"{arch.blocks}.{i}.mlp.down_proj" for i in range(2)]
    assert not torch.equal(model.get_submodule(name).weight, folded_residual)  # the fold changed the weight
    assert info["online_order"] == 128 and "Sylvester 128" in info["online_transform"]
    with torch.no_grad():
        after = model(ids).logits
    assert float((after - before).abs().max()) < 1e-5 * float(before.abs().max())
    # the check can fail: the folded weights without the run-time rotation compute something else
    for m in online_rotations(model):
        model.get_submodule(m)._forward_pre_hooks.clear()
    with torch.no_grad():
        assert float((model(ids).logits - before).abs().max()) > 1e-2 * float(before.abs().max())


def test_hooks_and_observers_see_the_rotated_input():
    """The rotation runs before any hook registered later (the calibration observers and GPTQ's Hessian read the
    input a forward hook sees, which must be the rotated one)."""
    model = make_tiny_model("llama")
    arch = get_arch(model)
    rotate_mlp_inputs(model, arch)
    mlp = get_module(arch.block_list(model)[0], "mlp")
    seen = {}
    mlp.down_proj.register_forward_pre_hook(lambda _m, a: seen.__setitem__("pre", a[0]))
    mlp.down_proj.register_forward_hook(lambda _m, a, _o: seen.__setitem__("post", a[0]))
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        mlp(x)
        raw = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    want = mlp.down_proj.input_rotation(raw)
    assert torch.allclose(seen["pre"], want, atol=1e-6) and torch.allclose(seen["post"], want, atol=1e-6)
    assert not torch.allclose(want, raw, atol=1e-2)


def _rotated_and_quantized(method: str, tmp_path=None):
    from compress.calibrate.blockwise import BlockPass, run_blockwise
    from compress.pipeline.model_stages import run_model_stages
    from compress.pipeline.options import RunOptions
    from compress.recipe import from_dict
    from compress.pipeline.calibration import StagePass, start_stages
    from compress.stages.base import make_plan

    model = make_tiny_model("llama")
    arch = get_arch(model)
    recipe = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 4, "seq_len": 16},
                        "stages": [{"stage": "rotate", "online_hadamard": True},
                                   {"stage": "quantize", "method": method,
                                    "scheme": {"dtype": "int4", "group_size": 16, "symmetric": False}}]})
    ids = torch.randint(0, 256, (4, 16))
    with torch.no_grad():
        before = model(ids).logits
    reports, _, _ = run_model_stages(model, None, arch, RunOptions(recipe, None, progress=False, log=lambda *_: None))
    plan = make_plan(model, arch, recipe.stages, model_stages_done=True)
    stage_pass = StagePass(start_stages(model, plan))
    run_blockwise(model, arch, ids, stage_pass.on_block, BlockPass(observe=stage_pass.observe, progress=False))
    return model, ids, before, reports[0]


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_layers_keep_the_rotation(method):
    from compress.core.nn import QuantLinear
    from compress.stages.rotate import RotateStage

    model, ids, before, report = _rotated_and_quantized(method)
    rotated = online_rotations(model)
    assert len(rotated) == 2 and all(isinstance(model.get_submodule(n), QuantLinear) for n in rotated)
    assert all(len(model.get_submodule(n)._forward_pre_hooks) == 1 for n in rotated)  # carried over, not doubled
    down = model.get_submodule(next(iter(rotated)))
    x = torch.randn(3, down.in_features)
    with torch.no_grad():  # the QuantLinear computes (xQ)·dequantize(W)ᵀ
        want = torch.nn.functional.linear(down.input_rotation(x), down.qtensor().dequantize(torch.float32))
        assert torch.allclose(down(x), want, atol=1e-5)
        after = model(ids).logits
    assert float((after - before).norm() / before.norm()) < 0.3
    assert "rotates its input at run time" in "\n".join(RotateStage.render(report, {}))


def test_the_compress_checkpoint_holds_the_rotation(tmp_path):
    from compress.export.native import load_compressed, save_compressed

    model, ids, _, _ = _rotated_and_quantized("rtn")
    save_compressed(model, None, tmp_path / "m", {}, save_dtype="float32")
    meta = yaml.safe_load((tmp_path / "m" / "compress.json").read_text())
    assert meta["online_rotations"] == {f"model.layers.{i}.mlp.down_proj": 128 for i in range(2)}
    reloaded = load_compressed(tmp_path / "m")
    assert sorted(online_rotations(reloaded)) == sorted(online_rotations(model))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "gguf-q4_0", "dense"])
def test_exports_refuse_the_online_hadamard_with_the_fix(fmt):
    model = make_tiny_model("llama")
    rotate_mlp_inputs(model, get_arch(model))
    with pytest.raises(ExportError, match="online Hadamard.*rotate.online_hadamard: false"):
        check_export(model, fmt)


def test_a_recipe_with_formats_is_refused_before_any_work(tmp_path):
    from compress.pipeline.resident import check_formats
    from compress.recipe import from_dict
    from compress.stages.base import make_plan

    model = make_tiny_model("llama")
    recipe = from_dict({"model": "unused", "stages": [{"stage": "rotate", "online_hadamard": True},
                                                      {"stage": "quantize", "method": "rtn"}],
                        "output": {"formats": ["compressed-tensors"]}})
    plan = make_plan(model, get_arch(model), recipe.stages)
    with pytest.raises(ExportError, match="cannot export to compressed-tensors.*online_hadamard"):
        check_formats(model, plan, recipe.output.formats)
    plain = from_dict({"model": "unused", "stages": [{"stage": "rotate"}, {"stage": "quantize", "method": "rtn"}],
                       "output": {"formats": ["compressed-tensors"]}})
    check_formats(model, make_plan(model, get_arch(model), plain.stages), plain.output.formats)


def test_the_awq_pair_into_a_rotated_linear_is_skipped_with_the_reason():
    model = make_tiny_model("llama")
    arch = get_arch(model)
    block = arch.block_list(model)[0]
    quantized = {"mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"}
    assert pair_skip_reason(block, "mlp.up_proj", ("mlp.down_proj",), quantized) is None
    rotate_mlp_inputs(model, arch)
    reason = pair_skip_reason(block, "mlp.up_proj", ("mlp.down_proj",), quantized)
    assert reason and "does not pass through the Hadamard" in reason
    assert pair_skip_reason(block, "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), quantized) is None


def test_pruning_after_the_online_hadamard_is_refused():
    from compress.stages.base import ModelStageContext
    from compress.stages.prune import PruneStage

    model = make_tiny_model("llama")
    rotate_mlp_inputs(model, get_arch(model))
    stage = PruneStage(mlp=0.5)
    ctx = ModelStageContext(model=model, tokenizer=None, arch=get_arch(model), calibration=None, out=None,
                            resume=False, progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="prune.*rotate.online_hadamard: false"):
        stage.run_model(ctx, 1)


def test_online_hadamard_needs_a_down_projection_linear():
    from compress.stages.rotate import RotateStage

    model = make_tiny_model("llama")
    step = RotateStage(online_hadamard=True).plan(model, get_arch(model), {}, 0)
    assert "online Hadamard on every mlp.down_proj input (Sylvester 128, order 128)" in step
