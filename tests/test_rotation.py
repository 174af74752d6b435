"""The residual-stream rotation (compress/transforms/rotation.py, stage `rotate`): Hadamard matrices, the float function
unchanged on every family it applies to, clear refusals elsewhere, and a quantize stage after it."""
from __future__ import annotations

import pytest
import torch

from compress.arch import get_arch
from compress.arch.tables import FAMILIES
from compress.calibrate.blockwise import BlockPass, run_blockwise
from compress.recipe import from_dict
from compress.transforms.rotation import hadamard, random_rotation, rotate_model
from compress.pipeline.calibration import StagePass, start_stages
from compress.stages.base import make_plan
from compress.stages.rotate import RotateStage

from .conftest import TINY_CONFIGS, make_tiny_model

ROTATABLE = sorted(f for f in TINY_CONFIGS if not isinstance(FAMILIES[f]["rotate"], str))


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 64, 576, 960, 1536])
def test_hadamard_matrices_are_hadamard(n):
    h = hadamard(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n", [6, 10, 92])  # 92 has a Hadamard matrix, but none of the constructions here
def test_orders_without_a_construction_fall_back_to_a_random_orthogonal_matrix(n):
    assert hadamard(n) is None
    q, what = random_rotation(n, "hadamard", seed=1)
    assert "random orthogonal" in what and "no Hadamard" in what
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


def test_the_randomised_hadamard_is_orthogonal_and_seeded():
    q, what = random_rotation(576, seed=3)
    assert "Paley II 36 ⊗ Sylvester 16" in what
    assert torch.allclose(q @ q.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_rotation(576, seed=3)[0]) and not torch.equal(q, random_rotation(576, seed=4)[0])
    assert torch.allclose(q.abs(), torch.full_like(q, 576 ** -0.5))  # every entry ±1/√d: maximally incoherent


@pytest.mark.parametrize("family", ROTATABLE)
@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_the_float_function_is_unchanged(family, kind):
    model = make_tiny_model(family).double()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    weights = {n: p.clone() for n, p in model.named_parameters()}
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    report = rotate_model(model, get_arch(model), kind, seed=0)
    with torch.no_grad():
        after = model(ids).logits
    # the norms compute in float32 inside transformers, so float32 rounding, not float64's
    assert float((after - before).abs().max()) < 1e-5 * float(before.abs().max())
    changed = [n for n, p in model.named_parameters() if n in weights and not torch.equal(p, weights[n])]
    assert any("embed" in n for n in changed) and any("o_proj" in n for n in changed)
    assert report["linears_rotated"] > 0 and report["untied_lm_head"] == tied
    assert model.lm_head.weight is not model.get_input_embeddings().weight


def test_without_the_output_rotation_the_function_changes():
    """The check above can fail: rotating the readers but not the writers breaks the model."""
    import compress.transforms.rotation as rot
    model = make_tiny_model("qwen2").double()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    saved = rot.rotate_output
    rot.rotate_output = lambda lin, q: None
    try:
        rotate_model(model, get_arch(model))
    finally:
        rot.rotate_output = saved
    with torch.no_grad():
        assert float((model(ids).logits - before).abs().max()) > 1e-2


@pytest.mark.parametrize("family", sorted(set(TINY_CONFIGS) - set(ROTATABLE)))
def test_families_it_cannot_rotate_are_refused_with_the_reason(family):
    model = make_tiny_model(family)
    recipe = from_dict({"model": "unused", "stages": [{"stage": "rotate"}, {"stage": "quantize"}]})
    with pytest.raises(ValueError, match="LayerNorm subtracts the mean|post-feedforward norms"):
        make_plan(model, get_arch(model), recipe.stages)


def test_rotate_must_come_first_and_kinds_are_checked():
    with pytest.raises(ValueError, match="rotate.*must come before"):
        from_dict({"model": "unused", "stages": [{"stage": "quantize"}, {"stage": "rotate"}]})
    with pytest.raises(ValueError, match="kind"):
        RotateStage(kind="spin")


def test_rotated_then_quantized_by_gptq():
    """The recipe's stages in order: rotate (whole model), then GPTQ block by block on the rotated model."""
    from compress.pipeline.model_stages import run_model_stages
    from compress.pipeline.options import RunOptions

    model = make_tiny_model("llama")
    arch = get_arch(model)
    recipe = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 4, "seq_len": 16},
                        "stages": [{"stage": "rotate"},
                                   {"stage": "quantize", "method": "gptq",
                                    "scheme": {"dtype": "int3", "group_size": 16, "symmetric": False}}]})
    ids = torch.randint(0, 256, (4, 16))
    with torch.no_grad():
        before = model(ids).logits
    reports, _, _ = run_model_stages(model, None, arch, RunOptions(recipe, None, progress=False, log=lambda *_: None))
    assert reports[0]["stage"] == "rotate" and "Hadamard" in reports[0]["rotation"]
    assert "Residual stream rotated" in "\n".join(RotateStage.render(reports[0], {}))
    plan = make_plan(model, arch, recipe.stages, model_stages_done=True)
    stage_pass = StagePass(start_stages(model, plan))
    run_blockwise(model, arch, ids, stage_pass.on_block, BlockPass(observe=stage_pass.observe, progress=False))
    with torch.no_grad():
        after = model(ids).logits
    assert torch.isfinite(after).all() and float((after - before).norm() / before.norm()) < 0.6
