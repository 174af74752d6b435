"""The `quantize` stage: which layers get which scheme (the plan), and applying it through the registered quantizer
(`quantizers.QUANTIZERS`) block by block during the calibration pass, then to what lies outside the blocks."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..measure.fmt import num
from ..arch import ArchSpec, block_pairs, cross_attention_blocks, get_module, multimodal_part, set_module
from ..arch.mixers import float_linear_reason, float_reason
from ..arch.moe import EXPERT, ROUTER_REASON, any_expert, router_names
from ..arch.paths import is_tied, untie_lm_head
from ..core.profile import phase_of
from ..core.nn import QuantLinear, is_linear, kernel_for, linear_shape, linear_weight
from ..calibrate.blockwise import BlockInputs, block_forward, forward_work
from ..calibrate.deferred import deferrable
from ..calibrate.observers import BlockObserver
from ..quantizers import LayerInputs, build_options, get_quantizer
from ..quantizers.autoround import BlockSamples, block_metric, tuning_workers
from ..threads import run_groups
from ..core.scheme import W4A16_G64, QuantScheme
from ..core.trellis import TrellisLinear, TrellisTensor
from ..transforms.smoothing import pooled_stats
from .base import BlockState, MemoryBasis, Needs, PassMemory, Plan, RunContext, StageBase, StageRecord

COMMON_GROUP_SIZES = (16, 32, 64, 128, 256)
TIED_LM_HEAD = ("keep", "untie")
# GPTQ solves at once on a CPU pass of more than one thread (each on its share of the threads): two, one per core on
# a 2-core laptop; more would hold more solves' memory for a column loop that is bound by its small operations
SOLVE_WORKERS = 2


@dataclass(frozen=True)
class LayerScheme:
    """One entry of a quantize stage's `layer_schemes`: the layers `layer` names (a full module name, a class name or
    a `re:` pattern, as in `targets`) take `scheme` instead of the stage's; `scheme: null` leaves them in float
    (reported). The first entry that matches a layer wins. `stage: auto_precision` writes these for the quantize
    stage after it (recipe.resolved.yaml then reproduces its choice without measuring again)."""

    layer: str
    scheme: QuantScheme | None = None


@dataclass
class QuantizeRecord(StageRecord):
    """The quantize stage's report section."""

    method: str
    scheme: str  # the stage's scheme (layers may have their own: `layers`)
    scheme_fields: dict
    quantized: int
    skipped: list  # [{"name", "reason"}] of the selected layers left in float
    float_parameters: dict  # why other parameters stay in float -> their count (QuantPlan.float_summary)
    layers: dict  # layer -> its scheme's name
    untied: dict  # an untied lm_head -> {"extra_bytes", "note"}
    layer_info: dict  # layer -> what the pass found for it (input scale, outlier features, ...)
    experts: dict  # a MoE expert's calibration coverage (expert_tokens)
    min_expert_tokens: int
    tuning: dict  # layer -> AutoRound's tuning record


