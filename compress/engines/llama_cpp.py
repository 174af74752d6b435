"""llama.cpp through llama-cpp-python, in this interpreter: the GGUF exports' engine."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .base import EngineAnswer, EngineRequest, EngineUnavailable


def format_problem(fmt: str) -> str | None:
    return None if fmt.startswith("gguf-") else "llama.cpp reads GGUF files; export a gguf-* format"


def _greedy(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def run(request: EngineRequest) -> EngineAnswer:
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailable("llama.cpp's Python binding is not installed: pip install llama-cpp-python") \
            from exc
    from ..export.gguf_llama_cpp import load_llama_cpp

    gguf = next(Path(request.folder).glob("*.gguf"), None)
    if gguf is None:
        return EngineAnswer(loads=False, error=f"{request.folder} holds no .gguf file")
    longest = max(len(x) for x in request.windows + request.prompts) + request.max_new_tokens
    start = time.perf_counter()
    try:
        llm = load_llama_cpp(gguf, n_ctx=longest)
    except Exception as exc:  # a refused file is a result
        return EngineAnswer(loads=False, error=f"{type(exc).__name__}: {exc}", version=llama_cpp.__version__)
    answer = EngineAnswer(loads=True, version=llama_cpp.__version__, method=gguf.stem.split("-", 1)[-1],
                          load_s=time.perf_counter() - start, kernels=["llama.cpp CPU (ggml)"])
    try:
        for w in request.windows:
            llm.reset()
            llm.eval(w)
            scores = np.asarray(llm.scores[:len(w) - 1], dtype=np.float64)
            logp = scores - np.logaddexp.reduce(scores, axis=-1, keepdims=True)
            answer.logprobs.append([float(logp[i, t]) for i, t in enumerate(w[1:])])
            answer.top1.append([int(i) for i in scores.argmax(-1)])
        start = time.perf_counter()
        answer.greedy = [_greedy(llm, p, request.max_new_tokens) for p in request.prompts]
        seconds = time.perf_counter() - start
        answer.tokens_per_s = sum(map(len, answer.greedy)) / seconds if seconds > 0 else None
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return answer
