"""Generated samples (compress/measure/samples.py): greedy continuations of the report's fixed prompts, where a model
first departs from the baseline, the report section, and `compress generate`."""
from __future__ import annotations

import json

import pytest
import torch

from compress.measure.samples import PROMPTS, first_difference, generate_samples, greedy, prompt_ids, render
from tests.conftest import make_tiny_model, requires_data, run_tiny_recipe
from tests.tiny_tokenizer import CHAT_TEMPLATE, byte_bpe_tokenizer, make_tiny_tokenizer


@torch.no_grad()
def reference_greedy(model, ids: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
    """The plainest greedy decoding: the whole sequence through the model for each token (no cache), its last
    position's argmax appended, until `n` tokens or a stop id."""
    seq, new = list(ids), []
    for _ in range(n):
        token = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        new.append(token)
        seq.append(token)
        if token in stop:
            break
    return new


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_the_continuation_is_the_reference_greedy_loop(family):
    model, tok = make_tiny_model(family), make_tiny_tokenizer()
    model.generation_config.eos_token_id = model.config.eos_token_id = None  # the whole length, no stop
    continuations = []
    for _, prompt in PROMPTS:
        ids, _ = prompt_ids(tok, prompt)
        ours = greedy(model, ids, 12)
        assert ours == reference_greedy(model, ids, 12), prompt
        continuations.append(ours)
    assert len(set(sum(continuations, []))) > 3  # a varied continuation, not one token repeated


def test_the_continuation_ends_at_an_end_of_sequence_id():
    model, tok = make_tiny_model("qwen2"), make_tiny_tokenizer()
    ids, _ = prompt_ids(tok, PROMPTS[1][1])
    full = reference_greedy(model, ids, 12)
    stop = full[4]  # a token the model generates fifth (and maybe earlier)
    ours = greedy(model, ids, 12, [stop])
    assert ours == reference_greedy(model, ids, 12, (stop,)) and ours[-1] == stop and len(ours) <= 5
    # the report's samples stop where the model's config says its sequence ends
    model.config.eos_token_id, model.generation_config.eos_token_id = stop, None
    (section,) = [p for p in generate_samples({"m": model}, tok, 12)["prompts"] if p["prompt"] == PROMPTS[1][1]]
    assert section["outputs"]["m"]["tokens"] == ours


@pytest.mark.parametrize("a,b,index", [
    ([1, 2, 3], [1, 2, 3], None), ([], [], None), ([5, 2, 3], [1, 2, 3], 0), ([1, 2, 3, 4], [1, 2, 9, 4], 2),
    ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1], 1), ([], [7], 0)])
def test_first_difference(a, b, index):
    assert first_difference(a, b) == index
    assert first_difference(b, a) == index


def test_the_chat_template_is_used_when_the_tokenizer_has_one():
    chat, plain = byte_bpe_tokenizer(), make_tiny_tokenizer()
    assert chat.chat_template == CHAT_TEMPLATE and not getattr(plain, "chat_template", None)
    prompt = "the quick brown fox"
    ids, text = prompt_ids(chat, prompt)
    assert text == "<|user|>the quick brown fox" and ids == chat(text, add_special_tokens=False)["input_ids"]
    ids, text = prompt_ids(chat, prompt, chat=False)
    assert text == prompt and ids == chat(prompt)["input_ids"]
    ids, text = prompt_ids(plain, prompt)
    assert text == prompt and ids == plain(prompt)["input_ids"]
    model = make_tiny_model("qwen2")
    assert generate_samples({"m": model}, chat, 2)["chat_template"] is True
    assert generate_samples({"m": model}, chat, 2, chat=False)["chat_template"] is False
    assert generate_samples({"m": model}, plain, 2)["chat_template"] is False


