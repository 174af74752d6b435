"""Q4_K_M of SmolLM2-135M-Instruct: llama.cpp's own quantization (llama_model_quantize, and with an importance
matrix through ggml_quantize_chunk, the function llama-quantize calls per tensor) against our exporter (our port of
the same quantizer with the imatrix, and GPTQ onto the grid it picks), every file run in llama-cpp-python.

Calibration: CALIB windows of 512 tokens of WikiText-2 validation (seed 0), the same windows for both sides; the
imatrix is mean x^2 per input column of every linear (what llama.cpp's imatrix tool accumulates), computed with
transformers forward hooks on the float model (llama-cpp-python ships no llama-imatrix binary). Held out: the
first WINDOWS windows of 512 tokens of WikiText-2 test; KL(float || file) per token against the float model in
transformers (float32), plus the F16 file as llama.cpp's own floor. Each variant runs in its own process
(wall time and peak RSS of that process, model load included).

    python bench/gguf_kquants.py      # ~20 minutes on 2 cores (calibration ~6); bench/results/gguf_kquants.json
    python bench/gguf_kquants.py --fresh   # recompute the saved calibration statistics too
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

CALIB, SEQ, WINDOWS = 32, 512, 4
WORK = ROOT / "runs" / "gguf_kquants"
VARIANTS = {
    "llama.cpp F16 (runtime floor)": "f16",
    "llama.cpp Q4_K_M, no imatrix (llama_model_quantize)": "llama",
    "llama.cpp Q4_K_M + imatrix (ggml_quantize_chunk)": "llama_imatrix",
    "ours Q4_K_M + imatrix (gguf_kquants port)": "ours_imatrix",
    "ours Q4_K_M, GPTQ on llama.cpp's grid + imatrix": "ours_gptq",
}


def load():
    from compress.model.load import default_model_path, load_model

    loaded = load_model("default")
    return loaded.model.eval(), loaded.tokenizer, str(default_model_path())


def calibration(model, tok) -> dict:
    """The calibration statistics both sides use (computed once, by the `calib` step)."""
    from compress.calibrate.data import TextSource, calibration_windows
    from compress.export.gguf_calib import calibration_stats

    ids = calibration_windows(TextSource(), tok, model, CALIB, SEQ, 0)
    imatrix, hessians = calibration_stats(model, ids, hessians=True)
    torch.save({"imatrix": imatrix, "hessians": hessians}, WORK / "calib.pt")
    return {"tokens": int(ids.numel())}


def gguf_names(model) -> dict[str, str]:
    from compress.export.gguf import LINEARS

    return {f"model.layers.{i}.{hf}": f"blk.{i}.{gg}.weight" for i in range(model.config.num_hidden_layers)
            for hf, gg in LINEARS.items()}


def step(name: str) -> dict:
    """One variant's file, in this process; returns its timing."""
    import gguf
    import llama_cpp

    from compress.export.gguf import write_gguf

    t0 = time.time()
    model, tok, source = load() if name != "llama" else (None, None, None)  # llama_model_quantize reads f16.gguf
    t_load = time.time() - t0
    WORK.mkdir(parents=True, exist_ok=True)
    f16 = WORK / "f16.gguf"
    out = WORK / f"{name}.gguf"
    info: dict = {}
    t1 = time.time()
    if name == "f16":
        write_gguf(model, tok, f16, "f16", source_gguf=source)
    elif name == "calib":
        info = calibration(model, tok)
    elif name in ("llama", "llama_imatrix"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError("llama_model_quantize failed")
        if name == "llama_imatrix":  # same types; each quantized tensor again, with the imatrix
            from compress.export.ggml_reference import ggml_quantize

            imatrix = torch.load(WORK / "calib.pt")["imatrix"]
            src = {t.name: t for t in gguf.GGUFReader(str(f16)).tensors}
            names = gguf_names(model)
            reader = gguf.GGUFReader(str(out), "r+")
            redone = 0
            for t in reader.tensors:
                kind = t.tensor_type.name
                hf = next((h for h, g in names.items() if g == t.name), None)
                if hf is None or kind in ("F32", "F16", "Q8_0"):  # Q8_0 ignores the imatrix in llama.cpp
                    continue
                s = src[t.name]
                w = np.array(s.data, dtype=np.float32).reshape(int(s.shape[1]), int(s.shape[0]))
                t.data[...] = ggml_quantize(w, kind, imatrix[hf].numpy()).reshape(t.data.shape)
                redone += 1
            reader.data.flush()
            info["tensors_with_imatrix"] = redone
    else:
        stats = torch.load(WORK / "calib.pt")
        imatrix, hessians = stats["imatrix"], stats["hessians"] if name == "ours_gptq" else None
        report = write_gguf(model, tok, out, "q4_k_m", source_gguf=source, imatrix=imatrix,
                            hessians=hessians or None)
        info["paths"] = report["counts"]
        info["methods"] = dict(__import__("collections").Counter(t.get("method", "-") for t in
                                                                 report["tensors"].values()))
    if name != "calib":
        info["types"] = dict(__import__("collections").Counter(
            t.tensor_type.name for t in gguf.GGUFReader(str(f16 if name == "f16" else out)).tensors))
        info["file_bytes"] = (f16 if name == "f16" else out).stat().st_size
    info.update(load_s=round(t_load, 1), quantize_s=round(time.time() - t1, 1),
                peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    return info


def evaluate() -> dict:
    from compress.pipeline.report import eval_windows
    from compress.export.gguf_llama_cpp import iter_llama_cpp_logits

    model, tok, _ = load()
    ids = eval_windows(tok, "test", SEQ, WINDOWS)
    with torch.no_grad():
        ref = [torch.log_softmax(model(input_ids=ids[i:i + 1], use_cache=False).logits[0].float(), -1)
               for i in range(ids.shape[0])]
    out = {}
    for name in VARIANTS.values():
        path = WORK / f"{name}.gguf"
        kls, agree = [], []
        for i, logits in enumerate(iter_llama_cpp_logits(path, ids)):
            q = torch.log_softmax(logits, -1)
            kls.append((ref[i].exp() * (ref[i] - q)).sum(-1))
            agree.append((logits.argmax(-1) == ref[i].argmax(-1)).float())
        kl = torch.cat(kls)
        out[name] = {"kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
                     "top1_agreement": float(torch.cat(agree).mean())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", choices=list(VARIANTS.values()) + ["calib", "eval"])
    ap.add_argument("--fresh", action="store_true", help="recompute the calibration statistics too")
    args = ap.parse_args()
    if args.step:
        result = evaluate() if args.step == "eval" else step(args.step)
        print(json.dumps(result))
        return
    if args.fresh:
        shutil.rmtree(WORK, ignore_errors=True)
    results = {}
    steps = [("F16 file", "f16"), ("calibration statistics", "calib")] + list(VARIANTS.items())[1:] + \
        [("eval", "eval")]
    for label, name in steps:
        saved = WORK / f"{name}.json"
        if name == "calib" and saved.is_file() and (WORK / "calib.pt").is_file():  # reused unless --fresh
            results[name] = json.loads(saved.read_text())
            continue
        print(f"[{label}]", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--step", name], cwd=ROOT, check=True,
                              capture_output=True, text=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        saved.write_text(json.dumps(results[name]))
    rows = {}
    for label, name in VARIANTS.items():
        rows[label] = {**results[name], **results["eval"][name]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "model": "SmolLM2-135M-Instruct (compress.model.default_model: its Q4_1 GGUF, dequantized = our float model)",
              "calibration": f"{CALIB} windows x {SEQ} tokens of WikiText-2 validation, seed 0",
              "held_out": f"WikiText-2 test, first {WINDOWS} windows of {SEQ} tokens",
              "calibration_step": results["calib"], "rows": rows,
              "note": "quantize_s excludes the shared calibration step (calibration_step); peak RSS is the "
                      "variant's own process, model load included; 2 shared CPU cores"}
    out = ROOT / "bench" / "results" / "gguf_kquants.json"
    out.write_text(json.dumps(record, indent=2))
    print("| variant | KL mean | KL p99 | top-1 | file bytes | quantize s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1_agreement']:.3f} | "
              f"{r['file_bytes']:,} | {r['quantize_s']} | {r['peak_rss_mb']} |")


if __name__ == "__main__":
    main()
