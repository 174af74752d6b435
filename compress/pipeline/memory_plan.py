"""A memory plan before any heavy work: what a run will hold at its peak, predicted from the model's config alone
(no weights read), checked against what the machine has.

A run that cannot fit is refused up front with the settings that would make it fit, instead of being killed by
the kernel minutes later. The figures are estimates of the large terms (weights, the second copies an evaluation or
a distillation holds, the calibration pass's activations and per-block statistics, the evaluation's logits), not
an accounting of every allocation; `model.check_memory: false` runs anyway.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import psutil
import torch

GB = 1e9
# a run is refused when its predicted peak times this exceeds what is available: bench/memory_plan_check.py measured
# the prediction at 0.94x of the peak anonymous memory in the worst case (a bf16 checkpoint loaded as float32)
MARGIN = 1.1
RUNTIME = int(0.5 * GB)  # the process before any model: Python, torch, transformers, a tokenizer (0.39 GB measured)


@dataclass(frozen=True)
class ModelSize:
    """What the plan needs to know about a model, read from its config on the meta device."""

    parameters: int
    block_linear_parameters: int  # weights of the linear layers inside the decoder blocks (what quantize stores)
    block_parameters: int  # one decoder block
    hessian_floats: int  # one block's Hessians: K² per distinct linear input (q/k/v, gate/up share theirs)
    input_features: int  # one block's distinct linear inputs, summed (kept replay samples are this wide)
    largest_solve: int  # floats a GPTQ solve holds beside the statistics: max over linears of K² + 2·out·K
    hidden: int
    vocab: int
    layers: int
    expert_parameters: int = 0  # a mixture of experts' expert weights (transformers' loader stacks them)
    output_features: int = 0  # one block's linear outputs, summed (the fisher pass's output errors are this wide)
    layer_hessian_floats: int = 0  # one block's Hessians, one per linear (the sensitivity pass does not share them)
    largest_hessian_floats: int = 0  # the widest linear input's K²
    # two GPTQ solves at once (stages/quantize.py: two inputs' layers on two worker threads on a CPU): the largest
    # sum, over blocks, of two distinct inputs' K² + 2·out·K (the widest layer reading each)
    two_solves: int = 0
    block_linear_sides: int = 0  # Σ (out + in) over the block linears: a rank-1 term of each (eora) holds this many
    output_hessian_floats: int = 0  # one block's output-side Hessians, out² per linear (the kl_hessians pass)


def model_size(config) -> ModelSize:
    """Sizes of the model `config` describes, from a skeleton on the meta device (nothing allocated)."""
    from ..arch import auto_model_class, block_pairs, get_arch
    from ..arch.moe import EXPERT, moe_blocks, unfuse_experts
    from ..core.nn import is_linear, linear_shape

    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    unfuse_experts(model)
    arch = get_arch(model)
    config = config.get_text_config()  # a vision-language model's sizes: its language model's
    blocks = arch.block_list(model)
    per_block = []  # (linears {name: (out, in)}, distinct linear inputs {reader: in}, parameters) of each block
    two_solves = []  # each block's two largest GPTQ solves (of distinct inputs), summed
    for block in blocks:
        linears = {n: linear_shape(m) for n, m in block.named_modules() if n and is_linear(m)}
        shared = {}  # linears reading one tensor share a Hessian: a pair's balance linears (one expert's at a time)
        for prev, balance, _, _ in block_pairs(block, arch.awq):
            first: dict = {}  # an expert's gate/up read the tokens routed to it: one Hessian per expert
            for n in balance:
                m = EXPERT.search(n)
                shared[n] = first.setdefault(m.group(0) if m else None, n)
        readers = {shared.get(n, n): k for n, (_, k) in linears.items()}
        per_block.append((linears, readers, sum(p.numel() for p in block.parameters())))
        solves: dict = {}  # each distinct input's GPTQ solve: K² + 2·out·K of the widest layer reading it
        for n, (o, k) in linears.items():
            solves[shared.get(n, n)] = max(solves.get(shared.get(n, n), 0), k * k + 2 * o * k)
        two_solves.append(sum(sorted(solves.values(), reverse=True)[:2]))
    seen: set = set()
    params = sum(p.numel() for p in model.parameters() if not (id(p) in seen or seen.add(id(p))))
    return ModelSize(
        parameters=params,
        block_linear_parameters=sum(o * i for lin, _, _ in per_block for o, i in lin.values()),
        block_parameters=max(n for _, _, n in per_block),
        hessian_floats=max(sum(k * k for k in r.values()) for _, r, _ in per_block),
        input_features=max(sum(r.values()) for _, r, _ in per_block),
        largest_solve=max((i * i + 2 * o * i for lin, _, _ in per_block for o, i in lin.values()), default=0),
        hidden=int(getattr(config, "hidden_size", None) or getattr(config, "n_embd")),
        vocab=int(config.vocab_size),
        layers=len(blocks),
        expert_parameters=sum(p.numel() for m in moe_blocks(model).values() for p in m.parameters()),
        output_features=max(sum(o for o, _ in lin.values()) for lin, _, _ in per_block),
        layer_hessian_floats=max(sum(i * i for _, i in lin.values()) for lin, _, _ in per_block),
        largest_hessian_floats=max((i * i for lin, _, _ in per_block for _, i in lin.values()), default=0),
        two_solves=max(two_solves, default=0),
        block_linear_sides=sum(o + i for lin, _, _ in per_block for o, i in lin.values()),
        output_hessian_floats=max(sum(o * o for o, _ in lin.values()) for lin, _, _ in per_block),
    )


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    dtype: str
    phases: dict  # phase -> {what: bytes}, host memory
    device_phases: dict  # phase -> {what: bytes}, accelerator memory (empty on a CPU run)
    available: int | None  # host memory available when the run starts
    device_available: int | None

    @staticmethod
    def _peak(phases: dict) -> tuple[str, int]:
        return max(((name, sum(parts.values())) for name, parts in phases.items()), key=lambda x: x[1],
                   default=("", 0))

    @property
    def peak(self) -> tuple[str, int]:
        return self._peak(self.phases)

    def lines(self) -> list[str]:
        name, peak = self.peak
        have = f"{self.available / GB:.1f} GB available" if self.available is not None else "available unknown"
        out = [f"memory plan (estimate, {self.dtype} weights): host peak {peak / GB:.2f} GB during {name}; {have}"]
        for phase, parts in self.phases.items():
            out.append(f"  {phase}: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in parts.items()))
        if self.device_phases:
            dname, dpeak = self._peak(self.device_phases)
            free = f"{self.device_available / GB:.1f} GB free" if self.device_available is not None else ""
            out.append(f"  {self.device}: peak {dpeak / GB:.2f} GB during {dname}; {free}")
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_phase": self.peak[0], "peak_bytes": self.peak[1]}

    def problem(self, recipe) -> str | None:
        """Why the run cannot fit, with the settings that would make it fit; None when it fits."""
        name, peak = self.peak
        if self.available is not None and peak * MARGIN > self.available:
            return (f"this run needs about {peak / GB:.1f} GB of host memory at its peak ({name}; refused above "
                    f"{self.available / MARGIN / GB:.1f} GB, a {MARGIN - 1:.0%} margin) and "
                    f"{self.available / GB:.1f} GB are available. " + " ".join(_fixes(recipe, self.phases[name], self.dtype)) +
                    " Or set model.check_memory=false to run anyway (the plan is an estimate).")
        if self.device_phases and self.device_available is not None:
            dname, dpeak = self._peak(self.device_phases)
            if dpeak > self.device_available:
                fix = "set eval.baseline=false (no KL or top-1 then) or lower eval.seq_len" if dname == "evaluation" \
                    else "lower calibration.n_samples or calibration.seq_len"
                return (f"this run needs about {dpeak / GB:.1f} GB on {self.device} ({dname}) and "
                        f"{self.device_available / GB:.1f} GB are free. {fix[0].upper() + fix[1:]}, or set "
                        "model.check_memory=false to run anyway.")
        return None


def _fixes(recipe, parts: dict, plan_dtype: str) -> list[str]:
    fixes = []
    if recipe.model.dtype == "float32" or (recipe.model.dtype == "auto" and plan_dtype == "float32"):
        fixes.append("model.dtype=bfloat16 halves every copy of the model (they are float32 now).")
    if parts.get("baseline copy"):
        fixes.append(f"eval.baseline=false drops the reloaded original ({parts['baseline copy'] / GB:.1f} GB; no KL "
                     "or top-1 then).")
    if parts.get("calibration activations", 0) > 0.1 * sum(parts.values()):
        fixes.append("calibration.offload=disk keeps the activations in memory-mapped files (they take "
                     f"{parts['calibration activations'] / GB:.1f} GB), or lower calibration.n_samples / seq_len.")
    fixes += list(dict.fromkeys(f for s in recipe.stages if (f := s.memory_fix(parts)) is not None))
    return fixes or ["Run on a machine with more memory."]


EVAL_TOKENS = 300_000  # about the WikiText-2 test split's tokens, for eval.max_windows: null


def plan_memory(recipe, config, dtype: torch.dtype, device: str, available: int | None = None,
                device_available: int | None = None, conversion: int = 0, streamed: bool = False) -> MemoryPlan:
    """The run's memory at each phase. `available` (host bytes) defaults to what the machine has free now; on a CUDA
    device, `device_available` to the device's free memory. `conversion`: what loading holds besides the model while
    it converts the checkpoint's tensors to `dtype` (a shard read into memory; `conversion_bytes`), at the load and
    again when the baseline is reloaded for the evaluation. What a stage adds (its weights as stored, its share of
    the calibration pass, its own phases) each stage answers itself (stages/base.py: stored_bytes, pass_memory,
    memory_phases)."""
    from ..stages.base import MemoryBasis

    size = model_size(config)
    width = torch.empty((), dtype=dtype).element_size()
    basis = MemoryBasis(size, width, recipe.calibration, streamed, device=device)
    weights = basis.weights
    added = sum(s.added_bytes(basis) for s in recipe.stages)
    compressed = next((b for s in recipe.stages if (b := s.stored_bytes(basis)) is not None), weights) + added
    basis = dataclasses.replace(basis, compressed=compressed, added=added)
    if streamed:
        return _streamed_plan(recipe, basis, dtype, device, available, device_available)
    before, after, into = _stage_phases(recipe, basis, ("load", "calibration", "evaluation"))
    on_device = device.startswith("cuda")
    # transformers' loader stacks a MoE checkpoint's per-expert tensors into the fused ones: counted as a second
    # copy of the experts while it loads (measured on a 0.68B Mixtral shape: 1.4 GB of 2.4 GB of float32 experts)
    stacking = size.expert_parameters * width
    phases, device_phases = {"load": _grown({"weights": weights, "dtype conversion": conversion,
                                             "expert stacking": stacking}, into.get("load"))}, {}
    phases |= before
    if recipe.calibration is not None and any(not s.whole_model for s in recipe.stages):
        cal = recipe.calibration
        acts = 3 * cal.n_samples * cal.seq_len * size.hidden * width  # block inputs, float outputs, compressed outputs
        stats, during, between = _pass_memory(recipe, basis)
        work = _grown({"calibration activations": 0 if cal.offload == "disk" else acts, "block statistics": stats,
                       **between, **during}, into.get("calibration"))
        if on_device:
            phases["calibration"] = {"weights": weights}
            device_phases["calibration"] = {"one block": size.block_parameters * width, **work}
        else:
            phases["calibration"] = {"weights": weights, **work}
    phases |= after
    logits = 4 * 4 * recipe.eval.seq_len * size.vocab  # both models' float32 logits and their log-softmax
    if available is None:
        available = psutil.virtual_memory().available
    if on_device and device_available is None and torch.cuda.is_available():
        device_available = torch.cuda.mem_get_info(torch.device(device))[0]
    evaluation = _grown({"compressed model": compressed, "baseline copy": weights if recipe.eval.baseline else 0,
                         "dtype conversion": conversion if recipe.eval.baseline else 0,
                         "expert stacking": stacking if recipe.eval.baseline else 0, "logits": logits},
                        into.get("evaluation"))
    # the quantized layers dequantized once for the perplexity windows and samples where the copy fits in half of
    # what the evaluation leaves free (core/nn.py: dequantized_if_room, the same rule)
    dequantized = size.block_linear_parameters * width if any(s.stores_weights for s in recipe.stages) else 0
    free = device_available if on_device else available
    if free is not None and dequantized > (free - RUNTIME - sum(evaluation.values())) // 2:
        dequantized = 0
    evaluation["dequantized weights"] = dequantized
    phases["evaluation"] = {k: v for k, v in evaluation.items() if v and not (on_device and k == "dequantized weights")}
    if on_device:  # the evaluation runs there (pipeline.on_device): every evaluated model, and the logits
        device_phases["evaluation"] = {k: v for k, v in evaluation.items()
                                       if v and k not in ("dtype conversion", "expert stacking")}
    phases = {name: {"runtime": RUNTIME, **{k: v for k, v in parts.items() if v}} for name, parts in phases.items()}
    return MemoryPlan(device, str(dtype).replace("torch.", ""), phases, device_phases, available, device_available)


def _largest(parts: list[dict[str, int]]) -> dict[str, int]:
    """The parts of several stages together: where they name the same thing, the largest (one allocation)."""
    out: dict[str, int] = {}
    for each in parts:
        for k, v in each.items():
            out[k] = max(out.get(k, 0), v)
    return out


def _grown(parts: dict[str, int], extra: dict[str, int] | None) -> dict[str, int]:
    """A runner phase's parts with what the stages add to it (the largest where both name a part)."""
    return _largest([parts, extra or {}])


