"""The recipe's stages and their registry.

`STAGES` maps a recipe's `stage:` name to its class, and is the only list of stages: the recipe loader, the runner
(`pipeline/resident.py`), `compress inspect` and the report renderer reach every stage through it and the lifecycle in
`base.py`. A new stage is one file here, one line below, and its tests; a new weight quantization method for the
`quantize` stage is one file in `quantizers/` and one line in `quantizers.QUANTIZERS` (HQQ is the worked example).
"""
from __future__ import annotations

from .auto_precision import AutoPrecisionStage
from .awq import AWQStage
from .base import Needs, Plan, RunContext, StageBase, make_plan, next_target
from .distill import DistillStage
from .eora import EoRAStage
from .kl_hessians import KLHessiansStage
from .kv_cache import KVCacheStage
from .prune import PruneStage
from .prune_experts import PruneExpertsStage
from .quantize import QuantizeStage
from .rotate import RotateStage
from .smoothquant import SmoothQuantStage
from .tune_scales import TuneScalesStage

STAGES: dict[str, type] = {
    "rotate": RotateStage,  # the residual stream rotated, folded into the weights (QuaRot / SpinQuant R1)
    "prune": PruneStage,  # Minitron importance pruning of the whole model
    "prune_experts": PruneExpertsStage,  # a mixture of experts' least salient experts dropped (REAP)
    "distill": DistillStage,  # knowledge-distillation repair from the original
    "auto_precision": AutoPrecisionStage,  # one scheme per layer within a byte budget, for the next quantize stage
    "kl_hessians": KLHessiansStage,  # two Kronecker sides of each layer's KL Hessian, for the next GPTQ
    "awq": AWQStage,  # activation-aware scales and clipping for the next quantize stage
    "smoothquant": SmoothQuantStage,  # activation outliers migrated into the weights
    "quantize": QuantizeStage,  # weights (and activations) quantized by a method in quantizers.QUANTIZERS
    "eora": EoRAStage,  # a low-rank repair of the quantized layers' error (EoRA), a LoRA adapter in the exports
    "kv_cache": KVCacheStage,  # fp8 key/value scales
    "tune_scales": TuneScalesStage,  # after the pass: the quantized scales trained by distillation, codes fixed
}


def get_stage(name: str) -> type:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; known stages: {sorted(STAGES)}")
    return STAGES[name]


__all__ = ["STAGES", "get_stage", "make_plan", "next_target", "Needs", "Plan", "RunContext", "StageBase",
           "AutoPrecisionStage", "AWQStage", "DistillStage", "EoRAStage", "KLHessiansStage", "KVCacheStage", "PruneExpertsStage", "PruneStage", "QuantizeStage", "RotateStage", "SmoothQuantStage",
           "TuneScalesStage"]
