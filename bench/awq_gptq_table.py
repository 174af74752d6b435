"""RTN vs AWQ vs GPTQ vs AWQ+GPTQ vs HQQ at int4 and int3 (group 64, zero-point) on SmolLM2-135M.

Phase 1 runs each recipe with `compress run` in its own process (so wall time and peak RSS are the
run's own), calibration 128 × 512 WikiText-2 validation, evaluation switched off, float tensors saved in
float32. Phase 2 scores the saved models and the baseline in one loop over the protocol's windows
(bench/protocol.py).

    python bench/awq_gptq_table.py
    python bench/awq_gptq_table.py --only "rtn int4" "hqq int4" "hqq int4, rounded zero points" "gptq int4" \
        "rtn int3" "hqq int3" "gptq int3" --out bench/results/hqq_table.json      # the HQQ table
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import protocol  # noqa: E402

# the auto_precision menu every mixed-precision row but the "int5/6 menu" ones was measured with: the default until
# int5 and int6 existed (2026-12-05); recipes/auto_precision_4bit.yaml now lists WIDE_MENU
OLD_MENU = ("[W8A16, {dtype: int4, granularity: group, group_size: 128, symmetric: false}, W4A16_ASYM_G64, "
            "{dtype: int3, granularity: group, group_size: 64, symmetric: false}]")
AUTO_RTN = ("[{stage: auto_precision, %s, n_samples: 4, menu: " + OLD_MENU + "}, "
            "{stage: quantize, method: rtn, scheme: W4A16_ASYM_G64, ignore: [lm_head]}]")
AUTO_GPTQ = ("[{stage: auto_precision, %s, n_samples: 4, menu: " + OLD_MENU + "}, "  # then gptq_int4.yaml's stage
             "{stage: quantize, method: gptq, scheme: W4A16_ASYM_G64, ignore: [lm_head]}]")
# awq_gptq_int4.yaml clips to GPTQ's grid since commit 4f58be1 (2026-12-04); the rows below that say no `grid clip` were
# measured before, clipping the weights themselves, which every method but GPTQ needs
W_CLIP = "stages.0.clip_to=weights"
AR = ["stages.1.method=autoround", "stages.1.options={iters: 200, batch_size: 2}"]
AR_GPTQ = ["stages.1.method=autoround", "stages.1.options={iters: 200, batch_size: 2, init: gptq}"]
ONLINE = "stages.0.online_hadamard=true"
WIDE_MENU = ("[W8A16, {dtype: int6, granularity: group, group_size: 64, symmetric: false}, "
             "{dtype: int5, granularity: group, group_size: 64, symmetric: false}, "
             "{dtype: int4, granularity: group, group_size: 128, symmetric: false}, W4A16_ASYM_G64, "
             "{dtype: int3, granularity: group, group_size: 64, symmetric: false}]")
RTN = ["stages.0.method=rtn", "calibration=null"]
# the residual rotation and the online Hadamard, then AWQ (scales where a pair still applies: not into the rotated
# down_proj; clipping everywhere), then GPTQ
ROT_AWQ_GPTQ = ("stages=[{stage: rotate, kind: hadamard, online_hadamard: true}, {stage: awq, n_grid: 20, "
                "search_samples: 4}, {stage: quantize, method: gptq, scheme: {dtype: %s, granularity: group, "
                "group_size: 64, symmetric: false}, ignore: [lm_head]}]")
INT4_G32 = "{dtype: int4, granularity: group, group_size: 32, symmetric: true}"
FP4_G32_E4M3 = "{dtype: fp4_e2m1, granularity: group, group_size: 32, symmetric: true, scale_dtype: float8_e4m3}"
# EoRA (issue 50): AWQ (grid clip) + GPTQ int3, then a rank-r low-rank repair of every quantized layer
EORA = ("stages=[{stage: awq, n_grid: 20, search_samples: 4, clip_to: grid}, {stage: quantize, method: gptq, "
        "scheme: {dtype: %s, granularity: group, group_size: 64, symmetric: false}, ignore: [lm_head]}, "
        "{stage: eora, rank: %d, iterations: %d}]")
# loss-aware rounding (issue 50): the output side of each layer's KL Hessian (kl_hessians), then GPTQ against both sides
KL_GPTQ = ("stages=[{stage: kl_hessians}, {stage: quantize, method: gptq, scheme: {dtype: %s, granularity: group, "
           "group_size: %d, symmetric: false}, ignore: [lm_head]}]")
KL_AWQ_GPTQ = ("stages=[{stage: kl_hessians}, {stage: awq, n_grid: 20, search_samples: 4, clip_to: grid}, "
               "{stage: quantize, method: gptq, scheme: {dtype: %s, granularity: group, group_size: %d, "
               "symmetric: false}, ignore: [lm_head]}]")
# AutoRound against the model's loss (issue 50): each block's error weighed by the Fisher at its output (kl_hessians),
# the table's 200 steps of 2 windows, like for like with "autoround int3" / "autoround int2 g32"
KL_AR = ("stages=[{stage: kl_hessians}, {stage: quantize, method: autoround, scheme: {dtype: %s, granularity: group, "
         "group_size: %d, symmetric: false}, options: {iters: 200, batch_size: 2}, ignore: [lm_head]}]")
# EoRA against the KL (issue 50): the kl_hessians stage's two sides fit the repair too; `allocate` spends the budget of
# rank r on every layer where the KL Hessians say a parameter removes the most
EORA_KL = "{stage: eora, rank: %d, weighting: %s, allocate: %s}"
# trellis codes (issue 50 item 1): QTIP-style, incoherence + BlockLDLQ with Viterbi, one float16 scale per row
TRELLIS = ("stages=[{stage: quantize, method: trellis, scheme: {dtype: %s, granularity: channel}, "
           "options: {state_bits: %d}, ignore: [lm_head]}]")
RUNS = {  # name: (recipe, extra --set overrides)
    **{f"trellis int{b} L{L}": ("recipes/gptq_int4.yaml", [TRELLIS % (f"int{b}", L)]) for b in (2, 3, 4) for L in (12, 14)},
    **{f"kl+trellis int{b} L{L}": ("recipes/gptq_int4.yaml", ["stages=[{stage: kl_hessians}, " +
                                                               (TRELLIS % (f"int{b}", L))[len("stages=["):]])
       for b in (2, 3, 4) for L in (12, 14)},
    # the trellis layers' row scales then tuned by distillation (tune_scales; walks and signs kept)
    **{f"kl+trellis int{b} L{L} + tune": ("recipes/gptq_int4.yaml", ["stages=[{stage: kl_hessians}, " +
                                                                      (TRELLIS % (f"int{b}", L))[len("stages=["):-1] +
                                                                      ", {stage: tune_scales}]"])
       for b in (3, 4) for L in (12, 14)},
    **{f"trellis int{b} L12 + eora r8": ("recipes/gptq_int4.yaml", [(TRELLIS % (f"int{b}", 12))[:-1] +
                                                                   ", {stage: eora, rank: 8}]"]) for b in (2, 3)},
    "rtn int4": ("recipes/gptq_int4.yaml", ["stages.0.method=rtn", "calibration=null"]),
    "awq int4": ("recipes/awq_int4.yaml", []),
    "gptq int4": ("recipes/gptq_int4.yaml", []),
    "awq+gptq int4": ("recipes/awq_gptq_int4.yaml", [W_CLIP]),
    "rtn int3": ("recipes/gptq_int4.yaml", ["stages.0.method=rtn", "calibration=null", "stages.0.scheme.dtype=int3"]),
    "kl+gptq int3": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int3", 64)]),
    "kl+gptq int4": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int4", 64)]),
    "gptq int2 g32": ("recipes/gptq_int4.yaml", ["stages.0.scheme.dtype=int2", "stages.0.scheme.group_size=32"]),
    "kl+gptq int2 g32": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int2", 32)]),
    "kl+awq(grid clip)+gptq int3": ("recipes/gptq_int4.yaml", [KL_AWQ_GPTQ % ("int3", 64)]),
    "kl+autoround int2 g32": ("recipes/gptq_int4.yaml", [KL_AR % ("int2", 32)]),
    "kl+autoround int3": ("recipes/gptq_int4.yaml", [KL_AR % ("int3", 64)]),
    "kl+autoround int4": ("recipes/gptq_int4.yaml", [KL_AR % ("int4", 64)]),
    **{f"kl+gptq+eora({how}) r{r} int3": ("recipes/gptq_int4.yaml", [
        (KL_GPTQ % ("int3", 64))[:-1] + ", " + EORA_KL % (r, how.split()[0], "alloc" in how) + "]"])
       for how, r in (("input", 8), ("kl", 8), ("kl alloc", 8), ("kl alloc", 16))},
    "kl+awq(grid clip)+gptq+eora(kl alloc) r8 int3": ("recipes/gptq_int4.yaml", [
        (KL_AWQ_GPTQ % ("int3", 64))[:-1] + ", " + EORA_KL % (8, "kl", True) + "]"]),
    # the same terms trained end to end by distillation (tune_scales train: [lowrank]); and the scales alone at the
    # base's bytes, for what the terms' bytes buy against tuning what is already there
    "kl+awq(grid clip)+gptq+eora(kl alloc)+tune(lowrank) r8 int3": ("recipes/gptq_int4.yaml", [
        (KL_AWQ_GPTQ % ("int3", 64))[:-1] + ", " + EORA_KL % (8, "kl", True) +
        ", {stage: tune_scales, train: [lowrank]}]"]),
    "kl+awq(grid clip)+gptq+tune int3": ("recipes/gptq_int4.yaml", [
        (KL_AWQ_GPTQ % ("int3", 64))[:-1] + ", {stage: tune_scales}]"]),
    **{f"kl({sides})+gptq int3": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int3", 64), f"stages.1.options.kl_sides={sides}"])
       for sides in ("input", "output")},
    "kl(input)+gptq int2 g32": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int2", 32), "stages.1.options.kl_sides=input"]),
    "kl(output damp 1)+gptq int2 g32": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int2", 32),
                                                                    "stages.1.options.output_dampening=1.0"]),
    "kl(damp 0.1)+gptq int2 g32": ("recipes/gptq_int4.yaml", [KL_GPTQ % ("int2", 32), "stages.1.options.dampening=0.1"]),
    "awq int3": ("recipes/awq_int3.yaml", []),
    "gptq int3": ("recipes/gptq_int4.yaml", ["stages.0.scheme.dtype=int3"]),
    "awq+gptq int3": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.scheme.dtype=int3"]),
    # HQQ (no calibration): fractional float16 zero points, and rounded to uint8 (what AWQ/GPTQ/compressed-tensors hold)
    "hqq int4": ("recipes/hqq_int4.yaml", []),
    # the embedded model's own storage layout (GGUF Q4_1: int4 g32, float16 scale and fractional zero point per group)
    "hqq int4 g32 (Q4_1 layout)": ("recipes/hqq_int4.yaml", ["stages.0.scheme.group_size=32"]),
    "hqq int4, rounded zero points": ("recipes/hqq_int4.yaml", ["stages.0.scheme.zero_point_dtype=uint8"]),
    "hqq int3": ("recipes/hqq_int4.yaml", ["stages.0.scheme.dtype=int3"]),
    # AutoRound (issue 19): 200 steps of 2 windows on this CPU (the recipe's setting; the paper's 8 is 4x the time)
    "autoround int4": ("recipes/gptq_int4.yaml", ["stages.0.method=autoround",
                                                  "stages.0.options={iters: 200, batch_size: 2}"]),
    **{f"autoround {bits}": ("recipes/gptq_int4.yaml", ["stages.0.method=autoround", f"stages.0.scheme.dtype={bits[:4]}",
                                                       "stages.0.options={iters: 200, batch_size: 2}",
                                                       f"stages.0.scheme.group_size={32 if 'g32' in bits else 64}"])
       for bits in ("int3", "int2 g32")},  # like for like with "gptq int3", "kl+gptq int3", ... (issue 50)
    "awq+autoround int4": ("recipes/autoround_int4.yaml", AR[1:]),  # the table's 200 steps (the recipe now takes 100)
    "awq+autoround int3": ("recipes/awq_gptq_int4.yaml", [W_CLIP, *AR, "stages.1.scheme.dtype=int3"]),
    # AutoRound started from GPTQ's solution (options.init: gptq) instead of round-to-nearest
    "awq+autoround(gptq init) int4": ("recipes/awq_gptq_int4.yaml", [W_CLIP, *AR_GPTQ]),
    "awq+autoround(gptq init) int3": ("recipes/awq_gptq_int4.yaml", [W_CLIP, *AR_GPTQ, "stages.1.scheme.dtype=int3"]),
    "rotate+gptq int4": ("recipes/rotate_gptq_int3.yaml", ["stages.1.scheme.dtype=int4"]),
    "rotate+gptq int3": ("recipes/rotate_gptq_int3.yaml", []),
    "rotate+gptq int2 g32": ("recipes/rotate_gptq_int3.yaml", ["stages.1.scheme.dtype=int2",
                                                              "stages.1.scheme.group_size=32"]),
    "rotate+autoround int2 g32": ("recipes/rotate_gptq_int3.yaml", [*AR, "stages.1.scheme.dtype=int2",
                                                                   "stages.1.scheme.group_size=32"]),
    # rotated activations: int8 weights per channel, int8 activations with one static scale per tensor (calibrated)
    "rtn w8a8 static": ("recipes/gptq_int4.yaml", ["stages.0.method=rtn", "stages.0.scheme=W8A8_STATIC"]),
    "rotate+rtn w8a8 static": ("recipes/rotate_gptq_int3.yaml", ["stages.1.method=rtn", "stages.1.scheme=W8A8_STATIC"]),
    # the online Hadamard on every down_proj input (rotate.online_hadamard, QuaRot / SpinQuant's R4) on top of R1
    "rotate+online+gptq int4": ("recipes/rotate_gptq_int3.yaml", [ONLINE, "stages.1.scheme.dtype=int4"]),
    "rotate+online+gptq int3": ("recipes/rotate_gptq_int3.yaml", [ONLINE]),
    "rotate+online+awq+gptq int4": ("recipes/rotate_gptq_int3.yaml", [ROT_AWQ_GPTQ % "int4"]),
    "rotate+online+awq+gptq int3": ("recipes/rotate_gptq_int3.yaml", [ROT_AWQ_GPTQ % "int3"]),
    # AWQ's clipping as GPTQ's grid (clip_to: grid) instead of clamped weights
    "rotate+online+awq(grid clip)+gptq int4": ("recipes/rotate_gptq_int3.yaml", [ROT_AWQ_GPTQ % "int4",
                                                                                "stages.1.clip_to=grid"]),
    "rotate+online+awq(grid clip)+gptq int3": ("recipes/rotate_gptq_int3.yaml", [ROT_AWQ_GPTQ % "int3",
                                                                                "stages.1.clip_to=grid"]),
    "awq(grid clip)+gptq int4": ("recipes/awq_gptq_int4.yaml", ["stages.0.clip_to=grid"]),
    "awq(grid clip)+gptq int3": ("recipes/awq_gptq_int4.yaml", ["stages.0.clip_to=grid", "stages.1.scheme.dtype=int3"]),
    **{f"awq(grid clip)+gptq+eora r{r} {bits}": ("recipes/awq_gptq_int4.yaml", [EORA % (bits, r, 1)])
       for bits, ranks in (("int3", (8, 16, 32, 64)), ("int4", (8, 16))) for r in ranks},
    # GPTQ re-run on W - B A and the term refitted, 3 more times (the eora stage's iterations)
    **{f"awq(grid clip)+gptq+eora r{r} x4 int3": ("recipes/awq_gptq_int4.yaml", [EORA % ("int3", r, 4)])
       for r in (8, 16)},
    "awq(grid clip)+gptq+tune int4": ("recipes/awq_gptq_tune_int4.yaml", []),
    "awq(grid clip)+gptq+tune int3": ("recipes/awq_gptq_tune_int4.yaml", ["stages.1.scheme.dtype=int3"]),
    "rotate+online+rtn w8a8 static": ("recipes/rotate_gptq_int3.yaml", [ONLINE, "stages.1.method=rtn",
                                                                       "stages.1.scheme=W8A8_STATIC"]),
    "rotate+online+autoround int4": ("recipes/rotate_gptq_int3.yaml", [ONLINE, *AR, "stages.1.scheme.dtype=int4"]),
    "rotate+online+autoround int3": ("recipes/rotate_gptq_int3.yaml", [ONLINE, *AR]),
    "rotate+online+autoround int2 g32": ("recipes/rotate_gptq_int3.yaml", [ONLINE, *AR, "stages.1.scheme.dtype=int2",
                                                                          "stages.1.scheme.group_size=32"]),
    "rotate+online+autoround+tune int2 g32": ("recipes/rotate_gptq_int3.yaml", [
        ONLINE, *AR, "stages.1.scheme.dtype=int2", "stages.1.scheme.group_size=32", "stages.2.stage=tune_scales"]),
    "awq+autoround int2 g32": ("recipes/awq_gptq_int4.yaml", [W_CLIP, *AR, "stages.1.scheme.dtype=int2",
                                                              "stages.1.scheme.group_size=32"]),
    # mixed precision (issue 19): a scheme per layer by Fisher sensitivity and a knapsack, then AWQ + GPTQ
    "auto awq+gptq @int4 g64 bytes": ("recipes/auto_precision_4bit.yaml", []),
    "auto awq+gptq @int4 g64 bytes, output_error": ("recipes/auto_precision_4bit.yaml",
                                                    ["stages.0.sensitivity=output_error"]),
    "auto awq+gptq @3.5 bits": ("recipes/auto_precision_4bit.yaml", ["stages.0.bytes_of=null",
                                                                     "stages.0.bits_per_weight=3.5"]),
    # sensitivities to GPTQ's weight errors (solved on 32 other calibration windows) instead of round-to-nearest's
    "auto awq+gptq @int4 g64 bytes, gptq errors": ("recipes/auto_precision_4bit.yaml",
                                                   ["stages.0.error_method=gptq"]),
    "auto awq+gptq @3.5 bits, gptq errors": ("recipes/auto_precision_4bit.yaml",
                                             ["stages.0.bytes_of=null", "stages.0.bits_per_weight=3.5",
                                              "stages.0.error_method=gptq"]),
    # sensitivities to AWQ-then-GPTQ's weight errors (the recipe's awq stage imitated on each layer alone)
    "auto awq+gptq @int4 g64 bytes, awq+gptq errors": ("recipes/auto_precision_4bit.yaml",
                                                       ["stages.0.error_method=awq_gptq"]),
    "auto awq+gptq @3.5 bits, awq+gptq errors": ("recipes/auto_precision_4bit.yaml",
                                                 ["stages.0.bytes_of=null", "stages.0.bits_per_weight=3.5",
                                                  "stages.0.error_method=awq_gptq"]),
    # a wider menu: int5 and int6 (the upgrades llama.cpp's Q4_K_M mixes buy with Q5_K / Q6_K) beside the default's
    "auto awq+gptq @int4 g64 bytes, int5/6 menu": ("recipes/auto_precision_4bit.yaml", [f"stages.0.menu={WIDE_MENU}"]),
    "auto awq+gptq @int4 g64 bytes, int5/6 menu, awq+gptq errors": ("recipes/auto_precision_4bit.yaml", [
        f"stages.0.menu={WIDE_MENU}", "stages.0.error_method=awq_gptq"]),
    "auto awq(grid clip)+gptq+tune @int4 g64 bytes, int5/6 menu": ("recipes/auto_precision_4bit.yaml", [
        f"stages.0.menu={WIDE_MENU}", "stages.1.clip_to=grid", "stages.3.stage=tune_scales"]),
    "auto awq(grid clip)+gptq @int4 g64 bytes, int5/6 menu": ("recipes/auto_precision_4bit.yaml", [
        f"stages.0.menu={WIDE_MENU}", "stages.1.clip_to=grid"]),
    "auto awq(grid clip)+gptq+tune @3.5 bits, int5/6 menu": ("recipes/auto_precision_4bit.yaml", [
        f"stages.0.menu={WIDE_MENU}", "stages.0.bytes_of=null", "stages.0.bits_per_weight=3.5", "stages.1.clip_to=grid",
        "stages.3.stage=tune_scales"]),
    "auto awq(grid clip)+gptq+tune @int4 g64 bytes, int5/6 menu, awq+gptq errors": ("recipes/auto_precision_4bit.yaml", [
        f"stages.0.menu={WIDE_MENU}", "stages.0.error_method=awq_gptq", "stages.1.clip_to=grid",
        "stages.3.stage=tune_scales"]),
    # mixed precision with the scale tuning of the uniform rows above (clipping to GPTQ's grid, then tune_scales):
    # the fair comparison with "awq(grid clip)+gptq+tune int4" and "awq(grid clip)+gptq+tune int3 g32"
    "auto awq(grid clip)+gptq @int4 g64 bytes": ("recipes/auto_precision_4bit.yaml", ["stages.1.clip_to=grid"]),
    "auto awq(grid clip)+gptq+tune @int4 g64 bytes": ("recipes/auto_precision_4bit.yaml", [
        "stages.1.clip_to=grid", "stages.3.stage=tune_scales"]),
    "auto awq(grid clip)+gptq+tune @3.5 bits": ("recipes/auto_precision_4bit.yaml", [
        "stages.0.bytes_of=null", "stages.0.bits_per_weight=3.5", "stages.1.clip_to=grid",
        "stages.3.stage=tune_scales"]),
    "awq(grid clip)+gptq+tune int3 g32": ("recipes/awq_gptq_tune_int4.yaml", ["stages.1.scheme.dtype=int3",
                                                                              "stages.1.scheme.group_size=32"]),
    "awq+gptq int3 g32": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.scheme.dtype=int3",
                                                         "stages.1.scheme.group_size=32"]),
    # the same choice with round-to-nearest weights (no AWQ, no GPTQ), against uniform RTN
    "auto rtn @int4 g64 bytes": ("recipes/auto_precision_4bit.yaml", [f"stages={AUTO_RTN % 'bytes_of: W4A16_ASYM_G64'}"]),
    "auto rtn @3.5 bits": ("recipes/auto_precision_4bit.yaml", [f"stages={AUTO_RTN % 'bits_per_weight: 3.5'}"]),
    "auto gptq @int4 g64 bytes": ("recipes/gptq_int4.yaml", [f"stages={AUTO_GPTQ % 'bytes_of: W4A16_ASYM_G64'}"]),
    "auto gptq @3.5 bits": ("recipes/gptq_int4.yaml", [f"stages={AUTO_GPTQ % 'bits_per_weight: 3.5'}"]),
    "gptq int3 g32": ("recipes/gptq_int4.yaml", ["stages.0.scheme.dtype=int3", "stages.0.scheme.group_size=32"]),
    "rtn int3 g32": ("recipes/gptq_int4.yaml", ["stages.0.method=rtn", "calibration=null", "stages.0.scheme.dtype=int3",
                                                "stages.0.scheme.group_size=32"]),
    # microscaling formats (issue 21), against integer formats of the same bytes: symmetric int4 g32 with float16
    # scales is 4.5 bits per weight, NVFP4's exactly; the W4A4 integer baseline has int4 g16 weights (NVFP4's
    # block) and dynamic per-token int4 activations
    "rtn int4 g32 sym": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=" + INT4_G32]),
    "gptq int4 g32 sym": ("recipes/gptq_int4.yaml", ["stages.0.scheme=" + INT4_G32]),
    "rtn nvfp4a16": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=NVFP4A16"]),
    "gptq nvfp4a16": ("recipes/gptq_int4.yaml", ["stages.0.scheme=NVFP4A16"]),
    "awq+gptq nvfp4a16": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.scheme=NVFP4A16"]),
    "rtn mxfp4a16": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=MXFP4A16"]),
    "gptq mxfp4a16": ("recipes/gptq_int4.yaml", ["stages.0.scheme=MXFP4A16"]),
    "rtn nvfp4 w4a4": ("recipes/gptq_int4.yaml", ["stages.0.method=rtn", "stages.0.scheme=NVFP4"]),  # calibrates
    "gptq nvfp4 w4a4": ("recipes/gptq_int4.yaml", ["stages.0.scheme=NVFP4"]),                        # the global
    "awq+gptq nvfp4 w4a4": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.scheme=NVFP4"]),                # input scale
    "rtn int4 w4a4 per-token": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=W4A4_INT"]),
    "gptq int4 w4a4 per-token": ("recipes/gptq_int4.yaml", ["stages.0.scheme=W4A4_INT"]),
    "rtn mxfp4 w4a4": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=MXFP4"]),
    "rtn mxfp8 w8a8": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=MXFP8"]),
    "gptq mxfp8 w8a8": ("recipes/gptq_int4.yaml", ["stages.0.scheme=MXFP8"]),
    "gptq mxfp8 w8a16": ("recipes/gptq_int4.yaml", ["stages.0.scheme=MXFP8A16"]),
    "gptq mxfp4 w4a4": ("recipes/gptq_int4.yaml", ["stages.0.scheme=MXFP4"]),
    "awq+gptq mxfp4a16": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.scheme=MXFP4A16"]),
    # MXFP4's bytes (4.25 bits per weight) with NVFP4's scale encoding: e2m1 in blocks of 32, e4m3 block scales under
    # an fp32 tensor scale, so MXFP4 against NVFP4 at the same bytes isolates the scale encoding (e8m0 vs e4m3)
    "rtn fp4 g32 e4m3": ("recipes/gptq_int4.yaml", [*RTN, "stages.0.scheme=" + FP4_G32_E4M3]),
    "gptq fp4 g32 e4m3": ("recipes/gptq_int4.yaml", ["stages.0.scheme=" + FP4_G32_E4M3]),
    "awq nvfp4a16": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.method=rtn", "stages.1.scheme=NVFP4A16"]),
    "awq nvfp4 w4a4": ("recipes/awq_gptq_int4.yaml", [W_CLIP, "stages.1.method=rtn", "stages.1.scheme=NVFP4"]),
}

for _name, (_path, _over) in list(RUNS.items()):  # the rows measured before the menu widened keep their menu
    if _path == "recipes/auto_precision_4bit.yaml" and not any(o.startswith(("stages.0.menu=", "stages=")) for o in _over):
        RUNS[_name] = (_path, [f"stages.0.menu={OLD_MENU}", *_over])


def run_dir(out_root: Path, name: str) -> Path:
    return out_root / name.replace(" ", "_").replace("+", "-").replace("(", "").replace(")", "").replace(",", "").replace("/", "-")


def compress_all(out_root: Path, only: list[str], jobs: int = 1, reuse: bool = False, extra: tuple = ()) -> dict:
    """Each selected run in its own `compress run` process, `jobs` at a time (each then calibrates on one thread);
    `reuse`: a run whose folder holds a finished report is read, not run again."""
    info, running = {}, []
    names = [n for n in RUNS if not only or n in only]
    for name in names:
        recipe, sets = RUNS[name]
        out = run_dir(out_root, name)
        if not (reuse and (out / "report.json").is_file()):
            cmd = [sys.executable, "-m", "compress", "run", recipe, "--output", str(out), "--overwrite",
                   "--no-progress", "--set", "eval.perplexity=false", "--set", "eval.speed=false", "--set",
                   "eval.baseline=false", *protocol.SAVE_FLOAT32]
            no_data = "calibration=null" in sets  # a calibration.* override would bring the pass back: drop it
            if jobs > 1 and not no_data:
                cmd += ["--set", "calibration.threads=1"]
            for s in [*sets, *(e for e in extra if not (no_data and e.startswith("calibration.")))]:
                cmd += ["--set", s]
            if len(running) >= jobs:
                running.pop(0).wait()
            running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    for proc in running:
        if proc.wait() != 0:
            raise SystemExit(f"a run failed: {proc.args}")
    for name in names:
        out = run_dir(out_root, name)
        report = json.loads((out / "report.json").read_text())
        t = report["timings"]
        # whole-model stages (rotate, auto_precision's sensitivity pass) run before the calibration pass,
        # tune_scales after it: all count
        info[name] = {"dir": str(out), "compress_s": t["compress"], "model_stages_s": t.get("prune_distill", 0.0),
                      "total_s": t["compress"] + t.get("prune_distill", 0.0) + t.get("tune", 0.0),
                      "peak_rss_bytes": report["eval"]["peak_rss_bytes"], "threads": report["model"]["threads"],
                      "calibration_threads": report["recipe"]["resolved"]["calibration"]["threads"]
                      if report["recipe"]["resolved"].get("calibration") else None}
        print(f"{name}: compress {info[name]['total_s']:.0f} s, peak RSS {info[name]['peak_rss_bytes'] / 1e9:.2f} GB",
              flush=True)
    return info


def score_all(info: dict, max_windows: int) -> dict:
    from compress.measure.ppl import score_windows
    from compress.pipeline.report import eval_windows
    from compress.model.load import load_model
    from compress.export.native import load_compressed

    torch.set_num_threads(2)
    base = load_model("default")
    models = {"baseline (float32)": base.model}
    models.update({name: load_compressed(i["dir"]) for name, i in info.items()})
    windows = eval_windows(base.tokenizer, protocol.SPLIT, protocol.SEQ_LEN, max_windows)
    scores = score_windows(models, windows, baseline="baseline (float32)")
    return {n: {"ppl": s.ppl, "kl": s.kl, "top1": s.top1_agreement, "tokens": s.tokens,
                **linear_bits(models[n])} for n, s in scores.items()}


def linear_bits(model) -> dict:
    """Stored bytes of the quantized linears (codes, scales, zero points) and bits per weight over them; the eora
    stage's low-rank terms at bf16 (`lowrank_bytes`); the whole model as a server holds it, float tensors at bf16
    (`serving_bytes`, the low-rank terms and the embedding included)."""
    from compress.core.nn import QuantLinear
    from compress.measure.memory import serving_bytes
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return {"serving_bytes": serving_bytes(model)}
    nbytes = sum(m.qtensor().nbytes for m in layers)
    lowrank = sum(2 * (m.lora_a.numel() + m.lora_b.numel()) for m in layers if m.rank)
    return {"linear_bytes": nbytes, "bits_per_weight": 8 * nbytes / sum(m.in_features * m.out_features for m in layers),
            "lowrank_bytes": lowrank, "serving_bytes": serving_bytes(model)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=protocol.WINDOWS)
    ap.add_argument("--out", default="bench/results/awq_gptq_table.json")
    ap.add_argument("--runs-dir", default="runs/bench")
    ap.add_argument("--only", nargs="*", default=[], help="subset of run names")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each calibrates on one thread)")
    ap.add_argument("--reuse", action="store_true", help="read runs whose folder holds a finished report")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="a recipe override for every run, after the run's own (e.g. calibration.n_samples=16)")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    info = compress_all(Path(args.runs_dir), args.only, args.jobs, args.reuse, tuple(args.sets))
    scores = score_all(info, args.max_windows)
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "windows": args.max_windows,
              "protocol": protocol.as_dict(), "runs": info, "overrides": args.sets,
              "scores": scores}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    base = scores["baseline (float32)"]["ppl"]
    print("| method | WikiText-2 ppl | Δ ppl | KL | top-1 | compress wall time (all stages) | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in scores.items():
        r = info.get(name)
        extra = f"{r.get('total_s', r['compress_s']):.0f} s | {r['peak_rss_bytes'] / 1e9:.2f} GB" if r else "— | —"
        print(f"| {name} | {s['ppl']:.3f} | {100 * (s['ppl'] / base - 1):+.1f}% | {s['kl']:.4f} | {s['top1']:.2%} | {extra} |")


if __name__ == "__main__":
    main()
