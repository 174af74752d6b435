"""The `eora` stage: a low-rank repair of each quantized layer's error (quantizers/eora.py), block by block in the
calibration pass, right after the quantize stage before it has stored the block's weights.

    - stage: quantize
      method: gptq
      scheme: {dtype: int3, granularity: group, group_size: 64, symmetric: false}
    - stage: eora
      rank: 16

Each repaired QuantLinear computes y = x dequantize(W)ᵀ + (x Aᵀ) Bᵀ. The next block is calibrated on the repaired
outputs. A and B are float tensors (saved at the run's save dtype, counted in the bytes); the exports write them
as a LoRA adapter beside the quantized checkpoint (`adapter/`, PEFT's layout), which peft, transformers and vLLM
(`--enable-lora`) load on top of it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..arch import ArchSpec, get_module
from ..core.nn import QuantLinear, is_linear, linear_weight
from ..quantizers.eora import eora_terms
from .base import BlockState, MemoryBasis, Needs, PassMemory, Plan, RunContext, StageBase, StageRecord


@dataclass
class EoRAPlan:
    """The layers the repair will fit (those an earlier quantize stage quantizes inside the decoder blocks), and
    those it will not, with the reason."""

    layers: list[str]
    outside: dict[str, str]
    quantized_by: dict[str, int] = field(default_factory=dict)  # layer -> index of the quantize stage that stores it


@dataclass
class EoRARecord(StageRecord):
    """The eora stage's report section."""

    rank: int
    damp: float
    repaired: int
    extra_parameters: int  # A and B, over all repaired layers
    mean_error_removed: float | None  # the mean share of each layer's input-weighted error the term removes
    skipped: list  # [{"name", "reason"}]
    layers: dict  # name -> {"rank", "error_removed", "seconds"}