@dataclass(frozen=True)
class QuantizeStage(StageBase):
    """Recipe entry `- stage: quantize`.

    targets / ignore: class names (`Linear`) or `re:` patterns matched from the start of the module's
    full name (`re:.*mlp\\..*`); a plain name also matches a full module name. `lm_head` always means
    the model's output projection, whatever the family calls it. `ignore` wins over `targets`.
    strict: a layer the scheme cannot hold (group size does not divide in_features) is an error;
    with strict: false it is left in float and listed in the report with the reason.
    method: a name in quantizers.QUANTIZERS (rtn, gptq, hqq); options: that method's settings (a mapping, e.g.
    `options: {act_order: false}` for gptq), validated against its options dataclass.
    tied_lm_head: what to do with an lm_head that shares its weight with the input embedding
    (tie_word_embeddings, as in SmolLM2). `keep` leaves it in float (reported): quantizing the shared matrix
    would also quantize the embedding lookup. `untie` gives lm_head its own copy of the matrix just before it is
    quantized: the embedding keeps its float weight, the config is marked untied, and the checkpoint grows by the
    quantized head's bytes (llama.cpp's GGUF files do the same: a separate 4/8-bit `output.weight`). It is an
    opt-in on top of the selection, not a selection of its own: lm_head must also be matched by `targets` and
    not by `ignore`. Because the default `ignore: [lm_head]` would silently turn `untie` into a no-op, a stage
    that says `untie` and still lists `lm_head` in `ignore` is rejected; write `ignore: []` (or a stage with
    `targets: [lm_head]` and `ignore: []` to quantize the head alone, e.g. at int8 while the body is int4).
    min_expert_tokens: a mixture-of-experts expert's layers are calibrated on the tokens routed to it; where the
    calibration set routed fewer than this many tokens to an expert, a method that needs calibration data (GPTQ)
    quantizes its weights by round-to-nearest instead, and a static activation scale is the largest of its sibling
    experts' (the same projection in the same block); the report lists every expert's tokens and each fallback.
    layer_schemes: per-layer exceptions to `scheme` (mixed precision by hand, or as `auto_precision` chose it): a
    list of {layer: NAME or re:PATTERN, scheme: SCHEME or null}; a layer matched by `targets` (and not `ignore`)
    takes the first matching entry's scheme, float for null.
    cross_attention: a vision-language model's cross-attention layers (Llama 3.2 Vision): `float` keeps them float,
    `quantize` quantizes them like the other blocks' layers, which needs calibration on images (calibration kind
    images: the model skips them on text); unset, the recipe resolves it from the calibration (quantize with kind
    images; else it stays unset, which plans them float).
    """

    method: str = "rtn"
    scheme: QuantScheme = W4A16_G64
    targets: tuple[str, ...] = ("Linear", "Conv1D")
    ignore: tuple[str, ...] = ("lm_head",)
    strict: bool = True
    options: Any = None  # the method's options dataclass (a mapping in a recipe; None: its defaults)
    tied_lm_head: Literal["keep", "untie"] = "keep"
    min_expert_tokens: int = 16  # a MoE expert routed fewer calibration tokens is quantized by the fallback rule
    layer_schemes: tuple[LayerScheme, ...] = ()
    cross_attention: Literal["float", "quantize"] | None = None

    @property
    def schemes(self) -> list[QuantScheme]:
        """Every scheme the stage may store: its own and those of layer_schemes."""
        return [self.scheme] + [e.scheme for e in self.layer_schemes if e.scheme is not None]

    def scheme_for(self, name: str, module: nn.Module, lm_head: str) -> tuple[QuantScheme | None, str | None]:
        """(the scheme layer `name` takes, the layer_schemes pattern that decided it or None for the stage's own)."""
        for e in self.layer_schemes:
            if _matches(name, module, (e.layer,), lm_head):
                return e.scheme, e.layer
        return self.scheme, None

    @property
    def scheme_label(self) -> str:
        """The stage's own scheme as the plan and the report name it (a trellis code's name for method trellis)."""
        code = get_quantizer(self.method).code
        return self.scheme.name if code is None else code(self.scheme, self.options).name

    @property
    def needs_calibration(self) -> bool:
        q = get_quantizer(self.method)
        return q.needs_hessian or q.tune_block is not None or any(needs_input_stats(s) for s in self.schemes)

    @property
    def data_parallel(self) -> bool:
        """A block-tuning method (AutoRound) would need its gradients summed over the processes at every step;
        not built, so such a stage runs in one process (distributed.check_stages refuses it before any work)."""
        return get_quantizer(self.method).tune_block is None

    def __post_init__(self):
        quantizer = get_quantizer(self.method)  # unknown method -> ValueError listing the known ones
        object.__setattr__(self, "options", build_options(self.method, self.options))
        for sch in dict.fromkeys(self.schemes):
            if (why := quantizer.problem(sch)) is not None:
                raise ValueError(f"method {self.method} with scheme {sch.name}: {why}")
        if self.min_expert_tokens < 1:
            raise ValueError(f"min_expert_tokens must be at least 1, got {self.min_expert_tokens}")
        if self.tied_lm_head not in TIED_LM_HEAD:
            raise ValueError(f"tied_lm_head is {self.tied_lm_head!r}; allowed values: "
                             f"{', '.join(map(repr, TIED_LM_HEAD))} (keep: leave a tied lm_head in float; untie: "
                             "quantize a separate copy of it)")
        if self.cross_attention not in (None, "float", "quantize"):
            raise ValueError(f"cross_attention is {self.cross_attention!r}; allowed values: 'float' (keep a vision-"
                             "language model's cross-attention layers float), 'quantize' (with calibration kind "
                             "images), or leave it out (resolved from the calibration)")
        if self.tied_lm_head == "untie" and "lm_head" in self.ignore:
            raise ValueError("tied_lm_head: untie quantizes the lm_head, but `ignore` still lists lm_head (the "
                             "default ignore is [lm_head]); set `ignore: []` (or drop lm_head from it), or use "
                             "tied_lm_head: keep")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "quantize"
    stores_weights: ClassVar[bool] = True

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> "QuantPlan":
        """plan_quantize, less the layers an earlier quantize stage claimed."""
        plan = plan_quantize(model, arch, self)
        for entry in plan.quantized:
            if entry.name in claimed:
                entry.scheme, entry.reason = None, f"quantized by stage {claimed[entry.name]}"
            else:
                claimed[entry.name] = index
        return plan

    def describe(self, plan: Plan, index: int) -> tuple[list[str], list[dict]]:
        step = plan.steps[index]
        mixed = {e.scheme for e in step.quantized}
        what = self.scheme_label if mixed <= {self.scheme} else \
            f"{len(mixed)} schemes ({', '.join(sorted(s.name for s in mixed))}; per layer below)"
        lines = [f"\nstage {index}: quantize, method {self.method}, scheme {what}: "
                 f"{len(step.quantized)} layers quantized, {len(step.skipped)} left in float"]
        lines += multimodal_lines(step, plan.arch, plan.model)
        rows = expert_rows(step.layers)
        width = max((len(name) for name, _, _ in rows), default=0)
        for name, e, count in rows:
            what = e.label if e.scheme else f"float  ({e.reason})"
            if e.scheme and e.scheme.act is not None:
                what += f"  [{kernel_for(e.scheme)}]"
            lines.append(f"  {name:<{width}}  {e.shape[0]:>6}×{e.shape[1]:<6} {what}" +
                         (f"  ({count} experts)" if count > 1 else ""))
        summary = step.float_summary()
        if summary:
            total = sum(r["elements"] for r in summary.values()) + sum(e.shape[0] * e.shape[1] for e in step.quantized)
            lines.append("  other parameters kept in float:")
            for why, r in sorted(summary.items(), key=lambda kv: -kv[1]["elements"]):
                lines.append(f"    {r['params']:>5} tensors, {r['elements'] / total:7.2%} of the parameters: {why}")
        return lines, [{"name": e.name, "shape": e.shape, "scheme": e.label if e.scheme else None,
                        "reason": e.reason} for e in step.layers]

    def observed_layers(self, step: "QuantPlan") -> set[str]:
        return {e.name for e in step.quantized}

    def needs(self, plan: Plan, index: int) -> Needs:
        experts = any(EXPERT.search(e.name) for e in plan.steps[index].quantized)
        return Needs(abs_max=any(s.act is not None for s in self.schemes), hessian=self._needs_hessian(),
                     tokens=experts)

    def _needs_hessian(self) -> bool:
        gptq_init = getattr(self.options, "init", None) == "gptq"  # AutoRound started from GPTQ's solution
        return get_quantizer(self.method).needs_hessian or gptq_init

    def export_problem(self, formats: tuple[str, ...], index: int, check) -> str | None:
        """Trellis codes load only in compress itself: refused before any work for every format but native and
        dense (the planned model's layers look like any int scheme to the formats' own checks)."""
        other = [f for f in formats if f not in ("native", "dense")]
        if self.method == "trellis" and other:
            return (f"stage {index}: method trellis stores trellis codes, which no {', '.join(other)} loader reads; "
                    "export `native` (compress's own checkpoint) or `dense` (the decoded weights in float)")
        return None

    def stored_bytes(self, basis: MemoryBasis) -> int:
        """The block linears at the stage's scheme (its bits, and a 16-bit scale per group), the rest as it was."""
        sch, linear = self.scheme, basis.size.block_linear_parameters
        per_weight = sch.bits / 8 + (2 / sch.group_size if sch.granularity == "group" else 0)
        return basis.weights - linear * basis.width + int(linear * per_weight)

    def pass_memory(self, basis: MemoryBasis) -> PassMemory:
        """GPTQ (and AutoRound started from it): one block's Hessians, K² floats per distinct linear input, and one
        solve at a time beside them (two on a CPU pass of more than one thread: two inputs' layers at once, one per
        worker thread): the layer's H/n, its weight being updated, the lazy update (quantizers/gptq.py; the factor of
        H that layers reading one input share is held across them, and let go before the next is made);
        AutoRound: the tuning of one block (tuning_bytes), and with `target: model` the float model's activations
        carried beside the pass's. Both are named, 0 where the method has none (a device plan lists them)."""
        size, seq_len = basis.size, basis.calibration.seq_len
        hessian = self._needs_hessian()
        tuning = get_quantizer(self.method).tune_block is not None
        # on a CPU with more than one thread, two inputs' layers are solved at once (apply_quantize: run_groups)
        two = basis.device == "cpu" and basis.calibration.threads != 1 and not tuning
        solve = size.two_solves if two else size.largest_solve
        workers = tuning_workers(getattr(self.options, "batch_size", 1), basis.device,
                                 2 if basis.calibration.threads != 1 else 1) if tuning else 1
        statistics = {"Hessians": 4 * size.hessian_floats} if hessian else {}
        if tuning and getattr(self.options, "target", "block") == "model":  # one more set of a block's activations
            statistics["the float model's activations"] = \
                basis.calibration.n_samples * seq_len * size.hidden * basis.width
        return PassMemory(statistics=statistics,
                          during={"block tuning": tuning_bytes(size, seq_len, workers) if tuning else 0},
                          between={"GPTQ solve": 4 * solve if hessian else 0})

    def observing(self, block: BlockState, index: int):
        """A block-tuning method (AutoRound) keeps the block's inputs and float outputs of every window (the
        tensors the pass computes anyway: references, not copies) and the autocast dtype the pass computes in."""
        if get_quantizer(self.method).tune_block is None:
            return contextlib.nullcontext()
        return _keep_block_samples(block, index)

    def begin(self, ctx: RunContext, index: int) -> None:
        ctx.records[index] = {}  # layer name -> what the pass found for it (input scale, outlier features)

    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        if getattr(self.options, "target", "block") == "model":
            _follow_float_model(ctx, block, index)
        tuned = self._tune(ctx, block, index) if get_quantizer(self.method).tune_block is not None else None
        apply_quantize(ctx.model, ctx.plan.steps[index], self, block.prefix, block.observer, block.divisor,
                       ctx.records[index], tuned=tuned, clip=block.clip,
                       output_divisor=output_divisors(block.module, ctx.arch.awq, block.divisor))

    def _tune(self, ctx: RunContext, block: BlockState, index: int) -> dict:
        """The block's planned linears tuned jointly by the block-level method; recorded per block."""
        entries = {e.name[len(block.prefix) + 1:]: e for e in ctx.plan.steps[index].quantized
                   if e.name.startswith(block.prefix + ".")}
        entries = {rel: e for rel, e in entries.items() if not isinstance(get_module(block.module, rel), QuantLinear)}
        kept = block.observed.pop(index, None)
        if not entries or kept is None or not kept[0].hidden:
            return {}
        samples, dtype = kept
        weights = {rel: linear_weight(get_module(block.module, rel)).detach() for rel in entries}
        t_init, kw = None, {}
        if getattr(self.options, "init", None) == "gptq":  # start from GPTQ's solution of each layer
            t0 = time.perf_counter()
            kw["starts"] = {rel: gptq_start(w, entries[rel].scheme, block.inputs(rel)) for rel, w in weights.items()}
            t_init = round(time.perf_counter() - t0, 2)
        if folder := getattr(self.options, "output_hessians", ""):  # against the model's loss (a kl_hessians stage)
            hidden = samples.target[0].shape[-1]
            kw["metric"] = block_metric(folder, block.prefix, hidden, self.options.kl_dampening).to(
                samples.target[0].device)
        tuned, record = get_quantizer(self.method).tune_block(
            block.module, weights, self.scheme, self.options, samples, dtype,
            {rel: e.scheme for rel, e in entries.items()}, **kw)
        if t_init is not None:
            record.update(init="gptq", init_seconds=t_init)
        if "metric" in kw:
            record.update(loss="block-output Fisher")
        if self.options.target == "model":
            record.update(target=f"the float model's activations (carried from block {ctx.carried[index][2]})")
        ctx.records[index][block.prefix] = {"tuning": record}  # beside the layers' records (saved on resume)
        return tuned

    def finalize(self, ctx: RunContext, index: int) -> None:
        """The planned layers outside the decoder blocks (lm_head), or all of them without a calibration pass."""
        ctx.carried.pop(index, None)  # AutoRound's float-model activations, if any, past the last block
        apply_quantize(ctx.model, ctx.plan.steps[index], self, outside=ctx.arch.blocks if ctx.calibrated else None)

    def report(self, ctx: RunContext, index: int) -> dict:
        plan = ctx.plan.steps[index]
        records = ctx.records.get(index, {})
        return QuantizeRecord(
            index, "quantize", self.method, self.scheme_label, asdict(self.scheme), len(plan.quantized),
            skipped=[{"name": e.name, "reason": e.reason} for e in plan.skipped],
            float_parameters=plan.float_summary(), layers={e.name: e.label for e in plan.quantized},
            untied={e.name: {"extra_bytes": e.untied_bytes, "note": e.note} for e in plan.quantized
                    if e.untied_bytes is not None},
            layer_info={n: v for n, v in records.items() if "tuning" not in v}, experts=expert_tokens(records),
            min_expert_tokens=self.min_expert_tokens,
            tuning={n: v["tuning"] for n, v in records.items() if "tuning" in v}).to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = ["", f"## Stage {section['index']}: quantize ({section.get('method', '')}, "
                     f"{section.get('scheme', '')})", "",
                 f"{section['quantized']} layers quantized; {len(section['skipped'])} left in float."]
        if section["skipped"]:
            lines += ["", "| layer | reason left in float |", "|---|---|"]
            lines += [f"| `{s['name']}` | {s['reason']} |" for s in section["skipped"]]
        return lines + float_lines(section) + expert_lines(section) + tuning_lines(section) + \
            activation_lines(section, models)


