"""Planted outlier features: the transform preserves the function on every family and produces activations
above LLM.int8's threshold in the planted channels, in every block."""
from __future__ import annotations

import pytest
import torch

from compress.arch import get_arch
from compress.transforms.outliers import PlantSpec, plant_outliers
from tests.conftest import TINY_CONFIGS, make_tiny_model


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_planting_preserves_logits(family):
    model = make_tiny_model(family)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        before = model(ids).logits
    info = plant_outliers(model, get_arch(model), PlantSpec(channels=3, factor=50.0))
    with torch.no_grad():
        after = model(ids).logits
    assert len(info["channels"]) == 3 and info["pairs"] >= 2
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_planted_channels_carry_outliers_into_the_projections():
    model = make_tiny_model("llama")
    info = plant_outliers(model, get_arch(model), PlantSpec(channels=2, factor=60.0, seed=3))
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(n, a[0].abs().amax(dim=(0, 1))))
             for n, m in model.named_modules() if n.endswith(("q_proj", "gate_proj"))]
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 32)))
    for h in hooks:
        h.remove()
    for name, absmax in seen.items():
        planted = absmax[info["channels"]]
        others = absmax[[c for c in range(absmax.numel()) if c not in info["channels"]]]
        assert planted.min() >= 6.0, name  # LLM.int8's threshold
        assert planted.min() > 5 * others.max(), name


def test_bad_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="factor"):
        PlantSpec(channels=2, factor=1.0)
    with pytest.raises(ValueError, match="hidden size"):
        plant_outliers(make_tiny_model("llama"), get_arch(make_tiny_model("llama")), PlantSpec(channels=100))
