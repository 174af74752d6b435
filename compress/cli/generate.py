"""`compress generate MODEL "prompt"`: a model's greedy continuation of a prompt (and a baseline's beside it)."""
from __future__ import annotations

EPILOG = """examples:
  compress generate default "What is the capital of France?"
  compress generate runs/awq_int4 "Write a haiku about rain." --baseline default
  compress generate runs/int4_rtn/exports/gguf-q4_0/model-q4_0.gguf "def fibonacci(n):" --no-chat-template
  compress generate runs/awq_int4 --max-new-tokens 64          # no prompt: the report's three prompts

MODEL and --baseline accept `default`, a compress output folder, an export folder, a Hugging Face folder, a .gguf
file or a hub id. Decoding is greedy (deterministic), at most --max-new-tokens tokens, ending at end-of-sequence.
The prompt is rendered as one user turn with MODEL's chat template when its tokenizer has one (SmolLM2-Instruct
has), plain text with --no-chat-template or without one. Both models read MODEL's tokenizer; with --baseline the
output says at which generated token the two continuations first differ.
"""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("generate", help="print a model's greedy continuation of a prompt, beside a baseline's",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the model that continues the prompt")
    p.add_argument("prompt", nargs="?", help="the prompt (default: the report's three fixed prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated at most (default 32)")
    p.add_argument("--baseline", help="a second model, its continuation printed beside MODEL's")
    p.add_argument("--no-chat-template", action="store_true",
                   help="give the prompt as plain text even when the tokenizer has a chat template")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype the models are loaded in (default auto: float32 on a CPU, bfloat16 on CUDA)")
    p.add_argument("--json", action="store_true", help="print the continuations (text and token ids) as JSON")


def run(args) -> int:
    import json

    from ..measure.samples import PROMPTS, generate_samples, side_by_side
    from ..model.load import load_model, resolve_device

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: give the tokens to generate, e.g. 32")
    device = resolve_device(args.device)
    loaded = load_model(args.model, args.dtype, device)
    models = {"baseline": load_model(args.baseline, args.dtype, device).model} if args.baseline else {}
    models["model"] = loaded.model
    for m in models.values():
        m.to(device)
    prompts = (("prompt", args.prompt),) if args.prompt is not None else PROMPTS
    section = generate_samples(models, loaded.tokenizer, args.max_new_tokens,
                               baseline="baseline" if args.baseline else None, chat=not args.no_chat_template,
                               prompts=prompts)
    print(json.dumps(section, indent=2) if args.json else side_by_side(section))
    return 0
