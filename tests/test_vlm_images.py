"""Calibration on image-caption pairs (calibration kind `images`, compress/calibrate/images.py): tiny vision-language
models (tests/test_vlm.py's builders) saved with a processor built offline (the tiny word tokenizer with the family's
image tokens, the family's image processor at small sizes, a chat template that places the family's image
placeholder), a folder of small random PNG images with captions. The calibration pass feeds each image with its
caption through the model's own forward, so the decoder blocks see the image tokens' hidden states (and Llama 3.2
Vision's cross-attention layers run, and are quantized); the vision tower stays bit for bit; the kind is refused on a
text-only model and on a folder without a processor.

Qwen2.5-VL's processor cannot be built without torchvision (transformers builds its video processor with it), which
this machine lacks: there its processor is built without one and handed to the run (_without_video_processor).
"""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from compress.arch import get_arch
from compress.arch.tiny import tiny_config, tiny_model
from compress.calibrate.blockwise import capture_block_inputs
from compress.calibrate.images import image_captions, image_samples, load_processor
from compress.stages.quantize import CROSS_ATTENTION_REASON
from tests.test_vlm import SCHEME, _outside_language_model
from tests.tiny_tokenizer import make_tiny_tokenizer

CAPTIONS = ["the quick brown fox jumps over a lazy dog", "many small fish swim in cold water",
            "birds sing on old trees near the hill"]


def _template(placeholder: str) -> str:
    """A chat template that renders the user's image as the family's placeholder, then the text."""
    return ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + placeholder +
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def _tokenizer(**special) -> transformers.PreTrainedTokenizerFast:
    base = make_tiny_tokenizer()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=base._tokenizer, unk_token="[UNK]",
                                                pad_token="[PAD]", **special)


def _gemma3():
    tok = _tokenizer(extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                           "image_token": "<image_soft_token>"})
    processor = transformers.Gemma3Processor(transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32}),
                                             tok, chat_template=_template("<start_of_image>"), image_seq_length=4)
    ids = {"boi_token_index": tok.boi_token_id, "image_token_index": tok.image_token_id,
           "eoi_token_index": tok.eoi_token_id}
    return processor, ids


def _mllama():
    tok = _tokenizer(bos_token="<|begin_of_text|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
    image = transformers.MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=4)
    processor = transformers.MllamaProcessor(image, tok, chat_template=_template("<|image|>"))
    return processor, {"image_token_index": tok.convert_tokens_to_ids("<|image|>")}


def _qwen2_5_vl():
    tok = _tokenizer()
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": names})
    image = transformers.Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    video = None if NO_TORCHVISION else transformers.Qwen2VLVideoProcessor()
    processor = transformers.Qwen2_5_VLProcessor(image, tok, video,
                                                 chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>"))
    keys = ["vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"]
    return processor, dict(zip(keys, tok.convert_tokens_to_ids(names)))


BUILD = {"gemma3": _gemma3, "mllama": _mllama, "qwen2_5_vl": _qwen2_5_vl}
NO_TORCHVISION = importlib.util.find_spec("torchvision") is None
FAMILIES = ["gemma3", "mllama", "qwen2_5_vl"]


def _without_video_processor(monkeypatch) -> dict:
    """Where torchvision is missing (this machine), transformers can neither build nor load Qwen2.5-VL's processor:
    its video processor needs torchvision, and images do not use it. The stand-in: the processor is built without
    one (the class check lets None through), and the run is handed that processor instead of loading it from the
    folder (AutoProcessor, which the Gemma 3 and Llama 3.2 Vision tests exercise). Returns the processors handed
    over, by folder."""
    from transformers.processing_utils import ProcessorMixin
    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" and arg is None else
                        check(self, name, arg))
    handed: dict = {}
    monkeypatch.setattr("compress.pipeline.calibration.load_processor", lambda source: handed[str(Path(source))])
    return handed


def _save(family: str, folder: Path, monkeypatch=None) -> tuple[Path, object]:
    """The family's tiny model, its image token ids those of the tiny tokenizer, saved in bfloat16 with the
    processor (tokenizer, image processor, chat template); and the processor."""
    handed = _without_video_processor(monkeypatch) if family == "qwen2_5_vl" and NO_TORCHVISION else None
    processor, token_ids = BUILD[family]()
    config = tiny_config(transformers.AutoConfig.for_model(family), {"num_key_value_heads": 2})
    for k, v in token_ids.items():
        setattr(config, k, v)
    model = tiny_model(config)
    for name, p in model.named_parameters():  # Llama 3.2 Vision's cross-attention gates start at 0 (tanh(0): the
        if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):  # layer adds nothing); a trained
            p.data.fill_(1.0)  # model's are not
    model.to(torch.bfloat16).save_pretrained(folder)
    if handed is None:
        processor.save_pretrained(folder)
    else:
        processor.tokenizer.save_pretrained(folder)
        handed[str(folder)] = processor
    return folder, processor


