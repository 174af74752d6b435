"""Two windows at once against one at a time (issue 49): one SmolLM2-135M-shaped decoder block (random weights,
bfloat16 matmuls under autocast as the calibration pass runs them) on N windows of 512 tokens, with
blockwise.block_forward (two workers of one thread each where the machine has more than one thread) against the
same windows one after another on all threads; and the embedded model's greedy samples at int4 with each layer
dequantizing per call against dequantized once (core/nn.dequantized_if_room). Same run, alternating, nothing else
should be running. Prints a JSON line per repeat.

    OMP_WAIT_POLICY=PASSIVE python bench/parallel_windows.py --windows 32 --repeats 3 [--samples]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from compress.calibrate.blockwise import BlockInputs, block_forward, linear_weights_in  # noqa: E402


def _block(windows: int, seq: int):
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=1, vocab_size=1000)
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, 0).eval()
    hidden = [torch.randn(1, seq, 576) for _ in range(windows)]
    pos = torch.arange(seq)[None]
    kw = {"position_embeddings": LlamaRotaryEmbedding(cfg)(hidden[0], pos), "attention_mask": None,
          "position_ids": pos}
    return block, hidden, kw


@torch.no_grad()
def serial(block, hidden, kw) -> list:
    """The windows one after another on the caller's threads (block_forward before the workers)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), linear_weights_in(block, torch.bfloat16):
        outs = [block(h, **kw) for h in hidden]
        return [(o[0] if isinstance(o, tuple) else o).float() for o in outs]


def forwards(args) -> None:
    block, hidden, kw = _block(args.windows, 512)
    inputs = BlockInputs(hidden, [kw] * len(hidden))
    for r in range(args.repeats):
        t = time.perf_counter()
        block_forward(block, inputs, torch.bfloat16)
        workers = time.perf_counter() - t
        t = time.perf_counter()
        serial(block, hidden, kw)
        one_at_a_time = time.perf_counter() - t
        print(json.dumps({"part": "block forward", "repeat": r, "windows": args.windows, "threads":
                          torch.get_num_threads(), "one_at_a_time_s": round(one_at_a_time, 3),
                          "two_workers_s": round(workers, 3), "speedup": round(one_at_a_time / workers, 2)}))


def samples(args) -> None:
    from compress.arch import set_module
    from compress.core.nn import QuantLinear, dequantized_if_room
    from compress.core.scheme import scheme
    from compress.measure.samples import generate_samples
    from compress.model.load import load_model
    from compress.quantizers.rtn import quantize_rtn
    loaded = load_model("default", "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    w4 = scheme("int4", "group", 64, symmetric=False)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            set_module(model, name, QuantLinear.from_module(m, quantize_rtn(m.weight.detach(), w4)))
    for r in range(args.repeats):
        t = time.perf_counter()
        per_call = generate_samples({"m": model}, tok, 32)
        a = time.perf_counter() - t
        t = time.perf_counter()
        with dequantized_if_room(model, torch.float32):
            once = generate_samples({"m": model}, tok, 32)
        b = time.perf_counter() - t
        print(json.dumps({"part": "greedy samples (3 prompts x 32 tokens, int4 g64)", "repeat": r,
                          "threads": torch.get_num_threads(), "per_call_s": round(a, 2), "dequantized_once_s":
                          round(b, 2), "same_tokens": per_call == once}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", action="store_true", help="also the greedy samples (loads the embedded model)")
    args = ap.parse_args()
    forwards(args)
    if args.samples:
        samples(args)


if __name__ == "__main__":
    main()
