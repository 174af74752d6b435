"""mlx-lm (MLX on Apple silicon; the mlx-cpu build on Linux), started in its own interpreter (mlx_worker.py) on one
`mlx` export folder.

mlx-lm pins its own transformers and needs no torch, so it is usually installed in a virtual environment of its own
(python -m venv ~/mlx && ~/mlx/bin/pip install mlx mlx-cpu mlx-lm on Linux); the interpreter comes from `python` (the
request), else COMPRESS_MLX_PYTHON, else this one when it can import mlx_lm: vllm.py's convention. The engine
computes in the dtype the checkpoint holds when the request's dtype is "auto", else with every float parameter cast
(scales and biases included, as vLLM casts its scales to its dtype). On mlx-cpu, ask for float32: its float16 and
bfloat16 quantized matmuls are 40x and 10x slower than its float32 one (measured: bench/mlx_export.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from .base import EngineAnswer, EngineRequest, engine_interpreter

WORKER = Path(__file__).with_name("mlx_worker.py")
INSTALL = ("install mlx-lm in its own virtual environment (Linux: python -m venv ~/mlx && ~/mlx/bin/pip install mlx "
           "mlx-cpu mlx-lm; macOS: pip install mlx-lm) and pass --engine-python ~/mlx/bin/python or set "
           "COMPRESS_MLX_PYTHON")


def format_problem(fmt: str) -> str | None:
    return None if fmt == "mlx" else "mlx-lm is checked on `mlx` exports (MLX's affine layout); export --format mlx"


def interpreter(explicit: str | None = None) -> str:
    return engine_interpreter(explicit, "COMPRESS_MLX_PYTHON", "mlx_lm", "mlx-lm", INSTALL)


def _call(request: EngineRequest, logits_dir: str | None = None) -> dict:
    """Run the worker on `request`; its answer (JSON), or one that says how it failed."""
    python = interpreter(request.python)
    payload = {"model": str(Path(request.folder).resolve()), "dtype": request.dtype, "windows": request.windows,
               "prompts": request.prompts, "max_new_tokens": request.max_new_tokens, "logits_dir": logits_dir}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **{k: str(v) for k, v in request.env.items()}}
    with tempfile.TemporaryDirectory(prefix="compress-mlx-") as tmp:
        req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req.write_text(json.dumps(payload))
        try:
            proc = subprocess.run([python, str(WORKER), str(req), str(ans)], env=env, capture_output=True,
                                  text=True, timeout=request.timeout)
        except subprocess.TimeoutExpired:
            return {"loads": False, "error": f"mlx-lm did not answer within {request.timeout:.0f} s"}
        data = json.loads(ans.read_text()) if ans.is_file() else {"loads": False}
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            data.update(loads=False, error=f"mlx-lm's worker exited with {proc.returncode}; its log ends:\n{tail}")
    return data


def answer_from(data: dict) -> EngineAnswer:
    layers = data.get("layers") or {}
    answer = EngineAnswer(loads=data["loads"], error=data.get("error"), version=data.get("version"),
                          method="mlx affine" if layers else None, load_s=data.get("load_s"),
                          kernels=[f"{k} x{n}" for k, n in sorted(layers.items())])
    if not answer.loads:
        return answer
    answer.logprobs, answer.top1, answer.greedy = data["prompt_logprobs"], data["top1"], data["greedy"]
    decode = data["decode"]
    answer.tokens_per_s = decode["tokens"] / decode["seconds"] if decode["seconds"] > 0 else None
    answer.notes.append(f"mlx {data.get('mlx_version')}; computed in {', '.join(data.get('dtypes') or [])}")
    return answer


def run(request: EngineRequest) -> EngineAnswer:
    return answer_from(_call(request))


def iter_mlx_logits(folder: str | Path, windows: torch.Tensor, dtype: str = "auto", python: str | None = None,
                    timeout: float = 3600) -> Iterator[torch.Tensor]:
    """mlx-lm's float32 logits [T, V] for each window [B, T], one window at a time (for compare_logits' KL, as
    export/gguf_llama_cpp.iter_llama_cpp_logits gives llama.cpp's). Raises RuntimeError when mlx-lm refuses it."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="compress-mlx-logits-") as tmp:
        request = EngineRequest(str(folder), windows.tolist(), [], 0, dtype, {}, python, timeout)
        data = _call(request, logits_dir=tmp)
        if not data.get("loads"):
            raise RuntimeError(f"mlx-lm did not serve {folder}: {data.get('error')}")
        for i in range(len(windows)):
            path = Path(tmp) / f"window_{i}.npy"
            yield torch.from_numpy(np.load(path))
            path.unlink()
