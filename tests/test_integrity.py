"""Damaged inputs get a clear error before any work (compress/model/integrity.py): safetensors checkpoints (one file and
sharded), GGUF files and resume folders, each written by its real writer, then cut short, emptied, with a length
field or a header byte changed, or with a shard missing. Every error is a DamagedFileError (a ValueError, which the
CLI prints as one line) naming the file, the tensor where there is one, the bytes expected and found for a cut file,
and the fix. Sound files pass, the embedded model's among them; through `compress run`, `load_model` and the
streamed source the error comes out before anything else is read."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from compress.model.integrity import (DamagedFileError, check_gguf, check_resume_dir, check_safetensors,
                                check_safetensors_folder, gguf_reader)
from tests.conftest import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer, word_text

REFETCH = "Download or copy it again"  # the fix a cut or corrupt model file names
CUT = "truncated"


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _header(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, raw[8:8 + n]


def _refused(check, path, *words: str, tensor: str | None = None) -> DamagedFileError:
    with pytest.raises(DamagedFileError) as info:
        check(path)
    err = info.value
    msg = str(err)
    assert isinstance(err, ValueError)  # what `compress` prints as one line (cli.main)
    assert str(err.path) in msg, msg
    for word in words:
        assert word in msg, msg
    if tensor is not None:
        assert err.tensor == tensor and repr(tensor) in msg, msg
    return err


# ----------------------------------------------------------------------------------------------- safetensors


@pytest.fixture
def st_file(tmp_path) -> Path:
    """A tiny llama's tensors written by safetensors' own save_file."""
    path = tmp_path / "model.safetensors"
    save_file({k: v.clone() for k, v in make_tiny_model("llama").state_dict().items()}, str(path),
              metadata={"format": "pt"})
    return path


@pytest.fixture
def sharded(tmp_path) -> Path:
    """A tiny llama saved by transformers in 50 KB shards with its index, as a large checkpoint is."""
    folder = tmp_path / "sharded"
    make_tiny_model("llama").save_pretrained(folder, max_shard_size="50KB")
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def _index(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def test_sound_safetensors_pass_every_dtype_sized_as_the_writer_writes_it(tmp_path, st_file, sharded):
    check_safetensors(st_file)
    check_safetensors_folder(sharded)
    assert len(set(_index(sharded).values())) > 3
    mixed = tmp_path / "mixed.safetensors"
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
              torch.uint32, torch.uint64]
    save_file({f"t{i}": torch.zeros(3, 5, dtype=d) for i, d in enumerate(dtypes)} | {"empty": torch.zeros(0, 4),
                                                                                      "scalar": torch.ones(())},
              str(mixed))
    check_safetensors(mixed)


def test_checking_reads_the_header_only(tmp_path):
    """An 8 GB checkpoint (a sparse file: no data written) is checked in milliseconds, as a 70B model's ~30 shards
    must be: reading its data would take seconds."""
    path = tmp_path / "big.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2 ** 31], "data_offsets": [0, 2 ** 33]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    os.truncate(path, 8 + len(header) + 2 ** 33)
    start = time.perf_counter()
    check_safetensors(path)
    assert time.perf_counter() - start < 0.5
    os.truncate(path, 8 + len(header) + 2 ** 32)
    err = _refused(check_safetensors, path, CUT, tensor="w")
    assert (err.expected, err.found) == (8 + len(header) + 2 ** 33, 8 + len(header) + 2 ** 32)


def test_a_safetensors_file_cut_in_half_names_the_first_cut_tensor_and_the_sizes(st_file):
    size = st_file.stat().st_size
    n, raw = _header(st_file)
    entries = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
    data = size // 2 - 8 - n
    first_cut = min((e["data_offsets"][0], k) for k, e in entries.items() if e["data_offsets"][1] > data)[1]
    os.truncate(st_file, size // 2)
    err = _refused(check_safetensors, st_file, CUT, REFETCH, "df -h", f"expected a file of {size} bytes",
                   f"found {size // 2}", tensor=first_cut)
    assert (err.expected, err.found) == (size, size // 2)


def test_an_empty_safetensors_file_is_refused(st_file):
    os.truncate(st_file, 0)
    err = _refused(check_safetensors, st_file, "0 bytes", "empty or truncated", REFETCH)
    assert (err.expected, err.found) == (8, 0)


def test_a_file_cut_inside_its_header_says_so(st_file):
    n, _ = _header(st_file)
    os.truncate(st_file, 8 + n // 2)
    err = _refused(check_safetensors, st_file, "truncated inside its header", f"says {n} bytes", REFETCH)
    assert (err.expected, err.found) == (8 + n, 8 + n // 2)


@pytest.mark.parametrize("value,words", [
    (2 ** 40, ("header length field", "corrupt")),  # a high byte of the length changed
    (None, ("does not parse",)),  # the length 8 bytes longer: the JSON runs into the tensor data
])
def test_a_corrupt_header_length_field_is_refused(st_file, value, words):
    n, _ = _header(st_file)
    _poke(st_file, 0, struct.pack("<Q", value if value is not None else n + 8))
    _refused(check_safetensors, st_file, *words, REFETCH)


def test_a_flipped_byte_in_the_json_header_is_refused(st_file):
    for offset, byte, words in [(8, b"[", ("does not parse",)), (30, b"\xff", ("does not parse",))]:
        path = st_file.with_name(f"flip{offset}.safetensors")
        shutil.copy(st_file, path)
        _poke(path, offset, byte)
        _refused(check_safetensors, path, *words, "corrupt", REFETCH)


def test_a_changed_data_offset_names_its_tensor(st_file):
    n, raw = _header(st_file)
    name = "model.layers.1.mlp.up_proj.weight"
    m = re.search(rb'"' + re.escape(name.encode()) + rb'":\{[^}]*"data_offsets":\[\d+,(\d+)\]', raw)
    digit = m.end(1) - 1  # the end offset's last digit, one more
    _poke(st_file, 8 + digit, bytes([ord("0") + (raw[digit] - ord("0") + 1) % 10]))
    _refused(check_safetensors, st_file, "data_offsets", "span", "corrupt", tensor=name)


def test_bytes_after_the_last_tensor_are_refused(st_file):
    size = st_file.stat().st_size
    with open(st_file, "ab") as f:
        f.write(b"\0" * 16)
    err = _refused(check_safetensors, st_file, "16 bytes after its last tensor")
    assert (err.expected, err.found) == (size, size + 16)


def test_a_missing_shard_is_named_with_a_tensor_it_holds(sharded):
    weight_map = _index(sharded)
    shard = sorted(set(weight_map.values()))[1]
    (sharded / shard).unlink()
    tensor = next(t for t, s in weight_map.items() if s == shard)
    err = _refused(check_safetensors_folder, sharded, "is missing", "model.safetensors.index.json",
                   "download the missing shards again", tensor=tensor)
    assert err.path == sharded / shard


def test_a_cut_shard_in_a_sharded_checkpoint_is_named(sharded):
    shard = sorted(set(_index(sharded).values()))[2]
    os.truncate(sharded / shard, (sharded / shard).stat().st_size // 2)
    err = _refused(check_safetensors_folder, sharded, CUT, REFETCH)
    assert err.path == sharded / shard and err.tensor in _index(sharded)


def test_a_shard_that_does_not_hold_what_the_index_says_is_refused(sharded):
    weight_map = _index(sharded)
    first, second = sorted(set(weight_map.values()))[:2]
    shutil.copy(sharded / first, sharded / second)  # a mixed download
    tensor = next(t for t, s in weight_map.items() if s == second)
    _refused(check_safetensors_folder, sharded, "lacks tensor", "index", tensor=tensor)


def test_a_damaged_index_is_refused(sharded):
    index = sharded / "model.safetensors.index.json"
    os.truncate(index, index.stat().st_size // 2)
    _refused(check_safetensors_folder, sharded, "is damaged", REFETCH)


def test_numbered_shards_without_their_index_name_the_missing_one(sharded):
    shards = sorted(set(_index(sharded).values()))
    (sharded / "model.safetensors.index.json").unlink()
    (sharded / shards[1]).unlink()
    _refused(check_safetensors_folder, sharded, shards[1], "incomplete")


# ----------------------------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def gguf_sound(tmp_path_factory) -> Path:
    """A tiny llama written as q8_0 GGUF by compress's writer (gguf's GGUFWriter)."""
    from compress.export.gguf import write_gguf
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(make_tiny_model("llama"), byte_bpe_tokenizer(), path, "q8_0")
    return path


@pytest.fixture
def gguf_file(tmp_path, gguf_sound) -> Path:
    path = tmp_path / "tiny.gguf"
    shutil.copy(gguf_sound, path)
    return path


def _tensor_info(path: Path, name: str) -> int:
    """Byte offset of tensor `name`'s info (its n_dims field) in the header."""
    raw = path.read_bytes()
    at = raw.rindex(struct.pack("<Q", len(name)) + name.encode())
    return at + 8 + len(name)


