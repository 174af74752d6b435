"""Large models on this machine: `compress run` on 7B and 13B Llama shapes streamed from disk, peak memory measured.

Builds Llama-2-shaped models with random weights from configs (bfloat16 safetensors in 5 GB shards, written one
tensor at a time so building needs no more memory than one tensor; SmolLM2's tokenizer and vocabulary; nothing is
committed), then runs `compress run` on each in a fresh process with a small calibration and evaluation, sampling
the process's resident memory from /proc every 50 ms (VmRSS, and RssAnon: what must fit, the kernel cannot drop it)
and reading the report's peak RSS (getrusage). Results go to bench/results/large_models.json.

    python bench/large_models.py [--sizes 7b,13b] [--runs rtn,gptq] [--models-dir DIR] [--keep]
    python bench/large_models.py --embedded    # streamed vs in-memory wall time on the embedded model
    python bench/large_models.py --sizes 13b --runs rtn-dense --reload   # + plain-transformers reload of the export
    python bench/large_models.py --sizes 13b --runs none --offload-eval 8   # `compress eval --offload 8` of the model
    python bench/large_models.py --sizes 7b --runs auto-rtn    # mixed precision, its sensitivity pass streamed
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SIZES = {  # Llama-2 shapes (hidden, MLP, blocks, heads, KV heads); SmolLM2's vocabulary (49152)
    "7b": (4096, 11008, 32, 32, 32),
    "13b": (5120, 13824, 40, 40, 40),
}
RUNS = {  # name -> (recipe, overrides); every run: 2 × 256-token evaluation windows, no speed (a streamed run skips it)
    "rtn": ("recipes/int4_rtn.yaml", ["calibration.n_samples=4", "calibration.seq_len=256"]),
    "gptq": ("recipes/gptq_int4.yaml", ["calibration.n_samples=8", "calibration.seq_len=256"]),
    # the same RTN run, also exporting a dense (dequantized bf16) checkpoint block by block; --reload then loads that
    # export with plain transformers (accelerate disk offload) and scores the run's evaluation windows with it
    # mixed precision: auto_precision's menu and budget (int8 / int4 g128 / int4 g64 / int3 g64 at int4 g64's bytes:
    # the default menu when measured, before int5 / int6), its fisher pass block by block from disk on 2 windows,
    # then round-to-nearest (AWQ and GPTQ: too slow here)
    "auto-rtn": ("recipes/auto_precision_4bit.yaml", [
        "stages=[{stage: auto_precision, bytes_of: W4A16_ASYM_G64, n_samples: 2, menu: [W8A16, {dtype: int4, "
        "group_size: 128, symmetric: false}, W4A16_ASYM_G64, {dtype: int3, group_size: 64, symmetric: false}]}, "
        "{stage: quantize, method: rtn, "
        "scheme: W4A16_ASYM_G64, ignore: [lm_head]}]", "calibration.n_samples=4", "calibration.seq_len=256"]),
    "rtn-dense": ("recipes/int4_rtn.yaml", ["calibration.n_samples=4", "calibration.seq_len=256",
                                            "output.formats=[dense]", "output.verify_windows=0"]),
}
COMMON = ["eval.max_windows=2", "eval.seq_len=256", "eval.speed=false", "output.overwrite=true"]  # threads: default


def llama_config(shape: tuple, max_positions: int = 4096):
    """(LlamaConfig of `shape` = (hidden, MLP, blocks, heads, KV heads) with SmolLM2's vocabulary, its tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig

    from compress.model.default_model import default_model_path

    hidden, inter, layers, heads, kv = shape
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=len(tokenizer),
                         max_position_embeddings=max_positions, tie_word_embeddings=False, dtype="bfloat16")
    return config, tokenizer


