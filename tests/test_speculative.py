"""Speculative decoding: the acceptance rule is exact (a toy p and q over 5 symbols, 10^6 rounds, the emitted
tokens' histogram matches q; without the residual step it does not), greedy speculation reproduces plain greedy
decoding token for token on several families, and the speed-up formula is the lecture's."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from compress.serving import speculative as spec
from tests.conftest import make_tiny_model, requires_data, run_tiny_recipe

P = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.05])  # the draft's distribution
Q = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15])  # the target's
DRAWS = 1_000_000


def _rounds(k: int, resample_residual: bool = True, seed: int = 0):
    """DRAWS independent rounds of drafting k tokens from P and verifying them against Q."""
    g = torch.Generator().manual_seed(seed)
    p = P.expand(DRAWS, k, 5)
    q = Q.expand(DRAWS, k + 1, 5)
    tokens = torch.multinomial(P, DRAWS * k, replacement=True, generator=g).reshape(DRAWS, k)
    n, nxt = spec.accept_sampled(tokens, p, q, g, resample_residual=resample_residual)
    return tokens, n, nxt


def _first_emitted(tokens, n, nxt):
    """The first token a round emits: the first drafted one if kept, else the replacement."""
    return torch.where(n > 0, tokens[:, 0], nxt)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_4DOF_1E6 = 35.0  # chi-square with 4 degrees of freedom exceeds 35 with probability ~5e-7


def test_emitted_token_is_distributed_as_the_target():
    tokens, n, nxt = _rounds(k=1)
    counts = torch.bincount(_first_emitted(tokens, n, nxt), minlength=5).double()
    assert _chi2(counts, Q.double()) < CHI2_4DOF_1E6
    assert torch.allclose(counts / DRAWS, Q.double(), atol=3e-3)
    # the acceptance rate is Σ min(p, q) (the lecture's α for these two distributions)
    assert abs(float(n.double().mean()) - float(torch.minimum(P, Q).sum())) < 3e-3


def test_dropping_the_residual_step_breaks_it():
    tokens, n, nxt = _rounds(k=1, resample_residual=False)
    counts = torch.bincount(_first_emitted(tokens, n, nxt), minlength=5).double()
    assert _chi2(counts, Q.double()) > 1000  # far from q: accepted mass min(p, q) plus q again on rejection
    wrong = torch.minimum(P, Q) + (1 - torch.minimum(P, Q).sum()) * Q  # what that mistake samples
    assert torch.allclose(counts / DRAWS, wrong.double(), atol=3e-3)


def test_every_position_of_a_longer_draft_is_distributed_as_the_target():
    """k = 3: the i-th emitted token of a round (where the round emits one) is distributed as q, and the bonus token
    after three accepted ones too."""
    tokens, n, nxt = _rounds(k=3, seed=1)
    for i in range(3):
        reached = n >= i  # the round emits an i-th token (index i) iff the first i drafted ones were kept
        emitted = torch.where(n[reached] > i, tokens[reached, i], nxt[reached])
        counts = torch.bincount(emitted, minlength=5).double()
        assert _chi2(counts, Q.double()) < CHI2_4DOF_1E6, i
    bonus = torch.bincount(nxt[n == 3], minlength=5).double()
    assert _chi2(bonus, Q.double()) < CHI2_4DOF_1E6
    alpha = float(torch.minimum(P, Q).sum())
    assert abs(float((n == 3).double().mean()) - alpha ** 3) < 3e-3


def test_residual():
    r = spec.residual(Q, P)
    assert torch.allclose(r, (Q - P).clamp_min(0) / (Q - P).clamp_min(0).sum())
    assert torch.equal(spec.residual(Q, Q), Q)  # nothing left over: q itself (never reached by the procedure)


def test_greedy_acceptance():
    logits = torch.full((1, 4, 6), -1.0)
    for i, t in enumerate([2, 5, 1, 3]):
        logits[0, i, t] = 1.0
    n, nxt = spec.accept_greedy(torch.tensor([[2, 5, 0]]), logits)
    assert (int(n), int(nxt)) == (2, 1)  # the third drafted token (0) is not the argmax (1): replaced
    n, nxt = spec.accept_greedy(torch.tensor([[2, 5, 1]]), logits)
    assert (int(n), int(nxt)) == (3, 3)  # all kept, plus the bonus token


def test_expected_tokens_and_speedup():
    assert spec.expected_tokens(0.0, 4) == 1.0
    assert spec.expected_tokens(1.0, 4) == 5.0
    assert math.isclose(spec.expected_tokens(0.8, 4), sum(0.8 ** i for i in range(5)))
    assert math.isclose(spec.predicted_speedup(0.8, 4, draft_cost=0.1), (1 - 0.8 ** 5) / 0.2 / 1.4)
    assert spec.best_k(0.95, 0.01) == spec.K_MAX  # a nearly free, nearly always right draft: the longest
    assert spec.best_k(0.3, 0.5) == 1
    with pytest.raises(ValueError, match="acceptance rate"):
        spec.expected_tokens(1.5, 2)


def _reference_greedy(model, prompt, n):
    """Plain greedy decoding without a cache: argmax of a full forward at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _near_copy(model, noise: float, seed: int = 1):
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "phi3", "opt", "gpt_neox", "gpt2"])
def test_greedy_speculation_equals_plain_greedy(family):
    target = make_tiny_model(family, seed=0).double()
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _reference_greedy(target, prompt, 24)
    assert spec.generate_plain(target, prompt, 24).tokens == want
    for draft, k in ((_near_copy(target, 0.3), 4), (make_tiny_model(family, seed=5).double(), 3)):
        got = spec.generate_speculative(target, draft, prompt, 24, k=k)
        assert got.tokens == want
        assert got.target_steps == len(got.ks) and sum(got.ks) == got.proposed
    self_draft = spec.generate_speculative(target, target, prompt, 24, k=5)
    assert self_draft.tokens == want and self_draft.alpha == 1.0  # the target as its own draft: all accepted
    assert self_draft.target_steps == math.ceil(24 / 6)


