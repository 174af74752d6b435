"""End-to-end decode on a GPU: a Llama-3-8B-shaped model with random weights, bf16 against W4A16 (each W4A16 kernel
forced in turn) and FP8 dynamic, at batch 1, 16 and 64: 512 tokens of prompt, then 128 greedy tokens decoded with
the step captured in a CUDA graph (compress/serving/static_decode.py).

    python bench/gpu_decode.py --out DIR                # on an H100 / H200: about 2 minutes (estimate below)
    python bench/gpu_decode.py --dry-run --out DIR      # CPU, tiny widths: the same code (tests/test_gpu_decode.py)
    python bench/gpu_decode.py --variants "bf16,W4A16 v2,FP8 dynamic" --batches 1,64 --budget 100

Model: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, vocabulary 128256, untied head, bf16,
built directly on the GPU, every matrix drawn from N(0, 0.02) there: every layer its own tensors, so no layer's
weights are in L2 when the next reads them. Variants (VARIANTS, in the order they run, the bars' first):
  bf16                          dense bf16 (cuBLAS)
  W4A16 v2 / v1 / tinygemm / dequant+cuBLAS
                                int4 g128 with integer zero points (RTN on the GPU), packed on the GPU, each run
                                with one kernel forced on every quantized layer (dispatch.install_kernel)
  FP8 dynamic (ours / _scaled_mm / quantize+_scaled_mm)
                                e4m3 per-channel weights, per-token dynamic activations
lm_head stays bf16 in every variant (as AWQ / GPTQ / compressed-tensors checkpoints keep it), so a step reads
15.0 GB of weights in bf16, 8.0 GB in FP8 and 4.8 GB in W4A16 (int4 codes, bf16 scales and zero points). In every
variant q/k/v and gate/up are fused into one linear each (lean_decode.fuse_projections, as vLLM and TensorRT-LLM
run them; --no-fuse keeps them apart). A kernel that is not in this build (gpu.KERNELS) gives a "not run" row with
the reason; a kernel that refuses a layer is an error row (the comparison would be mixed).

What the loop costs besides the matmuls: a block is 4 matmuls and about 16 other kernels (norms, rotation, cache
writes, attention, activation, residuals), about 650 kernels a step; replayed from a graph at an estimated 1.5-2.5
us each (not measured here), that is 1-1.6 ms a step whatever the weights, against ~1.2 ms to read W4A16's 4.8 GB
at 4 TB/s. At batch 1 the W4A16 / bf16 ratio is bounded by it (`ops_per_step` in each row counts the kernels, the
eager-check step time `eager_ms_per_step` shows what the graph saves); fusing those kernels (torch.compile of the
elementwise parts, or a fused norm / rotary kernel) is the next step if the batch-1 bar is missed by that margin.

Per variant and batch: decode tokens/s (batch x 128 / the span of the 128 replays, CUDA events), ms per token
p50 / p90 (each replay timed with its own events), weight bytes read per step (the operands of every linear: the
kernels' packed weights, scales and zero points, the bf16 head; the embedding's one row a token is left out) and
their rate against a device-to-device copy's bandwidth measured in the same run (read + write bytes / time), the
KV-cache bytes the loop reads per step (the whole static cache, batch x 640 positions: 5.4 GB at batch 64, unfilled
slots masked), peak GPU memory of the prefill and of the decode, the tokens/s ratio to bf16 at the same batch, and
`graph_equals_eager`: the first 4 tokens of the graph replays equal those of 4 eager steps from the same prefill.

Bars (issue 44): W4A16 v2 >= 2.2x bf16 tokens/s at batch 1 and >= 1.8x at batch 16; FP8 >= 1.3x at batch 64 (the
best FP8 variant counts). They are evaluated at the end (`bars` in the json, and the md).

Time on an H200 (an estimate from bytes and FLOPs, not a measurement): a bf16 decode step reads 15 GB (+ 5.4 GB of
KV cache at batch 64): ~4-5 ms, so 128 steps take ~0.5-0.7 s; the prefill of 64 x 512 tokens is 4.9e14 FLOP, ~1 s
in bf16, up to ~5 s on a W4A16 kernel tuned for decode; capture, the 4 eager check steps and the warm-up ~0.3 s.
About 1.5 / 2 / 3-6 s for batch 1 / 16 / 64, so 7-10 s a variant. Building a variant: random init of 8B parameters
on the GPU (~1-2 s), RTN and packing of 224 linears on the GPU (~3-6 s), freeing it (<1 s). In all ~10 s for bf16
and ~15 s per quantized variant: bf16 + the 7 quantized variants is ~115 s, within the default --budget of 150 s
(with fewer kernels in the build, less). What does not fit is skipped and recorded as "not run" (the budget is
checked before each variant and each batch, against the longest the same step took so far); --variants and
--batches choose fewer. The budget's clock starts once our CUDA extension is loaded (`extension_load_s` in the
json: seconds from torch's build cache, which bench/gpu_check.py fills; 1-3 minutes for a cold build).

Outputs in --out (default $OUT, else bench/results): gpu_decode.jsonl (one row per variant and batch, appended as
each completes), gpu_decode.json (environment, copy bandwidth, every row, the bars) and gpu_decode.md (the table).
Exit status 0 when every row that ran ran cleanly (whatever the bars), 1 when a row failed, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.arch import get_arch  # noqa: E402
from compress.kernels.dispatch import KERNELS as CPU_KERNELS, clear_dispatch, install_kernel, registry  # noqa: E402
from compress.serving.lean_decode import fuse_projections  # noqa: E402
from compress.core.nn import QuantLinear  # noqa: E402
from compress.core.scheme import FP8_DYNAMIC, W4A16, QuantScheme  # noqa: E402
from compress.kernels.cuda_graph import StepTimer, percentile  # noqa: E402
from compress.serving.static_decode import StaticDecoder  # noqa: E402
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
TINY = dict(LLAMA3_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
W4A16_ASYM = replace(W4A16, symmetric=False)  # int4 g128, uint8 zero points: what AWQ / GPTQ checkpoints hold
CHECK_STEPS = 4  # eager steps whose tokens the graph's must equal
FP8S = ("FP8 dynamic", "FP8 dynamic _scaled_mm", "FP8 dynamic quantize+_scaled_mm")
# issue 44's bars: (variants, the best of which counts; batch; tokens/s against bf16 at that batch)
BARS = ((("W4A16 v2",), 1, 2.2), (("W4A16 v2",), 16, 1.8), (FP8S, 64, 1.3))


@dataclass(frozen=True)
class Variant:
    name: str
    schemes: tuple[QuantScheme, ...]  # the first the kernel accepts is used; () for the dense model
    kernel: str | None  # the kernel forced on every quantized layer (gpu.KERNELS names)


W4A16S = (W4A16_ASYM, W4A16)  # zero points where the kernel takes them, else symmetric (recorded per row)
VARIANTS = (
    Variant("bf16", (), None),
    Variant("W4A16 v2", W4A16S, "compress w4a16 v2 (CUDA)"),
    Variant("FP8 dynamic", (FP8_DYNAMIC,), "compress fp8 w8a8 (CUDA)"),
    Variant("W4A16 v1", W4A16S, "compress w4a16 (CUDA)"),
    Variant("W4A16 tinygemm", W4A16S, "torch tinygemm int4 (CUDA)"),
    Variant("FP8 dynamic _scaled_mm", (FP8_DYNAMIC,), "torch _scaled_mm fp8 (CUDA)"),
    Variant("W4A16 dequant+cuBLAS", W4A16S, "compress w4a16 dequant+cuBLAS (CUDA)"),
    Variant("FP8 dynamic quantize+_scaled_mm", (FP8_DYNAMIC,), "compress fp8 quantize + torch _scaled_mm (CUDA)"),
)


def pick_scheme(v: Variant, setup: Setup) -> tuple[QuantScheme | None, str | None]:
    """The first of the variant's schemes its kernel accepts, asked of an empty layer of the model's first shape
    before 8B parameters are built and quantized; (None, the kernel's reasons) when it takes none. A dry run takes
    the first scheme whatever the (CUDA) kernel says: a CPU kernel stands in for it."""
    kernel = registry()[v.kernel]
    d = setup.config["hidden_size"]
    reasons = []
    for scheme in v.schemes:
        why = kernel.reason(QuantLinear(d, d, scheme, device=setup.device), setup.dtype, setup.device)
        if why is None or setup.dry_run:
            return scheme, None
        reasons.append(f"{scheme.name}: {why}")
    return None, "; ".join(reasons)


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    config: dict
    batches: tuple[int, ...]
    context: int
    new_tokens: int
    dry_run: bool
    copy_bytes_s: float  # the device-to-device copy bandwidth measured at the start of the run
    fuse: bool = True  # q/k/v and gate/up fused into one linear each (lean_decode.fuse_projections)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e9


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    timer = StepTimer(device)
    for _ in range(repeats):
        timer.call(lambda: dst.copy_(src))
    return 2 * nbytes / statistics.median(timer.times())


def build_model(setup: Setup, seed: int = 0) -> torch.nn.Module:
    """The random-weight model, created and initialised on the device (no host copy of 16 GB)."""
    config = transformers.LlamaConfig(**setup.config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(setup.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=setup.dtype)
        except TypeError:  # transformers before 4.56 named it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=setup.dtype)
    model.eval().requires_grad_(False)
    gen = torch.Generator(setup.device).manual_seed(seed)
    with torch.no_grad():  # every tensor drawn here, whatever the transformers version's init does (or skips)
        for p in model.parameters():
            if p.dim() == 2:  # linears and the embedding
                p.normal_(0.0, 0.02, generator=gen)
            else:  # norm weights (Llama has no biases)
                p.fill_(1.0)
    return model


def quantize(model: torch.nn.Module, scheme: QuantScheme) -> None:
    """RTN on the model's device, lm_head kept in float."""
    stage = QuantizeStage(scheme=scheme, ignore=("lm_head",))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)


