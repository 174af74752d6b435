"""One rank of the multi-process distill test: `torchrun --nproc_per_node 2 tests/distill_worker.py OUT [--fsdp]`.

Every rank builds the same tiny llama teacher, noisy student and training windows, distills for 3 steps
(2 micro-batches each, evaluated on rank 0 only),
and writes OUT/rank-<i>.json: the sha256 of its initial and final student parameters and of the
windows its teacher saw at step 0 (recorded by a forward pre-hook, so it is what the rank trained on).
Also whether the teacher came back unchanged and the AdamW moments this rank held (their local elements); rank 0
writes the initial and final student to OUT/initial.safetensors and OUT/student.safetensors. --fsdp shards student
and teacher over the processes; --checkpoint-every N, --crash-at S (raise during step S) and --resume test the
checkpoints.
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # two OpenMP threads stall on the 2-core CI machines
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compress.distill.kd import distill  # noqa: E402
from compress.stages.distill import DistillStage  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402


def params_sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(out: Path, fsdp: bool = False, batch_size: int = 2, checkpoint_every: int = 0, crash_at: int = -1,
         resume: bool = False) -> None:
    teacher = make_tiny_model("llama", seed=0)
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    train_ids = torch.randint(0, 256, (32, 16), generator=g)
    eval_ids = torch.randint(0, 256, (2, 16), generator=g)
    initial = params_sha(student)
    initial_state = {k: v.clone() for k, v in student.state_dict().items()}
    seen = []
    # training micro-batches only (evaluation windows go one at a time; with fsdp through the same forward)
    hook = teacher.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["input_ids"].clone()) if len(kwargs["input_ids"]) > 1 else None,
        with_kwargs=True)
    teacher_before = params_sha(teacher)
    moments = []

    def count_moments(optimizer, args, kwargs):
        local = [s["exp_avg"] for s in optimizer.state.values()]
        moments.append(sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in local))
        if len(moments) == crash_at + 1:  # killed during step crash_at (0-based), after its optimizer step
            raise KeyboardInterrupt

    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(count_moments)
    cfg = DistillStage(steps=3, batch_size=batch_size, grad_accum=2, seq_len=16, lr=1e-3, min_lr=1e-4, warmup_steps=0,
                       eval_every=0, checkpoint_every=checkpoint_every, fsdp=fsdp)
    result = distill(student, teacher, train_ids, cfg, out / "work", eval_ids=eval_ids, progress=False,
                     log=lambda m: None, resume=resume)
    from accelerate.state import PartialState
    state = PartialState()
    hook.remove()
    if state.process_index == 0:
        from safetensors.torch import save_file
        save_file({k: v.detach().clone() for k, v in student.state_dict().items()}, str(out / "student.safetensors"))
        save_file({k: v.detach().clone() for k, v in initial_state.items()}, str(out / "initial.safetensors"))
    step0 = torch.cat(seen[:cfg.grad_accum])  # step 0's micro-batches, [grad_accum * batch_size, seq_len]
    (out / f"rank-{state.process_index}.json").write_text(json.dumps({
        "rank": state.process_index, "processes": result["processes"], "tokens": result["tokens"],
        "curve_kl": [p["kl"] for p in result["curve"]],
        "initial_sha": initial, "final_sha": params_sha(student),
        "step0_rows": sorted(hashlib.sha256(r.numpy().tobytes()).hexdigest() for r in step0),
        "teacher_unchanged": params_sha(teacher) == teacher_before, "moments": moments[-1],
        "sharded": result["sharded"], "train_loss": [p["train_loss"] for p in result["curve"]],
    }))


if __name__ == "__main__":
    flags = sys.argv[2:]

    def value(flag: str, default: int) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else default

    main(Path(sys.argv[1]), fsdp="--fsdp" in flags, checkpoint_every=value("--checkpoint-every", 0),
         crash_at=value("--crash-at", -1), resume="--resume" in flags)
