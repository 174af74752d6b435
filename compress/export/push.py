"""`compress push`: upload a run folder or an export folder, with its model card, to a Hugging Face Hub model
repository (create it if needed, then one commit that adds or replaces the listed files; nothing is deleted).

What is uploaded: every file in the folder except hidden ones (a name starting with "."; staging leftovers and
huggingface_hub's own .cache/), and, from a run folder, except its exports/ folder: each export is read by other
engines (vLLM, llama.cpp, ...), and one repository holding several formats defeats the Hub's library detection and
makes every download fetch them all, so each export is pushed to its own repository. The run folder's report.json,
report.md and recipe files go with it: they are what its card cites.

The card's loading snippets name the repository as `OWNER/NAME` (card.REPO_PLACEHOLDER); the uploaded README.md
has it replaced by --repo, the folder's own file is left as it is (a folder can be pushed to several repositories).
"""
from __future__ import annotations

import re
from pathlib import Path

from .card import CARD, REPO_PLACEHOLDER, write_folder_card

WEIGHT_SUFFIXES = (".safetensors", ".gguf")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def upload_list(folder: str | Path) -> list[str]:
    """The folder's files to upload, as repository paths (see the module docstring), sorted."""
    folder = Path(folder)
    run_folder = (folder / "compress.json").is_file() or (folder / "report.json").is_file()  # saved model or not
    files = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if run_folder and rel.parts[0] == "exports":
            continue
        files.append(rel.as_posix())
    return sorted(files)


def check_folder(folder: Path, files: list[str]) -> None:
    """Refuse a folder without a card or without model weights, naming the way out."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; give a run folder (compress run's output) or an export "
                                "folder (OUTPUT/exports/FORMAT)")
    if CARD not in files:
        raise ValueError(f"{folder} has no model card ({CARD}); runs and exports write one; for a folder written "
                         f"before they did, add --write-card to write it from its report.json / export.json")
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        raise ValueError(f"{folder} holds no model weights (*.safetensors, *.gguf); push a run folder that saved its "
                         "checkpoint (output.save_model) or an export folder")


def card_for(folder: Path, repo: str) -> str:
    return (folder / CARD).read_text(encoding="utf-8").replace(REPO_PLACEHOLDER, repo)


def push(folder: str | Path, repo: str, private: bool = False, dry_run: bool = False, token: str | None = None,
         write_card: bool = False, api=None, log=print) -> dict:
    """Upload `folder` to the model repository `repo` (see the module docstring). `api` is a huggingface_hub
    HfApi (made from `token`, or the saved login / HF_TOKEN, when None). `dry_run` lists the files and prints the
    card, and contacts nothing. Returns {"repo", "files", "card", "url"}."""
    folder = Path(folder)
    if not REPO_ID.match(repo):
        raise ValueError(f"--repo {repo!r}: give the repository as owner/name, e.g. my-org/SmolLM2-135M-int4")
    if write_card:  # a local file the user asked for, written on a dry run too
        log(f"wrote {write_folder_card(folder)}")
    files = upload_list(folder) if folder.is_dir() else []
    check_folder(folder, files)
    card = card_for(folder, repo)
    sizes = {f: (folder / f).stat().st_size for f in files}
    log(f"{'would upload' if dry_run else 'uploading'} {len(files)} files ({sum(sizes.values()):,} bytes) from "
        f"{folder} to https://huggingface.co/{repo}" + (" (private)" if private else "") + ":")
    for f in files:
        log(f"  {f}  {sizes[f]:,} bytes")
    result = {"repo": repo, "files": files, "card": card, "url": None}
    if dry_run:
        log(f"\n{CARD} as it would be uploaded:\n\n{card}")
        return result
    from huggingface_hub import CommitOperationAdd, HfApi

    api = api or HfApi(token=token)
    api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=card.encode("utf-8") if f == CARD
                                     else str(folder / f)) for f in files]
    commit = api.create_commit(repo, operations, commit_message=f"compress push: {folder.name} ({len(files)} files)",
                               repo_type="model")
    result["url"] = getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo}"
    log(f"pushed: {result['url']}")
    return result