def release_reference(model: torch.nn.Module) -> None:
    """Drop the QuantLinears' own codes once every one runs a prepared kernel (their forward never reads them
    again), so that memory holds what a server would: the kernels' operands. Operands that alias the codes (fp8
    weights) stay alive through the kernel's reference."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for name in ("qdata", "scale", "zero_point"):
                t = getattr(m, name)
                if t is not None:
                    setattr(m, name, t.new_empty(0))


def _tensors(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads for the linear layers: a prepared kernel's operands, else the layer's own
    tensors (QuantLinear codes, scales, zero points; nn.Linear weight), biases included; each tensor once."""
    tensors: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, QuantLinear):
            d = m.dispatch
            if d is not None and d.only is not None:
                _tensors(d.only[1], tensors)
            else:
                _tensors([m.qdata, m.scale, m.zero_point], tensors)
            _tensors(m.bias, tensors)
        elif isinstance(m, torch.nn.Linear):
            _tensors([m.weight, m.bias], tensors)
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def kv_bytes_per_step(dec: StaticDecoder) -> int:
    """The static cache the step's attention reads: every slot of every layer, keys and values."""
    return dec.k.numel() * dec.k.element_size() * 2


def run_batch(model, setup: Setup, batch: int, seed: int = 1) -> dict:
    """Prefill, 4 eager check steps, rewind, capture, `new_tokens` replays: one row's measurements."""
    device = setup.device
    cuda = device.type == "cuda"
    dec = StaticDecoder(model, batch, setup.context + setup.new_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.config["vocab_size"], (batch, setup.context), generator=gen).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    dec.prefill(ids)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    peak_prefill = torch.cuda.max_memory_allocated(device) if cuda else None

    check = min(CHECK_STEPS, setup.new_tokens)
    eager = StepTimer(device)
    with torch.no_grad():
        for _ in range(check):
            eager.call(dec.step)
    eager_ms = [t * 1e3 for t in eager.times()]
    first = setup.context + 1  # seq position of the first step's token
    eager_tokens = dec.seq[:, first:first + check].clone()
    dec.rewind(setup.context)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        dec.ready()
    _sync(device)
    capture_s = time.perf_counter() - t0
    timer = dec.decode(setup.new_tokens)
    steps = timer.times()
    span = timer.span()
    peak_decode = torch.cuda.max_memory_allocated(device) if cuda else None
    graph_tokens = dec.seq[:, first:first + check]
    row = {"decode_mode": dec.mode, "prefill_s": prefill_s, "prefill_tok_s": batch * setup.context / prefill_s,
           "capture_s": capture_s, "decode_s": span, "decode_tok_s": batch * setup.new_tokens / span,
           "ms_per_token_p50": percentile(steps, 50) * 1e3, "ms_per_token_p90": percentile(steps, 90) * 1e3,
           "ms_per_token_mean": span / setup.new_tokens * 1e3,
           "eager_ms_per_step": statistics.median(eager_ms[1:] or eager_ms),
           "graph_equals_eager": bool(torch.equal(graph_tokens, eager_tokens)),
           "kv_bytes_per_step": kv_bytes_per_step(dec), "ops_per_step": dec.ops_per_step,
           "peak_prefill_gb": _gb(peak_prefill), "peak_decode_gb": _gb(peak_decode)}
    del dec
    return row


