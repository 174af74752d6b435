"""Text sources, windowing and fingerprints."""
from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from compress.calibrate.data import (TextSource, fingerprint, find_data_dir, load_texts, random_windows, sample_from_model,
                           sequential_windows, wikitext2_rows)
from tests.conftest import make_tiny_model, requires_data


def test_sequential_windows_drop_the_tail():
    ids = torch.arange(10).reshape(1, 10)
    w = sequential_windows(ids, 3)
    assert w.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert sequential_windows(ids, 3, max_windows=2).shape == (2, 3)
    with pytest.raises(ValueError, match="fewer than one window"):
        sequential_windows(ids, 11)


def test_random_windows_are_seeded_distinct_and_aligned():
    ids = torch.arange(1000).reshape(1, 1000)
    a = random_windows(ids, 5, 100, seed=0)
    assert torch.equal(a, random_windows(ids, 5, 100, seed=0))
    assert not torch.equal(a, random_windows(ids, 5, 100, seed=1))
    starts = a[:, 0].tolist()
    assert len(set(starts)) == 5 and all(s % 100 == 0 for s in starts) and starts == sorted(starts)
    with pytest.raises(ValueError, match="Lower n_samples"):
        random_windows(ids, 11, 100, seed=0)


def test_fingerprint_is_sha256_of_int64_ids():
    ids = torch.tensor([[1, 2, 3]])
    assert fingerprint(ids) == hashlib.sha256(torch.tensor([1, 2, 3], dtype=torch.int64).numpy().tobytes()).hexdigest()
    assert fingerprint(ids) != fingerprint(torch.tensor([[1, 2, 4]]))


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "row one"}) + "\n\n" + json.dumps({"text": "row two"}) + "\n")
    pq.write_table(pa.table({"content": ["parquet row"]}), tmp_path / "c.parquet")
    src = TextSource(kind="files", files=(str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")))
    assert load_texts(src) == ["plain text file", "row one", "row two"]
    assert load_texts(TextSource(kind="files", files=(str(tmp_path / "c.parquet"),), text_field="content")) == \
        ["parquet row"]
    with pytest.raises(ValueError, match="set text_field"):
        load_texts(TextSource(kind="files", files=(str(tmp_path / "c.parquet"),)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_texts(TextSource(kind="files", files=(str(tmp_path / "nope.txt"),)))
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_texts(TextSource(kind="files", files=(str(tmp_path / "d.csv"),)))


def test_self_generated_is_deterministic():
    model = make_tiny_model("llama")
    a = sample_from_model(model, n_samples=3, seq_len=12, seed=0, batch_size=2)
    assert a.shape == (3, 12)
    assert torch.equal(a, sample_from_model(model, n_samples=3, seq_len=12, seed=0, batch_size=2))
    assert not torch.equal(a, sample_from_model(model, n_samples=3, seq_len=12, seed=1, batch_size=2))


def test_data_dir_env_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="COMPRESS_DATA_DIR"):
        find_data_dir()
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(tmp_path))
    assert find_data_dir() == tmp_path


@requires_data
def test_wikitext_rows_reencode_to_the_pinned_file():
    """The hub rows we rebuild from the raw file turn back into the exact pinned bytes (data README)."""
    rows = wikitext2_rows("test")
    assert len(rows) == 4358
    raw = "".join(" \n" if r == "" else r for r in rows).encode("utf-8")
    assert hashlib.sha256(raw).hexdigest() == "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"
    assert rows[0] == "" and rows[1].startswith(" = Robert Boulter = ")


def test_wikitext2_percent_slices_partition_the_split():
    from compress.calibrate.data import parse_split

    assert parse_split("validation[:50%]") == ("validation", 0, 50)
    assert parse_split("validation[50%:]") == ("validation", 50, 100)
    with pytest.raises(ValueError, match="0 <= start < end"):
        parse_split("validation[60%:40%]")
    with pytest.raises(ValueError, match="percent"):
        parse_split("validation[1:2:3]")


@requires_data
def test_wikitext2_halves_rejoin_to_the_whole_split():
    from compress.calibrate.data import wikitext2_rows

    whole, first, second = (wikitext2_rows(s) for s in ("validation", "validation[:50%]", "validation[50%:]"))
    assert first + second == whole and abs(len(first) - len(second)) <= 1
