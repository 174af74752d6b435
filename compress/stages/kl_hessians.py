"""The `kl_hessians` stage: GPTQ against the whole model's loss (issue 50, item 2). Before the calibration pass it
computes, for every layer the next quantize stage will quantize, two Kronecker sides of the layer's KL Hessian (the
Fisher with labels sampled from the model, block by block, precision/output_hessians.py: Σ g gᵀ of the gradients at
the layer's outputs, and the input Hessian with each token weighted by |g|²), writes them to the run's work folder, and points that stage's GPTQ at them
(`options.output_hessians`), which then rounds against tr(ΔW H_in ΔWᵀ H_out) (quantizers/gptq_kron.py):

    - stage: kl_hessians
      n_samples: 32
    - stage: quantize
      method: gptq
      scheme: {dtype: int3, granularity: group, group_size: 64, symmetric: false}

The Hessians are those of the model as it is before the calibration pass (after any rotation, pruning or
distillation before this stage): the original model's KL. A smoothing stage between this stage and the quantize stage
(awq, smoothquant) rescales the layers afterwards; GPTQ takes both sides into the layers' new coordinates
(gptq_kron.as_scaled), so AWQ's scales and its clipping as GPTQ's grid combine with it.

Before a `method: autoround` stage the pass writes, instead of the layers' sides, the Fisher at the output of each
decoder block (hidden × hidden), and AutoRound tunes each block against Δy G Δyᵀ instead of its output's squared
error (quantizers/autoround.py):

    - stage: kl_hessians
    - stage: quantize
      method: autoround
      scheme: {dtype: int2, granularity: group, group_size: 32, symmetric: false}
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arch import ArchSpec
from ..calibrate.data import calibration_windows
from ..core.nn import calibration_dtype, linear_shape
from ..precision.output_hessians import complete, output_hessians, outside_blocks, owning_blocks
from ..quantizers import get_quantizer
from ..quantizers.gptq_kron import kron_problem
from ..threads import cpu_threads
from .base import (MemoryBasis, MemoryPhase, ModelStageContext, Plan, StageBase, StageRecord, next_target,
        work_dir)
from .quantize import plan_quantize

FOLDER = "kl_hessians"  # inside the run's work folder


def _block_sides(q) -> bool:
    """Whether the quantize stage `q` tunes whole blocks (AutoRound), and so reads each block's output side, not its
    layers' two sides."""
    return get_quantizer(q.method).tune_block is not None


@dataclass
class KLHessiansRecord(StageRecord):
    """The kl_hessians stage's report section; resolve_stages reads `folder` back."""

    layers: int
    windows: int
    seq_len: int
    tokens: int
    seed: int
    seconds: float
    reused: bool  # a resumed run found the folder complete
    folder: str
    disk_bytes: int  # the files, Σ (out² + in²) float32 values over the layers (blocks: hidden² per block)
    sides: str = "layers"  # "layers": each layer's two sides (GPTQ, trellis); "blocks": each block's output (AutoRound)