def build(name: str, folder: Path) -> int:
    """A random-weight Llama of shape `name` in `folder`, written tensor by tensor. Returns its parameter count."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from compress.export.shards import ShardWriter

    config, tokenizer = llama_config(SIZES[name])
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardWriter(tmp)
    gen = torch.Generator().manual_seed(0)
    total = 0
    for key, p in skeleton.state_dict().items():
        if "norm" in key:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
        writer.add(key, t)
        total += t.numel()
        del t
    writer.finish()
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)
    return total


def watch(proc: subprocess.Popen, every: float = 0.05) -> dict:
    """Peak VmRSS and RssAnon of a running process, sampled from /proc until it exits."""
    peak = {"VmRSS": 0, "RssAnon": 0}
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                key = line.split(":")[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(every)
    proc.wait()
    return peak


def run_watched(cmd: list[str], log: Path) -> dict:
    """`cmd` run in the repository, its output in `log`, its resident memory sampled: the row's command (from
    `compress` on), exit status, wall time and peaks."""
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        peak = watch(proc)
    return {"command": "compress " + " ".join(cmd[3:]), "exit": proc.returncode,
            "wall_s": round(time.perf_counter() - t, 1), "peak_vmrss_sampled": peak["VmRSS"],
            "peak_anonymous_sampled": peak["RssAnon"]}


def run_one(model: Path, recipe: str, overrides: list[str], out: Path, log: Path, common: bool = True) -> dict:
    cmd = [sys.executable, "-m", "compress", "run", recipe, "--no-progress", "--output", str(out),
           "--set", f"model={model}"] + [a for o in overrides + (COMMON if common else []) for a in ("--set", o)]
    row = run_watched(cmd, log)
    if row["exit"] != 0:
        row["log_tail"] = log.read_text()[-2000:]
        return row
    report = json.loads((out / "report.json").read_text())
    models = report["eval"]["models"]
    row.update({
        "peak_rss_report": report["eval"]["peak_rss_bytes"],
        "memory_plan_peak": report.get("memory_plan", {}).get("peak_bytes"),
        "memory_plan_dtype": report.get("memory_plan", {}).get("dtype"),
        "streamed": report.get("streamed"), "timings": report["timings"], "profile": report.get("profile"),
        "ppl": {n: m.get("ppl") for n, m in models.items()}, "kl": models["compressed"].get("kl"),
        "top1": models["compressed"].get("top1_agreement"),
        "checkpoint_bytes": report["memory"]["checkpoint_bytes"],
        "files": sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".json")),
    })
    return row


RELOAD = """
import json, sys, time, tempfile, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from compress.calibrate.data import eval_windows
folder, cap, n, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto",
                                             max_memory={"cpu": cap}, offload_folder=tempfile.mkdtemp(dir=folder))
load = time.perf_counter() - t
windows = eval_windows(AutoTokenizer.from_pretrained(folder), "test", seq, n)
nll, count = 0.0, 0
with torch.no_grad():
    for w in windows:
        logits = model(w[None]).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
        count += w.numel() - 1
placed = {}
for v in model.hf_device_map.values():
    placed[str(v)] = placed.get(str(v), 0) + 1
print(json.dumps({"ppl": float(torch.exp(torch.tensor(nll / count))), "tokens": count, "load_s": round(load, 1),
                  "score_s": round(time.perf_counter() - t - load, 1), "device_map_modules": placed}))
