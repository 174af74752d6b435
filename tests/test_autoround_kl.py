"""AutoRound against the model's loss (issue 50, item 2): the kl_hessians pass's block-output Fisher against a
whole-model backward, the weighted loss against its formula, and a run whose AutoRound reads it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from compress.calibrate.blockwise import _first
from compress.core.scheme import QuantScheme
from compress.precision.output_hessians import INDEX, complete, output_hessians
from compress.quantizers.autoround import (KEY_BLOCK, AutoRoundOptions, BlockSamples, block_fisher_path,
                                           block_metric, error_loss, tune_block)
from tests.conftest import make_tiny_model, requires_data, run_tiny_recipe, tiny_recipe
from tests.test_autoround import _OneLinear
from tests.test_kl_hessians import codes_differ_from_plain, sampled_backward

AR_INT3 = {"stage": "quantize", "method": "autoround", "ignore": ["lm_head"], "options": {"iters": 10, "batch_size": 2},
           "scheme": {"dtype": "int3", "granularity": "group", "group_size": 16, "symmetric": False}}


def _block_fishers(model: nn.Module, windows: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """The plain reference: the whole model forward and backward per window (labels sampled from its logits by the
    same generator, in the same order), Σ g gᵀ of the gradient at every decoder block's output."""
    layers = model.model.layers
    sums = [0] * len(layers)

    def hook(b):
        def f(_m, _args, out):
            def g_hook(g):
                g2 = g.reshape(-1, g.shape[-1]).double()
                sums[b] = sums[b] + g2.T @ g2
            _first(out).register_hook(g_hook)
        return f

    sampled_backward(model, windows, seed, [layer.register_forward_hook(hook(b)) for b, layer in enumerate(layers)])
    return sums


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_block_sides_equal_the_whole_model(tmp_path, family):
    model = make_tiny_model(family).float().eval()
    windows = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")]
    index = output_hessians(model, windows, names, tmp_path, seed=7, block_sides=True)
    assert index["block_sides"] and complete(tmp_path, names, 7, 72, block_sides=True)
    assert not complete(tmp_path, names, 7, 72)  # a GPTQ run does not reuse a block-sides folder
    assert not any(p.name.endswith("_proj.safetensors") for p in tmp_path.iterdir())  # no layer's two sides
    model.requires_grad_(True)
    ref = _block_fishers(model, windows, seed=7)
    for b, want in enumerate(ref):
        have = load_file(str(block_fisher_path(tmp_path, f"model.layers.{b}")))[KEY_BLOCK].double()
        assert have.shape == want.shape == (model.config.hidden_size,) * 2
        assert torch.allclose(have, want, rtol=1e-4, atol=1e-6 * want.abs().max()), b


def test_the_loss_is_its_formula_and_the_identity_the_plain_one():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(1, 5, 6, generator=g)
    a = torch.randn(6, 6, generator=g)
    m = a @ a.T
    want = sum(float(d[0, t] @ m @ d[0, t]) for t in range(5)) / (5 * 6)
    assert float(error_loss(d, m)) == pytest.approx(want, rel=1e-5)
    assert torch.equal(error_loss(d, 2 * torch.eye(6)), 2 * error_loss(d, None))


def test_block_metric_normalises_and_names_the_fix(tmp_path):
    g = torch.diag(torch.tensor([4.0, 2.0, 0.0]))
    save_file({KEY_BLOCK: g}, str(block_fisher_path(tmp_path, "model.layers.0")))
    m = block_metric(tmp_path, "model.layers.0", 3, 0.5)
    assert torch.allclose(m, torch.diag(torch.tensor([2.5, 1.5, 0.5])))  # G / mean diag (2) + 0.5 I
    with pytest.raises(FileNotFoundError, match="kl_hessians"):
        block_metric(tmp_path, "model.layers.1", 3, 0.01)
    with pytest.raises(ValueError, match="another model"):
        block_metric(tmp_path, "model.layers.0", 4, 0.01)
    with pytest.raises(ValueError, match="kl_dampening"):
        AutoRoundOptions(kl_dampening=-1.0)


def _one_linear_problem():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(32, 128, generator=g) * 0.05, torch.zeros(32)
    basis = torch.randn(8, 128, generator=g)
    xs = [torch.randn(1, 32, 8, generator=g) @ basis + 0.1 * torch.randn(1, 32, 128, generator=g) for _ in range(8)]
    return w, _OneLinear(w, b), BlockSamples(xs, [{}] * 8, [x @ w.T for x in xs]), xs


