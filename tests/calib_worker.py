"""One rank of the data-parallel statistics test: `torchrun --nproc-per-node 2 tests/calib_worker.py OUT`.

Every rank builds the same tiny llama MLP and the same 8 random inputs, observes its share of them (every 2nd,
from its rank) with a BlockObserver (Hessians, |x| sums and maxima), reduces the statistics over the ranks and
writes them to OUT/rank-<i>.safetensors.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # two OpenMP threads stall on the 2-core CI machines
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402

from compress.distributed import reduce_stats, share, start  # noqa: E402
from compress.observers import BlockObserver  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

LINEARS = ["gate_proj", "up_proj", "down_proj"]


def inputs() -> torch.Tensor:
    return torch.randn(8, 1, 16, 64, generator=torch.Generator().manual_seed(3))


def observe(mlp, xs) -> dict[str, torch.Tensor]:
    with BlockObserver(mlp, LINEARS, [], abs_mean=True, hessian=True, keep_samples=0, abs_max=True) as obs:
        for x in xs:
            mlp(x)
    return obs


def flat(obs) -> dict[str, torch.Tensor]:
    out = {}
    for name in LINEARS:
        st = obs.stats[name]
        out.update({f"{name}.hessian": st.hessian, f"{name}.abs_sum": st.abs_sum, f"{name}.abs_max": st.abs_max,
                    f"{name}.tokens": torch.tensor(st.tokens)})
    return out


if __name__ == "__main__":
    rank, size = start("cpu")
    mlp = make_tiny_model("llama").model.layers[0].mlp
    obs = observe(mlp, share(inputs(), rank, size))
    reduce_stats(obs)
    save_file({k: v.clone() for k, v in flat(obs).items()}, str(Path(sys.argv[1]) / f"rank-{rank}.safetensors"))
