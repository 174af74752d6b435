"""Does vLLM load a head written by `compress draft-head`, and does it accept the head's tokens as often as compress
does? Saves the target as a float32 Hugging Face folder, decodes WikiText-2 test prompts greedily with the head in
compress (generate_eagle: α, tokens) and in vLLM (compress/engines/vllm_eagle.py: its speculative-decoding
counters, tokens), and writes both side by side.

  python bench/eagle_vllm.py --head runs/eagle_head --python ~/vllm/bin/python --output bench/results/eagle_vllm.json

α here is vLLM's own measure, accepted draft tokens / draft tokens (not the lecture's accepted / judged), so both
sides are given both ways where they can be."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--head", required=True)
    ap.add_argument("--python", default=os.path.expanduser("~/vllm/bin/python"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()

    from compress.measure.speculation import wikitext_prompts
    from compress.model.load import load_model
    from compress.serving.eagle import generate_eagle, load_head

    torch.set_num_threads(1)
    loaded = load_model(args.target, "float32", "cpu")
    head = load_head(args.head)
    prompts = wikitext_prompts(loaded.tokenizer, args.prompts, args.prompt_tokens)
    ours = [generate_eagle(loaded.model, head, p, args.max_new_tokens, k=args.k) for p in prompts]
    result = {"target": args.target, "head": args.head, "k": args.k, "prompts": args.prompts,
              "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
              "compress": {"proposed": sum(g.proposed for g in ours), "accepted": sum(g.accepted for g in ours),
                           "rejected": sum(g.rejected for g in ours),
                           "target_steps": sum(g.target_steps for g in ours)}}
    c = result["compress"]
    c["accepted_per_draft_token"] = c["accepted"] / max(c["proposed"], 1)
    c["alpha"] = c["accepted"] / max(c["accepted"] + c["rejected"], 1)
    from compress.engines.vllm_eagle import serve_with_head

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "target"
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
        for speculative in (False, True):
            t0 = time.perf_counter()
            answer = serve_with_head(str(folder), args.head, prompts, args.k, args.max_new_tokens, speculative,
                                     python=args.python)
            answer["wall_s"] = time.perf_counter() - t0
            result["vllm_speculative" if speculative else "vllm_plain"] = answer
    v = result["vllm_speculative"]
    plain = result["vllm_plain"].get("greedy")
    if plain and v.get("greedy"):
        result["vllm_speculative_equals_vllm_plain"] = sum(a == b for a, b in zip(plain, v["greedy"]))
        result["vllm_plain_equals_compress"] = sum(a == g.tokens for a, g in zip(plain, ours))
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("vllm")}, indent=1))
    for key in ("vllm_plain", "vllm_speculative"):
        a = result[key]
        print(key, {k: a.get(k) for k in ("loads", "error", "version", "seconds", "drafts", "draft_tokens", "accepted",
                                          "accepted_per_draft_token", "accepted_per_position")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