def test_two_models_side_by_side_with_where_they_part():
    tok = make_tiny_tokenizer()
    base, other = make_tiny_model("qwen2"), make_tiny_model("qwen2", seed=1)
    for m in (base, other):
        m.generation_config.eos_token_id = m.config.eos_token_id = None
    section = generate_samples({"baseline": base, "compressed": other, "same": base}, tok, 8, baseline="baseline")
    assert [p["name"] for p in section["prompts"]] == [n for n, _ in PROMPTS]
    for p in section["prompts"]:
        b, c = p["outputs"]["baseline"]["tokens"], p["outputs"]["compressed"]["tokens"]
        assert p["outputs"]["baseline"]["text"] == tok.decode(b, skip_special_tokens=True)
        assert p["first_difference"]["same"] is None
        diff = p["first_difference"]["compressed"]
        i = next(k for k in range(8) if b[k] != c[k])  # two different random models part somewhere
        assert diff == {"index": i, "agreed_text": tok.decode(b[:i], skip_special_tokens=True)}
    md = "\n".join(render(section))
    assert "| prompt | baseline | compressed | same | first difference |" in md
    assert md.count("same: identical") == 3 and md.count("compressed: token ") == 3


def test_generated_text_keeps_the_table_intact():
    """Code, pipes and line breaks in a continuation stay inside their cell."""
    text = "```python\ndef f(a, b):\n    return a | b < 3\n```"
    section = {"new_tokens": 4, "device": "cpu", "chat_template": True, "baseline": "baseline", "prompts": [
        {"name": "code", "prompt": "Write | code", "rendered": "", "first_difference": {"compressed": None},
         "outputs": {"baseline": {"text": text, "tokens": []}, "compressed": {"text": text, "tokens": []}}}]}
    row = render(section)[-1]
    cells = [c for c in row.replace("\\|", "").split("|")][1:-1]
    assert len(cells) == 4 and cells[-1].strip() == "identical" and "\n" not in row
    assert "\\`\\`\\`python<br>def f(a, b):<br>    return a \\| b &lt; 3" in row


def test_without_a_baseline_the_model_alone():
    from compress.pipeline.report import evaluate_models, samples_section
    from compress.recipe import EvalSpec

    tok = make_tiny_tokenizer()
    spec = EvalSpec(perplexity=False, speed=False, baseline=False, samples=4)
    section = evaluate_models({"compressed": make_tiny_model("qwen2")}, tok, spec, progress=False)["samples"]
    assert section["baseline"] is None and all(list(p["outputs"]) == ["compressed"] and "first_difference" not in p
                                               for p in section["prompts"])
    md = "\n".join(render(section))
    assert "| prompt | compressed |" in md and "first difference" not in md
    assert "samples" not in evaluate_models({"m": make_tiny_model("qwen2")}, tok,
                                            EvalSpec(perplexity=False, speed=False, samples=0), progress=False)
    skipped = samples_section({"m": make_tiny_model("qwen2")}, tok, 4, None, offloaded=lambda m: ["model.layers.1"])
    assert "offloaded" in skipped["skipped"] and "Not generated: m offloaded" in "\n".join(render(skipped))


def test_eval_samples_is_validated():
    from compress.recipe import EvalSpec, RecipeError, build

    assert build(EvalSpec, {"samples": 0}, "eval", "r.yaml").samples == 0 and EvalSpec().samples == 32
    with pytest.raises(RecipeError, match="eval.samples must be new tokens in 0..4096"):
        build(EvalSpec, {"samples": -1}, "eval", "r.yaml")
    with pytest.raises(RecipeError, match="`eval.samples` must be"):
        build(EvalSpec, {"samples": "many"}, "eval", "r.yaml")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("samples")
    stages = [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "granularity": "group",
                                                                 "group_size": 16, "symmetric": True}}]
    return tmp, run_tiny_recipe(tmp, stages, {"seq_len": 64, "max_windows": 1, "speed": False, "threads": 1,
                                              "samples": 6})


