"""Runs inside mlx-lm's own Python (its virtual environment): load one export with mlx_lm.load, score token windows,
decode greedily.

Standalone on purpose, as vllm_worker.py: it imports only mlx, mlx-lm, numpy and the standard library, so it runs
where `compress` (and torch) is not installed. `compress.engines.mlx` writes a request (JSON), starts this file with
the engine's interpreter and reads the answer (JSON). Request fields:
  model, dtype ("auto": as the checkpoint stores it; else float32 / float16 / bfloat16, every float parameter cast,
  scales and biases included), windows, prompts, max_new_tokens, logits_dir (optional: each window's float32
  logits [T, V] saved there as window_{i}.npy).
Answer fields:
  loads, error, version, mlx_version, quantization (config.json's entry), layers ({"affine 4-bit g64": count, ...}:
  the quantized layers mlx-lm built), dtypes (of the float parameters, as computed), prompt_logprobs, top1, greedy,
  load_s, decode (tokens, seconds).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

# run as a script, this file's folder comes first on sys.path, and it holds compress's own mlx.py
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def _layers(model) -> dict:
    import mlx.nn as nn

    counts: dict = {}
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            key = f"{type(m).__name__} {getattr(m, 'mode', 'affine')} {m.bits}-bit g{m.group_size}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _score(model, request: dict, answer: dict) -> None:
    import mlx.core as mx
    import numpy as np

    answer["prompt_logprobs"], answer["top1"] = [], []
    for i, w in enumerate(request["windows"]):
        logits = model(mx.array([w]))[0].astype(mx.float32)
        logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))  # [T, V]
        if request.get("logits_dir"):
            np.save(os.path.join(request["logits_dir"], f"window_{i}.npy"), np.array(logits))
        answer["prompt_logprobs"].append([float(logp[t, tok]) for t, tok in enumerate(w[1:])])
        answer["top1"].append([int(x) for x in logp[:-1].argmax(-1)])


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def main(request_path: str, answer_path: str) -> int:
    request = json.loads(open(request_path).read())
    answer: dict = {"loads": False}
    try:
        import mlx.core as mx
        import mlx_lm

        answer["version"], answer["mlx_version"] = mlx_lm.__version__, mx.__version__
        start = time.perf_counter()
        model, _tokenizer = mlx_lm.load(request["model"])
        if request.get("dtype", "auto") != "auto":
            model.set_dtype(getattr(mx, request["dtype"]))
        mx.eval(model.parameters())
        answer["load_s"] = time.perf_counter() - start
        answer["loads"] = True
        config = json.loads(open(os.path.join(request["model"], "config.json")).read())
        answer["quantization"] = config.get("quantization")
        answer["layers"] = _layers(model)
        from mlx.utils import tree_flatten
        answer["dtypes"] = sorted({str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())
                                   if mx.issubdtype(v.dtype, mx.floating)})
    except Exception as exc:  # the answer says why: a refused checkpoint is a result, not a crash
        answer["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        answer["traceback"] = traceback.format_exc()[-4000:]
        open(answer_path, "w").write(json.dumps(answer))
        return 0
    try:
        _score(model, request, answer)
        start = time.perf_counter()
        answer["greedy"] = [_greedy(model, p, request["max_new_tokens"]) for p in request["prompts"]]
        answer["decode"] = {"tokens": sum(map(len, answer["greedy"])), "seconds": time.perf_counter() - start}
    except Exception as exc:  # loaded, then failed to compute: the checkpoint is not served either
        answer["loads"] = False
        answer["error"] = f"loaded, then its first forward failed: {type(exc).__name__}: {exc}"[:2000]
        answer["traceback"] = traceback.format_exc()[-4000:]
    open(answer_path, "w").write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