def test_sound_gguf_files_pass(gguf_file):
    from gguf import GGUFReader

    check_gguf(gguf_file)
    assert len(gguf_reader(gguf_file).tensors) == len(GGUFReader(gguf_file).tensors) == 20


def test_the_embedded_models_gguf_passes_in_milliseconds():
    from compress.model import integrity
    from compress.model.default_model import default_model_path

    path = default_model_path()
    integrity._checked.clear()
    check_gguf(path)  # gguf imported
    integrity._checked.clear()
    start = time.perf_counter()
    check_gguf(path)  # 272 tensors and a 49152-token vocabulary
    assert time.perf_counter() - start < 1.0


def test_a_gguf_file_cut_in_half_names_the_cut_tensor_and_the_sizes(gguf_file):
    size = gguf_file.stat().st_size
    os.truncate(gguf_file, size // 2)
    err = _refused(check_gguf, gguf_file, CUT, REFETCH, f"found {size // 2}", "tensors are cut")
    assert err.tensor and repr(err.tensor) in str(err)
    assert size - 32 <= err.expected <= size and err.found == size // 2  # the last tensor's end (then padding)


def test_an_empty_gguf_file_is_refused(gguf_file):
    os.truncate(gguf_file, 0)
    err = _refused(check_gguf, gguf_file, "0 bytes", "empty or truncated", REFETCH)
    assert (err.expected, err.found) == (24, 0)


def test_a_gguf_file_cut_inside_its_header_says_so(gguf_file):
    os.truncate(gguf_file, 2000)  # inside the tokenizer's vocabulary
    _refused(check_gguf, gguf_file, "runs past the end of the file", "truncated inside its header", REFETCH)


@pytest.mark.parametrize("offset,data,words", [
    (0, b"GGUX", ("magic",)),
    (4, struct.pack("<I", 77), ("version 77",)),
    (16, struct.pack("<Q", 2 ** 40), ("metadata entries", "more than")),  # the metadata count: the header's length
    (8, struct.pack("<Q", 2 ** 40), ("tensors", "more than")),  # the tensor count
    (24, struct.pack("<Q", 2 ** 50), ("runs past the end",)),  # the first key's length
])
def test_a_corrupt_gguf_header_field_is_refused(gguf_file, offset, data, words):
    _poke(gguf_file, offset, data)
    _refused(check_gguf, gguf_file, *words, "corrupt" if "runs past" not in words[0] else "length", REFETCH)


def test_a_flipped_tensor_type_or_shape_names_the_tensor(gguf_file, tmp_path):
    name = "blk.1.ffn_up.weight"
    at = _tensor_info(gguf_file, name)
    n_dims = struct.unpack("<I", gguf_file.read_bytes()[at:at + 4])[0]
    typed = tmp_path / "typed.gguf"
    shutil.copy(gguf_file, typed)
    _poke(typed, at + 4 + 8 * n_dims, struct.pack("<I", 200))  # its ggml type
    _refused(check_gguf, typed, "ggml type 200", "corrupt", tensor=name)
    _poke(gguf_file, at + 4, struct.pack("<Q", 33))  # rows of 33: not whole q8_0 blocks of 32
    _refused(check_gguf, gguf_file, "not a multiple", "corrupt", tensor=name)
    _poke(gguf_file, at + 4, struct.pack("<Q", 32 * 64))  # a longer row: it runs into the next tensor
    _refused(check_gguf, gguf_file, "overlap", "corrupt")


def test_gguf_readers_own_errors_on_a_cut_file_are_made_clear(gguf_file, monkeypatch):
    """gguf's GGUFReader on a cut file fails with numpy's "cannot reshape array" (the second reported error);
    were the check to miss a damage, the reader's error still comes out naming the file and the fix."""
    from compress.model import integrity

    os.truncate(gguf_file, gguf_file.stat().st_size // 2)
    monkeypatch.setattr(integrity, "check_gguf", lambda path: None)
    _refused(gguf_reader, gguf_file, "gguf's reader cannot parse it", "reshape", REFETCH)


# ----------------------------------------------------------------------------------------------- end to end


def _recipe_file(tmp_path: Path, source: Path, stream: str = "never") -> Path:
    calib = tmp_path / "calib.txt"
    calib.write_text(word_text(256) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"source": str(source), "dtype": "float32", "stream": stream},
        "calibration": {"kind": "files", "files": [str(calib)], "n_samples": 2, "seq_len": 16},
        "stages": [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16}}],
        "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(tmp_path / "out")}}))
    return path