@requires_data
def test_a_run_reports_both_models_samples(tiny_run):
    tmp, out = tiny_run
    report = json.loads((out / "report.json").read_text())
    section = report["eval"]["samples"]
    assert "skipped" not in section and section["new_tokens"] == 6 and section["baseline"] == "baseline"
    from compress.model.load import load_model
    source = load_model(str(tmp / "tiny"), "float32")
    for (name, prompt), p in zip(PROMPTS, section["prompts"]):
        assert (p["name"], p["prompt"], list(p["outputs"])) == (name, prompt, ["baseline", "compressed"])
        ids, _ = prompt_ids(source.tokenizer, prompt)
        stop = (source.model.config.eos_token_id,)  # 2: "the" in the word vocabulary
        assert p["outputs"]["baseline"]["tokens"] == reference_greedy(source.model, ids, 6, stop)
        assert 1 <= len(p["outputs"]["compressed"]["tokens"]) <= 6
        base = p["outputs"]["baseline"]["tokens"]
        i = first_difference(base, p["outputs"]["compressed"]["tokens"])
        assert p["first_difference"]["compressed"] == (None if i is None else {
            "index": i, "agreed_text": source.tokenizer.decode(base[:i], skip_special_tokens=True)})
    md = (out / "report.md").read_text()
    assert "## Generated samples" in md and "at most 6 new tokens" in md
    assert md.index("## Memory") < md.index("## Generated samples")
    for p in section["prompts"]:
        assert f"| {p['prompt']} | {p['outputs']['baseline']['text']} | {p['outputs']['compressed']['text']} |" in md


