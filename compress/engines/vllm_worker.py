"""Runs inside vLLM's own Python (its virtual environment): load one export, score token windows, decode greedily.

Standalone on purpose: it imports only vLLM and the standard library, so it runs in an environment where `compress`
is not installed. `compress.engines.vllm` writes a request (JSON), starts this file with the engine's interpreter
and reads the answer (JSON). Request fields:
  model, dtype, max_model_len, windows (token id lists), prompts (token id lists), max_new_tokens, kv_cache_gb.
Answer fields:
  loads, error, version, quantization (the method vLLM picked), config_dtype, prompt_logprobs (per window: the
  log-probability the engine gives each next token, position 1 on), top1 (per window: the engine's most likely
  next token at each position), greedy (per prompt: new tokens), load_s, decode (tokens, seconds).
The kernels vLLM chose are in its log, which the caller reads.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

# run as a script, this file's folder comes first on sys.path, and it holds compress's own vllm.py
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def _error_line(exc: BaseException) -> str:
    """The innermost cause's message: vLLM wraps loader errors several times."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = [line.strip() for line in str(exc).strip().splitlines()
            if line.strip() and "errors.pydantic.dev" not in line]  # pydantic ends with a link, not the reason
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:2000]


def _top(entry: dict) -> int:
    """The rank-1 token of one position's logprob dict."""
    return min(entry.items(), key=lambda kv: kv[1].rank)[0]


def _w4a8_layers(model) -> int:
    return sum(bool(getattr(m, "use_w4a8", False)) for m in model.modules())


def _serve(llm, SamplingParams, request: dict, answer: dict) -> None:
    """Score the windows (prompt log-probabilities), then decode the prompts greedily, timed."""
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": w} for w in request["windows"]], score, use_tqdm=False)
    answer["prompt_logprobs"], answer["top1"] = [], []
    for w, out in zip(request["windows"], outs):
        entries = out.prompt_logprobs[1:]  # position 0 has no prediction
        answer["prompt_logprobs"].append([e[t].logprob for e, t in zip(entries, w[1:])])
        answer["top1"].append([_top(e) for e in entries])
    greedy = SamplingParams(max_tokens=request["max_new_tokens"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    answer["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    answer["decode"] = {"tokens": sum(len(g) for g in answer["greedy"]), "seconds": seconds,
                        "sequences": len(outs)}


def main(request_path: str, answer_path: str) -> int:
    request = json.loads(open(request_path).read())
    answer: dict = {"loads": False}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        answer["version"] = vllm.__version__
        start = time.perf_counter()
        llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                  enforce_eager=True, seed=0, trust_remote_code=False,
                  max_num_seqs=max(1, len(request["prompts"]), len(request["windows"])))
        answer["load_s"] = time.perf_counter() - start
        answer["loads"] = True
        config = llm.llm_engine.model_config
        answer["quantization"] = config.quantization
        answer["config_dtype"] = str(config.dtype).replace("torch.", "")
        open(answer_path, "w").write(json.dumps(answer))  # loaded: what the caller reads if scoring never ends
        try:  # the CPU build's int4 kernel quantizes activations to int8 when this flag is set on a layer
            answer["w4a8_layers"] = sum(llm.apply_model(_w4a8_layers))
        except Exception as exc:
            answer["w4a8_layers_error"] = _error_line(exc)
    except Exception as exc:  # the answer says why: a refused checkpoint is a result, not a crash
        answer["error"] = _error_line(exc)
        answer["traceback"] = traceback.format_exc()[-4000:]
        open(answer_path, "w").write(json.dumps(answer))
        return 0

    try:
        _serve(llm, SamplingParams, request, answer)
    except Exception as exc:  # loaded, then failed to compute: the checkpoint is not served either
        answer["loads"] = False
        answer["error"] = f"loaded, then its first forward failed: {_error_line(exc)}"
        answer["traceback"] = traceback.format_exc()[-4000:]
    open(answer_path, "w").write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