@dataclass(frozen=True)
class KLHessiansStage(StageBase):
    """Recipe entry `- stage: kl_hessians`, right before the `quantize` stage (method gptq or trellis) it feeds."""

    n_samples: int = 32  # calibration windows the Fisher is summed over (each token one sampled label)
    seq_len: int | None = None  # None: the calibration section's
    seed: int = 0  # of the sampled labels

    def __post_init__(self):
        if not isinstance(self.n_samples, int) or self.n_samples < 1:
            raise ValueError(f"kl_hessians: n_samples must be a positive integer, got {self.n_samples!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ValueError(f"kl_hessians: seq_len must be an integer >= 2 (or absent), got {self.seq_len!r}")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "kl_hessians"
    whole_model: ClassVar[bool] = True

    @property
    def needs_calibration(self) -> bool:
        return True

    def stream_problem(self) -> str | None:
        """The pass reads a streamed model's blocks one at a time, like the fisher sensitivity pass."""
        return None

    def check(self, index: int, stages: tuple, calibrated: bool) -> "KLHessiansStage":
        super().check(index, stages, calibrated)
        j = next_target(stages, index)
        q = None if j is None else stages[j]
        if q is None or not hasattr(getattr(q, "options", None), "output_hessians"):
            raise ValueError(f"`stages.{index}` (kl_hessians) feeds the rounding of the quantize stage after it; put a "
                             "`- stage: quantize` with `method: gptq`, `trellis` or `autoround` right after it")
        if later := [s.name for s in stages[index + 1:] if s.whole_model and not s.after_calibration]:
            raise ValueError(f"`stages.{index}` (kl_hessians): {', '.join(later)} after it would change the model "
                             "after its Hessians are taken; put kl_hessians after them, right before the quantize stage")
        if not _block_sides(q):  # AutoRound reads the block's side, on any scheme it takes
            for s in q.schemes:
                if (why := kron_problem(s)) is not None:
                    raise ValueError(f"`stages.{j}` scheme {s.name}: {why}")
        return self

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> str:
        return (f"\nstage {index}: kl_hessians, each layer's KL Hessian in two Kronecker sides (Fisher, sampled labels) "
                f"on {self.n_samples} calibration windows, block by block, for the rounding of the next quantize stage "
                "(float32 files in the run's work folder: out² + in² values per layer; before AutoRound, each "
                "block's output side instead: hidden² values per block)")

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        return [plan.steps[index]], plan.steps[index].strip()

    def memory_phases(self, basis: MemoryBasis) -> list[MemoryPhase]:
        """Every block's input kept for each window, one block's output-side sums, one window's backward through a
        block, the logits at the top; besides the weights or, streamed, one block and the embedding and head. Before
        AutoRound the sums are one hidden² side per block, counted here as the layers' sides (an upper bound: the
        basis does not say which method follows)."""
        if basis.calibration is None:
            return []
        size, width = basis.size, basis.width
        seq_len = self.seq_len or basis.calibration.seq_len
        parts = {"kept states": (size.layers + 2) * self.n_samples * seq_len * size.hidden * width,
                 "one block's KL Hessians": 4 * (size.output_hessian_floats + size.layer_hessian_floats),
                 "one block's backward": 4 * 16 * seq_len * size.input_features,
                 "logits": 3 * 4 * seq_len * size.vocab}
        held = ({"one block": 2 * size.block_parameters * width,
                 "embedding and head": 2 * size.vocab * size.hidden * width} if basis.streamed
                else {"weights": basis.weights})
        return [MemoryPhase("kl hessians", held | parts)]

    def memory_fix(self, parts: dict[str, int]) -> str | None:
        if "one block's KL Hessians" in parts:  # this stage's phase (its kept states are what shrink)
            return "fewer kl_hessians windows (`n_samples`) or a shorter `seq_len`"
        return None

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        q = ctx.stages[next_target(ctx.stages, index)]
        plan = plan_quantize(ctx.model, ctx.arch, q)
        names = [e.name for e in plan.quantized]
        if not names:
            raise ValueError(f"stage {index} (kl_hessians): the quantize stage after it selects no layer")
        if bad := outside_blocks(ctx.model, names):
            raise ValueError(f"stage {index} (kl_hessians): {bad[0]} lies outside the decoder blocks, where the "
                             "output-side Hessians are not computed; add it to the quantize stage's `ignore:`")
        seq_len = self.seq_len or ctx.calibration.seq_len
        folder = work_dir(ctx.out) / FOLDER
        by_block = _block_sides(q)
        if by_block:
            hidden = ctx.model.get_input_embeddings().weight.shape[-1]
            need = 4 * hidden * hidden * len(owning_blocks(ctx.model, names))
        else:
            need = sum(4 * (o * o + i * i) for o, i in (linear_shape(ctx.model.get_submodule(n)) for n in names))
        folder.parent.mkdir(parents=True, exist_ok=True)
        if (free := shutil.disk_usage(folder.parent).free) < need:
            raise ValueError(f"stage {index} (kl_hessians): the layers' KL Hessians take {need / 1e9:.1f} GB on disk "
                             f"beside the output ({folder}), and {free / 1e9:.1f} GB are free; write the run where "
                             "there is room (--output) or quantize fewer layers")
        windows = calibration_windows(ctx.calibration.source(), ctx.tokenizer, ctx.model, self.n_samples, seq_len,
                                      ctx.calibration.seed)
        t0 = time.perf_counter()
        reused = ctx.resume and complete(folder, names, self.seed, int(windows.numel()), by_block)
        if reused:
            ctx.log(f"stage {index}: kl_hessians — reusing the output-side Hessians in {folder}")
        else:
            what = ("the Fisher at each block's output, for AutoRound's loss," if by_block
                    else f"the KL Hessians (two sides) of {len(names)} layers")
            ctx.log(f"stage {index}: kl_hessians — {what} on {self.n_samples} × {seq_len} calibration tokens ...")
            bar = tqdm(desc="kl hessians", unit="step", disable=not ctx.progress, leave=False)

            def progress(what: str, done: int, total: int) -> None:
                bar.total = total
                bar.set_description(what)
                bar.update(done - bar.n)

            try:
                device = ctx.device or ctx.model.get_input_embeddings().weight.device
                dtype = calibration_dtype(ctx.calibration.dtype, device)
                with cpu_threads(ctx.calibration.threads):  # the calibration's threads and matmul dtype
                    output_hessians(ctx.model, windows, names, folder, self.seed, progress, blocks=ctx.blocks,
                                    device=ctx.device, compute_dtype=getattr(torch, dtype), block_sides=by_block)
            finally:
                bar.close()
        return KLHessiansRecord(index, self.name, len(names), int(windows.shape[0]), seq_len, int(windows.numel()),
                                self.seed, time.perf_counter() - t0, reused, str(folder), need,
                                "blocks" if by_block else "layers").to_json()

    def resolve_stages(self, stages: tuple, index: int, section: dict) -> tuple:
        j = next_target(stages, index)
        q = stages[j]
        fed = replace(q, options=replace(q.options, output_hessians=section["folder"]))
        return stages[:j] + (fed,) + stages[j + 1:]

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        how = "reused from an interrupted run" if section.get("reused") else f"{section['seconds']:.1f} s"
        if section.get("sides") == "blocks":
            what, use = "The Fisher at the output of each decoder block", "AutoRound's loss in the next stage"
        else:
            what, use = f"The two sides of {section['layers']} layers' KL Hessians", "the rounding of the next stage"
        return ["", f"## Stage {section['index']}: kl_hessians",
                f"{what} (labels sampled from the model), on {section['windows']} × {section['seq_len']} calibration "
                f"tokens ({how}), for {use}."]
