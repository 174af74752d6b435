"""The `kv_cache` stage: per-layer fp8 key/value scales, calibrated from the keys and values attention reads
(kv_cache.py holds the attention wrapper that records and applies them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ..distributed import max_over_ranks
from ..kv_cache import attention_modules, kv_layers, recording_kv, set_kv_scales, use_kv_attention
from ..scheme import FP8_MAX
from .base import BlockState, Plan, RunContext, StageBase


@dataclass(frozen=True)
class KVCacheStage(StageBase):
    """Recipe entry `- stage: kv_cache`: calibrate per-layer fp8 key/value scales (needs calibration data)."""

    dtype: Literal["fp8_e4m3", "fp8_e5m2"] = "fp8_e4m3"

    def __post_init__(self):
        if self.dtype not in FP8_MAX:
            raise ValueError(f"kv_cache dtype={self.dtype!r}; use 'fp8_e4m3' or 'fp8_e5m2'")

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "kv_cache"

    @property
    def needs_calibration(self) -> bool:
        return True

    def describe(self, plan: Plan, index: int) -> tuple[list[str], list[str]]:
        blocks = plan.arch.block_list(plan.model)
        names = attention_modules(blocks[0])
        return [f"\nstage {index}: kv_cache {self.dtype}: k_scale / v_scale per attention layer, calibrated on "
                f"`{', '.join(names)}` of each of the {len(blocks)} blocks"], names

    def begin(self, ctx: RunContext, index: int) -> None:
        use_kv_attention(ctx.model)  # the attention wrapper that records (now) and applies (later) the scales
        ctx.records[index] = {}  # attention layer -> its scales, kept as set (a streamed block leaves memory)

    def observing(self, block: BlockState, index: int):
        return recording_kv(block.module, block.observed.setdefault(index, {}))

    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        # with several processes, every rank's maxima (each saw its share of the windows)
        for name, (k_max, v_max) in max_over_ranks(block.observed[index]).items():
            set_kv_scales(block.module.get_submodule(name), k_max, v_max, self.dtype)
        ctx.records[index].update({f"{block.prefix}.{n}": v for n, v in kv_layers(block.module).items()})

    def report(self, ctx: RunContext, index: int) -> dict:
        return {"index": index, "stage": "kv_cache", "dtype": self.dtype, "quantized": 0, "skipped": [],
                "layers": ctx.records[index]}

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        kv = section.get("layers", {})
        return ["", f"## Stage {section['index']}: kv_cache ({section['dtype']})", "",
                f"{len(kv)} attention layers with calibrated scales (max|k| / fp8 max, max|v| / fp8 max), "
                "applied to the keys and values every attention call reads during evaluation.", "",
                "| attention layer | k_scale | v_scale |", "|---|---:|---:|"] + \
            [f"| `{n}` | {v['k_scale']:.4g} | {v['v_scale']:.4g} |" for n, v in kv.items()]
