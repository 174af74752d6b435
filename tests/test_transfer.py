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


def test_a_streamed_block_on_cuda_is_taken_from_the_read_aheads_copies(tmp_path, monkeypatch):
    """StreamedBlocks' CUDA branch, run on this CPU build: the copies themselves cannot run here (pinned memory and
    CUDA streams need a device), so `DeviceCopies.of` and `ready` are stand-ins that keep the tensors where they are.
    What is checked is the wiring: from block 1 on, each block comes from the read-ahead's copies, through `ready()`
    (the stream wait) before use, with the values a plain read gives."""
    from compress.core import transfer
    from compress.model.streaming import open_streamed
    from compress.pipeline import streamed as streamed_module
    from compress.pipeline.streamed import StreamedBlocks

    from .conftest import make_tiny_model
    from .tiny_tokenizer import make_tiny_tokenizer
    folder = tmp_path / "model"
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    queued, readied = [], []

    def of(tensors, device, stream=None):
        queued.append(sorted(tensors))
        return DeviceCopies(dict(tensors), None, torch.device("cpu"))

    def ready(self):
        readied.append(sorted(self.tensors))
        return self.tensors

    monkeypatch.setattr(streamed_module, "ahead_to", lambda device: True)
    monkeypatch.setattr(transfer.torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(DeviceCopies, "of", staticmethod(of))
    monkeypatch.setattr(DeviceCopies, "ready", ready)
    streamed = open_streamed("folder", str(folder), torch.float32)
    blocks = StreamedBlocks(streamed, None, "float32")
    reference = open_streamed("folder", str(folder), torch.float32)
    n = blocks.n
    for i in range(n):
        block = blocks.load(i, "cpu")
        expected = reference.load(i)
        assert all(torch.equal(a, b) for a, b in zip(block.state_dict().values(), expected.state_dict().values()))
        blocks.done(i, block)
    blocks.end()
    assert n > 1 and len(queued) == len(readied) == n - 1 and queued == readied