@requires_data
def test_compress_generate_on_a_run_folder(tiny_run, capsys):
    from compress.cli.commands import main

    tmp, out = tiny_run
    assert main(["generate", str(out), "the quick brown fox", "--max-new-tokens", "4", "--baseline",
                 str(tmp / "tiny"), "--json"]) == 0
    section = json.loads(capsys.readouterr().out)
    (p,) = section["prompts"]
    assert p["prompt"] == "the quick brown fox" and list(p["outputs"]) == ["baseline", "model"]
    assert section["chat_template"] is False and all(1 <= len(o["tokens"]) <= 4 for o in p["outputs"].values())
    assert main(["generate", str(out), "--max-new-tokens", "3"]) == 0  # no prompt: the report's three
    printed = capsys.readouterr().out
    assert all(f"prompt: {prompt}" in printed for _, prompt in PROMPTS) and "--- model ---" in printed
    assert "first difference" not in printed
    assert main(["generate", str(out), "the", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens 0" in capsys.readouterr().err


@pytest.mark.slow  # loading SmolLM2 from its GGUF takes ~20 s on the 2-core machine
def test_compress_generate_on_the_embedded_model(capsys):
    from compress.cli.commands import main

    assert main(["generate", "default", "What is the capital of France?", "--max-new-tokens", "8",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("prompt (chat template): What is the capital of France?") and "Paris" in printed


def _quantized(family: str):
    """A tiny model whose every linear but the head is an int4 QuantLinear (round to nearest)."""
    from compress.arch import set_module
    from compress.core.nn import QuantLinear
    from compress.core.scheme import scheme
    from compress.quantizers.rtn import quantize_rtn
    model = make_tiny_model(family)
    w4 = scheme("int4", "group", 16, symmetric=False)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            set_module(model, name, QuantLinear.from_module(m, quantize_rtn(m.weight.detach(), w4)))
    return model


def test_samples_through_weights_dequantized_once_are_the_per_call_samples():
    """The evaluation dequantizes a quantized model's weights once where the copy fits (dequantized_if_room):
    the samples and logits are what each call's own dequantization gives, bit for bit; without room, nothing is
    cached."""
    from compress.core.nn import QuantLinear, dequantized_if_room
    model, tok = _quantized("qwen2"), make_tiny_tokenizer()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    ids = torch.randint(0, 256, (1, 40))
    per_call, logits = generate_samples({"m": model}, tok, 12), model(ids).logits
    need = sum(m.in_features * m.out_features for m in layers) * 4
    with dequantized_if_room(model, torch.float32, free=2 * need - 2):
        assert all(m._weight_cache is None for m in layers)
    with dequantized_if_room(model, torch.float32, free=2 * need):
        assert all(m._weight_cache is not None for m in layers)
        assert generate_samples({"m": model}, tok, 12) == per_call
        assert torch.equal(model(ids).logits, logits)
    assert all(m._weight_cache is None for m in layers)


def test_the_evaluation_caches_for_the_samples_and_not_for_the_speed_run(monkeypatch):
    """A cached layer bypasses its dispatch plan's kernels: the speed run must see the per-call layers."""
    import compress.measure.samples as samples
    import compress.pipeline.report as report
    from compress.core.nn import QuantLinear
    from compress.recipe import EvalSpec
    model, tok = _quantized("qwen2"), make_tiny_tokenizer()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    cached = {}
    real_samples, real_speed = samples.generate_samples, report.measure_speed

    def spy_samples(*args, **kwargs):
        cached["samples"] = all(m._weight_cache is not None for m in layers)
        return real_samples(*args, **kwargs)

    def spy_speed(*args, **kwargs):
        cached["speed"] = any(m._weight_cache is not None for m in layers)
        return real_speed(*args, **kwargs)
    monkeypatch.setattr(samples, "generate_samples", spy_samples)
    monkeypatch.setattr(report, "measure_speed", spy_speed)
    spec = EvalSpec(perplexity=False, samples=4, speed=True, prefill_tokens=8, decode_tokens=2, speed_repeats=1)
    result = report.evaluate_models({"compressed": model}, tok, spec)
    assert cached == {"samples": True, "speed": False} and result["samples"]["prompts"]


def test_models_decode_side_by_side_as_each_alone(monkeypatch):
    """On a CPU with a core to spare, the models decode at once, one worker each on the caller's thread count: each
    model's tokens are those it gives alone, and a model given under two names decodes once."""
    import compress.measure.samples as samples
    from compress.threads import cpu_threads

    tok = make_tiny_tokenizer()
    models = {"a": make_tiny_model("qwen2"), "b": make_tiny_model("qwen2", seed=1), "c": make_tiny_model("mistral")}
    models["again"] = models["a"]
    for m in models.values():
        m.generation_config.eos_token_id = m.config.eos_token_id = None
    alone = {n: [greedy(m, prompt_ids(tok, p)[0], 6) for _, p in PROMPTS] for n, m in models.items()}
    calls, threads = [], {}
    own = samples.greedy

    def counted(m, *args, **kw):
        calls.append(id(m))
        threads.setdefault(id(m), set()).add(torch.get_num_threads())
        return own(m, *args, **kw)
    monkeypatch.setattr(samples, "greedy", counted)
    monkeypatch.setattr(samples.os, "cpu_count", lambda: 4)  # room for every model, whatever this machine has
    with cpu_threads(1):
        assert samples.decoding_workers("cpu", 3) == 3 and samples.decoding_workers("cuda", 3) == 1
        section = generate_samples(models, tok, 6, baseline="a")
        assert torch.get_num_threads() == 1
    for k, p in enumerate(section["prompts"]):
        assert {n: o["tokens"] for n, o in p["outputs"].items()} == {n: alone[n][k] for n in models}
    assert sorted(calls) == sorted([id(m) for n, m in models.items() if n != "again"] * len(PROMPTS))
    assert all(t == {1} for t in threads.values())
    threads.clear()
    with cpu_threads(2):  # two models at once on 4 cores, each on the caller's 2 threads
        assert samples.decoding_workers("cpu", 3) == 2
        generate_samples(models, tok, 2)
        assert torch.get_num_threads() == 2
    assert len(threads) == 3 and all(t == {2} for t in threads.values())
