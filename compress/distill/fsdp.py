"""Sharded training state for distillation over several processes (torch FSDP2, `fully_shard`).

With `distill.fsdp: true` under torchrun / `accelerate launch`, the student and the teacher are each replaced, for
the duration of the distillation, by a copy whose parameters are split over the processes: every decoder block is
its own FSDP unit (all-gathered for its forward and backward, freed after), the rest is the root unit. Gradients are
reduce-scattered and AdamW's moments exist only for each process's shard, so a process holds about
(student + teacher) / processes of parameters plus 3 × student / processes of gradients and moments, where plain
data parallelism (DDP) holds all of it on every process. The original modules' parameters are released (emptied, the
Parameter objects kept) while the copies train, and refilled from the copies at the end, so the caller's objects are
the ones trained, as in the unsharded path.

Checkpoints are each process's local shards as safetensors (`shard-R.safetensors`: parameters, AdamW moments and
step), never pickles; a resume needs the same number of processes.

Works on CPU processes over gloo (tested here with 2) and on GPUs over NCCL.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..arch import get_arch


def shard(module: nn.Module, device) -> nn.Module:
    """A copy of `module` sharded over the process group, holding its values; `module`'s own parameters are released
    (`gather_into` refills them; its buffers, small, stay)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    sharded = copy.deepcopy(module, memo)  # the same modules and tied parameters, nothing allocated
    for block in get_arch(sharded).block_list(sharded):
        fully_shard(block)
    fully_shard(sharded)
    sharded.to_empty(device=device)
    # each process keeps its own slice of every parameter (the full values are on every process already)
    set_model_state_dict(sharded, module.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        for name, b in module.named_buffers():  # buffers are not sharded; non-persistent ones (rotary) are not in
            sharded.get_buffer(name).copy_(b)  # the state dict
    for p in module.parameters():  # released; the Parameter objects (and their ties) stay for gather_into
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return sharded


def resharded(model: nn.Module) -> nn.Module:
    """Every unit of `model` back to its shards (the root stays gathered after a forward without a backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model


def gather_into(module: nn.Module, sharded: nn.Module) -> None:
    """Refill `module` (released by `shard`) with the full values of `sharded`, one parameter at a time; every process
    takes part (all-gathers) and ends with the same full module."""
    resharded(sharded)
    with torch.no_grad():
        mine = dict(sharded.named_parameters())
        for name, p in module.named_parameters():
            p.data = mine[name].full_tensor().contiguous()


def save_local(folder: Path, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """This process's shards of the parameters and of the AdamW state, as safetensors."""
    from safetensors.torch import save_file

    tensors = {}
    for name, p in resharded(model).named_parameters():
        tensors[f"param.{name}"] = p.to_local().detach().contiguous()
        for key, value in optimizer.state.get(p, {}).items():
            value = value.to_local() if hasattr(value, "to_local") else value
            tensors[f"optim.{name}.{key}"] = value.detach().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / f"shard-{rank}.safetensors"))


def load_local(folder: Path, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Inverse of save_local, into a freshly sharded model and its new optimizer."""
    from safetensors.torch import load_file

    path = folder / f"shard-{rank}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was written by fewer processes, or is incomplete")
    saved = load_file(str(path))
    with torch.no_grad():
        for name, p in resharded(model).named_parameters():
            p.to_local().copy_(saved[f"param.{name}"])
            keys = [k[len(f"optim.{name}."):] for k in saved if k.startswith(f"optim.{name}.")]
            if not keys:
                continue
            state = optimizer.state[p]
            for key in keys:
                value = saved[f"optim.{name}.{key}"]
                if key == "step":
                    state[key] = value.clone()
                else:
                    state[key] = torch.zeros_like(p)
                    state[key].to_local().copy_(value)
