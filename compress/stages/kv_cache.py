"""The `kv_cache` stage: per-layer fp8 key/value scales, calibrated from the keys and values attention reads
(kv/cache.py holds the attention wrapper that records and applies them); or an int8 / int4 KIVI cache (kv/kivi.py:
keys per channel, values per token, a float residual window), which needs no calibration."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from ..calibrate.distributed import max_over_ranks
from ..kv.cache import attach_kv_quant, attention_modules, kv_layers, recording_kv, set_kv_scales, use_kv_attention
from ..kv.kivi import KVQuant
from ..core.scheme import FP8_MAX
from .base import BlockState, Plan, RunContext, StageBase, StageRecord, optional


@dataclass
class KVCacheRecord(StageRecord):
    """The kv_cache stage's report section; the KIVI fields only with an int cache."""

    dtype: str
    quantized: int  # 0: it stores no weights
    skipped: list
    layers: dict  # attention layer -> its k_scale / v_scale (fp8), what kv_layers reports
    format: str | None = optional()
    group: int | None = optional()
    residual: int | None = optional()
    bytes_per_element: float | None = optional()


UNSEEN_REASON = ("the calibration text never reached it (a cross-attention layer of a vision-language model, skipped "
                 "without images): no scale; its cache keeps the model's dtype")


@dataclass(frozen=True)
class KVCacheStage(StageBase):
    """Recipe entry `- stage: kv_cache`: fp8 (calibrate per-layer key/value scales; needs calibration data) or
    int8 / int4 (KIVI: `group` tokens per key chunk and channels per value group, `residual` recent tokens in
    float; dynamic, no calibration)."""

    dtype: Literal["fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4"] = "fp8_e4m3"
    group: int = 32  # int only
    residual: int = 128  # int only

    def __post_init__(self):
        if self.dtype not in FP8_MAX and self.dtype not in ("nvfp4", "int8", "int4"):
            raise ValueError(f"kv_cache dtype={self.dtype!r}; use 'fp8_e4m3', 'fp8_e5m2', 'nvfp4' (calibrated tensor "
                             "scales, e4m3 scales per 16 channels), 'int8' or 'int4' (KIVI)")
        if self.int_format is not None:
            self.int_format  # validates group / residual
        elif (self.group, self.residual) != (32, 128):
            raise ValueError("kv_cache group / residual apply to dtype int8 or int4 only (fp8 has one scale per "
                             "layer)")

    @property
    def int_format(self) -> KVQuant | None:
        return KVQuant(int(self.dtype[3:]), self.group, self.residual) if self.dtype.startswith("int") else None

    # ---------------------------------------------------------------- lifecycle (stages/base.py)
    name: ClassVar[str] = "kv_cache"

    @property
    def needs_calibration(self) -> bool:
        return self.int_format is None

    def describe(self, plan: Plan, index: int) -> tuple[list[str], list[str]]:
        blocks = plan.arch.block_list(plan.model)
        names = attention_modules(blocks[0])
        if self.int_format is not None:
            f = self.int_format
            return [f"\nstage {index}: kv_cache {f.name}: keys per channel over {f.group}-token chunks, values per "
                    f"token over {f.group} channels, the last {f.residual} tokens in float, on `{', '.join(names)}` "
                    f"of each of the {len(blocks)} blocks ({f.bytes_per_element():.3f} bytes per element)"], names
        return [f"\nstage {index}: kv_cache {self.dtype}: k_scale / v_scale per attention layer, calibrated on "
                f"`{', '.join(names)}` of each of the {len(blocks)} blocks"], names

    def begin(self, ctx: RunContext, index: int) -> None:
        use_kv_attention(ctx.model)  # the attention wrapper that records (now) and applies (later) the scales
        # attention layer -> its scales, kept as set (a streamed block leaves memory), or {"skipped": why} for one
        # left without scales
        ctx.records[index] = {}

    def observing(self, block: BlockState, index: int):
        if self.int_format is not None:
            import contextlib
            return contextlib.nullcontext()
        return recording_kv(block.module, block.observed.setdefault(index, {}))

    def on_block(self, ctx: RunContext, block: BlockState, index: int) -> None:
        if self.int_format is not None:
            names = attach_kv_quant(block.module, self.int_format)
            ctx.records[index].update({f"{block.prefix}.{n}": self.int_format.to_dict() for n in names})
            return
        # with several processes, every rank's maxima (each saw its share of the windows)
        for name, (k_max, v_max) in max_over_ranks(block.observed[index]).items():
            if k_max == 0 and v_max == 0:  # never called: the model passes this block by on text (Llama 3.2 Vision's
                ctx.records[index][f"{block.prefix}.{name}"] = {"skipped": UNSEEN_REASON}
                continue  # cross-attention layers): a scale from nothing would crush the image keys and values
            set_kv_scales(block.module.get_submodule(name), k_max, v_max, self.dtype)
        ctx.records[index].update({f"{block.prefix}.{n}": v for n, v in kv_layers(block.module).items()})

    def report(self, ctx: RunContext, index: int) -> dict:
        kept = ctx.records[index]
        skipped = [{"name": n, "reason": v["skipped"]} for n, v in kept.items() if "skipped" in v]
        record = KVCacheRecord(index, "kv_cache", self.dtype, 0, skipped,
                               {n: v for n, v in kept.items() if "skipped" not in v})
        if self.int_format is not None:
            record = replace(record, format=self.int_format.name, group=self.group, residual=self.residual,
                             bytes_per_element=self.int_format.bytes_per_element())
        return record.to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        kv = section.get("layers", {})
        if "format" in section:
            return ["", f"## Stage {section['index']}: kv_cache ({section['format']})", "",
                    f"{len(kv)} attention layers attend over a KIVI {section['dtype']} cache: keys per channel over "
                    f"chunks of {section['group']} tokens, values per token over {section['group']} channels, "
                    f"asymmetric, the last {section['residual']} tokens (up to {section['group'] - 1} more) in float; "
                    f"{section['bytes_per_element']:.3f} bytes per cached element with the scales and zeros "
                    "(bfloat16: 2). Evaluation attends over it: the perplexity includes its effect."]
        return ["", f"## Stage {section['index']}: kv_cache ({section['dtype']})", "",
                f"{len(kv)} attention layers with calibrated scales (max|k| / fp8 max, max|v| / fp8 max), "
                "applied to the keys and values every attention call reads during evaluation.", "",
                "| attention layer | k_scale | v_scale |", "|---|---:|---:|"] + \
            [f"| `{n}` | {v['k_scale']:.4g} | {v['v_scale']:.4g} |" for n, v in kv.items()] + \
            [f"\nNo scales for `{s['name']}`: {s['reason']}." for s in section.get("skipped", [])]
