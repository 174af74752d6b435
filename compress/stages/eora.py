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

Against the model's KL (`weighting: kl`, with a `kl_hessians` stage before the quantize stage): each term is fitted
in the two-sided norm of the layer's KL Hessian (quantizers/eora.eora_kl_terms) instead of its own output error. With
`allocate: true` the ranks are not uniform: the stage fits up to `max_rank` per layer during the pass, and after it
spends the budget of `rank` on every layer (the same parameters) where the KL Hessians say a parameter removes the
most (allocate_ranks); the terms are then set, so the blocks after each are calibrated on their unrepaired outputs.

    - stage: kl_hessians
    - stage: quantize
      method: gptq
      scheme: {dtype: int3, granularity: group, group_size: 64, symmetric: false}
    - stage: eora
      rank: 8
      weighting: kl
      allocate: true
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
from ..quantizers.eora import allocate_ranks, eora_kl_terms, eora_terms, kl_cost, kl_weights
from ..quantizers.gptq_kron import layer_kl_sides
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
    weighting: str
    allocate: bool
    repaired: int
    extra_parameters: int  # A and B, over all repaired layers
    mean_error_removed: float | None  # the mean share of each layer's input-weighted error the term removes
    kl_cost_removed: float | None  # weighting kl: the share of the model's Kronecker KL cost, over all its layers
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
    # input: each layer's own output error (its calibration inputs' Hessian); kl: the two sides of the layer's KL
    # Hessian from a kl_hessians stage before the quantize stage (one unit across the model's layers)
    weighting: str = "input"
    # true (weighting kl): the ranks are chosen after the pass, the budget of `rank` on every layer spent where it
    # removes the most KL; false: every layer gets `rank`
    allocate: bool = False
    max_rank: int = 0  # with allocate: the most one layer gets (0: 8 × rank)
    output_shrink: float = 1.0  # weighting kl: the output side toward its diagonal (GPTQConfig.output_shrink)

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"eora: rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"eora: iterations must be a positive integer, got {self.iterations!r}")
        if not 0.0 <= self.damp < 1.0:
            raise ValueError(f"eora: damp must be in [0, 1), got {self.damp}")
        if self.weighting not in ("input", "kl"):
            raise ValueError(f"eora: weighting must be input or kl, got {self.weighting!r}")
        if self.allocate and self.weighting != "kl":
            raise ValueError("eora: allocate: true compares layers by the KL each rank removes; set weighting: kl (and "
                             "a kl_hessians stage before the quantize stage)")
        if self.allocate and self.iterations > 1:
            raise ValueError("eora: allocate chooses the ranks after the pass, and iterations re-quantize each layer "
                             "during it with its rank known; use one of them")
        if not isinstance(self.max_rank, int) or self.max_rank < 0:
            raise ValueError(f"eora: max_rank must be a non-negative integer, got {self.max_rank!r}")
        if self.output_shrink < 0:
            raise ValueError(f"eora: output_shrink must be >= 0, got {self.output_shrink}")

    @property
    def fit_rank(self) -> int:
        """The rank each layer is fitted to during the pass: `rank`, or the allocation's cap."""
        return (self.max_rank or 8 * self.rank) if self.allocate else self.rank

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
        if self.weighting == "kl" and not any(getattr(s, "name", "") == "kl_hessians" for s in stages[:index]):
            raise ValueError(f"`stages.{index}` (eora, weighting: kl) fits against the layers' KL Hessians; put a "
                             "`- stage: kl_hessians` right before the quantize stage, or use weighting: input")
        if self.weighting == "kl" and (tuned := [j for j, s in enumerate(stages[:index])
                                                 if getattr(s, "method", None) == "autoround"]):
            raise ValueError(f"`stages.{index}` (eora, weighting: kl): `stages.{tuned[0]}` is AutoRound, for which "
                             "kl_hessians writes each block's output side, not the layers' two sides this fit reads; "
                             "use weighting: input after AutoRound, or quantize with gptq or trellis")
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
        rank = (f"ranks allocated against the KL (on average {self.rank}, at most {self.fit_rank})" if self.allocate
                else f"rank {self.rank}" + (", fitted against the KL" if self.weighting == "kl" else ""))
        lines = [f"\nstage {index}: eora, {rank}{rounds}: a low-rank repair of {len(step.layers)} quantized layers"]
        lines += [f"  {n}: not repaired ({why})" for n, why in step.outside.items()]
        return lines, {"rank": self.rank, "iterations": self.iterations, "weighting": self.weighting,
                       "allocate": self.allocate, "layers": len(step.layers), "outside": step.outside}

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
        Hessian and its factor (K² each), the weighted error and its SVD (out·K each); with weighting kl the output
        side and its factor (out² each) too. With allocate the fits of every layer are held until the pass ends:
        max_rank × (out + in) float32 values per layer, counted with the fit."""
        size = basis.size
        fit = size.largest_hessian_floats + size.largest_solve
        if self.weighting == "kl":
            fit += 2 * size.output_hessian_floats
        held = self.fit_rank * size.block_linear_sides * basis.width if self.allocate else 0
        return PassMemory(statistics={"Hessians": 4 * size.hessian_floats},
                          between={"EoRA fit": 4 * fit + held})

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
            sides = self._kl_weights(ctx, index, name, inputs, tuple(w.shape)) if self.weighting == "kl" else None
            if sides is None:
                a, b, share = eora_terms(error, inputs.hessian("EoRA"), self.rank, self.damp)
                record = {"rank": a.shape[0], "error_removed": round(share, 4)}
            else:
                a, b, gains, total = eora_kl_terms(error, sides, self.fit_rank)
                share = float(gains.sum()) / total if total > 0 else 0.0
                record = {"rank": a.shape[0], "error_removed": round(share, 4), "kl_cost": total}
                if self.allocate:  # kept until finalize chooses the ranks; popped there
                    record["fit"] = (a.to(w.dtype).cpu(), b.to(w.dtype).cpu(), gains.cpu())
            if self.iterations > 1:
                a, b, more = self._alternate(ctx, index, layer, name, w.float(), inputs, (a, b, error), sides)
                record.update(more)
            if not self.allocate:
                layer.set_lowrank(a.to(w.dtype), b.to(w.dtype))
            ctx.records[index][name] = record | {"seconds": round(time.perf_counter() - t0, 3)}

    def _kl_weights(self, ctx: RunContext, index: int, name: str, inputs, shape: tuple):
        """Layer `name`'s KL sides, factored once for every fit (quantizers/eora.kl_weights), from the kl_hessians
        folder its quantize stage was given, in the layer's coordinates now (gptq_kron.layer_kl_sides: a smoothing
        stage between rescales them; a MoE expert the pass barely reached takes its own input Hessian)."""
        j = ctx.plan.steps[index].quantized_by[name]
        folder = getattr(ctx.plan.stages[j].options, "output_hessians", "")
        if not folder:
            raise ValueError(f"eora (weighting: kl): stage {j}, which quantizes {name}, was given no KL Hessians; "
                             f"put a `- stage: kl_hessians` right before it (its method must be gptq or trellis)")
        h_out, h_in, _ = layer_kl_sides(folder, inputs, shape)
        return kl_weights(h_in, h_out, self.damp, self.output_shrink)

    def _alternate(self, ctx: RunContext, index: int, layer: QuantLinear, name: str, w: torch.Tensor, inputs,
                   first, sides=None) -> tuple:
        """Rounds of: the layer's weight re-quantized as W - B A by its quantize stage's method (the layer's codes
        replaced), the term refitted to the new error. The round with the least input-weighted error ‖(W - Q - B A)
        Xᵀ‖ is kept (the first fit included); with the KL's `sides` (kl_weights), the least KL cost, and each refit
        against both sides. Returns (A, B, what to add to the layer's record)."""
        from ..quantizers import get_quantizer

        j = ctx.plan.steps[index].quantized_by[name]
        stage, step = ctx.plan.stages[j], ctx.plan.steps[j]
        quantizer = get_quantizer(stage.method)
        fallback = (ctx.records.get(j) or {}).get(name, {}).get("fallback")
        if quantizer.tune_block is not None or fallback:
            why = fallback or f"{stage.method} tunes whole blocks; the term was fitted once"
            return first[0], first[1], {"iterations": 1, "not_alternated": why}
        scheme = next(e.scheme for e in step.quantized if e.name == name)
        if sides is None:
            h = inputs.hessian("EoRA")
            damped = h.clone()  # the error is weighed as eora_terms weighs it; each refit damps `h` itself
            damped.diagonal().add_(self.damp * float(h.diagonal().mean().clamp(min=1e-12)))

            def weighted(r: torch.Tensor) -> float:
                return float(((r @ damped) * r).sum())

            def refit(e: torch.Tensor) -> tuple:
                return eora_terms(e, h, self.rank, self.damp)[:2]
        else:
            def weighted(r: torch.Tensor) -> float:
                return kl_cost(r, sides)

            def refit(e: torch.Tensor) -> tuple:
                return eora_kl_terms(e, sides, self.rank)[:2]

        a, b, error = first
        base = weighted(error)
        best = (weighted(error - b @ a), a, b, layer.qtensor())
        for _ in range(self.iterations - 1):
            qt = quantizer.quantize((w - b @ a).to(layer.qdata.device), scheme, stage.options, inputs)
            error = w - qt.dequantize(torch.float32)
            a, b = refit(error)
            value = weighted(error - b @ a)
            if value < best[0]:
                best = (value, a, b, qt)
        value, a, b, qt = best
        layer.qdata, layer.scale, layer.zero_point = qt.qdata, qt.scale, qt.zero_point
        if qt.global_scale is not None:
            layer.global_scale = qt.global_scale
        return a, b, {"iterations": self.iterations, "error_removed": round(1 - value / base, 4) if base else 0.0}

    def finalize(self, ctx: RunContext, index: int) -> None:
        records = ctx.records.setdefault(index, {})
        if self.allocate:
            self._allocate(ctx, records)
        for name, why in ctx.plan.steps[index].outside.items():
            records[name] = {"skipped": why}

    def _allocate(self, ctx: RunContext, records: dict) -> None:
        """Choose every fitted layer's rank (allocate_ranks: the budget of `rank` on each, spent where the KL Hessians
        say a parameter removes the most) and set the terms, truncated to it. A layer given rank 0 gets no term."""
        fits = {n: r.pop("fit") for n, r in records.items() if "fit" in r}
        costs = {n: a.shape[1] + b.shape[0] for n, (a, b, _) in fits.items()}
        budget = sum(min(self.rank, a.shape[1], b.shape[0]) * costs[n] for n, (a, b, _) in fits.items())
        ranks = allocate_ranks({n: g for n, (_, _, g) in fits.items()}, costs, budget)
        for name, (a, b, gains) in fits.items():
            r, record = ranks[name], records[name]
            total = record["kl_cost"]
            record.update(rank=r, error_removed=round(float(gains[:r].sum()) / total, 4) if total > 0 else 0.0)
            if r:  # held on the CPU during the pass; the layer may live on an accelerator
                layer = get_module(ctx.model, name)
                device = layer.qdata.device
                layer.set_lowrank(a[:r].contiguous().to(device), b[:, :r].contiguous().to(device))

    def report(self, ctx: RunContext, index: int) -> dict:
        records = ctx.records.get(index, {})
        done = {n: r for n, r in records.items() if "rank" in r}
        extra = 0
        for n in done:
            layer = get_module(ctx.model, n)
            if isinstance(layer, QuantLinear) and layer.rank:
                extra += layer.lora_a.numel() + layer.lora_b.numel()
        shares = [r["error_removed"] for r in done.values()]
        costs = [(r["kl_cost"], r["kl_cost"] * r["error_removed"]) for r in done.values() if "kl_cost" in r]
        total = sum(c for c, _ in costs)
        repaired = sum(r["rank"] > 0 for r in done.values())
        return EoRARecord(index, "eora", self.rank, self.damp, self.weighting, self.allocate, repaired, extra,
                          sum(shares) / len(shares) if shares else None,
                          sum(x for _, x in costs) / total if total > 0 else None,
                          [{"name": n, "reason": r["skipped"]} for n, r in records.items() if "skipped" in r],
                          done).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        kl = section.get("weighting") == "kl"
        rank = f"ranks allocated, {section['rank']} on average" if section.get("allocate") else \
            f"rank {section['rank']}"
        lines = ["", f"## Stage {section['index']}: eora ({rank}{', against the KL' if kl else ''})", "",
                 f"{section['repaired']} layers repaired with {section['extra_parameters']:,} float parameters "
                 "(a LoRA adapter beside the exports)."]
        if section.get("allocate"):
            ranks = [r["rank"] for r in section["layers"].values()]
            lines.append(f"Ranks per layer: {min(ranks)} to {max(ranks)} (" +
                         ", ".join(f"{k}: {v:.1f}" for k, v in _mean_rank_by_kind(section["layers"]).items()) + ").")
        if section.get("mean_error_removed") is not None:
            lines.append(f"Each term removes on average {section['mean_error_removed']:.1%} of its layer's "
                         f"{'KL-weighted' if kl else 'input-weighted'} quantization error.")
        if section.get("kl_cost_removed") is not None:
            lines.append(f"Over the model, the terms remove {section['kl_cost_removed']:.1%} of the quantization "
                         "error's KL cost as the KL Hessians' Kronecker factors estimate it.")
        if section["skipped"]:
            lines += ["", "| layer | not repaired |", "|---|---|"]
            lines += [f"| `{s['name']}` | {s['reason']} |" for s in section["skipped"]]
        return lines


def _mean_rank_by_kind(layers: dict) -> dict[str, float]:
    """The mean rank per layer kind (the name's last part: q_proj, down_proj, ...), in first-seen order."""
    kinds: dict[str, list[int]] = {}
    for name, r in layers.items():
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(r["rank"])
    return {k: sum(v) / len(v) for k, v in kinds.items()}


@contextlib.contextmanager
def _keep_float_weights(block: BlockState, index: int):
    """block.observed[index]: block-relative name -> the weight tensor of each float linear of the block."""
    block.observed[index] = {n: linear_weight(m).detach() for n, m in block.module.named_modules()
                             if n and is_linear(m) and not isinstance(m, QuantLinear)}
    yield
