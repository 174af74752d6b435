"""Quantizing a tied lm_head by untying it (QuantizeStage.tied_lm_head): the plan, the untying itself, the
save / load round trip, and what each export format does with the separate quantized head."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.arch import get_arch
from compress.export import ExportError, export_model
from compress.export.native import load_compressed, save_compressed
from compress.core.nn import QuantLinear
from compress.pipeline.resident import planned_model
from compress.stages import Plan, RunContext, make_plan
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.quantizers.rtn import quantize_rtn
from compress.recipe import Recipe, RecipeError, from_dict
from compress.core.scheme import scheme
from tests.conftest import make_tiny_model

INT8_CHANNEL = scheme("int8", "channel")
INT4_G16 = scheme("int4", "group", 16)
HEAD_ONLY = dict(targets=("lm_head",), ignore=(), tied_lm_head="untie")
WINDOWS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    return model(input_ids=WINDOWS, use_cache=False).logits


def _quantized(stage: QuantizeStage) -> tuple[nn.Module, list]:
    model = make_tiny_model("llama")
    plan = plan_quantize(model, get_arch(model), stage)
    apply_quantize(model, plan, stage)
    return model, plan


def _tied(model: nn.Module) -> bool:
    return getattr(model.lm_head, "weight", None) is model.get_input_embeddings().weight


# ---------------------------------------------------------------- plan and untying

def test_keep_leaves_the_tied_head_in_float_and_names_the_fix(tiny_llama):
    stage = QuantizeStage(scheme=INT8_CHANNEL, ignore=())
    plan = plan_quantize(tiny_llama, get_arch(tiny_llama), stage)
    head = next(e for e in plan.layers if e.name == "lm_head")
    assert head.scheme is None
    assert "tie_word_embeddings" in head.reason and "set tied_lm_head: untie" in head.reason
    apply_quantize(tiny_llama, plan, stage)
    assert _tied(tiny_llama) and tiny_llama.config.tie_word_embeddings


@pytest.mark.parametrize("sch", [INT8_CHANNEL, INT4_G16], ids=lambda s: s.name)
def test_untie_quantizes_a_copy_and_leaves_the_embedding_bit_identical(sch):
    embedding = make_tiny_model("llama").get_input_embeddings().weight.detach().clone()
    model, plan = _quantized(QuantizeStage(scheme=sch, **HEAD_ONLY))
    assert [e.name for e in plan.quantized] == ["lm_head"] and plan.quantized[0].untie
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.scheme == sch
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert model.config.tie_word_embeddings is False and model.all_tied_weights_keys == {}
    model.tie_weights()  # what load_compressed and transformers call: must not re-tie
    assert isinstance(model.lm_head, QuantLinear)

    # reference built by hand: a float copy of the embedding as lm_head, quantized with the same quantizer
    ref = make_tiny_model("llama")
    ref.config.tie_word_embeddings = False
    head = nn.Linear(embedding.shape[1], embedding.shape[0], bias=False)
    head.weight = nn.Parameter(embedding.clone())
    ref.lm_head = QuantLinear.from_module(head, quantize_rtn(embedding, sch))
    assert torch.equal(_logits(model), _logits(ref))


def test_untie_records_the_extra_bytes_in_the_plan_and_the_stage_summary():
    stage = QuantizeStage(scheme=INT8_CHANNEL, ignore=(), tied_lm_head="untie")  # body and head
    model, plan = _quantized(stage)
    head = next(e for e in plan.quantized if e.name == "lm_head")
    vocab, hidden = model.get_input_embeddings().weight.shape
    assert head.untied_bytes == vocab * hidden + vocab * 2  # int8 codes + one float16 scale per row
    assert "untied" in head.note and f"{head.untied_bytes} bytes" in head.note
    assert [e.untied_bytes for e in plan.quantized if e.name != "lm_head"] == [None] * 14
    summary = stage.report(RunContext(model, Plan((stage,), [plan], model, get_arch(model))), 0)
    assert summary["untied"] == {"lm_head": {"extra_bytes": head.untied_bytes, "note": head.note}}
    assert summary["layers"]["lm_head"] == INT8_CHANNEL.name


def test_untying_happens_once_in_a_recipe_with_a_separate_head_stage():
    """Body int4 (lm_head ignored as usual), then a stage that quantizes only the head at int8."""
    model = make_tiny_model("llama")
    arch = get_arch(model)
    body = QuantizeStage(scheme=INT4_G16)
    head = QuantizeStage(scheme=INT8_CHANNEL, **HEAD_ONLY)
    recipe = Recipe(stages=(body, head))
    plan = make_plan(model, arch, recipe.stages)
    plans = plan.steps
    assert planned_model(model, plan).config.tie_word_embeddings is False  # what the export checks see
    assert model.config.tie_word_embeddings  # planning changes nothing
    assert apply_quantize(model, plans[0], body) == 14 and _tied(model)
    assert apply_quantize(model, plans[1], head) == 1 and not _tied(model)
    assert model.lm_head.scheme == INT8_CHANNEL
    assert apply_quantize(model, plans[1], head) == 0  # a second pass finds the head quantized: nothing to do
    assert plan_quantize(model, arch, head).layers[-1].reason == f"already quantized ({INT8_CHANNEL.name})"


def test_bad_values_and_a_contradictory_ignore_are_errors_that_name_the_fix():
    with pytest.raises(ValueError, match=r"tied_lm_head is 'yes'; allowed values: 'keep', 'untie'"):
        QuantizeStage(tied_lm_head="yes")
    with pytest.raises(ValueError, match=r"`ignore` still lists lm_head .*set `ignore: \[\]`"):
        QuantizeStage(tied_lm_head="untie")  # the default ignore: [lm_head]


def test_recipes_read_tied_lm_head():
    stage = {"stage": "quantize", "scheme": "W8A16", "targets": ["lm_head"], "ignore": [], "tied_lm_head": "untie"}
    recipe = from_dict({"model": "default", "stages": [stage]})
    assert recipe.stages[0].tied_lm_head == "untie"
    assert from_dict({"model": "default", "stages": [{"stage": "quantize"}]}).stages[0].tied_lm_head == "keep"
    with pytest.raises(RecipeError, match=r"stages\.0\.tied_lm_head.*allowed values: 'keep', 'untie'"):
        from_dict({"model": "default", "stages": [{**stage, "tied_lm_head": "share"}]})
    with pytest.raises(RecipeError, match="ignore: \\[\\]"):
        from_dict({"model": "default", "stages": [{"stage": "quantize", "tied_lm_head": "untie"}]})


# ---------------------------------------------------------------- save / load

@pytest.mark.parametrize("sch", [INT8_CHANNEL, INT4_G16], ids=lambda s: s.name)
def test_untied_quantized_head_round_trips_and_is_not_re_tied(tmp_path, sch):
    model, _ = _quantized(QuantizeStage(scheme=sch, ignore=(), tied_lm_head="untie"))
    save_compressed(model, None, tmp_path, {"note": "test"}, save_dtype="float32")
    loaded = load_compressed(tmp_path)
    loaded.set_attn_implementation("eager")  # from_config picks sdpa; the tiny models run eager
    assert isinstance(loaded.lm_head, QuantLinear) and loaded.config.tie_word_embeddings is False
    assert torch.equal(loaded.lm_head.qdata, model.lm_head.qdata)
    assert torch.equal(loaded.lm_head.scale, model.lm_head.scale)
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(_logits(loaded), _logits(model))


# ---------------------------------------------------------------- exports

@pytest.mark.parametrize("fmt", ["compressed-tensors", "dense"])
def test_formats_that_hold_a_quantized_head_reload_it(fmt, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compress.export.verify import verify_export
    from tests.tiny_tokenizer import make_tiny_tokenizer

    model, _ = _quantized(QuantizeStage(scheme=INT8_CHANNEL, ignore=(), tied_lm_head="untie"))
    record = export_model(model, make_tiny_tokenizer(), fmt, tmp_path / fmt)
    assert "lm_head" in record["layers"]
    result = verify_export(tmp_path / fmt, model, WINDOWS)
    # bfloat16 float tensors on disk; measured KL 5e-8 (compressed-tensors) and 1.2e-7 (dense), top-1 1.0
    assert result["kl"] < 1e-3 and result["top1_agreement"] == 1.0, result


@pytest.mark.parametrize("fmt, sch", [
    ("awq", scheme("int4", "group", 16, symmetric=False)),
    ("gptq", scheme("int4", "group", 16)),
    ("fp8", scheme("fp8_e4m3", "tensor", None)),
], ids=lambda x: getattr(x, "name", x))
def test_formats_whose_loaders_keep_lm_head_float_refuse_it(fmt, sch, tmp_path):
    from tests.tiny_tokenizer import make_tiny_tokenizer

    body, _ = _quantized(QuantizeStage(scheme=sch))
    export_model(body, make_tiny_tokenizer(), fmt, tmp_path / "body")  # the same scheme without the head: fine
    model, _ = _quantized(QuantizeStage(scheme=sch, ignore=(), tied_lm_head="untie"))
    with pytest.raises(ExportError, match=r"cannot export to \w+:\n  lm_head \(.*\): .*keep the output projection "
                                          r"in float.*export compressed-tensors, dense or gguf-\*") as err:
        export_model(model, make_tiny_tokenizer(), fmt, tmp_path / fmt)
    assert str(err.value).count("\n") == 1  # the head is the only problem
    assert not (tmp_path / fmt).exists()


@pytest.mark.parametrize("sch, qtype", [(scheme("int8", "group", 32), "q8_0"), (scheme("int4", "group", 32), "q4_0")],
                         ids=lambda x: getattr(x, "name", x))
def test_gguf_writes_the_untied_head_as_output_weight_exactly(sch, qtype, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from compress.export.gguf import write_gguf
    from compress.export.gguf_llama_cpp import llama_cpp_logits
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model, _ = _quantized(QuantizeStage(scheme=sch, ignore=(), tied_lm_head="untie"))
    path = tmp_path / f"{qtype}.gguf"
    report = write_gguf(model, byte_bpe_tokenizer(), path, qtype, embed_qtype="f16")
    assert report["tied_embeddings"] is False
    assert report["tensors"]["output.weight"]["type"] == qtype.upper()
    assert report["tensors"]["output.weight"]["path"] == "exact"
    assert report["tensors"]["token_embd.weight"]["type"] == "F16"
    ours = _logits(model).float()
    theirs = llama_cpp_logits(path, WINDOWS)
    rel = float((theirs - ours).norm() / ours.norm())
    agreement = float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())
    # every linear layer is exact in the file; what differs is llama.cpp's 8-bit activation blocks and the f16
    # embedding: measured rel 0.0069 (q8_0) / 0.0072 (q4_0), agreement 1.0; the bars leave 2x
    assert rel < 0.015 and agreement >= 0.95, (rel, agreement)


# ---------------------------------------------------------------- the real model

@pytest.mark.slow  # loading SmolLM2 from its GGUF takes ~22 s on the 2-core CI machine
def test_smollm2_int8_head_keeps_next_token_predictions():
    from compress.model.load import load_model
    from tests.test_export_gguf import PARAGRAPH  # real English prose, ~270 SmolLM2 tokens

    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    assert _tied(model)
    ids = tok(PARAGRAPH, add_special_tokens=False, return_tensors="pt").input_ids[:, :256].reshape(2, 128)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    embedding = model.get_input_embeddings().weight.detach().clone()
    stage = QuantizeStage(scheme=INT8_CHANNEL, **HEAD_ONLY)
    plan = plan_quantize(model, get_arch(model), stage)
    assert apply_quantize(model, plan, stage) == 1 and isinstance(model.lm_head, QuantLinear)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    agreement = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    # measured 0.980 (5 of 256 positions flip) with a relative logits error of 0.0099: int8 with one scale per row
    # of the 49152×576 head moves the logits by ~1%, which flips only close top-2 pairs; 0.95 allows 12 flips
    assert agreement >= 0.95, agreement


# ---------------------------------------------------------------- the whole run

def _run_recipe(tmp_path, formats: list[str]) -> dict:
    from compress.pipeline.resident import run
    from tests.tiny_tokenizer import make_tiny_tokenizer, word_text

    folder = tmp_path / "tiny-llama"
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(word_text(128) + "\n")
    recipe = from_dict({
        "model": {"source": str(folder), "dtype": "float32", "device": "cpu"},
        "calibration": {"kind": "files", "files": [str(tmp_path / "calib.txt")], "n_samples": 2, "seq_len": 16},
        "stages": [{"stage": "quantize", "scheme": {"dtype": "int4", "group_size": 16}},
                   {"stage": "quantize", "scheme": "W8A16", "targets": ["lm_head"], "ignore": [],
                    "tied_lm_head": "untie"}],
        "eval": {"perplexity": False, "speed": False, "baseline": False, "samples": 0},
        "output": {"dir": str(tmp_path / "out"), "save_dtype": "float32", "formats": formats}})
    return run(recipe, progress=False, log=lambda *_: None)


def test_a_run_with_a_head_stage_saves_an_untied_model_and_reports_it(tmp_path):
    report = _run_recipe(tmp_path, ["compressed-tensors"])
    body, head = report["stages"]
    assert body["untied"] == {} and [s["name"] for s in body["skipped"]] == ["lm_head"]
    assert list(head["untied"]) == ["lm_head"] and head["untied"]["lm_head"]["extra_bytes"] > 0
    assert head["layers"] == {"lm_head": "int8-channel-sym"}
    loaded = load_compressed(tmp_path / "out")
    assert isinstance(loaded.lm_head, QuantLinear) and loaded.config.tie_word_embeddings is False
    (export,) = report["exports"]
    assert export["verify"]["top1_agreement"] == 1.0 and any("lm_head" in n for n in export["notes"])


def test_a_run_refuses_a_format_that_cannot_hold_the_head_before_calibrating(tmp_path):
    with pytest.raises(ExportError, match=r"(?s)cannot export to gptq:.*\n  lm_head \(int8-channel-sym\): .*float"):
        _run_recipe(tmp_path, ["gptq"])
    assert not (tmp_path / "out").exists()
