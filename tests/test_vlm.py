"""Vision-language models (issue 48): Qwen2.5-VL, Qwen3-VL, Gemma 3, Llama 3.2 Vision (mllama) and Mistral 3, each a
tiny random model of its own transformers config class (text and vision configs shrunk: compress/arch/tiny.py), saved
in bfloat16 as real checkpoints are. They load whole (AutoModelForImageTextToText) and as skeletons; only the language
model's decoder blocks are quantized, and every other parameter (vision tower, projector, Llama 3.2 Vision's
cross-attention layers, which the model skips on text) is listed in float with its reason; a run leaves the vision
weights bit for bit as they were, and its checkpoint and its `dense` and `compressed-tensors` exports reload in
transformers as the same class, giving our compressed model's logits on text."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from compress.arch import get_arch, multimodal_part
from compress.arch.tables import FAMILIES
from compress.arch.tiny import tiny_config, tiny_model
from compress.core.nn import QuantLinear, is_linear
from compress.core.scheme import QuantScheme
from compress.stages.quantize import CROSS_ATTENTION_REASON, VISION_REASON, QuantizeStage, plan_quantize
from tests.tiny_tokenizer import make_tiny_tokenizer, word_text

VLM = ["qwen2_5_vl", "qwen3_vl", "gemma3", "mllama", "mistral3"]
CLASS = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
         "gemma3": "Gemma3ForConditionalGeneration", "mllama": "MllamaForConditionalGeneration",
         "mistral3": "Mistral3ForConditionalGeneration"}
SCHEME = {"dtype": "int4", "group_size": 16, "scale_dtype": "bfloat16"}  # the exports hold the scales so
IDS = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(3))  # text only: no image token ids


def _model(family: str) -> torch.nn.Module:
    return tiny_model(tiny_config(transformers.AutoConfig.for_model(family), {"num_key_value_heads": 2}))


def _save(family: str, folder: Path) -> Path:
    _model(family).to(torch.bfloat16).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def _outside_language_model(model: torch.nn.Module, family: str) -> dict[str, torch.Tensor]:
    """The model's tensors outside its language model and head (vision tower, projector), by name."""
    arch = get_arch(model)
    return {n: t for n, t in model.state_dict().items() if multimodal_part(arch, n) is not None}


