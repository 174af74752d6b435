"""Output folders written atomically: everything goes into a staging folder beside the output, which is renamed into
place only when the writing completes. A crash or Ctrl-C never leaves a half-written output, nor replaces an
existing one with a half-written one."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


@contextlib.contextmanager
def staged(out: Path, folder: Path | None = None):
    """Yield a staging folder for `out`; when the block completes, `out` (if it exists) is replaced by it.

    Without `folder`: a fresh temporary sibling `.NAME.tmp-PID`, removed on any error or Ctrl-C (the old `out` is
    left untouched). With `folder`: the caller's own staging folder, already filled in part (a streamed run's
    OUTPUT.work/output, written block by block), used as it is and left in place on failure, for `--resume`."""
    out = Path(out)
    own = folder is None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}" if own else Path(folder)
    if own:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        if own:
            shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text`, written under a temporary name and renamed: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
