"""Generated samples: greedy continuations of a few fixed prompts by each model, and where they first differ from the
baseline's (the report's `eval.samples`, `compress generate`). A user's first question after "how small" is "does it
still talk?": perplexity answers it in aggregate, these answer it in words."""
from __future__ import annotations

import html
import os

import torch
from torch import nn

from ..threads import ordered_map

# three short prompts of different kinds, the same in every report
PROMPTS = (("fact", "What is the capital of France?"),
           ("instruction", "Give three tips for staying healthy."),
           ("code", "Write a Python function that checks whether a number is prime."))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, prompt: str, chat: bool = True) -> tuple[list[int], str]:
    """The prompt's token ids and the text they spell: rendered as one user turn with the tokenizer's chat template
    (and the assistant turn opened) when `chat` and the tokenizer has one, else the plain text (with the special
    tokens the tokenizer adds to any text, a BOS for Llama's)."""
    if chat and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text
    return list(tokenizer(prompt)["input_ids"]), prompt


def stop_ids(model: nn.Module, tokenizer) -> list[int]:
    """End-of-sequence ids: the model's generation config's, its config's and the tokenizer's."""
    ids: set[int] = set()
    for eos in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return sorted(ids)


@torch.no_grad()
def greedy(model: nn.Module, ids: list[int], new_tokens: int, stop: list[int] = ()) -> list[int]:
    """The model's greedy continuation of `ids`: at most `new_tokens` tokens, through its own `generate` (its KV
    cache, whatever its family's), ending with the first id of `stop` when one comes."""
    from transformers import GenerationConfig

    device = next(p.device for p in model.parameters())
    prompt = torch.tensor([ids], device=device)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=list(stop) or None,
                              pad_token_id=stop[0] if stop else 0, use_cache=True)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    return out[0, len(ids):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first generated token where `a` and `b` differ (the shorter one's length when one is the
    other's start), None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decoding_workers(device: str, models: int, threads: int | None = None) -> int:
    """How many models decode their samples at once: on a CPU, as many as its cores hold at `threads` (default: the
    caller's torch threads) each, else one. Greedy decoding at batch 1 is small operations a second torch thread
    barely speeds up, while two models on one thread each take about half the time of one after the other; each model
    still decodes on `threads` threads, so its tokens are those it gives alone."""
    threads = threads or torch.get_num_threads()
    return max(1, min(models, (os.cpu_count() or 1) // threads)) if device == "cpu" else 1


def generate_samples(models: dict[str, nn.Module], tokenizer, new_tokens: int, baseline: str | None = None,
                     chat: bool = True, prompts=PROMPTS) -> dict:
    """The report's `eval.samples`: for each prompt, each model's greedy continuation (its text, special tokens left
    out, and its token ids), and for each model but `baseline` where it first departs from the baseline's.

    Each distinct model decodes every prompt on the caller's thread count; on a CPU with cores to spare, several
    models at once (decoding_workers), one worker each. A model given under two names decodes once."""
    device = str(next(next(iter(models.values())).parameters()).device)
    result = {"new_tokens": new_tokens, "decoding": "greedy", "device": device,
              "chat_template": chat and has_chat_template(tokenizer), "baseline": baseline, "prompts": []}
    rendered = [(name, prompt, *prompt_ids(tokenizer, prompt, chat)) for name, prompt in prompts]
    distinct = list({id(m): m for m in models.values()}.values())

    def continuations(m: nn.Module) -> list[list[int]]:
        stop = stop_ids(m, tokenizer)
        return [greedy(m, ids, new_tokens, stop) for _, _, ids, _ in rendered]

    threads = torch.get_num_threads()
    workers = decoding_workers(device.split(":")[0], len(distinct), threads)
    tokens = dict(zip(map(id, distinct), ordered_map(distinct, continuations, workers, threads_each=threads)))
    for k, (name, prompt, ids, text) in enumerate(rendered):
        outputs = {}
        for n, m in models.items():
            new = tokens[id(m)][k]
            outputs[n] = {"text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new}
        entry = {"name": name, "prompt": prompt, "rendered": text, "outputs": outputs}
        if baseline is not None:
            ref = outputs[baseline]["tokens"]
            entry["first_difference"] = {}
            for n, o in outputs.items():
                if n != baseline:
                    i = first_difference(ref, o["tokens"])
                    entry["first_difference"][n] = None if i is None else {
                        "index": i, "agreed_text": tokenizer.decode(ref[:i], skip_special_tokens=True)}
        result["prompts"].append(entry)
    return result


def _cell(text: str) -> str:
    """Text in a markdown table cell: HTML escaped, pipes and backticks escaped (a generated ``` would open a code
    span that swallows the rest of the row), line breaks as <br>."""
    return (html.escape(text, quote=False).replace("|", "\\|").replace("`", "\\`").replace("\n", "<br>")
            or "(nothing)")


def difference_text(diff: dict | None) -> str:
    if diff is None:
        return "identical"
    return f"token {diff['index']}, after “{diff['agreed_text']}”" if diff["index"] else "token 0"


def render(section: dict | None) -> list[str]:
    """report.md's "Generated samples": one row per prompt, the models' continuations side by side."""
    if not section:
        return []
    lines = ["", "## Generated samples", ""]
    if "skipped" in section:
        return lines + [f"Not generated: {section['skipped']}."]
    names = list(section["prompts"][0]["outputs"]) if section["prompts"] else []
    base = section.get("baseline")
    others = [n for n in names if n != base]
    lines += [f"Greedy continuations, at most {section['new_tokens']} new tokens (ending at end-of-sequence), on "
              f"{section['device']}; prompts "
              + ("rendered with the tokenizer's chat template as one user turn." if section["chat_template"] else
                 "given as plain text (the tokenizer has no chat template).")
              + (" The last column: the first generated token where a model departs from the baseline's "
                 "continuation, and the text they share up to it." if base and others else ""), "",
              "| prompt | " + " | ".join(names) + (" | first difference |" if base and others else " |"),
              "|---|" + "---|" * (len(names) + bool(base and others))]
    for p in section["prompts"]:
        cells = [_cell(p["prompt"])] + [_cell(p["outputs"][n]["text"]) for n in names]
        if base and others:
            diffs = p["first_difference"]
            cells.append("<br>".join((f"{n}: " if len(others) > 1 else "") + _cell(difference_text(diffs[n]))
                                     for n in others))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def side_by_side(section: dict) -> str:
    """`compress generate`'s output: each model's continuation of each prompt, and where they first differ."""
    out = []
    base = section.get("baseline")
    for p in section["prompts"]:
        out.append(f"prompt: {p['rendered']}" if not section["chat_template"] else
                   f"prompt (chat template): {p['prompt']}")
        for n, o in p["outputs"].items():
            out.append(f"--- {n} ---\n{o['text']}")
        if base is not None:
            out += [f"--- first difference ({n}): {difference_text(d)}" for n, d in p["first_difference"].items()]
    return "\n".join(out)
