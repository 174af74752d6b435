"""lm-eval offline: the adapters against the local files, a two-task run on tiny models with no network,
recovery against the baseline, and the errors that name the fix."""
from __future__ import annotations

import socket

import pytest

from compress.arch import get_arch
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import scheme
from tests.conftest import make_tiny_model, requires_data, shared_data_dir
from tests.tiny_tokenizer import make_tiny_tokenizer

pytest.importorskip("lm_eval")
from compress.measure import harness  # noqa: E402
from compress.resources import resource_dir  # noqa: E402

TASK_DIR = resource_dir("eval") / "lm_eval"


def adapters():
    import importlib.util
    spec = importlib.util.spec_from_file_location("adapters", TASK_DIR / "adapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arc_rows_become_the_hub_columns():
    from datasets import Dataset
    rows = Dataset.from_list([{"id": "x", "question": {"stem": "Which is a gas?", "choices": [
        {"text": "ice", "label": "A"}, {"text": "steam", "label": "B"}]}, "answerKey": "B"}])
    doc = adapters().arc_docs(rows)[0]
    assert doc == {"question": "Which is a gas?", "choices": {"text": ["ice", "steam"], "label": ["A", "B"]},
                   "answerKey": "B"}


@requires_data
def test_local_files_give_the_official_split_sizes():
    a, data = adapters(), shared_data_dir()
    assert [len(a.wiki_pages(data / "wikitext-2-raw" / f)) for f in ("wiki.test.raw", "wiki.valid.raw")] == [62, 60]
    piqa = a.piqa_dataset(str(data))["validation"]
    assert len(piqa) == 1838 and set(piqa["label"]) == {0, 1}


def tokenizer():
    tok = make_tiny_tokenizer()
    tok.eos_token = "[PAD]"  # lm-eval prefixes rolling windows with the EOS id
    return tok


@requires_data
def test_two_tasks_offline_with_stderr_and_recovery(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:1]}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    base = make_tiny_model("llama")
    quant = make_tiny_model("llama")
    stage = QuantizeStage(scheme=scheme("int4", "group", 16))
    apply_quantize(quant, plan_quantize(quant, get_arch(quant), stage), stage)
    out = harness.evaluate_tasks({"baseline": base, "compressed": quant}, tokenizer(), ["arc_easy", "lambada_openai"],
                                 limit=4, baseline="baseline")
    for name in ("baseline", "compressed"):
        assert set(out["scores"][name]) == {"arc_easy", "lambada_openai"}
        assert set(out["scores"][name]["arc_easy"]) == {"acc", "acc_norm"}
        ppl = out["scores"][name]["lambada_openai"]["perplexity"]
        assert ppl["value"] > 1 and ppl["stderr"] is not None and ppl["stderr"] >= 0
    b, c = (out["scores"][n]["lambada_openai"]["perplexity"]["value"] for n in ("baseline", "compressed"))
    assert out["recovery"]["compressed"]["lambada_openai"]["perplexity"] == pytest.approx(b / c)
    d = out["vs_baseline"]["compressed"]["lambada_openai"]["perplexity"]
    bs, cs = (out["scores"][n]["lambada_openai"]["perplexity"]["stderr"] for n in ("baseline", "compressed"))
    assert d["delta"] == pytest.approx(c - b) and d["stderr"] == pytest.approx((bs ** 2 + cs ** 2) ** 0.5)
    assert d["within_noise"] == (abs(c - b) < 2 * d["stderr"])
    assert out["tasks"]["arc_easy"] == {"name": "arc_easy_local", "version": 1.0}
    assert out["limit"] == 4 and out["num_fewshot"] == 0 and "lm-eval" in out["harness"]


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="arc_challenge"):
        harness.check_tasks(["hellaswag"])


def test_without_data_or_hub_the_error_names_the_setting(monkeypatch):
    monkeypatch.setattr("compress.calibrate.data.find_data_dir", lambda: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="COMPRESS_DATA_DIR"):
        harness.evaluate_tasks({"m": make_tiny_model("llama")}, tokenizer(), ["lambada_openai"], limit=1)


def test_difference_flags_what_two_standard_errors_cannot_tell_apart():
    base = {"value": 0.50, "stderr": 0.10}
    assert harness.difference(base, {"value": 0.60, "stderr": 0.10})["within_noise"]  # 0.10 < 2 * 0.141
    far = harness.difference(base, {"value": 0.90, "stderr": 0.10})
    assert far["delta"] == pytest.approx(0.40) and not far["within_noise"]
    assert harness.difference(base, {"value": 0.6, "stderr": None})["within_noise"] is None
