"""`compress draft-head TARGET --output DIR`: train an EAGLE-3 draft head for TARGET and write it as vLLM loads it."""
from __future__ import annotations

import json
import time
from pathlib import Path

EPILOG = """examples:
  compress draft-head default --output runs/eagle_head                  # the embedded model's head
  compress draft-head runs/awq_gptq_int4 --output runs/eagle_awq        # a head for a quantized target
  compress speculate runs/awq_gptq_int4 --draft runs/eagle_awq --k 3-5  # measure it (exact: verified by the target)
  vllm serve EXPORT --speculative-config '{"method":"eagle3","model":"runs/eagle_awq","num_speculative_tokens":4}'

TARGET is anything `compress eval` loads (a run folder, a Hugging Face folder, a .gguf file, `default`); a Llama-family
decoder (the head is a Llama layer; the target's attention shape, rotary embedding and vocabulary are copied). The head
reads the target's hidden states entering three layers (default 2, n/2, n-3, vLLM's choice) and is trained on the
target's own continuations of WikiText-2 validation prompts (half greedy, half sampled at --sample-temperature),
unrolled --ttt-steps times as drafting feeds it its own outputs, against the target's distribution over the
--draft-vocab tokens most frequent in those continuations. A quantized target trains the head on its own (quantized)
hidden states: the head drafts for the model that will be served. The output folder holds config.json and
model.safetensors (vLLM's LlamaForCausalLMEagle3 layout; the embedding is the target's) and training.json (settings,
per-epoch held-out KL and top-1 agreement per unrolled step, seconds per phase). --cache DIR keeps the generated data
(safetensors) to train again without generating; --text-sequences N adds N stretches of WikiText-2 validation
text, read as they are (more data for the cost of a forward each, at the price of text the target did not write)."""


def add_parser(sub) -> None:
    import argparse

    from ..distill.eagle import HeadTraining

    d = HeadTraining()
    p = sub.add_parser("draft-head", help="train an EAGLE-3 draft head for a target (quantized or not) on its own "
                                          "generations; write it as vLLM loads it", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="the model the head drafts for (e.g. default, or a compressed run folder)")
    p.add_argument("--output", required=True, help="the head's folder (written atomically)")
    p.add_argument("--sequences", type=int, default=d.sequences, help=f"generated sequences (default {d.sequences})")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help=f"WikiText-2 validation tokens per prompt (default {d.prompt_tokens})")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens,
                   help=f"tokens the target generates per prompt (default {d.new_tokens})")
    p.add_argument("--text-sequences", type=int, default=d.text_sequences,
                   help="also train on this many WikiText-2 validation stretches of prompt + new tokens, read as they "
                        f"are (the target's features and distributions over real text; default {d.text_sequences})")
    p.add_argument("--sample-temperature", type=float, default=d.sample_temperature,
                   help=f"temperature of the sampled half of the data (default {d.sample_temperature})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help=f"tokens the head can propose (default {d.draft_vocab})")
    p.add_argument("--aux-layers", help="three target layer ids, comma-separated (default 2,n/2,n-3)")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW peak learning rate (default {d.lr})")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help=f"unrolled self-fed steps in training (default {d.ttt_steps})")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 even where the CPU computes bfloat16 "
                                                           "natively (bf16 autocast is the default there)")
    p.add_argument("--holdout", type=int, default=16, help="sequences held out for the per-epoch score (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the saved weights' dtype (default bfloat16, as published heads)")
    p.add_argument("--cache", help="a folder to keep (or reuse) the generated data")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=d.seed)


GEN_KEYS = ("sequences", "prompt_tokens", "new_tokens", "sample_temperature", "seed")


def _read(cache: Path | None, name: str, key: dict) -> dict | None:
    """The tensors of cache/NAME.safetensors when cache/NAME.json holds `key` (the settings that made them)."""
    from safetensors.torch import load_file

    if cache is None or not (cache / f"{name}.safetensors").is_file() or not (cache / f"{name}.json").is_file():
        return None
    return load_file(str(cache / f"{name}.safetensors")) if json.loads((cache / f"{name}.json").read_text()) == key \
        else None


def _write(cache: Path | None, name: str, key: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(cache / f"{name}.safetensors"))
        (cache / f"{name}.json").write_text(json.dumps(key))


