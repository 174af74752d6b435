"""What a run will cost in time, before it runs (`compress inspect`): each phase's work from the model's shapes and the
recipe, held against this machine's measured peaks (measure/machine.py). A lower bound: the phases' real rates are
in every run's report (its `profile`), and the gap between the two is what a faster implementation could win.

Counted: reading the checkpoint; the calibration pass's float and compressed forwards (the linear layers' FLOPs,
at the pass's matmul dtype; the float one twice for AutoRound's `target: model`); the evaluation's forwards (both
models, at the model's dtype); the statistics a stage asks for (GPTQ's Hessians, X^T X per distinct input,
float32); GPTQ's solves (per layer: the factor of its Hessian, ~4/3 K^3, and the updates, ~N K^2, float32). Not counted: attention's own products, element-wise work, AWQ's and
AutoRound's searches, the trellis encoder's Viterbi search (their cost depends on their grids, steps and trellis
states: the report shows it).
"""
from __future__ import annotations

import torch
from torch import nn

from ..arch import ArchSpec, block_pairs
from ..core.nn import is_linear, linear_shape, native_bf16
from ..recipe import Recipe

EVAL_TOKENS = 2 ** 18  # eval.max_windows null: the WikiText-2 test split, about 2.9e5 tokens (rounded down)


def _block_shapes(model: nn.Module, arch: ArchSpec) -> list[list[tuple[str, int, int]]]:
    """(name, out_features, in_features) of each block's linear layers."""
    return [[(n, *linear_shape(m)) for n, m in block.named_modules() if n and is_linear(m)]
            for block in arch.block_list(model)]


def _distinct_inputs(block: nn.Module, arch: ArchSpec, names: list[tuple[str, int, int]]) -> list[int]:
    """in_features of each distinct input of a block's linears: those that read one tensor (q/k/v, gate/up: the
    balance layers of one scaling pair) share one Hessian."""
    shared = [set(balance) for _, balance, _, _ in block_pairs(block, arch.awq)]
    seen, out = set(), []
    for name, _, k in names:
        group = next((frozenset(g) for g in shared if name in g), frozenset([name]))
        if group not in seen:
            seen.add(group)
            out.append(k)
    return out


def time_plan(model: nn.Module, arch: ArchSpec, recipe: Recipe, needs_hessian: bool, checkpoint_bytes: int,
              model_dtype: torch.dtype, device: str, peaks: dict) -> dict:
    """Each phase's work and its seconds at `peaks` (the report's profile names), and their sum."""
    shapes = _block_shapes(model, arch)
    block_flop_per_token = 2 * sum(n * k for blk in shapes for _, n, k in blk)
    head = model.get_output_embeddings()
    head_flop_per_token = 2 * (linear_shape(head)[0] * linear_shape(head)[1] if head is not None else 0)
    rates = peaks["matmul_gflop_per_s"]
    model_name = str(model_dtype).replace("torch.", "")
    rows = []

    def row(phase: str, flop: float = 0.0, nbytes: float = 0.0, dtype: str = "float32"):
        if flop:
            rate = rates.get(dtype) or rates["float32"]
            rows.append({"phase": phase, "tflop": round(flop / 1e12, 3), "dtype": dtype,
                         "seconds": round(flop / (rate * 1e9), 2)})
        elif nbytes:
            rows.append({"phase": phase, "gb": round(nbytes / 1e9, 3), "seconds": round(nbytes / 1e9 /
                                                                                          peaks["read_gb_per_s"], 2)})

    row("read", nbytes=checkpoint_bytes)
    cal = recipe.calibration
    if cal is not None:
        tokens = cal.n_samples * cal.seq_len
        compute = model_name if model_dtype != torch.float32 else (
            "bfloat16" if cal.dtype == "bfloat16" or (cal.dtype == "auto" and native_bf16(torch.device(device).type))
            else "float32")
        # AutoRound's `target: model` runs the float blocks once more, on the float model's own activations
        floats = 2 if any(getattr(getattr(st, "options", None), "target", None) == "model" for st in recipe.stages) \
            else 1
        row("float forward", floats * block_flop_per_token * tokens, dtype=compute)
        row("compressed forward", block_flop_per_token * tokens, dtype=compute)
        if needs_hessian:
            blocks = arch.block_list(model)
            ks = [k for blk, names in zip(blocks, shapes) for k in _distinct_inputs(blk, arch, names)]
            row("statistics", sum(2 * tokens * k * k for k in ks))
            row("solves", sum(4 / 3 * k ** 3 + n * k * k for blk in shapes for _, n, k in blk))
    ev = recipe.eval
    if ev.perplexity:
        tokens = (ev.max_windows * ev.seq_len if ev.max_windows else EVAL_TOKENS) * (2 if ev.baseline else 1)
        row("evaluation", (block_flop_per_token + head_flop_per_token) * tokens, dtype=model_name)
    return {"phases": rows, "seconds": round(sum(r["seconds"] for r in rows), 1), "machine": peaks}


def time_lines(plan: dict) -> list[str]:
    """`compress inspect`'s lines of a time_plan."""
    parts = []
    for r in plan["phases"]:
        work = f"{r['gb']:.3g} GB" if "gb" in r else f"{r['tflop']:.3g} TFLOP {r['dtype']}"
        parts.append(f"{r['phase']} {work}: {r['seconds']:.1f} s")
    m = plan["machine"]
    peaks = ", ".join(f"{v:.0f} GFLOP/s {k}" for k, v in m["matmul_gflop_per_s"].items())
    return [f"time at this machine's measured peaks ({peaks}, read {m['read_gb_per_s']:.2f} GB/s): at least "
            f"{plan['seconds']:.0f} s; the report's profile shows what each phase took", "  " + "; ".join(parts)]
