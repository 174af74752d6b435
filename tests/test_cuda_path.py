"""Pieces of the CUDA code path that can be checked on a CPU (issue 44, item 7; bench/gpu_recipes.py runs the whole
path on a GPU): a run's phase timings wait for the GPU's queued work, and an empty QuantLinear is made on its own
device with the buffers a CPU-made one has."""
from __future__ import annotations

import pytest
import torch

from compress.core.nn import QuantLinear
from compress.pipeline.calibration import Timings
from compress.core.scheme import QuantScheme, get_preset


def test_phase_timings_wait_for_the_gpu(monkeypatch):
    """Kernels are launched asynchronously: a phase's time must end after they finish, and start after the previous
    phase's. No GPU here, so torch.cuda's answers are replaced: the test checks where the waits happen."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    timings = Timings()
    with timings("compress"):
        events.append("work")
    assert events == ["sync", "work", "sync"] and timings["compress"] >= 0
    events.clear()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU run, or CUDA not used yet: no wait
    with timings("load"):
        events.append("work")
    assert events == ["work"] and "load" in timings


@pytest.mark.parametrize("scheme", [
    QuantScheme(dtype="int4", granularity="group", group_size=64, symmetric=False), get_preset("W4A16"),
    QuantScheme(dtype="int3", granularity="group", group_size=32, symmetric=False), get_preset("FP8_DYNAMIC"),
    get_preset("NVFP4"), get_preset("MXFP4"), get_preset("W8A8"),
], ids=lambda s: s.name)
def test_an_empty_quant_linear_is_made_on_its_device(scheme):
    """The empty layer's buffers are made where they live (packing a 7B layer's zero codes on the CPU cost up to
    4.6 s per layer, for a layer bound for the GPU or a meta skeleton): the same shapes and dtypes on any device."""
    cpu = QuantLinear(256, 96, scheme, bias=True)
    meta = QuantLinear(256, 96, scheme, bias=True, device="meta")
    for (name, a), (name_b, b) in zip(cpu.named_buffers(), meta.named_buffers(), strict=True):
        assert name == name_b and b.is_meta and (a.shape, a.dtype) == (b.shape, b.dtype), name
    assert meta.bias.is_meta and not cpu.bias.is_meta
    # and the CPU-made one is still the quantized form of a zero weight: dequantizes to zeros
    assert torch.equal(cpu.qtensor().dequantize(), torch.zeros(96, 256))
