"""The dispatcher: per layer and per batch size (rows of the input), which matmul a QuantLinear runs.

Candidates are the kernels in KERNELS that accept the layer (each says why not otherwise) plus the layer's
reference path (dequantize-then-matmul, or the int8 `_int_mm` / fake-quantized path for quantized
activations: kernels/reference.py). `plan_dispatch` times every candidate and the dense layer the quantized one
replaces (same shape, the model's float dtype) at each batch size, on the model's own device, and chooses for
each layer a table of row-count buckets -> the fastest kernel, changing nothing. With `measure=False` it takes, per
bucket, the first usable kernel in registry order that is meant for that many rows (`Kernel.rows`: the W4A16 GEMM for
M <= 64, dequantize+cuBLAS for M >= 128, ...; none meant for it: the nearest range), without timing. Above the
largest bucket, a kernel whose range ends below goes on to the first usable kernel meant for every size above (the
large-batch paths), measured or not. Kernels whose `prepare` is the same function share one prepared state per layer
(the W4A16 GEMM and dequantize+cuBLAS run the same packed operands). On CUDA each candidate call is captured in a CUDA
graph and its replays are timed with CUDA events, as a graph-captured decode step runs it (an eager call would time
its Python launch cost, which can exceed a decode-sized kernel); a call that cannot be captured is timed eagerly and
listed (`eager_timed`). `with use_dispatch(model, report):` puts the
choice on the layers (`QuantLinear.dispatch`) for the duration of the block; it is never saved with the model: it
belongs to the machine that measured it.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from . import cpu, trellis
from .kernel import Kernel

REFERENCE = "reference"
BATCH_SIZES = (1, 4, 16, 64)
TAIL = 2 ** 31 - 1  # the bound of the bucket above the largest batch size planned (LayerDispatch: rows <= bound)
SLOWER_THAN_DENSE = 0.9  # a row whose every compressed candidate runs below this fraction of the dense speed is flagged


def _gpu_kernels() -> dict[str, Kernel]:
    from . import gpu  # CUDA ops and torch's CUDA built-ins; importing needs no GPU
    return {k.name: k for k in gpu.KERNELS}


def _on_qtensor(fn: Callable) -> Callable:
    """Adapt a kernel function of (QuantizedTensor, ...) to take the layer."""
    return lambda layer, *args: fn(layer.qtensor(), *args)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("torch int4pack (CPU)", _on_qtensor(cpu.int4pack_reason), _on_qtensor(cpu.prepare_int4pack),
           cpu.linear_int4pack),
    Kernel("torch int8pack (CPU)", _on_qtensor(cpu.int8pack_reason), _on_qtensor(cpu.prepare_int8pack),
           cpu.linear_int8pack),
    Kernel("torch int4pack (CPU, bf16 activations)", _on_qtensor(cpu.int4pack_bf16_reason),
           _on_qtensor(cpu.prepare_int4pack_bf16), cpu.linear_int4pack_bf16),
    trellis.KERNEL,
)}


FLOAT_COPY = Kernel(
    "dequantized float copy", lambda layer, dtype, device: None,
    lambda layer, dtype: layer.qtensor().dequantize(dtype),
    lambda w, x, bias: F.linear(x, w, None if bias is None else bias.to(x.dtype)))


def registry(float_copy: bool = False) -> dict[str, Kernel]:
    """Every kernel, CPU ones first, in the order `measure=False` prefers them. float_copy adds a kernel that keeps
    a dequantized copy of the weight: as fast as the dense layer at large batch sizes, at the dense layer's memory
    cost wherever it is chosen (weight-only schemes; quantized activations keep their own path)."""
    return {**KERNELS, **_gpu_kernels(), **({FLOAT_COPY.name: FLOAT_COPY} if float_copy else {})}


@dataclass
class LayerDispatch:
    """A layer's plan: rows <= bound -> kernel name, in increasing bounds; beyond the last, the last kernel."""
    buckets: tuple[tuple[int, str], ...]
    dtype: torch.dtype
    states: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, Kernel] = field(default_factory=dict)

    def __post_init__(self):
        # one bucket and a prepared kernel: the forward calls it without looking up the row count
        only = self.buckets[0][1] if len(self.buckets) == 1 else None
        self.only = (self.kernels[only].run, self.states[only]) if only in self.states else None

    def choose(self, rows: int) -> str:
        for bound, name in self.buckets:
            if rows <= bound:
                return name
        return self.buckets[-1][1]

    def describe(self) -> str:
        parts, lo = [], 0
        for i, (bound, name) in enumerate(self.buckets):
            last = i == len(self.buckets) - 1
            span = f"M>{lo}" if last and lo else ("all M" if last else (f"M<={bound}" if not lo else f"M {lo + 1}-{bound}"))
            parts.append(f"{name} ({span})")
            lo = bound
        return ", ".join(parts)


