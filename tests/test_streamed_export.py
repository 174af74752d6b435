"""Exports written block by block (streaming.open_compressed + stream_parts): a compress checkpoint is read one
decoder block at a time and each format's tensors for that block go to the export's shards before the next block
is read. The files must equal the in-memory export's bit for bit, for every format, with at most one block in
memory; a refusal that needs a layer's data (GPTQ's zero point 0) still leaves nothing behind; a streamed run
with output.formats writes the same exports as the in-memory run."""
from __future__ import annotations

import json

import pytest
import torch

from compress.export import ExportError, export_model
from compress.export.native import load_compressed
from compress.pipeline.resident import run
from compress.recipe import from_dict
from compress.export.shards import read_safetensors, shard_files
from compress.model.streaming import open_compressed, stream_parts
from tests.conftest import make_tiny_model, requires_data
from tests.tiny_tokenizer import byte_bpe_tokenizer

INT4 = {"dtype": "int4", "granularity": "group", "group_size": 32, "symmetric": True}
# format -> the scheme its run quantizes with (each format's exact layout: q4_0 holds symmetric int4 g32)
FORMATS = {"dense": INT4, "compressed-tensors": INT4, "awq": {**INT4, "symmetric": False}, "gptq": INT4,
           "mlx": {**INT4, "symmetric": False},
           "gguf-q4_0": INT4, "fp8": {"dtype": "fp8_e4m3", "granularity": "block", "group_size": 16,
                                      "act": {"dtype": "fp8_e4m3", "granularity": "token"}}}
QUIET = {"progress": False, "log": lambda *a: None}


def _source(tmp_path, blocks: int = 4, edit=None):
    model = make_tiny_model("llama")
    model.config.num_hidden_layers = blocks
    model = type(model)(model.config)
    if edit is not None:
        edit(model)
    folder = tmp_path / "source"
    model.save_pretrained(folder, max_shard_size="50KB")
    byte_bpe_tokenizer().save_pretrained(folder)  # GGUF writes a byte-level BPE vocabulary
    return folder


def _run(tmp_path, scheme, stream="never", formats=(), name="run", source=None):
    out = tmp_path / name
    recipe = from_dict({
        "model": {"source": str(source or _source(tmp_path)), "dtype": "float32", "stream": stream},
        "stages": [{"stage": "quantize", "method": "rtn", "scheme": scheme}],
        "eval": {"perplexity": False, "speed": False, "samples": 0},
        "output": {"dir": str(out), "max_shard_gb": 0.00003, "formats": list(formats), "verify_windows": 0}})
    return out, run(recipe, **QUIET)


def _tensors(folder, fmt: str) -> dict:
    if not fmt.startswith("gguf"):
        return read_safetensors(folder)
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(next(folder.glob("*.gguf"))))
    return {t.name: (int(t.tensor_type), t.data.tobytes()) for t in reader.tensors}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype if isinstance(a[k], torch.Tensor)
               else a[k] == b[k] for k in a)


def _config(folder) -> dict:
    path = folder / "config.json"
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "_name_or_path"} if path.exists() else {}


def _counting(streamed, seen: list[int]):
    """stream_parts, noting at each step how many decoder blocks hold real (non-meta) tensors."""
    blocks = streamed.arch.block_list(streamed.model)
    for label in stream_parts(streamed):
        seen.append(sum(not next(b.parameters()).is_meta for b in blocks))
        yield label


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_streamed_export_equals_the_in_memory_export_with_one_block_resident(tmp_path, fmt):
    run_dir, _ = _run(tmp_path, FORMATS[fmt])
    model = load_compressed(run_dir)
    whole = export_model(model, open_compressed(run_dir).tokenizer, fmt, tmp_path / "whole",
                         max_shard_bytes=40_000)
    streamed, seen = open_compressed(run_dir), []
    parted = export_model(streamed.model, streamed.tokenizer, fmt, tmp_path / "parts", max_shard_bytes=40_000,
                          parts=_counting(streamed, seen))
    assert seen == [1, 1, 1, 1, 0]  # each block alone, then what lies outside the blocks
    assert _same(_tensors(tmp_path / "whole", fmt), _tensors(tmp_path / "parts", fmt))
    assert _config(tmp_path / "whole") == _config(tmp_path / "parts")
    key = "tensors" if fmt.startswith("gguf") else "layers"
    assert whole[key] == parted[key] and len(parted[key]) >= 4 * 7
    if not fmt.startswith("gguf"):
        assert len(shard_files(tmp_path / "parts")) > 1  # sharded at max_shard_bytes
    assert all(p.is_meta for p in streamed.model.parameters())  # nothing left in memory afterwards


