"""Measure a model as a speculative-decoding draft for a target: acceptance rate, tokens per target step and
wall-clock speed-up against plain decoding of the target, for each draft length, on real prompts; with the speed-up
the measured step costs predict and the roofline's prediction for accelerators beside it.

Every round of measurement decodes each prompt once plainly and once per draft length, interleaved (so the ratios
share the machine's state); greedy outputs are checked token for token against the plain ones."""
from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from ..serving.speculative import (acceptance_rate, expected_tokens, generate_plain, generate_speculative,
        roofline_speedup)
from ..serving.tree import TreeShape
from ..arch import set_module
from ..serving.lean_decode import fuse_projections, lean_problem
from ..core.nn import QuantLinear, is_linear, native_bf16
from ..core.scheme import W4A16_ASYM_G64, W8A16, QuantScheme

SELF_DRAFT = "self-int4"


def int4_copy(model: nn.Module, scheme: QuantScheme = W4A16_ASYM_G64, head: QuantScheme | None = W8A16,
              dtype: torch.dtype | None = None, vocab_ids: torch.Tensor | None = None,
              fuse: bool = True) -> tuple[nn.Module, list[str]]:
    """A round-to-nearest int4 copy of `model` to use as a draft (no calibration: a draft only has to agree often):
    every linear whose input width the group divides in `scheme`, the output head in `head` (None: kept), in `dtype`
    (default bfloat16 where the model's device computes it natively, which the int4 kernel needs to be fast, else
    float32).
    Returns the copy and the layers kept in float with the reason. The copy is made whole first: for a model that
    does not fit twice in memory, quantize it with a recipe and pass the folder as the draft. `vocab_ids`: the head
    keeps only those tokens' rows (VocabSubsetHead), quantized in `head`. `fuse`: q/k/v and gate/up fused into one
    layer each where the lean decode path runs the model (lean_decode.fuse_projections; the same numbers)."""
    from ..quantizers.rtn import quantize_rtn

    if dtype is None:  # where the model is: a CUDA model's draft is bfloat16 whatever the host CPU has
        where = next((p.device.type for p in model.parameters()), "cpu")
        dtype = torch.bfloat16 if native_bf16(where) else torch.float32
    draft = copy.deepcopy(model).to(dtype)
    if vocab_ids is not None and not isinstance(draft.get_output_embeddings(), QuantLinear):
        draft.config.tie_word_embeddings = False
        subset_head(draft, vocab_ids, head)
    head_module = draft.get_output_embeddings()
    head_module = getattr(head_module, "inner", head_module)  # a VocabSubsetHead's rows
    kept = []
    for name, module in list(draft.named_modules()):
        if not is_linear(module) or isinstance(module, QuantLinear):
            continue
        s = head if module is head_module else scheme
        if s is None:
            kept.append(f"{name}: the head (head=None)")
            continue
        if s.granularity == "group" and module.in_features % s.group_size:
            kept.append(f"{name}: in_features {module.in_features} is not a multiple of group {s.group_size}")
            continue
        set_module(draft, name, QuantLinear.from_module(module, quantize_rtn(module.weight.detach().float(), s)))
    if fuse and lean_problem(draft, 1) is None:
        kept += [f"{x} (not fused)" for x in fuse_projections(draft)]
    return draft.eval(), kept


def int8_head(head: nn.Module, scheme: QuantScheme = W8A16) -> nn.Module:
    """A copy of an EAGLE-3 head (serving/eagle.py) whose decoder layer and lm_head are rounded to `scheme` (int8
    per output channel): a draft step reads about a quarter of the bytes, and only acceptance can change (the
    target verifies every token). `fc`, which reads the target's features once a round, stays float."""
    from ..quantizers.rtn import quantize_rtn

    out = copy.deepcopy(head)
    for name, module in list(out.named_modules()):
        if type(module) is nn.Linear and name != "fc":
            set_module(out, name, QuantLinear.from_module(module, quantize_rtn(module.weight.detach().float(),
                                                                               scheme)))
    return out.eval()


