"""The capacity planner behind `compress plan`: how many accelerators a workload needs, from a model's config alone.

Inputs: a model (a transformers config: a hub id, a folder with config.json, or a built-in name from `BUILTIN`), a
scheme per component (weights: `WEIGHTS` or any `scheme.PRESETS` name; KV cache: `KV_DTYPES`), an accelerator from
`roofline.ACCELERATORS` and a `Workload` (concurrent users, context per user, TTFT and tokens/s-per-user targets).

The model, per accelerator of a replica of `tp` accelerators in tensor parallel (weights, KV heads and FLOPs split
`tp` ways; every rank reads its share at the datasheet bandwidth; two all-reduces of the hidden state per layer):
    memory   weights / tp + batch * KV(context) / tp + activations  <=  memory_utilization * memory
    decode   step = max((weight bytes / q_eff + batch * KV bytes) / (bw * bw_eff), FLOPs / (peak * c_eff)) + comm
             tokens/s per user = 1 / step                 (the roofline's `decode`, per rank)
    TTFT     prefill of the prompt alone on its replica: max(FLOPs / (peak * c_eff), chunks * weights / bw) + comm
    comm     2 * layers * (allreduce_latency + 2 (tp-1)/tp * tokens * hidden * 2 bytes / (link bw * link_eff))
    activations  prefill_chunk * 2 bytes * (2 * hidden + (q + k + v widths + 3 * intermediate) / tp)
                 + batch * vocab * 4 bytes / tp (float32 logits of each sequence's last token)
The largest batch is the smaller of what fits in memory and what still meets the tokens/s target; replicas =
ceil(users / batch); the plan is the tensor-parallel size (1, 2, 4, 8 that divides the heads) with the fewest
accelerators in all (ties: the smaller replica). Ignored: queueing (TTFT is an idle replica's), prefills stealing
decode time, compute/communication overlap, pipeline parallelism, speculative decoding, prefix caching.

Defaults are the roofline's ceilings (100% of datasheet bandwidth and peak) so that the course's figures come out
as it states them (Llama-2-13B on an H100: 26.9 GB read, 8.0 ms, 125 tokens/s at batch 1 and 1024 tokens); real
kernels reach less, and `sensitivity` says how far each such assumption may be wrong before the plan needs more
accelerators (the one with the least headroom is the assumption that breaks the plan).

Stored bytes: block linears in the weight scheme (codes + scales + packed zero points, per `bits_per_weight`; a
linear whose width the group does not divide stays bf16, as the quantize stage would leave it); embeddings, head,
norms and biases in bf16 (vLLM keeps them 16-bit for W4A16/W8A16/fp8 checkpoints). Mixtures of experts are refused:
their decode reads only the routed experts, which this roofline does not model.

Over 400 lines because the model, the search, the options table and the sensitivity analysis share one set of
formulas; splitting them would scatter the assumptions this docstring states in one place.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import asdict, dataclass, replace

from .roofline import GB, Accelerator, get_accelerator, model_facts
from ..core.scheme import (FP8_DYNAMIC, MXFP4, MXFP8, NVFP4, NVFP4A16, PRESETS, W3A16_G64, W4A16, W4A16_G64, W8A8,
        W8A16, QuantScheme)

# Reference architectures as transformers config fields, from each model's published config.json (no download).
BUILTIN = {
    "llama-2-13b": {  # meta-llama/Llama-2-13b-hf: the course's worked example (13.0B, MHA)
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
        "max_position_embeddings": 4096, "tie_word_embeddings": False},
    "llama-30b": {  # huggyllama/llama-30b (LLaMA-1 "30B", 32.5B, MHA, trained at 2048 tokens)
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 6656, "intermediate_size": 17920,
        "num_hidden_layers": 60, "num_attention_heads": 52, "num_key_value_heads": 52,
        "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "qwen2.5-32b": {  # Qwen/Qwen2.5-32B-Instruct (32.8B counted, GQA 40 query / 8 KV heads, 32k context)
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "use_sliding_window": False},
}

# Weight schemes by short name; any scheme.PRESETS name is accepted too. None: bf16.
WEIGHTS: dict[str, QuantScheme | None] = {
    "bf16": None, "fp8": FP8_DYNAMIC, "int8": W8A16, "w8a8": W8A8, "int4": W4A16, "int4-g64": W4A16_G64,
    "int3-g64": W3A16_G64, "nvfp4": NVFP4, "nvfp4a16": NVFP4A16, "mxfp4": MXFP4, "mxfp8": MXFP8}
WEIGHT_RISK = {  # qualitative, with what this repository measured (README, SmolLM2-135M: small models lose more)
    "bf16": "none: the reference",
    "fp8": "low: e4m3 weights and activations; published 7B+ results within ~1% perplexity; measured here +1.9% "
           "(FP8_DYNAMIC with GPTQ) on a 135M model",
    "int8": "very low: weight-only per channel; measured here +0.18% perplexity on a 135M model",
    "w8a8": "low to moderate: int8 activations need SmoothQuant-style smoothing on outlier-heavy models; measured "
            "here +0.9-1.1% (SmoothQuant W8A8)",
    "int4": "moderate: AWQ/GPTQ int4 g128 is typically +1-5% perplexity on 7B+ models (published); measured here "
            "+7.8% at best on a 135M model; check your own tasks",
    "int4-g64": "moderate: as int4, slightly lower error for 1/64 more scale bytes",
    "int3-g64": "high: +40% perplexity here even with AWQ+AutoRound; only with evaluation on your tasks",
    "nvfp4a16": "moderate: as int4 g16 with e4m3 scales (4.5 bits); measured here +11.1% perplexity with GPTQ, +7.6% "
                "with AWQ+GPTQ on a 135M model (int4 g32 GPTQ at the same bytes: +18.4%)",
    "nvfp4": "moderate to high: fp4 activations too (Blackwell's fp4 rate); measured here +22.8% perplexity at best "
             "(AWQ+GPTQ) on a 135M model; published 7B+ results are a few percent; check your own tasks",
    "mxfp4": "high: power-of-two scales per 32 cost more than NVFP4's e4m3 per 16; measured here on a 135M model "
             "+115% perplexity W4A4 with GPTQ (+203% round-to-nearest); weight-only MXFP4 +16.3% with GPTQ, +14.0% "
             "with AWQ+GPTQ (NVFP4A16: +11.1%, +7.6%)",
    "mxfp8": "low to moderate: e4m3 weights and activations with power-of-two scales per 32; measured here +2.7% "
             "perplexity with GPTQ (+4.0% round-to-nearest; weights alone +1.2%) on a 135M model whose weights sit "
             "on a 4-bit grid, in line with per-channel fp8 (FP8_DYNAMIC with GPTQ: +1.9%)"}
# KV cache formats: (bits, scale and zero-point bits, elements sharing them; None: one scale per token and KV head)
KV_DTYPES = {"bf16": (16, 0, 1), "fp8": (8, 0, 1), "int8": (8, 16, None), "int4": (4, 32, 32),
             "nvfp4": (4, 8, 16)}  # e2m1, an e4m3 scale per 16 channels (and one calibrated fp32 scale per layer)
KV_RISK = {
    "bf16": "none: the reference",
    "fp8": "low: e4m3 with per-layer scales; measured here +0.7 points of perplexity on a 135M model",
    "int8": "very low: measured here -0.01% perplexity at 2048 tokens on a 135M model (KIVI layout, "
            "bench/kv_cache_table.py); published results within ~0.5%",
    "int4": "low to moderate: with per-channel keys, per-token values in groups of 32 and a 128-token float window "
            "(KIVI) measured here +0.28% perplexity at 2048 tokens on a 135M model (+0.57% without the window); "
            "longer contexts and retrieval tasks are the risk",
    "nvfp4": "moderate to high: e2m1 per token in blocks of 16 channels under e4m3 scales, no float window; measured "
             "here +10.4% perplexity at 2048 tokens on a 135M model (fp8 +1.2%, int4 KIVI +0.28%: per-channel keys "
             "and the window matter more than the element format)"}
ARCH_RISK = {
    "gqa": "architectural: uptraining an MHA checkpoint into grouped KV heads costs ~5% of pre-training compute "
           "(Ainslie et al. 2023) for quality close to MHA; fewer KV heads than the TP size are replicated",
    "mla": "architectural: DeepSeek-V2's latent attention matches MHA when trained from scratch; converting a "
           "trained model needs fine-tuning (MHA2MLA, TransMLA); the latent cache is replicated on every TP rank",
    "hybrid": "architectural: retraining; local layers see only the window, so long-range recall rests on the "
              "global layers (Gemma reports small perplexity costs; long-context retrieval is the risk)"}
# NVLink per direction (the ring all-reduce's bus bandwidth); PCIe 4.0 x16 for the cards without NVLink
LINK_GBS = {"H100-SXM": 450, "H200": 450, "A100-80GB": 300, "L40S": 32, "RTX-4090": 32,
            "B200": 900}  # NVLink 5: 1.8 TB/s bidirectional per GPU (DGX B200 datasheet)
TP_SIZES = (1, 2, 4, 8)
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads from a config. The KV cache: `layers` layers, of which `local_layers` keep only the
    last `window` tokens; each layer stores K and V for `kv_heads` heads of `head_dim`, or (latent > 0, MLA) one
    latent of `latent + rope_dim` elements shared by all heads."""
    name: str
    params: int
    embedding_params: int  # input embedding + untied head: bf16
    linears: tuple[tuple[int, int], ...]  # (in_features, weights) of the decoder blocks' linears, by input width
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_position: int | None = None
    local_layers: int = 0
    window: int | None = None
    latent: int = 0
    rope_dim: int = 0

    def __post_init__(self):
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} heads are not a multiple of {self.kv_heads} KV heads")
        if self.local_layers and not (self.window and 0 < self.local_layers <= self.layers):
            raise ValueError(f"{self.name}: {self.local_layers} local layers need a window and at most "
                             f"{self.layers} layers")

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def linear_params(self) -> int:
        return sum(n for _, n in self.linears)

    def cached_tokens(self, context: int) -> int:
        """Tokens held summed over layers for one sequence of `context` tokens."""
        local = self.local_layers * min(context, self.window or context)
        return (self.layers - self.local_layers) * context + local

    def cache_width(self, tp: int = 1) -> int:
        """Cached elements per token and layer on one of `tp` ranks."""
        if self.latent:
            return self.latent + self.rope_dim  # not split by heads: every rank holds the whole latent
        return 2 * math.ceil(self.kv_heads / tp) * self.head_dim

    def decode_attn_flops(self, context: int) -> float:
        """Attention FLOPs of one new token against `context` cached tokens (QK^T and PV, all layers)."""
        per_token = 2 * self.heads * (2 * self.latent + self.rope_dim) if self.latent else 4 * self.attn_dim
        return per_token * self.cached_tokens(context)

    def prefill_attn_flops(self, tokens: int) -> float:
        """Causal attention FLOPs of a `tokens` prompt (MLA prefills in its decompressed MHA form)."""
        def pairs(window):  # (query, key) pairs a causal layer scores, within a window
            w = min(window, tokens)
            return w * w / 2 + (tokens - w) * w
        local = self.local_layers * pairs(self.window) if self.local_layers else 0
        return 4 * self.attn_dim * ((self.layers - self.local_layers) * pairs(tokens) + local)


