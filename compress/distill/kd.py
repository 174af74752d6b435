"""Knowledge-distillation repair (Minitron style): train a pruned student to match its teacher.

Loss per micro-batch: T**2 * KL(teacher || student) on T-softened next-token distributions at every
position, plus optionally `hidden_weight` * MSE(final hidden states) / Var(teacher hidden).
Runs on Hugging Face accelerate: one process, or DDP under `accelerate launch` (gloo on CPU); with `fsdp: true`
under torchrun / `accelerate launch`, student and teacher are sharded over the processes (torch FSDP2, fsdp.py).
Data order is a pure function of (seed, step): step s takes rows_per_step rows of a seeded
per-epoch permutation and gives each (micro-batch, process) its own slice, so a resumed run
trains on exactly the rows an uninterrupted run would have.
"""
from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.nn import cast_linear_weights, swapped_weights
from ..measure.ppl import score_hidden, score_windows
from ..model.integrity import check_resume_dir
from ..threads import run_groups, window_workers

STATE_FILE = "distill_state.json"  # written last, so a checkpoint folder without it is incomplete
# changing these between a run and its resume would silently change what is trained
_RESUME_FIXED = ("batch_size", "grad_accum", "seq_len", "lr", "min_lr", "warmup_steps", "weight_decay",
                 "temperature", "hidden_weight", "max_grad_norm", "seed")


KD_CHUNK_ROWS = 64  # rows of logits per chunk of kd_loss on a GPU: 64 × a 152k vocabulary is 39 MB of float32
# on a CPU: 8 rows of the embedded model's 49k vocabulary are 1.5 MB of float32 each, so a chunk's five temporaries
# stay in the cores' caches (64 rows went through memory)
KD_CHUNK_ROWS_CPU = 8


def _kd_rows(s: Tensor, t: Tensor, temperature: float, grad: Tensor | None, rows: range, chunk: int,
             total_rows: int) -> list[Tensor]:
    """kd_loss's terms of the logits' rows `rows`, a chunk at a time: each chunk's float64 sum of
    p_t (log p_t - log p_s), and its rows of the gradient written into `grad`. Each row's values are a function of
    that row alone, whichever rows go together."""
    sums = []
    for a in range(rows.start, rows.stop, chunk):
        b = min(a + chunk, rows.stop)
        ss, tt = s[a:b].float(), t[a:b].float()
        if temperature != 1.0:  # x / 1.0 is x: the division skipped changes no value
            ss, tt = ss / temperature, tt / temperature
        log_s = F.log_softmax(ss, dim=-1)
        log_t = F.log_softmax(tt, dim=-1)
        p_t = log_t.exp()
        sums.append((p_t * (log_t - log_s)).sum(dtype=torch.float64))
        if grad is not None:
            grad[a:b] = (log_s.exp_().sub_(p_t)).mul_(temperature / total_rows)
    return sums


