"""Serving engines that load an export themselves: the proof that a checkpoint is served as we computed it.

ENGINES maps an engine name to an Engine: the export formats it serves and a `run` that loads one export folder in
the engine and returns an EngineAnswer (the log-probability it gives each next token of some windows, its most
likely token there, greedy continuations of some prompts, decode speed, and the method and kernels it chose, or
the engine's own error when it refuses the checkpoint). `check.engine_check` compares an answer with our model.
vLLM and mlx-lm run in their own interpreters (their virtual environments: `--engine-python`), llama.cpp in this one.
"""
from __future__ import annotations

from .base import CHECKED_WITH, Engine, EngineAnswer, EngineRequest, EngineUnavailable


def _registry() -> dict[str, Engine]:
    from . import llama_cpp, mlx, vllm

    return {"vllm": Engine("vllm", vllm.format_problem, vllm.run, vllm.plain_env),
            "llama.cpp": Engine("llama.cpp", llama_cpp.format_problem, llama_cpp.run),
            "mlx": Engine("mlx", mlx.format_problem, mlx.run)}


ENGINE_NAMES = ("vllm", "llama.cpp", "mlx")


def get_engine(name: str) -> Engine:
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return _registry()[name]


__all__ = ["CHECKED_WITH", "ENGINE_NAMES", "Engine", "EngineAnswer", "EngineRequest", "EngineUnavailable",
           "get_engine"]
