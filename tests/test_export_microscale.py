"""NVFP4 / MXFP4 / MXFP8 exports: compressed-tensors (nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp8-quantized)
reloaded through transformers' compressed-tensors loader, and ModelOpt's NVFP4 layout reloaded through
compressed-tensors' own ModelOpt converter; the tensors are the ones those projects' sources name."""
from __future__ import annotations

import json

import pytest
import torch

from compress.export import ExportError, export_model
from compress.export.verify import verify_export
from compress.core.scheme import MXFP4, MXFP4A16, MXFP8, MXFP8A16, NVFP4, NVFP4A16, ActScheme, QuantScheme
from dataclasses import replace
from tests.test_export import KL_BAR, WINDOWS, export, quant_config, quantized, tensors
from tests.tiny_tokenizer import make_tiny_tokenizer

pytest.importorskip("compressed_tensors")

LAYER = "model.layers.0.mlp.up_proj"  # [128, 64] in the tiny llama
CT = {"NVFP4A16": NVFP4A16, "NVFP4": NVFP4, "MXFP4A16": MXFP4A16, "MXFP4": MXFP4, "MXFP8A16": MXFP8A16,
      "MXFP8": MXFP8}


@pytest.mark.parametrize("name", list(CT))
def test_compressed_tensors_microscale_layout_and_reload(name, tmp_path):
    sch = CT[name]
    model = quantized(sch)
    out = export(model, "compressed-tensors", tmp_path)
    t = {k.rpartition(".")[-1]: v for k, v in tensors(out).items() if k.startswith(LAYER + ".")}
    fp4 = sch.dtype == "fp4_e2m1"
    want = {"weight_packed" if fp4 else "weight", "weight_scale"}
    if sch.has_global_scale:
        want.add("weight_global_scale")
        if sch.act is not None:
            want.add("input_global_scale")
    assert set(t) == want
    if fp4:
        assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (128, 32)
    else:
        assert t["weight"].dtype == torch.float8_e4m3fn and t["weight"].shape == (128, 64)
    assert t["weight_scale"].dtype == (torch.float8_e4m3fn if sch.has_global_scale else torch.uint8)
    assert t["weight_scale"].shape == (128, 64 // sch.group_size)
    group = quant_config(out)["config_groups"]["group_0"]
    assert group["format"] == {"NVFP4": "nvfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized",
                               "MXFP8": "mxfp8-quantized"}[sch.micro_name]
    assert group["weights"]["strategy"] == ("tensor_group" if sch.has_global_scale else "group")
    if sch.act is not None:
        assert group["input_activations"]["dynamic"] == ("local" if sch.has_global_scale else True)
    result = verify_export(out, model, WINDOWS)
    assert result["loader"] == "transformers + compressed-tensors (dequantize on load)"
    assert result["kl"] < KL_BAR and result["top1_agreement"] == 1.0, result
    if sch.act is not None:
        assert result["input_scales_match"] is (True if sch.has_global_scale else None)


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_compressed_tensors_own_compressor_writes_the_same_bytes(name, tmp_path):
    """compressed-tensors' NVFP4 / MXFP4 compressor, given our dequantized weight and our scales, packs exactly
    the bytes we wrote: the codes are the ones its quantizer picks on its grid."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    sch = CT[name]
    model = quantized(sch)
    qt = model.get_submodule(LAYER).qtensor()
    out = export(model, "compressed-tensors", tmp_path)
    written = {k.rpartition(".")[-1]: v for k, v in tensors(out).items() if k.startswith(LAYER + ".")}
    args = QuantizationArgs(**PRESET_SCHEMES[name]["weights"].model_dump())
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": qt.dequantize(), "weight_scale": qt.scale_float() * (qt.global_scale if
                                                                                 sch.has_global_scale else 1)}
    if sch.has_global_scale:
        state["weight_global_scale"] = qt.global_scale.reshape(1)
    compressor = NVFP4PackedCompressor if sch.has_global_scale else MXFP4PackedCompressor
    theirs = compressor.compress(state, scheme)

    def no_negative_zero(packed):  # our -0.0 (a small negative weight) dequantizes to -0.0, which their cast
        lo, hi = packed & 0x0F, packed >> 4  # re-encodes as +0 (torch.sign(-0.0) = 0): both decode to 0
        return torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)
    assert torch.equal(no_negative_zero(theirs["weight_packed"]), no_negative_zero(written["weight_packed"]))
    assert not torch.equal(theirs["weight_packed"], torch.zeros_like(theirs["weight_packed"]))
    assert torch.equal(theirs["weight_scale"].view(torch.uint8), written["weight_scale"].view(torch.uint8))


@pytest.mark.parametrize("sch", [NVFP4A16, NVFP4])
def test_modelopt_nvfp4_layout_and_reload(sch, tmp_path):
    model = quantized(sch)
    out = export(model, "modelopt-nvfp4", tmp_path)
    t = {k.rpartition(".")[-1]: v for k, v in tensors(out).items() if k.startswith(LAYER + ".")}
    assert set(t) == {"weight", "weight_scale", "weight_scale_2"} | ({"input_scale"} if sch.act else set())
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (128, 32)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (128, 4)
    qt = model.get_submodule(LAYER).qtensor()
    assert t["weight_scale_2"].shape == () and float(t["weight_scale_2"]) == float(1.0 / qt.global_scale)
    assert torch.equal(t["weight"], qt.qdata)  # the same nibbles as compressed-tensors' weight_packed
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == ("NVFP4" if sch.act else "W4A16_NVFP4") and hf_quant["group_size"] == 16
    assert hf_quant["exclude_modules"] == ["lm_head"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    result = verify_export(out, model, WINDOWS)
    assert result["loader"].startswith("compressed-tensors' ModelOpt NVFP4 converter")
    assert result["kl"] < KL_BAR and result["top1_agreement"] == 1.0, result
    if sch.act is not None:
        assert result["input_scales_match"] is True


def test_exports_refuse_what_their_loaders_cannot_read(tmp_path):
    with pytest.raises(ExportError, match="NVFP4 or NVFP4A16 preset"):
        export_model(quantized(MXFP4A16), make_tiny_tokenizer(), "modelopt-nvfp4", tmp_path / "a")
    odd = QuantScheme("fp4_e2m1", "group", 32, True, "float8_e4m3")  # e4m3 scales over 32: no format has it
    with pytest.raises(ExportError, match="use a preset"):
        export_model(quantized(odd), make_tiny_tokenizer(), "compressed-tensors", tmp_path / "b")
    dyn = replace(NVFP4, act=replace(NVFP4.act, dynamic=True))  # a per-input tensor scale: no engine has it
    with pytest.raises(ExportError, match="act.dynamic: false"):
        export_model(quantized(dyn), make_tiny_tokenizer(), "compressed-tensors", tmp_path / "c")
    with pytest.raises(ExportError, match="MXFP4 weights go with MXFP4 activations"):
        mixed = replace(MXFP4A16, act=ActScheme("fp8_e4m3", "group", group_size=32, scale_dtype="e8m0"))
        export_model(quantized(mixed), make_tiny_tokenizer(), "compressed-tensors", tmp_path / "d")
    for fmt in ("awq", "gptq", "fp8"):
        with pytest.raises(ExportError):
            export_model(quantized(NVFP4A16), make_tiny_tokenizer(), fmt, tmp_path / fmt)


@pytest.mark.parametrize("name", ["nvfp4.yaml", "mxfp4.yaml"])
def test_shipped_microscale_recipes_run_and_their_exports_reload(name, tmp_path):
    """The shipped recipe's stages and formats, end to end on a tiny llama: calibrated (NVFP4's input global scale
    from observed amax), quantized, exported and each export reloaded by its loader agreeing with the model."""
    import yaml

    from compress.recipe import resource_dir
    from tests.conftest import run_tiny_recipe

    shipped = yaml.safe_load((resource_dir("recipes") / name).read_text())
    out = run_tiny_recipe(tmp_path, shipped["stages"], {"perplexity": False, "speed": False, "baseline": False, "samples": 0},
                          tuple(shipped["output"]["formats"]))
    report = json.loads((out / "report.json").read_text())
    assert [e["format"] for e in report["exports"]] == shipped["output"]["formats"]
    for entry in report["exports"]:
        assert entry["verify"]["kl"] < KL_BAR and entry["verify"]["top1_agreement"] > 0.95, entry
    layers = json.loads((out / "compress.json").read_text())["layers"]
    assert len(layers) == 14 and {v["dtype"] for v in layers.values()} == {"fp4_e2m1"}  # 2 blocks x 7, no head
    want = shipped["stages"][-1]["scheme"]  # a preset name
    assert {(v["group_size"], v["scale_dtype"], v["act"] is not None) for v in layers.values()} == {
        {"NVFP4": (16, "float8_e4m3", True), "MXFP4A16": (32, "e8m0", False)}[want]}


def test_a_reload_left_in_bfloat16_is_compared_in_float32(tmp_path, monkeypatch):
    """transformers 5.17 (the GPU machine's) leaves an NVFP4 export's weights decompressed in bfloat16 beside float32
    activations, a dtype error at the first matmul; 5.25 (here) gives float32. That loader is imitated: the reload is
    compared in float32 either way."""
    import transformers

    model = quantized(NVFP4)
    out = export(model, "compressed-tensors", tmp_path)
    original = transformers.AutoModelForCausalLM.from_pretrained

    def like_5_17(*args, **kwargs):
        loaded = original(*args, **kwargs)
        for name, m in loaded.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":  # the layers it decompressed
                m.weight.data = m.weight.data.to(torch.bfloat16)
        return loaded

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", like_5_17)
    result = verify_export(out, model, WINDOWS)
    assert result["kl"] < KL_BAR and result["top1_agreement"] == 1.0, result
