"""The dispatcher's row ranges (Kernel.rows, issue 44): without measuring it takes, per row-count bucket, the first
usable kernel meant for it; above the largest bucket a kernel meant only for small batches hands over to the
large-batch path, measured or not; kernels with one prepare share one state; a kernel that fails while being measured
is recorded, not fatal; a row where every compressed candidate is slower than 0.9x dense says so. The kernels here are
plain Python callables on CPU (no mocks): the CUDA registry's own ranges are checked in test_kernels_dequant.py."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compress.kernels import dispatch
from compress.kernels.dispatch import (FLOAT_COPY, REFERENCE, TAIL, install_dispatch, plan_dispatch, summary,
                                       use_dispatch)
from compress.kernels.kernel import Kernel
from compress.core.nn import QuantLinear
from compress.core.qtensor import QuantizedTensor
from compress.core.scheme import scheme

GEN = torch.Generator().manual_seed(7)


def _model(n: int = 64, k: int = 128, layers: int = 1) -> nn.Module:
    s = scheme("int4", "group", 32, True)
    mods = []
    for _ in range(layers):
        q = torch.randint(s.qmin, s.qmax + 1, (n, k), generator=GEN)
        qt = QuantizedTensor.from_codes(q, torch.rand(n, k // 32, generator=GEN) + 0.5, None, s)
        mods.append(QuantLinear.from_module(nn.Linear(k, n, bias=True, dtype=torch.bfloat16), qt))
    return nn.Sequential(*mods)


def _dense(layer, dtype):
    return layer.qtensor().dequantize(dtype)


def _fake(name: str, rows=None, refuse: str | None = None, sleep: float = 0.0, fail: bool = False,
          prepare=_dense) -> Kernel:
    """A kernel that multiplies by the dequantized weight; `sleep` makes it slow, `fail` makes its run raise."""
    def run(w, x, bias):
        if fail:
            raise RuntimeError("this device refuses the layout")
        if sleep:
            time.sleep(sleep)
        return F.linear(x, w, bias)
    return Kernel(name, lambda layer, dtype, device: refuse, prepare, run, rows)


def _registry(*kernels: Kernel) -> dict[str, Kernel]:
    return {k.name: k for k in kernels}


def _buckets(report) -> tuple:
    (buckets, _), = report.choices.values()
    return buckets


def test_kernel_rows_are_checked_and_tested_inclusively():
    k = _fake("k", rows=(1, 64))
    assert k.meant_for(1) and k.meant_for(64) and not k.meant_for(65) and not k.meant_for(float("inf"))
    assert _fake("big", rows=(128, None)).meant_for(float("inf")) and not _fake("big", rows=(128, None)).meant_for(127)
    assert _fake("any").meant_for(1) and _fake("any").meant_for(float("inf"))
    with pytest.raises(ValueError, match=r"rows=\(0, 4\) must be \(lo, hi\) with 1 <= lo <= hi"):
        _fake("bad", rows=(0, 4))
    with pytest.raises(ValueError, match=r"rows=\(64, 16\)"):
        _fake("bad", rows=(64, 16))


def test_unmeasured_plan_takes_per_bucket_the_first_kernel_meant_for_it():
    """Registry order decode (M <= 16, the lead's future v2), small (M <= 64), large (M >= 128): buckets 1, 4, 16 go to
    decode, 64 to small, and every size above 64 to large, the extra tail bucket; a refused kernel is reported."""
    kernels = _registry(_fake("refused", refuse="not this layer"), _fake("decode", rows=(1, 16)),
                        _fake("small", rows=(1, 64)), _fake("large", rows=(128, None)))
    model = _model()
    report = plan_dispatch(model, measure=False, kernels=kernels)
    assert _buckets(report) == ((16, "decode"), (64, "small"), (TAIL, "large"))
    assert not report.rows and next(iter(report.skipped.values())) == {"refused": "not this layer"}
    with use_dispatch(model, report):
        d = model[0].dispatch
        assert [d.choose(m) for m in (1, 16, 17, 64, 65, 128, 100_000)] == \
            ["decode", "decode", "small", "small", "large", "large", "large"]
        assert d.describe() == "decode (M<=16), small (M 17-64), large (M>64)"
        x = torch.randn(200, 128, generator=GEN).bfloat16()
        torch.testing.assert_close(model(x), F.linear(x, _dense(model[0], torch.bfloat16), model[0].bias))


def test_unmeasured_bucket_between_ranges_goes_to_the_nearest():
    """A bucket no kernel is meant for (M = 100 between M <= 64 and M >= 128) takes the nearest range; a kernel
    without a range is meant for every size and, first in order, takes them all."""
    kernels = _registry(_fake("small", rows=(1, 64)), _fake("large", rows=(128, None)))
    report = plan_dispatch(_model(), batch_sizes=(1, 70, 100, 256), measure=False, kernels=kernels)
    assert _buckets(report) == ((70, "small"), (256, "large"))
    anyk = _registry(_fake("any"), _fake("small", rows=(1, 64)), _fake("large", rows=(128, None)))
    assert _buckets(plan_dispatch(_model(), measure=False, kernels=anyk)) == ((64, "any"),)
    only_small = _registry(_fake("small", rows=(1, 64)))  # nothing for large M: the small kernel goes on
    assert _buckets(plan_dispatch(_model(), measure=False, kernels=only_small)) == ((64, "small"),)
    nothing = _registry(_fake("refused", refuse="no"))
    assert _buckets(plan_dispatch(_model(), measure=False, kernels=nothing)) == ((64, REFERENCE),)


def test_unmeasured_plan_never_takes_the_float_copy():
    kernels = {FLOAT_COPY.name: FLOAT_COPY, **_registry(_fake("small", rows=(1, 64)))}
    assert _buckets(plan_dispatch(_model(), measure=False, kernels=kernels)) == ((64, "small"),)


def test_default_cpu_registry_plans_as_before():
    """The CPU kernels of grid codes declare no range: without measuring, one bucket of the first usable kernel at the
    largest batch size, exactly the plan of before the ranges existed (the trellis kernel, meant for 1..16 rows, only
    takes trellis layers)."""
    report = plan_dispatch(_model(layers=2), measure=False)
    assert report.choices and all(b == ((max(dispatch.BATCH_SIZES), "torch int4pack (CPU)"),)
                                  for b, _ in report.choices.values())
    assert all(k.rows is None for k in dispatch.KERNELS.values() if not k.trellis)


def test_measured_plan_hands_sizes_above_the_largest_bucket_to_the_large_path():
    """Measured at M = 1 and 4 only, 'small' wins (the large path sleeps); rows above 4 are not measured, and 'small' is
    not meant for them beyond 64: the tail goes to 'large'. Timing decides nothing here except that 'small' (a plain
    F.linear on the prepared weight) beats a kernel that sleeps 3 ms and the reference path's dequantize-then-matmul
    of a 256 x 512 weight."""
    kernels = _registry(_fake("small", rows=(1, 64)), _fake("large", rows=(128, None), sleep=3e-3))
    model = _model(256, 512)
    report = plan_dispatch(model, batch_sizes=(1, 4), repeats=1, kernels=kernels)
    assert [r.choice for r in report.rows] == ["small", "small"]
    assert _buckets(report) == ((4, "small"), (TAIL, "large"))
    assert all(set(r.times_us) == {"small", "large", "reference: dequantize+matmul"} for r in report.rows)


def test_a_kernel_that_fails_while_measured_is_recorded_not_fatal():
    def bad_prepare(layer, dtype):
        raise ValueError("cannot pack this layer")
    kernels = _registry(_fake("broken", fail=True), _fake("unpackable", prepare=bad_prepare), _fake("good"))
    report = plan_dispatch(_model(), batch_sizes=(1, 2), repeats=1, kernels=kernels)
    why = next(iter(report.skipped.values()))
    assert why["broken"] == "failed at M=1: RuntimeError: this device refuses the layout"
    assert why["unpackable"] == "prepare failed: ValueError: cannot pack this layer"
    assert all("broken" not in r.times_us and "unpackable" not in r.times_us for r in report.rows)
    assert all(n in ("good", REFERENCE) for _, n in _buckets(report))


def test_kernels_with_one_prepare_share_one_state_per_layer():
    """The W4A16 GEMM and dequantize+cuBLAS run the same packed operands: one prepare per layer, not one per kernel,
    when planning and when installing."""
    calls = []

    def prepare(layer, dtype):
        calls.append(layer)
        return _dense(layer, dtype)
    kernels = _registry(_fake("small", rows=(1, 64), prepare=prepare),
                        _fake("large", rows=(128, None), prepare=prepare))
    model = _model(layers=2)  # two layers of one shape: one group, planned on the first
    plan_dispatch(model, batch_sizes=(1,), repeats=1, kernels=kernels)
    assert len(calls) == 1
    calls.clear()
    report = plan_dispatch(model, measure=False, kernels=kernels)
    assert not calls and _buckets(report) == ((64, "small"), (TAIL, "large"))
    install_dispatch(model, report)
    assert calls == [model[0], model[1]]
    for m in model:
        assert m.dispatch.states["small"] is m.dispatch.states["large"]
    assert "small (M<=64), large (M>64) [2 layers]" in summary(model)


def test_row_flags_when_every_compressed_candidate_is_below_dense():
    kernels = {"a": _fake("a"), FLOAT_COPY.name: FLOAT_COPY}
    assert dispatch._below_dense({REFERENCE: 2.0, "a": 1.2}, 1.0, kernels)          # 0.5x and 0.83x
    assert not dispatch._below_dense({REFERENCE: 2.0, "a": 1.05}, 1.0, kernels)  # 0.95x: a compressed one keeps up
    assert dispatch._below_dense({REFERENCE: 2.0, "a": 1.2, FLOAT_COPY.name: 1.0}, 1.0, kernels)  # the copy is not one
    report = plan_dispatch(_model(), batch_sizes=(1,), repeats=1, kernels=_registry(_fake("slow", sleep=2e-3)))
    row = report.to_dict()["rows"][0]
    assert "below_dense" in row and row["below_dense"] == report.rows[0].below_dense
    # a 2 ms kernel and the reference path's dequantize-then-matmul against a 64 x 128 dense GEMV
    assert row["below_dense"] is True