class VocabSubsetHead(nn.Module):
    """A draft's output head over a subset of the vocabulary (the tokens most frequent in some text): logits for
    `ids` from `inner` (a linear over those rows of the head), -inf for every other token. A draft may only ever
    propose those tokens, and speculative decoding stays exact: greedy verification keeps a drafted token only where
    the target agrees, and sampling draws rejected positions from max(q − p, 0), which covers every token the draft
    gives no mass. What it saves is the head's bytes (49,152 × 576 on SmolLM2: a fifth of the model)."""

    def __init__(self, inner: nn.Module, ids: torch.Tensor, vocab: int):
        super().__init__()
        self.inner, self.vocab = inner, vocab
        self.register_buffer("ids", ids.to(torch.int64), persistent=False)
        self.in_features, self.out_features = inner.in_features, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.inner(x)
        out = sub.new_full((*sub.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)


def frequent_tokens(tokenizer, n: int, split: str = "validation") -> torch.Tensor:
    """The `n` token ids most frequent in WikiText-2 `split` (validation: the calibration split, never the test
    text the prompts come from), then the lowest ids (a BPE vocabulary's earliest merges) if fewer occur."""
    from ..calibrate.data import tokenize_joined, wikitext2_rows

    ids = tokenize_joined(wikitext2_rows(split), tokenizer)[0]
    vocab = len(tokenizer)
    counts = torch.bincount(ids, minlength=vocab).float()
    counts += torch.linspace(1e-3, 0, vocab)  # ties (unseen tokens): lower ids first
    return torch.topk(counts, min(n, vocab)).indices.sort().values


def subset_head(model: nn.Module, ids: torch.Tensor, scheme: QuantScheme | None = W8A16) -> nn.Module:
    """Replace `model`'s output head in place by a VocabSubsetHead over `ids`, its rows quantized in `scheme`
    (None: float). Returns the model."""
    from ..quantizers.rtn import quantize_rtn

    head = model.get_output_embeddings()
    if isinstance(head, QuantLinear):
        raise ValueError("the draft's head is already quantized; take the subset before quantizing it")
    weight = head.weight.detach()[ids]
    inner = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    inner.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if scheme is not None:
        inner = QuantLinear.from_module(inner, quantize_rtn(weight.float(), scheme))
    model.lm_head = VocabSubsetHead(inner, ids, head.out_features)
    return model


def wikitext_prompts(tokenizer, n: int, length: int, split: str = "test", offset: float = 0.0) -> list[list[int]]:
    """`n` prompts of `length` tokens: the starts of evenly spaced stretches of WikiText-2 `split`, each `offset`
    of a stretch in (0.5: prompts disjoint from offset 0's, to choose settings on without touching the reported
    ones)."""
    from ..calibrate.data import tokenize_joined, wikitext2_rows

    if not 0 <= offset < 1:
        raise ValueError(f"prompt offset {offset}: use 0 <= offset < 1 (a fraction of the stretch between prompts)")
    ids = tokenize_joined(wikitext2_rows(split), tokenizer)[0]  # [T]
    if ids.numel() < n * length:
        raise ValueError(f"WikiText-2 {split} has {ids.numel()} tokens, fewer than {n} prompts of {length}")
    step = ids.numel() // n
    starts = [min(int((i + offset) * step), ids.numel() - length) for i in range(n)]
    if offset and step < 2 * length:
        raise ValueError(f"{n} prompts of {length} tokens are too dense in WikiText-2 {split} for an offset: they "
                         "would overlap the others; ask for fewer")
    return [ids[s:s + length].tolist() for s in starts]


def _bytes(model: nn.Module) -> int:
    from .memory import weight_bytes

    return weight_bytes(model)["total"]


def _serving(model: nn.Module) -> int:
    from .memory import serving_bytes

    return serving_bytes(model)


ROW_KINDS = {"f32": "float32", "int4": "int4 (float32 activations)", "int8": "int8",
             "w4a8": "int4 x int8 activations (VNNI)"}


def choose_kernels(kernels: str, threads: int, runtime: str, dtype: str) -> str | None:
    """None when the few-row kernels (kernels/cpu_rows.c) are to be used for a draft measurement, else why not (a
    note). kernels: auto (one thread, the lean loop, float32, and they build here), rows (insists: an error says why
    it cannot) or torch. `compress speculate` and a recipe's eval.speculative decide by it."""
    from ..kernels.cpu_rows import RowsUnavailable, load

    if kernels == "torch":
        return "kernels: each layer's own forward (--kernels torch)"
    why = None
    if runtime == "transformers":
        why = "the few-row kernels run in the lean loop, not transformers' forward (--runtime transformers)"
    elif dtype != "float32":
        why = f"the few-row kernels are float32 (--dtype {dtype})"
    elif kernels == "auto" and threads != 1:
        why = f"the few-row kernels run on one thread (--threads {threads}): torch's matmuls use them all"
    else:
        try:
            load()
        except RowsUnavailable as e:
            why = str(e)
    if why and kernels == "rows":
        raise ValueError(f"--kernels rows: {why}")
    return None if why is None else f"kernels: each layer's own forward ({why})"


def measure_draft(target: nn.Module, draft: nn.Module, prompts: list[list[int]], max_new_tokens: int = 64,
                  ks=(1, 2, 3, 4, 5, 6, 7, 8), adaptive: bool = True, temperature: float = 0.0, seed: int = 0,
                  rounds: int = 1, progress=None, runtime: str = "auto", trees=(), tree_sampling: str = "drawn") -> dict:
    """α, tokens per target step and speed-up over plain decoding of `target`, per draft length K (and the adaptive
    schedule), over `prompts`. `draft`: a model sharing the target's vocabulary, or an EAGLE-3 head (serving/eagle.py)
    trained for the target. Speed-up: the summed end-to-end time of plain decoding over that of speculative
    decoding, each from the prompt to the last new token (prefills included: the draft's is part of the cost).
    Greedy (temperature 0) checks every output against plain decoding. `runtime`: the decode loop of both
    (speculative.RUNTIMES; auto: the lean path where the model allows it). `trees`: serving.tree.TreeShape each, a
    row per shape for a head drafting trees, sampled as `tree_sampling` says (serving.tree.generate_eagle_tree);
    where their outputs must be plain decoding's (greedy, or sampling 'top') the differences are tree_mismatches."""
    from ..serving.eagle import EagleHead, generate_eagle
    from ..serving.tree import generate_eagle_tree

    is_head = isinstance(draft, EagleHead)
    if trees and not is_head:
        raise ValueError("draft trees are drafted by an EAGLE-3 head (compress draft-head); a whole-model draft "
                         "drafts a chain (no --tree)")
    generate = generate_eagle if is_head else generate_speculative  # a head, or a whole model
    settings = [(k, False) for k in ks] + ([(ks[0] if ks else 4, True)] if adaptive else [])
    settings += [(shape, False) for shape in trees]
    trees_exact = not (temperature and tree_sampling == "drawn")  # outputs must then be plain decoding's
    plain_s, plain_decode_s, plain_steps, plain_tokens, mismatches, tree_mismatches = 0.0, 0.0, 0, 0, 0, 0
    distinct = []  # per prompt: distinct 4-grams / 4-grams of the plain output (repetition raises α)
    label = lambda k, a: "adaptive" if a else (f"tree {k}" if isinstance(k, TreeShape) else k)  # noqa: E731
    rows = {label(k, a): {"k": label(k, a), "seconds": 0.0, "proposed": 0, "accepted": 0, "rejected": 0,
                          "target_steps": 0, "tokens": 0, "draft_s": 0.0, "verify_s": 0.0, "ks": []}
            for k, a in settings}
    t_start = time.perf_counter()
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed(seed + i)
            base = generate_plain(target, prompt, max_new_tokens, temperature, g, runtime=runtime)
            plain_s += base.seconds
            plain_decode_s += base.seconds - base.prefill_seconds[0]
            plain_steps += base.target_steps
            plain_tokens += len(base.tokens)
            grams = [tuple(base.tokens[j:j + 4]) for j in range(len(base.tokens) - 3)]
            if r == 0 and grams:
                distinct.append(len(set(grams)) / len(grams))
            for k, a in settings:
                g = torch.Generator().manual_seed(seed + i)
                if isinstance(k, TreeShape):
                    got = generate_eagle_tree(target, draft, prompt, max_new_tokens, k, temperature, g,
                                              runtime=runtime, sampling=tree_sampling)
                    tree_mismatches += trees_exact and got.tokens != base.tokens
                else:
                    got = generate(target, draft, prompt, max_new_tokens, k, temperature, a, g, runtime=runtime)
                if temperature == 0 and got.tokens != base.tokens:
                    mismatches += 1
                row = rows[label(k, a)]
                row["seconds"] += got.seconds
                row["proposed"] += got.proposed
                row["accepted"] += got.accepted
                row["rejected"] += got.rejected
                row["target_steps"] += got.target_steps
                row["tokens"] += len(got.tokens)
                row["draft_s"] += got.draft_seconds
                row["verify_s"] += got.target_seconds
                row["ks"] += got.ks
            if progress:
                progress(r * len(prompts) + i + 1, rounds * len(prompts))
    # one plain step: the plain run's decode time over its steps (its first token comes from the prefill)
    t_step = plain_decode_s / max(plain_steps, 1)
    out_rows = []
    for row in rows.values():
        k_mean = statistics.mean(row["ks"]) if row["ks"] else 0
        ks_used = row.pop("ks")
        common = {"tokens_per_step": row["tokens"] / max(row["target_steps"], 1), "mean_k": k_mean,
                  "speedup": plain_s / row["seconds"] if row["seconds"] else 0.0,
                  "tok_s": row["tokens"] / row["seconds"] if row["seconds"] else 0.0,
                  "verify_cost": row["verify_s"] / max(row["target_steps"], 1) / t_step}
        if isinstance(row["k"], str) and row["k"].startswith("tree"):
            # a tree: α of a chain does not apply; its draft cost is per round (every level and the catch-up)
            draft_cost = row["draft_s"] / max(row["target_steps"], 1) / t_step
            out_rows.append({**row, **common, "alpha": None, "expected_tokens_per_step": None, "k_histogram": {},
                             "tree": row["k"][5:], "draft_cost": draft_cost,
                             "predicted_speedup": common["tokens_per_step"] / (common["verify_cost"] + draft_cost)})
            continue
        alpha = acceptance_rate(row["accepted"], row["rejected"]) if row["proposed"] else 0.0
        draft_cost = row["draft_s"] / max(row["proposed"], 1) / t_step
        k_eff = k_mean if row["k"] == "adaptive" else row["k"]
        predicted = expected_tokens(alpha, round(k_eff)) / (common["verify_cost"] + k_eff * draft_cost) if k_eff else 0
        out_rows.append({**row, **common, "alpha": alpha,
                         "expected_tokens_per_step": expected_tokens(alpha, round(k_eff)) if k_eff else 1.0,
                         "k_histogram": {k: ks_used.count(k) for k in sorted(set(ks_used))},
                         "draft_cost": draft_cost, "predicted_speedup": predicted})
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]) if prompts else 0,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "rounds": rounds,
            "plain_s": plain_s, "plain_step_s": t_step, "plain_tok_s": plain_tokens / plain_s if plain_s else 0,
            "greedy_mismatches": mismatches if temperature == 0 else None, "rows": out_rows,
            "tree_mismatches": tree_mismatches if trees and trees_exact else None,
            "tree_sampling": tree_sampling if trees and temperature else None,
            "plain_distinct_4grams": distinct,
            "target_bytes": _bytes(target), "draft_bytes": _bytes(draft), "target_serving_bytes": _serving(target),
            "draft_serving_bytes": _serving(draft), "threads": torch.get_num_threads(),
            "runtime": base.runtime if prompts else runtime, "target_dtype": str(next(target.parameters()).dtype),
            "seconds": time.perf_counter() - t_start}