def _images(folder: Path, layout: str = "jsonl") -> Path:
    """Three random PNGs of different sizes with their captions (captions.jsonl, or a .txt beside each)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i, caption in enumerate(CAPTIONS):
        name = f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (32 + 8 * i, 40, 3), dtype=np.uint8)).save(folder / name)
        rows.append({"image": name, "caption": caption})
        if layout == "txt":
            (folder / name).with_suffix(".txt").write_text(caption + "\n")
    if layout == "jsonl":
        (folder / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _run(model: Path, images: Path, out: Path, stages: list, **calibration) -> dict:
    from compress.pipeline.resident import run
    from compress.recipe import from_dict
    recipe = from_dict({"model": {"source": str(model), "dtype": "float32"},
                        "calibration": {"kind": "images", "folder": str(images), "n_samples": 3, **calibration},
                        "stages": stages, "eval": {"perplexity": False, "speed": False, "samples": 0},
                        "output": {"dir": str(out), "formats": [], "verify_windows": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(recipe, progress=False, log=lambda *a: None)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_block_pass_sees_the_images(family, tmp_path, monkeypatch):
    """Block 0's captured inputs for an image-caption sample are the model's embeddings with the vision tower's
    features at the image tokens (Gemma 3, Qwen2.5-VL: they differ from the text-only capture of the same ids
    exactly there), or (Llama 3.2 Vision, which reads the image in its cross-attention layer) that layer is called
    with the image's cross-attention states, where on text the model passes it by."""
    from compress.model.load import load_model
    folder, processor = _save(family, tmp_path / family, monkeypatch)
    model = load_model(str(folder), "float32").model
    arch = get_arch(model)
    if family != "qwen2_5_vl" or not NO_TORCHVISION:
        processor = load_processor(str(folder))
    samples = image_samples(str(_images(tmp_path / "images")), processor, 3, 0)
    assert len({s["input_ids"].shape[1] for s in samples}) > 1  # each at its own length
    assert samples.tokens == sum(s["input_ids"].numel() for s in samples)
    with torch.no_grad():
        seen, _ = capture_block_inputs(model, arch, samples, "cpu")
        text, _ = capture_block_inputs(model, arch, torch.cat([s["input_ids"] for s in samples][:1]), "cpu")
    ids = samples.inputs[0]["input_ids"][0]
    assert seen.hidden[0].shape == text.hidden[0].shape == (1, len(ids), 64)
    if family == "mllama":
        cross = 1  # the tiny model's cross-attention layer
        assert cross not in seen.arguments.skipped and cross in text.arguments.skipped
        states = seen.arguments.of(cross)[0]["cross_attention_states"]
        assert states is not None and states.abs().sum() > 0
        return
    image = ids == getattr(model.config, "image_token_id", getattr(model.config, "image_token_index", None))
    assert image.sum() > 0
    differs = (seen.hidden[0][0] != text.hidden[0][0]).any(-1)
    assert torch.equal(differs, image), (differs, image)