class Table:
    """Rows appended to gpu_decode.jsonl as they complete; the json and md written by `finish`."""

    def __init__(self, out: Path, env: dict):
        self.out, self.env, self.rows = out, env, []
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = out / "gpu_decode.jsonl"
        self.jsonl.write_text("")

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        what = f"{row['variant']} batch {row['batch']}"
        if row["status"] == "ok":
            print(f"{what}: {row['decode_tok_s']:,.1f} tok/s, {row['ms_per_token_p50']:.3f} ms/token p50, "
                  f"{row['weight_gb_s']:,.0f} GB/s weights ({row['weight_bw_frac']:.0%} of copy), {row['decode_mode']}",
                  flush=True)
        else:
            print(f"{what}: {row['status']}: {row.get('why') or row.get('error')}", flush=True)

    def finish(self) -> dict:
        dense = {r["batch"]: r["decode_tok_s"] for r in self.rows if r["variant"] == "bf16" and r["status"] == "ok"}
        for r in self.rows:
            if r["status"] == "ok" and r["batch"] in dense:
                r["vs_bf16"] = r["decode_tok_s"] / dense[r["batch"]]
        bars = []
        for variants, batch, need in BARS:
            got = [r for r in self.rows if r["variant"] in variants and r["batch"] == batch and "vs_bf16" in r]
            best = max(got, key=lambda r: r["vs_bf16"], default=None)
            bars.append({"variant": " / ".join(variants) if best is None else best["variant"], "batch": batch,
                         "need_vs_bf16": need, "vs_bf16": None if best is None else best["vs_bf16"],
                         "met": None if best is None else best["vs_bf16"] >= need})
        result = {"env": self.env, "rows": self.rows, "bars": bars}
        (self.out / "gpu_decode.json").write_text(json.dumps(result, indent=1))
        (self.out / "gpu_decode.md").write_text("\n".join(render(result)) + "\n")
        return result


