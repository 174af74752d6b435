"""Sharded checkpoints: the saved model and every safetensors export split into HF-convention shards with an index
once they exceed max_shard_bytes, and reload (through our reader and through the formats' own loaders) to the same
predictions as the one-file checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open


from compress.export.verify import compare_logits, model_logits, verify_export
from compress.export.native import load_compressed, save_compressed
from compress.core.scheme import FP8, scheme
from compress.export.shards import INDEX, SINGLE, plan_shards, read_safetensors, write_safetensors
from tests.test_export import KL_BAR, WINDOWS, export, quantized
from tests.tiny_tokenizer import make_tiny_tokenizer

SMALL = 20_000  # bytes: the tiny models (about 0.1-0.5 MB of tensors) split into several shards


def test_shards_pack_in_order_and_an_oversized_tensor_gets_its_own():
    t = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(5)}  # 40, 40, 400, 20 B
    assert plan_shards(t, 80) == [["a", "b"], ["big"], ["c"]]
    assert plan_shards(t, 10 ** 6) == [["a", "b", "big", "c"]]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        plan_shards(t, 0)


def test_index_names_every_tensor_once_with_the_total_size(tmp_path):
    t = {f"w{i}": torch.randn(64, 64) for i in range(5)}  # 16 KiB each
    names = write_safetensors(tmp_path, t, {"compress": "1"}, max_shard_bytes=40_000)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX]
    index = json.loads((tmp_path / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(t) and index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    with safe_open(str(tmp_path / names[0]), "pt") as f:
        assert f.metadata() == {"format": "pt", "compress": "1"}
    back = read_safetensors(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in t.items())
    (tmp_path / "one").mkdir()
    assert write_safetensors(tmp_path / "one", t) == [SINGLE]  # the default, 5 GB: one file


def test_saved_model_in_shards_reloads_to_the_same_predictions(tmp_path):
    model = quantized(scheme("int4", "group", 16, symmetric=False), kv=True)
    save_compressed(model, make_tiny_tokenizer(), tmp_path / "one", {"source": "test"})
    save_compressed(model, make_tiny_tokenizer(), tmp_path / "sharded", {"source": "test"}, max_shard_bytes=SMALL)
    assert not (tmp_path / "sharded" / SINGLE).exists()
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 3
    one, sharded = load_compressed(tmp_path / "one"), load_compressed(tmp_path / "sharded")
    assert torch.equal(model_logits(one, WINDOWS), model_logits(sharded, WINDOWS))


@pytest.mark.parametrize("fmt,sch", [("dense", scheme("int4", "group", 16)),
                                     ("compressed-tensors", scheme("int4", "group", 16, symmetric=False)),
                                     ("awq", scheme("int4", "group", 16, symmetric=False)),
                                     ("gptq", scheme("int4", "group", 16)),
                                     ("fp8", FP8)])
def test_every_safetensors_export_shards_and_reloads_through_its_loader(fmt, sch, tmp_path):
    model = quantized(sch)
    out = export(model, fmt, tmp_path, max_shard_bytes=SMALL)
    assert (out / INDEX).is_file() and not (out / SINGLE).exists()
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 3
    result = verify_export(out, model, WINDOWS)
    assert result["kl"] < KL_BAR and result["top1_agreement"] == 1.0, result
    if fmt == "dense":  # plain transformers reads the index itself
        from transformers import AutoModelForCausalLM
        plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert compare_logits(model_logits(model, WINDOWS), model_logits(plain, WINDOWS))["kl"] < KL_BAR
