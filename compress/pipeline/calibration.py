"""What the in-memory run (resident.py) and the streamed run (streamed.py) share: the calibration pass with the
block stages (`compress_model`), the report's header and files."""
from __future__ import annotations

import contextlib
import datetime
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..calibrate.distributed import (active, check_stages, local_keep, reduce_stats, share, start as start_processes,
        world)
from ..arch import block_pairs
from ..calibrate.blockwise import BlockPass, run_blockwise
from ..calibrate.data import calibration_windows, fingerprint
from ..calibrate.images import ImageSamples, image_samples, load_processor
from ..measure.plots import plot_recovery
from .report import write_report
from ..core.nn import QuantLinear, calibration_dtype, is_linear  # noqa: F401 (calibration_dtype: the pass's, here too)
from ..core.profile import Profile, device_sync, phase_of
from ..calibrate.observers import BlockObserver
from ..recipe import Recipe, to_plain
from ..model.streaming import trim_heap
from ..stages.base import BlockState, Plan, RunContext
from ..threads import set_threads


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"output folder {out} exists; pass --overwrite (or output.overwrite: true) to replace it, "
                              "or choose another output.dir")


def calibration_samples(recipe: Recipe, model, tokenizer) -> tuple[torch.Tensor | ImageSamples, dict]:
    """The calibration samples (text windows [n, seq_len], or a vision-language model's image-caption samples for
    kind images) and the report's `calibration` section."""
    cal = recipe.calibration
    if cal.kind == "images":
        samples = image_calibration(recipe, model)
    else:
        samples = calibration_windows(cal.source(), tokenizer, model, cal.n_samples, cal.seq_len, cal.seed)
    info = {k: v for k, v in asdict(cal).items() if v not in (None, ())}
    if cal.texts:  # the documents themselves stay out of the report: their count (and the windows' fingerprint)
        info["texts"] = f"{len(cal.texts)} documents"
    if isinstance(samples, ImageSamples):  # each sample at its own length: seq_len does not apply
        info.pop("seq_len", None)
        info.update(fingerprint=samples.fingerprint(), tokens=samples.tokens, images=samples.names)
    else:
        info.update(fingerprint=fingerprint(samples), tokens=int(samples.numel()))
    return samples, info


def image_calibration(recipe: Recipe, model) -> ImageSamples:
    """Kind images: the folder's image-caption pairs rendered by the model's processor (calibrate/images.py);
    refused for a text-only model and for a model folder without a processor."""
    from ..arch.vlm import is_vision_language
    if not is_vision_language(model.config):
        raise ValueError(f"calibration kind 'images' is for a vision-language model (Qwen2.5-VL, Qwen3-VL, Gemma 3, "
                         f"Llama 3.2 Vision, Mistral 3); {recipe.model.source} is a text-only "
                         f"{getattr(model.config, 'model_type', '?')} model: calibrate it on text")
    cal = recipe.calibration
    return image_samples(cal.folder, load_processor(recipe.model.source), cal.n_samples, cal.seed)


class StagePass:
    """The block stages of a plan inside the calibration pass: per block, what to observe during its float forward
    (the statistics the stages' `needs` ask for, of the layers the plan quantizes, plus each stage's own
    `observing`), then each stage's `on_block` in recipe order."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.stages = [(i, ctx.plan.stages[i]) for i in ctx.plan.block_stages]
        self.needs = ctx.plan.needs()
        self.observed = ctx.plan.observed_layers()  # only the layers a stage will use statistics of

    def observe(self, i: int, prefix: str, block) -> "_Observing":
        linears = [n for n, m in block.named_modules() if n and is_linear(m) and not isinstance(m, QuantLinear)
                   and f"{prefix}.{n}" in self.observed]
        observer = None
        if linears and self.needs.any:
            nd = self.needs
            inspect = sorted({p[2] for p in block_pairs(block, self.ctx.arch.awq)}) if nd.replay_samples else []
            # with several processes, each keeps its own windows among the first replay_samples of all windows
            keep = local_keep(nd.replay_samples, *world()) if active() else nd.replay_samples
            observer = BlockObserver(block, linears, inspect, abs_mean=nd.abs_mean, hessian=nd.hessian,
                                     keep_samples=keep, abs_max=nd.abs_max)
            observer.profile = self.ctx.profile
        state = BlockState(i, prefix, block, observer)
        return _Observing(state, ([observer] if observer is not None else []) +
                          [stage.observing(state, k) for k, stage in self.stages])

    def on_block(self, _i: int, _prefix: str, _block, _inputs, observing: "_Observing") -> None:
        if observing.state.observer is not None and active():  # every rank: all ranks' windows
            reduce_stats(observing.state.observer)
        for k, stage in self.stages:
            stage.on_block(self.ctx, observing.state, k)


class _Observing:
    """The context managers active during one block's float forward, and the block's state for the stages."""

    def __init__(self, state: BlockState, contexts: list):
        self.state, self.contexts = state, contexts
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "_Observing":
        for c in self.contexts:
            self._stack.enter_context(c)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


def start_stages(model, plan: Plan) -> RunContext:
    """The run context, after each block stage's `begin` (before the calibration pass, or instead of it)."""
    ctx = RunContext(model, plan)
    for i in plan.block_stages:
        plan.stages[i].begin(ctx, i)
    return ctx


