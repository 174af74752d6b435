"""`compress speculate TARGET --draft DRAFT`: measure DRAFT as a speculative-decoding draft for TARGET."""
from __future__ import annotations

import collections
import contextlib
import json
from pathlib import Path

EPILOG = """examples:
  compress speculate default --draft self-int4                  # the target's own int4 copy as its draft
  compress speculate default --draft runs/gptq_int4 --k 4       # a compressed run's model as the draft
  compress speculate default --draft runs/minitron_prune_distill --draft-int4 --k 1-8 --adaptive
  compress speculate default --draft self-int4 --temperature 0.8 --output runs/spec.json
  compress speculate default --draft runs/awq_gptq_int4 --draft-int4 --draft-vocab 16384 --k 3-5
  compress speculate default --draft runs/eagle_head --k 3-6                # an EAGLE-3 head (compress draft-head)
  compress speculate default --draft runs/eagle_head --k 2 --tree 5,4,15    # the head drafting trees, beside a chain

DRAFT is anything `compress eval` loads (a run folder, a Hugging Face folder, a .gguf file, `default`),
`self-int4`: TARGET's weights rounded to int4 g64 (head int8) in memory, no calibration, or an EAGLE-3 head folder
(`compress draft-head TARGET --output DIR`: one layer reading TARGET's hidden states; float32 here).
A whole-model draft must share TARGET's tokenizer. Greedy (temperature 0) outputs are checked token for token against plain decoding; with
sampling, the output follows TARGET's distribution exactly (the min(1, q/p) acceptance rule and the residual).
Timings are batch 1 on --threads CPU threads; the speed-up is end to end (prefills included) against plain
greedy decoding of TARGET in the same run. --accelerator adds the roofline's prediction at each measured alpha.
Llama, Mistral and Qwen2 models decode on a lean loop (their own modules over a preallocated cache; drafts rounded
here get fused q/k/v and gate/up layers), both plainly and speculatively; other families on transformers' forward.
At one thread the lean loop runs on compress's few-row C kernels (--kernels; built with the C compiler on first
use): float32 targets, int4/int8 drafts (int4 x int8 activations on AVX512-VNNI CPUs, --draft-act); a verify of a
few tokens then costs about one decode step (16 cost ~1.8 on a 2-core Xeon: float32 arithmetic) and equals the
one-token steps bit for bit.
--tree DEPTH,BRANCH,TOKENS (a head only; repeat it to compare shapes): each round the head expands the BRANCH best
nodes of each of DEPTH levels, the TOKENS nodes of highest path probability are verified in one target forward
(root + 15 = the few-row kernels' 16 rows), and the target's argmax walks down the tree: the output is plain
decoding's token for token. Sampled (--temperature > 0), each node's children are drawn from the head and verified
by recursive rejection, exact in distribution (--tree-sampling drawn, the default), or are the head's top tokens
walked with the target's own draws (top: plain decoding's tokens, accepted only where the draw lands on a node).
Trees raise the tokens per target step; on a CPU the wider verify can cost more than they bring (docs/results.md)."""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("speculate", help="measure a model as a speculative-decoding draft for another: acceptance, "
                                         "speed-up, roofline prediction", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="the model whose outputs are produced (e.g. default)")
    p.add_argument("--draft", required=True, help="the draft model, or self-int4 (see below)")
    p.add_argument("--draft-int4", action="store_true", help="round the draft's float linears to int4 g64 (its head to "
                                                             "int8) in memory first: a pruned+distilled draft -> "
                                                             "pruned+int4; a quantized run with a float head -> int8 head")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="the draft's head keeps only the N tokens most frequent in WikiText-2 validation (int8 rows); "
                        "decoding stays exact (default 0: the whole vocabulary)")
    p.add_argument("--head-int8", action="store_true",
                   help="an EAGLE-3 head's layer and output rows rounded to int8 per channel in memory (its fc stays "
                        "float): about a quarter of the bytes a draft step reads; only acceptance can change")
    p.add_argument("--draft-head", default="int8", choices=["int8", "int4"],
                   help="the draft's head when the draft is rounded here (self-int4, --draft-int4, --draft-vocab): "
                        "int8 per channel (default) or int4 g64")
    p.add_argument("--k", default="1-8", help="draft lengths: one (4), a list (2,4,6) or a range (1-8; default)")
    p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive draft length")
    p.add_argument("--tree", action="append", default=[], metavar="D,B,T",
                   help="also measure the head drafting trees of DEPTH levels, BRANCH nodes expanded per level, "
                        "TOKENS verified (e.g. 5,4,15); repeatable")
    p.add_argument("--tree-sampling", default="drawn", choices=["drawn", "top"],
                   help="trees at --temperature > 0: drawn (default) draws each node's children from the head and "
                        "verifies them by recursive rejection; top keeps the head's top tokens and walks with the "
                        "target's own draws (plain decoding's tokens, accepted less often)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    p.add_argument("--prompts", type=int, default=4, help="WikiText-2 test prompts (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--prompt-split", default="test", choices=["test", "train", "validation"],
                   help="the WikiText-2 split the prompts come from (default test)")
    p.add_argument("--prompt-offset", type=float, default=0.0, metavar="F",
                   help="start each prompt F of the way into its stretch of the split (default 0; 0.5 gives prompts "
                        "disjoint from the default ones: choose settings such as --tree there, report at 0)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole measurement (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default float32; bfloat16 verifies K+1 tokens more cheaply on a CPU with "
                        "bf16 instructions, but its 1-token and (K+1)-token forwards round differently, so greedy "
                        "outputs can differ from plain decoding at near-ties: counted in the result)")
    p.add_argument("--runtime", default="auto", choices=["auto", "lean", "transformers"],
                   help="decode loop for target and draft alike (auto: the lean path for Llama/Mistral/Qwen2, "
                        "transformers' forward otherwise)")
    p.add_argument("--kernels", default="auto", choices=["auto", "rows", "torch"],
                   help="the lean loop's matmuls at 1..16 rows: rows = compress's few-row CPU kernels (float32, int4, "
                        "int8 layers; built with the C compiler on first use; a decode step or a verify is one call "
                        "through every block), torch = each layer's own forward; auto (default): rows at --threads 1 "
                        "where they build, else torch. Plain and speculative decoding always use the same")
    p.add_argument("--draft-act", default="int8", choices=["int8", "float"],
                   help="with the few-row kernels, the draft's int4 layers take int8 activations (W4A8 on AVX512-VNNI "
                        "CPUs: x rounded per weight group; exactness is untouched, the target verifies every token) "
                        "or float32 ones (default int8)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable timings)")
    p.add_argument("--accelerator", action="append", default=[], metavar="NAME",
                   help="also predict the speed-up there by the roofline model (repeatable; e.g. H100-SXM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the result as JSON to this file")


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            ks = tuple(range(lo, hi + 1))
        else:
            ks = tuple(int(x) for x in text.split(","))
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1 or max(ks) > 64:
        raise ValueError(f"--k {text!r}: give a draft length (4), a list (2,4,6) or a range (1-8), each in 1..64")
    return ks


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from ..serving.roofline import get_accelerator
    from ..measure.speculation import (ROW_KINDS, SELF_DRAFT, choose_kernels, frequent_tokens, int4_copy,
            int8_head, measure_draft, render, roofline_rows, subset_head, wikitext_prompts)
    from ..core.scheme import W4A16_ASYM_G64, W8A16
    from ..kernels.dispatch import plan_dispatch, use_dispatch
    from ..serving.lean_decode import ROWS_ATTR, use_rows
    from ..model.load import load_model
    from ..core.nn import QuantLinear
    from ..serving.eagle import is_head_folder, load_head

    from ..serving.tree import TreeShape

    ks = parse_ks(args.k)
    trees = tuple(TreeShape.parse(t) for t in args.tree)
    for name in args.accelerator:
        get_accelerator(name)  # an unknown name fails before any loading
    if args.temperature < 0:
        raise ValueError(f"--temperature {args.temperature}: use 0 (greedy) or a positive temperature")
    torch.set_num_threads(args.threads)
    dtype = args.dtype
    notes = []
    why_not = choose_kernels(args.kernels, args.threads, args.runtime, dtype)
    row_kernels = {}
    rows = why_not is None
    notes += [why_not] if why_not else []
    draft_dtype = torch.float32 if rows else None  # the few-row kernels take float32 activations
    loaded = load_model(args.target, dtype, "cpu")
    target = loaded.model
    head = W8A16 if args.draft_head == "int8" else W4A16_ASYM_G64
    ids = frequent_tokens(loaded.tokenizer, args.draft_vocab) if args.draft_vocab else None
    if ids is not None:
        notes.append(f"draft head: the {len(ids)} tokens most frequent in WikiText-2 validation (--draft-vocab)")
    if is_head_folder(args.draft):
        if args.draft_int4 or args.draft_vocab:
            raise ValueError(f"{args.draft} is an EAGLE-3 head: --draft-int4 and --draft-vocab apply to whole-model "
                             "drafts (a head has its own draft vocabulary)")
        draft, kept = load_head(args.draft, torch.float32), []
        if args.head_int8:
            draft = int8_head(draft)
        notes.append(f"draft: the EAGLE-3 head in {args.draft} ({draft.config.draft_vocab_size} draft tokens, target "
                     f"features at layers {list(draft.aux_layers)}), " +
                     ("its layer and lm_head int8 per channel, fc float32" if args.head_int8 else "float32"))
        if args.accelerator:
            notes.append("no roofline for a head draft: the roofline models whole decoders (--accelerator ignored)")
            args.accelerator = []
    elif trees or args.head_int8:
        flag = "--tree" if trees else "--head-int8"
        raise ValueError(f"{flag}: for an EAGLE-3 head draft (compress draft-head), not {args.draft}")
    elif args.draft == SELF_DRAFT:
        draft, kept = int4_copy(target, head=head, dtype=draft_dtype, vocab_ids=ids)
        notes.append(f"draft: the target's linears rounded to int4 g64 (asymmetric), its head to {args.draft_head}")
    else:
        draft = load_model(args.draft, dtype, "cpu").model
        kept = []
        if args.draft_int4:
            draft, kept = int4_copy(draft, head=head, dtype=draft_dtype, vocab_ids=ids)
            notes.append(f"draft: its float linears rounded to int4 g64 in memory (--draft-int4; layers it already "
                         f"holds quantized are kept), its head to {args.draft_head}")
        elif ids is not None:
            draft.config.tie_word_embeddings = False
            subset_head(draft, ids, head)
    notes += [f"kept in float: {k}" for k in kept]
    prompts = wikitext_prompts(loaded.tokenizer, args.prompts, args.prompt_tokens, args.prompt_split,
                               args.prompt_offset)
    batches = sorted({1, *(k + 1 for k in range(1, max(*ks, 8) + 1)), *(t.tokens + 1 for t in trees),
                      args.prompt_tokens - 1})  # decode, verify (chain and tree), prefill
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for m in (target, draft):  # the fastest kernel per layer, as `compress eval` measures speed
            if any(isinstance(x, QuantLinear) for x in m.modules()):
                stack.enter_context(use_dispatch(m, plan_dispatch(m, batches)))
        if rows:
            for name, m in (("target", target), ("draft", draft)):
                left = stack.enter_context(use_rows(m, int8_activations=m is draft and args.draft_act == "int8"))
                notes += [f"{name}: on its own forward, not the few-row kernels: {x}" for x in left]
                kinds = collections.Counter(getattr(x, ROWS_ATTR).kind for x in m.modules() if hasattr(x, ROWS_ATTR))
                row_kernels[name] = dict(kinds)
                notes.append(f"{name}'s layers on the few-row kernels: " +
                             ", ".join(f"{v} {ROW_KINDS[k]}" for k, v in sorted(kinds.items())))
        bar = tqdm(total=args.rounds * args.prompts, desc="speculating", unit="prompt")
        result = measure_draft(target, draft, prompts, args.max_new_tokens, ks, not args.no_adaptive,
                               args.temperature, args.seed, args.rounds, progress=lambda i, n: bar.update(i - bar.n),
                               runtime=args.runtime, trees=trees, tree_sampling=args.tree_sampling)
        bar.close()
    result["target"], result["draft"], result["notes"] = args.target, args.draft, notes
    result["prompt_split"], result["prompt_offset"] = args.prompt_split, args.prompt_offset
    result["kernels"] = "rows" if rows else "torch"
    result["row_kernels"] = row_kernels
    if args.accelerator:
        result["roofline"] = roofline_rows(result, target.config, draft.config, args.accelerator)
    print("\n".join(render(result, f"{args.draft} as a draft for {args.target}") + [""] + notes))
    if result["greedy_mismatches"]:
        print(f"warning: {result['greedy_mismatches']} greedy outputs differ from plain decoding (numerical ties "
              "between the one-token and the (K+1)-token forward)")
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)
    return 0
