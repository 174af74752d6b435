"""Evaluate baseline and compressed models side by side; render report.json and report.md."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from ..calibrate.data import eval_windows, fingerprint
from ..core.nn import QuantLinear, dequantized_if_room
from ..core.profile import phase_of
from ..stages import get_stage
from ..measure.fmt import mb as _mb, num as _f
from ..measure.memory import peak_cuda_bytes, peak_rss_bytes, serving_bytes, weight_bytes
from ..measure.machine import profile_lines
from ..measure.ppl import score_windows
from ..kernels.dispatch import plan_dispatch, render as render_dispatch, use_dispatch
from ..measure.speed import measure_speed, speed_sweep
from ..threads import cpu_threads


OFFLOAD_PREFILL, OFFLOAD_DECODE = 32, 4  # a disk-offloaded model's speed run: every token reads the offloaded weights


def evaluate_models(models: dict[str, nn.Module], tokenizer, spec, device: str = "cpu", baseline: str | None = None,
                    progress: bool = True, profile=None) -> dict:
    """Perplexity (+ KL / top-1 against `baseline`), greedy samples (`spec.samples` new tokens; where they first
    depart from the baseline's), weight bytes and speed for each model, same windows. Accuracy passes run on
    `spec.threads` CPU threads; speed and samples (batch-1 decoding: small ops, where a second thread's barriers
    cost more than it adds on a small model) on the threads set by the caller. `profile` (core.profile.Profile):
    each part timed as its own phase (perplexity, samples, speed, lm-eval, speculative)."""
    from ..model.load import offloaded
    result: dict = {"models": {n: {} for n in models}}
    accuracy_threads = getattr(spec, "threads", None)
    with _dequantized(models, offloaded):
        _accuracy_and_samples(models, tokenizer, spec, device, baseline, progress, profile, result)
    for n, m in models.items():
        on_disk = offloaded(m)
        result["models"][n]["weights"] = weight_bytes(m, meta=bool(on_disk))
        if on_disk:  # accelerate's device_map reads every offloaded module's weights for its forward
            result["models"][n]["offloaded"] = {"modules_on_disk": len(on_disk)}
            if spec.speed:  # a short measurement: each forward reads the offloaded weights again
                vocab = m.get_input_embeddings().weight.shape[0]
                with phase_of(profile, "speed"):
                    speed = measure_speed(m, vocab, min(spec.prefill_tokens, OFFLOAD_PREFILL),
                                          min(spec.decode_tokens, OFFLOAD_DECODE), 1, device)
                result["models"][n]["speed"] = {**speed, "offloaded_modules": len(on_disk)}
        elif spec.speed:
            vocab = m.get_input_embeddings().weight.shape[0]
            quantized = any(isinstance(q, QuantLinear) for q in m.modules())
            batches = sorted({1, 4, 16, 64, *getattr(spec, "speed_batches", ())})
            dispatch = use_dispatch(m, plan_dispatch(m, batches)) if quantized and getattr(spec, "dispatch", True) else \
                contextlib.nullcontext()
            with dispatch as plan, phase_of(profile, "speed"):  # accuracy (lm-eval, later evaluations): reference path
                if plan is not None:
                    result["models"][n]["dispatch"] = plan.to_dict()
                result["models"][n]["speed"] = measure_speed(m, vocab, spec.prefill_tokens, spec.decode_tokens,
                                                             spec.speed_repeats, device)
                if getattr(spec, "speed_batches", ()):
                    result["models"][n]["speed_sweep"] = speed_sweep(m, vocab, spec.speed_batches,
                                                                     spec.speed_contexts, spec.decode_tokens,
                                                                     spec.speed_repeats, device)
    if getattr(spec, "tasks", ()):
        from ..measure.harness import evaluate_tasks
        with cpu_threads(accuracy_threads), phase_of(profile, "lm-eval"), _dequantized(models, offloaded):
            result["lm_eval"] = evaluate_tasks(models, tokenizer, spec.tasks, spec.task_limit, spec.num_fewshot,
                                               spec.task_batch_size, baseline=baseline)
    if getattr(spec, "speculative", ()) and baseline is not None and "compressed" in models:
        with phase_of(profile, "speculative"):
            result["speculative"] = speculative_section(models[baseline], models["compressed"], tokenizer, spec)
    for n, m in models.items():
        result["models"][n]["weights"]["serving_bf16"] = serving_bytes(m, meta=bool(offloaded(m)))
        result["models"][n]["roofline"] = model_roofline(m, result["models"][n]["weights"]["serving_bf16"], spec)
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["peak_cuda_bytes"] = peak_cuda_bytes()
    return result


def _dequantized(models: dict[str, nn.Module], offloaded) -> contextlib.ExitStack:
    """Each resident model's quantized weights dequantized once for the accuracy forwards and the samples, where the
    copy fits (core/nn.py: dequantized_if_room; bit for bit the per-call forward's)."""
    stack = contextlib.ExitStack()
    for m in models.values():
        if not offloaded(m):
            stack.enter_context(dequantized_if_room(m, m.dtype))
    return stack


def _accuracy_and_samples(models: dict[str, nn.Module], tokenizer, spec, device: str, baseline: str | None,
                          progress: bool, profile, result: dict) -> None:
    """evaluate_models' perplexity (KL, top-1) and greedy samples, into `result`."""
    from ..model.load import offloaded
    accuracy_threads = getattr(spec, "threads", None)
    if spec.perplexity:
        windows = eval_windows(tokenizer, spec.split, spec.seq_len, spec.max_windows)
        result["protocol"] = eval_protocol(spec, windows, next(iter(models.values())).dtype)
        for m in models.values():
            for q in _llm_int8_layers(m):
                q.outlier_counts.update(forwards=0, total=0, max=0)
        with cpu_threads(accuracy_threads) as n, phase_of(profile, "perplexity"):
            result["protocol"]["threads"] = n
            scores = score_windows(models, windows, baseline=baseline, device=device, progress=progress)
        for n, s in scores.items():
            result["models"][n].update(ppl=s.ppl, nll=s.nll, tokens=s.tokens, kl=s.kl, top1_agreement=s.top1_agreement)
            result["models"][n].update(llm_int8_figures(models[n]))
    if getattr(spec, "samples", 0):  # decoding, as the speed figures: on the caller's threads
        with phase_of(profile, "samples"):
            result["samples"] = samples_section(models, tokenizer, spec.samples, baseline, offloaded)


def samples_section(models: dict[str, nn.Module], tokenizer, new_tokens: int, baseline: str | None,
                    offloaded) -> dict:
    """Each model's greedy continuations of the fixed prompts (evaluate/samples.py), or why there are none: an
    offloaded model would read its weights from disk for every token; a failure is reported, not raised (the run's
    figures are worth more than its samples)."""
    from ..measure.samples import generate_samples

    if on_disk := [n for n, m in models.items() if offloaded(m)]:
        return {"skipped": f"{', '.join(on_disk)} offloaded to disk: every generated token would read the offloaded "
                           "weights again; `compress generate` where the model fits"}
    try:
        return generate_samples(models, tokenizer, new_tokens, baseline)
    except Exception as exc:  # noqa: BLE001 - said in the report instead
        return {"skipped": f"generation failed: {type(exc).__name__}: {exc}"}


def speculative_section(target: nn.Module, draft: nn.Module, tokenizer, spec) -> dict:
    """The compressed model measured as a greedy speculative-decoding draft for the original (batch 1, on the speed
    threads, its fastest kernels): α, tokens per target step, speed-up per draft length, the roofline's prediction."""
    from ..serving.lean_decode import use_rows
    from ..measure.speculation import choose_kernels, measure_draft, roofline_rows, wikitext_prompts

    prompts = wikitext_prompts(tokenizer, spec.speculative_prompts, spec.speculative_prompt_tokens)
    quantized = any(isinstance(q, QuantLinear) for q in draft.modules())
    batches = sorted({1, *(k + 1 for k in spec.speculative)})
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if quantized:
            stack.enter_context(use_dispatch(draft, plan_dispatch(draft, batches)))
        # the few-row kernels as `compress speculate --kernels auto` decides; the draft as it is (no W4A8)
        params = next(target.parameters())
        why_not = (choose_kernels("auto", torch.get_num_threads(), "auto", str(params.dtype).replace("torch.", ""))
                   if params.device.type == "cpu" else f"kernels: each layer's own forward (on {params.device.type})")
        if why_not is None:
            stack.enter_context(use_rows(target))
            stack.enter_context(use_rows(draft))
        result = measure_draft(target, draft, prompts, spec.speculative_new_tokens, tuple(spec.speculative))
    result["kernels"] = "rows" if why_not is None else why_not
    result["roofline"] = roofline_rows(result, target.config, draft.config, spec.accelerators)
    return result


def _sample_lines(report: dict) -> list[str]:
    from ..measure.samples import render
    return render(report.get("eval", {}).get("samples"))


def _speculative_lines(report: dict) -> list[str]:
    section = report.get("eval", {}).get("speculative")
    if not section:
        return []
    from ..measure.speculation import render
    return ["", "## The compressed model as a speculative-decoding draft for the original"] + render(section)[1:]


def eval_protocol(spec, windows, dtype: torch.dtype) -> dict:
    """How the perplexity windows were made (the report's `eval.protocol`)."""
    return {
        "dataset": "wikitext-2-raw-v1", "split": spec.split, "join": "\\n\\n", "seq_len": spec.seq_len,
        "stride": spec.seq_len, "windows": int(windows.shape[0]), "max_windows": spec.max_windows,
        "predicted_tokens_per_window": spec.seq_len - 1, "dtype": str(dtype).replace("torch.", ""),
        "bos": "none added", "tokens_fingerprint": fingerprint(windows),
    }


def llm_int8_figures(model: nn.Module) -> dict:
    """LLM.int8 dynamic outliers counted over the evaluation windows, and the share of matmul work in float."""
    out = {}
    outliers = {name: {"forwards": c["forwards"], "mean": c["total"] / c["forwards"], "max": c["max"],
                       "in_features": q.in_features}
                for name, q in _llm_int8_layers(model, named=True) if (c := q.outlier_counts)["forwards"]}
    if outliers:  # LLM.int8 dynamic: outlier features computed in float, per evaluation window
        out["llm_int8_outliers"] = outliers
    if (share := llm_int8_float_share(model)) is not None:
        out["llm_int8_float_share"] = share
    return out


def model_figures(model: nn.Module, spec, meta: bool = False) -> dict:
    """Weight bytes (as held, and as a bf16 server holds them) and the roofline of a model that was not measured
    resident (a streamed run: `meta` counts its blocks on the meta device by shape); with the LLM.int8 figures."""
    weights = weight_bytes(model, meta)
    weights["serving_bf16"] = serving_bytes(model, meta=meta)
    return {**llm_int8_figures(model), "weights": weights,
            "roofline": model_roofline(model, weights["serving_bf16"], spec)}


def llm_int8_float_share(model: nn.Module) -> dict | None:
    """The share of the LLM.int8 layers' matmul work done in float: a layer with K inputs, N outputs and k of its
    input features computed in float spends k / K of its 2·M·N·K multiply-adds in float. Per layer k / K, and
    overall Σ N·k / Σ N·K (every layer sees the same tokens). k is the static outlier set, or, in dynamic mode, the
    mean over the forwards since the counts were reset (the perplexity windows). None: no LLM.int8 layer ran."""
    layers, num, den = {}, 0.0, 0.0
    for name, q in _llm_int8_layers(model, named=True):
        c = q.outlier_counts
        if q.outlier_cols is not None:
            k = float(q.outlier_cols.numel())
        elif c["forwards"]:
            k = c["total"] / c["forwards"]
        else:
            continue
        layers[name] = k / q.in_features
        num, den = num + k * q.out_features, den + q.in_features * q.out_features
    return {"overall": num / den, "layers": layers} if layers else None


def _llm_int8_layers(model: nn.Module, named: bool = False):
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.scheme.act is not None
              and m.scheme.act.outlier_threshold is not None]
    return layers if named else [m for _, m in layers]


def model_roofline(model: nn.Module, weight_total: int, spec) -> list[dict]:
    """Predicted serving figures of `model` from its weight bytes as served (float tensors in bf16, quantized
    layers as stored) and its KV cache (bf16, 1 byte per element with calibrated fp8 scales, 0.5625 for NVFP4, or
    an int KIVI cache's bytes per element)."""
    from ..serving.roofline import get_accelerator, model_facts, roofline

    facts = model_facts(model.config, weight_bytes=weight_total)
    from ..kv.cache import KV_BYTES

    scaled = [m.kv_cache_dtype for m in model.modules()
              if getattr(m, "kv_cache_dtype", None) and getattr(m, "k_scale", None) is not None]
    kv_bytes = KV_BYTES[scaled[0]] if scaled else 2
    int_kv = [m.kv_quant for m in model.modules() if getattr(m, "kv_quant", None) is not None]
    if int_kv:  # a KIVI cache: its codes with their scales and zeros (the float residual window is per sequence)
        kv_bytes = int_kv[0].bytes_per_element()
    return [roofline(facts, get_accelerator(a), tuple(getattr(spec, "roofline_batches", (1, 16, 64))),
                     getattr(spec, "roofline_context", 1024), kv_bytes, matmul_compute(model))
            for a in getattr(spec, "accelerators", ("H100-SXM",))]


def matmul_compute(model: nn.Module) -> str:
    """The matmul input precision the roofline's compute peak assumes: the widest over the quantized linears'
    activations (weight-only layers run in bf16; int8, fp8 and int4 activations at the 8-bit rate, as Hopper and
    Blackwell have no int4 tensor cores; fp4 e2m1 ones, NVFP4 and MXFP4, at the fp4 rate). Float layers (the head,
    ignored ones) are left out: a ceiling, as the rest."""
    from ..core.nn import QuantLinear
    from ..serving.roofline import COMPUTE

    def compute(layer) -> str:
        act = layer.scheme.act
        return "bf16" if act is None else "fp4" if act.dtype == "fp4_e2m1" else "fp8"
    kinds = {compute(m) for m in model.modules() if isinstance(m, QuantLinear)}
    return min(kinds, key=COMPUTE.index) if kinds else "bf16"


def _task_lines(lm: dict | None) -> list[str]:
    if not lm:
        return []
    names = list(lm["scores"])
    diffs = lm.get("vs_baseline") or {}
    lines = ["", "## lm-eval tasks", "",
             f"{lm['harness']}, {lm['num_fewshot']}-shot, limit {lm['limit'] or 'none (whole split)'}, batch "
             f"{lm['batch_size']}, BOS {lm['bos']}; data: {lm['data']}. Task versions: " +
             ", ".join(f"{t} {v['version']}" for t, v in lm["tasks"].items()) + ". Score ± standard error"
             + ("; in brackets the difference to the baseline ± its standard error, with ≈ where it is under two "
                "standard errors (not distinguishable from no change at this document count)." if diffs else "."),
             "", "| task | metric | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for task, metrics in lm["scores"][names[0]].items():
        for metric in metrics:
            cells = []
            for n in names:
                v = lm["scores"][n][task][metric]
                d = diffs.get(n, {}).get(task, {}).get(metric)
                cell = f"{v['value']:.4g}" + (f" ± {v['stderr']:.2g}" if v["stderr"] is not None else "")
                if d is not None:
                    cell += f" ({d['delta']:+.3g}" + (f" ± {d['stderr']:.2g}" if d["stderr"] is not None else "") + \
                        (", ≈" if d["within_noise"] else "") + ")"
                cells.append(cell)
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    return lines


def _sweep_lines(models: dict) -> list[str]:
    rows = [(n, p) for n, m in models.items() for p in m.get("speed_sweep") or ()]
    if not rows:
        return []
    first = next(p for _, p in rows if "skipped" not in p)
    lines = ["", "## Speed sweep", "",
             f"Tokens/s over the batch (prefill: batch × context tokens in one forward; decode: {first['decode_tokens']}"
             f" greedy steps for the whole batch), median of {first['repeats']} after a warm-up, "
             f"{first['threads']} thread(s) on {first['device']}.", "",
             "| model | batch | context | prefill tok/s | decode tok/s | kernel |", "|---|---:|---:|---:|---:|---|"]
    for n, p in rows:
        if "skipped" in p:
            lines.append(f"| {n} | {p['batch']} | {p['prefill_tokens']} | skipped: {p['skipped']} | | |")
        else:
            lines.append(f"| {n} | {p['batch']} | {p['prefill_tokens']} | {p['prefill_tok_s']:,.1f} | "
                         f"{p['decode_tok_s']:,.1f} | {p['kernel']} |")
    return lines


def _roofline_lines(models: dict) -> list[str]:
    rows = [(n, r) for n, m in models.items() for r in m.get("roofline") or ()]
    if not rows:
        return []
    batches = list(rows[0][1]["decode"])
    lines = ["", "## Roofline predictions", "",
             f"Decode at context {rows[0][1]['context']}: bytes moved per step ÷ bandwidth (or FLOPs ÷ peak when "
             "compute-bound); ceilings that ignore kernel efficiency (compress/serving/roofline.py).", "",
             "| model | accelerator | weights | KV / token | latency B=1 | " +
             " | ".join(f"tok/s B={b}" for b in batches) + " | max batch | prefill |",
             "|---|---|---:|---:|---:|" + "---:|" * len(batches) + "---:|---:|"]
    for n, r in rows:
        d = r["decode"]
        lines.append(f"| {n} | {r['accelerator']['name']} | {_mb(r['weight_bytes'])} | "
                     f"{r['kv_bytes_per_token'] / 1e3:,.1f} kB | {d[batches[0]]['latency_s'] * 1e3:.3f} ms | " +
                     " | ".join(f"{d[b]['tokens_per_s']:,.0f}" for b in batches) +
                     f" | {r['max_batch']:,} | {r['prefill_s'] * 1e3:.2f} ms |")
    return lines


def write_report(report: dict, folder: str | Path) -> None:
    folder = Path(folder)
    (folder / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (folder / "report.md").write_text(render_markdown(report))


def _calib_where(cal: dict) -> str:
    kind = cal.get("kind")
    if kind == "files":
        return ", ".join(Path(f).name for f in cal.get("files", ()))
    if kind == "hub":
        return cal.get("dataset") or ""
    if kind == "self":
        return "sampled from the model"
    return cal.get("split") or ""


def _activation_notes(verify: dict) -> list[str]:
    if "activations" not in verify:
        return []
    match = verify.get("input_scales_match")
    return [verify["activations"] + ("" if match is None else
                                     "; stored static input scales equal ours" if match else
                                     "; STORED STATIC INPUT SCALES DIFFER FROM OURS")]


def _export_lines(exports: list[dict]) -> list[str]:
    if not exports:
        return []
    verified = any(e.get("verify") for e in exports)
    lines = ["", "## Exports", "",
             "Each export was reloaded through the loader named and compared with the compressed model in memory "
             "(KL divergence per token and top-1 agreement of next-token predictions)." if verified else
             "The exports were not reloaded here (the notes say why).", "",
             "| format | folder | size | read by | verified with | KL | top-1 |", "|---|---|---:|---|---|---:|---:|"]
    for e in exports:
        v = e.get("verify") or {}
        lines.append(f"| {e['format']} | `{e['folder']}` | {_mb(e.get('bytes'))} | {e['loaders']} | "
                     f"{v.get('loader', 'not verified')} | {_f(v.get('kl'), '{:.2e}')} | "
                     f"{_f(v.get('top1_agreement'), '{:.4f}')} |")
    notes = [f"- {e['format']}: {n}" for e in exports
             for n in [*e.get("notes", []), *_activation_notes(e.get("verify") or {})]]
    return lines + ([""] + notes if notes else [])


def _models(report: dict) -> dict:
    return report.get("eval", {}).get("models", {})


def _header_lines(report: dict) -> list[str]:
    lines = ["# compress report", ""]
    rec = report.get("recipe", {})
    if rec:
        lines += [f"- recipe: `{rec.get('path')}` (sha256 `{rec.get('sha256', '')[:16]}…`)"
                  + (f", overrides: {', '.join(rec['overrides'])}" if rec.get("overrides") else "")]
    model = report.get("model", {})
    if model:
        facts = [model.get("family") or model.get("kind"),  # `compress eval` reports only source and kind
                 f"{model['parameters'] / 1e6:.1f}M parameters" if model.get("parameters") else None,
                 f"{model['dtype']} on {model['device']}" if model.get("dtype") else None]
        facts = ", ".join(f for f in facts if f)
        lines += [f"- model: `{model.get('source')}`" + (f" ({facts})" if facts else "")]
    cal = report.get("calibration")
    if cal:
        lines += [f"- calibration: {cal.get('n_samples')} × {cal.get('seq_len')} tokens from {cal.get('kind')}"
                  f" ({_calib_where(cal)}), seed {cal.get('seed')}, "
                  f"fingerprint `{cal.get('fingerprint', '')[:16]}…`"]
        if isinstance(cal.get("replay"), list):  # "exact", or why replaying the blocks is not the model's forward
            lines += [f"- **calibration replay is not the model's own forward**: {why}" for why in cal["replay"]]
    # what a stage did not do as asked (AWQ clipping only where no scaling pair could be used), said up front
    lines += [f"- **{section['summary']}**" for section in report.get("stages", []) if section.get("summary")]
    proto = report.get("eval", {}).get("protocol")
    if proto:
        lines += [f"- perplexity: WikiText-2 {proto['split']}, rows joined with \"\\n\\n\", seq_len {proto['seq_len']}, "
                  f"stride {proto['stride']}, {proto['windows']} windows"
                  + (" (limited by max_windows)" if proto.get("max_windows") else " (whole split)")
                  + f", {proto['dtype']}"]
    return lines


def _accuracy_lines(report: dict) -> list[str]:
    models = _models(report)
    lines = ["", "## Accuracy", ""]
    if not report.get("eval", {}).get("protocol"):
        return lines + ["Perplexity, KL and top-1 agreement: not evaluated (eval.perplexity: false)."]
    lines += ["| model | perplexity | Δ ppl | KL to baseline (nats/token) | top-1 agreement |",
              "|---|---:|---:|---:|---:|"]
    base_ppl = models.get("baseline", {}).get("ppl")
    for n, m in models.items():
        delta = f"{100 * (m['ppl'] / base_ppl - 1):+.2f}%" if base_ppl and m.get("ppl") and n != "baseline" else "—"
        lines.append(f"| {n} | {_f(m.get('ppl'), '{:.3f}')} | {delta} | {_f(m.get('kl'))} | "
                     f"{_f(m.get('top1_agreement'), '{:.2%}')} |")
    return lines


def _memory_lines(report: dict) -> list[str]:
    ev, models, mem = report.get("eval", {}), _models(report), report.get("memory", {})
    lines = ["", "## Memory", "", "| model | weights in memory | linear layers | quantized linears vs bf16 | "
             "checkpoint on disk |", "|---|---:|---:|---:|---:|"]
    for n, m in models.items():
        w = m.get("weights", {})
        ratio = w.get("quantized_over_bf16")
        disk = mem.get("checkpoint_bytes") if n != "baseline" else mem.get("baseline_checkpoint_bf16_bytes")
        lines.append(f"| {n} | {_mb(w.get('total'))} | {_mb(w.get('linear_layers'))} | "
                     f"{'—' if ratio is None else f'{ratio:.3f}×'} | {_mb(disk)} |")
    for n, m in models.items():
        bd = m.get("weights", {}).get("by_dtype", {})
        lines.append(f"\n{n} weight bytes by dtype: " + ", ".join(f"{k} {_mb(v)}" for k, v in bd.items()))
    lines += ["", f"Peak RSS: {_mb(ev.get('peak_rss_bytes'))}"
              + (f"; peak CUDA memory: {_mb(ev['peak_cuda_bytes'])}" if ev.get("peak_cuda_bytes") else "")
              + (" (baseline checkpoint bytes are its weights at bf16)" if mem else "")]
    plan = report.get("memory_plan")
    if plan:  # predicted from the config before loading (memory_plan.py)
        lines.append(f"Predicted host peak (memory plan, before loading): {_mb(plan['peak_bytes'])} during "
                     f"{plan['peak_phase']}; {_mb(plan['available'])} were available.")
    return lines


def _speed_lines(report: dict) -> list[str]:
    models = _models(report)
    if not any("speed" in m for m in models.values()):
        return []
    lines = ["", "## Speed (batch 1)", "", "| model | prefill tok/s | decode tok/s | kernel | threads |",
             "|---|---:|---:|---|---:|"]
    for n, m in models.items():
        s = m.get("speed")
        if s:
            where = f" (disk offload: {s['offloaded_modules']} modules)" if s.get("offloaded_modules") else ""
            lines.append(f"| {n}{where} | {s['prefill_tok_s']:.2f} | {s['decode_tok_s']:.2f} | {s['kernel']} | "
                         f"{s['threads']} |")
    lines += [f"\n{n}: prefill {s['prefill_tokens']} tokens, then {s['decode_tokens']} greedy decode steps; median "
              f"of {s['repeats']} runs after a warm-up, on {s['device']}"
              + (f"; decode: {s['decode_mode']}" if s.get("decode_mode") and s["device"].startswith("cuda") else "")
              + (": every forward reads the offloaded modules' weights from disk (or the page cache), so these "
                 "figures time the disk more than the model." if s.get("offloaded_modules") else ".")
              for n, s in _distinct_protocols(models)]
    return lines


def _distinct_protocols(models: dict) -> list[tuple[str, dict]]:
    """One (model names, speed) line per distinct speed protocol: an offloaded model's is shorter."""
    seen: dict[tuple, tuple[list[str], dict]] = {}
    for n, m in models.items():
        s = m.get("speed")
        if s:
            key = (s["prefill_tokens"], s["decode_tokens"], s["repeats"], s["device"], bool(s.get("offloaded_modules")),
                   s.get("decode_mode"))
            seen.setdefault(key, ([], s))[0].append(n)
    return [(", ".join(names), s) for names, s in seen.values()]


def _streamed_lines(report: dict) -> list[str]:
    st = report.get("streamed")
    if not st:
        return []
    lines = ["", "## Streamed from disk", "",
             f"The weights were read block by block from {st['weights_from']} ({st['blocks']} blocks at "
             f"{st['dtype']}, one in memory at a time) and the output written shard by shard as blocks finished. "
             f"Evaluation: {st['evaluation']}."]
    lines += [f"- not measured: {what}: {why}" for what, why in (st.get("not_measured") or {}).items()]
    return lines


def _offload_lines(report: dict) -> list[str]:
    off = {n: m["offloaded"] for n, m in _models(report).items() if m.get("offloaded")}
    if not off:
        return []
    return ["", "## Offloaded to disk", ""] + [
        f"- {n}: {o['modules_on_disk']} modules kept on disk by accelerate's device_map (`--offload`), read for each "
        f"forward" for n, o in off.items()]


def _dispatch_lines(report: dict) -> list[str]:
    lines = []
    for n, m in _models(report).items():
        if m.get("dispatch"):
            lines += ["", f"## Kernel dispatch: {n}", "", "Each quantized layer shape timed with every kernel that "
                      "can run it and with the dense layer it replaces; the fastest runs at each batch size (M rows). "
                      "Speed above is measured with these choices; accuracy on the reference path.", ""]
            lines += render_dispatch(m["dispatch"])
    return lines


def _stage_lines(report: dict) -> list[str]:
    lines = []
    for section in report.get("stages", []):  # each stage renders its own section (stages/)
        lines += get_stage(section["stage"]).render(section, _models(report))
    kept = report.get("kept_in_float")
    return lines + (["", "Not linear layers, kept in float: " + "; ".join(kept)] if kept else [])


def _block_error_lines(report: dict) -> list[str]:
    errs = report.get("block_errors")
    if not errs:
        return []
    return ["", "## Per-block output error", "",
            "Relative error ‖block′(x) − block(x)‖² / ‖block(x)‖² on calibration inputs:", "",
            "| block | rel. error |", "|---:|---:|"] + [f"| {i} | {e:.2e} |" for i, e in enumerate(errs)]


def _timing_lines(report: dict) -> list[str]:
    timings = report.get("timings")
    return ["", "Timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())] if timings else []


# report.md, section by section, in this order; each reads its part of report.json (`compress report` re-renders
# a saved report.json with the same functions)
SECTIONS = (_header_lines, _accuracy_lines, _memory_lines, _sample_lines, _streamed_lines, _offload_lines, _speed_lines,
            _dispatch_lines, _stage_lines, _block_error_lines, lambda r: _task_lines(r.get("eval", {}).get("lm_eval")),
            _speculative_lines, lambda r: _sweep_lines(_models(r)), lambda r: _roofline_lines(_models(r)),
            lambda r: _export_lines(r.get("exports") or []), _timing_lines,
            lambda r: profile_lines(r.get("profile")))


def render_markdown(report: dict) -> str:
    return "\n".join(line for section in SECTIONS for line in section(report)) + "\n"