@pytest.mark.parametrize("stream", ["never", "always"])
def test_compress_run_on_a_half_cut_model_folder_says_which_file_in_one_line(tmp_path, stream, capsys):
    """The first reported error: safetensors' "incomplete metadata, file not fully covered" traceback."""
    from compress.cli import main

    folder = tmp_path / "model"
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    capsys.readouterr()  # the writer's progress bar
    assert main(["run", str(_recipe_file(tmp_path, folder, stream)), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"compress run: error: {weights} is truncated: tensor ") and err.count("\n") == 1, err
    assert REFETCH in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


@pytest.mark.parametrize("stream", ["never", "always"])
def test_compress_run_on_a_cut_gguf_file_says_which_tensor_in_one_line(tmp_path, gguf_file, stream, capsys):
    """The second reported error: "cannot reshape array of size ... into shape ..."."""
    from compress.cli import main

    os.truncate(gguf_file, gguf_file.stat().st_size * 2 // 3)
    assert main(["run", str(_recipe_file(tmp_path, gguf_file, stream)), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"compress run: error: {gguf_file} is truncated: tensor ") and err.count("\n") == 1, err
    assert "reshape" not in err and REFETCH in err


def test_the_loading_entry_points_refuse_before_reading(tmp_path, gguf_file, sharded, monkeypatch):
    """load_model, the streamed source (open_streamed, gguf_tensor_source) and a compress checkpoint opened for
    export (open_compressed) all refuse; transformers' loader is never reached."""
    import transformers

    from compress.model.gguf_source import gguf_tensor_source
    from compress.export.native import save_compressed
    from compress.model.load import load_model
    from compress.model.streaming import open_compressed, open_streamed

    def never(*a, **k):
        raise AssertionError("transformers was asked to load a damaged checkpoint")

    skeleton = make_tiny_model("llama")
    saved = save_compressed(skeleton, make_tiny_tokenizer(), tmp_path / "compressed", {})
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    os.truncate(gguf_file, gguf_file.stat().st_size // 2)
    shard = sorted(set(_index(sharded).values()))[-1]
    os.truncate(sharded / shard, 100)
    os.truncate(saved / "model.safetensors", (saved / "model.safetensors").stat().st_size - 1)
    for call, path in [(lambda: load_model(str(gguf_file)), gguf_file),
                       (lambda: load_model(str(sharded)), sharded / shard),
                       (lambda: load_model(str(saved)), saved / "model.safetensors"),
                       (lambda: open_streamed("gguf", str(gguf_file), torch.float32), gguf_file),
                       (lambda: open_streamed("folder", str(sharded), torch.float32), sharded / shard),
                       (lambda: gguf_tensor_source(str(gguf_file), skeleton), gguf_file),
                       (lambda: open_compressed(saved), saved / "model.safetensors")]:
        with pytest.raises(DamagedFileError, match=CUT) as info:
            call()
        assert info.value.path == path


# ----------------------------------------------------------------------------------------------- resume folders


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, object]:
    """A streamed gptq run of a 4-block llama killed before block 2 (its checkpoint in OUT.work), and its recipe."""
    from compress.pipeline.resident import run
    from compress.recipe import from_dict
    from compress.pipeline.streamed import StreamedBlocks

    tmp = tmp_path_factory.mktemp("interrupted")
    model = make_tiny_model("llama")
    model.config.num_hidden_layers = 4
    torch.manual_seed(1)
    type(model)(model.config).save_pretrained(tmp / "model", max_shard_size="50KB")
    make_tiny_tokenizer().save_pretrained(tmp / "model")
    (tmp / "calib.txt").write_text(word_text(512) + "\n")
    recipe = from_dict({
        "model": {"source": str(tmp / "model"), "stream": "always", "dtype": "float32"},
        "stages": [{"stage": "quantize", "method": "gptq",
                    "scheme": {"dtype": "int4", "granularity": "group", "group_size": 32}}],
        "calibration": {"kind": "files", "files": [str(tmp / "calib.txt")], "n_samples": 4, "seq_len": 32},
        "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(tmp / "out"), "max_shard_gb": 0.00002}})
    load = StreamedBlocks.load

    def crashing(self, i, device):
        if i == 2:
            raise KeyboardInterrupt
        return load(self, i, device)

    StreamedBlocks.load = crashing
    try:
        with pytest.raises(KeyboardInterrupt):
            run(recipe, progress=False, log=lambda *a: None)
    finally:
        StreamedBlocks.load = load
    shutil.copytree(tmp / "out.work", tmp / "pristine.work")
    return tmp, recipe


def _stream_damage(work: Path, what: str) -> Path:
    progress = json.loads((work / "stream" / "progress.json").read_text())
    if what == "progress.json":
        path = work / "stream" / "progress.json"
        _poke(path, 0, b"[")
    elif what == "carried":
        path = work / "stream" / progress["carried"] / "model.safetensors"
        os.truncate(path, path.stat().st_size // 2)
    elif what == "carried folder":
        path = work / "stream" / progress["carried"]
        shutil.rmtree(path)
    elif what == "closed shard":
        path = work / "output" / progress["writer"]["parts"][0][0]
        os.truncate(path, path.stat().st_size - 10)
    else:  # the open shard's data file
        path = work / "output" / progress["writer"]["data"]
        os.truncate(path, progress["writer"]["size"] // 2)
    return path


@pytest.mark.parametrize("what", ["progress.json", "carried", "carried folder", "closed shard", "open data"])
def test_a_damaged_streamed_checkpoint_is_refused_before_any_work(interrupted, what, monkeypatch):
    from compress.pipeline.resident import run
    from compress.pipeline.streamed import StreamedBlocks

    tmp, recipe = interrupted
    work = tmp / "out.work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(tmp / "pristine.work", work)
    path = _stream_damage(work, what)
    opened = []
    monkeypatch.setattr(StreamedBlocks, "load", lambda *a: opened.append(a) or pytest.fail("a block was read"))
    with pytest.raises(DamagedFileError, match="without --resume") as info:
        run(recipe, progress=False, log=lambda *a: None, resume=True)
    assert str(path) in str(info.value) and not opened
    assert work.exists()  # the interrupted run's files are left for the user to decide
    if what == "open data":  # a truncated data file would have been zero-filled back to its size by the writer
        assert info.value.expected == json.loads((work / "stream" / "progress.json").read_text())["writer"]["size"]


def test_a_sound_streamed_checkpoint_passes_and_resumes(interrupted):
    from compress.pipeline.resident import run

    tmp, recipe = interrupted
    work = tmp / "out.work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(tmp / "pristine.work", work)
    check_resume_dir(work)
    check_resume_dir(work / "stream")
    report = run(recipe, progress=False, log=lambda *a: None, resume=True)
    assert report["streamed"]["resumed_at_block"] == 2 and not work.exists()


@pytest.fixture
def distilled(tmp_path) -> tuple[Path, callable]:
    """A tiny distillation checkpointed at steps 2 and 4 (accelerate's files: model.safetensors, optimizer.bin,
    random_states_0.pkl, then distill_state.json), and a resume of it."""
    import copy

    from compress.distill.kd import distill
    from compress.stages.distill import DistillStage

    teacher = make_tiny_model("llama")
    student = copy.deepcopy(teacher).requires_grad_(True)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(5))
    cfg = DistillStage(steps=4, batch_size=2, grad_accum=1, seq_len=16, warmup_steps=0, eval_every=4,
                       checkpoint_every=2, keep_checkpoints=2)
    quiet = dict(progress=False, log=lambda m: None)
    distill(copy.deepcopy(student), teacher, ids, cfg, tmp_path, **quiet)
    return tmp_path, lambda: distill(copy.deepcopy(student), teacher, ids, cfg, tmp_path, resume=True, **quiet)


@pytest.mark.parametrize("name,cut", [("model.safetensors", 0.5), ("optimizer.bin", 0.5),
                                      ("random_states_0.pkl", 0.9), ("distill_state.json", 0.5)])
def test_a_damaged_distillation_checkpoint_names_the_file_and_the_one_to_fall_back_to(distilled, name, cut):
    work, resume = distilled
    newest = work / "checkpoints" / "step-000004"
    os.truncate(newest / name, int((newest / name).stat().st_size * cut))
    with pytest.raises(DamagedFileError) as info:
        resume()
    msg = str(info.value)
    assert str(newest / name) in msg, msg
    assert f"Delete {newest} to resume from the one before it (step-000002)" in msg, msg
    shutil.rmtree(newest)
    assert resume()["resumed_from"] == 2  # the fix works: the older checkpoint is sound and resumes


def test_a_sound_distillation_checkpoint_passes_and_resumes(distilled):
    work, resume = distilled
    check_resume_dir(work / "checkpoints" / "step-000004")
    assert resume()["resumed_from"] == 4