def _merge(choices: list[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    out: list[tuple[int, str]] = []
    for bound, name in choices:
        if out and out[-1][1] == name:
            out[-1] = (bound, name)
        else:
            out.append((bound, name))
    return tuple(out)


# On CUDA, L2 is flushed (read through) before every timed call, so weights come from HBM as in a model's forward.
# Not on CPU: this VM's timings after a cache-evicting read were slower and noisier than the model's own layers
# (a 576x576 bf16 GEMV went from ~90 to ~500 us), so CPU times are with the layer's weights cache-warm. That
# flatters the dense matmul of layers that fit in L2 (the "vs dense" column), never the choice between compressed
# kernels by much; end-to-end decode (bench/cpu_decode.py) is the arbiter.
FLUSH_BYTES = {"cuda": 256 * 2 ** 20}


def _time(fn: Callable[[], Tensor], device: torch.device, repeats: int, flush: Tensor | None = None,
          notes: list[str] | None = None) -> float:
    """Median seconds of `repeats` calls after one warm-up, `flush` read before each. CUDA: the call captured once
    in a CUDA graph and replayed, each replay timed with CUDA events (a decode loop runs its layers inside a graph,
    so host-side launch cost is not the kernel's); where the call cannot be captured, eager host-synchronized
    calls, and the reason is appended to `notes`. Other devices: perf_counter around each call."""
    if device.type == "cuda":
        try:
            return _time_graph(fn, repeats, flush)
        except Exception as e:  # noqa: BLE001 - a call that cannot be captured is timed eagerly, with the reason
            if notes is not None:
                notes.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.sum()  # a read: evicts the caches without leaving dirty lines to write back during the call
            sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_graph(fn: Callable[[], Tensor], repeats: int, flush: Tensor | None) -> float:
    """Capture `fn` (after checking eagerly that it is capture-safe: serving/cuda_graph.capture_problem) and time
    `repeats` replays with CUDA events, `flush` read before each replay, outside the graph and the timed interval.
    Raises when the call cannot be captured."""
    from .cuda_graph import HostSync, capture, capture_problem, time_replays
    problem = capture_problem(fn)
    if problem:
        raise HostSync(problem)
    graph = capture(fn, warmup=1)
    try:
        return time_replays(graph, repeats, (lambda: flush.sum()) if flush is not None else None)
    finally:
        del graph


def _key(layer) -> tuple:
    return (layer.out_features, layer.in_features, layer.scheme, layer.bias is not None,
            getattr(layer, "trellis", None))


def _reason(kernel: Kernel, layer, dtype: torch.dtype, device) -> str | None:
    """Why `kernel` cannot run `layer` (None: it can): first whether it reads the codes the layer holds (a trellis
    layer's tiles are no grid's codes, whatever its scheme says; the float copy reads either through qtensor())."""
    holds = getattr(layer, "trellis", None) is not None
    if kernel is not FLOAT_COPY and kernel.trellis != holds:
        return "reads trellis codes; the layer holds a grid's codes" if kernel.trellis else \
            "reads a grid's codes; the layer holds trellis codes"
    return kernel.reason(layer, dtype, device)


@dataclass
class DispatchRow:
    """One layer shape at one batch size: every candidate's time, the dense layer's, and the choice.
    `below_dense`: every candidate that keeps the weights compressed (all but the float copy) runs at less than
    SLOWER_THAN_DENSE of the dense layer's speed here: no compressed kernel is fast enough at this size."""
    shape: tuple[int, int]
    scheme: str
    layers: int
    rows: int
    times_us: dict[str, float]
    dense_us: float | None
    choice: str
    below_dense: bool = False

    @property
    def vs_dense(self) -> float | None:
        return None if self.dense_us is None else self.dense_us / self.times_us[self.choice]


@dataclass
class DispatchReport:
    dtype: str
    device: str
    rows: list[DispatchRow]
    skipped: dict[str, dict[str, str]]  # "N x K scheme" -> {kernel: why it cannot run these layers}
    layers: int
    threads: int
    # what install_dispatch puts on each layer: "N x K scheme" group key -> (buckets, activation dtype), and the
    # kernels those name (not part of the report's dict)
    choices: dict[tuple, tuple] = field(default_factory=dict)
    kernels: dict[str, Kernel] = field(default_factory=dict)
    timing: str = "-"  # how the times were taken
    # CUDA: "N x K scheme M=rows candidate" -> why that call could not be captured in a CUDA graph (timed eagerly,
    # host-synchronized, instead)
    eager_timed: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "device": self.device, "layers": self.layers, "threads": self.threads,
                "skipped": self.skipped, "timing": self.timing, "eager_timed": self.eager_timed,
                "rows": [{"shape": list(r.shape), "scheme": r.scheme, "layers": r.layers, "rows": r.rows,
                          "times_us": r.times_us, "dense_us": r.dense_us, "choice": r.choice,
                          "vs_dense": r.vs_dense, "below_dense": r.below_dense} for r in self.rows]}


def _prepare_all(kernels: dict[str, Kernel], names, layer, dtype: torch.dtype,
                 errors: dict[str, str] | None = None) -> dict[str, Any]:
    """Each named kernel's prepared state for `layer`, built once per distinct `prepare` function (kernels that run
    the same operands share them: one copy of the packed weight per layer, not one per kernel). With `errors`, a
    prepare that raises is recorded there (kernel name -> why) and its kernels left out; without, it raises."""
    built: dict[Callable, Any] = {}
    states: dict[str, Any] = {}
    for n in names:
        fn = kernels[n].prepare
        if fn not in built:
            if errors is None:
                built[fn] = fn(layer, dtype)
            else:
                try:
                    built[fn] = fn(layer, dtype)
                except Exception as e:  # a kernel that cannot prepare this layer is not a candidate; say why
                    built[fn] = e
        if isinstance(built[fn], Exception):
            errors[n] = f"prepare failed: {type(built[fn]).__name__}: {str(built[fn])[:300]}"
        else:
            states[n] = built[fn]
    return states


def _distance(k: Kernel, rows: float) -> float:
    """How many rows `rows` lies outside the kernel's range (0: inside, or no range)."""
    if k.rows is None:
        return 0
    lo, hi = k.rows
    return lo - rows if rows < lo else (0 if hi is None or rows <= hi else rows - hi)


def _unmeasured(kernels: dict[str, Kernel], usable: list[str], rows: float) -> str:
    """The kernel taken without timing for `rows` rows: the first usable one meant for that many (Kernel.rows), else
    the usable one whose range is nearest (ties: registry order; M = 100 between a kernel for M <= 64 and one for
    M >= 128 goes to the latter), else the reference path. Never the float copy (the dense layer's memory)."""
    candidates = [n for n in usable if kernels[n] is not FLOAT_COPY]
    return min(candidates, key=lambda n: _distance(kernels[n], rows)) if candidates else REFERENCE


def _below_dense(times: dict[str, float], dense: float, kernels: dict[str, Kernel]) -> bool:
    """Whether every candidate that keeps the weights compressed (the reference path and every kernel but the float
    copy) runs at less than SLOWER_THAN_DENSE of the dense layer's speed."""
    compressed = [t for n, t in times.items() if n == REFERENCE or kernels[n] is not FLOAT_COPY]
    return all(dense / t < SLOWER_THAN_DENSE for t in compressed)


def _tail(kernels: dict[str, Kernel], usable: list[str], last: str) -> str | None:
    """The kernel for rows above the largest planned bucket, whose choice was `last`: None (keep `last`) when `last`
    is meant for every size above (or is the reference path), else the first usable kernel that is (the large-batch
    paths: the W4A16 GEMM's range ends at M = 64, dequantize+cuBLAS takes over), else None."""
    if last not in kernels or kernels[last].meant_for(math.inf):
        return None
    return next((n for n in usable if kernels[n] is not FLOAT_COPY and kernels[n].meant_for(math.inf)), None)


@torch.no_grad()
def plan_dispatch(model: nn.Module, batch_sizes=BATCH_SIZES, measure: bool = True, repeats: int = 5,
                  kernels: dict[str, Kernel] | None = None, seed: int = 0, float_copy: bool = False) -> DispatchReport:
    """Choose, for every group of QuantLinears under `model` (one shape and scheme; measured on the first of them),
    the kernel per batch-size bucket, and return what was measured and chosen. Pure: the model is left as it was;
    `use_dispatch(model, report)` (or install_dispatch) applies the choice. float_copy: also consider keeping a
    dequantized float copy of weight-only layers (see `registry`); never chosen unmeasured.

    measure=False: per bucket, the first usable kernel meant for its row count (Kernel.rows; none: the one whose
    range is nearest). Either way, rows above the largest bucket go to the first usable kernel meant for every larger
    size when the largest bucket's kernel is not (an extra bucket up to TAIL). A kernel whose prepare or run raises
    while being measured is dropped from the candidates and listed with the error among the kernels not used."""
    from ..core.nn import QuantLinear, kernel_for

    kernels = registry(float_copy and measure) if kernels is None else kernels
    gen = torch.Generator().manual_seed(seed)
    groups: dict[tuple, list[QuantLinear]] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            groups.setdefault(_key(m), []).append(m)
    rows, skipped, chosen, eager = [], {}, {}, {}
    dtype = device = None
    for key, layers in groups.items():
        first = layers[0]
        dtype = first.bias.dtype if first.bias is not None else _float_dtype(model)
        device = first.qdata.device
        label = f"{first.out_features}x{first.in_features} {first.scheme.name}"
        usable, why = [], {}
        for name, k in kernels.items():
            reason = _reason(k, first, dtype, device) if k is not FLOAT_COPY or first.scheme.act is None else \
                "weight-only layers only (quantized activations keep their path)"
            (why.__setitem__(name, reason) if reason else usable.append(name))
        ref_name = f"{REFERENCE}: {kernel_for(first.scheme)}"
        choices: list[tuple[int, str]] = []
        if not measure or not usable:
            choices = [(b, _unmeasured(kernels, usable, b)) for b in sorted(batch_sizes)]
        else:
            states = _prepare_all(kernels, usable, first, dtype, why)
            usable = [n for n in usable if n in states]
            flush = torch.zeros(FLUSH_BYTES[device.type] // 4, dtype=torch.int32, device=device) \
                if device.type in FLUSH_BYTES else None
            dense_w = torch.randn(first.out_features, first.in_features, generator=gen).to(device, dtype)
            installed, first.dispatch = first.dispatch, None  # the reference path is timed as the layer's own forward
            for b in sorted(batch_sizes):
                x = torch.randn(b, first.in_features, generator=gen).to(device, dtype)
                def timed(what: str, fn: Callable[[], Tensor]) -> float:
                    notes: list[str] = []
                    seconds = _time(fn, device, repeats, flush, notes)
                    if notes:
                        eager[f"{label} M={b} {what}"] = notes[0]
                    return seconds

                t = {REFERENCE: timed(ref_name, lambda: first(x))}
                for n in list(usable):
                    try:
                        t[n] = timed(n, lambda n=n: kernels[n].run(states[n], x, first.bias))
                    except Exception as e:  # recorded, not fatal: the other candidates still run (e.g. a torch op
                        # that refuses a layout on this GPU); the kernel is left out from here on
                        why[n] = f"failed at M={b}: {type(e).__name__}: {str(e)[:300]}"
                        usable.remove(n)
                dense = timed("dense", lambda: F.linear(x, dense_w))
                best = min(t, key=t.get)
                choices.append((b, best))
                rows.append(DispatchRow((first.out_features, first.in_features), first.scheme.name, len(layers), b,
                                        {(ref_name if n == REFERENCE else n): v * 1e6 for n, v in t.items()},
                                        dense * 1e6, ref_name if best == REFERENCE else best,
                                        _below_dense(t, dense, kernels)))
            first.dispatch = installed
            del states, flush
        tail = _tail(kernels, usable, choices[-1][1])
        if tail is not None and tail != choices[-1][1]:
            choices.append((TAIL, tail))
        if why:
            skipped[label] = why
        chosen[key] = (_merge(choices), dtype)
    timing = ("CUDA graph replays timed with CUDA events, median per call" if device is not None and
              device.type == "cuda" else "perf_counter around eager calls, median per call") if rows else "-"
    return DispatchReport(str(dtype).replace("torch.", "") if dtype else "-", str(device) if device else "-", rows,
                          skipped, sum(len(v) for v in groups.values()), torch.get_num_threads(), chosen, kernels,
                          timing, eager)


def install_dispatch(model: nn.Module, report: DispatchReport) -> None:
    """Give every QuantLinear of a group `report` planned its LayerDispatch (kernel operands prepared per layer, once
    per distinct prepare function); layers of other groups stay on the reference path."""
    from ..core.nn import QuantLinear
    for m in model.modules():
        if isinstance(m, QuantLinear) and _key(m) in report.choices:
            buckets, dtype = report.choices[_key(m)]
            names = sorted({n for _, n in buckets if n != REFERENCE})
            m.dispatch = LayerDispatch(buckets, dtype, _prepare_all(report.kernels, names, m, dtype),
                                       {n: report.kernels[n] for n in names})


def install_kernel(model: nn.Module, name: str, dtype: torch.dtype,
                   kernels: dict[str, Kernel] | None = None) -> dict[str, str]:
    """Put kernel `name` on every QuantLinear of `model` that it accepts, at every batch size, unmeasured: what a
    benchmark comparing kernels does, forcing each in turn. Returns the layers left on the reference path, with
    the kernel's reason. Raises ValueError when no kernel has that name (naming those that do exist)."""
    from ..core.nn import QuantLinear
    kernels = registry() if kernels is None else kernels
    if name not in kernels:
        raise ValueError(f"no kernel named {name!r}; registered: {', '.join(kernels)}")
    kernel, left = kernels[name], {}
    for layer_name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        reason = _reason(kernel, m, dtype, m.qdata.device)
        if reason:
            left[layer_name] = reason
            continue
        m.dispatch = LayerDispatch(((max(BATCH_SIZES), name),), dtype, {name: kernel.prepare(m, dtype)},
                                   {name: kernel})
    return left


@contextlib.contextmanager
def use_dispatch(model: nn.Module, report: DispatchReport):
    """Run `model`'s quantized layers on the kernels `report` (plan_dispatch) chose, inside this block only: installed
    on entry and removed on exit, an exception included, so accuracy passes after it run on the reference path."""
    install_dispatch(model, report)
    try:
        yield report
    finally:
        clear_dispatch(model)


def clear_dispatch(model: nn.Module) -> None:
    """Back to the reference path everywhere (drops the prepared operands)."""
    from ..core.nn import QuantLinear
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.dispatch = None


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def summary(model: nn.Module) -> str:
    """The kernels the model's quantized layers use, counted by plan (for the report's kernel column)."""
    from ..core.nn import QuantLinear, kernel_for
    kinds: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            d = m.dispatch
            what = d.describe() if d is not None else kernel_for(m.scheme)
            if d is not None:
                what = what.replace(REFERENCE, f"{REFERENCE} {kernel_for(m.scheme)}")
            kinds[what] = kinds.get(what, 0) + 1
    if not kinds:
        return "torch dense matmul"
    return "; ".join(f"{k} [{n} layers]" for k, n in sorted(kinds.items()))


def render(plan: dict) -> list[str]:
    """Markdown lines for a DispatchReport.to_dict(): the measured table and the kernels that could not run."""
    warm = " CPU times are with the layer's weights cache-warm, which flatters the dense matmul of layers that fit in " \
        "L2; the end-to-end decode speed is the arbiter." if plan["device"].startswith("cpu") else \
        f" L2 flushed before every call; {plan.get('timing', 'host-synchronized eager calls')}."
    lines = [f"{plan['layers']} quantized layers, activations {plan['dtype']} on {plan['device']}, "
             f"{plan['threads']} thread(s); times are medians per call.{warm}", ""]
    if plan["rows"]:
        lines += ["| layer shape (N×K) | scheme | layers | M | chosen kernel | µs | dense µs | vs dense | others (µs) |",
                  "|---|---|---:|---:|---|---:|---:|---:|---|"]
        for r in plan["rows"]:
            others = ", ".join(f"{k} {v:,.0f}" for k, v in r["times_us"].items() if k != r["choice"])
            vs = r["vs_dense"]
            lines.append(f"| {r['shape'][0]}×{r['shape'][1]} | {r['scheme']} | {r['layers']} | {r['rows']} | "
                         f"{r['choice']} | {r['times_us'][r['choice']]:,.0f} | {r['dense_us']:,.0f} | "
                         f"{'—' if vs is None else f'{vs:.2f}×'} | {others or '—'} |")
        slower = sorted({r["rows"] for r in plan["rows"] if r["vs_dense"] is not None and r["vs_dense"] < 0.9})
        if slower:
            lines += ["", f"More than 10% slower than the dense layer it replaces at M = {', '.join(map(str, slower))}"
                          " on this device: no kernel that keeps the weights compressed beats the float matmul there"
                          " (`compress inspect MODEL --float-copy` trades memory for it)."]
        if any(r["choice"] == FLOAT_COPY.name for r in plan["rows"]):
            lines += ["", f"Where `{FLOAT_COPY.name}` is chosen, the layer holds a dequantized weight: the dense "
                          "layer's memory, in addition to the compressed one."]
    eager = plan.get("eager_timed") or {}
    if eager:
        lines += ["", f"Timed eagerly (host-synchronized), not in a CUDA graph, where capture failed ({len(eager)} "
                      "calls): " + "; ".join(f"{k}: {v}" for k, v in list(eager.items())[:8])
                  + ("; ..." if len(eager) > 8 else "")]
    why: dict[str, set] = {}
    for reasons in plan["skipped"].values():
        for kernel, reason in reasons.items():
            why.setdefault(kernel, set()).add(reason)
    if why:
        lines += ["", "Kernels not used: " + "; ".join(f"{k}: {' / '.join(sorted(v))}" for k, v in why.items())]
    return lines