@pytest.mark.parametrize("family", FAMILIES)
def test_gptq_on_images_keeps_the_vision_tower_and_reloads(family, tmp_path, monkeypatch):
    """GPTQ calibrated on image-caption pairs through the runner: every block calibrated (Llama 3.2 Vision's
    cross-attention block too: it runs on the image, and calibration kind images quantizes its linear layers), the
    report names the images and counts their tokens, the vision tower comes back bit for bit and the checkpoint
    reloads as the family's class."""
    from compress.export.native import load_compressed
    folder, _ = _save(family, tmp_path / family, monkeypatch)
    report = _run(folder, _images(tmp_path / "images", "txt"), tmp_path / "out",
                  [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}])
    cal = report["calibration"]
    assert cal["kind"] == "images" and cal["images"] == ["img0.png", "img1.png", "img2.png"]
    assert cal["replay"] == "exact" and "seq_len" not in cal
    errors = report["block_errors"]
    assert all(0 < e < 0.1 for e in errors), errors
    quantize = report["stages"][0]
    assert quantize["quantized"] > 0 and all(n.startswith("model.language_model.layers.") for n in quantize["layers"])
    if family == "mllama":
        cross = {n for n in quantize["layers"] if ".layers.1." in n}
        assert len(quantize["layers"]) == 21 and {n.rsplit(".", 1)[1] for n in cross} == \
            {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert not [s for s in quantize["skipped"] if s["reason"] == CROSS_ATTENTION_REASON]
    original = transformers.AutoModelForImageTextToText.from_pretrained(folder)
    ours = load_compressed(tmp_path / "out")
    assert type(ours) is type(original)
    state = ours.state_dict()
    for name, t in _outside_language_model(original, family).items():
        assert torch.equal(state[name].to(t.dtype), t), name


def test_the_folder_layouts_and_their_errors(tmp_path):
    """captions.jsonl (its order, its images) or a .txt beside each image; a missing caption, a missing image or an
    empty folder is a clear error."""
    jsonl = _images(tmp_path / "a")
    assert [(p.name, c) for p, c in image_captions(jsonl)] == [(f"img{i}.png", c) for i, c in enumerate(CAPTIONS)]
    txt = _images(tmp_path / "b", "txt")
    assert [c for _, c in image_captions(txt)] == CAPTIONS
    (txt / "img1.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no caption \.txt beside \['img1.png'\]"):
        image_captions(txt)
    (jsonl / "img2.png").unlink()
    with pytest.raises(FileNotFoundError, match="captions.jsonl:3: no image"):
        image_captions(jsonl)
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        image_captions(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        image_captions(tmp_path / "nowhere")


def test_the_recipe_checks_the_kind(tmp_path):
    """kind images needs a folder, keeps its activations in memory, and `folder` belongs to kind images only."""
    from compress.recipe import CalibrationSpec
    with pytest.raises(ValueError, match="needs `folder:`"):
        CalibrationSpec(kind="images")
    with pytest.raises(ValueError, match="offload: memory"):
        CalibrationSpec(kind="images", folder="x", offload="disk")
    with pytest.raises(ValueError, match="is for kind 'images'"):
        CalibrationSpec(kind="files", folder="x")
    assert CalibrationSpec(kind="images", folder="x").source().folder == "x"


def test_refused_on_a_text_only_model_and_without_a_processor(tmp_path):
    """A text-only model: calibrate it on text. A VLM folder without its processor: save the processor."""
    from tests.conftest import make_tiny_model
    images = _images(tmp_path / "images")
    llama = tmp_path / "llama"
    make_tiny_model("llama").save_pretrained(llama)
    make_tiny_tokenizer().save_pretrained(llama)
    with pytest.raises(ValueError, match="text-only llama model: calibrate it on text"):
        _run(llama, images, tmp_path / "o1", [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}])
    bare = tmp_path / "bare"
    config = tiny_config(transformers.AutoConfig.for_model("gemma3"), {"num_key_value_heads": 2})
    tiny_model(config).save_pretrained(bare)
    make_tiny_tokenizer().save_pretrained(bare)
    with pytest.raises(ValueError, match="AutoProcessor could not load one|has no image processor"):
        _run(bare, images, tmp_path / "o2", [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}])


def test_awq_then_gptq_on_images_with_samples_of_different_lengths(tmp_path):
    """AWQ's searches replay each sample at its own length (Llama 3.2 Vision's three captions differ in length):
    the pass runs, its replay is the model's own forward, every block is scaled (the cross-attention block's MLP
    pairs too) and calibrated."""
    folder, _ = _save("mllama", tmp_path / "mllama")
    report = _run(folder, _images(tmp_path / "images"), tmp_path / "out",
                  [{"stage": "awq", "n_grid": 4, "search_samples": 2},
                   {"stage": "quantize", "method": "gptq", "scheme": SCHEME}])
    assert report["calibration"]["replay"] == "exact"
    assert report["stages"][0]["unscaled"]["unscaled_blocks"] == 0
    errors = report["block_errors"]
    assert all(0 < e < 0.1 for e in errors), errors