def test_the_metric_moves_the_error_where_the_loss_does_not_look():
    """M = 2·I changes nothing (SignSGD reads signs; 2·I is exact). A metric that reads the outputs along two
    directions only (and the rest a thousandth as much) leaves less error along them than the plain loss, and more
    in all. (A diagonal metric would change nothing here: one linear's rows round apart, and a row's weight does not
    change its gradient's signs.)"""
    scheme = QuantScheme("int2", "group", 16, symmetric=False)
    w, block, samples, xs = _one_linear_problem()
    opts = AutoRoundOptions(iters=60, batch_size=4)
    plain, _ = tune_block(block, {"proj": w}, scheme, opts, samples)
    doubled, _ = tune_block(block, {"proj": w}, scheme, opts, samples, metric=2 * torch.eye(32))
    assert torch.equal(plain["proj"].codes(), doubled["proj"].codes())
    u = torch.linalg.qr(torch.randn(32, 2, generator=torch.Generator().manual_seed(5)))[0]
    focused, rec = tune_block(block, {"proj": w}, scheme, opts, samples, metric=u @ u.T + 1e-3 * torch.eye(32))

    def error(q, along=None):
        d = [x @ (q.dequantize() - w).T for x in xs]
        return sum(float(((e if along is None else e @ along) ** 2).mean()) for e in d)

    assert error(focused["proj"], u) < 0.5 * error(plain["proj"], u)
    assert error(focused["proj"]) > error(plain["proj"])
    assert rec["kept_loss"] < rec["first_loss"]


def test_a_run_tunes_against_the_block_fishers(tmp_path):
    """kl_hessians before AutoRound writes one Fisher per block (not the layers' sides), the resolved recipe points
    AutoRound at them, every block's tuning says which loss it took, and the codes differ from plain AutoRound's."""
    out = run_tiny_recipe(tmp_path, [{"stage": "kl_hessians", "n_samples": 2}, AR_INT3], {"perplexity": False})
    report = json.loads((out / "report.json").read_text())
    section = next(s for s in report["stages"] if s["stage"] == "kl_hessians")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert section["sides"] == "blocks"
    assert section["disk_bytes"] == 4 * config["hidden_size"] ** 2 * config["num_hidden_layers"]
    tuning = next(s for s in report["stages"] if s["stage"] == "quantize")["tuning"]
    assert len(tuning) == config["num_hidden_layers"]
    assert all(t["loss"] == "block-output Fisher" for t in tuning.values())
    assert "output_hessians:" in (out / "recipe.resolved.yaml").read_text()
    assert "output of each decoder block" in (out / "report.md").read_text()
    assert codes_differ_from_plain(tmp_path, out, AR_INT3)


def test_eora_against_the_layers_kl_is_refused_after_autoround(tmp_path):
    from compress import load_recipe
    with pytest.raises(ValueError, match="weighting: input after AutoRound"):
        load_recipe(tiny_recipe(tmp_path, [{"stage": "kl_hessians"}, AR_INT3,
                                           {"stage": "eora", "rank": 4, "weighting": "kl"}], {"perplexity": False}))
    assert load_recipe(tiny_recipe(tmp_path, [{"stage": "kl_hessians"}, {**AR_INT3, "scheme": {
        "dtype": "int4", "granularity": "tensor", "symmetric": True}}], {"perplexity": False}))  # any AutoRound scheme


@requires_data
def test_streamed_equals_in_memory(tmp_path):
    """A streamed run's pass reads the blocks from disk one at a time: the same block Fishers, so the same AutoRound
    tensors as in memory."""
    from compress.export.shards import read_safetensors
    from compress.pipeline.resident import run
    from tests.test_streaming import _folder, _recipe

    folder, _ = _folder(tmp_path, "llama")
    stages = [{"stage": "kl_hessians", "n_samples": 2}, {**AR_INT3, "ignore": []}]
    tensors = {}
    for mode in ("never", "always"):
        out = tmp_path / f"out-{mode}"
        report = run(_recipe(folder, out, stages, mode), progress=False, log=lambda *a: None)
        assert ("streamed" in report) == (mode == "always")
        tensors[mode] = read_safetensors(out)
    assert tensors["never"].keys() == tensors["always"].keys()
    assert all(torch.equal(tensors["never"][k], tensors["always"][k]) for k in tensors["never"])