SCALE_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float8_e4m3": 8, "e8m0": 8}


def bits_per_weight(s: QuantScheme | None, in_features: int) -> float:
    """Stored bits per weight of an [out, in_features] linear: codes, scales, zero points (packed at the code width,
    as AWQ/GPTQ/compressed-tensors store them). A width the group does not divide stays at 16 bits."""
    if s is None:
        return 16.0
    side = SCALE_BITS[s.scale_dtype] + (0 if s.symmetric else s.bits)  # NVFP4's one fp32 per tensor: ~0 per weight
    if s.granularity == "tensor":
        return float(s.bits)
    if s.granularity == "channel":
        return s.bits + side / in_features
    if in_features % s.group_size:
        return 16.0
    return s.bits + side / (s.group_size if s.granularity == "group" else s.group_size ** 2)


def weight_scheme(name: str) -> QuantScheme | None:
    if name in WEIGHTS:
        return WEIGHTS[name]
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"unknown weight scheme {name!r}; use one of {', '.join(WEIGHTS)} or a preset "
                     f"({', '.join(PRESETS)})")


def kv_element_bytes(kv: str, shape: ModelShape) -> float:
    """Bytes per cached element, scales included (int8: one fp16 scale per token and KV head or latent)."""
    if kv not in KV_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {kv!r}; use one of {', '.join(KV_DTYPES)}")
    bits, side, group = KV_DTYPES[kv]
    group = group or (shape.latent + shape.rope_dim if shape.latent else shape.head_dim)
    return (bits + side / group) / 8