@dataclass(frozen=True)
class EoRAStage(StageBase):
    """Recipe entry `- stage: eora`, after the `quantize` stage whose layers it repairs."""

    rank: int = 16  # per layer; capped at min(out, in)
    damp: float = 0.01  # added to the Hessian's diagonal, as a share of its mean (GPTQ's dampening)
    # 1: the term fitted once to the quantize stage's error. n > 1: then n - 1 rounds of re-quantizing W - B A with
    # that stage's method and refitting the term to the new error (LoftQ / QERA's alternation), the best kept by
    # the input-weighted error. A per-layer method only (rtn, gptq, hqq; AutoRound tunes whole blocks)
    iterations: int = 1

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"eora: rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"eora: iterations must be a positive integer, got {self.iterations!r}")
        if not 0.0 <= self.damp < 1.0:
            raise ValueError(f"eora: damp must be in [0, 1), got {self.damp}")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "eora"

    @property
    def needs_calibration(self) -> bool:
        return True

    def stream_problem(self) -> str | None:
        return ("eora's low-rank terms are not yet written block by block (run it where the model fits in memory, "
                "model.stream: never)")

    def check(self, index: int, stages: tuple, calibrated: bool) -> "EoRAStage":
        super().check(index, stages, calibrated)
        if not any(getattr(s, "stores_weights", False) for s in stages[:index]):
            raise ValueError(f"`stages.{index}` (eora) repairs the error of quantized layers; put it after the "
                             "`stage: quantize` whose layers it repairs")
        return self

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> EoRAPlan:
        inside = arch.blocks + "."
        layers = sorted(n for n in claimed if n.startswith(inside))
        outside = {n: "outside the decoder blocks: the calibration pass sees no inputs of it, so no repair is fitted"
                   for n in sorted(claimed) if not n.startswith(inside)}
        return EoRAPlan(layers, outside, {n: claimed[n] for n in layers})

    def describe(self, plan: Plan, index: int) -> tuple[list[str], dict]:
        step = plan.steps[index]
        rounds = f", {self.iterations} rounds of re-quantizing and refitting" if self.iterations > 1 else ""
        lines = [f"\nstage {index}: eora, rank {self.rank}{rounds}: a low-rank repair of {len(step.layers)} quantized "
                 "layers"]
        lines += [f"  {n}: not repaired ({why})" for n, why in step.outside.items()]
        return lines, {"rank": self.rank, "iterations": self.iterations, "layers": len(step.layers),
                       "outside": step.outside}

    def observed_layers(self, step: EoRAPlan) -> set[str]:
        return set(step.layers)

    def needs(self, plan: Plan, index: int) -> Needs:
        return Needs(hessian=True)

    def added_bytes(self, basis: MemoryBasis) -> int:
        """A [rank, in] and B [out, rank] per block linear, at the run's dtype (an upper bound where a layer's rank is
        capped at its smaller side)."""
        return self.rank * basis.size.block_linear_sides * basis.width

    def pass_memory(self, basis: MemoryBasis) -> PassMemory:
        """One block's Hessians (shared with GPTQ's, where it runs), and the fit of the widest layer: the damped
        Hessian and its factor (K² each), the weighted error and its SVD (out·K each)."""
        size = basis.size
        return PassMemory(statistics={"Hessians": 4 * size.hessian_floats},
                          between={"EoRA fit": 4 * (size.largest_hessian_floats + size.largest_solve)})

    def begin(self, ctx: RunContext, index: int) -> None:
        ctx.records[index] = {}

    def observing(self, block: BlockState, index: int):
        """The block's float weights, as references, before the quantize stage replaces the layers (a smoothing
        stage scales them in place, so the quantize stage and the repair see the same tensors)."""
        return _keep_float_weights(block, index)

    @torch.no_grad()  # as apply_quantize: a smoothing stage's clipping factors may carry autograd state
    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        weights = block.observed.pop(index, {})
        for rel in sorted(block.under(ctx.plan.steps[index].layers)):
            name = f"{block.prefix}.{rel}"
            layer = get_module(block.module, rel)
            if not isinstance(layer, QuantLinear):
                ctx.records[index][name] = {"skipped": "not quantized (left in float by the quantize stage)"}
                continue
            if rel not in weights:
                ctx.records[index][name] = {"skipped": "its float weight was not seen in the block's float forward"}
                continue
            t0 = time.perf_counter()
            w = weights[rel]
            inputs = block.inputs(rel)
            error = w.float() - layer.qtensor().dequantize(torch.float32)
            a, b, share = eora_terms(error, inputs.hessian("EoRA"), self.rank, self.damp)
            record = {"rank": a.shape[0], "error_removed": round(share, 4)}
            if self.iterations > 1:
                a, b, more = self._alternate(ctx, index, layer, name, w.float(), inputs, (a, b, error))
                record.update(more)
            layer.set_lowrank(a.to(w.dtype), b.to(w.dtype))
            ctx.records[index][name] = record | {"seconds": round(time.perf_counter() - t0, 3)}

    def _alternate(self, ctx: RunContext, index: int, layer: QuantLinear, name: str, w: torch.Tensor, inputs,
                   first) -> tuple:
        """Rounds of: the layer's weight re-quantized as W - B A by its quantize stage's method (the layer's codes
        replaced), the term refitted to the new error. The round with the least input-weighted error ‖(W - Q - B A)
        Xᵀ‖ is kept (the first fit included). Returns (A, B, what to add to the layer's record)."""
        from ..quantizers import get_quantizer

        j = ctx.plan.steps[index].quantized_by[name]
        stage, step = ctx.plan.stages[j], ctx.plan.steps[j]
        quantizer = get_quantizer(stage.method)
        fallback = (ctx.records.get(j) or {}).get(name, {}).get("fallback")
        if quantizer.tune_block is not None or fallback:
            why = fallback or f"{stage.method} tunes whole blocks; the term was fitted once"
            return first[0], first[1], {"iterations": 1, "not_alternated": why}
        scheme = next(e.scheme for e in step.quantized if e.name == name)
        h = inputs.hessian("EoRA")
        damped = h.clone()  # the error is weighed as eora_terms weighs it; each refit damps `h` itself
        damped.diagonal().add_(self.damp * float(h.diagonal().mean().clamp(min=1e-12)))

        def weighted(r: torch.Tensor) -> float:
            return float(((r @ damped) * r).sum())

        a, b, error = first
        base = weighted(error)
        best = (weighted(error - b @ a), a, b, layer.qtensor())
        for _ in range(self.iterations - 1):
            qt = quantizer.quantize((w - b @ a).to(layer.qdata.device), scheme, stage.options, inputs)
            error = w - qt.dequantize(torch.float32)
            a, b, _ = eora_terms(error, h, self.rank, self.damp)
            value = weighted(error - b @ a)
            if value < best[0]:
                best = (value, a, b, qt)
        value, a, b, qt = best
        layer.qdata, layer.scale, layer.zero_point = qt.qdata, qt.scale, qt.zero_point
        if qt.global_scale is not None:
            layer.global_scale = qt.global_scale
        return a, b, {"iterations": self.iterations, "error_removed": round(1 - value / base, 4) if base else 0.0}

    def finalize(self, ctx: RunContext, index: int) -> None:
        for name, why in ctx.plan.steps[index].outside.items():
            ctx.records.setdefault(index, {})[name] = {"skipped": why}

    def report(self, ctx: RunContext, index: int) -> dict:
        records = ctx.records.get(index, {})
        done = {n: r for n, r in records.items() if "rank" in r}
        extra = 0
        for n in done:
            layer = get_module(ctx.model, n)
            if isinstance(layer, QuantLinear) and layer.rank:
                extra += layer.lora_a.numel() + layer.lora_b.numel()
        shares = [r["error_removed"] for r in done.values()]
        return EoRARecord(index, "eora", self.rank, self.damp, len(done), extra,
                          sum(shares) / len(shares) if shares else None,
                          [{"name": n, "reason": r["skipped"]} for n, r in records.items() if "skipped" in r],
                          done).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = ["", f"## Stage {section['index']}: eora (rank {section['rank']})", "",
                 f"{section['repaired']} layers repaired with {section['extra_parameters']:,} float parameters "
                 "(a LoRA adapter beside the exports)."]
        if section.get("mean_error_removed") is not None:
            lines.append(f"Each term removes on average {section['mean_error_removed']:.1%} of its layer's "
                         "input-weighted quantization error.")
        if section["skipped"]:
            lines += ["", "| layer | not repaired |", "|---|---|"]
            lines += [f"| `{s['name']}` | {s['reason']} |" for s in section["skipped"]]
        return lines


@contextlib.contextmanager
def _keep_float_weights(block: BlockState, index: int):
    """block.observed[index]: block-relative name -> the weight tensor of each float linear of the block."""
    block.observed[index] = {n: linear_weight(m).detach() for n, m in block.module.named_modules()
                             if n and is_linear(m) and not isinstance(m, QuantLinear)}
    yield
