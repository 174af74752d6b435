"""Prefill and decode throughput: warm-up, repeated runs, the median; at batch 1, or swept over batch sizes
and context lengths where memory allows.

On a CPU both run transformers' forward with its dynamic cache. On CUDA, decoding is timed as a server runs it:
serving/static_decode.py's loop over a static KV cache, each step a CUDA graph replay timed with CUDA events (eager,
host-synchronized calls would time Python more than the kernels); prefill stays eager. `decode_mode` in the result
says which ran, and why not the graph where it did not."""
from __future__ import annotations

import statistics

import psutil
import time

import torch
from torch import nn

from ..core.nn import QuantLinear
from ..serving.hf_forward import cache_kwarg as _cache_kwarg, last_logits_kwarg as _last_logits_kwarg


def kernel_name(model: nn.Module) -> str:
    """Which matmul path the model's linear layers use."""
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not quant:
        return "torch dense matmul"
    kinds: dict[str, int] = {}
    for m in quant:
        kinds[m.kernel] = kinds.get(m.kernel, 0) + 1
    return "; ".join(f"{k} ({n} layers)" for k, n in sorted(kinds.items()))


def _cache(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def measure_speed(model: nn.Module, vocab_size: int, prefill_tokens: int = 512, decode_tokens: int = 32,
                  repeats: int = 3, device: str = "cpu", seed: int = 0, batch: int = 1, graph: bool = True) -> dict:
    """Prefill tokens/s (one forward over `batch` × `prefill_tokens`) and decode tokens/s (greedy steps for the
    whole batch with the KV cache after a prefill), median of `repeats` runs after one warm-up. On CUDA with
    `graph`, decoding runs on the static loop captured in a CUDA graph (module doc); where that loop cannot run the
    model, transformers' eager forward, with the reason in `decode_mode`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, prefill_tokens), generator=gen).to(device)
    mode = "eager (transformers forward, dynamic cache)"
    if device.startswith("cuda") and graph:
        from ..serving.static_decode import static_problem
        problem = static_problem(model, prefill_tokens + decode_tokens)
        if problem is None:
            return _static_speed(model, ids, decode_tokens, repeats, device)
        mode += f": the CUDA-graph decode loop cannot run this model ({problem})"
    elif device.startswith("cuda"):
        mode += ": graph=False"
    prefill, decode = [], []
    cache_kw, keep = _cache_kwarg(model), _last_logits_kwarg(model)
    for run in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **keep)
        _sync(device)
        t1 = time.perf_counter()
        cache, token = _cache(out), out.logits[:, -1:].argmax(-1)
        for _ in range(decode_tokens):
            out = model(input_ids=token, use_cache=True, **{cache_kw: cache})
            cache, token = _cache(out), out.logits[:, -1:].argmax(-1)
        _sync(device)
        t2 = time.perf_counter()
        if run:  # run 0 is the warm-up
            prefill.append(batch * prefill_tokens / (t1 - t0))
            decode.append(batch * decode_tokens / (t2 - t1))
    return {"batch": batch, "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "repeats": repeats,
            "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "kernel": kernel_name(model), "threads": torch.get_num_threads(), "device": device, "decode_mode": mode}


def _static_speed(model: nn.Module, ids: torch.Tensor, decode_tokens: int, repeats: int, device: str) -> dict:
    """measure_speed on the static decode loop: prefill eager (synchronized), decode as `decode_tokens` steps timed
    with CUDA events, replays of one captured graph (or eager steps, when capture failed: `decode_mode` says so)."""
    from ..kernels.cuda_graph import percentile
    from ..serving.static_decode import StaticDecoder

    batch, prefill_tokens = ids.shape
    dec = StaticDecoder(model, batch, prefill_tokens + max(decode_tokens, 1))
    prefill, decode, steps = [], [], []
    for run in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dec.prefill(ids)
        _sync(device)
        t1 = time.perf_counter()
        timer = dec.decode(decode_tokens)
        if run:  # run 0 is the warm-up (and the capture)
            prefill.append(batch * prefill_tokens / (t1 - t0))
            decode.append(batch * decode_tokens / timer.span() if decode_tokens else 0.0)
            steps += timer.times()
    return {"batch": batch, "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "repeats": repeats,
            "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "decode_ms_p50": percentile(steps, 50) * 1e3 if steps else None,
            "decode_ms_p90": percentile(steps, 90) * 1e3 if steps else None,
            "kernel": kernel_name(model), "threads": torch.get_num_threads(), "device": device,
            "decode_mode": dec.mode, "ops_per_step": dec.ops_per_step}


def sweep_bytes(model: nn.Module, batch: int, context: int) -> int:
    """A generous estimate of the memory one sweep point needs beyond the weights: the KV cache and the prefill
    activations (about 16 hidden-size float32 vectors a token live at once, and the MLP's widest)."""
    from ..serving.roofline import attention_dims
    cfg = getattr(model.config, "text_config", model.config)
    heads = cfg.num_attention_heads
    head_dim, kv_heads = attention_dims(cfg)
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4
    width = max(cfg.hidden_size * 16, getattr(cfg, "intermediate_size", 0) * 3, heads * context)
    return batch * context * (kv + width * 4)


def speed_sweep(model: nn.Module, vocab_size: int, batches, contexts, decode_tokens: int = 16, repeats: int = 3,
                device: str = "cpu", budget: int | None = None) -> list[dict]:
    """measure_speed at every (batch, context); points whose estimate exceeds half the free memory are skipped
    and listed with the reason."""
    if budget is None:
        budget = (torch.cuda.mem_get_info()[0] if device.startswith("cuda") else psutil.virtual_memory().available) // 2
    points = []
    for context in contexts:
        for batch in batches:
            need = sweep_bytes(model, batch, context)
            if need > budget:
                points.append({"batch": batch, "prefill_tokens": context, "skipped":
                               f"needs about {need / 1e9:.1f} GB, over half the free memory ({budget / 1e9:.1f} GB)"})
                continue
            points.append(measure_speed(model, vocab_size, context, decode_tokens, repeats, device, batch=batch))
    return points
