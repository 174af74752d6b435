"""save_compressed -> load_compressed round trips, and load_model on folders and bad sources."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from compress.arch import get_arch
from compress.model.load import load_model
from compress.export.native import COMPRESS_META, load_compressed, save_compressed
from compress.export.shards import SINGLE as WEIGHTS
from compress.core.nn import QuantLinear
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import scheme
from tests.conftest import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer, word_text

SCHEMES = [scheme("int4", "group", 16, symmetric=False), scheme("int8", "channel")]
# llama: tied lm_head / embed_tokens; gpt2: transformers Conv1D layers (weight stored [in, out]), tied head
FAMILIES = ["llama", "gpt2"]
# 2 blocks × (q, k, v, o, gate, up, down) for llama, × (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) for gpt2
N_QUANTIZED = {"llama": 2 * 7, "gpt2": 2 * 4}
# Relative logits error after saving the float tensors (embeddings, norms, biases) in bfloat16 while the
# quantized buffers stay exact. Measured 0.0021 (llama) and 0.0023 (gpt2), int4 g16 asym: bf16 keeps 8
# significant bits, so each float weight moves by at most 2^-9 ≈ 0.002 relative. 0.01 leaves over 4x margin.
BF16_LOGITS_REL_ERR = 0.01


def _quantized(family: str, sch) -> nn.Module:
    model = make_tiny_model(family)
    stage = QuantizeStage(scheme=sch)
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    return model


def _quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    return model(input_ids=ids, use_cache=False).logits


def _assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    qa, qb = _quant_layers(a), _quant_layers(b)
    assert set(qa) == set(qb) and len(qa) == N_QUANTIZED[a.config.model_type]
    for name in qa:
        assert qa[name].scheme == qb[name].scheme, name
        assert qa[name].qdata.dtype == qb[name].qdata.dtype and torch.equal(qa[name].qdata, qb[name].qdata), name
        assert qa[name].scale.dtype == qb[name].scale.dtype and torch.equal(qa[name].scale, qb[name].scale), name
        if qa[name].zero_point is None:
            assert qb[name].zero_point is None, name
        else:
            assert torch.equal(qa[name].zero_point, qb[name].zero_point), name
        if qa[name].bias is not None:
            assert torch.equal(qa[name].bias, qb[name].bias), name


@pytest.mark.parametrize("sch", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_round_trip_is_exact(tmp_path, family, sch):
    model = _quantized(family, sch)
    save_compressed(model, None, tmp_path, {"note": "test"}, save_dtype="float32")
    loaded = load_compressed(tmp_path)
    _assert_same_buffers(model, loaded)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight  # re-tied at load
    loaded.set_attn_implementation("eager")  # from_config picks sdpa; the tiny models run eager
    assert torch.equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_save_keeps_quantized_buffers_exact(tmp_path, family):
    model = _quantized(family, SCHEMES[0])
    save_compressed(model, None, tmp_path, {}, save_dtype="bfloat16")
    with safe_open(str(tmp_path / WEIGHTS), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes[f"{get_arch(model).embed}.weight"] == "BF16"
    assert {d for k, d in dtypes.items() if k.endswith(".scale")} == {"F16"}  # scheme.scale_dtype, not bf16
    loaded = load_compressed(tmp_path)
    _assert_same_buffers(model, loaded)
    assert loaded.get_input_embeddings().weight.dtype == torch.float32
    loaded.set_attn_implementation("eager")
    ref = _logits(model)
    out = _logits(loaded)
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < BF16_LOGITS_REL_ERR


def test_tied_weights_are_stored_once(tmp_path):
    model = _quantized("llama", SCHEMES[1])
    save_compressed(model, None, tmp_path, {}, save_dtype="float32")
    with safe_open(str(tmp_path / WEIGHTS), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) != ("model.embed_tokens.weight" in keys)


def test_compress_json_records_layers_and_provenance(tmp_path):
    model = _quantized("gpt2", SCHEMES[0])
    save_compressed(model, make_tiny_tokenizer(), tmp_path, {"recipe_sha256": "abc"}, save_dtype="bfloat16")
    meta = json.loads((tmp_path / COMPRESS_META).read_text())
    assert meta["recipe_sha256"] == "abc" and meta["save_dtype"] == "bfloat16"
    assert meta["format"] == "compress-native-v1"
    assert meta["layers"] == {n: m.scheme.to_dict() for n, m in _quant_layers(model).items()}
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()


def test_load_model_on_a_compressed_folder(tmp_path):
    model = _quantized("llama", SCHEMES[0])
    save_compressed(model, make_tiny_tokenizer(), tmp_path, {}, save_dtype="float32")
    loaded = load_model(str(tmp_path))
    assert loaded.kind == "compressed" and loaded.source == str(tmp_path)
    _assert_same_buffers(model, loaded.model)
    assert loaded.tokenizer(word_text(4)).input_ids == make_tiny_tokenizer()(word_text(4)).input_ids


def test_load_compressed_rejects_a_mismatched_checkpoint(tmp_path):
    model = _quantized("llama", SCHEMES[1])
    save_compressed(model, None, tmp_path, {}, save_dtype="float32")
    meta = json.loads((tmp_path / COMPRESS_META).read_text())
    del meta["layers"]["model.layers.0.mlp.up_proj"]
    (tmp_path / COMPRESS_META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"checkpoint does not match its config: "
                                         r"unexpected=\['model\.layers\.0\.mlp\.up_proj\.(qdata|scale)"):
        load_compressed(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_on_a_save_pretrained_folder(tmp_path, family):
    model = make_tiny_model(family)
    model.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.kind == "folder" and loaded.source == str(tmp_path)
    assert type(loaded.model) is type(model)
    assert loaded.tokenizer(word_text(3)).input_ids == [2, 3, 4]
    loaded.model.set_attn_implementation("eager")
    assert torch.equal(_logits(loaded.model), _logits(model))


def test_load_model_missing_gguf():
    with pytest.raises(FileNotFoundError, match=r"model 'does/not/exist/x\.gguf': no such \.gguf file"):
        load_model("does/not/exist/x.gguf")


def test_load_model_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json; is it a Hugging Face model folder\?"):
        load_model(str(tmp_path))


def test_load_model_unrecognised_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not `default`, a \.gguf file, a model folder or a hub id"):
        load_model(str(tmp_path / "missing" / "folder"))


def test_the_embedded_model_loads_from_its_kept_conversion_as_from_the_gguf_file(tmp_path, monkeypatch):
    """The first load of `default` converts the GGUF file and keeps the conversion in the cache; the next one reads
    it (no GGUF parse, about 0.2 s instead of 15 s) and is the same model: every weight bit for bit (lm_head still
    tied), the same config, the same tokenizer (ids of a mixed text, chat template, special tokens)."""
    from compress.model import gguf_cache
    from compress.model.default_model import default_model_path

    monkeypatch.setenv("COMPRESS_DEFAULT_GGUF", str(default_model_path()))  # before the cache moves
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    kept = []
    real = gguf_cache.keep
    monkeypatch.setattr(gguf_cache, "keep", lambda *a, **kw: kept.append(real(*a, **kw)) or kept[-1])
    cold = load_model("default")
    assert len(kept) == 1 and kept[0] is not None and kept[0].parent == tmp_path / "converted"
    warm = load_model("default")
    assert len(kept) == 1  # read from the kept folder, not converted again
    a, b = cold.model.state_dict(), warm.model.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert warm.model.lm_head.weight is warm.model.model.embed_tokens.weight
    assert cold.model.config.to_json_string() == warm.model.config.to_json_string()
    text = "Hello world, the quick brown fox. 123 ∑ émoji 🙂\n\n  spaces <|im_start|>user"
    assert cold.tokenizer(text).input_ids == warm.tokenizer(text).input_ids
    assert cold.tokenizer.chat_template == warm.tokenizer.chat_template
    assert cold.tokenizer.all_special_tokens == warm.tokenizer.all_special_tokens
    assert warm.source == cold.source and warm.kind == cold.kind == "default"


def test_a_conversion_that_cannot_be_kept_is_a_note_not_an_error(tmp_path, monkeypatch):
    from compress.model import gguf_cache

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "a file"))
    (tmp_path / "a file").write_text("not a folder")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    notes = []
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    assert gguf_cache.keep(str(gguf), torch.float32, model, tok, log=notes.append) is None
    assert len(notes) == 1 and "COMPRESS_CACHE" in notes[0]
    assert gguf_cache.cached(str(gguf), torch.float32) is None
