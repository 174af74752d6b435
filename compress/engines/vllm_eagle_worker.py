"""Runs inside vLLM's own Python: serve TARGET with an EAGLE-3 head as its speculative draft, decode the prompts
greedily and report the tokens and vLLM's own speculative-decoding counters. Standalone (vLLM and the standard
library only); compress/engines/vllm_eagle.py writes the request and reads the answer.
Request: target, head, k, prompts (token id lists), max_new_tokens, dtype, speculative (bool).
Answer: loads, error, version, greedy (per prompt), seconds, drafts, draft_tokens, accepted, accepted_per_position."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def _counter(metrics, name: str):
    for m in metrics:
        if m.name == name:
            return getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
    return None


def main(request_path: str, answer_path: str) -> int:
    request = json.loads(open(request_path).read())
    answer: dict = {"loads": False}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        answer["version"] = vllm.__version__
        spec = {"method": "eagle3", "model": request["head"], "num_speculative_tokens": request["k"]}
        llm = LLM(model=request["target"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                  enforce_eager=True, seed=0,
                  max_num_seqs=1, speculative_config=spec if request["speculative"] else None,
                  disable_log_stats=False)
        answer["loads"] = True
        greedy = SamplingParams(max_tokens=request["max_new_tokens"], temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        answer["greedy"] = []
        for p in request["prompts"]:  # one at a time: batch 1, as compress speculate measures
            out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
            answer["greedy"].append(list(out[0].outputs[0].token_ids))
        answer["seconds"] = time.perf_counter() - start
        metrics = llm.get_metrics()
        answer["drafts"] = _counter(metrics, "vllm:spec_decode_num_drafts")
        answer["draft_tokens"] = _counter(metrics, "vllm:spec_decode_num_draft_tokens")
        answer["accepted"] = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
        answer["accepted_per_position"] = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    except BaseException as exc:  # noqa: BLE001 - the answer carries the reason
        answer["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        answer["traceback"] = traceback.format_exc()[-6000:]
    open(answer_path, "w").write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
