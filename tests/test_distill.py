"""Knowledge-distillation repair: the KD loss and schedule against hand formulas, recovery on a tiny
noisy student, exact resume from an accelerate checkpoint, and 2-process DDP over gloo."""
from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compress.distill.kd import distill, kd_loss, lr_at, native_bf16
from compress.stages.distill import DistillStage
from tests.conftest import TINY_CONFIGS, make_tiny_model

torch.set_num_threads(1)  # two OpenMP threads stall on the 2-core CI machines
REPO = Path(__file__).resolve().parents[1]
QUIET = dict(progress=False, log=lambda m: None)


def noisy_copy(model: torch.nn.Module, std: float = 0.05, seed: int = 1) -> torch.nn.Module:
    student = copy.deepcopy(model).requires_grad_(True)  # distill freezes the teacher it was copied from
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(std * torch.randn(p.shape, generator=g))
    return student


def random_ids(rows: int, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def kd_reference(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """T**2 * mean over tokens of sum_v p_t (log p_t - log p_s), explicit softmax in fp64."""
    s, te = student.double().reshape(-1, student.shape[-1]) / t, teacher.double().reshape(-1, teacher.shape[-1]) / t
    log_ps = s - torch.log(torch.exp(s).sum(-1, keepdim=True))
    log_pt = te - torch.log(torch.exp(te).sum(-1, keepdim=True))
    return (torch.exp(log_pt) * (log_pt - log_ps)).sum(-1).mean() * t * t


@pytest.mark.parametrize("temperature", [1.0, 2.5, 0.5])
def test_kd_loss_matches_reference_and_gradient(temperature):
    student = (3 * torch.randn(2, 5, 11)).requires_grad_()
    teacher = 3 * torch.randn(2, 5, 11)
    loss = kd_loss(student, teacher, temperature)
    torch.testing.assert_close(loss.double(), kd_reference(student.detach(), teacher, temperature),
                               rtol=1e-5, atol=1e-6)
    loss.backward()
    # d/dz_s [T^2 KL(p_t || p_s)] = T (p_s - p_t) / tokens
    expected = temperature * (torch.softmax(student.detach() / temperature, -1)
                              - torch.softmax(teacher / temperature, -1)) / 10
    torch.testing.assert_close(student.grad, expected, rtol=1e-4, atol=1e-6)
    assert kd_loss(teacher, teacher.clone(), temperature).abs().item() < 1e-6


def test_kd_loss_chunks_rows_and_keeps_the_logits_dtype():
    """More rows than one chunk (the chunk loop's seams and the ragged last chunk), bfloat16 logits as autocast makes
    them: the loss and the gradient are the float64 reference's on the same bfloat16 values, and the gradient comes
    back in bfloat16, as the unfused .float() would have returned it."""
    from compress.distill import kd

    student = (3 * torch.randn(3, 2 * kd.KD_CHUNK_ROWS + 5, 37)).bfloat16().requires_grad_()
    teacher = (3 * torch.randn(3, 2 * kd.KD_CHUNK_ROWS + 5, 37)).bfloat16()
    loss = kd_loss(student, teacher, 2.0)
    torch.testing.assert_close(loss.double(), kd_reference(student.detach().float(), teacher.float(), 2.0),
                               rtol=1e-5, atol=1e-7)
    (3 * loss).backward()
    rows = student.shape[0] * student.shape[1]
    expected = 3 * 2.0 * (torch.softmax(student.detach().double() / 2.0, -1)
                          - torch.softmax(teacher.double() / 2.0, -1)) / rows
    assert student.grad.dtype == torch.bfloat16
    torch.testing.assert_close(student.grad.double(), expected, rtol=1e-2, atol=1e-7)


def test_kd_loss_gradient_is_the_same_however_the_rows_are_cut(monkeypatch):
    """On two threads the rows go to two workers in chunks of KD_CHUNK_ROWS_CPU; the gradient is the one a single
    chunk on one thread makes, bit for bit (each row's terms depend on that row alone), and the loss equals it to
    float64 rounding (its sum's order is the only difference)."""
    from compress.distill import kd
    from compress.threads import cpu_threads

    student = (3 * torch.randn(2, 8 * kd.KD_CHUNK_ROWS_CPU + 3, 50)).bfloat16()
    teacher = (3 * torch.randn(2, 8 * kd.KD_CHUNK_ROWS_CPU + 3, 50)).bfloat16()

    def run(threads: int, temperature: float):
        s = student.clone().requires_grad_()
        with cpu_threads(threads):
            loss = kd_loss(s, teacher, temperature)
            loss.backward()
        return loss, s.grad

    for temperature in (1.0, 2.0):
        cut_loss, cut_grad = run(2, temperature)
        monkeypatch.setattr(kd, "KD_CHUNK_ROWS_CPU", 10_000)
        whole_loss, whole_grad = run(1, temperature)
        monkeypatch.undo()
        assert torch.equal(cut_grad, whole_grad)
        torch.testing.assert_close(cut_loss, whole_loss, rtol=1e-6, atol=0)


def test_teacher_runs_on_weights_cast_once(tmp_path):
    """Under bf16 autocast the teacher's linear layers run on bfloat16 copies made once (core/nn.py:
    cast_linear_weights), where autocast would cast each float32 weight at every forward: the same logits bit for
    bit; outside the teacher's forward, and after distill, the teacher holds its own float32 weights (the tied head
    tied again)."""
    from compress.core.nn import cast_linear_weights, swapped_weights

    teacher = make_tiny_model("llama")
    teacher.config.tie_word_embeddings = True
    teacher.tie_weights()
    ids = random_ids(2, 16, 0)
    casts = cast_linear_weights(teacher, torch.bfloat16)
    assert casts and all(c.dtype == torch.bfloat16 and w.dtype == torch.float32 for _, w, c in casts)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = teacher(input_ids=ids).logits
        with swapped_weights(casts):
            assert teacher.lm_head.weight.dtype == torch.bfloat16
            cast = teacher(input_ids=ids).logits
    assert torch.equal(plain, cast)
    assert teacher.lm_head.weight is teacher.model.embed_tokens.weight
    assert cast_linear_weights(teacher, torch.bfloat16, free=0) == []  # no room: autocast casts as before
    assert cast_linear_weights(teacher, torch.float32) == []  # nothing narrower to cast to

    seen = []
    student = noisy_copy(teacher)
    teacher.lm_head.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    cfg = DistillStage(steps=2, batch_size=2, seq_len=16, lr=1e-3, min_lr=1e-4, warmup_steps=0, eval_every=0,
                       checkpoint_every=0, mixed_precision="bf16")
    distill(student, teacher, random_ids(8, 16, 4), cfg, tmp_path, **QUIET)
    assert seen and set(seen) == {torch.bfloat16}
    assert teacher.lm_head.weight is teacher.model.embed_tokens.weight
    assert teacher.lm_head.weight.dtype == torch.float32


def test_kd_loss_rejects_other_vocab():
    with pytest.raises(ValueError, match="same vocabulary"):
        kd_loss(torch.randn(3, 8), torch.randn(3, 9), 1.0)


def test_lr_schedule_warmup_then_cosine_to_min_lr():
    cfg = DistillStage(steps=26, warmup_steps=5, lr=1e-3, min_lr=1e-4)
    lrs = [lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == 0.0
    assert lrs[:6] == pytest.approx([0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3])  # linear, peak at warm-up end
    assert max(lrs) == pytest.approx(1e-3)
    assert lrs[15] == pytest.approx(5.5e-4)  # cosine midpoint (steps 5..25) = (lr + min_lr) / 2
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[5:], lrs[6:]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=10, warmup_steps=10), "warmup_steps < steps"),
    (dict(steps=0), "positive integer"),
    (dict(batch_size=2.5), "positive integer"),
    (dict(lr=1e-4, min_lr=1e-3), "min_lr <= lr"),
    (dict(min_lr=0.0), "min_lr <= lr"),
    (dict(temperature=0.0), "temperature > 0"),
    (dict(eval_every=-1), ">= 0"),
    (dict(hidden_weight=-1.0), ">= 0"),
    (dict(mixed_precision="fp16"), "'auto', 'no' or 'bf16'"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillStage(**kwargs)


def test_distill_reduces_kl_to_teacher(tmp_path):
    teacher = make_tiny_model("llama")
    student = noisy_copy(teacher)
    cfg = DistillStage(steps=30, batch_size=4, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=3,
                       eval_every=10, checkpoint_every=0)
    out = distill(student, teacher, random_ids(64, 32, 2), cfg, tmp_path, eval_ids=random_ids(4, 32, 3), **QUIET)
    curve = out["curve"]
    assert [p["step"] for p in curve] == [0, 10, 20, 30]
    assert [p["tokens"] for p in curve] == [0, 1280, 2560, 3840]
    # auto: bf16 autocast where the hardware has native bf16 (AMX / AVX512-BF16 CPUs, bf16 GPUs), else float32
    assert out["tokens"] == 3840 and out["processes"] == 1
    assert out["mixed_precision"] == ("bf16" if native_bf16() else "no")
    assert out["resumed_from"] is None and out["teacher"]["ppl"] > 1
    # measured: KL 0.103 -> 0.016 nats/token (ratio 0.16), the same with float32 and bf16 autocast
    assert curve[-1]["kl"] < 0.35 * curve[0]["kl"]
    assert curve[-1]["train_loss"] < curve[1]["train_loss"]
    assert not student.training and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in student.parameters())


def test_distill_runs_twice_in_one_process_with_other_settings(tmp_path, monkeypatch):
    from compress.distill import kd

    seen = []  # the dtype of the student's logits as the loss receives them
    monkeypatch.setattr(kd, "kd_loss", lambda s, t, temp: seen.append(s.dtype) or kd_loss(s, t, temp))
    teacher = make_tiny_model("qwen2")
    # accelerate's AcceleratorState singleton refuses a second Accelerator with another mixed_precision
    for grad_accum, mixed_precision in ((1, "bf16"), (2, "no")):
        student = noisy_copy(teacher)
        before = [p.clone() for p in student.parameters()]
        cfg = DistillStage(steps=2, batch_size=2, grad_accum=grad_accum, seq_len=16, lr=1e-3, min_lr=1e-4,
                           warmup_steps=0, eval_every=0, checkpoint_every=0, mixed_precision=mixed_precision)
        out = distill(student, teacher, random_ids(8, 16, 4), cfg, tmp_path / str(grad_accum), **QUIET)
        assert out["tokens"] == 2 * 2 * grad_accum * 16 and out["mixed_precision"] == mixed_precision
        # accelerate's autocast patch of forward is undone and HF's forward decorators survive
        assert "forward" not in student.__dict__
        assert isinstance(student(input_ids=random_ids(1, 16, 0), return_dict=False), tuple)
        assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters()))
        # under bf16 autocast the logits reach the loss as the autocast matmul made them: accelerate's conversion of
        # the outputs to float32 (a [tokens, vocab] copy per micro-batch) is dropped (kd._autocast_only)
        assert set(seen) == {torch.bfloat16 if mixed_precision == "bf16" else torch.float32}
        seen.clear()


