"""The Python API (compress/api): compress a model already in memory, evaluate, save, export, load — and the same
bits as `compress run`."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import compress
from compress.api.session import as_recipe, cpu_copy, with_dataset
from compress.cli import main as cli
from compress.recipe import RecipeError
from tests.conftest import make_tiny_model, shared_data_dir, tiny_recipe
from tests.tiny_tokenizer import make_tiny_tokenizer

GPTQ = {"stage": "quantize", "method": "gptq", "scheme": {"dtype": "int4", "group_size": 32}}
EVAL = {"max_windows": 2, "seq_len": 64, "speed": False}

needs_data = pytest.mark.skipif(shared_data_dir() is None, reason="WikiText-2 (../shared/data) is not here")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert different == []


@pytest.fixture
def tiny(tmp_path):
    """A saved tiny llama, a calibration text file and a recipe file naming them (conftest.tiny_recipe)."""
    path = tiny_recipe(tmp_path, [GPTQ], EVAL, out="cli")
    return tmp_path / "tiny", path, tmp_path / "calib.txt"


def load_hf(folder: Path):
    import transformers
    return (transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(folder))


@needs_data
def test_the_api_writes_the_bits_the_cli_writes(tiny, tmp_path):
    folder, recipe, _ = tiny
    assert cli(["run", str(recipe), "--no-progress"]) == 0
    model, tokenizer = load_hf(folder)
    result = compress.compress(model, tokenizer, str(recipe), output=tmp_path / "api", progress=False, log=lambda m: 0)
    assert_same_tensors(tmp_path / "cli", tmp_path / "api")
    saved = result.save(tmp_path / "saved")  # the in-memory result saved afterwards: the same bits again
    assert_same_tensors(tmp_path / "cli", saved)
    import json
    cli_eval = json.loads((tmp_path / "cli" / "report.json").read_text())["eval"]["models"]
    for name in ("baseline", "compressed"):  # the same model, the same windows: the same figures
        for key in ("ppl", "kl", "top1_agreement"):
            assert result.report.models[name][key] == cli_eval[name][key], (name, key)
    assert result.report.ppl == cli_eval["compressed"]["ppl"] and result.report.kl > 0
    # the CLI's profile starts with the process (its imports: `startup`) and covers nearly all of its wall
    profile = json.loads((tmp_path / "cli" / "report.json").read_text())["profile"]
    phases = {r["phase"] for r in profile["phases"]}
    assert {"startup", "load", "calibration data", "capture", "float forward", "statistics", "solves",
            "compressed forward", "save", "eval", "perplexity"} <= phases and profile["covered"] > 0.9, profile
    assert "speed" not in phases  # eval.speed: false here
    assert "startup" not in {r["phase"] for r in result.report.data["profile"]["phases"]}  # the API's: no start-up


@needs_data
def test_a_notebook_session(tiny, tmp_path):
    """Load with transformers, compress with texts in memory, evaluate, export, reload: as a notebook would."""
    import transformers

    folder, _, calib = tiny
    model, tokenizer = load_hf(folder)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"calibration": {"n_samples": 4, "seq_len": 64}, "stages": [GPTQ], "eval": EVAL,
              "output": {"save_dtype": "float32"}}  # the float tensors saved as they are: reloaded, the same numbers
    texts = calib.read_text().split(". ")
    result = compress.compress(model, tokenizer, recipe, dataset=texts, progress=False, log=lambda m: 0)
    assert result.output is None and result.report.data["calibration"]["kind"] == "texts"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the caller's model: untouched
    assert any(type(m).__name__ == "QuantLinear" for m in result.model.modules())

    again = compress.evaluate(result, baseline=model, max_windows=2, seq_len=64, speed=False)
    assert again.kl == pytest.approx(result.report.kl, rel=1e-6)  # the same windows, the same KL
    assert again.ppl == pytest.approx(result.report.ppl, rel=1e-6)

    saved = result.save(tmp_path / "run")
    reloaded, _ = compress.load(saved)
    ids = torch.randint(2, 200, (2, 32))
    with torch.no_grad():
        ours = result.model(ids).logits
        assert torch.equal(reloaded(ids).logits, ours)  # our checkpoint reloads to the same numbers
        dense = result.export("dense", tmp_path / "dense")
        served = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
        theirs = served(ids).logits  # the dense export holds bfloat16 weights: close, the same predictions
        assert (theirs - ours).abs().max() < 1e-2 * ours.abs().max()
        assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.95
    assert (dense / "export.json").is_file()
    from tests.test_card import validate  # the Hub's conventions, the metrics table against the report
    validate(saved / "README.md", result.report.data, "native", result.recipe.resolved_yaml(), "gptq")
    validate(dense / "README.md", result.report.data, "dense", result.recipe.resolved_yaml(), "gptq")


def test_recipes_come_as_a_path_text_dict_or_recipe(tiny):
    _, path, _ = tiny
    from_path = as_recipe(str(path))
    text = path.read_text()
    from_text = as_recipe(text)
    from_dict = as_recipe(yaml.safe_load(text))
    for r in (from_text, from_dict, as_recipe(from_path)):
        assert r.resolved_yaml() == from_path.resolved_yaml()
    assert as_recipe(text, ["stages.0.scheme.group_size=64"]).stages[0].scheme.group_size == 64
    assert as_recipe({"calibration": "wikitext2", "stages": [GPTQ]}).model.source == "in-memory"  # no model: needed
    with pytest.raises(RecipeError, match="does not exist"):
        as_recipe("recipes/no_such_recipe.yaml")
    with pytest.raises(RecipeError, match="a path, YAML text, a dict"):
        as_recipe(42)
    with pytest.raises(RecipeError, match="Recipe object is already built"):
        as_recipe(from_path, ["eval.max_windows=1"])


def test_the_dataset_replaces_the_calibration_text(tiny):
    import datasets

    recipe = as_recipe(str(tiny[1]))
    texts = with_dataset(recipe, ["one text", "another"]).calibration
    assert (texts.kind, texts.texts, texts.n_samples) == ("texts", ("one text", "another"), 4)
    table = with_dataset(recipe, datasets.Dataset.from_dict({"text": ["a b c"], "n": [1]})).calibration
    assert table.texts == ("a b c",)
    assert with_dataset(recipe, "owner/corpus").calibration.dataset == "owner/corpus"
    with pytest.raises(ValueError, match="no column 'text'"):
        with_dataset(recipe, datasets.Dataset.from_dict({"body": ["x"]}))
    with pytest.raises(ValueError, match="list of strings"):
        with_dataset(recipe, [1, 2])
    images = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, kind="images",
                                                                         folder="pictures"))
    with pytest.raises(RecipeError, match="image-caption pairs of calibration.folder"):
        with_dataset(images, ["text"])
    rtn = as_recipe({"stages": [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int8"}}]})
    with pytest.raises(RecipeError, match="no calibration pass"):
        with_dataset(rtn, ["text"])


def test_calibration_texts_tokenize_like_a_file_of_them(tiny):
    from compress.calibrate.data import calibration_windows

    recipe = as_recipe(str(tiny[1]))
    tokenizer = make_tiny_tokenizer()
    text = tiny[2].read_text()
    from_file = calibration_windows(recipe.calibration.source(), tokenizer, None, 4, 64, 0)
    from_texts = with_dataset(recipe, [text]).calibration.source()
    assert torch.equal(calibration_windows(from_texts, tokenizer, None, 4, 64, 0), from_file)


def test_the_cpu_copy_keeps_ties_and_leaves_the_original_alone():
    model = make_tiny_model("llama", tie_word_embeddings=True)
    model.tie_weights()
    copy = cpu_copy(model)
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # still one tensor
    assert copy.lm_head.weight is not model.lm_head.weight
    copy.model.embed_tokens.weight.data.zero_()
    assert model.model.embed_tokens.weight.abs().sum() > 0


def test_the_report_object_reads_the_headline_figures():
    report = compress.Report({"eval": {"models": {
        "baseline": {"ppl": 10.0}, "compressed": {"ppl": 11.0, "kl": 0.1, "top1_agreement": 0.9,
                                                  "weights": {"total": 1234}}}}})
    assert (report.ppl, report.baseline_ppl, report.kl, report.top1_agreement, report.weight_bytes) == \
        (11.0, 10.0, 0.1, 0.9, 1234)
    assert "ppl 11" in repr(report)
    assert compress.Report({"eval": {"models": {"model": {"ppl": 3.0}}}}).ppl == 3.0


def test_the_package_names_the_api():
    for name in ("compress", "evaluate", "load", "run", "Result", "Report"):
        assert callable(getattr(compress, name)), name
    assert dataclasses.is_dataclass(compress.Result)


@pytest.mark.slow  # about 2 minutes on 2 cores: the GGUF read and converted twice
@needs_data
def test_the_embedded_model_through_the_api_and_the_cli(tmp_path):
    """SmolLM2-135M (the embedded model): loaded with compress.load, compressed in memory, the same checkpoint as
    `compress run` writes from `model: default`."""
    recipe = {"model": "default", "stages": [{"stage": "quantize", "method": "rtn",
                                              "scheme": {"dtype": "int4", "group_size": 32}}],
              "eval": {"max_windows": 1, "seq_len": 128, "speed": False}, "output": {"dir": str(tmp_path / "cli")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli(["run", str(path), "--no-progress"]) == 0
    model, tokenizer = compress.load("default")
    result = compress.compress(model, tokenizer, path, output=tmp_path / "api", progress=False, log=lambda m: 0)
    assert_same_tensors(tmp_path / "cli", tmp_path / "api")
    assert 0 < result.report.kl < 0.5 and result.report.top1_agreement > 0.6
