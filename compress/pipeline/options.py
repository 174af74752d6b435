"""What every phase of a run reads and none changes, in one object the run builds once."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..recipe import Recipe


@dataclass(frozen=True)
class RunOptions:
    """The run's recipe (replaced, with dataclasses.replace, when the memory plan or the whole-model stages resolve
    it), its output folder `out` (or the work folder a phase keeps its files in), the compute `device`, whether to
    show progress bars, where log lines go, and whether the run continues an interrupted one (`resume`)."""
    recipe: Recipe
    out: Path
    device: str = "cpu"
    progress: bool = True
    log: Callable = print
    resume: bool = False
