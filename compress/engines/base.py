"""The engine check's data types (compress/engines/__init__.py says what they are for)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..export.notes import CHECKED_WITH  # noqa: F401  (the export records it; engines name it)


class EngineUnavailable(RuntimeError):
    """The engine cannot be started here (not installed, wrong interpreter): the message says how to get it."""


def engine_interpreter(explicit: str | None, env_var: str, module: str, engine: str, install: str) -> str:
    """The Python an engine's worker runs in: `explicit` (--engine-python), else the environment variable `env_var`,
    else this interpreter when it can import `module`; EngineUnavailable, saying how to install it, otherwise."""
    import importlib.util
    import os
    import sys
    from pathlib import Path

    python = explicit or os.environ.get(env_var)
    if python:
        if not Path(python).is_file():
            raise EngineUnavailable(f"{engine} interpreter {python} does not exist; {install}")
        return python
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    raise EngineUnavailable(f"{engine} is not importable in this Python; {install}")


@dataclass(frozen=True)
class EngineRequest:
    folder: str                     # the export folder
    windows: list[list[int]]        # token ids scored position by position
    prompts: list[list[int]]        # token ids continued greedily
    max_new_tokens: int = 32
    dtype: str = "bfloat16"         # the engine's compute dtype
    env: dict = field(default_factory=dict)  # engine settings (environment variables), e.g. VLLM_CPU_INT4_W4A8=0
    python: str | None = None       # the engine's interpreter, where it runs in its own environment
    timeout: float = 3600           # seconds before an engine that has not answered is reported as such


@dataclass
class EngineAnswer:
    loads: bool
    error: str | None = None
    version: str | None = None
    method: str | None = None       # the quantization method the engine picked for the checkpoint
    kernels: list[str] = field(default_factory=list)  # what its log says it runs the layers with
    logprobs: list[list[float]] = field(default_factory=list)  # per window: log p(next token), positions 1..T-1
    top1: list[list[int]] = field(default_factory=list)        # per window: its most likely next token
    greedy: list[list[int]] = field(default_factory=list)      # per prompt: the new tokens
    tokens_per_s: float | None = None
    load_s: float | None = None
    notes: list[str] = field(default_factory=list)  # settings of the engine that change the model, and why


@dataclass(frozen=True)
class Engine:
    name: str
    formats: Callable[[str], str | None]  # export format -> why this engine does not serve it (None: it does)
    run: Callable[[EngineRequest], EngineAnswer]
    # settings that undo an engine default which changed the model in this answer (None: there is none)
    plain_env: Callable[[EngineAnswer], dict | None] = lambda answer: None