def weight_bytes(shape: ModelShape, weights: str) -> float:
    s = weight_scheme(weights)
    linear = sum(n * bits_per_weight(s, k) for k, n in shape.linears) / 8
    return linear + 2 * (shape.params - shape.linear_params)


def compute_peak(acc: Accelerator, weights: str) -> float:
    """FLOP/s: the fp4 tensor-core rate when activations are fp4 e2m1 (NVFP4, MXFP4: Blackwell), the 8-bit rate
    (fp8 = int8 on Hopper/Ada) when they are otherwise quantized, else bf16; an accelerator without the rate runs at
    the next wider one (Accelerator.peak_tflops). A100 has int8 but no fp8 entry in the table: its W8A8 runs at
    the bf16 rate here (conservative)."""
    s = weight_scheme(weights)
    compute = "bf16" if s is None or s.act is None else "fp4" if s.act.dtype == "fp4_e2m1" else "fp8"
    return acc.peak_tflops(compute) * 1e12


@dataclass(frozen=True)
class Workload:
    """users: sequences decoding at once; context: tokens each holds in its KV cache; prompt_tokens (default:
    context): the prompt prefilled before the first token; targets None: not constrained."""
    users: int
    context: int
    ttft_s: float | None = None
    tokens_per_s: float | None = None  # per user
    prompt_tokens: int | None = None

    def __post_init__(self):
        for k in ("users", "context"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        for k in ("ttft_s", "tokens_per_s"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise ValueError(f"target {k} must be > 0 (or omitted: no target), got {v!r}")
        if self.prompt_tokens is not None and not 1 <= self.prompt_tokens <= self.context:
            raise ValueError(f"prompt_tokens={self.prompt_tokens} must be in 1..context ({self.context})")

    @property
    def prompt(self) -> int:
        return self.prompt_tokens or self.context


@dataclass(frozen=True)
class Assumptions:
    """What the plan takes for granted. Efficiencies are fractions of the datasheet figures (1: the roofline)."""
    bandwidth_efficiency: float = 1.0  # decode's memory reads; tuned serving kernels reach ~0.7-0.9
    compute_efficiency: float = 1.0  # prefill (and compute-bound decode) against dense peak; ~0.4-0.7 typical
    quantized_kernel_efficiency: float = 1.0  # a dequantizing kernel's weight-read speed relative to bf16's
    memory_utilization: float = 0.9  # vLLM's gpu_memory_utilization: the rest is CUDA context, graphs, workspaces
    activation_factor: float = 1.0  # times the activation estimate (0: activations not counted)
    prefill_chunk: int = 8192  # tokens per forward (vLLM's max_num_batched_tokens with chunked prefill)
    allreduce_latency_s: float = 10e-6  # one small all-reduce inside a node
    link_efficiency: float = 1.0  # fraction of the link bandwidth (LINK_GBS) an all-reduce reaches

    def __post_init__(self):
        for k in ("bandwidth_efficiency", "compute_efficiency", "quantized_kernel_efficiency", "memory_utilization",
                  "link_efficiency"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"{k} must be in (0, 1], got {getattr(self, k)!r}")
        if self.activation_factor < 0 or self.allreduce_latency_s < 0 or self.prefill_chunk < 1:
            raise ValueError("activation_factor and allreduce_latency_s must be >= 0 and prefill_chunk >= 1")


@dataclass(frozen=True)
class Deployment:
    """One replica layout; `problem` says why it fails (then accelerators is None). Memory is per accelerator."""
    tp: int
    problem: str | None = None
    binding: str | None = None  # what limits the batch: memory, tokens/s or users
    accelerators: int | None = None
    replicas: int | None = None
    batch: int = 0  # sequences decoding on each replica
    max_batch_memory: int = 0
    max_batch: int = 0  # largest that fits and meets the tokens/s target
    weights_gb: float = 0.0
    kv_gb: float = 0.0  # at `batch`
    activations_gb: float = 0.0
    usable_gb: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0  # per user at `batch`
    ttft_s: float = 0.0


def _comm(shape: ModelShape, acc: Accelerator, a: Assumptions, tp: int, tokens: int, messages: int = 1) -> float:
    if tp == 1:
        return 0.0
    if acc.name not in LINK_GBS:
        raise ValueError(f"no interconnect bandwidth for {acc.name}: add it to compress.serving.planner.LINK_GBS, or plan with "
                         "max_tp=1")
    ring = 2 * (tp - 1) / tp * tokens * shape.hidden * 2 / (LINK_GBS[acc.name] * GB * a.link_efficiency)
    return 2 * shape.layers * (messages * a.allreduce_latency_s + ring)


def step_seconds(shape: ModelShape, acc: Accelerator, weights: str, kv: str, a: Assumptions, tp: int, batch: int,
                 context: int) -> float:
    """One decode step of `batch` sequences at `context` tokens on a replica of `tp` accelerators."""
    w = weight_bytes(shape, weights) / tp / (1.0 if weight_scheme(weights) is None else a.quantized_kernel_efficiency)
    cache = batch * shape.cached_tokens(context) * shape.cache_width(tp) * kv_element_bytes(kv, shape)
    flops = batch * (2 * shape.params + shape.decode_attn_flops(context)) / tp
    t = max((w + cache) / (acc.bandwidth_tbs * 1e12 * a.bandwidth_efficiency),
            flops / (compute_peak(acc, weights) * a.compute_efficiency))
    return t + _comm(shape, acc, a, tp, batch)


def ttft_seconds(shape: ModelShape, acc: Accelerator, weights: str, a: Assumptions, tp: int, prompt: int) -> float:
    """Prefill of one `prompt` on an idle replica: compute-bound, but never faster than reading the weights once
    per chunk."""
    chunks = math.ceil(prompt / a.prefill_chunk)
    flops = (2 * shape.params * prompt + shape.prefill_attn_flops(prompt)) / tp
    reads = chunks * weight_bytes(shape, weights) / tp / (acc.bandwidth_tbs * 1e12 * a.bandwidth_efficiency)
    return max(flops / (compute_peak(acc, weights) * a.compute_efficiency), reads) + \
        _comm(shape, acc, a, tp, prompt, chunks)


def memory_split(shape: ModelShape, acc: Accelerator, weights: str, kv: str, a: Assumptions, tp: int,
                 context: int) -> dict:
    """Bytes per accelerator: usable, weights, activations (fixed part), per sequence (KV cache, logits) and the
    largest batch that fits."""
    usable = a.memory_utilization * acc.memory_gb * GB
    w = weight_bytes(shape, weights) / tp
    qkv = shape.attn_dim + 2 * shape.kv_heads * shape.head_dim  # [chunk, q + k + v] split over the ranks
    act = a.activation_factor * a.prefill_chunk * 2 * (2 * shape.hidden + (qkv + 3 * shape.intermediate) / tp)
    kv_seq = shape.cached_tokens(context) * shape.cache_width(tp) * kv_element_bytes(kv, shape)
    logits = a.activation_factor * shape.vocab * 4 / tp  # float32, vocabulary split over the ranks
    return {"usable": usable, "weights": w, "activations": act, "kv_seq": kv_seq, "logits_seq": logits,
            "max_batch": max(0, math.floor((usable - w - act) / (kv_seq + logits)))}


def deploy(shape: ModelShape, acc: Accelerator, weights: str, kv: str, work: Workload, a: Assumptions,
           tp: int) -> Deployment:
    """The best this replica size does for the workload; `problem` names the target it cannot meet."""
    if shape.heads % tp:
        return Deployment(tp, f"{shape.heads} attention heads do not split over TP {tp}")
    m = memory_split(shape, acc, weights, kv, a, tp, work.context)
    b_mem, ttft = m["max_batch"], ttft_seconds(shape, acc, weights, a, tp, work.prompt)
    base = dict(max_batch_memory=b_mem, weights_gb=m["weights"] / GB, activations_gb=m["activations"] / GB,
                usable_gb=m["usable"] / GB, ttft_s=ttft)
    if b_mem < 1:
        need = m["weights"] + m["activations"] + m["kv_seq"] + m["logits_seq"]
        return Deployment(tp, f"one sequence of {work.context} tokens does not fit: {need / GB:.1f} GB per "
                              f"accelerator (weights {m['weights'] / GB:.1f}) > {m['usable'] / GB:.1f} GB usable",
                          **base)

    def step(b: int) -> float:
        return step_seconds(shape, acc, weights, kv, a, tp, b, work.context)

    problems, b_max = [], b_mem
    if work.tokens_per_s and 1 / step(1) < work.tokens_per_s:
        problems.append(f"{1 / step(1):.1f} tokens/s per user at batch 1 (target {work.tokens_per_s:g})")
    elif work.tokens_per_s:
        lo, hi = 1, b_mem  # the step grows with the batch: the largest batch still meeting the target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if 1 / step(mid) >= work.tokens_per_s else (lo, mid - 1)
        b_max = lo
    if work.ttft_s and ttft > work.ttft_s:
        problems.append(f"TTFT {ttft:.3f} s for a {work.prompt}-token prompt (target {work.ttft_s:g} s)")
    if problems:
        return Deployment(tp, "; ".join(problems), max_batch=b_max, step_s=step(1), tokens_per_s=1 / step(1), **base)
    replicas = math.ceil(work.users / b_max)
    batch = math.ceil(work.users / replicas)  # users spread evenly over the replicas
    binding = "users" if work.users <= b_max else "memory" if b_max == b_mem else "tokens/s"
    return Deployment(tp, None, binding, replicas * tp, replicas, batch, b_mem, b_max, m["weights"] / GB,
                      batch * m["kv_seq"] / GB, (m["activations"] + batch * m["logits_seq"]) / GB, m["usable"] / GB,
                      step(batch), 1 / step(batch), ttft)


def search(shape: ModelShape, acc: Accelerator, weights: str, kv: str, work: Workload, a: Assumptions,
           max_tp: int = 8) -> tuple[Deployment | None, list[Deployment]]:
    """The feasible layout with the fewest accelerators (ties: the smaller replica), and every candidate."""
    candidates = [deploy(shape, acc, weights, kv, work, a, tp) for tp in TP_SIZES if tp <= max_tp]
    feasible = [d for d in candidates if d.problem is None]
    return min(feasible, key=lambda d: (d.accelerators, d.tp), default=None), candidates


def without_ttft(shape: ModelShape, acc: Accelerator, weights: str, kv: str, work: Workload, a: Assumptions,
                 max_tp: int = 8) -> Deployment | None:
    """The plan if TTFT were not a target: what memory and tokens/s alone need."""
    return search(shape, acc, weights, kv, replace(work, ttft_s=None), a, max_tp)[0] if work.ttft_s else None


def infeasible_message(shape: ModelShape, acc: Accelerator, weights: str, kv: str, work: Workload, a: Assumptions,
                       candidates: list[Deployment], max_tp: int = 8) -> str:
    """Which target binds, its best achievable value (the largest replica that splits the heads) and the fix."""
    split = [d for d in candidates if "do not split" not in (d.problem or "")] or candidates
    best = split[-1]
    lines = [f"no layout of up to {max_tp} {acc.name} per replica meets the workload; the best, TP {best.tp}: "
             f"{best.problem}"] + [f"  TP {d.tp}: {d.problem}" for d in candidates]
    if "TTFT" in best.problem:
        eight_bit = compute_peak(acc, weights) > acc.bf16_tflops * 1e12
        lines.append("TTFT is compute-bound: shorten the prompt (--prompt-tokens) or relax --ttft" + (
            "" if eight_bit else ", or compute in 8 bits (--weights fp8); weight-only int4 does not speed prefill"))
        free = without_ttft(shape, acc, weights, kv, work, a, max_tp)
        if free is not None:
            lines.append(f"without the TTFT target: {free.accelerators} {acc.name} ({free.replicas} x TP {free.tp}, "
                         f"TTFT {free.ttft_s:.3f} s)")
    elif "tokens/s" in best.problem:
        lines.append("decode at batch 1 is bandwidth-bound: smaller weights (--weights int4) or a lower --tokens-per-s")
    else:
        lines.append("smaller weights (--weights int4), a smaller KV cache (--kv fp8 / int8) or a shorter --context")
    return "\n".join(lines)


# ---- options, sensitivity, the whole plan ----

def variants(shape: ModelShape) -> list[tuple[str, str, ModelShape]]:
    """Architectural KV reductions: (label, risk key, reshaped model). GQA's fewer K/V projections shrink the
    weights too; MLA (DeepSeek-V2: latent 4 * head_dim, rotary key head_dim / 2: 512 + 64 at head_dim 128) and the
    hybrid layouts keep the baseline's weights."""
    out = []
    if not shape.latent:
        for kv in (8, 4, 1):
            if kv < shape.kv_heads and shape.heads % kv == 0:
                fewer = 2 * shape.layers * shape.hidden * shape.head_dim * (shape.kv_heads - kv)  # k_proj, v_proj
                linears = tuple((k, n - fewer if k == shape.hidden else n) for k, n in shape.linears)
                out.append((f"GQA {shape.heads // kv}:1 ({kv} KV heads)" if kv > 1 else "MQA (1 KV head)", "gqa",
                            replace(shape, kv_heads=kv, params=shape.params - fewer, linears=linears)))
        out.append((f"MLA (latent {4 * shape.head_dim} + {shape.head_dim // 2} per token and layer)", "mla",
                    replace(shape, latent=4 * shape.head_dim, rope_dim=shape.head_dim // 2)))
    if not shape.local_layers:
        out.append(("hybrid 5 local : 1 global, window 1024 (Gemma 3)", "hybrid",
                    replace(shape, local_layers=shape.layers - shape.layers // 6, window=1024)))
        out.append(("hybrid 1 local : 1 global, window 4096 (Gemma 2)", "hybrid",
                    replace(shape, local_layers=shape.layers // 2, window=4096)))
    return out


def options(shape: ModelShape, acc: Accelerator, weights: str, kv: str, work: Workload, a: Assumptions,
            max_tp: int = 8, compare: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """What each compression option buys: the reference (bf16, bf16), this plan, each (weights, kv) pair of
    `compare`, then one change at a time from the plan's (weights, kv): weight schemes, KV dtypes, architectures.
    A row whose only problem is TTFT also says what memory and tokens/s alone would need."""
    rows = [("reference: bf16 weights, bf16 KV", "bf16", "bf16", shape, "none: the reference"),
            (f"this plan: {weights} weights, {kv} KV", weights, kv, shape, "as its rows below")]
    rows += [(f"{w} weights, {k} KV", w, k, shape, f"weights: {WEIGHT_RISK.get(w, 'see its preset')}; KV: "
              f"{KV_RISK[k]}") for w, k in compare]
    menu = ("bf16", "fp8", "int8", "int4") + (("nvfp4",) if acc.fp4_tflops else ())  # fp4 compute: Blackwell
    rows += [(f"weights {w}", w, kv, shape, WEIGHT_RISK[w]) for w in menu if w != weights]
    rows += [(f"KV cache {k}", weights, k, shape, KV_RISK[k]) for k in KV_DTYPES if k != kv]
    rows += [(label, weights, kv, s, ARCH_RISK[risk]) for label, risk, s in variants(shape)]
    out = []
    for label, w, k, s, risk in rows:
        best, cands = search(s, acc, w, k, work, a, max_tp)
        row = {"option": label, "weights": w, "kv": k, "risk": risk,
               "weight_gb": weight_bytes(s, w) / GB,
               "kv_gb_per_user": s.cached_tokens(work.context) * s.cache_width() * kv_element_bytes(k, s) / GB}
        if best is None:
            split = [d for d in cands if "do not split" not in (d.problem or "")] or cands
            free = without_ttft(s, acc, w, k, work, a, max_tp) if "TTFT" in split[-1].problem else None
            row.update(accelerators=None, problem=f"TP {split[-1].tp}: {split[-1].problem}",
                       accelerators_without_ttft=None if free is None else free.accelerators)
        else:
            row.update(accelerators=best.accelerators, tp=best.tp, replicas=best.replicas, batch=best.batch,
                       max_batch=best.max_batch, tokens_per_s=best.tokens_per_s, ttft_s=best.ttft_s)
        out.append(row)
    return out


# assumption -> (what it means, how a factor f >= 1 makes it worse)
PERTURB = {
    "users": ("concurrent users", lambda w, a, f: (replace(w, users=math.ceil(w.users * f)), a)),
    "context": ("context per user (KV held and prompt prefilled)", lambda w, a, f: (
        replace(w, context=math.ceil(w.context * f),
                prompt_tokens=None if w.prompt_tokens is None else math.ceil(w.prompt_tokens * f)), a)),
    "bandwidth_efficiency": ("fraction of datasheet bandwidth decode reaches", lambda w, a, f: (
        w, replace(a, bandwidth_efficiency=a.bandwidth_efficiency / f))),
    "compute_efficiency": ("fraction of peak FLOP/s prefill reaches", lambda w, a, f: (
        w, replace(a, compute_efficiency=a.compute_efficiency / f))),
    "quantized_kernel_efficiency": ("quantized kernel's weight-read speed relative to bf16", lambda w, a, f: (
        w, replace(a, quantized_kernel_efficiency=a.quantized_kernel_efficiency / f))),
    "activation_factor": ("activation memory", lambda w, a, f: (
        w, replace(a, activation_factor=a.activation_factor * f))),
    "allreduce_latency_s": ("all-reduce latency", lambda w, a, f: (
        w, replace(a, allreduce_latency_s=a.allreduce_latency_s * f))),
    "link_efficiency": ("fraction of link bandwidth the all-reduce reaches", lambda w, a, f: (
        w, replace(a, link_efficiency=a.link_efficiency / f))),
}
MAX_FACTOR = 4.0


def sensitivity(shape: ModelShape, acc: Accelerator, weights: str, kv: str, work: Workload, a: Assumptions,
                max_tp: int = 8) -> list[dict]:
    """For each assumption, the smallest adverse factor (up to 4x) at which the plan needs more accelerators
    (or no layout works), by bisection: the accelerator count only grows as an assumption worsens."""
    def total(w, aa):
        best, _ = search(shape, acc, weights, kv, w, aa, max_tp)
        return math.inf if best is None else best.accelerators

    now = total(work, a)
    out = []
    for key, (meaning, apply) in PERTURB.items():
        if key == "quantized_kernel_efficiency" and weight_scheme(weights) is None:
            continue
        if key == "activation_factor" and a.activation_factor == 0:
            continue
        if total(*apply(work, a, MAX_FACTOR)) <= now:
            out.append({"assumption": key, "meaning": meaning, "factor": None})
            continue
        lo, hi = 1.0, MAX_FACTOR
        for _ in range(24):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if total(*apply(work, a, mid)) <= now else (lo, mid)
        w2, a2 = apply(work, a, hi)
        after = total(w2, a2)
        value = getattr(w2, key, None) if key in ("users", "context") else getattr(a2, key)
        out.append({"assumption": key, "meaning": meaning, "factor": hi, "breaks_at": value,
                    "accelerators_after": None if after == math.inf else after})
    return sorted(out, key=lambda r: math.inf if r["factor"] is None else r["factor"])


def plan(shape: ModelShape, accelerator: str, weights: str, kv: str, work: Workload,
         a: Assumptions = Assumptions(), max_tp: int = 8, compare: tuple[tuple[str, str], ...] = ()) -> dict:
    """The whole answer: the plan, every TP candidate, the options table and the sensitivity. Raises ValueError
    when no layout meets the targets, naming the binding one and the best achievable value."""
    acc = get_accelerator(accelerator)
    for w, k in ((weights, kv), *compare):  # unknown names fail first
        weight_scheme(w), kv_element_bytes(k, shape)
    if max_tp not in TP_SIZES:
        raise ValueError(f"max_tp must be one of {TP_SIZES} (tensor parallelism inside one node), got {max_tp}")
    best, candidates = search(shape, acc, weights, kv, work, a, max_tp)
    if best is None:
        raise ValueError(infeasible_message(shape, acc, weights, kv, work, a, candidates, max_tp))
    notes = []
    if shape.max_position and work.context > shape.max_position:
        notes.append(f"context {work.context} is beyond the model's max_position_embeddings {shape.max_position}: "
                     "it needs RoPE scaling (and quality there is untested)")
    sens = sensitivity(shape, acc, weights, kv, work, a, max_tp)
    breaking = next((r for r in sens if r["factor"] is not None), None)
    return {"model": asdict(shape) | {"linear_params": shape.linear_params}, "accelerator": asdict(acc),
            "weights": weights, "kv": kv, "workload": asdict(work), "assumptions": asdict(a),
            "weight_bits_per_weight": sum(n * bits_per_weight(weight_scheme(weights), k) for k, n in shape.linears)
            / shape.linear_params, "kv_element_bytes": kv_element_bytes(kv, shape),
            "plan": asdict(best), "candidates": [asdict(d) for d in candidates],
            "options": options(shape, acc, weights, kv, work, a, max_tp, compare), "sensitivity": sens,
            "breaks_first": breaking, "notes": notes}


# ---- reading a model ----

def shape_from_config(config, name: str = "model") -> ModelShape:
    """A ModelShape from a transformers config, parameters counted on the meta device (no weights)."""
    import torch
    from ..arch import auto_model_class

    from ..core.nn import is_linear, linear_shape

    text = getattr(config, "text_config", None) or config
    if any(getattr(text, f, None) for f in MOE_FIELDS):
        raise ValueError(f"{name} is a mixture of experts: decode reads only the routed experts' weights, which "
                         "this planner does not model; plan a dense model")
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    params = sum(p.numel() for p in model.parameters())
    heads = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    embedding = sum(p.numel() for p in {id(p): p for m in heads for p in m.parameters()}.values())
    by_width: dict[int, int] = {}
    for m in model.modules():
        if is_linear(m) and m not in heads:
            out_f, in_f = linear_shape(m)
            by_width[in_f] = by_width.get(in_f, 0) + out_f * in_f
    facts = model_facts(config, params=params)
    types = getattr(text, "layer_types", None) or []
    local = sum(t == "sliding_attention" for t in types)
    if not types and getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        local = facts.layers  # Mistral-style: every layer slides
    return ModelShape(name, params, embedding, tuple(sorted(by_width.items())), text.hidden_size,
                      getattr(text, "intermediate_size", None) or 4 * text.hidden_size, text.vocab_size, facts.layers,
                      text.num_attention_heads, facts.kv_heads, facts.head_dim,
                      getattr(text, "max_position_embeddings", None), local,
                      getattr(text, "sliding_window", None) if local else None)


@functools.lru_cache(maxsize=None)
def builtin_shape(name: str) -> ModelShape:
    import transformers

    fields = dict(BUILTIN[name])
    return shape_from_config(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields), name)


def load_shape(model: str) -> ModelShape:
    """A built-in name, a folder (or config.json) on disk, or a hub id: config only, no weights."""
    import transformers

    if model in BUILTIN:
        return builtin_shape(model)
    path = os.path.expanduser(model)
    hub_id = model.count("/") <= 1 and not model.startswith((".", "/", "~")) and not model.endswith(".json")
    if not os.path.exists(path) and not hub_id:
        raise ValueError(f"{model}: no such file or folder; give a folder with config.json, a hub id, or a built-in "
                         f"({', '.join(BUILTIN)})")
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read the config of {model!r} ({str(exc).splitlines()[0]}); offline, download "
                         f"its config.json into a folder and pass the folder, or use a built-in "
                         f"({', '.join(BUILTIN)})") from exc
    return shape_from_config(config, model)
