"""The scorer (evaluate/ppl.py) against independent computations: transformers' own loss for perplexity, and a
plain full-logits implementation of KL(baseline || model) and top-1 agreement."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from compress.arch import get_arch
from compress.evaluate.ppl import score_windows
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

    from compress.evaluate.ppl import _final_hidden, final_logits
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