def test_gradient_checkpointing_gives_the_same_weights(tmp_path):
    teacher = make_tiny_model("phi3")
    initial = noisy_copy(teacher)
    students, checkpointing_on = [], []
    for gc in (False, True):
        students.append(copy.deepcopy(initial))
        calls = []  # per training forward of layer 0: was checkpointing active
        students[-1].model.layers[0].register_forward_pre_hook(
            lambda m, a: calls.append(bool(m.gradient_checkpointing and m.training)))
        cfg = DistillStage(steps=2, batch_size=2, seq_len=16, lr=1e-3, min_lr=1e-4, warmup_steps=0, eval_every=0,
                           checkpoint_every=0, gradient_checkpointing=gc)
        distill(students[-1], teacher, random_ids(4, 16, 10), cfg, tmp_path / str(gc), **QUIET)
        checkpointing_on.append(calls)
    assert checkpointing_on == [[False, False], [True, True]]  # checkpointing was on in training forwards
    assert not any(getattr(m, "gradient_checkpointing", False) for m in students[1].modules())  # disabled after
    assert not hasattr(students[1], "_require_grads_hook")
    for a, b in zip(*(s.parameters() for s in students)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(initial.parameters(), students[0].parameters()))


def test_resume_continues_exactly(tmp_path):
    teacher = make_tiny_model("llama")
    initial = noisy_copy(teacher)
    train_ids, eval_ids = random_ids(24, 16, 5), random_ids(2, 16, 6)
    cfg = DistillStage(steps=8, batch_size=2, grad_accum=2, seq_len=16, lr=2e-3, min_lr=2e-4, warmup_steps=2,
                       eval_every=4, checkpoint_every=2, keep_checkpoints=2)

    with pytest.raises(FileNotFoundError, match="checkpoints"):
        distill(copy.deepcopy(initial), teacher, train_ids, cfg, tmp_path, resume=True, **QUIET)

    student_a = copy.deepcopy(initial)
    run_a = distill(student_a, teacher, train_ids, cfg, tmp_path, eval_ids=eval_ids, **QUIET)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000006", "step-000008"]  # keep_checkpoints=2
    assert (ckpts / "step-000008" / "model.safetensors").is_file()
    shutil.move(ckpts / "step-000008", tmp_path / "a-step-000008")

    student_b = copy.deepcopy(initial)
    run_b = distill(student_b, teacher, train_ids, cfg, tmp_path, eval_ids=eval_ids, resume=True, **QUIET)
    assert run_b["resumed_from"] == 6 and run_b["steps"] == 8 and run_b["tokens"] == run_a["tokens"]
    for (name, a), b in zip(student_a.named_parameters(), student_b.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    assert [p["step"] for p in run_b["curve"]] == [0, 4, 8]
    assert run_b["curve"][:2] == run_a["curve"][:2]
    assert run_b["curve"][2]["kl"] == pytest.approx(run_a["curve"][2]["kl"], rel=1e-5)

    # optimizer moments, step counts and the scheduler state after the last step match run A's
    state_a = json.loads((tmp_path / "a-step-000008" / "distill_state.json").read_text())
    state_b = json.loads((ckpts / "step-000008" / "distill_state.json").read_text())
    assert state_b["scheduler"] == state_a["scheduler"] and state_b["scheduler"]["last_epoch"] == 8
    opt_a = torch.load(tmp_path / "a-step-000008" / "optimizer.bin", weights_only=True)
    opt_b = torch.load(ckpts / "step-000008" / "optimizer.bin", weights_only=True)
    assert opt_b["param_groups"][0]["lr"] == pytest.approx(opt_a["param_groups"][0]["lr"])
    for k, sa in opt_a["state"].items():
        assert float(opt_b["state"][k]["step"]) == float(sa["step"]) == 8
        torch.testing.assert_close(opt_b["state"][k]["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-5, atol=1e-12)

    # a finished run resumes to an immediate return with the saved curve and untouched weights
    student_c = copy.deepcopy(student_b)
    run_c = distill(student_c, teacher, train_ids, cfg, tmp_path, eval_ids=eval_ids, resume=True, **QUIET)
    assert run_c["resumed_from"] == 8 and run_c["curve"] == run_b["curve"]
    for a, c in zip(student_b.parameters(), student_c.parameters()):
        assert torch.equal(a, c)


def test_hidden_state_term(tmp_path):
    teacher = make_tiny_model("gemma")
    student = noisy_copy(teacher)
    seen = []
    teacher.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"]), with_kwargs=True)
    losses = {}
    for w in (0.0, 2.0):  # one step: the logged loss is the loss of the initial student on step 0's batch
        cfg = DistillStage(steps=1, batch_size=2, seq_len=16, warmup_steps=0, eval_every=0, checkpoint_every=0,
                           hidden_weight=w)
        out = distill(copy.deepcopy(student), teacher, random_ids(4, 16, 7), cfg, tmp_path / str(w), **QUIET)
        losses[w] = out["curve"][-1]["train_loss"]
    assert torch.equal(seen[0], seen[1])
    with torch.no_grad():
        t_h = teacher(input_ids=seen[0], output_hidden_states=True).hidden_states[-1]
        s_h = student(input_ids=seen[0], output_hidden_states=True).hidden_states[-1]
    expected = 2.0 * ((s_h - t_h) ** 2).mean() / t_h.var()
    assert expected > 1e-3
    assert losses[2.0] - losses[0.0] == pytest.approx(expected.item(), rel=1e-4)


def test_hidden_weight_needs_equal_hidden_sizes(tmp_path):
    teacher = make_tiny_model("llama")
    config = TINY_CONFIGS["llama"]()
    config.hidden_size = 32
    student = type(teacher)(config)
    cfg = DistillStage(steps=2, batch_size=1, seq_len=16, warmup_steps=0, hidden_weight=1.0)
    with pytest.raises(ValueError, match="hidden_weight: 0"):
        distill(student, teacher, random_ids(4, 16, 8), cfg, tmp_path, **QUIET)


def test_input_validation(tmp_path):
    teacher = make_tiny_model("gpt2")
    cfg = DistillStage(steps=2, batch_size=4, grad_accum=2, seq_len=16, warmup_steps=0)
    with pytest.raises(ValueError, match="one step needs"):
        distill(noisy_copy(teacher), teacher, random_ids(7, 16, 9), cfg, tmp_path, **QUIET)
    with pytest.raises(ValueError, match="seq_len=16"):
        distill(noisy_copy(teacher), teacher, random_ids(8, 32, 9), cfg, tmp_path, **QUIET)
    with pytest.raises(ValueError, match="requires_grad_"):
        distill(noisy_copy(teacher).requires_grad_(False), teacher, random_ids(8, 16, 9), cfg, tmp_path, **QUIET)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two(tmp_path, *extra: str, check: bool = True) -> list[dict]:
    # accelerate 1.15: `launch --cpu --num_processes 2` starts ONE process (multi-CPU needs mpirun);
    # `--multi_gpu` goes through torchrun and, with no visible GPU, accelerate picks MULTI_CPU + gloo.
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), str(REPO / "tests" / "distill_worker.py"), str(tmp_path),
           *extra]
    proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=300, capture_output=True, text=True)
    if not check:
        return proc.returncode
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank-{i}.json").read_text()) for i in range(2)]