class _KDLoss(torch.autograd.Function):
    """T² · mean over rows of KL(softmax(t/T) || softmax(s/T)) for logits [rows, V], a chunk of rows at a time. The
    gradient with respect to the student's logits, T · (softmax(s/T) - softmax(t/T)) / rows, is formed in the forward
    (in the logits' dtype) and kept for the backward, so no [rows, V] float32 tensor is ever held: the unfused form
    kept four of them (the float copies, both log-softmaxes) and went over each in the backward again. On the embedded
    model's tuning step (2048 rows × 49,152, bfloat16 logits; 2-core EPYC) the loss took 2.4 s, this 0.85 s, and the
    whole step went from 15.3 s to 12.4 s.
    On a CPU of more than one thread the rows are cut in two halves, each on a worker of one thread (element-wise
    work that this 2-core machine's second OpenMP thread slows down), in chunks of 8 rows that stay in cache: 0.90 s
    -> 0.47 s on the AMX Xeon. Each row's log-softmax is the same function of the row as unfused, so the gradient is
    the same bit for bit however the rows are cut; only the loss's sum (which only reports) changes its order."""

    @staticmethod
    def forward(ctx, s: Tensor, t: Tensor, temperature: float) -> Tensor:
        rows = s.shape[0]
        grad = torch.empty_like(s) if ctx.needs_input_grad[0] else None
        cpu = s.device.type == "cpu"
        chunk = KD_CHUNK_ROWS_CPU if cpu else KD_CHUNK_ROWS
        workers = window_workers(s.device.type, torch.get_num_threads(), 2) if rows >= 2 * chunk else 1
        cut = rows // workers // chunk * chunk if workers > 1 else rows
        spans = [range(0, cut), range(cut, rows)] if workers > 1 else [range(0, rows)]
        parts = run_groups(spans, lambda span: _kd_rows(s, t, temperature, grad, span, chunk, rows), workers)
        total = torch.zeros((), dtype=torch.float64, device=s.device)
        for part in parts:  # in the rows' order, whatever finished first
            for term in part:
                total += term
        ctx.save_for_backward(grad)
        return (total * (temperature ** 2 / rows)).float()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad, = ctx.saved_tensors
        if grad_out.device.type == "cpu" and float(grad_out) == 1.0:  # the usual loss.backward(): x * 1 is x
            return grad, None, None
        return grad * grad_out.to(grad.dtype), None, None


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """Forward KL(teacher || student) on softened distributions, mean over tokens, times T**2 (float32; computed in
    float32 from logits of any dtype, chunk by chunk: _KDLoss)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher logits "
                         f"{tuple(teacher_logits.shape)}; student and teacher need the same vocabulary")
    vocab = student_logits.shape[-1]
    return _KDLoss.apply(student_logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab), temperature)


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # accelerate's mixed_precision


def lr_at(step: int, cfg) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up 0 -> lr, cosine lr -> min_lr at steps - 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def _step_rows(step: int, n_rows: int, cfg, process: int, processes: int) -> Tensor:
    """Row indices [grad_accum, batch_size] that `process` trains on at `step`."""
    per_step = cfg.batch_size * cfg.grad_accum * processes
    steps_per_epoch = n_rows // per_step
    epoch, k = divmod(step, steps_per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
    rows = perm[k * per_step:(k + 1) * per_step].view(cfg.grad_accum, processes, cfg.batch_size)
    return rows[:, process]


def native_bf16() -> bool:
    """bf16 matmuls in hardware: a CUDA GPU that supports them, or a CPU with AMX or AVX512-BF16 (elsewhere
    bf16 autocast on CPU is emulated and slower than float32)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    cpu = getattr(torch, "cpu", None)
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())


def _new_accelerator(cfg):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    # AcceleratorState is a process-wide singleton that refuses a second, different mixed_precision;
    # clear it (PartialState, which owns the process group, stays) so distill can run twice in a process.
    AcceleratorState._reset_state(reset_partial_state=False)
    cuda = torch.cuda.is_available()
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if native_bf16() else "no"
    return Accelerator(mixed_precision=mp, gradient_accumulation_steps=cfg.grad_accum, cpu=not cuda)


