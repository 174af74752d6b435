"""EoRA against the model's KL (issue 50, items 2 and 3 together): the two-sided fit against a plain reference (the
symmetric square roots of both sides), the rank allocation against brute force, and the stage in a run after a
kl_hessians stage (ranks that differ per layer, the budget kept, the adapter reloaded through peft)."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from compress.quantizers.eora import allocate_ranks, eora_kl_terms, eora_terms, kl_cost, kl_weights
from tests.conftest import run_tiny_recipe, tiny_recipe

F64 = torch.float64


def _spd(n: int, tokens: int, seed: int) -> torch.Tensor:
    """Σ x xᵀ over anisotropic random x: a full-rank, ill-conditioned Hessian."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=gen, dtype=F64) * torch.logspace(1, -1, n, dtype=F64)
    mix = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64)).Q
    x = x @ mix
    return x.T @ x


def _root(h: torch.Tensor, power: float) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(h)
    return (vecs * vals ** power) @ vecs.T


def _plain_sides(h_in, h_out, damp, shrink):
    """Both sides as the fit weighs them, built plainly: the output side's diagonal times 1 + shrink, then each
    side's diagonal plus damp × its mean."""
    hi = h_in + damp * h_in.diagonal().mean() * torch.eye(len(h_in), dtype=F64)
    ho = h_out + shrink * torch.diag(h_out.diagonal())
    ho = ho + damp * ho.diagonal().mean() * torch.eye(len(ho), dtype=F64)
    return hi, ho


def reference_kl_fit(e, h_in, h_out, rank, damp, shrink):
    """The minimiser of tr((E - L) H_in (E - L)ᵀ H_out) over rank-r L by symmetric square roots: the best rank-r
    approximation of H_out^½ E H_in^½ mapped back by the inverse roots (a different factorisation from the code's
    Cholesky factors, the same minimiser)."""
    hi, ho = _plain_sides(h_in, h_out, damp, shrink)
    m = _root(ho, 0.5) @ e @ _root(hi, 0.5)
    u, s, vt = torch.linalg.svd(m)
    return _root(ho, -0.5) @ (u[:, :rank] * s[:rank]) @ vt[:rank] @ _root(hi, -0.5)


def plain_cost(r, h_in, h_out, damp, shrink):
    """vec(R)ᵀ (H_out ⊗ H_in) vec(R) / tr(H_out as shrunk): the Kronecker cost written out on the flattened error."""
    hi, ho = _plain_sides(h_in, h_out, damp, shrink)
    v = r.reshape(-1)
    return float(v @ torch.kron(ho, hi) @ v) / float(h_out.diagonal().sum() * (1 + shrink))


@pytest.mark.parametrize("out,k,rank", [(24, 16, 3), (16, 24, 6), (12, 12, 12)])
@pytest.mark.parametrize("shrink", [0.0, 1.0])
def test_kl_terms_are_the_reference_minimiser(out, k, rank, shrink):
    e = torch.randn(out, k, generator=torch.Generator().manual_seed(3), dtype=F64)
    h_in, h_out = _spd(k, 300, 1), _spd(out, 300, 2)
    a, b, gains, total = eora_kl_terms(e, kl_weights(h_in, h_out, damp=0.01, output_shrink=shrink), rank)
    ref = reference_kl_fit(e, h_in, h_out, rank, 0.01, shrink)
    assert torch.allclose(b @ a, ref, atol=1e-7 * float(ref.abs().max()), rtol=0)
    # the units: the whole error's cost, and what is left is the total less the ranks' gains
    assert total == pytest.approx(plain_cost(e, h_in, h_out, 0.01, shrink), rel=1e-9)
    left = plain_cost(e - b @ a, h_in, h_out, 0.01, shrink)
    assert left == pytest.approx(total - float(gains.sum()), rel=1e-6, abs=1e-9 * total)
    assert kl_cost(e - b @ a, kl_weights(h_in, h_out, 0.01, shrink)) == pytest.approx(left, rel=1e-9,
                                                                              abs=1e-12 * total)
    assert bool((gains[:-1] >= gains[1:]).all())


def test_a_flat_output_side_is_the_input_only_fit():
    """H_out = I (every output alike) leaves the layer's own output error: the same term as eora_terms."""
    e = torch.randn(20, 16, generator=torch.Generator().manual_seed(4), dtype=F64)
    h_in = _spd(16, 200, 5)
    a, b, _, _ = eora_kl_terms(e, kl_weights(h_in, torch.eye(20, dtype=F64), 0.01, 0.0), 4)
    a0, b0, _ = eora_terms(e, h_in, 4, damp=0.01)
    assert torch.allclose(b @ a, b0 @ a0, atol=1e-10, rtol=0)


