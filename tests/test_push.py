"""`compress push` (compress/export/push.py) on a real run: the exact files it uploads from a run folder and from an
export, the card it uploads (the repository id filled in), its refusals, and the calls it makes to the Hub.

The Hub cannot be reached here (no network), so the upload is checked at its boundary: `RecordingHub` stands in for
huggingface_hub.HfApi and records create_repo / create_commit. The operations it receives are huggingface_hub's own
CommitOperationAdd objects, built from the real files."""
from __future__ import annotations

import shutil

import pytest

from compress.cli.commands import main
from compress.export.card import CARD, write_folder_card
from compress.export.push import push

RUN_FILES = ["README.md", "chat_template.jinja", "compress.json", "config.json", "generation_config.json",
             "model.safetensors", "recipe.resolved.yaml", "recipe.yaml", "report.json", "report.md", "tokenizer.json",
             "tokenizer_config.json"]
CT_FILES = ["README.md", "chat_template.jinja", "config.json", "export.json", "generation_config.json",
            "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
GGUF_FILES = ["README.md", "export.json", "model-q8_0.gguf"]


class RecordingHub:
    """Stands in for huggingface_hub.HfApi (the Hub is out of reach in the tests): records each call."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations, kwargs))

        class Commit:
            commit_url = f"https://huggingface.co/{repo_id}/commit/0123abc"
        return Commit()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_run_folder_uploads_its_checkpoint_and_card_without_its_exports(card_run_dir, tmp_path):
    run = _copy(card_run_dir, tmp_path / "run")
    (run / ".cache" / "huggingface").mkdir(parents=True)  # huggingface_hub's own bookkeeping, a staging leftover
    (run / ".cache" / "huggingface" / "x.lock").write_text("")
    (run / ".out.tmp-123").mkdir()
    (run / ".out.tmp-123" / "model.safetensors").write_text("")
    hub = RecordingHub()
    result = push(run, "me/tiny-int8", private=True, api=hub, log=lambda *a: None)
    assert result["files"] == RUN_FILES  # exports/ stays behind: each export is its own repository
    (create, repo, kwargs), (commit, repo2, operations, commit_kwargs) = hub.calls
    assert (create, repo, kwargs) == ("create_repo", "me/tiny-int8",
                                      {"repo_type": "model", "private": True, "exist_ok": True})
    assert (commit, repo2, commit_kwargs["repo_type"]) == ("create_commit", "me/tiny-int8", "model")
    assert [op.path_in_repo for op in operations] == RUN_FILES
    by_path = {op.path_in_repo: op.path_or_fileobj for op in operations}
    assert by_path["model.safetensors"] == str(run / "model.safetensors")
    card = by_path[CARD].decode()
    assert card == result["card"] and "OWNER/NAME" not in card and "hf download me/tiny-int8" in card
    assert "OWNER/NAME" in (run / CARD).read_text()  # the folder's own card is left as it was
    assert result["url"] == "https://huggingface.co/me/tiny-int8/commit/0123abc"


@pytest.mark.parametrize("fmt, files", [("compressed-tensors", CT_FILES), ("gguf-q8_0", GGUF_FILES)])
def test_an_export_uploads_every_file_it_holds(card_run_dir, tmp_path, fmt, files):
    hub = RecordingHub()
    result = push(card_run_dir / "exports" / fmt, "me/tiny", api=hub, log=lambda *a: None)
    assert result["files"] == files and [op.path_in_repo for op in hub.calls[1][2]] == files
    assert "me/tiny" in result["card"] and "OWNER/NAME" not in result["card"]


def test_a_dry_run_lists_the_files_prints_the_card_and_calls_nothing(card_run_dir, capsys):
    hub = RecordingHub()
    result = push(card_run_dir / "exports" / "gguf-q8_0", "me/tiny-gguf", dry_run=True, api=hub)
    assert hub.calls == [] and result["url"] is None
    out = capsys.readouterr().out
    assert "would upload 3 files" in out and all(f"  {f}  " in out for f in GGUF_FILES)
    assert "--hf-repo me/tiny-gguf --hf-file model-q8_0.gguf" in out and "library_name: gguf" in out
    assert main(["push", str(card_run_dir), "--repo", "me/tiny", "--dry-run"]) == 0  # the command, same path
    out = capsys.readouterr().out
    assert all(f"  {f}  " in out for f in RUN_FILES) and "exports/" not in out.split("README.md as it")[0]


def test_push_refuses_a_folder_without_a_card_or_weights_and_a_bad_repo_id(card_run_dir, tmp_path, capsys):
    export = _copy(card_run_dir / "exports" / "compressed-tensors", tmp_path / "ct")
    (export / CARD).unlink()
    hub = RecordingHub()
    with pytest.raises(ValueError, match="no model card.*--write-card"):
        push(export, "me/tiny", api=hub)
    assert main(["push", str(export), "--repo", "me/tiny", "--dry-run"]) == 2
    assert "no model card" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / CARD).write_text("---\nlibrary_name: transformers\n---\n# nothing\n")
    with pytest.raises(ValueError, match="no model weights"):
        push(empty, "me/tiny", api=hub)
    unsaved = _copy(card_run_dir, tmp_path / "unsaved")  # a run with output.save_model false: only its exports
    for name in ("compress.json", "model.safetensors"):
        (unsaved / name).unlink()
    with pytest.raises(ValueError, match="no model weights"):  # not its exports' weights, in one repository
        push(unsaved, "me/tiny", api=hub)
    with pytest.raises(ValueError, match="owner/name"):
        push(card_run_dir, "not a repo", api=hub)
    assert hub.calls == []


def test_write_card_rebuilds_the_card_the_run_wrote(card_run_dir, tmp_path):
    """A folder written before cards existed gets the same card from its run's report.json and export.json."""
    run = _copy(card_run_dir, tmp_path / "run")
    for folder in (run, run / "exports" / "compressed-tensors", run / "exports" / "gguf-q8_0"):
        before = (folder / CARD).read_text()
        (folder / CARD).unlink()
        hub = RecordingHub()
        push(folder, "me/tiny", write_card=True, api=hub, log=lambda *a: None)
        assert (folder / CARD).read_text() == before and CARD in [op.path_in_repo for op in hub.calls[1][2]]
    with pytest.raises(FileNotFoundError, match="neither a compress run folder"):
        write_folder_card(tmp_path)