def tuning_bytes(size, seq_len: int, workers: int = 1) -> int:
    """AutoRound's tuning of one block (quantizers/autoround.py), for the memory plan (`size`: a
    pipeline.memory_plan.ModelSize): per weight, float32 V, its gradient and the best step's copy, the float32 copy of
    a 16-bit weight, the step's rounded weight and its gradient, the mask and factor the rounding's backward reads,
    the rounded weight cast for a window's matmul and the rounding's temporaries: 38 bytes (measured 2026-12-06 on a
    1B-shaped block: 38.4 at bfloat16, 35.6 at float32), and 4 more for each further worker's gradient (`workers`:
    windows computed at once, autoround.tuning_workers); and each worker's window's forward saved for its backward,
    about 16 float32 values per token and input feature."""
    return (38 + 4 * (workers - 1)) * size.block_parameters + workers * 4 * 16 * seq_len * size.input_features


def gptq_start(w: Tensor, scheme: QuantScheme, inputs: LayerInputs) -> Tensor:
    """GPTQ's solution for one layer (its scheme, the default GPTQ settings: act order with static groups, so its
    grid is the one min/max of `w` gives, AutoRound's own at α = β = 1; the Hessian of the inputs the pass saw),
    dequantized: what AutoRound's `init: gptq` rounds onto that grid, GPTQ's codes exactly before any step."""
    from ..quantizers import GPTQConfig
    from ..quantizers.gptq import quantize_gptq

    qt = quantize_gptq(w.float(), inputs.hessian("AutoRound's GPTQ initialisation"), scheme, GPTQConfig(),
                       name=inputs.name, overwrite_hessian=True)
    return qt.dequantize(torch.float32).to(w.dtype)


