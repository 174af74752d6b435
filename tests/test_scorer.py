"""The scorer (measure/ppl.py) against independent computations: transformers' own loss for perplexity, and a
plain full-logits implementation of KL(baseline || model) and top-1 agreement."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from compress.arch import get_arch
from compress.measure import ppl
from compress.measure.ppl import score_windows
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import scheme
from tests.conftest import TINY_CONFIGS, make_tiny_model, requires_data


def hf_perplexity(model, windows: torch.Tensor) -> float:
    """exp of the mean of transformers' own causal-LM loss (mean over each window's seq_len - 1 predictions; every
    window has as many)."""
    with torch.no_grad():
        losses = [float(model(input_ids=w[None], labels=w[None]).loss) for w in windows]
    return math.exp(sum(losses) / len(losses))


def plain_kl_top1(base, model, windows: torch.Tensor) -> tuple[float, float]:
    """Full logits in float64, every position but the last (it predicts nothing scored)."""
    kl, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for w in windows:
            p = torch.log_softmax(base(input_ids=w[None]).logits[0, :-1].double(), -1)
            q = torch.log_softmax(model(input_ids=w[None]).logits[0, :-1].double(), -1)
            kl += float((p.exp() * (p - q)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            n += p.shape[0]
    return kl / n, agree / n


def _int2(model):
    m = copy.deepcopy(model)
    stage = QuantizeStage(scheme=scheme("int2", "group", 16, symmetric=False))
    apply_quantize(m, plan_quantize(m, get_arch(m), stage), stage)
    return m


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_perplexity_equals_transformers_loss(family):
    model = make_tiny_model(family)
    windows = torch.randint(0, 256, (3, 40))
    ours = score_windows({"m": model}, windows, progress=False)["m"]
    assert ours.tokens == 3 * 39
    assert ours.ppl == pytest.approx(hf_perplexity(model, windows), rel=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2", "opt", "gpt2"])
def test_kl_and_top1_equal_a_plain_implementation(family):
    base = make_tiny_model(family)
    with torch.no_grad():  # sharper next-token distributions than a random init's near-uniform ones
        head = base.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach() * 20)  # untied from the input embedding
    quantized = _int2(base)
    windows = torch.randint(0, 256, (2, 48))
    scores = score_windows({"base": base, "q": quantized}, windows, baseline="base", progress=False)
    kl, top1 = plain_kl_top1(base, quantized, windows)
    assert kl > 1e-3  # int2 g16 moves the distribution: the comparison is not 0 == 0
    assert scores["q"].kl == pytest.approx(kl, rel=1e-4)
    assert scores["q"].top1_agreement == pytest.approx(top1, abs=1 / (2 * 47) + 1e-12)  # at most one near-tie flip
    assert scores["base"].kl == 0 and scores["base"].top1_agreement == 1.0


@pytest.mark.slow  # 26 s: test_perplexity_equals_transformers_loss checks the same on every tiny family by default
@requires_data
def test_perplexity_on_the_embedded_model_equals_transformers_loss():
    from compress.pipeline.report import eval_windows
    from compress.model.load import load_model

    loaded = load_model("default")
    windows = eval_windows(loaded.tokenizer, "test", 512, 2)
    with torch.no_grad():
        ours = score_windows({"m": loaded.model}, windows, progress=False)["m"]
    theirs = hf_perplexity(loaded.model, windows)
    assert 5 < theirs < 80  # a real language model on WikiText-2
    assert ours.ppl == pytest.approx(theirs, rel=1e-4)


HEAD_SCALED = {  # families whose causal-LM forward does more to the head's output than Gemma's soft-capping
    "cohere2": {},  # logits * logit_scale (0.0625 by default)
    "granite": {"logits_scaling": 4.0},  # logits / logits_scaling
    "falcon_h1": {"lm_head_multiplier": 0.5},  # logits * lm_head_multiplier
}


@pytest.mark.parametrize("family", sorted(HEAD_SCALED))
def test_logits_from_final_hidden_states_are_the_models_own(family):
    """final_logits (the in-memory and the streamed evaluation's, and the block-by-block fisher pass's) gives the
    model's own logits from its final hidden states, whatever the family applies after the head; with `head`, those
    of another head (a streamed run's float baseline beside its quantized head). The head alone is off by the scale:
    what the streamed evaluation computed before."""
    import transformers

    from compress.measure.ppl import _final_hidden, final_logits
    from tests.conftest import _COMMON

    if family == "granite":
        torch.manual_seed(0)
        config = transformers.GraniteConfig(**_COMMON, **HEAD_SCALED[family])
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    else:
        model = make_tiny_model(family, **HEAD_SCALED[family])
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    other = copy.deepcopy(model)
    with torch.no_grad():
        head = other.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach() * 1.5)  # untied from the input embedding
        hidden = _final_hidden(model, ids)
        want = model(input_ids=ids).logits
        torch.testing.assert_close(final_logits(model, hidden), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(final_logits(model, hidden[0]), want[0], rtol=0, atol=1e-6)  # [seq, hidden]
        torch.testing.assert_close(final_logits(model, hidden, other.get_output_embeddings()),
                                   other(input_ids=ids).logits, rtol=0, atol=1e-6)
        assert model.get_output_embeddings() is not other.get_output_embeddings()  # the model's own head is back
        assert (model.get_output_embeddings()(hidden) - want).abs().max() > 1e-3
    windows = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    ours = score_windows({"m": model}, windows, progress=False)["m"]
    assert ours.ppl == pytest.approx(hf_perplexity(model, windows), rel=1e-4)


# ---------------------------------------------------------------- windows longer than one logits chunk
# The scorer runs one forward per window but turns its final hidden states into logits ppl.CHUNK positions at a time;
# the tests above use windows shorter than a chunk, so they cannot see a position lost or counted twice at a chunk
# edge. Here windows of 2 chunks exactly, 2 chunks + 1 position and 2.5 chunks of predictions are scored against one
# full forward over the whole window, per-token NLL by F.cross_entropy in float64.
#
# Tolerance rel 1e-5 on the summed NLL: the scorer sums each chunk's log-probs in float32 (512 terms of ~24 nats:
# worst-case rounding ~log2(512) * 6e-8 ≈ 5e-7 relative) from logits computed on a chunk of rows instead of the whole
# window (matmul blocking: ~1e-7 relative per logit); measured below 1e-7 (llama). One position dropped or counted
# twice per chunk moves the sum by >= 1/1280 ≈ 8e-4 relative (the sharpened heads give every position several nats),
# 80x the tolerance.

LONG = [2 * 512 + 1, 2 * 512 + 2, 2 * 512 + 256 + 1]  # window lengths: 2 chunks of predictions, one over, 2.5 chunks
LONG_IDS = ["2chunks", "2chunks+1", "2.5chunks"]


def plain_nll(model, windows: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (float64) and the number of predictions, from one full forward per window."""
    total, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w[None], use_cache=False).logits[0, :-1].double()
            total += float(F.cross_entropy(logits, w[1:], reduction="sum"))
            n += w.numel() - 1
    return total, n


