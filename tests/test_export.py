"""Exports reload through the loaders that serve them: compressed-tensors and dense through transformers,
fp8 / AWQ / GPTQ through their published layouts; refusals come before anything is written; folders are
replaced atomically; export.json records provenance. GGUF: tests/test_export_gguf.py; AWQ/GPTQ bit
layouts: tests/test_export_awq_gptq.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from compress.arch import get_arch
from compress.calibrate.blockwise import BlockPass, run_blockwise
from compress.export import ExportError, export_model
from compress.export.verify import compare_logits, load_export, model_logits, verify_export
from compress.kv.cache import attention_modules, restore_attention, set_kv_scales, use_kv_attention
from compress.core.nn import QuantLinear
from compress.calibrate.observers import BlockObserver
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import FP8, FP8_BLOCK, FP8_DYNAMIC, LLM_INT8, W8A8, W8A8_STATIC, scheme
from tests.conftest import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

pytest.importorskip("compressed_tensors")

# KL(ours || reloaded) per token. The reloaded models differ from ours only where the float tensors were
# stored in bfloat16 (embeddings, norms: 2^-9 relative) and in the order of float operations; measured
# 1e-7 (weight-only) to 1e-5 (fp8 with quantized activations) on these tiny models. The bar is 1e-3.
KL_BAR = 1e-3
WINDOWS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
CALIBRATION = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
FP8_BLOCK32 = scheme("fp8_e4m3", "block", 32, act=FP8_BLOCK.act)  # tiny model: 64 / 128 not divisible by 128


def quantized(sch, family: str = "llama", kv: bool = False, layer_schemes=(), **config) -> torch.nn.Module:
    """A tiny model quantized by the block-by-block runner (static activation scales need calibration); `config`
    overrides its config's fields."""
    model = make_tiny_model(family, **config)
    arch, stage = get_arch(model), QuantizeStage(scheme=sch, layer_schemes=tuple(layer_schemes))
    plan = plan_quantize(model, arch, stage)

    def observe(_i, _prefix, block):
        return BlockObserver(block, [n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)], [],
                             abs_mean=False, hessian=False, keep_samples=0, abs_max=True)

    run_blockwise(model, arch, CALIBRATION,
                  lambda _i, prefix, _b, _x, obs: apply_quantize(model, plan, stage, prefix, obs),
                  BlockPass(progress=False, observe=observe))
    if kv:
        for block in arch.block_list(model):
            for name in attention_modules(block):
                # small absmax: the keys and values clip, so a reload that ignored these scales would differ
                set_kv_scales(block.get_submodule(name), 0.05, 0.04, "fp8_e4m3")
        use_kv_attention(model)
    return model


def export(model, fmt: str, tmp_path: Path, **kw) -> Path:
    out = tmp_path / fmt
    export_model(model, make_tiny_tokenizer(), fmt, out, {"recipe_sha256": "ab" * 32}, **kw)
    return out


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def quant_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


CT_CASES = {
    "w4a16-asym-g16": (scheme("int4", "group", 16, symmetric=False), False),
    "w4a16-sym-g16": (scheme("int4", "group", 16), False),
    "w4a16-channel": (scheme("int4", "channel"), False),
    "w8a16": (scheme("int8", "channel"), False),
    "w8a8-dynamic": (W8A8, False),
    "w8a8-static": (W8A8_STATIC, False),
    "fp8-static": (FP8, False),
    "fp8-dynamic+kv": (FP8_DYNAMIC, True),
    "fp8-block": (FP8_BLOCK32, False),
}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_reloads_through_transformers(case, tmp_path):
    sch, kv = CT_CASES[case]
    model = quantized(sch, kv=kv)
    out = export(model, "compressed-tensors", tmp_path)
    result = verify_export(out, model, WINDOWS)
    assert result["loader"].startswith("transformers + compressed-tensors")
    assert result["kl"] < KL_BAR and result["top1_agreement"] == 1.0, result
    if sch.act is not None:  # compared with float inputs on both sides; static scales checked one by one
        assert "float activations" in result["activations"]
        assert result["input_scales_match"] is (True if not sch.act.dynamic else None)


