"""Data-parallel calibration over processes (`torchrun` / `accelerate launch`): each rank takes a share of the
calibration windows, and before the stages act on a block the statistics its float forward gathered are summed
over the ranks (GPTQ Hessians, |x| sums and token counts) or maxed (|x| maxima), so every rank holds the statistics
of all the windows and quantizes the block identically. The result is the single-process one up to the order of
float summation. Rank 0 writes the output and evaluates; the other ranks only calibrate.

The AWQ / SmoothQuant scale searches replay kept inputs: each rank keeps those of its own windows among the first
`replay_samples` of all windows (`local_keep`), scores every candidate on them, and the candidates' losses are summed
over the ranks (`mean_over_ranks`), so every rank picks the same scales; AWQ's clipping search sees every rank's kept
inputs in the order of all windows (`all_windows`). The kv_cache stage's key and value maxima are maxed over the
ranks (`max_over_ranks`). A stage that declares `data_parallel = False` is refused on more than one process.
A streamed run's per-block checkpoint holds every rank's own inputs, committed by rank 0 after a `barrier`
(stream_run.StreamCheckpoint), so `--resume` continues on the same number of processes.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .observers import BlockObserver


def world() -> tuple[int, int]:
    """(rank, processes) as `accelerate launch` / torchrun set them; (0, 1) in a plain run."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def start(device: str) -> tuple[int, int]:
    """Join the launcher's process group (gloo on CPUs; on GPUs nccl for CUDA tensors and gloo for the CPU ones: the
    token counts, losses and flags reduced here are CPU tensors, which an nccl-only group refuses) when there is
    more than one process."""
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return rank, size


def check_stages(plan) -> None:
    """Refuse, before any work, stages whose statistics are not sums or maxima."""
    why = [f"stage {i} ({stage.name})" for i, stage in enumerate(plan.stages)
           if i in plan.block_stages and not stage.data_parallel]
    if why:
        raise ValueError(f"data-parallel calibration does not support {', '.join(why)} yet: run this recipe in one "
                         "process (without torchrun / accelerate launch)")


def share(samples: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's calibration windows: every size-th, from its rank."""
    if samples.shape[0] < size:
        raise ValueError(f"{samples.shape[0]} calibration windows for {size} processes: raise calibration.n_samples "
                         f"to at least {size}")
    return samples[rank::size]


def reduce_stats(observer: BlockObserver) -> None:
    """Sum (Hessians, |x| sums, token counts) and max (|x| maxima) the block's statistics over the ranks, in
    place; every rank observed the same layers, in the same order. A MoE expert may have been routed tokens on
    one rank and none on another: the ranks first agree which layers anyone saw and which share one input (the
    first reader's index, maxed), and a rank that saw none of a layer's inputs joins with zeros."""
    names = observer.linears
    alias = torch.full((len(names),), -1, dtype=torch.int64)
    first: dict[int, int] = {}
    for i, name in enumerate(names):
        st = observer.stats.get(name)
        if st is not None:
            alias[i] = first.setdefault(id(st), i)
    dist.all_reduce(alias, op=dist.ReduceOp.MAX)
    for i, name in enumerate(names):
        a = int(alias[i])
        if a < 0 or name in observer.stats:
            continue
        observer.stats[name] = observer.stats[names[a]] if a != i else \
            observer.empty_stats(observer.block.get_submodule(name))
    seen: set[int] = set()
    for name in observer.linears:
        st = observer.stats.get(name)
        if st is None or id(st) in seen:
            continue
        seen.add(id(st))
        for attr, op in (("hessian", dist.ReduceOp.SUM), ("abs_sum", dist.ReduceOp.SUM),
                         ("abs_max", dist.ReduceOp.MAX)):
            t = getattr(st, attr)
            if t is not None:
                dist.all_reduce(t, op=op)
        tokens = torch.tensor([st.tokens], dtype=torch.float64)
        dist.all_reduce(tokens)
        st.tokens = int(tokens.item())


def reduce_sums(values: list[float]) -> list[float]:
    """Floats summed over the ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def local_keep(keep: int, rank: int, size: int) -> int:
    """How many of this rank's windows are among the first `keep` of all windows (rank r holds r, r + size, ...)."""
    return max(0, -(-(keep - rank) // size))


def total_over_ranks(value: int) -> int:
    """An integer summed over the ranks (in one process: itself)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def mean_over_ranks(values: list[float]) -> float:
    """The mean of per-window losses over every rank's windows (in one process: over `values`, as before)."""
    if not active():
        return sum(values) / len(values)
    t = torch.tensor([sum(values), float(len(values))], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def all_windows(kept: list[torch.Tensor], at: list[int] | None = None) -> list[torch.Tensor]:
    """Per-window tensors of every rank, in the order of all windows (rank r's local window i is window i·size + r);
    in one process, `kept` itself. `at`: the local window of each tensor, where not every window has one (a MoE
    expert no token of a window was routed to); by default tensor i is local window i. Exchanged with
    all_gather_object: between this run's own processes."""
    if not active():
        return kept
    size, rank = dist.get_world_size(), dist.get_rank()
    at = list(range(len(kept))) if at is None else at
    parts: list = [None] * size
    dist.all_gather_object(parts, [(i * size + rank, t.cpu()) for i, t in zip(at, kept)])
    device = kept[0].device if kept else "cpu"
    return [t.to(device) for _, t in sorted((p for part in parts for p in part), key=lambda p: p[0])]


def max_over_ranks(records: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-name lists of maxima (the kv_cache stage's max |k|, max |v|) maxed over the ranks (in one process: as
    they are); every rank holds the same names."""
    if not active():
        return records
    names = sorted(records)
    t = torch.tensor([records[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: [float(v) for v in row] for n, row in zip(names, t)}


def barrier() -> None:
    """Wait until every rank gets here (the per-block checkpoint's commit: every rank's inputs saved first)."""
    dist.barrier()