def _follow_float_model(ctx: RunContext, block: BlockState, index: int) -> None:
    """AutoRound's `target: model`: the float model's own activations at this block's output become the tuning's
    targets (in place of the float block on the compressed model's inputs), carried from block to block in
    ctx.carried[index] as (the block they are the input of, one tensor per window, the block the carried stream
    started at). At the first block both are the pass's own targets. The float block runs on them before any
    stage of this block has quantized it, with the pass's autocast dtype and its two windows at once. A pass resumed
    part-way starts the stream again from the compressed model's inputs at the block it resumes at (the record says
    from which block); a block the model's forward passes by (cross-attention on text) passes it on unchanged."""
    if getattr(ctx.model.config.get_text_config(), "num_kv_shared_layers", 0):
        raise ValueError("autoround target: model carries a second stream of activations through the blocks, and "
                         "this model's later layers read keys and values that earlier layers wrote in the same "
                         "forward (num_kv_shared_layers), which the two streams would overwrite; use target: block")
    stream = ctx.carried.get(index)
    if stream is not None and stream[0] != block.index:
        stream = None  # not this block's input (the pass resumed elsewhere): start again from the pass's inputs
    kept = block.observed.get(index)
    if kept is None or not kept[0].hidden:  # the block saw no windows: the activations pass it by
        if stream is not None:
            ctx.carried[index] = (block.index + 1, stream[1], stream[2])
        return
    samples, dtype = kept
    if stream is None:  # the block's own outputs as its hook saw them (not a spill file's rows: those are reused)
        ctx.carried[index] = (block.index + 1, samples.target, block.index)
        return
    inputs, started = BlockInputs(stream[1], samples.kwargs), stream[2]
    del stream
    ctx.carried[index] = None  # the previous block's activations go as this block's are made
    with phase_of(ctx.profile, "float forward", *forward_work(block.module, inputs, dtype)):
        targets = block_forward(block.module, inputs, dtype)
    del inputs
    ctx.carried[index] = (block.index + 1, targets, started)
    block.observed[index] = (BlockSamples(samples.hidden, samples.kwargs, targets), dtype)