def test_a_streamed_run_and_text_window_stages_say_why_not(tmp_path):
    """A streamed run refuses kind images (the vision tower runs in the model's forward), naming the way out; a
    stage that takes text windows from the calibration set says kind images holds none."""
    from compress.calibrate.data import TextSource, calibration_windows
    from compress.pipeline.streamed import stream_blockers
    from compress.recipe import from_dict
    recipe = from_dict({"model": {"source": str(tmp_path)}, "calibration": {"kind": "images", "folder": "x"},
                        "stages": [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}]})
    assert any("calibration.kind: images runs the vision tower" in w for w in stream_blockers(recipe))
    with pytest.raises(ValueError, match="needs a text calibration kind"):
        calibration_windows(TextSource("images", folder="x"), None, None, 2, 16, 0)


def test_calibration_on_images_plans_the_cross_attention_layers_quantized(tmp_path, capsys):
    """The recipe resolves the quantize stage's cross_attention from the calibration: kind images quantizes Llama 3.2
    Vision's cross-attention layers, and `compress inspect` says so before any weight is read; `cross_attention:
    float` keeps them float with the reason; `quantize` without images is refused."""
    from compress.cli import main
    from compress.recipe import RecipeError, from_dict
    folder, _ = _save("mllama", tmp_path / "mllama")
    quantize = {"stage": "quantize", "method": "gptq", "scheme": SCHEME}
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox\n")
    for calibration, cross in (({"kind": "images", "folder": str(tmp_path)}, "quantize"),
                               ({"kind": "files", "files": [str(text)]}, None)):
        recipe = from_dict({"model": {"source": str(folder)}, "calibration": calibration, "stages": [quantize]})
        assert recipe.stages[0].cross_attention == cross
    with pytest.raises(RecipeError, match="cross_attention: quantize needs calibration on images"):
        from_dict({"model": {"source": str(folder)}, "calibration": {"kind": "files", "files": [str(text)]},
                   "stages": [{**quantize, "cross_attention": "quantize"}]})
    lines = {}
    for how in ("", ", cross_attention: float"):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"model: {{source: {folder}, dtype: float32}}\n"
                          f"calibration: {{kind: images, folder: {tmp_path}}}\nstages:\n"
                          f"  - {{stage: quantize, method: gptq, scheme: {{dtype: int4, group_size: 16}}{how}}}\n")
        assert main(["inspect", str(recipe)]) == 0
        lines[how] = capsys.readouterr().out
    assert "    cross-attention layers: 7 linear layers (7 quantized, calibrated on images), 6 tensors," in lines[""]
    assert CROSS_ATTENTION_REASON not in lines[""]
    assert "    cross-attention layers: 7 linear layers, 13 tensors," in lines[", cross_attention: float"]
    assert CROSS_ATTENTION_REASON in lines[", cross_attention: float"]


def test_the_quantized_cross_attention_layers_export_and_reload_with_our_logits_on_an_image(tmp_path):
    """Llama 3.2 Vision calibrated on images (its cross-attention layers quantized): the checkpoint, the `dense` and
    the `compressed-tensors` exports reload in transformers as the family's class and give our compressed model's
    logits on an image-caption sample, which differ from the original's."""
    from compress.export.native import load_compressed
    from compress.export.readers import read_transformers
    from compress.pipeline.resident import run
    from compress.recipe import from_dict
    folder, _ = _save("mllama", tmp_path / "mllama")
    images = _images(tmp_path / "images")
    recipe = from_dict({"model": {"source": str(folder), "dtype": "float32"},
                        "calibration": {"kind": "images", "folder": str(images), "n_samples": 3},
                        "stages": [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}],
                        "eval": {"perplexity": False, "speed": False, "samples": 0},
                        "output": {"dir": str(tmp_path / "out"), "formats": ["dense", "compressed-tensors"],
                                   "verify_windows": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(recipe, progress=False, log=lambda *a: None)
    sample = image_samples(str(images), load_processor(str(folder)), 1, 0).inputs[0]
    with torch.no_grad():
        ours = load_compressed(tmp_path / "out")(**sample).logits
        original = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)(**sample)
        assert float((original.logits - ours).norm() / ours.norm()) > 1e-3
        for fmt in ("dense", "compressed-tensors"):
            model = read_transformers(tmp_path / "out" / "exports" / fmt, {"format": fmt})[1]
            assert type(model).__name__ == "MllamaForConditionalGeneration"
            rel = float((model(**sample).logits - ours).norm() / ours.norm())
            # compressed-tensors holds our codes and scales: measured 0.0; dense the dequantized weights in
            # bfloat16: measured 2.0e-3
            assert rel < (2e-2 if fmt == "dense" else 1e-6), (fmt, rel)
