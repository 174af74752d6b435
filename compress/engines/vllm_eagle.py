"""An EAGLE-3 head (export/eagle.py) served by vLLM itself: the target folder with the head as its speculative draft
(`speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": K}`), greedy decoding of token
prompts one at a time, and vLLM's own counters of drafted and accepted tokens; or the target alone
(`speculative=False`), whose greedy tokens the speculative ones must equal. Runs vllm_eagle_worker.py with vLLM's
interpreter (vllm.interpreter: --engine-python, COMPRESS_VLLM_PYTHON, or this Python if it imports vllm)."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from .base import EngineRequest
from .vllm import engine_env, interpreter

WORKER = Path(__file__).with_name("vllm_eagle_worker.py")


def serve_with_head(target: str, head: str, prompts: list[list[int]], k: int = 3, max_new_tokens: int = 32,
                    speculative: bool = True, dtype: str = "float32", python: str | None = None,
                    timeout: float = 1800) -> dict:
    """vLLM's answer: loads, error, version, greedy (per prompt), seconds, drafts, draft_tokens, accepted,
    accepted_per_position (the counters are None without speculation)."""
    exe = interpreter(python)
    longest = max(len(p) for p in prompts) + max_new_tokens + k + 8
    payload = {"target": str(Path(target).resolve()), "head": str(Path(head).resolve()), "k": k, "prompts": prompts,
               "max_new_tokens": max_new_tokens, "dtype": dtype, "speculative": speculative,
               "max_model_len": longest}
    with tempfile.TemporaryDirectory(prefix="compress-vllm-eagle-") as tmp:
        req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req.write_text(json.dumps(payload))
        env = engine_env(EngineRequest(folder=str(target), windows=[], prompts=prompts))
        try:
            proc = subprocess.run([exe, str(WORKER), str(req), str(ans)], env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"loads": False, "error": f"vLLM did not answer within {timeout:.0f} s"}
        answer = json.loads(ans.read_text()) if ans.is_file() else \
            {"loads": False, "error": f"vLLM exited with {proc.returncode} before answering"}
        answer["log_tail"] = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    if answer.get("draft_tokens"):
        answer["accepted_per_draft_token"] = answer["accepted"] / answer["draft_tokens"]
    return answer
