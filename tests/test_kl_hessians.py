"""The kl_hessians stage: the output-side Hessians block by block against a whole-model backward, and a run whose GPTQ
rounds against them (recipe checks, the report, the resolved recipe)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from compress.precision.mixed import sample_labels
from compress.precision.output_hessians import INDEX, output_hessians
from compress.quantizers.gptq_kron import output_hessian_path
from tests.conftest import make_tiny_model, requires_data, run_tiny_recipe, tiny_recipe

GPTQ_INT3 = {"stage": "quantize", "method": "gptq", "ignore": ["lm_head"],
             "scheme": {"dtype": "int3", "granularity": "group", "group_size": 16, "symmetric": False}}


def _whole_model(model: nn.Module, windows: torch.Tensor, names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """The plain reference: the whole model forward and backward per window (labels sampled from its logits by the
    same generator, in the same order), every layer's Σ g gᵀ and Σ |g|² x xᵀ summed by a hook on its output."""
    sums = {n: [0, 0] for n in names}  # [Σ g gᵀ, Σ |g|² x xᵀ]

    def hook(name):
        def f(_m, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()

            def g_hook(g):
                g2 = g.reshape(-1, g.shape[-1]).double()
                sums[name][0] = sums[name][0] + g2.T @ g2
                sums[name][1] = sums[name][1] + (x * (g2 * g2).sum(1, keepdim=True)).T @ x
            out.register_hook(g_hook)
        return f

    sampled_backward(model, windows, seed, [model.get_submodule(n).register_forward_hook(hook(n)) for n in names])
    return sums


def sampled_backward(model: nn.Module, windows: torch.Tensor, seed: int, handles: list) -> None:
    """Each window forward and back through the whole model, the labels sampled from its logits by a generator seeded
    `seed` (in the windows' order, as the block-by-block pass draws them); `handles` (hooks summing what the test
    wants) removed after."""
    gen = torch.Generator().manual_seed(seed)
    for w in windows:
        logits = model(w[None]).logits[0]
        nn.functional.cross_entropy(logits, sample_labels(logits, gen), reduction="sum").backward()
    for h in handles:
        h.remove()
    model.zero_grad()


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral"])
def test_block_by_block_equals_the_whole_model(tmp_path, family):
    from compress.arch.moe import unfuse_experts
    model = make_tiny_model(family).float().eval()
    unfuse_experts(model)  # as the loader leaves a mixture of experts: one linear per expert
    windows = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")
             and "router" not in n and not n.endswith(".gate")]
    before = [p.requires_grad for p in model.parameters()]
    index = output_hessians(model, windows, names, tmp_path, seed=7)
    assert index["tokens"] == 72 and sorted(index["layers"]) == sorted(names)
    assert json.loads((tmp_path / INDEX).read_text()) == index
    assert [p.requires_grad for p in model.parameters()] == before  # restored
    model.requires_grad_(True)  # the reference backpropagates through every layer
    ref = _whole_model(model, windows, names, seed=7)
    for n in names:
        got = load_file(str(output_hessian_path(tmp_path, n)))
        for key, want in zip(("output", "input"), ref[n]):
            have = got[key].double()
            assert have.shape == want.shape
            assert torch.allclose(have, want, rtol=1e-4, atol=1e-6 * want.abs().max()), (n, key)


def test_layers_outside_the_blocks_are_refused(tmp_path):
    model = make_tiny_model("llama").float().eval()
    with pytest.raises(ValueError, match="lm_head.*ignore"):
        output_hessians(model, torch.zeros(1, 8, dtype=torch.long), ["lm_head"], tmp_path)


def test_a_run_rounds_against_them(tmp_path):
    """The stage writes every quantized layer's Hessian and points the GPTQ at them (the resolved recipe says so);
    the result differs from plain GPTQ's and its report has the stage's section."""
    from compress import load_recipe

    out = run_tiny_recipe(tmp_path, [{"stage": "kl_hessians", "n_samples": 2}, GPTQ_INT3], {"perplexity": False})
    report = json.loads((out / "report.json").read_text())
    section = next(s for s in report["stages"] if s["stage"] == "kl_hessians")
    assert section["layers"] == 7 * 2 and section["windows"] == 2 and not section["reused"]
    resolved = (out / "recipe.resolved.yaml").read_text()
    assert "output_hessians:" in resolved and "kl_hessians" in resolved
    assert "kl_hessians" in (out / "report.md").read_text()
    assert codes_differ_from_plain(tmp_path, out, GPTQ_INT3)
    assert load_recipe(tiny_recipe(tmp_path, [{"stage": "kl_hessians"}, GPTQ_INT3], {"perplexity": False}))


