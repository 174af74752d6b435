"""Serving engines that load an export themselves: the proof that a checkpoint is served as we computed it.

ENGINES maps an engine name to an Engine: the export formats it serves and a `run` that loads one export folder in
the engine and returns an EngineAnswer (the log-probability it gives each next token of some windows, its most
likely token there, greedy continuations of some prompts, decode speed, and the method and kernels it chose, or
the engine's own error when it refuses the checkpoint). `check.engine_check` compares an answer with our model.
vLLM runs in its own interpreter (its virtual environment: `--engine-python`), llama.cpp in this one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class EngineUnavailable(RuntimeError):
    """The engine cannot be started here (not installed, wrong interpreter): the message says how to get it."""


@dataclass(frozen=True)
class EngineRequest:
    folder: str                     # the export folder
    windows: list[list[int]]        # token ids scored position by position
    prompts: list[list[int]]        # token ids continued greedily
    max_new_tokens: int = 32
    dtype: str = "bfloat16"         # the engine's compute dtype
    env: dict = field(default_factory=dict)  # engine settings (environment variables), e.g. VLLM_CPU_INT4_W4A8=0
    python: str | None = None       # the engine's interpreter, where it runs in its own environment


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


def _registry() -> dict[str, Engine]:
    from . import llama_cpp, vllm

    return {"vllm": Engine("vllm", vllm.format_problem, vllm.run, vllm.plain_env),
            "llama.cpp": Engine("llama.cpp", llama_cpp.format_problem, llama_cpp.run)}


ENGINE_NAMES = ("vllm", "llama.cpp")


def get_engine(name: str) -> Engine:
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return _registry()[name]
