"""The one way a run or an export writes its output folder (export/staging.py): into a staging folder, renamed into
place only when the writing completes."""
from __future__ import annotations

import os

import pytest

from compress.export.staging import staged, write_atomic


def _siblings(out):
    return sorted(p.name for p in out.parent.iterdir())


def test_success_renames_the_staging_folder_into_place(tmp_path):
    out = tmp_path / "runs" / "out"  # its parent does not exist yet
    with staged(out) as tmp:
        assert tmp.is_dir() and tmp.parent == out.parent and tmp != out
        assert not out.exists()  # nothing at the output until the block completes
        (tmp / "model.safetensors").write_text("weights")
        (tmp / "exports").mkdir()
        (tmp / "exports" / "report.md").write_text("report")
    assert (out / "model.safetensors").read_text() == "weights"
    assert (out / "exports" / "report.md").read_text() == "report"
    assert _siblings(out) == ["out"]  # no staging folder left behind


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_keeps_the_old_output_and_removes_the_staging_folder(tmp_path, error):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("the previous run")
    with pytest.raises(error):
        with staged(out) as tmp:
            (tmp / "report.md").write_text("half written")
            raise error("stopped")
    assert (out / "report.md").read_text() == "the previous run"
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]
    assert _siblings(out) == ["out"]


def test_a_failure_without_an_old_output_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError):
        with staged(out) as tmp:
            (tmp / "part").write_text("x")
            raise ValueError("stopped")
    assert list(tmp_path.iterdir()) == []


def test_a_rerun_replaces_the_existing_output_whole(tmp_path):
    out = tmp_path / "out"
    with staged(out) as tmp:
        (tmp / "old-only.txt").write_text("1")
        (tmp / "both.txt").write_text("1")
    with staged(out) as tmp:
        (tmp / "both.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["both.txt"]  # the first run's other files are gone
    assert (out / "both.txt").read_text() == "2"
    assert _siblings(out) == ["out"]


def test_a_stale_staging_folder_of_a_killed_run_is_cleared(tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / f".out.tmp-{os.getpid()}"  # a run killed (SIGKILL) before its rename, with this pid
    stale.mkdir()
    (stale / "stale").write_text("half written")
    with staged(out) as tmp:
        assert list(tmp.iterdir()) == []  # starts empty
        (tmp / "fresh").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["fresh"]
    assert _siblings(out) == ["out"]


def test_a_callers_staging_folder_is_kept_on_failure_for_resume(tmp_path):
    out, work = tmp_path / "out", tmp_path / "out.work" / "output"
    work.mkdir(parents=True)
    (work / "shard-1").write_text("blocks 0-16")  # written during the pass, before the tail
    with pytest.raises(RuntimeError):
        with staged(out, work) as folder:
            assert folder == work
            raise RuntimeError("the evaluation failed")
    assert (work / "shard-1").read_text() == "blocks 0-16" and not out.exists()
    with staged(out, work) as folder:  # the resumed run completes
        (folder / "report.md").write_text("done")
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "shard-1"] and not work.exists()


def test_write_atomic_replaces_the_file_whole(tmp_path):
    path = tmp_path / "progress.json"
    write_atomic(path, '{"next": 3}')
    write_atomic(path, '{"next": 4}')
    assert path.read_text() == '{"next": 4}'
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]
