"""A memory plan before any heavy work: what a run will hold at its peak, predicted from the model's config alone
(no weights read), checked against what the machine has.

A run that cannot fit is refused up front with the settings that would make it fit, instead of being killed by
the kernel minutes later. The figures are estimates of the large terms (weights, the second copies an evaluation or
a distillation holds, the calibration pass's activations and per-block statistics, the evaluation's logits), not
an accounting of every allocation; `model.check_memory: false` runs anyway.
"""
from __future__ import annotations

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


def model_size(config) -> ModelSize:
    """Sizes of the model `config` describes, from a skeleton on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    from ..arch import block_pairs, get_arch
    from ..arch.moe import EXPERT, moe_blocks, unfuse_experts
    from ..core.nn import is_linear, linear_shape

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    unfuse_experts(model)
    arch = get_arch(model)
    blocks = arch.block_list(model)
    per_block = []  # (linears {name: (out, in)}, distinct linear inputs {reader: in}, parameters) of each block
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
    if parts.get("teacher and optimizer"):
        fixes.append("Distillation holds the teacher and AdamW states beside the student: fewer parameters after "
                     "pruning, or distill on a larger machine.")
    return fixes or ["Run on a machine with more memory."]


EVAL_TOKENS = 300_000  # about the WikiText-2 test split's tokens, for eval.max_windows: null


def plan_memory(recipe, config, dtype: torch.dtype, device: str, available: int | None = None,
                device_available: int | None = None, conversion: int = 0, streamed: bool = False) -> MemoryPlan:
    """The run's memory at each phase. `available` (host bytes) defaults to what the machine has free now; on a CUDA
    device, `device_available` to the device's free memory. `conversion`: what loading holds besides the model while
    it converts the checkpoint's tensors to `dtype` (a shard read into memory; `conversion_bytes`), at the load and
    again when the baseline is reloaded for the evaluation."""
    size = model_size(config)
    width = torch.empty((), dtype=dtype).element_size()
    if streamed:
        return _streamed_plan(recipe, size, width, dtype, device, available, device_available)
    weights = size.parameters * width
    target = next((s for s in recipe.stages if getattr(s, "stores_weights", False)), None)
    compressed = weights
    if target is not None:
        sch = target.scheme
        per_weight = sch.bits / 8 + (2 / sch.group_size if sch.granularity == "group" else 0)
        compressed = weights - size.block_linear_parameters * width + int(size.block_linear_parameters * per_weight)
    on_device = device.startswith("cuda")
    # transformers' loader stacks a MoE checkpoint's per-expert tensors into the fused ones: counted as a second
    # copy of the experts while it loads (measured on a 0.68B Mixtral shape: 1.4 GB of 2.4 GB of float32 experts)
    stacking = size.expert_parameters * width
    phases, device_phases = {"load": {"weights": weights, "dtype conversion": conversion,
                                      "expert stacking": stacking}}, {}
    if any(getattr(s, "needs_teacher", False) for s in recipe.stages):
        # the teacher, the student's copy before distillation, gradients and AdamW's two moments (float32); with
        # fsdp over several processes the teacher, gradients and moments are sharded over them (fsdp.py)
        from ..calibrate.distributed import world

        share = world()[1] if any(getattr(s, "fsdp", False) for s in recipe.stages) else 1
        phases["distill"] = {"weights": weights,
                             "teacher and optimizer": weights + (weights + size.parameters * 12) // share}
    if recipe.calibration is not None and any(not s.whole_model for s in recipe.stages):
        cal = recipe.calibration
        acts = 3 * cal.n_samples * cal.seq_len * size.hidden * width  # block inputs, float outputs, compressed outputs
        # a stage's `needs` reads its own settings (the plan argument is for stages that will need more)
        needs = [s.needs(None, i) for i, s in enumerate(recipe.stages) if not s.whole_model]
        stats = 4 * size.hessian_floats if any(n.hessian for n in needs) else 0
        kept = 4 * max((n.replay_samples for n in needs), default=0) * cal.seq_len * size.input_features
        work = {"calibration activations": 0 if cal.offload == "disk" else acts, "block statistics": stats + kept,
                "GPTQ solve": 4 * size.largest_solve if stats else 0,
                "block tuning": tuning_bytes(size, cal.seq_len) if any(n.block_tuning for n in needs) else 0}
        if on_device:
            phases["calibration"] = {"weights": weights}
            device_phases["calibration"] = {"one block": size.block_parameters * width, **work}
        else:
            phases["calibration"] = {"weights": weights, **work}
    if sensitivity := sensitivity_bytes(size, recipe, width):
        phases["sensitivity pass"] = {"weights": weights, **sensitivity}
    tune = next((s for s in recipe.stages if getattr(s, "after_calibration", False)), None)
    if tune is not None and recipe.calibration is not None:
        phases["tune_scales"] = {"compressed model": compressed, "teacher": weights,
                                 **tune_scales_bytes(size, tune, recipe.calibration.seq_len)}
    logits = 4 * 4 * recipe.eval.seq_len * size.vocab  # both models' float32 logits and their log-softmax
    evaluation = {"compressed model": compressed, "baseline copy": weights if recipe.eval.baseline else 0,
                  "dtype conversion": conversion if recipe.eval.baseline else 0,
                  "expert stacking": stacking if recipe.eval.baseline else 0, "logits": logits}
    if any(getattr(s, "needs_teacher", False) for s in recipe.stages):
        evaluation["pruned copy"] = compressed
    phases["evaluation"] = {k: v for k, v in evaluation.items() if v}
    if on_device:  # the evaluation runs there (pipeline.on_device): every evaluated model, and the logits
        device_phases["evaluation"] = {k: v for k, v in evaluation.items()
                                       if v and k not in ("dtype conversion", "expert stacking")}
    phases = {name: {"runtime": RUNTIME, **{k: v for k, v in parts.items() if v}} for name, parts in phases.items()}
    if available is None:
        available = psutil.virtual_memory().available
    if on_device and device_available is None and torch.cuda.is_available():
        device_available = torch.cuda.mem_get_info(torch.device(device))[0]
    return MemoryPlan(device, str(dtype).replace("torch.", ""), phases, device_phases, available, device_available)


def _streamed_plan(recipe, size: ModelSize, width: int, dtype, device: str, available, device_available) -> MemoryPlan:
    """A streamed run (stream_run.py): one block (and its dequantized copy while its compressed forward runs), the
    calibration activations and statistics, both models' evaluation hidden states; before and after the blocks, the
    embedding (to capture the blocks' inputs) or the head (to score), one at a time, and the logits."""
    ev = recipe.eval
    windows = (ev.max_windows or EVAL_TOKENS // ev.seq_len) if ev.perplexity else 0
    hidden = (2 if ev.baseline else 1) * windows * ev.seq_len * size.hidden * width
    # one block at the run's dtype, its bfloat16 copies under autocast, its dequantized copy during the compressed
    # forward, the tensors being read and the allocator's slack: 3.5x its weights (bench/large_models.py measured
    # 3.3x on the 7B shape at float32: 3.28 GB anonymous peak, of which 2.7 GB came with the block)
    passing = {"one block": int(3.5 * size.block_parameters * width), "evaluation hidden states": hidden}
    if recipe.calibration is not None:
        cal = recipe.calibration
        acts = 3 * cal.n_samples * cal.seq_len * size.hidden * width
        needs = [s.needs(None, i) for i, s in enumerate(recipe.stages) if not s.whole_model]
        stats = 4 * size.hessian_floats if any(n.hessian for n in needs) else 0
        kept = 4 * max((n.replay_samples for n in needs), default=0) * cal.seq_len * size.input_features
        passing.update({"calibration activations": 0 if cal.offload == "disk" else acts, "block statistics": stats + kept,
                        "block tuning": tuning_bytes(size, cal.seq_len) if any(n.block_tuning for n in needs) else 0})
    phases = {"streamed pass": passing}
    if recipe.calibration is not None and stats:
        # between the block's forwards: its float weights (no autocast or dequantized copies then), the statistics,
        # and one GPTQ solve at a time: the layer's H/n, its weight being updated, the lazy update (quantizers/gptq.py)
        phases["GPTQ solve"] = {**passing, "one block": size.block_parameters * width,
                                "GPTQ solve": 4 * size.largest_solve}
    if sensitivity := sensitivity_bytes(size, recipe, width):
        phases["sensitivity pass"] = {"one block": 2 * size.block_parameters * width,
                                      "embedding and head": 2 * size.vocab * size.hidden * width, **sensitivity}
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


def sensitivity_bytes(size: ModelSize, recipe, width: int) -> dict[str, int]:
    """The recipe's auto_precision fisher pass block by block (fisher_blocks.py; empty without one), besides the
    weights or the streamed block:
    every block's input kept for each window (and, with solved errors, the gradient at every block's output), one
    window's output errors of a block's layers under every option, the autograd graph of one block's forward, the
    logits at the top; with solved errors also the Hessians of a group of layers (precision.HESSIAN_BUDGET, or the
    widest layer's alone), the menu's solutions for one block and the Hessian windows' states."""
    from ..precision.mixed import HESSIAN_BUDGET

    stage = next((s for s in recipe.stages if s.name == "auto_precision"), None)
    if stage is None or recipe.calibration is None:
        return {}
    seq_len = stage.seq_len or recipe.calibration.seq_len
    solved = stage.error_method != "rtn"
    options = len(stage.options)
    parts = {"kept states": (size.layers + 1) * stage.n_samples * seq_len * size.hidden * width * (2 if solved else 1),
             "output errors": 4 * options * seq_len * size.output_features,
             "one block's backward": 4 * 16 * seq_len * size.input_features,
             "logits": 3 * 4 * seq_len * size.vocab}
    if solved:
        per_weight = sum(2 if o is None else o.bits / 8 + (4 / o.group_size if o.granularity == "group" else 0)
                         for o in stage.options)
        parts.update({"Hessians": min(4 * size.layer_hessian_floats,
                                      max(HESSIAN_BUDGET, 4 * size.largest_hessian_floats)),
                      "one block's solutions": int(per_weight * size.block_linear_parameters / max(size.layers, 1)),
                      "Hessian windows": 2 * stage.gptq_samples * seq_len * size.hidden * width})
    return parts


def tuning_bytes(size: ModelSize, seq_len: int) -> int:
    """AutoRound's tuning of one block (quantizers/autoround.py): per weight, float32 V, its gradient and the best
    step's copy, the float32 weight and about five weight-sized temporaries of the rounding that autograd keeps for
    the backward (36 bytes in all); and one window's forward saved for its backward, about 16 float32 values per
    token and input feature."""
    return 36 * size.block_parameters + 4 * 16 * seq_len * size.input_features


def tune_scales_bytes(size: ModelSize, stage, seq_len: int) -> dict[str, int]:
    """The tune_scales stage beside both models: each linear's dequantized weight (float32, and its bfloat16 copy
    under autocast) kept for the backward, in every block or, with gradient checkpointing, in one block at a time;
    one step's activations, about 6 float32 values per token and input feature of a block (with checkpointing:
    one block's, plus every block's input); both models' float32 logits and their log-softmax and gradient.
    Measured on the embedded model (4 × 512 tokens a step, bf16 autocast): 6.9 GB peak RSS, where this plans 8.3 GB
    (the activations, about 5 values per token and feature, are most of it)."""
    tokens = stage.batch_size * seq_len
    blocks = 1 if stage.gradient_checkpointing else size.layers
    kept = 4 * tokens * size.hidden * size.layers if stage.gradient_checkpointing else 0
    return {"dequantized weights": 6 * size.block_linear_parameters * blocks // size.layers,
            "activations": 4 * 6 * tokens * size.input_features * blocks + kept,
            "logits": 4 * 4 * tokens * size.vocab}


def conversion_bytes(files: list, config, dtype: torch.dtype) -> int:
    """Loading a safetensors checkpoint at its own dtype maps the files (pages the kernel can drop); converting it to
    another dtype reads a shard's tensors into memory first: the largest shard (measured: a 0.5B bf16 checkpoint
    loaded as float32 held 4.2 GB of anonymous memory at its peak, the float32 copies plus the bf16 file)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    if not files or stored is None or stored == dtype:
        return 0
    return max(f.stat().st_size for f in files)
