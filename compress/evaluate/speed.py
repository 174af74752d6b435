"""Prefill and decode throughput at batch 1: warm-up, repeated runs, the median."""
from __future__ import annotations

import inspect
import statistics
import time

import torch
from torch import nn

from ..nn import QuantLinear


def kernel_name(model: nn.Module) -> str:
    """Which matmul path the model's linear layers use."""
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not quant:
        return "torch dense matmul"
    kinds: dict[str, int] = {}
    for m in quant:
        kinds[m.kernel] = kinds.get(m.kernel, 0) + 1
    return "; ".join(f"{k} ({n} layers)" for k, n in sorted(kinds.items()))


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x calls the KV cache `cache`; 4.x called it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def measure_speed(model: nn.Module, vocab_size: int, prefill_tokens: int = 512, decode_tokens: int = 32,
                  repeats: int = 3, device: str = "cpu", seed: int = 0) -> dict:
    """Prefill tokens/s (one forward over `prefill_tokens`) and decode tokens/s (greedy steps with the
    KV cache after a prefill), batch 1, median of `repeats` runs after one warm-up."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, prefill_tokens), generator=gen).to(device)
    prefill, decode = [], []
    cache_kw = _cache_kwarg(model)
    for run in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        _sync(device)
        t1 = time.perf_counter()
        cache, token = _cache(out), out.logits[:, -1:].argmax(-1)
        for _ in range(decode_tokens):
            out = model(input_ids=token, use_cache=True, **{cache_kw: cache})
            cache, token = _cache(out), out.logits[:, -1:].argmax(-1)
        _sync(device)
        t2 = time.perf_counter()
        if run:  # run 0 is the warm-up
            prefill.append(prefill_tokens / (t1 - t0))
            decode.append(decode_tokens / (t2 - t1))
    return {"batch": 1, "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "repeats": repeats,
            "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "kernel": kernel_name(model), "threads": torch.get_num_threads(), "device": device}