def kept_in_float(model) -> list[str]:
    """Weight-holding modules outside the linear layers (embeddings, norms, MoE routers), and the parameters of
    recurrent layers besides their linears (Mamba's A_log, D, dt_bias, its convolution): reported, never silent."""
    from ..arch.mixers import float_reason
    from ..arch.moe import ROUTER_REASON, router_names
    routers = router_names(model)
    kinds: dict[tuple[str, str], int] = {}
    for name, m in model.named_modules():
        if is_linear(m):
            continue
        if not list(m.children()) and isinstance(getattr(m, "weight", None), torch.Tensor):
            why = ROUTER_REASON if name in routers else \
                float_reason(m, "weight") or "weight-only integer schemes apply to linear layers"
            kinds[type(m).__name__, why] = kinds.get((type(m).__name__, why), 0) + 1
            continue
        for p_name, _ in m.named_parameters(recurse=False):  # a recurrent layer's own (its children: above)
            if why := float_reason(m, p_name):
                key = (f"{type(m).__name__}.{p_name}", why)
                kinds[key] = kinds.get(key, 0) + 1
    return [f"{n}× {k} ({why})" for (k, why), n in sorted(kinds.items())]


@dataclass(frozen=True)
class PassExtras:
    """What a run gives compress_model beyond the model, its plan and where to compute. `model_reports`: the report
    sections of the whole-model stages that ran before, by stage index. `spill_dir`: where calibration activations
    go with calibration.offload: disk (a temporary folder inside it). `blocks` (a streamed model's block source, see
    blockwise.BlockPass) makes the pass run even without calibration data: the stages then act on each block as it
    is read, and `visitors` ride along. `checkpoint` (streamed.StreamCheckpoint) saves the pass after every block
    and resumes it at the block where an interrupted run stopped. `profile`: see the field."""
    model_reports: dict = field(default_factory=dict)
    spill_dir: Path | None = None
    blocks: object = None
    visitors: tuple = ()
    checkpoint: object = None
    profile: Profile | None = None  # the run's (core/profile.py): the pass's phases are timed into it


