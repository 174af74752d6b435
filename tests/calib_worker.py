"""One rank of the data-parallel statistics test: `torchrun --nproc-per-node 2 tests/calib_worker.py OUT [moe]`.

Every rank builds the same tiny llama MLP and the same 8 random inputs, observes its share of them (every 2nd,
from its rank) with a BlockObserver (Hessians, |x| sums and maxima), reduces the statistics over the ranks and
writes them to OUT/rank-<i>.safetensors. With `moe`: a gpt-oss MoE block whose expert 3 only rank 0's windows
reach (its router's bias pushes tokens away from it; the even windows are pushed towards it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # two OpenMP threads stall on the 2-core CI machines
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402

from compress.calibrate.distributed import reduce_stats, share, start  # noqa: E402
from compress.calibrate.observers import BlockObserver  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

LINEARS = ["gate_proj", "up_proj", "down_proj"]


def inputs() -> torch.Tensor:
    return torch.randn(8, 1, 16, 64, generator=torch.Generator().manual_seed(3))


MOE_LINEARS = [f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]


def moe_block():
    """Block 0's MoE MLP of the tiny gpt-oss, unfused, and its inputs: expert 3 reached by the even windows only."""
    from compress.arch.moe import unfuse_experts
    model = make_tiny_model("gpt_oss")
    unfuse_experts(model)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.router.bias[3] = -8.0
        direction = mlp.router.weight[3] / mlp.router.weight[3].norm()
    xs = inputs()
    xs[0::2] += 400 * direction
    return mlp, xs


def observe(mlp, xs, linears=LINEARS) -> dict[str, torch.Tensor]:
    with BlockObserver(mlp, linears, [], abs_mean=True, hessian=True, keep_samples=0, abs_max=True) as obs:
        with torch.no_grad():
            for x in xs:
                mlp(x)
    return obs


def flat(obs, linears=LINEARS) -> dict[str, torch.Tensor]:
    out = {}
    for name in linears:
        st = obs.stats[name]
        out.update({f"{name}.hessian": st.hessian, f"{name}.abs_sum": st.abs_sum, f"{name}.abs_max": st.abs_max,
                    f"{name}.tokens": torch.tensor(st.tokens)})
    return out


if __name__ == "__main__":
    rank, size = start("cpu")
    moe = sys.argv[2:] == ["moe"]
    mlp, xs = moe_block() if moe else (make_tiny_model("llama").model.layers[0].mlp, inputs())
    linears = MOE_LINEARS if moe else LINEARS
    obs = observe(mlp, share(xs, rank, size), linears)
    saw = torch.tensor([n in obs.stats for n in linears])  # before the reduction: what this rank's windows reached
    reduce_stats(obs)
    out = {k: v.clone() for k, v in flat(obs, linears).items()}
    save_file({**out, "saw": saw}, str(Path(sys.argv[1]) / f"rank-{rank}.safetensors"))
