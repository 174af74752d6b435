"""What every phase of a run reads and none changes, in one object the run builds once."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.profile import Profile
from ..recipe import Recipe


@dataclass(frozen=True)
class RunOptions:
    """The run's recipe (replaced, with dataclasses.replace, when the memory plan or the whole-model stages resolve
    it), its output folder `out` (or the work folder a phase keeps its files in), the compute `device`, whether to
    show progress bars, where log lines go, whether the run continues an interrupted one (`resume`), and the
    `profile` its phases are timed into (None: run_source starts one; the CLI starts it at the process's start)."""
    recipe: Recipe
    out: Path
    device: str = "cpu"
    progress: bool = True
    log: Callable = print
    resume: bool = False
    profile: Profile | None = None