def compress_model(model, tokenizer, recipe: Recipe, plan: Plan, device: str, progress: bool = True, log=print,
                   extras: PassExtras = PassExtras()) -> tuple[dict, torch.Tensor | None]:
    """The recipe's calibration pass and block stages, applied to `model` in place (the whole-model stages, prune
    and distill, have run before). Returns the report's `calibration`, `block_errors`, `stages` and `kept_in_float`
    sections, and the calibration windows (None without a calibration pass). `extras`: see PassExtras."""
    model_reports, spill_dir, blocks = extras.model_reports, extras.spill_dir, extras.blocks
    visitors, checkpoint = extras.visitors, extras.checkpoint
    sections: dict = {}
    samples = None
    ctx = start_stages(model, plan)
    ctx.profile = profile = extras.profile
    start, restore = 0, None
    if checkpoint is not None:
        start, restore = checkpoint.bind(ctx), checkpoint.restore
        visitors = (*visitors, checkpoint)
    calibrate = recipe.calibration is not None and bool(plan.block_stages)
    if calibrate or blocks is not None:
        if calibrate:
            log("preparing calibration data ...")
            with phase_of(profile, "calibration data"):
                samples, sections["calibration"] = calibration_samples(recipe, model, tokenizer)
            set_threads(recipe.calibration.threads)
            rank, size = start_processes(device)
            if size > 1:
                if isinstance(samples, ImageSamples):
                    raise ValueError("calibration kind 'images' runs in one process (its samples differ in length); "
                                     "run without data-parallel processes")
                check_stages(plan)
                sections["calibration"]["processes"] = size
                log(f"data-parallel calibration: process {rank} of {size} takes every {size}th window")
            dtype = calibration_dtype(recipe.calibration.dtype, device)
            sections["calibration"]["compute_dtype"] = dtype
            size_text = f"{len(samples)} image-caption samples, {samples.tokens} tokens" if \
                isinstance(samples, ImageSamples) else f"{samples.shape[0]} × {samples.shape[1]} tokens"
            log(f"calibrating block by block on {device} ({size_text}, "
                f"{dtype} matmuls, {torch.get_num_threads()} threads) ...")
        else:
            log(f"compressing block by block on {device} (no calibration data) ...")
        stage_pass = StagePass(ctx)
        spill = calibrate and recipe.calibration.offload == "disk"
        with contextlib.ExitStack() as stack:
            if spill:  # memory-mapped activations, removed after the pass
                if spill_dir is not None:
                    spill_dir.mkdir(parents=True, exist_ok=True)
                spill_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=spill_dir, prefix=".spill-")))
                log(f"calibration activations spill to {spill_dir}")
            mine = share(samples, rank, size) if calibrate and size > 1 else samples
            replay: list[str] = []
            errors = run_blockwise(model, plan.arch, mine, stage_pass.on_block, BlockPass(
                device=device, progress=progress, observe=stage_pass.observe,
                compute_dtype=getattr(torch, dtype) if calibrate else None, spill_dir=spill_dir if spill else None,
                blocks=blocks, visitors=visitors, start=start, restore=restore, notes=replay, profile=profile))
        if calibrate:
            sections["block_errors"] = errors
            sections["calibration"]["replay"] = replay or "exact"  # the blocks saw the model's own forward's inputs
            for line in replay:
                log(f"WARNING: calibration replay is not the model's own forward: {line}")
        ctx.calibrated = True
    for i in plan.block_stages:  # the whole model (what lies outside the blocks; all of it without calibration)
        plan.stages[i].finalize(ctx, i)
    # the pass's activations, statistics and tuning state are gone: the heap's freed pages back to the system before
    # the evaluation's copies and logits (0.3-0.5 GB of the peak on the embedded model's AutoRound run)
    trim_heap()
    sections["stages"] = [model_reports[i] if i in model_reports else stage.report(ctx, i)
                          for i, stage in enumerate(plan.stages)]
    for section in sections["stages"]:
        if section.get("summary"):
            log(f"WARNING: {section['summary']}")
    sections["kept_in_float"] = kept_in_float(model)
    # what follows (distill, the exports' check) takes text windows: image-caption samples are not
    return sections, None if isinstance(samples, ImageSamples) else samples


def write_run_report(report: dict, folder: Path) -> None:
    """report.json, report.md, and a recovery-curve plot for each stage section that has one (distill)."""
    write_report(report, folder)
    for section in report["stages"]:
        if any(p.get("ppl") is not None for p in section.get("curve") or ()):
            plot_recovery(section, folder / f"recovery_curve_stage{section['index']}.png")


class Timings(dict):
    """Seconds per part of a run (the report's `timings`): `with timings("load"): ...` (not recorded when `when` is
    false), the GPU's queued work finished at both ends; each part is also a phase of `profile` (its seconds there:
    what the finer phases inside it did not take)."""

    def __init__(self, profile: Profile | None = None):
        super().__init__()
        self.profile = profile

    @contextlib.contextmanager
    def __call__(self, key: str, when: bool = True):
        device_sync()
        t = time.perf_counter()
        with phase_of(self.profile if when else None, key):
            yield
        device_sync()
        if when:
            self[key] = time.perf_counter() - t


def run_header(record: dict, recipe: Recipe, kind: str, model, arch, n_params: int, device: str, planted) -> dict:
    """The report's header: the run's provenance (`record`, provenance.py: compress version, source), the time, the
    recipe as written and as resolved, the model (`kind`: how it was loaded)."""
    return {
        "compress_version": record["compress_version"],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"path": recipe.path, "sha256": recipe.sha256, "overrides": list(recipe.overrides),
                   "text": recipe.text, "resolved": to_plain(recipe, skip=("path", "text", "sha256", "overrides"))},
        "model": {"source": record["source"], "kind": kind, "family": arch.family, "parameters": n_params,
                  "parameters_after": sum(p.numel() for p in model.parameters()),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
                  "threads": torch.get_num_threads(), "planted_outliers": planted},
    }