def roofline_rows(result: dict, target_config, draft_config, accelerators=("H100-SXM",), context: int = 1024) -> list:
    """The roofline's speed-up at each measured α and K, on each accelerator, with the weights as a GPU server holds
    them (quantized layers as stored, every float tensor in bf16: a float32 target on this CPU would otherwise make
    any draft look cheap)."""
    from ..serving.roofline import get_accelerator, model_facts

    t = model_facts(target_config, weight_bytes=result["target_serving_bytes"])
    d = model_facts(draft_config, weight_bytes=result["draft_serving_bytes"])
    out = []
    for name in accelerators:
        acc = get_accelerator(name)
        for row in result["rows"]:
            k = round(row["mean_k"]) if row["k"] == "adaptive" else row["k"]
            if k and row["alpha"] is not None:
                out.append({**roofline_speedup(row["alpha"], k, t, d, acc, context), "k": row["k"]})
    return out


def render(result: dict, title: str = "") -> list[str]:
    lines = [f"### {title}" if title else "", "",
             f"{result['prompts']} prompts of {result['prompt_tokens']} tokens, {result['max_new_tokens']} new tokens "
             f"each, temperature {result['temperature']}, {result['threads']} thread(s); plain decoding "
             f"{result['plain_tok_s']:.1f} tok/s; target {result['target_bytes'] / 1e6:.0f} MB, draft "
             f"{result['draft_bytes'] / 1e6:.0f} MB of weights; target in {result.get('target_dtype', '?')}, "
             f"{result.get('runtime', 'transformers')} decode loop for both", ""]
    if result["greedy_mismatches"] is not None:
        lines += [f"greedy outputs equal to plain decoding: "
                  f"{'all' if not result['greedy_mismatches'] else str(result['greedy_mismatches']) + ' differ'}", ""]
    if result.get("tree_mismatches") is not None:
        lines += [f"tree outputs equal to plain decoding (the target's own tokens): "
                  f"{'all' if not result['tree_mismatches'] else str(result['tree_mismatches']) + ' differ'}", ""]
    if result.get("tree_sampling") == "drawn":
        lines += ["trees sampled with drawn nodes and recursive rejection: in distribution, not token for token", ""]
    lines += ["| K | α | accepted / proposed | tokens / target step | E[tokens] at α | draft step | verify step | speed-up "
              "| predicted from step costs |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r["alpha"] is None:  # a tree
            lines.append(f"| tree {r['tree']} (mean {r['mean_k']:.1f} nodes) | — | "
                         f"{r['accepted'] / max(r['proposed'], 1):.3f} | {r['tokens_per_step']:.2f} | — | "
                         f"{r['draft_cost']:.2f} per round | {r['verify_cost']:.2f} | **{r['speedup']:.2f}×** | "
                         f"{r['predicted_speedup']:.2f}× |")
            continue
        k = r["k"] if r["k"] != "adaptive" else f"adaptive (mean {r['mean_k']:.1f})"
        lines.append(f"| {k} | {r['alpha']:.3f} | {r['accepted'] / max(r['proposed'], 1):.3f} | {r['tokens_per_step']:.2f} | {r['expected_tokens_per_step']:.2f} "
                     f"| {r['draft_cost']:.2f} | {r['verify_cost']:.2f} | **{r['speedup']:.2f}×** "
                     f"| {r['predicted_speedup']:.2f}× |")
    lines += ["", "Step costs are in units of one plain decoding step of the target."]
    if result.get("roofline"):
        lines += ["", "| accelerator | K | draft step | verify step | predicted speed-up |", "|---|---|---:|---:|---:|"]
        lines += [f"| {r['accelerator']} | {r['k']} | {r['draft_cost']:.2f} | {r['verify_cost']:.2f} | "
                  f"{r['speedup']:.2f}× |" for r in result["roofline"]]
    return lines