@contextlib.contextmanager
def _keep_block_samples(block: BlockState, index: int):
    """Record, during the block's float forward, every window's inputs and outputs in block.observed[index] as
    (BlockSamples, the autocast dtype of the forward or None)."""
    samples, dtype = BlockSamples([], [], []), []

    def hook(_module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        samples.hidden.append(hidden.detach())
        samples.kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        samples.target.append((output[0] if isinstance(output, (tuple, list)) else output).detach())
        if not dtype:
            dev = hidden.device.type
            dtype.append(torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None)

    # deferrable: in a parallel block forward the windows are kept in their order (calibrate/deferred.py)
    handle = block.module.register_forward_hook(deferrable(hook), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
    block.observed[index] = (samples, dtype[0] if dtype else None)


def tuning_lines(stage: dict) -> list[str]:
    """A block-tuning method's loss per block (block output MSE against the float block): first step, kept step."""
    rows = stage.get("tuning") or {}
    if not rows:
        return []
    secs = sum(r["seconds"] for r in rows.values())
    lines = ["", f"Block tuning ({stage.get('method')}): block output MSE against the float block at the first step "
                 f"and at the step kept; {secs:.0f} s in all.", "",
             "| block | first step | kept (step) | seconds |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| `{name}` | {num(r['first_loss'], '{:.3g}')} | {num(r['kept_loss'], '{:.3g}')} "
                     f"({r['kept_step']}) | {r['seconds']:.1f} |")
    return lines


def expert_tokens(info: dict) -> dict[str, dict]:
    """experts module -> {"tokens": calibration tokens routed to each expert, "fallback": {expert: rule}} from the
    per-layer records of a quantize stage."""
    out: dict[str, dict] = {}
    for name, v in info.items():
        m = EXPERT.search(name)
        if m is None or "expert_tokens" not in v:
            continue
        moe = name[:m.start()] + m.group(0)[:-len(m.group(1)) - 2]
        row = out.setdefault(moe, {"tokens": {}, "fallback": {}})
        e = int(m.group(1))
        row["tokens"][e] = max(row["tokens"].get(e, 0), v["expert_tokens"])
        if "fallback" in v:
            row["fallback"][e] = v["fallback"]
    return {moe: {"tokens": [r["tokens"][e] for e in sorted(r["tokens"])], "fallback": r["fallback"]}
            for moe, r in out.items()}


def sibling_stats(observer: BlockObserver, rel: str):
    """The input statistics of the same projection of the other experts of `rel`'s MoE block, pooled (the largest
    maxima): what a static input scale of an expert that saw too few tokens is taken from."""
    return pooled_stats(observer, [n for n in observer.stats if n != rel and any_expert(n) == any_expert(rel)])


def expert_rows(layers: list[LayerPlan]) -> list[tuple[str, LayerPlan, int]]:
    """(display name, a representative entry, how many) for `compress inspect`: the same projection of every expert
    of one MoE block with the same shape and outcome is one row (`...experts.*.gate_proj`); other layers one each."""
    rows: dict[tuple, list] = {}
    for e in layers:
        key = (any_expert(e.name), e.shape, e.scheme, e.reason)
        rows.setdefault(key, [key[0], e, 0])[2] += 1
    return [tuple(r) for r in rows.values()]


def needs_input_stats(scheme: QuantScheme) -> bool:
    """Static activation scales and static LLM.int8 outlier features come from calibration inputs."""
    act = scheme.act
    return act is not None and (not act.dynamic or (act.outlier_threshold is not None and act.outliers == "static"))


@dataclass
class LayerPlan:
    name: str
    kind: str  # module class name
    shape: tuple[int, int]  # (out_features, in_features)
    scheme: QuantScheme | None  # None = left in float
    reason: str = ""  # why it is left in float
    untie: bool = False  # lm_head tied to the input embedding: give it its own copy before quantizing it
    untied_bytes: int | None = None  # set when apply_quantize untied it: what the separate quantized head adds
    note: str = ""  # what was done beyond quantizing (untying)
    code: Any = None  # the stored format beyond the scheme's grid (Quantizer.code: trellis codes), None: the grid

    @property
    def label(self) -> str:
        """What the layer stores, as the plan and the report name it (the code's name where it has one)."""
        return self.code.name if self.code is not None else self.scheme.name


@dataclass
class QuantPlan:
    layers: list[LayerPlan] = field(default_factory=list)
    cross_attention: str = "float"  # a vision-language model's cross-attention layers (QuantizeStage.cross_attention)
    # every parameter that is not the weight of a planned layer: (name, elements, reason it stays float)
    float_params: list[tuple[str, int, str]] = field(default_factory=list)

    def float_summary(self) -> dict[str, dict]:
        """reason -> {"params": count, "elements": total}: what stays in float, by why."""
        out: dict[str, dict] = {}
        for _, n, why in self.float_params:
            row = out.setdefault(why, {"params": 0, "elements": 0})
            row["params"] += 1
            row["elements"] += n
        return out

    @property
    def quantized(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.scheme is not None]

    @property
    def skipped(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.scheme is None]


def _matches(name: str, module: nn.Module, patterns: tuple[str, ...], lm_head: str) -> str | None:
    for pat in patterns:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return pat
        elif pat == type(module).__name__ or pat == name or (pat == "lm_head" and name == lm_head):
            return pat
    return None


def _named(name: str, module: nn.Module, targets: tuple[str, ...], lm_head: str) -> bool:
    """Whether a target names layer `name` itself (its name or a `re:` pattern), not only its class."""
    return any(t not in CLASS_TARGETS and _matches(name, module, (t,), lm_head) for t in targets)


def plan_quantize(model: nn.Module, arch: ArchSpec, stage: QuantizeStage) -> QuantPlan:
    """Decide, for every linear layer, the scheme or the reason it stays in float. Raises on a
    layer the scheme cannot hold when stage.strict is set."""
    plan = QuantPlan(cross_attention=stage.cross_attention or "float")
    routers = router_names(model)
    tied = is_tied(model, arch.lm_head)
    cross = cross_attention_prefixes(model, arch) if plan.cross_attention == "float" else ()
    code = get_quantizer(stage.method).code
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        sch, by = stage.scheme_for(name, module, arch.lm_head)
        entry = LayerPlan(name, type(module).__name__, linear_shape(module), None)
        plan.layers.append(entry)
        in_features = entry.shape[1]
        if isinstance(module, QuantLinear):
            entry.reason = f"already quantized ({module.scheme.name})"
        elif why := multimodal_reason(name, arch, cross):
            entry.reason = why
        elif name in routers and not _named(name, module, stage.targets, arch.lm_head):
            entry.reason = ROUTER_REASON + " (name it in `targets:` to quantize it)"
        elif recurrent := float_linear_reason(model, name):
            entry.reason = recurrent
        elif is_per_layer_input(name, arch) and not _named(name, module, stage.targets, arch.lm_head):
            entry.reason = PER_LAYER_INPUT_REASON + " (name it in `targets:` to quantize it in a run held in memory)"
        elif not _matches(name, module, stage.targets, arch.lm_head):
            entry.reason = f"not matched by targets {list(stage.targets)}"
        elif pat := _matches(name, module, stage.ignore, arch.lm_head):
            entry.reason = f"ignored (ignore: {pat})"
        elif name == arch.lm_head and tied and stage.tied_lm_head == "keep":
            entry.reason = ("lm_head shares its weight with the input embedding (tie_word_embeddings); kept in "
                            "float; set tied_lm_head: untie to quantize a separate copy")
        elif sch is None:
            entry.reason = f"left in float by layer_schemes ({by})"
        elif sch.granularity == "block" and (in_features % sch.group_size or entry.shape[0] % sch.group_size):
            msg = (f"{name}: shape {entry.shape} is not a whole number of {sch.group_size}×{sch.group_size} blocks")
            if stage.strict:
                raise ValueError(msg + f". Use a block size that divides both, add {name!r} to `ignore:`, or set "
                                       "`strict: false` to leave such layers in float (reported).")
            entry.reason = f"shape {entry.shape} % block {sch.group_size} != 0 (strict: false)"
        elif code is not None and (tile := getattr(code(sch, stage.options), "tile", 1)) and \
                (in_features % tile or entry.shape[0] % tile):
            msg = f"{name}: shape {entry.shape} is not a whole number of {tile}×{tile} trellis tiles"
            if stage.strict:
                raise ValueError(msg + f". Set options.tile to a size that divides both, add {name!r} to `ignore:`, "
                                       "or set `strict: false` to leave such layers in float (reported).")
            entry.reason = f"shape {entry.shape} % trellis tile {tile} != 0 (strict: false)"
        elif sch.granularity == "group" and in_features % sch.group_size:
            fits = [g for g in COMMON_GROUP_SIZES if in_features % g == 0]
            msg = (f"{name}: in_features={in_features} is not divisible by group_size={sch.group_size}; "
                   f"group sizes that divide it: {fits or 'none of ' + str(list(COMMON_GROUP_SIZES))}")
            if stage.strict:
                raise ValueError(msg + f". Set scheme.group_size to one of those, add {name!r} to `ignore:`, "
                                       "or set `strict: false` to leave such layers in float (reported).")
            entry.reason = f"in_features={in_features} % group_size={sch.group_size} != 0 (strict: false)"
        else:
            entry.scheme = sch
            entry.untie = name == arch.lm_head and tied
            entry.code = None if code is None else code(sch, stage.options)
    plan.float_params = float_parameters(model, plan, routers, arch)
    return plan


# a vision-language model (arch/tables.py `vision`): only its language model's decoder blocks are quantized
VISION_REASON = ("{what} of a vision-language model: outside the language model; kept in float (only the "
                 "language model's blocks are quantized, also when calibrating on images)")
CROSS_ATTENTION_REASON = ("cross-attention layer of a vision-language model: it reads the image features and the "
                          "model skips it on text, so text calibration never runs it; kept in float (calibration "
                          "kind images quantizes it)")
# with calibration kind images the cross-attention layers' linears are quantized; their gates and norms stay float
CROSS_ATTENTION_PARAMS_REASON = ("gate or norm of a cross-attention layer (its linear layers quantized, calibrated on "
                                 "images): one value per channel or a scalar; kept in float")


def multimodal_split(step: "QuantPlan", arch: ArchSpec, model: nn.Module) -> dict[str, dict]:
    """A vision-language model's plan by part: {"language model": ..., "vision tower": ..., "cross-attention
    layers": ...}, each {"linears": linear layers, "quantized": of them quantized, "tensors": parameters kept float,
    "elements": their elements, "reason": why they stay float}; {} for a text-only model."""
    if not arch.vision:
        return {}
    cross = cross_attention_prefixes(model, arch)

    def part(name: str) -> str:
        if (what := multimodal_part(arch, name)) is not None:
            return what
        return "cross-attention layers" if name.startswith(cross) else "language model"

    out: dict[str, dict] = {}
    for e in step.layers:
        row = out.setdefault(part(e.name), dict(linears=0, quantized=0, tensors=0, elements=0, reason=""))
        row["linears"] += 1
        row["quantized"] += e.scheme is not None
    for name, n, why in step.float_params:
        row = out.setdefault(part(name), dict(linears=0, quantized=0, tensors=0, elements=0, reason=""))
        row["tensors"] += 1
        row["elements"] += n
        if row is not out.get("language model"):
            row["reason"] = why.removeprefix("linear left in float: ")
    return out


def multimodal_lines(step: "QuantPlan", arch: ArchSpec, model: nn.Module) -> list[str]:
    """`compress inspect`'s lines on how a vision-language model is split: what is quantized, what stays float."""
    split = multimodal_split(step, arch, model)
    if not split:
        return []
    lm = split.get("language model", {})
    lines = [f"  vision-language model: {lm.get('quantized', 0)} of the language model's {lm.get('linears', 0)} "
             "linear layers quantized; kept in float, with every parameter:"]
    for what, row in split.items():
        if what != "language model":
            quantized = f" ({row['quantized']} quantized, calibrated on images)" if row["quantized"] else ""
            lines.append(f"    {what}: {row['linears']} linear layers{quantized}, {row['tensors']} tensors, "
                         f"{row['elements']:,} parameters ({row['reason']})")
    return lines


def cross_attention_prefixes(model: nn.Module, arch: ArchSpec) -> tuple[str, ...]:
    """The names of the decoder blocks that are cross-attention layers (Llama 3.2 Vision), each with a final dot."""
    return tuple(f"{arch.blocks}.{i}." for i in cross_attention_blocks(model, arch))


def multimodal_reason(name: str, arch: ArchSpec, cross: tuple[str, ...], cross_attention: str = "float") -> str | None:
    """Why module or parameter `name` of a vision-language model stays float: it lies in the vision tower, the
    projector or elsewhere outside the language model, or in a cross-attention block (with `cross_attention:
    quantize`, only that block's parameters besides its linears' weights); None otherwise."""
    if (what := multimodal_part(arch, name)) is not None:
        return VISION_REASON.format(what=what)
    if not name.startswith(cross):
        return None
    return CROSS_ATTENTION_REASON if cross_attention == "float" else CROSS_ATTENTION_PARAMS_REASON


CLASS_TARGETS = (None, "Linear", "Conv1D")  # a target that names a module class, not a layer
# linears outside the decoder blocks that compute inputs every block reads: Gemma 3n / 4's per_layer_model_projection
# (each block's slice of the per-layer inputs). Quantized, they would change every block's inputs after the blocks
# were calibrated on the float ones, and a streamed run carries the float ones to its evaluation (the layer is
# quantized after the pass), so its evaluation would not see the quantized layer the in-memory run's does
PER_LAYER_INPUTS = ("per_layer_model_projection",)
PER_LAYER_INPUT_REASON = ("per-layer input projection outside the decoder blocks: every block reads its output, and the "
                          "blocks are calibrated (and a streamed run evaluated) on its float output")


def is_per_layer_input(name: str, arch: ArchSpec) -> bool:
    """Whether linear `name` is a per-layer input projection (PER_LAYER_INPUTS) outside the decoder blocks."""
    return name.rpartition(".")[2] in PER_LAYER_INPUTS and not name.startswith(arch.blocks + ".")


def float_parameters(model: nn.Module, plan: QuantPlan, routers: set[str],
                     arch: ArchSpec | None = None) -> list[tuple[str, int, str]]:
    """Every parameter of `model` the plan does not quantize, with the reason: the weights of layers left in float
    (their plan's reason), biases, norms, embeddings, routers and anything else, by module type. With the planned
    weights, these are all of the model's parameters (a test checks every family)."""
    planned = {e.name: e for e in plan.layers}
    embed = model.get_input_embeddings()
    cross = () if arch is None else cross_attention_prefixes(model, arch)
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied weight is counted once, where it first appears
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            entry = planned.get(mod_name)
            if entry is not None and p_name == "weight":
                if entry.scheme is None:
                    out.append((full, p.numel(), f"linear left in float: {entry.reason}"))
                continue
            if arch is not None and (multimodal := multimodal_reason(full, arch, cross, plan.cross_attention)):
                why = multimodal  # a vision tower's or a cross-attention block's every parameter, by its part
            elif module is embed:
                why = "input embedding: a lookup table, not a matmul"
            elif entry is not None:
                why = f"{p_name} of a linear layer: kept in float, as every checkpoint format does"
            elif mod_name in routers:
                why = ROUTER_REASON
            elif "norm" in type(module).__name__.lower() or "norm" in mod_name.rsplit(".", 1)[-1]:
                why = "normalisation weight: one value per channel"
            elif isinstance(module, nn.Embedding):  # Gemma 3n / 4's per-layer input embedding
                why = "embedding: a lookup table, not a matmul"
            elif recurrent := float_reason(module, p_name):  # a Mamba / linear-attention layer's own parameters
                why = recurrent
            else:
                why = f"not a linear layer ({type(module).__name__}.{p_name})"
            out.append((full, p.numel(), why))
    return out


@torch.no_grad()
def apply_quantize(model: nn.Module, plan: QuantPlan, stage: QuantizeStage, prefix: str | None = None,
                   observer: BlockObserver | None = None, input_divisor: dict | None = None,
                   info: dict | None = None, outside: str | None = None, tuned: dict | None = None,
                   clip: dict | None = None, output_divisor: dict | None = None) -> int:
    """Replace the planned layers (only those under `prefix`, when given; only those not under `outside`, when given:
    the decoder blocks the calibration pass has quantized already) by QuantLinear. Returns the count.

    Each layer goes through the stage's registered quantizer with its calibration inputs (`observer`, keys
    relative to `prefix`) as a LayerInputs, which corrects them for the scales an earlier AWQ or SmoothQuant stage
    divided the inputs by (`input_divisor`). Static activation scales and LLM.int8 outlier features come from the
    corrected input maxima; what was found per layer goes into `info[name]`. `tuned` (block-relative name ->
    QuantizedTensor): what a block-level method (AutoRound) made of the block's layers; used instead of `quantize`.
    `clip` (relative name -> range factors): AWQ's clipping for the quantizer's grid (the awq stage's clip_to: grid).
    `output_divisor` (relative name -> s): what a smoothing stage divided the layer's outputs by (output_divisors).
    """
    quantizer = get_quantizer(stage.method)
    jobs: list[_Job] = []
    for entry in plan.quantized:
        if prefix is not None and not entry.name.startswith(prefix + "."):
            continue
        if outside is not None and entry.name.startswith(outside + "."):
            continue
        module = get_module(model, entry.name)
        if isinstance(module, QuantLinear):
            continue
        w = linear_weight(module).detach()
        rel = entry.name[len(prefix) + 1:] if prefix else entry.name
        stats = None if observer is None else observer.stats.get(rel)
        divisor = (input_divisor or {}).get(rel)
        inputs = LayerInputs(entry.name, stats, divisor, (clip or {}).get(rel),
                             out_divisor=(output_divisor or {}).get(rel))
        method, options, expert_info = quantizer, stage.options, {}
        if observer is not None and EXPERT.search(rel):  # a MoE expert: calibrated on the tokens routed to it
            tokens = 0 if stats is None else stats.tokens
            expert_info = {"expert_tokens": tokens}
            weights_need = quantizer.needs_hessian or quantizer.tune_block is not None
            needs_data = weights_need or needs_input_stats(entry.scheme)
            if tokens < stage.min_expert_tokens and needs_data:
                if weights_need:
                    method, options = get_quantizer("rtn"), build_options("rtn", None)
                if needs_input_stats(entry.scheme):
                    inputs = LayerInputs(entry.name, sibling_stats(observer, rel), divisor, (clip or {}).get(rel))
                expert_info["fallback"] = (f"{tokens} calibration tokens < min_expert_tokens "
                                           f"{stage.min_expert_tokens}: " +
                                           ("round-to-nearest weights" if weights_need else "") +
                                           ("; " if weights_need and needs_input_stats(entry.scheme)
                                            else "") +
                                           ("input scale from its sibling experts" if needs_input_stats(entry.scheme)
                                            else ""))
        jobs.append(_Job(entry, module, w, rel, stats, inputs, method, options, expert_info))
    groups = _by_input(jobs)
    if _solve_in_threads(jobs, groups, quantizer, tuned):  # a block's GPTQ solves, one input's layers per worker
        done = run_groups(groups, lambda g: _quantize_group(g, quantizer, tuned), SOLVE_WORKERS,
                          cost=lambda g: sum(j.w.shape[0] * j.w.shape[1] ** 2 for j in g))
        for group, qts in zip(groups, done):
            for job, qt in zip(group, qts):
                _place(model, job, qt, info)
        return len(jobs)
    shared: dict = {}  # what layers reading one input share (GPTQ's factor of their Hessian), one at a time
    for job in jobs:  # each layer replaced as soon as it is quantized: one quantized copy at a time beside the model
        _place(model, job, _quantize_job(job, quantizer, tuned, shared), info)
    return len(jobs)


def output_divisors(block: nn.Module, pairs, input_divisor: dict[str, Tensor]) -> dict[str, Tensor]:
    """Block-relative linear name -> what its outputs are divided by: a smoothing stage that scales a pair whose
    previous op is a linear (v_proj -> o_proj, up_proj -> down_proj) divides that linear's output rows by the s it
    multiplies the balance linears' input columns by, so the two divisors are one (input_divisor, per balance)."""
    out = {}
    for prev, balance, _inspect, _followers in block_pairs(block, pairs):
        if is_linear(block.get_submodule(prev)) and balance[0] in input_divisor:
            out[prev] = input_divisor[balance[0]]
    return out


@dataclass
class _Job:
    """One layer for apply_quantize: the plan's entry, the module and its weight, the calibration inputs and the
    method (round-to-nearest for a MoE expert that saw too few tokens; `expert_info` says so)."""

    entry: Any
    module: nn.Module
    w: Tensor
    rel: str
    stats: Any
    inputs: LayerInputs
    method: Any
    options: Any
    expert_info: dict


def _quantize_job(job: _Job, quantizer, tuned: dict | None, shared: dict):
    """The layer's QuantizedTensor: a block-level method's result where it made one, else the method's."""
    if tuned and job.rel in tuned and job.method is quantizer:
        return tuned[job.rel]
    inputs = dataclasses.replace(job.inputs, shared=shared)
    return job.method.quantize(job.w, job.entry.scheme, job.options, inputs)


def _solve_in_threads(jobs: list[_Job], groups: list[list[_Job]], quantizer, tuned: dict | None) -> bool:
    """Whether the block's layers are quantized on worker threads: GPTQ (whose column loop is many small operations:
    on some CPUs a second torch thread does not speed it up, while a second layer on the second core does) on CPU
    tensors, more than one thread, and layers reading more than one input (`groups`, _by_input)."""
    return (quantizer.needs_hessian and not tuned and torch.get_num_threads() > 1
            and all(j.w.device.type == "cpu" for j in jobs) and len(groups) > 1)


def _by_input(jobs: list[_Job]) -> list[list[_Job]]:
    """The jobs grouped by the statistics object they read (q/k/v, gate/up: one InputStats, so one GPTQ factor)."""
    groups: dict[int, list[_Job]] = {}
    for j in jobs:
        groups.setdefault(id(j.stats) if j.stats is not None else id(j), []).append(j)
    return list(groups.values())


def _quantize_group(group: list[_Job], quantizer, tuned: dict | None) -> list:
    """One worker thread's share: the layers of one input, one factor among them (their own `shared` slot)."""
    shared: dict = {}
    return [_quantize_job(j, quantizer, tuned, shared) for j in group]


def _place(model: nn.Module, job: _Job, qt, info: dict | None) -> None:
    """The layer replaced by its QuantLinear, with what the pass found for it (input scale, outlier features,
    expert coverage) in `info`; an untied lm_head is untied only once it is quantized."""
    entry, module, stats, inputs, expert_info = job.entry, job.module, job.stats, job.inputs, job.expert_info
    untied = entry.untie and is_tied(model, entry.name)
    layer = (TrellisLinear if isinstance(qt, TrellisTensor) else QuantLinear).from_module(module, qt)
    act = entry.scheme.act
    # needed for static schemes (a clear error without calibration), recorded whenever observed
    observed = stats is not None and stats.abs_max is not None
    absmax = inputs.absmax() if needs_input_stats(entry.scheme) or observed else None
    if act is not None and absmax is not None:
        layer_info = {"input_absmax": float(absmax.max())}
        if not act.dynamic:
            layer.input_scale = (absmax.max().clamp(min=1e-8) / act.qmax).float().reshape(())
            layer_info["input_scale"] = float(layer.input_scale)
        if act.outlier_threshold is not None:
            cols = torch.nonzero(absmax >= act.outlier_threshold).reshape(-1)
            layer_info["outlier_features_calibration"] = int(cols.numel())
            if act.outliers == "static":
                layer.outlier_cols = cols.to(layer.qdata.device)
        if info is not None:
            info[entry.name] = layer_info | expert_info
    elif expert_info and info is not None:
        info[entry.name] = expert_info
    if untied:  # only once the head is quantized (an error above leaves the model as it was); afterwards the
        untie_lm_head(model, entry.name)  # model is untied, so a second call finds nothing to untie
        bias = 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
        entry.untied_bytes = qt.nbytes + bias
        entry.note = (f"untied from the input embedding (tied_lm_head: untie): the embedding stays float, so "
                      f"the checkpoint grows by this head's {entry.untied_bytes} bytes")
    set_module(model, entry.name, layer)


def float_lines(stage: dict) -> list[str]:
    """What else stays in float (embeddings, norms, routers, biases, linears left in float), by reason."""
    summary = stage.get("float_parameters") or {}
    if not summary:
        return []
    rows: dict[str, list[int]] = {}
    for why, r in summary.items():  # the linears left in float are listed above, one row each
        key = "the linear layers left in float (above)" if why.startswith("linear left in float") else why
        row = rows.setdefault(key, [0, 0])
        row[0], row[1] = row[0] + r["params"], row[1] + r["elements"]
    lines = ["", "| every other parameter, kept in float | tensors | elements |", "|---|---:|---:|"]
    return lines + [f"| {why} | {n} | {e:,} |" for why, (n, e) in sorted(rows.items(), key=lambda kv: -kv[1][1])]


def expert_lines(stage: dict) -> list[str]:
    """Mixture-of-experts calibration coverage: tokens routed to each expert, and the experts that fell back."""
    experts = stage.get("experts") or {}
    if not experts:
        return []
    lines = ["", f"Calibration tokens routed to each expert (an expert below {stage.get('min_expert_tokens')} "
                 "falls back: round-to-nearest weights, sibling experts' input scale):", "",
             "| experts | tokens per expert | fewest | fell back |", "|---|---|---:|---|"]
    for moe, row in experts.items():
        fell = ", ".join(f"{e}" for e in sorted(row["fallback"], key=int)) or "none"
        lines.append(f"| `{moe}` | {' '.join(str(t) for t in row['tokens'])} | {min(row['tokens'])} | {fell} |")
    return lines


def activation_lines(stage: dict, models: dict) -> list[str]:
    """Quantized-activation facts per layer: calibrated input scale, LLM.int8 outlier features."""
    info = {n: v for n, v in (stage.get("layer_info") or {}).items() if "input_absmax" in v}
    if not info:
        return []
    evals = next((m["llm_int8_outliers"] for m in models.values() if "llm_int8_outliers" in m), {})
    share = next((m["llm_int8_float_share"] for m in models.values() if "llm_int8_float_share" in m), None)
    if any("outlier_features_calibration" in v for v in info.values()):
        lines = ["", "LLM.int8 outlier features (input features computed in float): how many reached the threshold "
                 "anywhere in the calibration data, and, per evaluation window (dynamic mode), the mean and max used; "
                 "float share = the layer's matmul work done in float (outlier features ÷ input features)."]
        if share is not None:
            heavy = sorted(share["layers"].items(), key=lambda kv: -kv[1])
            lines += ["", f"**{share['overall']:.1%} of the LLM.int8 layers' matmul work ran in float** "
                      f"(weighted by layer size); the most: " +
                      ", ".join(f"`{n}` {v:.0%}" for n, v in heavy[:3]) +
                      ". Where that share is large, a layer is mostly a float layer: its accuracy says little about "
                      "int8."]
        lines += ["", "| layer | input max | calibration | eval mean | eval max | float share |",
                  "|---|---:|---:|---:|---:|---:|"]
        for n, v in info.items():
            e = evals.get(n, {})
            f = (share or {}).get("layers", {}).get(n)
            lines.append(f"| `{n}` | {v['input_absmax']:.2f} | {v['outlier_features_calibration']} | "
                         f"{num(e.get('mean'), '{:.1f}')} | {e.get('max', '—')} | {num(f, '{:.1%}')} |")
        return lines
    if any("input_scale" in v for v in info.values()):
        return ["", "| layer | calibrated input max | static input scale |", "|---|---:|---:|"] + \
            [f"| `{n}` | {v['input_absmax']:.3g} | {v['input_scale']:.3g} |" for n, v in info.items()]
    return []
