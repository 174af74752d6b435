"""The embedded model's conversion, kept: loading a GGUF file through transformers parses its metadata (a 49k-token
vocabulary, field by field) three times, for the config, the tokenizer and the model, and dequantizes every tensor:
about 15 s on a 2-core machine for a 135M model, in every run and every test that loads `default`. Its first load
writes the converted model (config, tokenizer, safetensors weights at the loaded dtype) into the compress cache;
later loads read that folder in about a second.

Only the `default` model is kept (the one file every run of the quick start loads; a user's own GGUF may be many
gigabytes, and its conversion would be several times that). The key is the file's path, size and modification
time, transformers' version and the dtype, so a changed file or library converts again. The folder is written
under a temporary name and renamed into place; a cache that cannot be written is skipped with a note, never an
error. `COMPRESS_GGUF_CACHE=0` turns it off.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..resources import cache_dir

ENV_OFF = "COMPRESS_GGUF_CACHE"
VERSION = 1  # of the folder's layout: a change here converts again


def cache_enabled() -> bool:
    return os.environ.get(ENV_OFF, "1") != "0"


def converted_folder(gguf: str, dtype: torch.dtype) -> Path:
    """Where the conversion of `gguf` at `dtype` is kept (it may not exist yet)."""
    import transformers
    st = os.stat(gguf)
    key = f"{os.path.realpath(gguf)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{dtype}|v{VERSION}"
    name = Path(gguf).stem + "-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "converted" / name


def cached(gguf: str, dtype: torch.dtype) -> Path | None:
    """The kept conversion's folder, or None when there is none (or the cache is off)."""
    if not cache_enabled():
        return None
    folder = converted_folder(gguf, dtype)
    return folder if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() else None


def keep(gguf: str, dtype: torch.dtype, model, tokenizer, log=print) -> Path | None:
    """Write the loaded model and tokenizer as the conversion of `gguf` at `dtype`; None when it could not be
    written (reported, not raised: the run goes on from the model in memory)."""
    if not cache_enabled():
        return None
    folder = converted_folder(gguf, dtype)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".tmp", dir=folder.parent))
        try:
            architectures = model.config.architectures  # save_pretrained sets it on the model's own config
            try:
                model.save_pretrained(tmp, safe_serialization=True)
            finally:
                model.config.architectures = architectures
            tokenizer.save_pretrained(tmp)
            try:
                os.replace(tmp, folder)
            except OSError:
                if not (folder / "config.json").is_file():
                    raise
                # another process kept it first: its copy stays, ours goes
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        log(f"note: the embedded model's conversion was not kept in {folder.parent} ({exc}); the next run converts "
            f"the GGUF file again (about 15 s). Set COMPRESS_CACHE to a writable folder, or {ENV_OFF}=0 to stop trying.")
        return None
    return folder if (folder / "config.json").is_file() else None