def _data(args, loaded, cfg, aux, notes):
    """(sequences, features, teacher log-probabilities, draft ids), made or read from --cache: the target's
    generations are kept apart (generations.*) so that other vocabulary, layer or text settings reuse them."""
    import torch
    from tqdm import tqdm

    from ..calibrate.data import random_windows, sequential_windows, tokenize_joined, wikitext2_rows
    from ..distill.eagle import frequent_ids, generate_sequences, teacher_data

    gen_key = {"target": args.target, **{k: getattr(cfg, k) for k in GEN_KEYS}}
    key = {**gen_key, "draft_vocab": cfg.draft_vocab, "aux_layers": list(aux), "text_sequences": cfg.text_sequences}
    cache = Path(args.cache) if args.cache else None
    if (t := _read(cache, "data", key)) is not None:
        notes["data"] = f"read from {cache}"
        return t["sequences"], t["features"], t["teacher"], t["ids"]
    text = tokenize_joined(wikitext2_rows("validation"), loaded.tokenizer)
    if (g := _read(cache, "generations", gen_key)) is not None:
        gens = g["sequences"]
        notes["generations"] = f"read from {cache}"
    else:
        prompts = random_windows(text, cfg.sequences, cfg.prompt_tokens, cfg.seed)
        t0 = time.perf_counter()
        bar = tqdm(total=cfg.sequences, desc="generating", unit="seq")
        gens = generate_sequences(loaded.model, prompts, cfg, progress=lambda i, n: bar.update(i - bar.n))
        bar.close()
        notes["seconds"]["generate"] = time.perf_counter() - t0
        _write(cache, "generations", gen_key, {"sequences": gens})
    # text first: the held-out sequences are the last ones, and they should be the target's own generations
    seqs = gens if not cfg.text_sequences else \
        torch.cat([sequential_windows(text, gens.shape[1], cfg.text_sequences), gens])
    vocab_ids = frequent_ids(seqs, cfg.draft_vocab, loaded.model.get_output_embeddings().out_features)
    t0 = time.perf_counter()
    bar = tqdm(total=seqs.shape[0], desc="teacher pass", unit="seq")
    feats, teacher = teacher_data(loaded.model, seqs, aux, vocab_ids, progress=lambda i, n: bar.update(i - bar.n))
    bar.close()
    notes["seconds"]["teacher"] = time.perf_counter() - t0
    _write(cache, "data", key, {"sequences": seqs, "features": feats, "teacher": teacher, "ids": vocab_ids})
    return seqs, feats, teacher, vocab_ids


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from ..distill.eagle import HeadTraining, init_head, train_head
    from ..export.eagle import write_head
    from ..model.load import load_model
    from ..serving.eagle import default_aux_layers

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = HeadTraining(sequences=args.sequences, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                       sample_temperature=args.sample_temperature, text_sequences=args.text_sequences,
                       draft_vocab=args.draft_vocab, epochs=args.epochs,
                       batch=args.batch, lr=args.lr, ttt_steps=args.ttt_steps, bf16=not args.no_bf16, seed=args.seed)
    if not 0 <= args.holdout < cfg.sequences:
        raise ValueError(f"--holdout {args.holdout}: use 0..{cfg.sequences - 1} (fewer than --sequences; held out "
                         "from the generations)")
    loaded = load_model(args.target, "float32", "cpu")
    target = loaded.model.eval()
    if getattr(target.config, "model_type", None) not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"draft heads are Llama layers reading a Llama-style target's hidden states; "
                         f"{target.config.model_type!r} is not one (llama, mistral, qwen2)")
    try:
        aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else \
            default_aux_layers(target.config.num_hidden_layers)
    except ValueError as e:
        raise ValueError(f"--aux-layers {args.aux_layers!r}: {e}") if args.aux_layers else e
    aux = tuple(sorted(aux))
    notes = {"target": args.target, "settings": cfg.to_dict(), "aux_layers": list(aux), "seconds": {}}
    t_all = time.perf_counter()
    seqs, feats, teacher, ids = _data(args, loaded, cfg, aux, notes)
    counts = torch.bincount(seqs.flatten(), minlength=target.get_output_embeddings().out_features)
    notes["draft_vocab_coverage"] = float(counts[ids].sum() / counts.sum())  # of the training sequences
    head = init_head(target, cfg.draft_vocab, ids, aux, cfg.seed)
    for p in target.parameters():
        p.requires_grad_(False)
    t0 = time.perf_counter()
    n_steps = -(-(seqs.shape[0] - args.holdout) // cfg.batch) * cfg.epochs
    bar = tqdm(total=n_steps, desc="training", unit="step")

    def progress(step, total, loss):
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.3f}")

    history = train_head(head, target.get_input_embeddings(), seqs, feats, teacher, cfg, args.holdout, progress)
    bar.close()
    notes["seconds"]["train"] = time.perf_counter() - t0
    notes["history"] = history
    notes["seconds"]["total"] = time.perf_counter() - t_all
    dtype = getattr(torch, args.dtype)
    write_head(head, Path(args.output), dtype, notes)
    last = history[-1]
    agree = ", ".join(f"{a:.3f}" for a in last.get("heldout_agreement", []))
    print(f"wrote {args.output}: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, draft vocabulary "
          f"{cfg.draft_vocab} (covers {notes['draft_vocab_coverage']:.1%} of the training tokens)"
          + (f"; held-out top-1 agreement per unrolled step: {agree}" if agree else ""))
    print(f"measure it: compress speculate {args.target} --draft {args.output}")
    return 0
