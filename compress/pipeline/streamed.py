"""`compress run` on a model streamed from disk, one decoder block at a time (`model.stream`).

One pass over the blocks does everything the in-memory run does in several: block i is read from the checkpoint
(streaming.py), its float forward feeds the calibration statistics and the baseline's evaluation windows, the stages
compress it, its compressed forward feeds the next block's calibration inputs and the compressed model's evaluation
windows, its tensors go to the output's shards (shards.ShardWriter), and it leaves memory. After the last block,
both models' final hidden states go through the final norm and the head for perplexity, KL and top-1: the baseline
is never a second copy. What needs the whole model resident (speed, lm-eval tasks, exports, self-generated
calibration, pruning and distillation) is refused up front or reported as not measured, with the reason. The
exports are written afterwards from the saved checkpoint, again one block at a time (export_streamed).
`StreamedSource` is what this changes in the run's one sequence (source.run_source); `run_streamed` runs it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from ..arch import get_module
from ..calibrate.blockwise import BlockInputs, BlockVisitor, block_forward, capture_block_inputs, forward_work
from ..core.profile import phase_of
from ..core.transfer import DeviceCopies, ahead_to
from ..calibrate.data import eval_windows
from ..calibrate.distributed import world
from ..measure.memory import folder_bytes
from ..kv.cache import kv_layers, set_kv_scales
from ..model.integrity import check_resume_dir
from .memory_plan import plan_memory
from ..model.load import _classify, load_config, resolve_device, streamed_dtype
from ..export.native import meta_quant_layers, storage_tensors, write_model_files
from ..core.scheme import FP8_MAX
from ..core.nn import QuantLinear, cached_dequantize
from ..recipe import Recipe
from .calibration import PassExtras, check_output
from .model_stages import work_dir
from .options import RunOptions
from .provenance import export_provenance
from .source import ModelSource, parameters, run_source
from ..export.shards import ShardReader, ShardWriter
from ..export.staging import write_atomic
from ..model.streaming import STREAM_KINDS, Streamed, open_streamed, trim_heap

NOT_STREAMED = {  # measured only on a resident model: reported as not measured in a streamed run
    "speed": "tokens/s needs the whole model loaded: run `compress eval OUTPUT` where it fits, or on an export "
             "with `--offload GB` where it does not (that times the disk)",
}

# generating reads every block from disk once per token, for each model: 2 x 3 prompts x eval.samples passes
NO_SAMPLES = ("this run streamed the model from disk one block at a time, and each generated token would read every "
              "block again; `compress generate OUTPUT \"prompt\" --baseline MODEL` where the model fits, or "
              "`compress eval OUTPUT --baseline MODEL` (samples included)")


def stream_blockers(recipe: Recipe) -> list[str]:
    """Why this recipe cannot run streamed (empty when it can), each naming the way out."""
    why = []
    try:
        kind = _classify(recipe.model.source)[0]
    except FileNotFoundError:  # loading says what is wrong with the source
        kind = None
    if kind is not None and kind not in STREAM_KINDS:
        why.append(f"a {kind} model is loaded as a whole (stream a Hugging Face folder, a hub id or a .gguf file)")
    why += list(dict.fromkeys(p for s in recipe.stages if (p := s.stream_problem()) is not None))
    if recipe.output.formats and not recipe.output.save_model:
        why.append("output.formats with output.save_model: false: a streamed run exports block by block from the "
                   "checkpoint it saves (set output.save_model: true)")
    if recipe.eval.tasks:
        why.append("eval.tasks: lm-eval needs the whole model resident (set eval.tasks: [] here, and run "
                   "`compress eval OUTPUT --tasks ...` where the model fits)")
    if recipe.calibration is not None and recipe.calibration.kind == "self":
        why.append("calibration.kind: self samples text from the whole model (use a text calibration set)")
    if recipe.calibration is not None and recipe.calibration.kind == "images":
        why.append("calibration.kind: images runs the vision tower in the model's forward (load the model whole)")
    return why


def choose_plan(recipe: Recipe, config, dtype: torch.dtype, device: str, conversion: int = 0,
                available: int | None = None):
    """(memory plan, the recipe to run, stream?, notes). model.stream: always streams; auto streams when the whole
    model would not fit and the streamed run would and the recipe can stream (else the notes say what stops it);
    never does not. Before streaming, and when a streamed run alone does not fit, calibration activations that do
    not fit in memory go to disk (calibration.offload: disk, chosen here when the recipe left it at memory)."""
    spec = recipe.model
    stream_dtype = streamed_dtype(spec.dtype, device, config)  # a bfloat16 checkpoint streams as stored

    def plan(r: Recipe, streamed: bool):
        return plan_memory(r, config, stream_dtype if streamed else dtype, device, available,
                           conversion=0 if streamed else conversion, streamed=streamed)

    def fitting(streamed: bool):
        """The recipe as given, or with its activations on disk, whichever fits first (None: neither)."""
        memory = plan(recipe, streamed)
        if memory.problem(recipe) is None or not spec.check_memory:
            return memory, recipe, []
        cal = recipe.calibration
        if cal is not None and cal.offload == "memory" and torch.device(device).type == "cpu":
            spilled = dataclasses.replace(recipe, calibration=dataclasses.replace(cal, offload="disk"))
            memory = plan(spilled, streamed)
            if memory.problem(spilled) is None:
                return memory, spilled, ["the calibration activations do not fit in memory: they go to disk "
                                         "(calibration.offload: disk, chosen from the memory plan)"]
        return None

    if spec.stream == "always":
        memory, run_recipe, notes = fitting(True) or (plan(recipe, True), recipe, [])
        return memory, run_recipe, True, notes
    whole = fitting(False)
    if whole is not None or spec.stream == "never":
        memory, run_recipe, notes = whole or (plan(recipe, False), recipe, [])
        return memory, run_recipe, False, notes
    streamed = fitting(True)
    if streamed is None:
        return plan(recipe, False), recipe, False, []
    if blockers := stream_blockers(recipe):
        return plan(recipe, False), recipe, False, [
            "streaming the model block by block (model.stream) would fit, but: " + "; ".join(blockers)]
    memory, run_recipe, notes = streamed
    return memory, run_recipe, True, ["the whole model does not fit in memory: streaming it from disk block by "
                                      "block (model.stream: auto)"] + notes


class StreamedBlocks:
    """The runner's block source for a streamed model: each block read from disk for its turn; afterwards its
    tensors go to the output's shards (`writer`, None when output.save_model is false) and it leaves memory.

    While block i computes, block i + 1 is read on a helper thread (`read_ahead`): its tensors as stored (one more
    block at the checkpoint's dtype in memory, which the memory plan counts), converted to the run's dtype when its
    turn comes. The profile then shows the read as overlapped, and as `read` only the time the pass waited for it.
    On a CUDA device the helper thread also queues the block's copies to the device, through pinned memory on a
    stream of its own (core/transfer.py; one more block's weights on the device): the pass's stream waits for them
    when the block's turn comes, and the profile shows them as the overlapped phase `transfer`."""

    def __init__(self, streamed: Streamed, writer: ShardWriter | None, save_dtype: str, profile=None,
                 read_ahead: bool = True):
        self.streamed, self.writer, self.save_dtype, self.profile = streamed, writer, save_dtype, profile
        self.kv: dict = {}
        self.n = len(streamed.arch.block_list(streamed.model))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead") if read_ahead else None
        self.ahead: tuple[int, Future] | None = None
        self.copies = None  # the CUDA stream the read-ahead copies go on (made by the helper thread on first use)

    def begin(self) -> None:  # the block-0 inputs are captured: embeddings and head are not needed until the end
        self.streamed.release_outside()

    def end(self) -> None:  # the head for its quantization and the scoring; the embedding goes to disk directly
        self.ahead = None
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.streamed.load_outside(skip=self.streamed.arch.embed)

    def load(self, i: int, device) -> nn.Module:
        stored = None
        if self.ahead is not None and self.ahead[0] == i:
            stored = self.ahead[1].result()  # the wait, if any, is timed as `read` by the runner
        self.ahead = None
        if self.pool is not None and i + 1 < self.n:
            self.ahead = (i + 1, self.pool.submit(self._read_ahead, i + 1, device))
        if isinstance(stored, DeviceCopies):
            stored = stored.ready()
        return self.streamed.load(i, self.profile, stored).to(device)

    def _read_ahead(self, i: int, device) -> dict | DeviceCopies:
        """Block i's tensors as stored (a helper thread's work), on a CUDA `device` already on their way there."""
        stored = self.streamed.read_block(i, self.profile)
        if not ahead_to(device):
            return stored
        if self.copies is None:
            self.copies = torch.cuda.Stream(torch.device(device))
        with phase_of(self.profile, "transfer", nbytes=sum(t.numel() * t.element_size() for t in stored.values())):
            return DeviceCopies.of(stored, device, self.copies)

    def done(self, i: int, block: nn.Module) -> None:
        prefix = f"{self.streamed.arch.blocks}.{i}"
        self.kv.update({f"{prefix}.{n}": v for n, v in kv_layers(block).items()})
        if self.writer is not None:
            # the block's tensors as stored, written on the writer's helper thread while the next block computes
            # (one block behind: the memory plan's "previous block (being written)"); held here, they outlive the
            # block's release to the meta device
            with phase_of(self.profile, "writing"):
                items = list(storage_tensors(block, self.save_dtype, prefix))
            self.writer.add_behind(items, self.profile)
            if self.profile is not None:
                self.profile.add_work("writing", nbytes=sum(t.numel() * t.element_size() for _, t in items))
        self.streamed.release(block)
        trim_heap()


class StreamedEval(BlockVisitor):
    """The evaluation windows carried through the pass for both models: the baseline through each float block,
    the compressed model through each compressed block (the same computation as the in-memory evaluation's model
    forward). The final norm and head are applied afterwards by `final`."""

    def __init__(self, windows: torch.Tensor, profile=None):
        self.windows, self.profile = windows, profile

    def start(self, model: nn.Module, arch, device) -> None:
        self.base, _ = capture_block_inputs(model, arch, self.windows, device)
        self.comp = self.base.fork()  # its own copy of any state the blocks share (Gemma 4's shared keys/values)
        self.dtype = self.base.hidden[0].dtype
        # the original final norm and head: the baseline's, even after a stage quantizes the head
        self.norm, self.head = get_module(model, arch.final_norm), model.get_output_embeddings()

    def loaded(self, i: int, block: nn.Module) -> None:
        with phase_of(self.profile, "evaluation", *forward_work(block, self.base, None)):
            self.base = self.base.advance(block_forward(block, self.base))

    def compressed(self, i: int, block: nn.Module) -> None:
        for m in block.modules():  # LLM.int8 dynamic outliers are counted over the evaluation windows only
            if isinstance(m, QuantLinear):
                m.outlier_counts.update(forwards=0, total=0, max=0)
        # the layers' own forward, as the in-memory evaluation runs them (int8 matmuls where a scheme has them); the
        # weight-only layers dequantized once for all the windows, not once per window (the same numbers)
        with phase_of(self.profile, "evaluation", *forward_work(block, self.comp, None)), \
                cached_dequantize(block, self.dtype, weight_only=True):
            self.comp = self.comp.advance(block_forward(block, self.comp))

    @torch.no_grad()
    def final(self, model: nn.Module, arch) -> dict[str, list[torch.Tensor]]:
        """Each model's final hidden states per window, [seq_len - 1, hidden]."""
        norm = get_module(model, arch.final_norm)
        return {"baseline": [self.norm(h)[0, :-1] for h in self.base.hidden],
                "compressed": [norm(h)[0, :-1] for h in self.comp.hidden]}


def per_layer_inputs_quantized(plan) -> list[str]:
    """The per-layer input projections (stages.quantize.PER_LAYER_INPUTS) a plan quantizes."""
    from ..stages.quantize import QuantPlan, is_per_layer_input
    return [e.name for step in plan.steps if isinstance(step, QuantPlan) for e in step.quantized
            if is_per_layer_input(e.name, plan.arch)]


def open_source(recipe: Recipe, device: str) -> Streamed:
    spec = recipe.model
    kind, where = _classify(spec.source)
    dtype = streamed_dtype(spec.dtype, device, load_config(spec.source, spec.revision, spec.trust_remote_code))
    return open_streamed(kind, where, dtype, spec.revision, spec.trust_remote_code)


class StreamCheckpoint(BlockVisitor):
    """The streamed pass saved after every block into `folder`, so that a run killed at block 17 of 80 continues at
    block 17 with `--resume` and ends as an uninterrupted run would, bit for bit: the next block's calibration
    inputs and both models' evaluation hidden states (a small safetensors checkpoint), the output writer's position
    (its shards stay in the staging folder), the stages' records and the block errors so far. `progress.json`,
    replaced atomically, is the commit point.

    With several processes (torchrun), every rank saves its own windows' inputs (`carried-N.rank-R`; rank 0's folder
    also holds the evaluation's hidden states), all ranks wait until every one has saved, then rank 0 commits; a
    resume needs as many processes, each reading its own."""

    def __init__(self, folder: Path, recipe_sha: str, writer: ShardWriter | None, blocks: StreamedBlocks,
                 evaluation: StreamedEval | None, state: dict | None = None, rank: int = 0, processes: int = 1):
        self.folder, self.sha, self.writer, self.blocks, self.evaluation = folder, recipe_sha, writer, blocks, evaluation
        self.state, self.rank, self.processes = state, rank, processes

    @staticmethod
    def load(folder: Path, recipe_sha: str, processes: int = 1) -> dict | None:
        path = folder / "progress.json"
        if not path.is_file():
            return None
        check_resume_dir(folder)  # its files whole before anything is read from them (integrity.py)
        state = json.loads(path.read_text())
        if state["recipe_sha256"] != recipe_sha:
            raise ValueError(f"{folder} holds an interrupted run of another recipe (or other overrides); run without "
                             "--resume to start over")
        ran_on = state.get("processes", 1)
        if ran_on != processes:
            raise ValueError(f"{folder} holds a run interrupted on {ran_on} process(es), and this one has {processes}: "
                             f"each process saved its own calibration windows. Resume on {ran_on} "
                             f"({'torchrun --nproc-per-node ' + str(ran_on) + ' -m compress run ...' if ran_on > 1 else 'without torchrun'}"
                             "), or run without --resume to start over")
        return state

    def _mine(self, name: str) -> Path:
        """This rank's folder of a checkpoint `name` (rank 0: the folder itself)."""
        return self.folder / (name if self.rank == 0 else f"{name}.rank-{self.rank}")

    def bind(self, ctx) -> int:
        """Give the run context its saved records; the block to start at."""
        self.ctx = ctx
        if self.state is None:
            return 0
        ctx.records.update({int(k): v for k, v in self.state["records"].items()})
        self.blocks.kv.update(self.state["kv"])
        done_blocks(ctx.model, ctx.plan, self.blocks.streamed, self.state["next"], self.state["kv"])
        return self.state["next"]

    def restore(self, inputs: BlockInputs | None) -> tuple[BlockInputs | None, list[float]]:
        saved, start = ShardReader(self.folder / self.state["carried"]), self.state["next"]
        if self.evaluation is not None:  # freshly captured for block 0: block `start`'s arguments
            ev = self.evaluation
            # on the device the pass computes on, where start() captured them (the checkpoint reads to the CPU)
            ev.base = ev.base.at(start, [saved.get(f"base.{k}").to(h.device) for k, h in enumerate(ev.base.hidden)])
            ev.comp = ev.comp.at(start, [saved.get(f"comp.{k}").to(h.device) for k, h in enumerate(ev.comp.hidden)])
        if inputs is not None and self.rank != 0:
            saved = ShardReader(self._mine(self.state["carried"]))
        restored = None if inputs is None else \
            inputs.at(start, [saved.get(f"cal.{k}") for k in range(len(inputs.hidden))])
        return restored, list(self.state["errors"])

    def done(self, i: int, inputs: BlockInputs | None, errors: list[float]) -> None:
        from ..calibrate.distributed import active, barrier

        name = f"carried-{i + 1:05d}"
        carried = ShardWriter(_fresh(self._mine(name)), max_shard_bytes=1 << 62)
        for k, h in enumerate(inputs.hidden if inputs is not None else ()):
            carried.add(f"cal.{k}", h)
        if self.evaluation is not None:
            for prefix, held in (("base", self.evaluation.base), ("comp", self.evaluation.comp)):
                for k, h in enumerate(held.hidden):
                    carried.add(f"{prefix}.{k}", h)
        carried.finish()
        if active():
            barrier()  # every rank's inputs of block i + 1 are on disk before the commit
        if self.rank == 0:
            state = {"recipe_sha256": self.sha, "next": i + 1, "carried": name, "errors": errors,
                     "writer": self.writer.state() if self.writer is not None else None,
                     "records": self.ctx.records, "kv": self.blocks.kv, "processes": self.processes}
            write_atomic(self.folder / "progress.json", json.dumps(state))
            if self.writer is not None:
                self.writer.drop_stale()
        if active():
            barrier()  # committed: the older inputs can go
        for old in self.folder.glob("carried-*"):
            if old.name != self._mine(name).name and _rank_of(old.name) == self.rank:
                shutil.rmtree(old)


def _rank_of(name: str) -> int:
    """The rank whose inputs a checkpoint folder holds: carried-00003 is rank 0's, carried-00003.rank-1 rank 1's."""
    return int(name.rsplit(".rank-", 1)[1]) if ".rank-" in name else 0


def done_blocks(model: nn.Module, plan, streamed: Streamed, upto: int, kv: dict) -> None:
    """The blocks an interrupted run finished (below `upto`) as they left it, on the meta device: the planned
    QuantLinear layers and the KV-cache scales, so the saved config, the per-layer schemes and the weight counts
    are those of an uninterrupted run (their tensors are in the output's shards already)."""
    blocks = {f"{streamed.arch.blocks}.{i}." for i in range(upto)}
    layers = {e.name: e.scheme for stage, step in zip(plan.stages, plan.steps) if stage.stores_weights
              for e in step.quantized if any(e.name.startswith(b) for b in blocks)}
    codes = {e.name: e.code for stage, step in zip(plan.stages, plan.steps) if stage.stores_weights
             for e in step.quantized if e.code is not None}
    meta_quant_layers(model, layers, streamed.dtype, codes)
    for name, fields in kv.items():
        set_kv_scales(model.get_submodule(name), fields["k_scale"] * FP8_MAX[fields["dtype"]],
                      fields["v_scale"] * FP8_MAX[fields["dtype"]], fields["dtype"])
    streamed.loaded_blocks = upto


def _fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def streamed_model_stages(opts: RunOptions, streamed: Streamed, main: bool = True) -> tuple[dict, Recipe]:
    """The whole-model stages a streamed run allows (auto_precision: its sensitivity pass reads the blocks from disk
    one at a time, fisher_blocks.py), before the calibration pass. Returns their report sections and the recipe
    with the stages as they resolved them. The head is read for the pass's logits and released after it. The
    sections are kept in OUTPUT.work/stream/model_stages.json (`opts.out`: OUTPUT.work): a run resumed in its
    calibration pass takes the choice from there instead of measuring again (an hour on a 70B model)."""
    from ..precision.fisher_blocks import StreamedReads
    from .model_stages import run_model_stages

    recipe, log = opts.recipe, opts.log
    kept = opts.out / "stream" / "model_stages.json"
    if opts.resume and kept.exists() and (saved := json.loads(kept.read_text()))["recipe_sha256"] == recipe.sha256:
        reports, stages = {int(i): r for i, r in saved["reports"].items()}, recipe.stages
        for i, section in sorted(reports.items()):
            stages = stages[i].resolve_stages(stages, i, section)
        log(f"resuming: the choice of {', '.join(recipe.stages[i].name for i in reports)} is read from {kept}")
        return reports, dataclasses.replace(recipe, stages=stages)
    streamed.load_outside()
    try:
        reports, _, stages = run_model_stages(streamed.model, streamed.tokenizer, streamed.arch, opts,
                                              blocks=StreamedReads(streamed))
    finally:  # back to what open_streamed left: the outside modules but the head
        streamed.release_outside()
        streamed.load_outside(skip=streamed.arch.lm_head)
        trim_heap()
    if main:
        write_atomic(kept, json.dumps({"recipe_sha256": recipe.sha256, "reports": reports}))
    return reports, dataclasses.replace(recipe, stages=stages)


def run_streamed(recipe: Recipe, progress: bool = True, log=print, memory=None, resume: bool = False,
                 profile=None) -> dict:
    """The recipe on a model streamed block by block (see the module docstring). Called by pipeline.run. The output
    is staged in OUTPUT.work/ beside it (with the pass's checkpoint) and renamed into place at the end; an
    interrupted run leaves that folder for `resume`."""
    if why := StreamedSource.refusals(recipe):
        raise ValueError("this recipe cannot run streamed (model.stream): " + "; ".join(why))
    out = Path(recipe.output.dir)
    check_output(out, recipe.output.overwrite)
    opts = RunOptions(recipe, out, resolve_device(recipe.model.device), progress, log, resume, profile)
    return run_source(StreamedSource(), opts, memory)


class StreamedSource(ModelSource):
    """The model streamed from disk one block at a time (model/streaming.py): the calibration pass also saves the
    blocks and carries the evaluation's hidden states, and is checkpointed after every block; what needs the whole
    model resident is refused up front (`refusals`, `check_plan`) or reported as not measured."""

    staging = None  # OUTPUT.work/output, from `prepare`
    refusals = staticmethod(stream_blockers)

    def prepare(self, opts: RunOptions) -> None:
        """OUTPUT.work: the pass's checkpoint read when resuming (by every rank: each resumes from its own windows'
        inputs), else an interrupted run's files removed; only rank 0 removes or creates."""
        recipe, log = opts.recipe, opts.log
        self.work = work_dir(opts.out)
        self.rank, self.processes = world()
        self.main = self.rank == 0  # with torchrun, the other processes only calibrate (distributed.py)
        self.state = StreamCheckpoint.load(self.work / "stream", recipe.sha256, self.processes) if opts.resume \
            else None
        if not self.main:
            pass
        elif self.state is None and self.work.exists():
            log(f"removing {self.work} (an interrupted run's files; --resume would have continued it)"
                if not opts.resume else f"nothing to resume in {self.work}: starting over")
            shutil.rmtree(self.work)
        elif self.state is not None:
            log(f"resuming the streamed pass at block {self.state['next']} from {self.work}")
        self.staging = self.work / "output"
        if self.main:
            self.staging.mkdir(parents=True, exist_ok=True)
            (self.work / "stream").mkdir(exist_ok=True)

    def open(self, opts: RunOptions) -> None:
        opts.log(f"opening {opts.recipe.model.source!r} to stream it block by block ...")
        self.streamed = open_source(opts.recipe, opts.device)
        self.model, self.tokenizer = self.streamed.model, self.streamed.tokenizer
        self.name, self.kind = self.streamed.source_name, self.streamed.kind
        self.n_params = parameters(self.model)

    @property
    def arch(self):
        return self.streamed.arch

    def check_plan(self, plan, formats: tuple[str, ...]) -> None:
        if inputs := per_layer_inputs_quantized(plan):
            raise ValueError(f"{inputs[0]} is quantized by the recipe, but a streamed run carries the per-layer inputs "
                             "it computes to its evaluation from the float layer (it is quantized after the pass), so "
                             "the evaluation would not see the quantized layer: leave it out of `targets:` (float, "
                             "the default), or run the model in memory (model.stream: false)")

    def model_stages(self, opts: RunOptions) -> tuple[dict, None, tuple]:
        """Those that stream (auto_precision), their files in OUTPUT.work; nothing is distilled."""
        if not any(s.whole_model and not s.after_calibration for s in opts.recipe.stages):
            return {}, None, opts.recipe.stages
        reports, recipe = streamed_model_stages(
            dataclasses.replace(opts, out=self.work, progress=opts.progress and self.main), self.streamed, self.main)
        return reports, None, recipe.stages

    def pass_extras(self, opts: RunOptions, model_reports: dict) -> PassExtras:
        """The pass reads the blocks from disk and writes them to the output's shards (`writer`), carries the
        evaluation windows through both models, and checkpoints itself after every block; the baseline's figures
        are taken before it changes the model."""
        from .report import model_figures

        recipe = opts.recipe
        self.baseline_figures = model_figures(self.model, recipe.eval, meta=True)
        self.windows = eval_windows(self.tokenizer, recipe.eval.split, recipe.eval.seq_len, recipe.eval.max_windows) \
            if recipe.eval.perplexity and self.main else None
        self.evaluation = StreamedEval(self.windows, opts.profile) if self.windows is not None else None
        self.writer = None
        if recipe.output.save_model and self.main:
            shard_args = ({"compress": "1"}, recipe.output.max_shard_bytes, True)  # keep_closed: for the checkpoint
            self.writer = ShardWriter.restore(self.staging, self.state["writer"], *shard_args) if self.state else \
                ShardWriter(self.staging, *shard_args)
        self.blocks = StreamedBlocks(self.streamed, self.writer, recipe.output.save_dtype, opts.profile)
        checkpoint = StreamCheckpoint(self.work / "stream", recipe.sha256, self.writer, self.blocks, self.evaluation,
                                      self.state, self.rank, self.processes)
        visitors = (self.evaluation,) if self.evaluation is not None else ()
        return PassExtras(model_reports, opts.out.parent, self.blocks, visitors, checkpoint)

    def stopped(self, opts: RunOptions) -> None:
        if self.writer is not None:  # a block being written behind finishes before a resume may truncate its shard
            with contextlib.suppress(Exception):  # its own error is not the one that stopped the pass
                self.writer.wait()
        opts.log(f"the streamed pass stopped; its progress is in {self.work}: the same command with --resume "
                 "continues it")

    def reload(self, opts: RunOptions) -> nn.Module:
        raise ValueError("a streamed run does not load the original model whole (a stage after the calibration "
                         "pass needs it as a teacher): run the model in memory (model.stream: false)")

    def save(self, tmp: Path, opts: RunOptions, record: dict) -> None:
        """The tensors outside the blocks (the blocks' went to the shards in the pass), then the model files."""
        model, arch, save_dtype = self.model, self.arch, opts.recipe.output.save_dtype
        opts.log("writing the rest of the model (embeddings, final norm, head) and closing the shards ...")
        self.writer.wait(opts.profile)  # the last block's tensors, still being written behind the pass
        for name, t in storage_tensors(model, save_dtype):
            self.writer.add(name, t)
        if any(p.is_meta for p in get_module(model, arch.embed).parameters()):
            for name, t in self.streamed.outside_tensors(arch.embed, getattr(torch, save_dtype)):
                self.writer.add(name, t)
        with phase_of(opts.profile, "writing"):  # the last block's tensors written, the last shard closed
            self.writer.finish()
        write_model_files(model, self.tokenizer, tmp, record, save_dtype, self.blocks.kv)

    def evaluate(self, opts: RunOptions, before_distill: None) -> tuple[dict, int]:
        return streamed_eval(opts.recipe, self.model, self.arch, self.evaluation, self.windows, self.baseline_figures,
                             opts.progress, opts.device), self.n_params * 2

    def export(self, tmp: Path, opts: RunOptions, record: dict, samples) -> list[dict]:
        return export_streamed(opts, record, tmp, self.streamed)

    def sections(self, opts: RunOptions) -> dict:
        return {"streamed": {
            "weights_from": self.streamed.where, "blocks": len(self.arch.block_list(self.model)),
            "resumed_at_block": self.state["next"] if self.state else None,
            "evaluation": "perplexity, KL and top-1 computed in the same pass, the baseline's and the compressed "
                          "model's hidden states carried block by block (no second copy)" if self.windows is not None
            else "no perplexity evaluation (eval.perplexity: false)",
            "not_measured": NOT_STREAMED if opts.recipe.eval.speed else {},
            "dtype": str(self.streamed.dtype).replace("torch.", ""),
        }}


NOT_VERIFIED = ("not reloaded and compared here: the loaders read the whole model, which this run streamed "
                "because it does not fit; `compress verify OUTPUT/exports/FORMAT` does it where the model fits")


def export_streamed(opts: RunOptions, record: dict, stage: Path, streamed: Streamed) -> list[dict]:
    """Each format of output.formats written from the checkpoint just saved in `stage`, one block in memory at a
    time (streaming.open_compressed + stream_parts); the same files the in-memory run writes."""
    from ..export import export_model
    from ..model.streaming import open_compressed, stream_parts

    recipe, log = opts.recipe, opts.log
    exports = []
    for fmt in recipe.output.formats:
        log(f"exporting {fmt} block by block ...")
        folder = stage / "exports" / fmt
        folder.parent.mkdir(exist_ok=True)
        source = open_compressed(stage)
        written = export_model(source.model, source.tokenizer, fmt, folder, export_provenance(record, opts.out),
                               source_gguf=record["source"] if streamed.kind == "gguf" else None,
                               max_shard_bytes=recipe.output.max_shard_bytes,
                               parts=stream_parts(source, opts.progress))
        exports.append({"format": fmt, "folder": f"exports/{fmt}", "loaders": written["loaders"],
                        "bytes": folder_bytes(folder), "notes": [*written.get("notes", []), NOT_VERIFIED]})
    return exports


def streamed_eval(recipe: Recipe, model: nn.Module, arch, evaluation: StreamedEval | None, windows,
                  baseline_figures: dict, progress: bool, device: str = "cpu") -> dict:
    """The report's `eval` section of a streamed run, in the in-memory run's shape. The hidden states were carried
    on `device`; the final norms and heads (on the CPU after the pass) go there for the scoring, and back."""
    from ..measure.ppl import final_logits, score_hidden
    from .report import eval_protocol, model_figures, peak_cuda_bytes, peak_rss_bytes

    spec = recipe.eval
    names = ["baseline", "compressed"] if spec.baseline else ["compressed"]
    result: dict = {"models": {n: {} for n in names}}
    if evaluation is not None:
        scoring = [evaluation.norm, evaluation.head, get_module(model, arch.final_norm), model.get_output_embeddings()]
        for m in scoring:
            m.to(device)
        final = evaluation.final(model, arch)
        result["protocol"] = {**eval_protocol(spec, windows, evaluation.dtype), "threads": torch.get_num_threads(),
                              "streamed": True}
        heads = {"baseline": evaluation.head, "compressed": model.get_output_embeddings()}
        scores = score_hidden({n: (lambda k, ids, n=n: final[n][k]) for n in names},
                              {n: (lambda h, n=n: final_logits(model, h, heads[n], arch)) for n in names},
                              windows, baseline="baseline" if spec.baseline else None, device=device,
                              progress=progress)
        for m in scoring:
            m.to("cpu")
        for n, s in scores.items():
            result["models"][n].update(ppl=s.ppl, nll=s.nll, tokens=s.tokens, kl=s.kl, top1_agreement=s.top1_agreement)
    if spec.samples:
        result["samples"] = {"skipped": NO_SAMPLES}
    if spec.baseline:
        result["models"]["baseline"].update(baseline_figures)
    result["models"]["compressed"].update(model_figures(model, spec, meta=True))
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["peak_cuda_bytes"] = peak_cuda_bytes()
    return result
