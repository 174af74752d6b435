"""The roofline model of LLM serving: what an accelerator could do with a model, from bytes and FLOPs alone.

Decode (one new token for each of B sequences at context S) reads every weight once and each sequence's
KV cache once, and does about 2 FLOPs per parameter per token:
    bytes moved      = weight bytes + B * S * KV bytes per token
    latency / step   = max(bytes moved / bandwidth, FLOPs / peak)      (memory-bound below the crossover)
    throughput       = B / latency
    intensity        = FLOPs / bytes moved, against the crossover peak / bandwidth (FLOP per byte)
Prefill of S tokens is compute-bound: 2 * params * S FLOPs (+ attention's 2 * 2 * layers * S^2 * d_attn / 2
for the causal half) at peak. The largest batch that fits: (memory - weight bytes) / (S * KV bytes per token).
KV bytes per token = 2 (K and V) * layers * KV heads * head_dim * bytes per element: grouped-query attention
(fewer KV heads) shrinks it, and with it the memory each sequence needs.
Predictions ignore activations, framework overhead and kernel efficiency: they are ceilings.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GB = 1e9  # datasheets state memory and bandwidth in decimal units
COMPUTE = ("bf16", "fp8", "fp4")  # matmul input precisions, widest first


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_tflops: float  # dense tensor-core peak, no sparsity
    fp8_tflops: float | None  # None: no fp8 tensor cores
    bandwidth_tbs: float  # TB/s
    memory_gb: float
    source: str
    fp4_tflops: float | None = None  # None: no fp4 tensor cores (everything before Blackwell)

    def peak_tflops(self, compute: str = "bf16") -> float:
        """Dense tensor-core peak for matmuls on `compute` inputs: bf16, fp8 (int8 runs at the same rate on these
        GPUs) or fp4 (NVFP4 / MXFP4 on both operands). A precision without tensor cores here runs at the next
        wider one that has them: fp4 on Hopper at the fp8 rate, fp8 on the A100 at the bf16 rate."""
        if compute not in COMPUTE:
            raise ValueError(f"compute={compute!r}; use one of {', '.join(COMPUTE)}")
        rates = {"fp4": self.fp4_tflops, "fp8": self.fp8_tflops, "bf16": self.bf16_tflops}
        return next(rates[c] for c in COMPUTE[COMPUTE.index(compute)::-1] if rates[c])

    @property
    def crossover(self) -> float:
        """FLOP per byte at which bf16 compute and memory take the same time."""
        return self.bf16_tflops * 1e12 / (self.bandwidth_tbs * 1e12)


ACCELERATORS = {a.name: a for a in (
    Accelerator("H100-SXM", 989.4, 1978.9, 3.35, 80, "NVIDIA H100 Tensor Core GPU datasheet (SXM5; dense figures)"),
    Accelerator("H200", 989.4, 1978.9, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet (SXM; dense figures)"),
    Accelerator("A100-80GB", 312.0, None, 2.039, 80, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM; dense BF16)"),
    Accelerator("L40S", 362.05, 733.0, 0.864, 48, "NVIDIA L40S datasheet (dense figures; the starred ones assume "
                                                  "sparsity)"),
    Accelerator("RTX-4090", 165.2, 330.3, 1.008, 24, "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 "
                                                     "(tensor FLOPS with FP32 accumulate, dense)"),
    Accelerator("B200", 2250.0, 4500.0, 8.0, 180, "NVIDIA DGX B200 datasheet (8 GPUs: 72 PFLOPS FP8 training, 144 "
                "PFLOPS FP4 inference with sparsity, 1,440 GB HBM3e at 64 TB/s), per GPU and dense (half the sparse "
                "figures): HGX B200 at 1,000 W", fp4_tflops=9000.0),
)}


def get_accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]


@dataclass(frozen=True)
class ModelFacts:
    """What the roofline needs to know about a model."""
    params: int
    weight_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    attn_dim: int  # query heads * head_dim

    def kv_bytes_per_token(self, element_bytes: float = 2) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def model_facts(config, weight_bytes: int | None = None, params: int | None = None) -> ModelFacts:
    """From a transformers config: parameters counted on the meta device; weight bytes default to bf16."""
    from ..prune.minitron import count_params

    params = count_params(config) if params is None else params
    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    head_dim, kv_heads = attention_dims(text)
    return ModelFacts(params, 2 * params if weight_bytes is None else weight_bytes, text.num_hidden_layers, kv_heads,
                      head_dim, heads * head_dim)


def attention_dims(text) -> tuple[int | float, int | float]:
    """(head_dim, KV heads) of a text config; where they differ per layer (a heterogeneous config: Gemma 4's global
    layers have their own head_dim, which transformers refuses to read globally), their means over the layers, so
    that layers × KV heads × head_dim is the model's KV width when the KV heads are the same in every layer."""
    heads = text.num_attention_heads
    per_layer = getattr(text, "per_layer_config", None)
    layers = list(per_layer) if per_layer else [text]
    dims = [(getattr(c, "head_dim", None) or text.hidden_size // heads, getattr(c, "num_key_value_heads", None) or heads)
            for c in layers]
    head_dim, kv_heads = (sum(d[k] for d in dims) / len(dims) for k in (0, 1))
    return tuple(int(v) if v == int(v) else v for v in (head_dim, kv_heads))


def decode(m: ModelFacts, acc: Accelerator, batch: int = 1, context: int = 1024, kv_bytes: float = 2,
           compute: str = "bf16") -> dict:
    """One decode step for `batch` sequences at `context` tokens of KV cache; `compute`: the matmuls' input
    precision (Accelerator.peak_tflops)."""
    moved = m.weight_bytes + batch * context * m.kv_bytes_per_token(kv_bytes)
    flops = batch * (2 * m.params + 4 * m.layers * context * m.attn_dim)  # matmuls + attention (QK^T and PV)
    peak = acc.peak_tflops(compute) * 1e12
    t_memory, t_compute = moved / (acc.bandwidth_tbs * 1e12), flops / peak
    latency = max(t_memory, t_compute)
    return {"bytes_moved": moved, "flops": flops, "latency_s": latency, "tokens_per_s": batch / latency,
            "bound": "memory" if t_memory >= t_compute else "compute", "intensity": flops / moved,
            "crossover": peak / (acc.bandwidth_tbs * 1e12)}


def prefill_seconds(m: ModelFacts, acc: Accelerator, tokens: int, compute: str = "bf16") -> float:
    """Compute-bound time to prefill `tokens` tokens of one sequence (causal attention: half the score matrix)."""
    flops = 2 * m.params * tokens + 2 * m.layers * tokens * tokens * m.attn_dim
    return flops / (acc.peak_tflops(compute) * 1e12)


def max_batch(m: ModelFacts, acc: Accelerator, context: int = 1024, kv_bytes: float = 2) -> int:
    """Sequences of `context` tokens whose KV caches fit beside the weights (0: the weights alone do not fit)."""
    free = acc.memory_gb * GB - m.weight_bytes
    return max(0, math.floor(free / (context * m.kv_bytes_per_token(kv_bytes))))


def roofline(m: ModelFacts, acc: Accelerator, batches=(1, 16, 64), context: int = 1024, kv_bytes: float = 2,
             compute: str = "bf16") -> dict:
    """The report's roofline block for one model on one accelerator."""
    return {"accelerator": asdict(acc), "context": context, "kv_bytes_per_token": m.kv_bytes_per_token(kv_bytes),
            "weight_bytes": m.weight_bytes, "max_batch": max_batch(m, acc, context, kv_bytes), "compute": compute,
            "peak_tflops": acc.peak_tflops(compute), "prefill_s": prefill_seconds(m, acc, context, compute),
            "decode": {b: decode(m, acc, b, context, kv_bytes, compute) for b in batches}}