def _long_model(family: str):
    """A tiny model that takes 2048 positions, its head sharpened (x20, untied from the input embedding) so that
    per-token NLLs spread over several nats instead of all sitting near log(vocab)."""
    model = make_tiny_model(family, max_position_embeddings=2048)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach() * 20)
    return model


def _assert_nll_matches(scores, model, windows):
    total, n = plain_nll(model, windows)
    assert scores.tokens == n
    assert scores.nll * scores.tokens == pytest.approx(total, rel=1e-5)
    assert scores.ppl == pytest.approx(math.exp(total / n), rel=1e-5)


@pytest.mark.parametrize("seq_len", LONG, ids=LONG_IDS)
@pytest.mark.parametrize("family", ["llama", "gemma2", "opt", "gpt2"])
def test_perplexity_over_several_chunks_equals_one_full_forward(family, seq_len):
    """The real CHUNK (512) on families whose logits are computed differently: tied head (llama), soft-capped logits
    and a sliding window (gemma2), a decoder inside a wrapper with learned positions (opt), Conv1D (gpt2)."""
    assert ppl.CHUNK == 512  # LONG is written for it
    model = _long_model(family)
    windows = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    _assert_nll_matches(score_windows({"m": model}, windows, progress=False)["m"], model, windows)


@pytest.mark.parametrize("targets", [32, 33, 40], ids=["2chunks", "2chunks+1", "2.5chunks"])
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_perplexity_over_several_small_chunks_every_family(family, targets, monkeypatch):
    """The same chunk edges on every tiny family, with 16-position chunks (CHUNK is read at each call) so that the
    windows stay within the families' 256 positions."""
    monkeypatch.setattr(ppl, "CHUNK", 16)
    model = _long_model(family)
    windows = torch.randint(0, 256, (2, targets + 1), generator=torch.Generator().manual_seed(targets))
    _assert_nll_matches(score_windows({"m": model}, windows, progress=False)["m"], model, windows)