def render(result: dict) -> list[str]:
    env = result["env"]
    lines = [f"# Decode on {env['device']}: {env['model']}", "",
             f"{env['context']} prompt tokens, then {env['new_tokens']} greedy tokens per sequence, each step timed "
             f"on its own (CUDA events on a GPU); how the steps ran is under the table. Device-to-device copy "
             f"bandwidth {env['copy_gb_s']:,.0f} GB/s (read + write). torch {env['torch']}, transformers "
             f"{env['transformers']}, {env['date']}.", "",
             "| variant | batch | tok/s | × bf16 | ms/token p50 | p90 | weights GB/step | weights GB/s | of copy BW "
             "| KV GB/step | peak GB (prefill / decode) | graph = eager | kernel |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['batch']} | {r['status']}: {r.get('why') or r.get('error')} "
                         "| | | | | | | | | | |")
            continue
        vs = r.get("vs_bf16")
        peak = " / ".join("—" if v is None else f"{v:.1f}" for v in (r["peak_prefill_gb"], r["peak_decode_gb"]))
        lines.append(f"| {r['variant']} | {r['batch']} | {r['decode_tok_s']:,.1f} | "
                     f"{'—' if vs is None else f'{vs:.2f}×'} | {r['ms_per_token_p50']:.3f} | "
                     f"{r['ms_per_token_p90']:.3f} | {r['weight_bytes'] / 1e9:.2f} | {r['weight_gb_s']:,.0f} | "
                     f"{r['weight_bw_frac']:.0%} | {r['kv_bytes_per_step'] / 1e9:.2f} | {peak} | "
                     f"{'yes' if r['graph_equals_eager'] else 'NO'} | {r['kernel']} |")
    modes = sorted({r["decode_mode"] for r in result["rows"] if r["status"] == "ok"})
    if modes:
        lines += ["", "Decode steps: " + "; ".join(modes)]
    lines += ["", "Bars (issue 44): " + "; ".join(
        f"{b['variant']} at batch {b['batch']} ≥ {b['need_vs_bf16']}× bf16: "
        + ("not measured" if b["met"] is None else f"{b['vs_bf16']:.2f}× ({'met' if b['met'] else 'NOT met'})")
        for b in result["bars"])]
    return lines