def _run(folder: Path, out: Path, stages: list, formats=("dense", "compressed-tensors"), stream="never") -> dict:
    from compress.pipeline.resident import run
    from compress.recipe import from_dict
    calib = out.parent / "calib.txt"
    calib.write_text(word_text(600) + "\n")
    recipe = from_dict({"model": {"source": str(folder), "dtype": "float32", "stream": stream},
                        "calibration": {"kind": "files", "files": [str(calib)], "n_samples": 2, "seq_len": 32},
                        "stages": stages, "eval": {"perplexity": False, "speed": False, "samples": 0},
                        "output": {"dir": str(out), "formats": list(formats), "verify_windows": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(recipe, progress=False, log=lambda *a: None)


@pytest.mark.parametrize("family", VLM)
def test_a_vlm_loads_whole_and_as_a_skeleton_with_its_vision_tower(family, tmp_path):
    """load_model and model_skeleton build the family's ForConditionalGeneration class (AutoModelForCausalLM refuses
    Qwen2.5-VL's config and builds Llama 3.2 Vision without its vision tower); the vision weights are the file's."""
    from compress.model.load import load_model, model_skeleton
    folder = _save(family, tmp_path / family)
    loaded = load_model(str(folder), "float32")
    assert type(loaded.model).__name__ == CLASS[family]
    _, _, skeleton = model_skeleton(str(folder))
    assert type(skeleton) is type(loaded.model) and all(p.is_meta for p in skeleton.parameters())
    saved = load_file(str(folder / "model.safetensors"))
    vision = _outside_language_model(loaded.model, family)
    assert vision and sum(t.numel() for t in vision.values()) == sum(
        v.numel() for k, v in saved.items() if "vision" in k or "visual" in k or "multi_modal_projector" in k)


@pytest.mark.parametrize("family", VLM)
def test_only_the_language_models_blocks_are_quantized_and_everything_else_is_listed(family):
    """Every linear of the language model's blocks is quantized (but Llama 3.2 Vision's cross-attention blocks), no
    other; quantized + listed = all parameters; every tensor of the vision tower and projector is listed under its
    part's reason, and a cross-attention block's under the cross-attention reason."""
    model = _model(family)
    arch = get_arch(model)
    assert arch.family == family and arch.blocks == "model.language_model.layers"
    plan = plan_quantize(model, arch, QuantizeStage(scheme=QuantScheme(**SCHEME)))
    quantized = {e.name for e in plan.quantized}
    cross = {f"{arch.blocks}.{i}." for i, b in enumerate(arch.block_list(model)) if hasattr(b, "cross_attn")}
    assert bool(cross) == (family == "mllama")
    block_linears = {n for n, m in model.named_modules() if is_linear(m) and n.startswith(arch.blocks + ".")
                     and not n.startswith(tuple(cross))}
    assert quantized == block_linears
    assert sum(e.shape[0] * e.shape[1] for e in plan.quantized) + sum(n for _, n, _ in plan.float_params) == \
        sum(p.numel() for p in model.parameters())
    reasons = {name: why for name, _, why in plan.float_params}
    for path, what in FAMILIES[family]["vision"]:
        under = [n for n in reasons if n.startswith(path + ".")]
        assert under and all(VISION_REASON.format(what=what) in reasons[n] for n in under), path
    for name, why in reasons.items():
        if name.startswith(tuple(cross)):
            assert CROSS_ATTENTION_REASON in why, name
    assert not [n for n, why in reasons.items() if why.startswith("not a linear layer")]


@pytest.mark.parametrize("family", VLM)
def test_an_rtn_run_keeps_the_vision_tower_and_reloads_in_transformers_with_our_logits(family, tmp_path):
    """int4 RTN through the runner: every planned layer is a QuantLinear in the checkpoint (compress.json), the
    vision tower and projector come back bit for bit, and the checkpoint (load_compressed) and the `dense` and
    `compressed-tensors` exports (transformers' own loader) are the family's class with our compressed model's
    logits on text."""
    from compress.export.native import load_compressed
    from compress.export.readers import read_transformers
    folder = _save(family, tmp_path / family)
    out = tmp_path / "out"
    report = _run(folder, out, [{"stage": "quantize", "method": "rtn", "scheme": SCHEME}])
    stage = report["stages"][0]
    assert stage["quantized"] == len(stage["layers"]) > 0
    assert all(n.startswith("model.language_model.layers.") for n in stage["layers"])
    original = transformers.AutoModelForImageTextToText.from_pretrained(folder)
    vision = _outside_language_model(original, family)
    ours = load_compressed(out)
    assert type(ours).__name__ == CLASS[family]
    assert {n for n, m in ours.named_modules() if isinstance(m, QuantLinear)} == set(stage["layers"])
    with torch.no_grad():
        reference = ours(input_ids=IDS).logits
    for fmt in ("native", "dense", "compressed-tensors"):
        if fmt == "native":
            model = ours
        else:
            model = read_transformers(out / "exports" / fmt, {"format": fmt})[1]
        assert type(model).__name__ == CLASS[family], fmt
        state = model.state_dict()
        for name, t in vision.items():
            assert torch.equal(state[name].to(t.dtype), t), (fmt, name)
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        rel = float((logits - reference).norm() / reference.norm())
        # the checkpoint and compressed-tensors hold our codes and (bfloat16) scales: measured 0.0 on all five;
        # `dense` holds the dequantized weights in bfloat16 (each rounded by up to 2^-9): measured up to 5.5e-3
        assert rel < (2e-2 if fmt == "dense" else 1e-6), (fmt, rel)


@pytest.mark.parametrize("method", ["awq+gptq"])
def test_awq_and_gptq_calibrate_llama_vision_on_text_past_its_cross_attention_layer(method, tmp_path):
    """AWQ then GPTQ on Llama 3.2 Vision: the calibration pass passes the cross-attention block by (the model skips it
    on text: its error is 0, its layers stay float), calibrates the self-attention blocks before and after it, and the
    vision tower is unchanged."""
    folder = _save("mllama", tmp_path / "mllama")
    report = _run(folder, tmp_path / "out", [{"stage": "awq", "n_grid": 4, "search_samples": 1},
                                             {"stage": "quantize", "method": "gptq", "scheme": SCHEME}], formats=())
    assert report["calibration"]["replay"] == "exact"
    errors = report["block_errors"]
    assert len(errors) == 3 and errors[1] == 0 and 0 < errors[0] < 0.1 and 0 < errors[2] < 0.1, errors
    awq, quantize = report["stages"]
    assert awq["unscaled"]["scaled"] > 0
    assert not any(".layers.1." in n for n in quantize["layers"]) and len(quantize["layers"]) == 14
    skipped = {s["name"]: s["reason"] for s in quantize["skipped"]}
    assert skipped["model.language_model.layers.1.cross_attn.q_proj"] == CROSS_ATTENTION_REASON
    from compress.export.native import load_compressed
    original = transformers.AutoModelForImageTextToText.from_pretrained(folder)
    ours = load_compressed(tmp_path / "out").state_dict()
    for name, t in _outside_language_model(original, "mllama").items():
        assert torch.equal(ours[name].to(t.dtype), t), name


def test_inspect_shows_the_split_with_counts_and_reasons(tmp_path, capsys):
    """`compress inspect` on a recipe for a VLM folder says what of the language model is quantized and what stays
    float (vision tower, projector, cross-attention layers), with counts and the reason, before any weight is read."""
    from compress.cli import main
    folder = _save("mllama", tmp_path / "mllama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {folder}, dtype: float32}}\nstages:\n"
                      "  - {stage: quantize, method: rtn, scheme: {dtype: int4, group_size: 16}}\n")
    assert main(["inspect", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "family mllama, blocks at `model.language_model.layers` (3 blocks)" in out
    assert "vision-language model: 14 of the language model's 15 linear layers quantized" in out
    assert "    vision tower: 18 linear layers, 51 tensors," in out
    assert "    multimodal projector: 1 linear layers, 2 tensors, 8,256 parameters" in out
    assert "    cross-attention layers: 7 linear layers, 13 tensors," in out
    assert CROSS_ATTENTION_REASON in out and VISION_REASON.format(what="vision tower") in out


def test_a_streamed_run_equals_the_run_held_in_memory_bit_for_bit(tmp_path):
    """model.stream: always reads Llama 3.2 Vision block by block from its checkpoint (saved under transformers'
    legacy names, language_model.model.layers...): GPTQ gives the same checkpoint, vision tower included, tensor for
    tensor as the run held in memory (measured on all five families; tested on the one with a passed-by block)."""
    from compress.export.native import load_compressed
    folder = _save("mllama", tmp_path / "mllama")
    stages = [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}]
    states = []
    for stream in ("never", "always"):
        out = tmp_path / f"out_{stream}"
        report = _run(folder, out, stages, formats=(), stream=stream)
        assert bool(report.get("streamed")) == (stream == "always")
        states.append(load_compressed(out).state_dict())
    assert states[0].keys() == states[1].keys()
    assert [k for k in states[0] if not torch.equal(states[0][k], states[1][k])] == []


def test_an_fp8_kv_cache_leaves_the_cross_attention_layer_without_scales_and_says_why(tmp_path):
    """The kv_cache stage calibrates the self-attention layers' key/value scales on text; Llama 3.2 Vision's
    cross-attention layer never sees a key there, and a scale from nothing (2e-11 before this was handled) would crush
    the image keys and values: it gets none, listed with the reason, and the checkpoint holds none for it."""
    from compress.stages.kv_cache import UNSEEN_REASON
    folder = _save("mllama", tmp_path / "mllama")
    report = _run(folder, tmp_path / "out", [{"stage": "quantize", "method": "rtn", "scheme": SCHEME},
                                             {"stage": "kv_cache", "dtype": "fp8_e4m3"}], formats=())
    kv = report["stages"][1]
    assert kv["skipped"] == [{"name": "model.language_model.layers.1.cross_attn", "reason": UNSEEN_REASON}]
    assert sorted(kv["layers"]) == ["model.language_model.layers.0.self_attn", "model.language_model.layers.2.self_attn"]
    assert all(v["k_scale"] > 1e-6 and v["v_scale"] > 1e-6 for v in kv["layers"].values())
