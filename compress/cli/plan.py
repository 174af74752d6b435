"""`compress plan MODEL --accelerator H100-SXM --users N --context T`: how many accelerators a workload needs."""
from __future__ import annotations

import json
from pathlib import Path

EPILOG = """examples:
  compress plan llama-2-13b --users 1 --context 1024          # the course's example: 26.9 GB, 8.0 ms, 125 tok/s
  compress plan qwen2.5-32b --users 100 --context 32768 --ttft 0.5 --weights fp8 --kv fp8 --compare int4:int8
  compress plan ./my-model --accelerator H200 --users 64 --context 8192 --tokens-per-s 30 --output plan.json

MODEL is a built-in architecture (llama-2-13b, llama-30b, qwen2.5-32b), a folder holding config.json, or a hub id
(config only: no weights are read). Weights: bf16, fp8 (W8A8 e4m3: prefill at the fp8 rate), int8 (weight-only),
w8a8 (int8 activations), int4 (g128), int4-g64, int3-g64, or any scheme preset (W4A16, FP8_DYNAMIC, ...); the
embeddings, head and norms stay bf16. KV cache: bf16, fp8, int8 (fp16 scale per token and head), int4 (groups of 32).

The figures are roofline ceilings unless the efficiencies say otherwise (100% of datasheet bandwidth and peak);
the sensitivity section says how far each assumption may be wrong before the plan needs more accelerators."""


def add_parser(sub) -> None:
    import argparse

    from ..serving.roofline import ACCELERATORS
    from ..serving.planner import BUILTIN, KV_DTYPES, WEIGHTS

    p = sub.add_parser("plan", help="capacity planner: accelerators, replicas, batch and memory for a workload, and "
                                    "what each compression option buys", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help=f"a built-in ({', '.join(BUILTIN)}), a folder with config.json or a "
                                            "hub id")
    p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as the positional MODEL")
    p.add_argument("--accelerator", default="H100-SXM", metavar="NAME",
                   help=f"one of {', '.join(ACCELERATORS)} (default H100-SXM)")
    p.add_argument("--users", type=int, required=True, metavar="N",
                   help="concurrent users (sequences decoding at once)")
    p.add_argument("--context", type=int, required=True, metavar="TOKENS", help="tokens each user's KV cache holds")
    p.add_argument("--prompt-tokens", type=int, metavar="TOKENS",
                   help="prompt prefilled before the first token (default: --context)")
    p.add_argument("--ttft", type=float, metavar="S", help="target time to first token, seconds (default: none)")
    p.add_argument("--tokens-per-s", type=float, metavar="R", help="target decode tokens/s per user (default: none)")
    p.add_argument("--weights", default="bf16", metavar="SCHEME",
                   help=f"weight scheme: {', '.join(WEIGHTS)} or a preset (default bf16)")
    p.add_argument("--kv", default="bf16", metavar="DTYPE",
                   help=f"KV-cache dtype: {', '.join(KV_DTYPES)} (default bf16)")
    p.add_argument("--compare", action="append", default=[], metavar="WEIGHTS:KV",
                   help="also plan this pair in the options table (repeatable; e.g. int4:int8)")
    p.add_argument("--max-tp", type=int, default=8, metavar="N",
                   help="largest tensor-parallel replica: 1, 2, 4 or 8 (default 8)")
    p.add_argument("--bandwidth-efficiency", type=float, default=1.0, metavar="F",
                   help="fraction of datasheet bandwidth decode reaches (default 1: the roofline; tuned serving "
                        "kernels reach ~0.7-0.9)")
    p.add_argument("--compute-efficiency", type=float, default=1.0, metavar="F",
                   help="fraction of peak FLOP/s prefill reaches (default 1: the roofline; ~0.4-0.7 is typical)")
    p.add_argument("--quantized-kernel-efficiency", type=float, default=1.0, metavar="F",
                   help="a quantized kernel's weight-read speed relative to bf16's (default 1)")
    p.add_argument("--memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of accelerator memory the server uses (default 0.9, as vLLM)")
    p.add_argument("--activation-factor", type=float, default=1.0, metavar="F",
                   help="times the activation estimate (default 1; 0: not counted)")
    p.add_argument("--prefill-chunk", type=int, default=8192, metavar="TOKENS",
                   help="tokens per prefill forward (default 8192)")
    p.add_argument("--allreduce-us", type=float, default=10.0, metavar="US",
                   help="latency of one all-reduce, µs (default 10)")
    p.add_argument("--link-efficiency", type=float, default=1.0, metavar="F",
                   help="fraction of NVLink / PCIe bandwidth an all-reduce reaches (default 1)")
    p.add_argument("--output", metavar="FILE", help="write the plan as JSON to this file")