def _stage_phases(recipe, basis, runner: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """The stages' phases (stage.memory_phases) as (before the calibration pass, after it, added to the runner's
    phases named in `runner`), each {phase: {what: bytes}}."""
    before: dict[str, list] = {}
    after: dict[str, list] = {}
    into: dict[str, list] = {}
    for stage in recipe.stages:
        for phase in stage.memory_phases(basis):
            where = into if phase.name in runner else after if phase.after_pass else before
            where.setdefault(phase.name, []).append(phase.parts)
    return tuple({name: _largest(parts) for name, parts in where.items()} for where in (before, after, into))


def _pass_memory(recipe, basis) -> tuple[int, dict[str, int], dict[str, int]]:
    """What the block stages hold in the calibration pass (stage.pass_memory): the statistics it records for them
    (each recorded once for every stage that asks), their work during the block's forwards and between them."""
    asked = [s.pass_memory(basis) for s in recipe.stages if not s.whole_model]
    return (sum(_largest([a.statistics for a in asked]).values()), _largest([a.during for a in asked]),
            _largest([a.between for a in asked]))


def _streamed_plan(recipe, basis, dtype, device: str, available, device_available) -> MemoryPlan:
    """A streamed run (pipeline/streamed.py): one block (and its dequantized copy while its compressed forward runs), the
    calibration activations and statistics, both models' evaluation hidden states; before and after the blocks, the
    embedding (to capture the blocks' inputs) or the head (to score), one at a time, and the logits. A stage's work
    between the block's forwards (GPTQ's solve) is a phase of its own, with the block's float weights alone."""
    size, width = basis.size, basis.width
    ev = recipe.eval
    windows = (ev.max_windows or EVAL_TOKENS // ev.seq_len) if ev.perplexity else 0
    hidden = (2 if ev.baseline else 1) * windows * ev.seq_len * size.hidden * width
    # one block at the run's dtype, its bfloat16 copies under autocast, its dequantized copy during the compressed
    # forward, the tensors being read and the allocator's slack: 3.5x its weights (bench/large_models.py measured
    # 3.3x on the 7B shape at float32: 3.28 GB anonymous peak, of which 2.7 GB came with the block)
    passing = {"one block": int(3.5 * size.block_parameters * width), "evaluation hidden states": hidden,
               # the next block, read on a helper thread while this one computes (StreamedBlocks), as stored:
               # counted at 16 bits, the dtype checkpoints are published in
               "next block (read ahead)": size.block_parameters * min(width, 2)}
    if recipe.output.save_model:
        # the block before, its tensors as stored, written to the shards on a helper thread while this one computes
        # (ShardWriter.add_behind): a block's share of the compressed model
        passing["previous block (being written)"] = int(size.block_parameters * width * basis.compressed /
                                                        max(basis.weights, 1))
    between = {}
    if recipe.calibration is not None:
        cal = recipe.calibration
        acts = 3 * cal.n_samples * cal.seq_len * size.hidden * width
        stats, during, between = _pass_memory(recipe, basis)
        passing.update({"calibration activations": 0 if cal.offload == "disk" else acts, "block statistics": stats,
                        **during})
    before, after, _ = _stage_phases(recipe, basis, ())
    phases = {**before, "streamed pass": passing}
    if any(between.values()):
        # between the block's forwards: its float weights (no autocast or dequantized copies then), the statistics,
        # and the stages' work there (GPTQ: one solve at a time)
        phases[" and ".join(k for k, v in between.items() if v)] = {**passing, "one block": size.block_parameters * width,
                                                                    **between}
    phases |= after
    phases |= {
        "embedding or head": {"embedding or head": size.vocab * size.hidden * width,
                              "evaluation hidden states": hidden,
                              "logits": 4 * 4 * ev.seq_len * size.vocab if windows else 0}}
    phases = {name: {"runtime": RUNTIME, **{k: v for k, v in parts.items() if v}} for name, parts in phases.items()}
    if available is None:
        available = psutil.virtual_memory().available
    if device.startswith("cuda") and device_available is None and torch.cuda.is_available():
        device_available = torch.cuda.mem_get_info(torch.device(device))[0]
    return MemoryPlan(device, str(dtype).replace("torch.", "") + ", streamed", phases, {}, available,
                      device_available)


def conversion_bytes(files: list, config, dtype: torch.dtype) -> int:
    """Loading a safetensors checkpoint at its own dtype maps the files (pages the kernel can drop); converting it to
    another dtype reads a shard's tensors into memory first: the largest shard (measured: a 0.5B bf16 checkpoint
    loaded as float32 held 4.2 GB of anonymous memory at its peak, the float32 copies plus the bf16 file)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    if not files or stored is None or stored == dtype:
        return 0
    return max(f.stat().st_size for f in files)
