"""int8 / int4 KV cache (KIVI: keys per channel over 32-token chunks, values per token over 32 channels, a float
residual window) on the embedded model at 2048 tokens of context: WikiText-2 test perplexity and KL to the float
cache on the README's windows, bytes per cached token, and the roofline's largest batch before and after.

Every window is one forward of 2048 tokens whose attention reads the cache as a KIVI engine would hold it when
each query is decoded (compress/kv/kivi.py: exact, tested against token-by-token decoding), so the perplexity is
that of generating over the quantized cache. Weights stay float32: the cost measured is the cache's alone.

    python bench/kv_cache_table.py [--max-windows 8] [--out bench/results/kv_cache_table.json]
    python bench/kv_cache_table.py --scaled --out bench/results/kv_cache_scaled.json   # fp8 and NVFP4 caches

--scaled: the caches with one calibrated tensor scale per layer for keys and one for values (max |k| and max |v|
over 16 x 512 tokens of WikiText-2 validation): fp8 e4m3 (what vLLM serves with k_scale / v_scale) and NVFP4
(e2m1 in blocks of 16 channels with e4m3 block scales under that tensor scale; compress/kv/cache.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `compress` from a checkout, installed or not

from compress.calibrate.data import sequential_windows, tokenize_joined, wikitext2_rows  # noqa: E402
from compress.measure.memory import serving_bytes  # noqa: E402
from compress.measure.ppl import _final_hidden, _logits, score_hidden  # noqa: E402
from compress.serving.roofline import get_accelerator, max_batch, model_facts  # noqa: E402
from compress.kv.cache import attach_kv_quant, use_kv_attention  # noqa: E402
from compress.kv.kivi import KVQuant  # noqa: E402
from compress.model.load import load_model  # noqa: E402

CONFIGS = {"float (bf16 cache)": None,
           "int8 KIVI g32, residual 128": KVQuant(8, 32, 128),
           "int8 per-token/channel, no residual": KVQuant(8, 32, 0),
           "int4 KIVI g32, residual 128": KVQuant(4, 32, 128),
           "int4 g32, no residual": KVQuant(4, 32, 0)}
SEQ_LEN = 2048
ACCELERATORS = ("H100-SXM", "B200", "RTX-4090")


def effective_bytes(kv: KVQuant | None, context: int) -> float:
    """Bytes per cached element averaged over a sequence of `context` tokens: the quantized ones with their scales,
    and the float residual (at most residual + group - 1 tokens at 2 bytes)."""
    if kv is None:
        return 2.0
    window = min(context, kv.residual + kv.group - 1) if kv.residual else 0
    return ((context - window) * kv.bytes_per_element() + window * 2.0) / context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/kv_cache_table.json"))
    ap.add_argument("--scaled", action="store_true", help="instead: float / fp8 e4m3 / NVFP4 caches with calibrated "
                    "per-layer tensor scales")
    ap.add_argument("--lm-eval-docs", type=int, default=0,
                    help="instead: lm-eval's `wikitext` task (document-level rolling perplexity over whole articles, "
                         "2048-token windows) on the first N test documents, float / int8 / int4 KIVI")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("default", "float32", "cpu")
    model = loaded.model.eval()
    use_kv_attention(model)
    if args.lm_eval_docs:
        return lm_eval_wikitext(loaded, args)
    windows = sequential_windows(tokenize_joined(wikitext2_rows("test"), loaded.tokenizer), SEQ_LEN, args.max_windows)
    if args.scaled:
        return scaled_caches(loaded, windows, args)

    def final(kv):
        def run(k, ids):
            for m in model.modules():
                if hasattr(m, "kv_quant"):
                    del m.kv_quant
            if kv is not None:
                attach_kv_quant(model, kv)
            return _final_hidden(model, ids)[0, :-1]
        return run

    t0 = time.perf_counter()
    scores = score_hidden({n: final(kv) for n, kv in CONFIGS.items()}, {n: lambda h: _logits(model, h) for n in CONFIGS},
                          windows, baseline="float (bf16 cache)")
    seconds = time.perf_counter() - t0
    facts = model_facts(model.config, serving_bytes(model))
    per_token_elements = facts.kv_bytes_per_token(1)  # elements per token (K and V, all layers)
    base_ppl = scores["float (bf16 cache)"].ppl
    rows = {}
    print(f"WikiText-2 test, {len(windows)} windows of {SEQ_LEN} ({scores['float (bf16 cache)'].tokens} predicted "
          f"tokens), {seconds:.0f} s\n")
    print("| KV cache | ppl | Δ ppl | KL | top-1 | bytes / element | KV bytes / token at 2048 | "
          + " | ".join(f"max batch {a} @2048" for a in ACCELERATORS) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(ACCELERATORS))
    for name, kv in CONFIGS.items():
        s = scores[name]
        b = effective_bytes(kv, SEQ_LEN)
        batches = {a: max_batch(facts, get_accelerator(a), SEQ_LEN, b) for a in ACCELERATORS}
        rows[name] = {"format": kv.name if kv else "bf16", "ppl": s.ppl, "delta_ppl": s.ppl / base_ppl - 1,
                      "kl": s.kl, "top1": s.top1_agreement, "tokens": s.tokens,
                      "bytes_per_element": kv.bytes_per_element() if kv else 2.0, "effective_bytes_at_2048": b,
                      "kv_bytes_per_token": per_token_elements * b, "max_batch_2048": batches}
        print(f"| {name} | {s.ppl:.3f} | {s.ppl / base_ppl - 1:+.2%} | {s.kl or 0:.4f} | {s.top1_agreement or 1:.2%} "
              f"| {rows[name]['bytes_per_element']:.3f} | {per_token_elements * b / 1e3:.1f} kB | "
              + " | ".join(f"{batches[a]:,}" for a in ACCELERATORS) + " |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit, "seq_len": SEQ_LEN,
                               "windows": len(windows), "seconds": seconds, "threads": 1,
                               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                               "weights_bytes_bf16": facts.weight_bytes, "rows": rows}, indent=1))
    print(f"\nwrote {out}")


SCALED = {"float (bf16 cache)": None, "fp8 e4m3, calibrated per layer": "fp8_e4m3",
          "NVFP4 (e2m1, e4m3 scales per 16, calibrated tensor scale)": "nvfp4"}


def scaled_caches(loaded, windows, args) -> None:
    import copy

    from compress.kv.cache import KV_BYTES, attention_modules, recording_kv, set_kv_scales

    base = loaded.model
    calib = sequential_windows(tokenize_joined(wikitext2_rows("validation"), loaded.tokenizer), 512, 16)
    records: dict = {}
    with recording_kv(base, records), torch.no_grad():
        for w in calib:
            base(w[None])
    models = {}
    for name, dtype in SCALED.items():
        m = base if dtype is None else copy.deepcopy(base)
        if dtype is not None:
            for attn in attention_modules(m):
                set_kv_scales(m.get_submodule(attn), *records[attn], dtype)
        models[name] = m

    def final(m):
        return lambda k, ids: _final_hidden(m, ids)[0, :-1]

    t0 = time.perf_counter()
    scores = score_hidden({n: final(m) for n, m in models.items()},
                          {n: (lambda h, m=m: _logits(m, h)) for n, m in models.items()}, windows,
                          baseline="float (bf16 cache)")
    seconds = time.perf_counter() - t0
    facts = model_facts(base.config, serving_bytes(base))
    per_token = facts.kv_bytes_per_token(1)
    base_ppl = scores["float (bf16 cache)"].ppl
    rows = {}
    print("| KV cache | ppl | Δ ppl | KL | top-1 | bytes / element | " +
          " | ".join(f"max batch {a} @2048" for a in ACCELERATORS) + " |")
    for name, dtype in SCALED.items():
        s, b = scores[name], (2.0 if dtype is None else KV_BYTES[dtype])
        batches = {a: max_batch(facts, get_accelerator(a), SEQ_LEN, b) for a in ACCELERATORS}
        rows[name] = {"dtype": dtype or "bf16", "ppl": s.ppl, "delta_ppl": s.ppl / base_ppl - 1, "kl": s.kl,
                      "top1": s.top1_agreement, "tokens": s.tokens, "bytes_per_element": b,
                      "kv_bytes_per_token": per_token * b, "max_batch_2048": batches}
        print(f"| {name} | {s.ppl:.3f} | {s.ppl / base_ppl - 1:+.2%} | {s.kl or 0:.4f} | {s.top1_agreement or 1:.2%} "
              f"| {b:.4f} | " + " | ".join(f"{batches[a]:,}" for a in ACCELERATORS) + " |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    Path(args.out).write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit,
                                          "seq_len": SEQ_LEN, "windows": len(windows), "seconds": seconds,
                                          "threads": 1, "calibration": "16 x 512 WikiText-2 validation",
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")


def lm_eval_wikitext(loaded, args) -> None:
    """The offline lm-eval `wikitext` task (whole Wikipedia articles, scored in rolling windows of 2048 tokens: the
    long-context task the shared data allows) for the float cache and the two KIVI caches."""
    import copy

    from compress.measure.harness import evaluate_tasks

    configs = {"float": None, "int8 KIVI g32 r128": KVQuant(8, 32, 128), "int4 KIVI g32 r128": KVQuant(4, 32, 128)}
    models = {}
    for name, kv in configs.items():
        models[name] = copy.deepcopy(loaded.model) if kv else loaded.model
        if kv:
            attach_kv_quant(models[name], kv)
    t0 = time.perf_counter()
    result = evaluate_tasks(models, loaded.tokenizer, ("wikitext",), limit=args.lm_eval_docs, batch_size=1,
                            baseline="float", max_length=SEQ_LEN)
    result["seconds"] = time.perf_counter() - t0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result |= {"date": datetime.date.today().isoformat(), "commit": commit, "max_length": SEQ_LEN}
    for name, by_task in result["scores"].items():
        print(name, {k: round(v["value"], 4) for k, v in by_task["wikitext"].items()})
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