@pytest.mark.parametrize("seq_len", LONG, ids=LONG_IDS)
def test_kl_top1_and_both_perplexities_over_several_chunks(seq_len):
    """With a baseline every chunk is scored by both models in turn: KL and top-1 over windows of several chunks
    equal the plain full-logits implementation (float64), and each model's perplexity its full forward's. KL
    tolerance rel 1e-4: a sum of float32 p * (log p - log q) terms, each difference of two ~24-nat log-probs off by
    ~1e-6, against a KL of ~3e-4 to 2e-3 nats per position (measured up to 8e-6 relative); one position dropped or
    counted twice per chunk moves it by ~1e-3 relative. Top-1 may flip at one near-tie position (float32 chunked
    logits against float64 full ones)."""
    base = _long_model("llama")
    quantized = _int2(base)
    windows = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    scores = score_windows({"q": quantized, "base": base}, windows, baseline="base", progress=False)
    kl, top1 = plain_kl_top1(base, quantized, windows)
    n = 2 * (seq_len - 1)
    assert kl > 1e-4  # int2 g16 moves the distribution (measured 3e-4 to 2e-3 here): the comparison is not 0 == 0
    assert scores["q"].kl == pytest.approx(kl, rel=1e-4)
    assert scores["q"].top1_agreement == pytest.approx(top1, abs=1 / n + 1e-12)
    assert scores["base"].kl == 0 and scores["base"].top1_agreement == 1.0
    _assert_nll_matches(scores["base"], base, windows)
    _assert_nll_matches(scores["q"], quantized, windows)


def test_score_hidden_over_several_chunks_reads_each_windows_own_hidden_states():
    """score_hidden (the streamed run's and distillation's entry point) with hidden states handed in per window index,
    as a block-by-block pass carries them: the same scores as one full forward per window, KL included."""
    from compress.measure.ppl import _final_hidden, final_logits

    base = _long_model("llama")
    quantized = _int2(base)
    models = {"base": base, "q": quantized}
    windows = torch.randint(0, 256, (3, LONG[2]), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = {n: [_final_hidden(m, w[None])[0, :-1] for w in windows] for n, m in models.items()}
    final = {n: (lambda k, ids, n=n: hidden[n][k]) for n in models}
    logits = {n: (lambda h, m=m: final_logits(m, h)) for n, m in models.items()}
    scores = ppl.score_hidden(final, logits, windows, baseline="base", progress=False)
    kl, _ = plain_kl_top1(base, quantized, windows)
    assert scores["q"].kl == pytest.approx(kl, rel=1e-4)
    _assert_nll_matches(scores["base"], base, windows)
    _assert_nll_matches(scores["q"], quantized, windows)


@pytest.mark.parametrize("family", ["llama", "opt", "gemma2"])
def test_windows_side_by_side_score_what_one_thread_scores(family):
    """On a CPU of more than one thread, score_windows runs two windows at once (one thread each) where the head
    alone gives the model's logits; the scores are a one-thread run's bit for bit. Gemma 2 soft-caps its logits
    after the head: its windows stay on the caller's thread (final_logits swaps a stand-in forward in per call)."""
    import threading
    from compress.threads import cpu_threads
    base = make_tiny_model(family)
    quantized = _int2(base)
    windows = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(4))
    plain = ppl._plain_head(base, get_arch(base)) is not None
    assert plain == (family != "gemma2")
    seen = []

    def where(*_):
        seen.append(threading.get_ident())
    where.thread_safe = True
    handle = base.register_forward_pre_hook(where) if not plain else \
        ppl._trunks(base)[0].register_forward_pre_hook(where)
    try:
        runs = []
        for threads in (1, 2):
            with cpu_threads(threads):
                runs.append(score_windows({"base": base, "q": quantized}, windows, baseline="base", progress=False))
    finally:
        handle.remove()
    assert runs[0] == runs[1]
    off_caller = sum(t != threading.get_ident() for t in seen[len(windows):])
    assert off_caller == (len(windows) if plain else 0)