def test_adaptive_k_and_sampling_run_on_a_model():
    target = make_tiny_model("llama", seed=0).double()
    prompt = list(range(3, 15))
    want = _reference_greedy(target, prompt, 30)
    got = spec.generate_speculative(target, _near_copy(target, 0.1), prompt, 30, k=1, adaptive=True)
    assert got.tokens == want and all(1 <= k <= spec.K_MAX for k in got.ks)  # (the schedule itself: test above)
    g = torch.Generator().manual_seed(0)
    sampled = spec.generate_speculative(target, _near_copy(target, 0.3), prompt, 30, k=4, temperature=1.0,
                                        generator=g)
    assert len(sampled.tokens) == 30 and 0 < sampled.alpha < 1


def _small_llama(seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config).double().eval()


def test_sampling_on_a_model_matches_the_target_distribution():
    """Through the generation loop on real (small) models: the first token after a prompt, drawn by speculative
    sampling with a different draft, follows the target's softmax (1,000 draws, chi-square over 16 tokens); the
    draft's own distribution is far from it, so a loop that kept the draft's tokens would fail."""
    target, draft = _small_llama(0), _small_llama(3)
    with torch.no_grad():
        for p in target.parameters():  # sharpen the logits so that the two distributions differ clearly
            p.mul_(3.0)
    prompt = [1, 5, 7, 2]
    with torch.no_grad():
        q = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1).double()
        p_draft = torch.softmax(draft(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1).double()
    g = torch.Generator().manual_seed(0)
    n = 1000
    draws = torch.tensor([spec.generate_speculative(target, draft, prompt, 1, k=1, temperature=1.0,
                                                    generator=g).tokens[0] for _ in range(n)])
    counts = torch.bincount(draws, minlength=16).double()
    assert _chi2(counts, q) < 15 + 6 * math.sqrt(2 * 15)  # ~6 standard deviations of a chi-square with 15 dof
    assert _chi2(counts, p_draft) > 200


def test_mismatched_vocabularies_are_refused():
    a = make_tiny_model("llama")
    b = make_tiny_model("gpt2")
    b.resize_token_embeddings(300)
    with pytest.raises(ValueError, match="tokenizer"):
        spec.generate_speculative(a, b, [1, 2, 3], 4)


def test_adaptive_verify_cost_is_learned_per_length():
    """The adaptive schedule's verify cost: the median measured at a length, else the cheapest shorter one measured
    (the optimistic bound: a length is tried once before a jump in its cost, as this CPU's float32 matmul has at 4
    rows, is known)."""
    measured = {1: [1.0, 1.2, 1.1], 2: [1.05], 4: [1.8, 1.7, 1.9]}
    assert spec._verify_estimate(measured, 1) == 1.1
    assert spec._verify_estimate(measured, 3) == 1.1  # unmeasured: the dearest of the shorter lengths 1 and 2
    assert spec._verify_estimate(measured, 4) == 1.8
    assert spec._verify_estimate(measured, 8) == 1.8
    assert spec._verify_estimate({4: [1.8], 6: [2.0]}, 2) == 1.8  # none shorter: the cheapest longer one
    # with those costs and a draft step at 0.2 of a verify step, K = 4 no longer pays, K = 3 (unmeasured) is tried
    alpha = 0.8
    assert spec.best_k(alpha, 0.2, lambda k: spec._verify_estimate(measured, k)) == 3
    assert spec.best_k(alpha, 0.2, lambda k: spec._verify_estimate({**measured, 3: [1.8]}, k)) == 2


def test_int4_copy_quantizes_a_copy_and_reports_what_it_kept():
    from compress.measure.speculation import int4_copy
    from compress.core.nn import QuantLinear
    from compress.core.scheme import W4A16_ASYM_G64

    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    draft, kept = int4_copy(model, dtype=torch.float32, fuse=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the target is untouched
    quantized = {n for n, m in draft.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 2 * 7 + 1 and "lm_head" in quantized and not kept  # 7 linears per block + the head
    assert draft.lm_head.scheme.dtype == "int8"
    fused, kept = int4_copy(model, dtype=torch.float32)  # q/k/v and gate/up fused: 4 layers a block, same bytes
    layers = {m for m in fused.modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 2 * 4 + 1 and not kept
    assert sum(m.qdata.numel() for m in layers) == sum(draft.get_submodule(n).qdata.numel() for n in quantized)
    # a group the input width does not divide: that layer stays in float, with the reason
    from dataclasses import replace
    draft, kept = int4_copy(model, replace(W4A16_ASYM_G64, group_size=128), dtype=torch.float32)
    assert len(kept) == 2 * 6 and all("not a multiple of group 128" in k for k in kept)  # all but down_proj
    assert isinstance(draft.model.layers[0].mlp.down_proj, QuantLinear)


def test_measure_draft_reports_each_length_and_checks_greedy_outputs():
    from compress.measure.speculation import int4_copy, measure_draft, render

    target = make_tiny_model("llama").double()
    draft, _ = int4_copy(target, dtype=torch.float64)
    prompts = [list(range(5, 21)), list(range(40, 56))]
    result = measure_draft(target, draft, prompts, max_new_tokens=12, ks=(1, 3), adaptive=True)
    assert result["greedy_mismatches"] == 0
    assert [r["k"] for r in result["rows"]] == [1, 3, "adaptive"]
    for r in result["rows"]:
        assert r["tokens"] == 2 * 12 and 0 <= r["alpha"] <= 1 and r["speedup"] > 0
        assert r["accepted"] <= r["proposed"] and r["target_steps"] >= 2 * 12 / 4 - 1e-9
    k3 = result["rows"][1]
    assert k3["tokens_per_step"] <= 4 and abs(k3["expected_tokens_per_step"] - spec.expected_tokens(k3["alpha"], 3)) < 1e-12
    assert any("| 3 |" in line for line in render(result))
    # the roofline counts float tensors at bf16 whatever their dtype here (this target is float64)
    from compress.measure.speculation import roofline_rows
    params = sum(p.numel() for p in target.parameters())
    assert result["target_serving_bytes"] == 2 * params and result["target_bytes"] == 8 * params
    rows = roofline_rows(result, target.config, draft.config, ["H100-SXM"])
    from compress.measure.memory import serving_bytes
    assert result["draft_serving_bytes"] == serving_bytes(draft) < result["target_serving_bytes"]
    assert [r["k"] for r in rows] == [1, 3, "adaptive"] and all(0 < r["draft_cost"] < 1 for r in rows)


@requires_data
def test_speculate_command_writes_its_measurement(tmp_path, capsys):
    import json

    from compress.cli.commands import main
    from tests.tiny_tokenizer import make_tiny_tokenizer

    folder = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "spec.json"
    assert main(["speculate", str(folder), "--draft", "self-int4", "--prompts", "2", "--prompt-tokens", "16",
                 "--max-new-tokens", "6", "--k", "1-2", "--accelerator", "H100-SXM", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["k"] for r in result["rows"]] == [1, 2, "adaptive"] and result["greedy_mismatches"] == 0
    assert {r["k"] for r in result["roofline"]} == {1, 2, "adaptive"}
    assert "as a draft for" in capsys.readouterr().out
    from compress.kernels.cpu_rows import RowsUnavailable, load
    try:
        load()
        assert result["kernels"] == "rows"  # auto at one thread: the few-row kernels, for plain and draft alike
    except RowsUnavailable:
        assert result["kernels"] == "torch" and any("kernels:" in n for n in result["notes"])
    assert main(["speculate", str(folder), "--draft", "self-int4", "--kernels", "rows", "--dtype", "bfloat16"]) == 2
    assert "--kernels rows: the few-row kernels are float32" in capsys.readouterr().err
    assert main(["speculate", str(folder), "--draft", "self-int4", "--k", "0"]) == 2
    assert main(["speculate", str(folder), "--draft", "self-int4", "--accelerator", "TPU-v9"]) == 2


def test_acceptance_rate_is_the_lecture_alpha_at_any_draft_length():
    """accepted / (accepted + rejected) recovers Σ min(p, q) from rounds of K = 6; accepted / proposed does not
    (it counts the never-judged tokens after a rejection)."""
    tokens, n, nxt = _rounds(k=6)
    alpha = float(torch.minimum(P, Q).sum())
    accepted, rejected = int(n.sum()), int((n < 6).sum())
    assert abs(spec.acceptance_rate(accepted, rejected) - alpha) < 3e-3
    assert accepted / n.numel() / 6 < alpha - 0.1
    assert abs(float(n.double().mean() + 1) - spec.expected_tokens(alpha, 6)) < 1e-2  # the lecture's E[tokens]


@requires_data
def test_a_run_measures_its_model_as_a_draft_for_the_original(tmp_path):
    import json

    out = run_tiny_recipe(tmp_path, [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 32}}],
                          {"perplexity": False, "speed": False, "samples": 0, "speculative": [1, 3], "speculative_prompts": 2,
                           "speculative_prompt_tokens": 16, "speculative_new_tokens": 8})
    section = json.loads((tmp_path / "out" / "report.json").read_text())["eval"]["speculative"]
    assert [r["k"] for r in section["rows"]] == [1, 3, "adaptive"] and section["greedy_mismatches"] == 0
    assert all(r["tokens"] == 2 * 8 for r in section["rows"]) and section["roofline"]
    assert section["kernels"] == "rows" or section["kernels"].startswith("kernels: ")  # which loop; why not rows
    assert "as a speculative-decoding draft for the original" in (tmp_path / "out" / "report.md").read_text()
    with pytest.raises(ValueError, match="draft lengths"):
        from compress.recipe import EvalSpec
        EvalSpec(speculative=(0,))


@torch.no_grad()
def test_a_vocabulary_subset_draft_keeps_decoding_exact():
    """A draft whose head covers only some tokens proposes only those, and both verifications stay exact: greedy
    equals plain decoding; the sampled first token follows the target's distribution (χ² over many seeds would be
    slow here, so: every token the subset excludes still appears through the residual)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from compress.measure.speculation import VocabSubsetHead, int4_copy

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2)).eval()
    ids = torch.arange(0, 64, 2)  # the even tokens only
    draft, _ = int4_copy(target, dtype=torch.float32, vocab_ids=ids)
    head = draft.get_output_embeddings()
    assert isinstance(head, VocabSubsetHead) and head.out_features == 64
    logits = draft(torch.tensor([[1, 2, 3]])).logits[0]
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    prompt = [1, 5, 9, 13]
    plain = spec.generate_plain(target, prompt, 20).tokens
    assert any(t % 2 for t in plain)  # the target emits tokens the draft can never propose ...
    for k in (1, 4):
        assert spec.generate_speculative(target, draft, prompt, 20, k=k).tokens == plain  # ... and greedy stays exact
    seen = {spec.generate_speculative(target, draft, prompt, 1, k=2, temperature=1.0,
                                 generator=torch.Generator().manual_seed(s)).tokens[0] for s in range(200)}
    assert any(t % 2 for t in seen)  # sampling reaches the excluded tokens through the residual