def test_a_refusal_seen_only_in_a_blocks_data_leaves_nothing_behind(tmp_path):
    """GPTQ v1 cannot store a zero point of 0; on a streamed model that shows only when the block is read."""
    def positive_group(model):
        with torch.no_grad():
            w = model.model.layers[2].mlp.up_proj.weight
            w[0, :32] = w[0, :32].abs() + 0.01

    run_dir, _ = _run(tmp_path, {**INT4, "symmetric": False}, source=_source(tmp_path, edit=positive_group))
    streamed = open_compressed(run_dir)
    with pytest.raises(ExportError, match=r"layers\.2\.mlp\.up_proj.*zero point of 0"):
        export_model(streamed.model, streamed.tokenizer, "gptq", tmp_path / "gptq", parts=stream_parts(streamed))
    assert not (tmp_path / "gptq").exists() and not list(tmp_path.glob(".gptq.tmp-*"))


def test_a_streamed_run_writes_the_same_exports_as_the_in_memory_run(tmp_path):
    formats = ("compressed-tensors", "gguf-q4_0")
    source = _source(tmp_path)
    reports = {mode: _run(tmp_path, INT4, mode, formats, f"out-{mode}", source)[1] for mode in ("never", "always")}
    assert "streamed" in reports["always"] and "streamed" not in reports["never"]
    for fmt in formats:
        a, b = tmp_path / "out-never" / "exports" / fmt, tmp_path / "out-always" / "exports" / fmt
        ta, tb = _tensors(a, fmt), _tensors(b, fmt)
        if fmt.startswith("gguf"):
            # the in-memory run writes GGUF's f32 norms and q8_0 embedding from its float32 model, the streamed one
            # from the checkpoint it saved (bfloat16, output.save_dtype), as `compress export` does: the int4 codes
            # are the same
            assert ta.keys() == tb.keys()
            ta, tb = ({k: v for k, v in t.items() if v[0] == 2} for t in (ta, tb))  # 2: GGML Q4_0
            assert len(ta) == 4 * 7
        assert _same(ta, tb) and _config(a) == _config(b)
    entry = reports["always"]["exports"][0]
    assert entry["folder"] == "exports/compressed-tensors" and any("compress verify" in n for n in entry["notes"])
    assert "## Exports" in (tmp_path / "out-always" / "report.md").read_text()
    for mode, report in reports.items():  # the checkpoint alone, not the exports' shards written beside it
        checkpoint = sum(f.stat().st_size for f in (tmp_path / f"out-{mode}").glob("*.safetensors"))
        assert report["memory"]["checkpoint_bytes"] == checkpoint, mode


@requires_data
def test_fp8_kv_scales_go_to_the_streamed_export(tmp_path):
    out = tmp_path / "run"
    run(from_dict({"model": {"source": str(_source(tmp_path)), "dtype": "float32"},
                   "stages": [{"stage": "quantize", "method": "rtn", "scheme": "FP8"}, {"stage": "kv_cache"}],
                   "calibration": {"kind": "wikitext2", "n_samples": 2, "seq_len": 32},
                   "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(out)}}), **QUIET)
    for fmt in ("fp8", "compressed-tensors"):
        whole = export_model(load_compressed(out), None, fmt, tmp_path / f"whole-{fmt}")
        streamed = open_compressed(out)
        parted = export_model(streamed.model, None, fmt, tmp_path / f"parts-{fmt}", parts=stream_parts(streamed))
        tensors = read_safetensors(tmp_path / f"parts-{fmt}")
        assert sum(k.endswith("k_scale") for k in tensors) == 4
        assert _same(read_safetensors(tmp_path / f"whole-{fmt}"), tensors)
        assert whole["kv_cache_layers"] == parted["kv_cache_layers"]