def test_the_output_side_changes_which_error_is_removed():
    """Outputs the loss cares about more get the term: against a skewed H_out the two-sided fit leaves less KL cost
    than the input-only fit of the same rank, by a wide margin."""
    e = torch.randn(32, 24, generator=torch.Generator().manual_seed(6), dtype=F64)
    h_in = _spd(24, 400, 7)
    h_out = torch.diag(torch.logspace(2, -2, 32, dtype=F64))
    weights = kl_weights(h_in, h_out, 0.01, 0.0)
    a, b, _, _ = eora_kl_terms(e, weights, 4)
    a0, b0, _ = eora_terms(e, h_in, 4, damp=0.01)
    assert kl_cost(e - b @ a, weights) < 0.8 * kl_cost(e - b0 @ a0, weights)


def _brute_force(gains: dict, costs: dict, budget: int) -> float:
    """The largest total gain of any choice of prefix ranks within the budget."""
    names = list(gains)
    best = 0.0
    for ranks in itertools.product(*(range(len(gains[n]) + 1) for n in names)):
        if sum(r * costs[n] for r, n in zip(ranks, names)) <= budget:
            best = max(best, sum(float(gains[n][:r].sum()) for r, n in zip(ranks, names)))
    return best


def test_allocation_with_equal_costs_is_the_best_choice():
    gen = torch.Generator().manual_seed(8)
    for trial in range(20):
        gains = {f"l{i}": torch.sort(torch.rand(4, generator=gen, dtype=F64) ** 3, descending=True).values
                 for i in range(3)}
        costs = dict.fromkeys(gains, 10)
        budget = int(torch.randint(0, 130, (1,), generator=gen))
        ranks = allocate_ranks(gains, costs, budget)
        assert sum(r * costs[n] for n, r in ranks.items()) <= budget
        value = sum(float(gains[n][:r].sum()) for n, r in ranks.items())
        assert value == pytest.approx(_brute_force(gains, costs, budget), rel=1e-12)


def test_allocation_spends_where_a_parameter_removes_most():
    """A wide layer (cost 100 per rank) with 5× the gain of a narrow one (cost 10) is worth half as much per
    parameter: the narrow one fills first; ranks are prefixes and the budget is never exceeded."""
    gains = {"wide": torch.full((6,), 5.0, dtype=F64), "narrow": torch.full((6,), 1.0, dtype=F64),
             "dead": torch.zeros(6, dtype=F64)}
    costs = {"wide": 100, "narrow": 10, "dead": 10}
    assert allocate_ranks(gains, costs, 100) == {"wide": 0, "narrow": 6, "dead": 0}  # 6 removed, not wide's 5
    assert allocate_ranks(gains, costs, 260) == {"wide": 2, "narrow": 6, "dead": 0}
    assert allocate_ranks(gains, costs, 0) == {"wide": 0, "narrow": 0, "dead": 0}


GPTQ_INT3 = {"stage": "quantize", "method": "gptq", "ignore": ["lm_head"],
             "scheme": {"dtype": "int3", "granularity": "group", "group_size": 16, "symmetric": False}}
KL = {"stage": "kl_hessians", "n_samples": 2}


def test_a_run_allocates_ranks_against_the_kl_and_the_adapter_reloads(tmp_path):
    """kl_hessians + GPTQ + eora (weighting kl, allocate): the ranks differ across layers, the parameters stay within
    the budget of rank 4 on every layer, the report says what was removed, and the adapter (PEFT's rank_pattern for
    the ranks that differ) reloads through transformers + peft beside the export and agrees with our model."""
    from compress.core.nn import QuantLinear
    from compress.export.native import load_compressed

    out = run_tiny_recipe(tmp_path, [KL, GPTQ_INT3, {"stage": "eora", "rank": 4, "weighting": "kl",
                                                     "allocate": True}],
                          {"perplexity": False, "speed": False, "samples": 0}, ("compressed-tensors",))
    report = json.loads((out / "report.json").read_text())
    section = next(s for s in report["stages"] if s["stage"] == "eora")
    assert section["allocate"] and section["weighting"] == "kl"
    ranks = {n: r["rank"] for n, r in section["layers"].items()}
    assert len(ranks) == 14 and len(set(ranks.values())) > 1 and max(ranks.values()) > 4
    model = load_compressed(out)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    budget = 4 * sum(m.in_features + m.out_features for m in layers.values())
    used = sum(m.rank * (m.in_features + m.out_features) for m in layers.values())
    assert used <= budget and used > 0.9 * budget
    assert all(layers[n].rank == r for n, r in ranks.items())
    assert 0 < section["kl_cost_removed"] < 1 and section["extra_parameters"] == used
    assert "Ranks per layer" in (out / "report.md").read_text()
    [entry] = report["exports"]
    assert entry["adapter"]["layers"] == sum(r > 0 for r in ranks.values())
    assert entry["adapter"]["max_rank"] == max(ranks.values())
    assert entry["verify"]["loader"].endswith("LoRA adapter (peft)") and entry["verify"]["kl"] < 1e-3, entry["verify"]
    [config] = out.parent.glob("**/adapter/adapter_config.json")
    assert json.loads(config.read_text())["rank_pattern"]  # the ranks that differ from the most common one