def codes_differ_from_plain(tmp_path, out, stage: dict) -> bool:
    """Whether the run in `out` stored other codes for layer 1's down_proj than a run of `stage` alone (written to
    tmp_path/plain)."""
    from safetensors import safe_open

    plain = tmp_path / "plain"
    plain.mkdir()
    run_tiny_recipe(plain, [stage], {"perplexity": False})
    name = "model.layers.1.mlp.down_proj.qdata"
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as a, \
            safe_open(str(next((plain / "out").glob("*.safetensors"))), "pt") as b:
        return not torch.equal(a.get_tensor(name), b.get_tensor(name))


@pytest.mark.parametrize("stages, match", [
    ([{"stage": "kl_hessians"}, {**GPTQ_INT3, "method": "rtn"}], "method: gptq"),
    ([{"stage": "kl_hessians"}, {"stage": "prune", "mlp": 0.5}, GPTQ_INT3], "prune after it"),
    ([{"stage": "kl_hessians"}, {**GPTQ_INT3, "scheme": {"dtype": "int8", "granularity": "tensor"}}],
     "channel or group"),
])
def test_recipe_checks(tmp_path, stages, match):
    from compress import load_recipe
    with pytest.raises(ValueError, match=match):
        load_recipe(tiny_recipe(tmp_path, stages, {"perplexity": False}))


@requires_data
def test_streamed_equals_in_memory(tmp_path):
    """A streamed run's pass reads the blocks from disk one at a time (as the fisher sensitivity pass does): the same
    Hessians, so the same GPTQ tensors as in memory."""
    from compress.export.shards import read_safetensors
    from compress.pipeline.resident import run
    from tests.test_streaming import _folder, _recipe

    folder, _ = _folder(tmp_path, "llama")
    stages = [{"stage": "kl_hessians", "n_samples": 2}, {**GPTQ_INT3, "ignore": []}]
    tensors, reports = {}, {}
    for mode in ("never", "always"):
        out = tmp_path / f"out-{mode}"
        reports[mode] = run(_recipe(folder, out, stages, mode), progress=False, log=lambda *a: None)
        tensors[mode] = read_safetensors(out)
    assert "streamed" in reports["always"] and "streamed" not in reports["never"]
    assert tensors["never"].keys() == tensors["always"].keys()
    assert all(torch.equal(tensors["never"][k], tensors["always"][k]) for k in tensors["never"])


def test_bfloat16_matmuls_stay_close(tmp_path):
    """Under bfloat16 autocast (the calibration's matmul dtype where the CPU has it) both sides stay within a few
    percent of float32's (relative Frobenius distance; measured 0.2-0.7% on the tiny llama)."""
    model = make_tiny_model("llama").float().eval()
    windows = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    names = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    output_hessians(model, windows, names, tmp_path / "f32", seed=3)
    output_hessians(model, windows, names, tmp_path / "bf16", seed=3, compute_dtype=torch.bfloat16)
    for n in names:
        a = load_file(str(output_hessian_path(tmp_path / "f32", n)))
        b = load_file(str(output_hessian_path(tmp_path / "bf16", n)))
        for key in ("output", "input"):
            dist = float((a[key] - b[key]).norm() / a[key].norm())
            assert 0 < dist < 0.05, (n, key, dist)


def test_awq_between_rescales_both_sides(tmp_path):
    """With awq between the stage and the quantize stage, every scaled pair's previous linear (up_proj) gets the
    divisor its balance linear's inputs got (down_proj), and the run completes with GPTQ on the rescaled sides."""
    from compress.stages.quantize import output_divisors

    block = make_tiny_model("llama").model.layers[0]
    from compress.arch import get_arch
    pairs = get_arch(make_tiny_model("llama")).awq
    s = torch.rand(block.mlp.down_proj.in_features) + 0.5
    assert set(output_divisors(block, pairs, {"mlp.down_proj": s})) == {"mlp.up_proj"}
    assert output_divisors(block, pairs, {"mlp.down_proj": s})["mlp.up_proj"] is s
    assert output_divisors(block, pairs, {}) == {}
    out = run_tiny_recipe(tmp_path, [{"stage": "kl_hessians", "n_samples": 2},
                                     {"stage": "awq", "n_grid": 4, "search_samples": 2, "clip_to": "grid"}, GPTQ_INT3],
                          {"perplexity": False})
    report = json.loads((out / "report.json").read_text())
    assert [s["stage"] for s in report["stages"]][:2] == ["kl_hessians", "awq"]