def _set_checkpointing(model: nn.Module, on: bool) -> None:
    """Activation checkpointing (non-reentrant, so DDP works); transformers 5 renamed the gradient_* methods."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable() if on else model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _restore_forward(model: nn.Module) -> None:
    """Undo the autocast patch accelerate's prepare puts on model.forward under mixed precision.

    Not accelerator.unwrap_model(keep_fp32_wrapper=False): accelerate 1.15 then unwraps every __wrapped__
    layer, HF's @can_return_tuple included, and model(..., return_dict=False) breaks afterwards.
    """
    original = model.__dict__.pop("_original_forward", None)
    if original is not None and getattr(original, "__func__", None) is type(model).forward:
        del model.forward  # back to the class's method
    elif original is not None:
        model.forward = original


def _autocast_only(model: nn.Module, acc) -> None:
    """Keep the autocast of accelerate's mixed-precision patch on model.forward and drop its conversion of every
    output to float32: for logits that is a [tokens, vocab] float32 copy per micro-batch (400 MB), and its gradient
    cast back in the backward, which kd_loss does chunk by chunk instead (the embedded model's tuning step of 4 × 512
    tokens on the 2-core EPYC: 12.4 s -> 10.3 s). The values
    are the same: the conversion was exact, and kd_loss computes in float32 from any dtype. `_restore_forward` undoes
    this as it undid the patch."""
    original = model.__dict__.get("_original_forward")
    if original is None:  # no mixed precision: nothing was patched
        return

    def forward(*args, **kwargs):
        with acc.autocast():
            return original(*args, **kwargs)

    model.forward = forward


def _micro_loss(model: nn.Module, teacher: nn.Module, ids: Tensor, cfg, teacher_context=None) -> Tensor:
    """One micro-batch's loss: KD on the logits (+ the hidden-state MSE). The teacher runs without gradients, under
    `teacher_context()` where the student's own forward was patched for mixed precision by accelerate's prepare (its
    autocast, and the teacher's weights cast once: _Training.teacher_context)."""
    with torch.no_grad(), (teacher_context() if teacher_context is not None else contextlib.nullcontext()):
        t_out = teacher(input_ids=ids, output_hidden_states=cfg.hidden_weight > 0, use_cache=False)
    s_out = model(input_ids=ids, output_hidden_states=cfg.hidden_weight > 0, use_cache=False)
    loss = kd_loss(s_out.logits, t_out.logits, cfg.temperature)
    if cfg.hidden_weight > 0:
        t_h, s_h = t_out.hidden_states[-1].float(), s_out.hidden_states[-1].float()
        loss = loss + cfg.hidden_weight * F.mse_loss(s_h, t_h) / t_h.var().clamp_min(1e-12)
    return loss


def _latest_checkpoint(work_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (work_dir / "checkpoints").glob(f"step-*/{STATE_FILE}"))
    return done[-1] if done else None


def _check_inputs(student: nn.Module, teacher: nn.Module, train_ids: Tensor, cfg) -> None:
    if train_ids.ndim != 2 or train_ids.dtype != torch.long or train_ids.shape[1] != cfg.seq_len:
        raise ValueError(f"train_ids is {train_ids.dtype} {tuple(train_ids.shape)}; distill needs int64 "
                         f"windows [N, seq_len={cfg.seq_len}] (cut the text into seq_len windows or set seq_len)")
    if cfg.hidden_weight > 0 and student.config.hidden_size != teacher.config.hidden_size:
        raise ValueError(f"hidden_weight={cfg.hidden_weight} needs equal hidden sizes, but student has "
                         f"{student.config.hidden_size} and teacher {teacher.config.hidden_size}; "
                         f"set hidden_weight: 0 (width-pruned students match logits only)")


def _check_accelerator(acc, cfg, n_rows: int) -> None:
    if acc.gradient_accumulation_steps != cfg.grad_accum:
        raise ValueError(f"accelerator accumulates {acc.gradient_accumulation_steps} micro-batches but "
                         f"grad_accum={cfg.grad_accum}; create it with gradient_accumulation_steps={cfg.grad_accum}")
    if acc._models or acc._optimizers:  # save_state would checkpoint those too, and load_state mismatch
        raise ValueError("the accelerator already holds prepared objects; pass a fresh Accelerator "
                         "or call accelerator.free_memory() first")
    rows_per_step = cfg.batch_size * cfg.grad_accum * acc.num_processes
    if n_rows < rows_per_step:
        raise ValueError(f"{n_rows} training windows, but one step needs batch_size * grad_accum * "
                         f"processes = {rows_per_step}; add windows or lower batch_size/grad_accum")


class _Training:
    """One distillation in progress: the prepared (or sharded) student and teacher, the optimizer and schedule, and
    what a checkpoint keeps (step, recovery curve, training seconds, the teacher's scores)."""

    def __init__(self, student: nn.Module, teacher: nn.Module, cfg, acc, work_dir: Path, log):
        self.student, self.teacher, self.cfg, self.acc, self.work_dir = student, teacher, cfg, acc, work_dir
        self.main, self.processes = acc.is_main_process, acc.num_processes
        self.say = log if self.main else (lambda *_: None)
        self.rows_per_step = cfg.batch_size * cfg.grad_accum * self.processes
        self.tokens_per_step = self.rows_per_step * cfg.seq_len
        self.step, self.curve, self.seconds, self.teacher_scores, self.resumed_from = 0, [], 0.0, None, None
        self.trainable = [p for p in student.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the student has no parameter with requires_grad=True (a copy of a frozen teacher?); "
                             "call student.requires_grad_(True) before distill")
        self._prepare()

    def _prepare(self) -> None:
        cfg, acc = self.cfg, self.acc
        self.teacher.eval().requires_grad_(False).to(acc.device)
        fsdp = bool(getattr(cfg, "fsdp", False))
        self.sharded = fsdp and self.processes > 1
        if fsdp and self.processes == 1:
            self.say("distill: fsdp asks to shard over processes, and this is one process: training unsharded")
        self.had_input_grads_hook = hasattr(self.student, "_require_grads_hook")  # transformers 5 adds one
        if cfg.gradient_checkpointing:
            _set_checkpointing(self.student, True)
        self.student.train()
        self.teach = self.teacher
        if self.sharded:  # FSDP2: the copies train, the originals are released until gather_into (fsdp.py)
            from .fsdp import shard

            self.model, self.teach = shard(self.student, acc.device), shard(self.teacher, acc.device)
            self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.lr,
                                           betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        # Not prepared: accelerate's scheduler wrapper steps num_processes times per step; its state goes in
        # STATE_FILE.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(s, cfg) / cfg.lr)
        self.teacher_casts = []
        if not self.sharded:
            self.model, self.optimizer = acc.prepare(self.student, self.optimizer)
            _autocast_only(self.student, acc)
            dtype = _AUTOCAST_DTYPES.get(acc.mixed_precision)
            if dtype is not None:  # the teacher's float32 weights cast once, not at every step (core/nn.py)
                self.teacher_casts = cast_linear_weights(self.teacher, dtype)

    @contextlib.contextmanager
    def teacher_context(self):
        """The teacher's forward in a training step: under the accelerator's autocast, on its weights cast once."""
        with self.acc.autocast(), swapped_weights(self.teacher_casts):
            yield

    def resume(self) -> None:
        cfg, work_dir = self.cfg, self.work_dir
        ckpt = _latest_checkpoint(work_dir)
        if ckpt is None:
            raise FileNotFoundError(f"resume=True but {work_dir / 'checkpoints'} holds no complete checkpoint "
                                    f"(step-*/{STATE_FILE}); run without resume")
        check_resume_dir(ckpt)  # a truncated or corrupt checkpoint is refused with the way out (integrity.py)
        state = json.loads((ckpt / STATE_FILE).read_text())
        changed = [k for k in _RESUME_FIXED if state["config"][k] != getattr(cfg, k)]
        if state.get("sharded") != ("fsdp" if self.sharded else None):
            changed.append("fsdp")
        if changed or state["processes"] != self.processes:
            raise ValueError(f"{ckpt} was written with other {changed or 'processes'} than this run; "
                             f"resume with the same settings or start a new work_dir")
        self.scheduler.load_state_dict(state["scheduler"])
        if self.sharded:
            from .fsdp import load_local

            load_local(ckpt, self.acc.process_index, self.model, self.optimizer)
            # the optimizer's own state_dict, which accelerate restores, would carry the learning rate
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        else:
            self.acc.load_state(str(ckpt))
        self.step = self.resumed_from = state["step"]
        self.curve, self.seconds, self.teacher_scores = state["curve"], state["seconds"], state["teacher"]
        self.say(f"distill: resumed from {ckpt} at step {self.step}/{cfg.steps}")

    def _scores(self, eval_ids: Tensor) -> dict:
        acc = self.acc
        raw = (self.model if self.sharded else acc.unwrap_model(self.model)).eval()
        if self.sharded:  # through each root forward (FSDP gathers units only inside it): one window's whole logits
            def whole(m):
                return lambda k, ids: m(input_ids=ids, use_cache=False).logits[0, :-1].float()

            scores = score_hidden({"teacher": whole(self.teach), "student": whole(raw)},
                                  {"teacher": lambda x: x, "student": lambda x: x}, eval_ids,
                                  baseline="teacher", device=str(acc.device), progress=False)
        else:
            scores = score_windows({"teacher": self.teach, "student": raw}, eval_ids, baseline="teacher",
                                   device=str(acc.device), progress=False)
        raw.train()
        return scores

    def evaluate(self, loss_sum: Tensor, n: int, eval_ids: Tensor | None) -> None:
        acc = self.acc
        mean_loss = float(acc.reduce(loss_sum, "mean")) / n if n else None  # collective: all ranks
        point = {"step": self.step, "tokens": self.step * self.tokens_per_step, "seconds": round(self.seconds, 3),
                 "ppl": None, "kl": None, "train_loss": mean_loss}
        if eval_ids is not None and (self.main or self.sharded):  # a sharded model's forward needs every process
            scores = self._scores(eval_ids)
            point["ppl"], point["kl"] = scores["student"].ppl, scores["student"].kl
            self.teacher_scores = self.teacher_scores or {"ppl": scores["teacher"].ppl, "nll": scores["teacher"].nll,
                                                          "tokens": scores["teacher"].tokens}
        self.curve.append(point)
        self.say(f"distill step {self.step}/{self.cfg.steps}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in point.items() if k != "step" and v is not None))
        acc.wait_for_everyone()

    def checkpoint(self) -> None:
        acc, work_dir = self.acc, self.work_dir
        folder = work_dir / "checkpoints" / f"step-{self.step:06d}"
        if self.sharded:  # every process its own shards
            from .fsdp import save_local

            save_local(folder, acc.process_index, self.model, self.optimizer)
        else:
            acc.save_state(str(folder))  # model as safetensors; optimizer, RNG and step counter from accelerate
        acc.wait_for_everyone()  # all written before the state file commits the checkpoint
        if self.main:
            state = {"step": self.step, "curve": self.curve, "tokens": self.step * self.tokens_per_step,
                     "seconds": self.seconds, "teacher": self.teacher_scores, "processes": self.processes,
                     "scheduler": self.scheduler.state_dict(), "sharded": "fsdp" if self.sharded else None,
                     "config": asdict(self.cfg)}
            (folder / STATE_FILE).write_text(json.dumps(state, indent=1))
            for old in sorted((work_dir / "checkpoints").glob("step-*"))[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def train_step(self, train_ids: Tensor, loss_sum: Tensor) -> Tensor:
        """One optimizer step over grad_accum micro-batches, each adding its share of the step's loss to `loss_sum`
        (in place); returns the last micro-batch's loss."""
        cfg, acc, model = self.cfg, self.acc, self.model
        for k, rows in enumerate(_step_rows(self.step, train_ids.shape[0], cfg, acc.process_index, self.processes)):
            ids = train_ids[rows].to(acc.device)  # [batch_size, seq_len]
            if self.sharded:  # gradients reduce-scattered at every micro-batch, so they stay sharded in between
                with acc.autocast():
                    loss = _micro_loss(model, self.teach, ids, cfg)
                (loss / cfg.grad_accum).backward()  # what acc.backward does inside acc.accumulate
                if k == cfg.grad_accum - 1:
                    torch.nn.utils.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            else:
                with acc.accumulate(model):
                    loss = _micro_loss(model, self.teach, ids, cfg, self.teacher_context)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            loss_sum += loss.detach().float() / cfg.grad_accum
        return loss

    def finish(self) -> None:
        """The originals hold the trained values (gathered from the shards, on every process), in eval mode, with
        what training switched on switched off again."""
        student, acc = self.student, self.acc
        if self.sharded:
            from .fsdp import gather_into

            gather_into(student, self.model)
            gather_into(self.teacher, self.teach)
            del self.model, self.teach, self.optimizer, self.trainable
        else:
            _restore_forward(student)
            self.teacher_casts = []
        student.eval()
        if self.cfg.gradient_checkpointing:
            _set_checkpointing(student, False)
            if not self.had_input_grads_hook and hasattr(student, "_require_grads_hook"):
                student.disable_input_require_grads()
        acc.wait_for_everyone()
        acc.free_memory()


def distill(student: nn.Module, teacher: nn.Module, train_ids: Tensor, cfg, work_dir: Path, *,
            eval_ids: Tensor | None = None, resume: bool = False, accelerator=None,
            progress: bool = True, log=print) -> dict:
    """Distill `teacher` into `student` in place; return throughput and the recovery curve.

    A passed `accelerator` must have gradient_accumulation_steps == cfg.grad_accum and nothing else
    prepared; distill releases what it prepared (accelerator.free_memory()) before returning.
    """
    _check_inputs(student, teacher, train_ids, cfg)
    acc = accelerator if accelerator is not None else _new_accelerator(cfg)
    _check_accelerator(acc, cfg, train_ids.shape[0])
    run = _Training(student, teacher, cfg, acc, Path(work_dir), log)
    if resume:
        run.resume()
    start_step = run.step
    if run.step == 0:
        run.evaluate(torch.zeros((), device=acc.device), 0, eval_ids)
    run.say(f"distill: {cfg.steps - run.step} steps x {run.rows_per_step} windows x {cfg.seq_len} tokens on "
            f"{run.processes} process(es), mixed precision {acc.mixed_precision}")
    bar = tqdm(total=cfg.steps, initial=run.step, desc="distill", unit="step", disable=not (progress and run.main))
    loss_sum, n_loss = torch.zeros((), device=acc.device), 0
    while run.step < cfg.steps:
        t0 = time.perf_counter()
        loss = run.train_step(train_ids, loss_sum)
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        run.step, n_loss = run.step + 1, n_loss + 1
        run.seconds += time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}")
        if run.step == cfg.steps or (cfg.eval_every and run.step % cfg.eval_every == 0):
            run.evaluate(loss_sum, n_loss, eval_ids)
            loss_sum, n_loss = torch.zeros((), device=acc.device), 0
        if cfg.checkpoint_every and (run.step % cfg.checkpoint_every == 0 or run.step == cfg.steps):
            run.checkpoint()
    bar.close()
    run.finish()
    step, seconds = run.step, run.seconds
    tokens = step * run.tokens_per_step
    if step > start_step:
        run.say(f"distill: {step - start_step} steps in {seconds:.1f} s training time, "
                f"{tokens / max(seconds, 1e-9):.0f} tokens/s")
    return {"steps": step, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
            "processes": run.processes, "sharded": "fsdp" if run.sharded else None,
            "mixed_precision": acc.mixed_precision, "curve": run.curve,
            "teacher": run.teacher_scores, "resumed_from": run.resumed_from, "config": asdict(cfg)}