def test_allocation_removes_more_kl_cost_than_uniform_ranks(tmp_path):
    """Same parameters, same KL Hessians: the allocated ranks remove more of the model's Kronecker KL cost than rank 4
    on every layer (both fitted against the KL)."""
    uniform = run_tiny_recipe(tmp_path, [KL, GPTQ_INT3, {"stage": "eora", "rank": 4, "weighting": "kl"}],
                              {"perplexity": False})
    first = next(s for s in json.loads((uniform / "report.json").read_text())["stages"] if s["stage"] == "eora")
    assert {r["rank"] for r in first["layers"].values()} == {4}
    other = tmp_path / "allocated"
    other.mkdir()
    allocated = run_tiny_recipe(other, [KL, GPTQ_INT3, {"stage": "eora", "rank": 4, "weighting": "kl",
                                                        "allocate": True}], {"perplexity": False})
    second = next(s for s in json.loads((allocated / "report.json").read_text())["stages"] if s["stage"] == "eora")
    assert second["kl_cost_removed"] > 1.05 * first["kl_cost_removed"]


def test_alternation_against_the_kl(tmp_path):
    """iterations with weighting kl: GPTQ (against the KL) re-run on W - B A, the best round by the KL cost kept."""
    out = run_tiny_recipe(tmp_path, [KL, GPTQ_INT3, {"stage": "eora", "rank": 2, "weighting": "kl", "iterations": 2}],
                          {"perplexity": False})
    section = next(s for s in json.loads((out / "report.json").read_text())["stages"] if s["stage"] == "eora")
    assert all(r["iterations"] == 2 and 0 < r["error_removed"] < 1 for r in section["layers"].values())


@pytest.mark.parametrize("stages, match", [
    ([GPTQ_INT3, {"stage": "eora", "allocate": True}], "set weighting: kl"),
    ([GPTQ_INT3, {"stage": "eora", "weighting": "kl"}], "kl_hessians"),
    ([KL, GPTQ_INT3, {"stage": "eora", "weighting": "kl", "allocate": True, "iterations": 2}], "use one of them"),
    ([GPTQ_INT3, {"stage": "eora", "weighting": "fisher"}], "input or kl"),
])
def test_recipe_checks(tmp_path, stages, match):
    from compress import load_recipe
    with pytest.raises(ValueError, match=match):
        load_recipe(tiny_recipe(tmp_path, stages, {"perplexity": False}))


def test_a_silent_input_takes_the_layers_own_hessian_in_the_kls_units(tmp_path):
    """An input channel the kl pass never saw fire but the calibration did (a MoE expert few windows reached): the
    layer's own input Hessian stands in, scaled to the file's trace; otherwise the file's sides, as stored."""
    from safetensors.torch import save_file

    from compress.quantizers import LayerInputs
    from compress.quantizers.gptq_kron import layer_kl_sides, output_hessian_path

    class _Stats:  # the one thing the sides read of the calibration statistics (a stand-in: no pass runs here)
        def __init__(self, h):
            self.h = h

        def hessian_mean(self, divisor=None):
            return self.h.clone()

    h_in, h_out, h_own = _spd(12, 50, 1).float(), _spd(8, 50, 2).float(), 7.0 * _spd(12, 50, 3).float()
    save_file({"output": h_out, "input": h_in}, str(output_hessian_path(tmp_path, "dense")))
    got_out, got_in, own = layer_kl_sides(tmp_path, LayerInputs("dense", _Stats(h_own)), (8, 12))
    assert not own and torch.equal(got_out, h_out) and torch.equal(got_in, h_in)
    silent = h_in.clone()
    silent[3, :] = silent[:, 3] = 0
    save_file({"output": h_out, "input": silent}, str(output_hessian_path(tmp_path, "expert")))
    _, got_in, own = layer_kl_sides(tmp_path, LayerInputs("expert", _Stats(h_own)), (8, 12))
    assert own and torch.allclose(got_in, h_own * (silent.trace() / h_own.trace()), rtol=1e-6)