def _pairs(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        w, sep, k = item.partition(":")
        if not sep or not w or not k:
            raise ValueError(f"--compare {item!r}: give WEIGHTS:KV, e.g. int4:int8")
        out.append((w, k))
    return tuple(out)


def _value(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:.3g}"


def _gb(x: float) -> str:
    return f"{x:.2f} GB"


def render(r: dict) -> list[str]:
    m, acc, w, a, p = r["model"], r["accelerator"], r["workload"], r["assumptions"], r["plan"]
    attn = f"{m['heads']} query / {m['kv_heads']} KV heads of {m['head_dim']}"
    if m["latent"]:
        attn += f", MLA latent {m['latent']} + {m['rope_dim']}"
    if m["local_layers"]:
        attn += f", {m['local_layers']} local layers (window {m['window']})"
    targets = ", ".join(x for x in (f"TTFT <= {w['ttft_s']:g} s" if w["ttft_s"] else "",
                                    f">= {w['tokens_per_s']:g} tokens/s per user" if w["tokens_per_s"] else "") if x)
    reference = r["options"][0]
    lines = [
        f"compress plan: {m['name']} on {acc['name']} ({acc['memory_gb']:g} GB, {acc['bandwidth_tbs']:g} TB/s, "
        f"{acc['bf16_tflops']:g} TFLOP/s bf16)",
        f"model: {m['params'] / 1e9:.2f}B parameters ({m['linear_params'] / 1e9:.2f}B in block linears), "
        f"{m['layers']} layers, {attn}, vocabulary {m['vocab']}",
        f"weights {r['weights']}: {r['weight_bits_per_weight']:.3f} bits per linear weight (embeddings, head, norms "
        f"bf16) = {_gb(r['options'][1]['weight_gb'])}; KV {r['kv']}: {r['kv_element_bytes']:.4f} bytes per element "
        f"= {_gb(r['options'][1]['kv_gb_per_user'])} per user at {w['context']:,} tokens",
        f"workload: {w['users']} users x {w['context']:,} tokens, prompt {w['prompt_tokens'] or w['context']:,} "
        f"tokens; targets: {targets or 'none'}",
        f"assumptions: {a['bandwidth_efficiency']:.0%} of bandwidth, {a['compute_efficiency']:.0%} of peak"
        f"{' (roofline ceilings)' if a['bandwidth_efficiency'] == a['compute_efficiency'] == 1 else ''}, "
        f"{a['memory_utilization']:.0%} of memory usable, activations x{a['activation_factor']:g} for "
        f"{a['prefill_chunk']}-token chunks, all-reduce {a['allreduce_latency_s'] * 1e6:g} µs + ring", "",
        f"PLAN: {p['accelerators']} x {acc['name']} = {p['replicas']} replica(s) x TP {p['tp']}"
        + (f" (bf16 weights and KV: {reference['accelerators']})" if reference["accelerators"] else
           f" (bf16 weights and KV: no layout; {reference['problem']})"),
        f"  per accelerator: weights {_gb(p['weights_gb'])} + KV {_gb(p['kv_gb'])} (batch {p['batch']}) + "
        f"activations {_gb(p['activations_gb'])} = {_gb(p['weights_gb'] + p['kv_gb'] + p['activations_gb'])} of "
        f"{_gb(p['usable_gb'])} usable",
        f"  largest batch per replica: {p['max_batch_memory']} by memory, {p['max_batch']} meeting the targets; "
        f"serving {p['batch']} (bound by {p['binding']})",
        f"  decode {p['step_s'] * 1e3:.2f} ms per step at batch {p['batch']}: {p['tokens_per_s']:.1f} tokens/s per "
        f"user; TTFT {p['ttft_s']:.3f} s",
        "  TP candidates: " + "; ".join(
            f"TP {d['tp']}: " + (d["problem"] if d["problem"] else f"{d['accelerators']} ({d['replicas']} x "
                                 f"{d['tp']}, batch {d['batch']})") for d in r["candidates"]), "",
        "what each option buys:", "",
        "| option | accelerators | replicas x TP | batch (max) | tok/s per user | TTFT | weights | KV per user "
        "| accuracy risk |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for o in r["options"]:
        if o["accelerators"] is None:
            free = o.get("accelerators_without_ttft")
            cells = f"— ({o['problem']}{f'; {free} without the TTFT target' if free else ''}) | | | | |"
        else:
            cells = (f"**{o['accelerators']}** | {o['replicas']} x {o['tp']} | {o['batch']} ({o['max_batch']}) | "
                     f"{o['tokens_per_s']:.1f} | {o['ttft_s']:.3f} s |")
        lines.append(f"| {o['option']} | {cells} {_gb(o['weight_gb'])} | {_gb(o['kv_gb_per_user'])} | {o['risk']} |")
    lines += ["", "sensitivity: how far each assumption may be wrong (adverse side) before the plan needs more "
                  f"than {p['accelerators']}:"]
    for s in r["sensitivity"]:
        if s["factor"] is None:
            lines.append(f"  {s['meaning']}: holds up to 4x worse")
            continue
        change = f"+{s['factor'] - 1:.0%}" if s["assumption"] in ("users", "context", "activation_factor",
                                                                  "allreduce_latency_s") else \
            f"-{1 - 1 / s['factor']:.0%}"
        after = s["accelerators_after"] if s["accelerators_after"] is not None else "no layout"
        lines.append(f"  {s['meaning']}: {change} (at {_value(s['breaks_at'])}) -> {after}")
    b = r["breaks_first"]
    lines.append(f"breaks first: {b['meaning']}, at {_value(b['breaks_at'])} ({b['assumption']})" if b else
                 "breaks first: no single assumption within 4x changes the count")
    return lines + [f"note: {n}" for n in r["notes"]]


def run(args) -> int:
    from ..serving.roofline import get_accelerator
    from ..serving.planner import Assumptions, Workload, kv_element_bytes, load_shape, plan, weight_scheme

    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"two models given ({args.model!r} and --model {args.model_flag!r}); give one")
    model = args.model or args.model_flag
    if not model:
        raise ValueError("give a MODEL: a built-in (llama-2-13b, llama-30b, qwen2.5-32b), a folder or a hub id")
    get_accelerator(args.accelerator)  # everything that can fail without the model fails first
    compare = _pairs(args.compare)
    for w, _ in ((args.weights, args.kv), *compare):
        weight_scheme(w)
    work = Workload(args.users, args.context, args.ttft, args.tokens_per_s, args.prompt_tokens)
    assume = Assumptions(args.bandwidth_efficiency, args.compute_efficiency, args.quantized_kernel_efficiency,
                         args.memory_utilization, args.activation_factor, args.prefill_chunk,
                         args.allreduce_us * 1e-6, args.link_efficiency)
    shape = load_shape(model)
    for _, k in ((args.weights, args.kv), *compare):
        kv_element_bytes(k, shape)
    result = plan(shape, args.accelerator, args.weights, args.kv, work, assume, args.max_tp, compare)
    print("\n".join(render(result)))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
    return 0
