"""core/transfer.py: a streamed run's next block copied to a CUDA device ahead of its turn, through pinned memory on a
side stream. The copies need a CUDA device; here (a CPU build) only the choice of when to copy ahead is checked, and
the streamed-on-CUDA run is checked against the resident one by bench/gpu_recipes.py (its `large streamed ==
resident` verdict) on the GPU machine."""
from __future__ import annotations

import pytest
import torch

from compress.core.transfer import DeviceCopies, ahead_to


def test_only_a_cuda_device_is_copied_ahead():
    assert ahead_to("cuda") and ahead_to("cuda:1") and ahead_to(torch.device("cuda", 0))
    assert not ahead_to("cpu") and not ahead_to("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies need a CUDA device (pinned memory, streams)")
def test_the_copies_arrive_whole_on_the_device():
    g = torch.Generator().manual_seed(0)
    host = {"w": torch.randn(1024, 1024, generator=g, dtype=torch.float32).to(torch.bfloat16),
            "codes": torch.randint(0, 255, (4096,), generator=g, dtype=torch.uint8)}
    got = DeviceCopies.of(host, "cuda").ready()
    assert got.keys() == host.keys()
    for name, t in host.items():
        assert got[name].device.type == "cuda" and torch.equal(got[name].cpu(), t)