"""


def reload_dense(folder: Path, log: Path, cap: str = "8GiB", windows: int = 2, seq_len: int = 256) -> dict:
    """Load a dense export with plain transformers (bfloat16; accelerate's device_map with `cap` of CPU memory, the
    rest offloaded to disk) and score WikiText-2 test windows with it in a fresh process, peak memory sampled."""
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", RELOAD, str(folder), cap, str(windows), str(seq_len)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True,
                                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        peak = watch(proc)
    row = {"command": f"python -c RELOAD {folder} {cap} {windows} {seq_len} (bench/large_models.py)",
           "exit": proc.returncode, "wall_s": round(time.perf_counter() - t, 1), "peak_vmrss_sampled": peak["VmRSS"],
           "peak_anonymous_sampled": peak["RssAnon"], "max_memory_cpu": cap}
    out = proc.stdout.read().strip().splitlines()
    if proc.returncode == 0 and out:
        row.update(json.loads(out[-1]))
    else:
        row["log_tail"] = log.read_text()[-2000:]
    return row


def offload_eval(folder: Path, out: Path, log: Path, gigabytes: float) -> dict:
    """`compress eval MODEL --offload GB` in a fresh process, memory sampled: one 128-token window and the short
    speed run of a disk-offloaded model (every forward reads the offloaded weights again)."""
    cmd = [sys.executable, "-m", "compress", "eval", str(folder), "--offload", f"{gigabytes:g}", "--max-windows", "1",
           "--seq-len", "128", "--threads", "2", "--no-progress", "--output", str(out)]
    row = run_watched(cmd, log)
    if row["exit"] != 0:
        return {**row, "log_tail": log.read_text()[-2000:]}
    model = json.loads((out / "report.json").read_text())["eval"]["models"]["model"]
    return {**row, "ppl": model.get("ppl"), "speed": model.get("speed"), "offloaded": model.get("offloaded")}


def embedded(base: Path, commit: str) -> dict:
    """The streamed path's cost on the embedded model: the same int4 RTN run in memory and streamed, one after the
    other in fresh processes (nothing else running), wall time and report figures side by side."""
    out = {"commit": commit, "date": datetime.date.today().isoformat(), "runs": {}}
    overrides = ["calibration.n_samples=8", "calibration.seq_len=512", "eval.max_windows=2", "eval.seq_len=2048",
                 "eval.speed=false", "calibration.threads=1", "eval.threads=1", "output.overwrite=true"]
    for mode in ("never", "always", "never", "always"):  # twice each, interleaved: the median of two
        row = run_one(Path("default"), "recipes/int4_rtn.yaml", overrides + [f"model.stream={mode}"],
                      base / f"out-embedded-{mode}", base / f"log-embedded-{mode}.txt", common=False)
        out["runs"].setdefault(mode, []).append({k: row.get(k) for k in ("wall_s", "ppl", "kl", "top1", "timings",
                                                                         "peak_rss_report", "exit")})
        print(mode, row["wall_s"], row.get("ppl"), flush=True)
    walls = {m: sorted(r["wall_s"] for r in rows) for m, rows in out["runs"].items()}
    out["streamed_over_in_memory_wall"] = (sum(walls["always"]) / 2) / (sum(walls["never"]) / 2)
    out["same_figures"] = all(a["ppl"] == b["ppl"] and a["kl"] == b["kl"] and a["top1"] == b["top1"]
                              for a, b in zip(out["runs"]["never"], out["runs"]["always"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedded", action="store_true",
                        help="only compare the streamed and in-memory runs on the embedded model (wall time)")
    parser.add_argument("--sizes", default="7b,13b")
    parser.add_argument("--runs", default="rtn,gptq")
    parser.add_argument("--models-dir", default="/tmp/compress-large")
    parser.add_argument("--keep", action="store_true", help="keep the built models and outputs")
    parser.add_argument("--offload-eval", type=float, metavar="GB",
                        help="also `compress eval` each built model with --offload GB: perplexity on one window and "
                             "the disk-offloaded speed run (row offload-eval)")
    parser.add_argument("--reload", action="store_true",
                        help="after a run with a dense export (rtn-dense), delete the source model and load the export "
                             "with plain transformers (disk offload), scoring the run's evaluation windows")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    base = Path(args.models_dir)
    base.mkdir(parents=True, exist_ok=True)
    results_path = ROOT / "bench" / "results" / "large_models.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"rows": []}
    if args.embedded:
        results["embedded"] = embedded(base, commit)
        print(json.dumps({k: v for k, v in results["embedded"].items() if k != "runs"}))
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        return
    for size in args.sizes.split(","):
        folder = base / f"llama-{size}"
        if not (folder / "config.json").exists():
            t = time.perf_counter()
            n = build(size, folder)
            print(f"built {folder}: {n / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s", flush=True)
        checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        machine = f"{os.cpu_count()} CPU cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 1e9:.0f} GB"
        if args.offload_eval:
            row = {**offload_eval(folder, base / f"eval-{size}", base / f"log-{size}-offload-eval.txt",
                                  args.offload_eval),
                   "model": f"Llama-2-{size} shape, random bf16", "checkpoint_bytes_in": checkpoint,
                   "run": "offload-eval", "commit": commit, "date": datetime.date.today().isoformat(),
                   "machine": machine}
            print(json.dumps(row), flush=True)
            results["rows"] = [r for r in results["rows"] if (r["model"], r["run"]) != (row["model"], row["run"])]
            results["rows"].append(row)
            results_path.write_text(json.dumps(results, indent=2) + "\n")
        for name in [r for r in args.runs.split(",") if r != "none"]:
            recipe, overrides = RUNS[name]
            out = base / f"out-{size}-{name}"
            row = run_one(folder, recipe, overrides, out, base / f"log-{size}-{name}.txt")
            row.update({"model": f"Llama-2-{size} shape, random bf16", "checkpoint_bytes_in": checkpoint,
                        "run": name, "commit": commit, "date": datetime.date.today().isoformat(),
                        "machine": machine})
            if args.reload and row["exit"] == 0 and (out / "exports" / "dense").is_dir():
                if not args.keep:  # room on disk for the offload
                    shutil.rmtree(folder, ignore_errors=True)
                dense = out / "exports" / "dense"
                files = sorted(p.name for p in dense.iterdir())
                size_bytes = sum(p.stat().st_size for p in dense.glob("*.safetensors"))
                row["reload_dense"] = {**reload_dense(dense, base / f"log-{size}-{name}-reload.txt"),
                                       "export_files": files, "export_bytes": size_bytes}
            print(json.dumps({k: v for k, v in row.items() if k not in ("streamed", "timings", "profile")}), flush=True)
            results["rows"] = [r for r in results["rows"] if (r["model"], r["run"]) != (row["model"], name)] + [row]
            results_path.write_text(json.dumps(results, indent=2) + "\n")
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