def test_compressed_tensors_layout_is_what_vllm_reads(tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    model = quantized(scheme("int4", "group", 16, symmetric=False))
    out = export(model, "compressed-tensors", tmp_path)
    t, config = tensors(out), quant_config(out)
    q = model.model.layers[0].mlp.down_proj  # [64, 128]
    p = "model.layers.0.mlp.down_proj"
    assert t[f"{p}.weight_packed"].dtype == torch.int32 and t[f"{p}.weight_packed"].shape == (64, 128 // 8)
    assert t[f"{p}.weight_zero_point"].shape == (64 // 8, 128 // 16)  # packed along out_features
    assert t[f"{p}.weight_shape"].tolist() == [64, 128]
    codes = unpack_from_int32(t[f"{p}.weight_packed"], 4, torch.Size([64, 128]))  # the library's own reader
    assert torch.equal(codes.to(torch.int32) + 8, q.qtensor().codes())
    zp = unpack_from_int32(t[f"{p}.weight_zero_point"], 4, torch.Size([64, 8]), packed_dim=0)
    assert torch.equal(zp.to(torch.int32) + 8, q.zero_point.to(torch.int32))
    # scales in the dtype vLLM holds them in for a weight-only layer: the model's (config) dtype
    assert t[f"{p}.weight_scale"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(t[f"{p}.weight_scale"], q.scale.to(torch.bfloat16))
    group = config["config_groups"]["group_0"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert group["targets"] == ["Linear"] and group["weights"] == {**group["weights"], "num_bits": 4, "type": "int",
                                                                   "symmetric": False, "strategy": "group",
                                                                   "group_size": 16}
    assert config["ignore"] == ["lm_head"]
    assert "lm_head.weight" not in t  # tied to the embedding, written once as save_pretrained does


def _calibration_absmax(family: str, samples: torch.Tensor, layer: str) -> float:
    """max |x| of a block-0 layer's inputs on the calibration samples, from a plain hook on the float model (block
    0's inputs do not depend on any quantization)."""
    model, seen = make_tiny_model(family), []
    handle = model.get_submodule(layer).register_forward_hook(lambda _m, a, _o: seen.append(float(a[0].abs().max())))
    with torch.no_grad():
        for row in samples:
            model(row[None])
    handle.remove()
    return max(seen)


def test_compressed_tensors_fp8_static_with_kv_scales(tmp_path):
    model = quantized(FP8, kv=True)
    t, config = tensors(out := export(model, "compressed-tensors", tmp_path)), None
    config = quant_config(out)
    p = "model.layers.0.self_attn.o_proj"
    assert t[f"{p}.weight"].dtype == torch.float8_e4m3fn and t[f"{p}.weight_scale"].shape == (1,)
    assert t[f"{p}.weight_scale"].dtype == torch.float32 and t[f"{p}.input_scale"].dtype == torch.float32
    # the static input scale is the calibration inputs' max |x| / 448, computed here independently
    assert float(t[f"{p}.input_scale"]) == pytest.approx(_calibration_absmax("llama", CALIBRATION, p) / 448,
                                                         rel=1e-6)
    assert float(t["model.layers.0.self_attn.k_scale"]) == pytest.approx(0.05 / 448)
    assert config["format"] == "float-quantized" and config["kv_cache_scheme"]["type"] == "float"
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is False


def test_compressed_tensors_mixed_schemes_get_one_group_each(tmp_path):
    model = quantized(scheme("int4", "group", 16))
    stage = QuantizeStage(scheme=W8A8)
    dense = make_tiny_model("llama")
    plan = plan_quantize(dense, get_arch(dense), stage)
    apply_quantize(dense, plan, stage)
    for i in range(2):  # W8A8 MLPs in the int4 model
        for name in ("gate_proj", "up_proj", "down_proj"):
            model.model.layers[i].mlp.__setattr__(name, getattr(dense.model.layers[i].mlp, name))
    out = export(model, "compressed-tensors", tmp_path)
    config = quant_config(out)
    assert config["format"] == "mixed-precision"
    assert sorted(g["format"] for g in config["config_groups"].values()) == ["int-quantized", "pack-quantized"]
    assert verify_export(out, model, WINDOWS)["kl"] < KL_BAR


def test_fp8_format_for_vllm_and_tensorrt_llm(tmp_path):
    model = quantized(FP8, kv=True)
    out = export(model, "fp8", tmp_path)
    t, config = tensors(out), quant_config(out)
    p = "model.layers.0.mlp.up_proj"
    assert t[f"{p}.weight"].dtype == torch.float8_e4m3fn and t[f"{p}.weight_scale"].dtype == torch.float32
    assert t[f"{p}.weight_scale"].shape == (1,) and t[f"{p}.input_scale"].shape == (1,)
    assert "model.layers.0.self_attn.k_proj.k_scale" in t and "model.layers.0.self_attn.v_proj.v_scale" in t
    assert config == {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    result = verify_export(out, model, WINDOWS)
    assert result["loader"].startswith("compress reader") and result["kl"] < KL_BAR


def test_fp8_block_format_reloads_through_transformers(tmp_path):
    model = quantized(FP8_BLOCK32)
    out = export(model, "fp8", tmp_path)
    assert quant_config(out)["weight_block_size"] == [32, 32]
    assert not (out / "hf_quant_config.json").exists()
    result = verify_export(out, model, WINDOWS)
    assert result["loader"] == "transformers" and result["kl"] < KL_BAR


@pytest.mark.parametrize("fmt,sch", [("awq", scheme("int4", "group", 16, symmetric=False)),
                                     ("awq", scheme("int4", "group", 32)),
                                     ("gptq", scheme("int4", "group", 16)),
                                     ("gptq", scheme("int8", "channel"))])
def test_awq_and_gptq_checkpoints_read_back_exactly(fmt, sch, tmp_path):
    model = quantized(sch)
    out = export(model, fmt, tmp_path)
    config = quant_config(out)
    assert config["quant_method"] == fmt and config["bits"] == sch.bits
    assert config["group_size"] == (sch.group_size or -1)
    loader, reread = load_export(out)
    assert loader.startswith("compress reader")
    for name, m in model.named_modules():  # every quantized weight comes back bit for bit
        if isinstance(m, QuantLinear):
            assert torch.equal(reread.get_submodule(name).weight, m.qtensor().dequantize(torch.float32)), name
    assert compare_logits(model_logits(model, WINDOWS), model_logits(reread, WINDOWS))["kl"] < KL_BAR


def test_dense_export_is_a_plain_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    model = quantized(scheme("int4", "group", 16), kv=True)
    out = export(model, "dense", tmp_path)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    restore_attention(model)  # a dense checkpoint has no KV-cache scales: compare with float keys and values
    assert compare_logits(model_logits(model, WINDOWS), model_logits(plain, WINDOWS))["kl"] < KL_BAR
    record = json.loads((out / "export.json").read_text())
    assert any("KV-cache" in n for n in record["notes"])


@pytest.mark.parametrize("dtype", ["int5", "int6", "int7"])
def test_int5_to_int7_export_dense_and_reload_as_our_checkpoint(dtype, tmp_path):
    """The widths mixed precision adds between int4 and int8: no serving format packs them, so `dense` writes
    their dequantized weights, and our own checkpoint keeps the packed codes (reloaded to the bit)."""
    from transformers import AutoModelForCausalLM
    from compress.export.native import load_compressed, save_compressed

    model = quantized(scheme(dtype, "group", 16, False))
    out = export(model, "dense", tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert compare_logits(model_logits(model, WINDOWS), model_logits(plain, WINDOWS))["kl"] < KL_BAR
    save_compressed(model, make_tiny_tokenizer(), tmp_path / "ours", {})
    again = load_compressed(tmp_path / "ours")
    a, b = dict(model.named_modules()), dict(again.named_modules())
    name = "model.layers.0.mlp.down_proj"
    assert a[name].scheme.dtype == b[name].scheme.dtype == dtype
    assert torch.equal(a[name].qtensor().codes(), b[name].qtensor().codes())


def _row_stream(unsigned: torch.Tensor, bits: int, words: int) -> bytes:
    """One row's codes as compressed-tensors packs them: a little-endian bit stream cut into int32 words."""
    from tests.reference.naive import naive_pack
    stream = naive_pack(unsigned.tolist(), bits)
    return (stream + bytes(4 * words))[:4 * words]


@pytest.mark.parametrize("dtype,symmetric", [("int2", True), ("int3", False), ("int3", True), ("int5", False),
                                             ("int6", False), ("int7", True), ("int8", False)])
def test_compressed_tensors_any_width_packs_densely_and_reloads(dtype, symmetric, tmp_path):
    """int2 ... int8 weights in compressed-tensors' pack-quantized layout (vLLM 0.32 reads every width 2-8): each row
    a dense little-endian bit stream of the codes + 2^(b-1) (a code may straddle two words), checked against a naive
    bit stream; compressed-tensors' own unpacker gives our codes back bit for bit; transformers reloads the model."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    bits = int(dtype[3:])
    model = quantized(scheme(dtype, "group", 16, symmetric, scale_dtype="bfloat16"))  # the file's scale dtype
    out = export(model, "compressed-tensors", tmp_path)
    weights = quant_config(out)["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["group_size"]) == (bits, symmetric, 16)
    stored, half = tensors(out), 1 << (bits - 1)
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        qt, packed = m.qtensor(), stored[f"{name}.weight_packed"]
        unsigned = qt.codes().int() + (half if symmetric else 0)
        assert packed.shape == (m.out_features, -(-m.in_features * bits // 32))
        for r in (0, m.out_features - 1):
            assert packed[r].numpy().tobytes() == _row_stream(unsigned[r], bits, packed.shape[1])
        codes = unpack_from_int32(packed, bits, torch.Size(stored[f"{name}.weight_shape"].tolist()))
        assert torch.equal(codes.int() + half, unsigned)
        assert torch.equal(stored[f"{name}.weight_scale"].float(), qt.scale.float())
        if not symmetric:
            zp = unpack_from_int32(stored[f"{name}.weight_zero_point"], bits, torch.Size(qt.scale.shape), packed_dim=0)
            assert torch.equal(zp.int() + half, qt.zero_point.int())
    _, reloaded = load_export(out)
    assert compare_logits(model_logits(model, WINDOWS), model_logits(reloaded, WINDOWS))["kl"] < KL_BAR


@pytest.mark.parametrize("fmt,sch,family,words", [
    ("gptq", scheme("int3", "group", 16), "llama", "4- or 8-bit"),
    ("gptq", scheme("int5", "group", 16, False), "llama", "4- or 8-bit"),
    ("awq", scheme("int5", "group", 16, False), "llama", "4-bit integer weights only"),
    ("awq", scheme("int8", "channel"), "llama", "4-bit"),
    ("compressed-tensors", LLM_INT8, "llama", "LLM.int8"),
    ("compressed-tensors", scheme("int4", "group", 16), "gpt2", "Conv1D"),
    ("fp8", FP8_DYNAMIC, "llama", "compressed-tensors"),
    ("fp8", scheme("int4", "group", 16), "llama", "fp8 e4m3"),
    ("awq", W8A8, "llama", "weight-only"),
])
def test_unsupported_combinations_fail_before_writing(fmt, sch, family, words, tmp_path):
    model = quantized(sch, family=family)
    with pytest.raises(ExportError, match=words):
        export(model, fmt, tmp_path)
    assert list(tmp_path.iterdir()) == []  # not even a temporary folder


@pytest.mark.parametrize("other", [scheme("int8", "channel"), None])
def test_a_fused_group_split_across_schemes_is_refused_where_engines_fuse_it(other, tmp_path):
    """vLLM loads q/k/v as one module with one scheme: k in another scheme (or in float) cannot be served from a
    compressed-tensors, AWQ or GPTQ checkpoint, and the refusal names the group and the fixes; `dense` takes it."""
    from compress.stages.quantize import LayerScheme
    model = quantized(scheme("int4", "group", 16), layer_schemes=[LayerScheme("re:.*layers\\.0\\..*k_proj", other)])
    for fmt in ("compressed-tensors", "awq", "gptq"):
        with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.\{q_proj,k_proj,v_proj\} hold .*"
                                              r"one fused module.*fused_groups"):
            export(model, fmt, tmp_path)
    assert list(tmp_path.iterdir()) == []
    export(model, "dense", tmp_path)


def test_unknown_format_names_the_choices(tmp_path):
    with pytest.raises(ExportError, match="gguf-q4_0"):
        export(make_tiny_model("llama"), "gguf-q3_k", tmp_path)  # q4_k, q5_k and q6_k are written (K-quants)


def test_existing_folder_needs_overwrite_and_is_replaced_whole(tmp_path):
    model = quantized(scheme("int4", "group", 16))
    out = export(model, "compressed-tensors", tmp_path)
    (out / "stale.txt").write_text("from an earlier export")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export(model, "compressed-tensors", tmp_path)
    assert (out / "stale.txt").exists()
    export(model, "compressed-tensors", tmp_path, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["compressed-tensors"]


def test_export_records_provenance_and_copies_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from compress import __version__

    model = quantized(scheme("int4", "group", 16))
    out = export(model, "compressed-tensors", tmp_path)
    record = json.loads((out / "export.json").read_text())
    assert record["format"] == "compressed-tensors" and record["compress_version"] == __version__
    assert record["recipe_sha256"] == "ab" * 32 and "vLLM" in record["loaders"]
    import compressed_tensors
    import transformers
    assert record["written_with"]["transformers"] == transformers.__version__
    assert record["written_with"]["compressed-tensors"] == compressed_tensors.__version__
    assert record["engines_checked"]["vllm"].startswith("0.32")
    assert len(record["layers"]) == 14 and all("exactly" in v for v in record["layers"].values())
    assert (out / "generation_config.json").exists()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("the quick fox").input_ids == make_tiny_tokenizer()("the quick fox").input_ids


def test_input_model_folder_is_not_modified(tmp_path):
    from compress.model.load import load_model
    from compress.export.native import save_compressed

    src = tmp_path / "run"
    save_compressed(quantized(scheme("int4", "group", 16)), make_tiny_tokenizer(), src, {})
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    loaded = load_model(str(src))
    export_model(loaded.model, loaded.tokenizer, "awq", tmp_path / "awq")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


@pytest.mark.parametrize("fmt,sch", [("compressed-tensors", scheme("int4", "group", 16)), ("awq", scheme("int4", "group", 16)),
                                     ("gptq", scheme("int4", "group", 16)), ("fp8", FP8), ("dense", W8A8)])
def test_config_names_the_architecture_even_when_the_source_had_none(fmt, sch, tmp_path):
    """A model loaded from GGUF (or built from a config, like these) has no `architectures`; vLLM picks its model
    class from that field, so every format writes it."""
    model = quantized(sch)
    assert not model.config.architectures
    out = export(model, fmt, tmp_path)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not model.config.architectures  # the in-memory model is left as it was


def test_saved_run_names_the_architecture(tmp_path):
    from compress.export.native import save_compressed

    save_compressed(quantized(scheme("int4", "group", 16)), make_tiny_tokenizer(), tmp_path / "run", {})
    assert json.loads((tmp_path / "run" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("sch,dtype", [(scheme("int4", "group", 16), torch.bfloat16),
                                       (scheme("int8", "channel"), torch.bfloat16),
                                       (W8A8_STATIC, torch.float32), (FP8_DYNAMIC, torch.float32)],
                         ids=["w4a16", "w8a16", "w8a8", "fp8"])
def test_compressed_tensors_scales_are_in_the_dtype_vllm_allocates(sch, dtype, tmp_path):
    """vLLM's CompressedTensorsWNA16 holds weight-only scales in the model dtype (params_dtype), W8A8 int8 and fp8
    in float32: the file holds them so, and says where that rounded our float16 scales."""
    model = quantized(sch)
    out = export(model, "compressed-tensors", tmp_path)
    t = tensors(out)
    scales = {k: v for k, v in t.items() if k.endswith(".weight_scale")}
    assert len(scales) == 14 and {v.dtype for v in scales.values()} == {dtype}
    notes = json.loads((out / "export.json").read_text())["notes"]
    rounded = any(not torch.equal(v.float(), model.get_submodule(k[:-len(".weight_scale")]).qtensor().scale.float()
                                  .reshape(v.shape)) for k, v in scales.items())
    assert rounded == (dtype == torch.bfloat16)  # float16 -> bfloat16 drops 3 mantissa bits
    assert any("scale_dtype: bfloat16" in n for n in notes) == rounded


def test_bfloat16_scales_export_exactly(tmp_path):
    model = quantized(scheme("int4", "group", 16, scale_dtype="bfloat16"))
    out = export(model, "compressed-tensors", tmp_path)
    record = json.loads((out / "export.json").read_text())
    assert not any("rounded" in n for n in record["notes"])  # only the engines' notes (tests/test_engines.py)
    assert all("scales copied exactly" in v for v in record["layers"].values())
    t = tensors(out)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(t[f"{name}.weight_scale"], m.qtensor().scale), name


def test_every_format_is_one_registry_entry_that_writes_and_reads_back():
    """The registry's keys are the list of formats (recipes, --help), and each entry names its writer, its checks and
    its reader (`compress verify`), resolved on first use."""
    from compress.export import EXPORTERS, FORMAT_NAMES

    assert FORMAT_NAMES == tuple(EXPORTERS)
    assert {"dense", "compressed-tensors", "awq", "gptq", "fp8", "modelopt-nvfp4", "native", "gguf-q4_k_m"} \
        <= set(FORMAT_NAMES)
    for name, exporter in EXPORTERS.items():
        assert exporter.name == name and callable(exporter.problems) and callable(exporter.write)
        assert callable(exporter.read), name


def test_our_own_checkpoint_is_an_exporter_read_back_exactly(tmp_path):
    """`native`: compress's own checkpoint written through export_model and read back by `compress verify`'s path
    with every QuantLinear buffer equal; the float tensors (norms, embeddings) are stored in bfloat16, so the logits
    agree within the bar every export meets."""
    model = quantized(scheme("int4", "group", 16), kv=True)
    out = export(model, "native", tmp_path)
    loader, again = load_export(out)
    assert loader.startswith("compress")
    ours, theirs = dict(model.named_modules()), dict(again.named_modules())
    quant = [n for n, m in ours.items() if isinstance(m, QuantLinear)]
    assert quant and all(isinstance(theirs[n], QuantLinear) for n in quant)
    for n in quant:
        assert torch.equal(ours[n].qdata, theirs[n].qdata) and torch.equal(ours[n].scale, theirs[n].scale)
    assert compare_logits(model_logits(model, WINDOWS), model_logits(again, WINDOWS))["kl"] < KL_BAR
    assert verify_export(out, model, WINDOWS)["kl"] < KL_BAR
