"""Each stage's report section is a typed record (stages/base.py: StageRecord) whose to_json() writes what
report.json has always held: the same keys, in the same order, with the same values. The block stages' sections
are checksummed by bench/runner_checksums.py; here the record mechanics and the whole-model stages' sections, built
beside the dicts the stages wrote before."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from compress.arch import get_arch
from compress.stages import KVCacheStage, RotateStage
from compress.stages.base import ModelStageContext, RunContext, StageRecord, inline, optional
from compress.stages.prune import PruneRecord
from tests.conftest import make_tiny_model


def same(a: dict, b: dict) -> bool:
    """Equal as report.json writes them: keys, their order and values."""
    return json.dumps(a) == json.dumps(b)


def test_a_record_writes_its_fields_in_order_inline_mappings_in_place_and_optional_ones_when_set():
    @dataclass
    class Example(StageRecord):
        kind: str
        extra: int | None = optional()
        curve: dict = inline()

    assert same(Example(2, "x", "a").to_json(), {"index": 2, "stage": "x", "kind": "a"})
    record = Example(2, "x", "a", 0, {"steps": 3, "loss": [1.0]})
    assert same(record.to_json(), {"index": 2, "stage": "x", "kind": "a", "extra": 0, "steps": 3, "loss": [1.0]})
    assert not same(record.to_json(), {"stage": "x", "index": 2, "kind": "a", "extra": 0, "steps": 3,
                                       "loss": [1.0]})  # the order is part of the section


def test_the_kv_cache_section_is_as_before():
    ctx = RunContext(model=None, plan=None, records={1: {"model.layers.0.self_attn": {"k_scale": 0.5}}})
    fp8 = KVCacheStage().report(ctx, 1)
    assert same(fp8, {"index": 1, "stage": "kv_cache", "dtype": "fp8_e4m3", "quantized": 0, "skipped": [],
                      "layers": ctx.records[1]})
    kivi = KVCacheStage(dtype="int4", group=32, residual=64)
    assert same(kivi.report(ctx, 1), {
        "index": 1, "stage": "kv_cache", "dtype": "int4", "quantized": 0, "skipped": [], "layers": ctx.records[1],
        "format": kivi.int_format.name, "group": 32, "residual": 64,
        "bytes_per_element": kivi.int_format.bytes_per_element()})


def test_the_rotate_section_is_as_before():
    from compress.transforms.rotation import rotate_mlp_inputs, rotate_model

    torch.manual_seed(0)
    model, before = make_tiny_model("llama"), make_tiny_model("llama")
    before.load_state_dict(model.state_dict())
    arch = get_arch(model)
    ctx = ModelStageContext(model, None, arch, None, None, False, False, lambda *a: None)
    section = RotateStage(seed=3, online_hadamard=True).run_model(ctx, 0)
    old = {"index": 0, "stage": "rotate", **rotate_model(before, get_arch(before), "hadamard", 3)}
    old |= rotate_mlp_inputs(before, get_arch(before), 3)
    assert same(section, old) and "online_hadamard" in section


def test_the_prune_section_keeps_minitrons_keys_after_the_index():
    done = {"stage": "prune", "original": {"layers": 2}, "pruned": {"layers": 1}, "axes": ["depth"], "notes": []}
    assert same(PruneRecord(0, done.pop("stage"), done).to_json(), {
        "index": 0, "stage": "prune", "original": {"layers": 2}, "pruned": {"layers": 1}, "axes": ["depth"],
        "notes": []})