def dry_run_stand_in(model: torch.nn.Module, dtype: torch.dtype, wanted: str, why: str) -> str | None:
    """In a dry run, force the first CPU kernel that takes every quantized layer, so the forced-kernel path
    (prepared operands, released codes, their bytes) runs as on the GPU; None (reference path) when none does."""
    for name in CPU_KERNELS:
        clear_dispatch(model)
        if not install_kernel(model, name, dtype):
            return f"{name} (dry-run stand-in for {wanted}: {why})"
    clear_dispatch(model)
    return None


def _free(device: torch.device) -> None:
    """Give a freed model's, cache's and graph pool's memory back to the device (the next variant's peak then
    holds its own tensors only). On a CPU there is nothing to give back (and gc.collect costs 0.3 s a call)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def run_variant(v: Variant, setup: Setup, table: Table, deadline: float, est: dict) -> None:
    """Build, quantize and dispatch one variant, then run every batch; each failure is a row. Frees the model.
    `est`: the longest a build and each batch took so far (seconds), what the budget is checked against."""
    base = {"variant": v.name, "scheme": None}

    def remaining() -> float:
        return deadline - time.perf_counter()

    def rows(status: str, **what) -> None:
        for b in setup.batches:
            table.add({**base, "batch": b, "status": status, **what})

    scheme = None
    if v.kernel is not None:
        if v.kernel not in registry():
            return rows("not run", why=f"kernel {v.kernel!r} is not in this build (gpu.KERNELS)")
        try:
            scheme, why = pick_scheme(v, setup)
        except Exception as e:  # noqa: BLE001
            return rows("error", error=f"kernel check: {type(e).__name__}: {e}",
                        traceback=traceback.format_exc()[-2000:])
        if scheme is None:
            return rows("not run", why=f"{v.kernel} takes none of the variant's schemes: {why}")
        base["scheme"] = scheme.name
    need = est.get("build", 10.0) + est.get(setup.batches[0], 5.0)
    if remaining() < need:
        return rows("not run", why=f"budget: {remaining():.0f} s left, the variant needs about {need:.0f} s")
    model = None
    try:
        t0 = time.perf_counter()
        model = build_model(setup)
        kernel = "dense matmul (cuBLAS)" if setup.device.type == "cuda" else "dense matmul"
        if scheme is not None:
            quantize(model, scheme)
        fused = fuse_projections(model) if setup.fuse else ["--no-fuse"]
        if scheme is not None:
            left = install_kernel(model, v.kernel, setup.dtype)
            if left and not setup.dry_run:
                reasons = sorted(set(left.values()))
                raise RuntimeError(f"{v.kernel} refuses {len(left)} layers: {'; '.join(reasons[:3])}")
            kernel = v.kernel
            if left:  # the CUDA kernels cannot run on a CPU: the dry run forces a CPU kernel that takes every layer
                kernel = dry_run_stand_in(model, setup.dtype, v.kernel, next(iter(left.values())))
            if kernel is not None:
                release_reference(model)
            else:
                kernel = f"reference path (dry run: {next(iter(left.values()))})"
        _free(setup.device)
        _sync(setup.device)
        build_s = time.perf_counter() - t0
        est["build"] = max(est.get("build", 0.0), build_s)
        wbytes = weight_bytes(model)
    except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the run
        model = None
        _free(setup.device)
        return rows("error", error=f"build: {type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    base.update(kernel=kernel, build_s=build_s, weight_bytes=wbytes, not_fused=fused)
    for batch in setup.batches:
        need = est.get(batch, 5.0)
        if remaining() < need:
            table.add({**base, "batch": batch, "status": "not run",
                       "why": f"budget: {remaining():.0f} s left, batch {batch} took up to {need:.0f} s"})
            continue
        t0 = time.perf_counter()
        try:
            row = run_batch(model, setup, batch)
            step_s = row["decode_s"] / setup.new_tokens
            row.update(weight_gb_s=wbytes / step_s / 1e9, weight_bw_frac=wbytes / step_s / setup.copy_bytes_s,
                       total_gb_s=(wbytes + row["kv_bytes_per_step"]) / step_s / 1e9)
            table.add({**base, "batch": batch, "status": "ok", **row, "batch_s": time.perf_counter() - t0})
        except Exception as e:  # noqa: BLE001
            table.add({**base, "batch": batch, "status": "error", "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-2000:]})
        _free(setup.device)  # the cache and the graph's memory pool of this batch
        est[batch] = max(est.get(batch, 0.0), time.perf_counter() - t0)
    model = None
    _free(setup.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The end-to-end decode table (issue 44): a Llama-3-8B-shaped model, bf16 "
                                             "against W4A16 and FP8 kernels, batch 1 / 16 / 64, CUDA-graph decode.")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny widths (2 layers), float32, batch 1 / 2, 16 + 8 tokens: a check of the script")
    ap.add_argument("--out", help="output folder (default $OUT, else bench/results)")
    ap.add_argument("--budget", type=float, default=150.0,
                    help="seconds for the whole run (default 150); what does not fit is recorded as not run")
    ap.add_argument("--variants", default="all",
                    help=f"comma-separated variant names, in the order to run (default all: "
                         f"{', '.join(v.name for v in VARIANTS)})")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64; dry run 1,2)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens (default 512; dry run 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 128; dry run 8)")
    ap.add_argument("--no-fuse", action="store_true",
                    help="keep q/k/v and gate/up as separate linears (default: fused, as servers run them)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    by_name = {v.name: v for v in VARIANTS}
    names = [v.name for v in VARIANTS] if args.variants == "all" else [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(by_name)}")
    if args.dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        device, dtype, config, batches, context, new = torch.device("cpu"), torch.float32, TINY, (1, 2), 16, 8
        copy_bytes = 16 * 2 ** 20
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device, dtype, config, batches, context, new = torch.device("cuda", 0), torch.bfloat16, LLAMA3_8B, \
            (1, 16, 64), 512, 128
        copy_bytes = 2 ** 30
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else batches
    context = args.context or context
    new = args.new_tokens or new
    extension = {}
    if device.type == "cuda":  # built (or loaded from torch's cache) before the budget's clock starts
        from compress.kernels import cuda_ext
        t0 = time.perf_counter()
        ext = cuda_ext.load()
        extension = {"extension_ok": ext.ok, "extension_reason": ext.reason,
                     "extension_load_s": time.perf_counter() - t0}
        start = time.perf_counter()
    copy_bytes_s = copy_bandwidth(device, copy_bytes)
    setup = Setup(device, dtype, config, batches, context, new, args.dry_run, copy_bytes_s, not args.no_fuse)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    layers, d = config["num_hidden_layers"], config["hidden_size"]
    env = {"date": date.today().isoformat(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
           "model": f"Llama-3-8B shape ({layers} layers, hidden {d}, intermediate {config['intermediate_size']}, "
                    f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} KV heads, vocabulary "
                    f"{config['vocab_size']}), random weights, {str(dtype).replace('torch.', '')}, lm_head "
                    "unquantized",
           "context": context, "new_tokens": new, "batches": list(batches), "variants": names,
           "budget_s": args.budget, "copy_gb_s": copy_bytes_s / 1e9, "fused_projections": not args.no_fuse,
           **extension,
           "argv": sys.argv[1:] if argv is None else argv}
    table = Table(out, env)
    deadline = start + args.budget
    est: dict = {}
    for name in names:
        run_variant(by_name[name], setup, table, deadline, est)
    env["wall_s"] = time.perf_counter() - start
    result = table.finish()
    print("\n".join(render(result)))
    return 1 if any(r["status"] == "error" for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