def test_two_processes_ddp_over_gloo(tmp_path):
    ranks = _launch_two(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["processes"] == 2 for r in ranks)
    assert ranks[0]["tokens"] == 3 * 2 * 2 * 2 * 16  # steps x batch_size x grad_accum x processes x seq_len
    assert all(kl > 0 for kl in ranks[0]["curve_kl"]) and ranks[1]["curve_kl"] == [None, None]  # main evaluates
    assert not set(ranks[0]["step0_rows"]) & set(ranks[1]["step0_rows"])  # each rank its own rows
    assert ranks[0]["final_sha"] == ranks[1]["final_sha"]  # gradients were all-reduced
    assert ranks[0]["final_sha"] != ranks[0]["initial_sha"]


@pytest.mark.slow  # 25 s of two processes; the default suite keeps DDP over two processes (test_two_processes_ddp_over_gloo)
def test_fsdp_over_two_processes_shards_the_state_trains_as_one_process_and_resumes(tmp_path):
    """`fsdp: true` on 2 gloo processes: each holds half of the AdamW moments (the state is sharded, not copied),
    both end with the same full student, the teacher is given back unchanged, and the training equals one process
    taking both processes' rows (batch 4 = 2 × 2): the same training losses and nearly the same weights (AdamW's
    normalised first steps amplify float summation-order differences of near-zero gradients, so not bit for bit).
    Killed during step 2 of 3 with a checkpoint after every step, each process has saved its own shards of the
    student and of AdamW's moments as safetensors, and resuming on 2 processes ends where the uninterrupted run
    ended, bit for bit."""
    from safetensors.torch import load_file

    from tests.distill_worker import main as worker

    ranks = _launch_two(tmp_path / "whole", "--fsdp")
    assert all(r["sharded"] == "fsdp" and r["teacher_unchanged"] for r in ranks)
    assert ranks[0]["final_sha"] == ranks[1]["final_sha"] != ranks[0]["initial_sha"]
    assert not set(ranks[0]["step0_rows"]) & set(ranks[1]["step0_rows"])
    full = sum(p.numel() for p in make_tiny_model("llama", seed=0).parameters())
    assert ranks[0]["moments"] + ranks[1]["moments"] == full and max(r["moments"] for r in ranks) <= full // 2 + 64

    one = tmp_path / "one"
    one.mkdir()
    worker(one, batch_size=4)  # one process taking both ranks' rows
    single = json.loads((one / "rank-0.json").read_text())
    assert single["sharded"] is None and single["initial_sha"] == ranks[0]["initial_sha"]
    assert ranks[0]["train_loss"][1:] == pytest.approx(single["train_loss"][1:], rel=1e-4)
    init, ref, two = (load_file(str(f)) for f in (one / "initial.safetensors", one / "student.safetensors",
                                                 tmp_path / "whole" / "student.safetensors"))
    moved = sum(float((ref[k] - init[k]).norm() ** 2) for k in ref) ** 0.5
    apart = sum(float((two[k] - ref[k]).norm() ** 2) for k in ref) ** 0.5
    assert apart < 0.1 * moved, (apart, moved)  # measured 0.023

    assert _launch_two(tmp_path / "cut", "--fsdp", "--checkpoint-every", "1", "--crash-at", "2", check=False) != 0
    ckpt = tmp_path / "cut" / "work" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000001", "step-000002"]
    assert sorted(p.name for p in (ckpt / "step-000002").iterdir()) == [
        "distill_state.json", "shard-0.safetensors", "shard-1.safetensors"]
    resumed = _launch_two(tmp_path / "cut", "--fsdp", "--checkpoint-every", "1", "--resume")
    assert resumed[0]["final_sha"] == resumed[1]["final_sha"] == ranks[0]["final_sha"]
