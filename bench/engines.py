"""Every export served by the engine itself (issue 46): vLLM (its CPU build here, its CUDA build on a GPU) and
llama.cpp load each export of SmolLM2-135M (and of a random-weight Qwen2-MoE built from a config), and their
next-token log-probabilities, top-1 tokens and greedy continuations are compared with the run's own model (float32)
on the same WikiText-2 test windows and prompts (compress/engines/check.py).

Each run's `dense` export is the floor: the same engine, the same dtype (bfloat16), the dequantized weights. The bars
compare every quantized export of the run with it: mean |dlogp| within 10% of the dense export's, top-1 agreement
within 0.01, greedy continuations equal to the dense export's for >= 16 tokens on each of 3 prompts. Where an engine
default changes the model (vLLM CPU's int8 activations for int4 layers), both are shown.

    python bench/engines.py --python ~/vllm/bin/python           # about 30 minutes on 2 cores
    python bench/engines.py --python ~/vllm/bin/python --select "int4 g64 sym;W8A8 SmoothQuant" --reuse
Writes bench/results/engines.json (rows as they complete) and docs/engines.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RTN = {"stage": "quantize", "method": "rtn", "ignore": ["lm_head"]}
G64 = {"dtype": "int4", "granularity": "group", "group_size": 64}
VLLM_FORMATS = ("dense", "compressed-tensors", "awq", "gptq", "fp8", "modelopt-nvfp4")
MIX_MENU = ["W8A16", {**G64, "dtype": "int6", "symmetric": False}, {**G64, "dtype": "int5", "symmetric": False},
            {**G64, "symmetric": False}, {**G64, "dtype": "int3", "symmetric": False}]
MIX = {"stage": "auto_precision", "menu": MIX_MENU, "bytes_of": {**G64, "symmetric": False}, "n_samples": 4}
MIX_INT4 = {**MIX, "menu": [{**G64, "group_size": g, "symmetric": False} for g in (32, 64, 128)], "keep_float": True}
RUNS = {  # name: (model, stages, formats, evaluate: KL against the original on the protocol's windows)
    "int4 g64 asym": ("default", [{**RTN, "scheme": {**G64, "symmetric": False}}],
                      ["dense", "compressed-tensors", "awq", "gptq"], False),
    "int4 g64 sym": ("default", [{**RTN, "scheme": G64}], ["dense", "compressed-tensors", "awq", "gptq"], False),
    "int4 g32 sym": ("default", [{**RTN, "scheme": {**G64, "group_size": 32}}],
                     ["dense", "compressed-tensors", "gguf-f16", "gguf-q4_0"], False),
    "int8 channel (W8A16)": ("default", [{**RTN, "scheme": "W8A16"}], ["dense", "compressed-tensors", "gptq"], False),
    "int8 channel asym": ("default", [{**RTN, "scheme": "W8A16_ASYM"}], ["dense", "compressed-tensors"], False),
    "int3 g64 asym": ("default", [{**RTN, "scheme": {**G64, "dtype": "int3", "symmetric": False}}],
                      ["dense", "compressed-tensors"], False),
    "int6 g64 asym": ("default", [{**RTN, "scheme": {**G64, "dtype": "int6", "symmetric": False}}],
                      ["dense", "compressed-tensors"], False),
    "W8A8 SmoothQuant": ("default", [{"stage": "smoothquant", "alpha": 0.5}, {**RTN, "scheme": "W8A8"}],
                         ["dense", "compressed-tensors"], False),
    "fp8 static + fp8 KV": ("default", [{**RTN, "scheme": "FP8"}, {"stage": "kv_cache", "dtype": "fp8_e4m3"}],
                            ["dense", "compressed-tensors", "fp8"], False),
    "fp8 dynamic": ("default", [{**RTN, "scheme": "FP8_DYNAMIC"}], ["dense", "compressed-tensors"], False),
    "NVFP4A16": ("default", [{**RTN, "scheme": "NVFP4A16"}], ["dense", "compressed-tensors", "modelopt-nvfp4"], False),
    "NVFP4 W4A4": ("default", [{**RTN, "scheme": "NVFP4"}], ["dense", "compressed-tensors"], False),
    "MXFP4A16": ("default", [{**RTN, "scheme": "MXFP4A16"}], ["dense", "compressed-tensors"], False),
    "mix at int4 g64 bytes": ("default", [MIX, {**RTN, "scheme": {**G64, "symmetric": False}}],
                              ["dense", "compressed-tensors"], True),
    "mix, every layer alone": ("default", [{**MIX, "fused_groups": False},
                                           {**RTN, "scheme": {**G64, "symmetric": False}}],
                               ["dense", "compressed-tensors"], True),
    # vLLM's CPU build serves 4-bit weight-only layers only: a mix it can load chooses among int4 group sizes and bf16
    "mix of int4 g32/g64/g128 + bf16": ("default", [MIX_INT4, {**RTN, "scheme": {**G64, "symmetric": False}}],
                                        ["dense", "compressed-tensors"], True),
    "mix of int4 g32/g64/g128 + bf16, every layer alone": (
        "default", [{**MIX_INT4, "fused_groups": False}, {**RTN, "scheme": {**G64, "symmetric": False}}],
        ["dense", "compressed-tensors"], True),
    "Qwen2-MoE (random) int4 g64 sym": ("moe", [{**RTN, "scheme": G64}], ["dense", "compressed-tensors"], False),
}
WINDOWS, SEQ_LEN, NEW_TOKENS = 2, 512, 32
RUNS_DIR = ROOT / "runs" / "engines"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def make_moe(folder: Path) -> Path:
    """A random-weight Qwen2-MoE (2 blocks, 4 experts, a shared expert) with SmolLM2's tokenizer, dims multiples of
    32 as vLLM's CPU int4 kernel needs."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers
    from compress.model.load import load_model

    tokenizer = load_model("default").tokenizer
    config = transformers.Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=2048,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def compress_run(name: str, model: str, stages: list, evaluate: bool, reuse: bool) -> Path:
    out = RUNS_DIR / slug(name)
    if reuse and (out / "compress.json").is_file():
        return out
    calibration = {"preset": "wikitext2", "n_samples": 16, "seq_len": 512}
    source = "default" if model == "default" else str(make_moe(RUNS_DIR / "qwen2_moe_random"))
    recipe = {"model": source, "calibration": calibration, "stages": stages,
              "eval": {"perplexity": evaluate, "speed": False, "baseline": evaluate, "seq_len": 2048,
                       "max_windows": 8},
              "output": {"dir": str(out), "overwrite": True, "save_dtype": "float32"}}
    path = RUNS_DIR / f"{slug(name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-m", "compress", "run", str(path), "--no-progress"], check=True, env=env,
                   cwd=ROOT)
    return out


def export(run_dir: Path, fmt: str) -> tuple[Path, str | None]:
    out = run_dir / "exports" / fmt
    proc = subprocess.run([sys.executable, "-m", "compress", "export", str(run_dir), "--format", fmt, "--overwrite"],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:  # "compress export: error: cannot export to F:" then one problem a line
        lines = [line.strip() for line in proc.stderr.strip().splitlines()]
        start = next((i for i, line in enumerate(lines) if "error:" in line), len(lines) - 1)
        return out, " ".join(lines[start:start + 2]) or "export failed"
    return out, None


def bars(row: dict, floor: dict | None) -> dict:
    """The issue's bars for one quantized export against its run's dense export on the same engine."""
    if floor is None or not row.get("loads") or not floor.get("loads") or row["format"] == floor["format"]:
        return {}
    best = row.get("plain") if row.get("plain", {}).get("loads") else row
    return {"dlogp_ratio": best["mean_abs_dlogp"] / floor["mean_abs_dlogp"],
            "top1_delta": best["top1_agreement"] - floor["top1_agreement"],
            "greedy_equal_to_dense": [sum(1 for _ in _prefix(a, b)) for a, b in zip(best["greedy"], floor["greedy"])]}


def tie_gaps(rows: list[dict], new_tokens: int) -> None:
    """Where a quantized export's greedy tokens leave its run's dense export's (same engine), how close the two tokens
    are in our float32 model at that step (|log p| difference, given the common prefix): a near tie is one bf16
    rounding can flip. Adds `greedy_gaps` (nats, None where no divergence)."""
    import torch
    from compress.engines.check import prompt_ids
    from compress.model.load import load_model

    for name in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == name and (r.get("bars") or {}).get("greedy_equal_to_dense")]
        if not mine:
            continue
        floors = {r["engine"]: r for r in rows if r["run"] == name and r["format"] in ("dense", "gguf-f16")}
        loaded = load_model(str(RUNS_DIR / slug(name)))
        prompts = prompt_ids(loaded.tokenizer)
        for r in mine:
            dense = floors[r["engine"]]
            best = r["plain"] if r.get("plain", {}).get("loads") else r
            gaps = []
            for p, n, a, b in zip(prompts, r["bars"]["greedy_equal_to_dense"], dense["greedy"], best["greedy"]):
                if n >= min(len(a), len(b), new_tokens):
                    gaps.append(None)
                    continue
                with torch.no_grad():
                    logits = loaded.model.forward(input_ids=torch.tensor([p + a[:n]])).logits[0, -1].float()
                logp = torch.log_softmax(logits, -1)
                gaps.append(abs(float(logp[a[n]] - logp[b[n]])))
            r["bars"]["greedy_gaps"] = gaps


def _prefix(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def bench_run(name: str, args) -> list[dict]:
    from compress.engines.check import engine_check, greedy, prompt_ids, reference
    from compress.pipeline.report import eval_windows
    from compress.export.verify import float_activations
    from compress.model.load import load_model

    model_name, stages, formats, evaluate = RUNS[name]
    run_dir = compress_run(name, model_name, stages, evaluate, args.reuse)
    loaded = load_model(str(run_dir))
    windows = eval_windows(loaded.tokenizer, "test", args.seq_len, args.windows)
    prompts = prompt_ids(loaded.tokenizer)
    figures = (*reference(loaded.model, windows), greedy(loaded.model, prompts, args.new_tokens))
    also, probe = None, {}
    with float_activations(loaded.model) as floated:
        if floated:  # W8A8 / fp8 activations: how far each side's own activation rounding moves the model
            also = {"ours, float activations": reference(loaded.model, windows)}
            probe = {"ours_vs_ours_float_activations": float((also["ours, float activations"][0] - figures[0])
                                                             .abs().double().mean())}
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
    kl = (((report.get("eval") or {}).get("models") or {}).get("compressed") or {}).get("kl")
    rows, floors = [], {}
    for fmt in formats:
        engine = "llama.cpp" if fmt.startswith("gguf-") else "vllm"
        folder, why = export(run_dir, fmt)
        if why is not None:
            row = {"engine": engine, "format": fmt, "exported": False, "loads": False, "error": why}
        else:
            row = engine_check(folder, loaded.model, windows, prompts, engine, args.new_tokens,
                               python=args.python if engine == "vllm" else None, reference_figures=figures,
                               also=also, timeout=args.timeout)
        row = {"run": name, "kl_vs_original": kl, **probe, **row}
        if fmt in ("dense", "gguf-f16"):
            floors[engine] = row
        row["bars"] = bars(row, floors.get(engine))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("greedy",)})[:600], flush=True)
    return rows


def _fig(r: dict) -> str:
    return f"{r['mean_abs_dlogp']:.4f} / {r['top1_agreement']:.3f}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | export | engine: loads? method, kernel | mean abs dlogp / top-1 (engine defaults) | "
             "... W4A8 off | vs dense: dlogp ratio, top-1 delta, greedy tokens = dense's (where they part: our model's "
             "log p gap between the two tokens) | tokens/s |",
             "|---|---|---|---|---|---|---:|"]
    for r in rows:
        if not r["loads"]:
            why = r["error"].splitlines()[0][:240].replace("|", "/")
            lines.append(f"| {r['run']} | {r['format']} | **no**: {why} | – | – | – | – |")
            continue
        kernels = "; ".join(sorted({k.split(" for ")[0] for k in r.get("kernels") or []})) or "–"
        plain = r.get("plain")
        b = r.get("bars") or {}
        gaps = [f"{n} (gap {g:.3f})" if g is not None else str(n)
                for n, g in zip(b.get("greedy_equal_to_dense", []), b.get("greedy_gaps") or [None] * 3)]
        vs = "floor" if not b else f"{b['dlogp_ratio']:.2f}x, {b['top1_delta']:+.3f}, {' / '.join(gaps)}"
        lines.append(f"| {r['run']} | {r['format']} | {r['engine']}: {r.get('method') or 'float'}, {kernels} | "
                     f"{_fig(r)} | {_fig(plain) if plain and plain['loads'] else '–'} | {vs} | "
                     f"{r['tokens_per_s']:.1f} |")
    probes = [r for r in rows if r.get("vs")]
    if probes:
        lines += ["", "Runs that quantize activations, against our model with float activations (the same weights): "
                  "how far each side's activation rounding moves it."]
    for r in probes:
        vs = r["vs"]["ours, float activations"]
        lines.append(f"- {r['run']}, {r['format']}: the engine {vs['mean_abs_dlogp']:.4f} / {vs['top1_agreement']:.3f} "
                     f"from it; our own quantized activations {r['ours_vs_ours_float_activations']:.4f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", help="vLLM's interpreter (its own virtual environment); default COMPRESS_VLLM_PYTHON")
    p.add_argument("--select", help="run names separated by semicolons (default: all)")
    p.add_argument("--reuse", action="store_true", help="reuse runs/engines/* that already exist")
    p.add_argument("--windows", type=int, default=WINDOWS)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--timeout", type=float, default=900, help="seconds an engine may take per export (default 900)")
    p.add_argument("--tabulate", action="store_true",
                   help="only tabulate the results file (adding the greedy tie gaps), running no engine")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "engines.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "engines.md"))
    args = p.parse_args(argv)
    names = list(RUNS) if not args.select else [n.strip() for n in args.select.split(";")]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    out = Path(args.out)
    if args.tabulate:
        data = json.loads(out.read_text())
        tie_gaps(data["rows"], data["meta"]["new_tokens"])
        out.write_text(json.dumps(data, indent=1, default=str))
        lines = table(data["rows"])
        print("\n".join(lines))
        write_docs(Path(args.docs), data["meta"], lines)
        return 0
    # a --select run replaces its runs' rows in the results file and keeps the others
    kept = [r for r in (json.loads(out.read_text())["rows"] if out.is_file() and args.select else [])
            if r["run"] not in names and r["run"] in RUNS]
    rows = []
    for name in names:
        rows += bench_run(name, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": kept + rows}, indent=1, default=str))
    order = list(RUNS)
    rows = sorted(kept + rows, key=lambda r: order.index(r["run"]))  # stable: formats keep their order
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    meta = {"date": datetime.date.today().isoformat(), "commit": commit, "windows": args.windows,
            "seq_len": args.seq_len, "new_tokens": args.new_tokens,
            "versions": sorted({f"{r['engine']} {r['version']}" for r in rows if r.get("version")}),
            "command": "python bench/engines.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    tie_gaps(rows, args.new_tokens)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    lines = table(rows)
    print("\n".join(lines))
    write_docs(Path(args.docs), meta, lines)
    return 0


START, END = "<!-- engines table: written by bench/engines.py -->", "<!-- end of engines table -->"


def write_docs(path: Path, meta: dict, lines: list[str]) -> None:
    """Replace the table between the markers of `path` (the prose around it is written by hand)."""
    block = [START, "", f"{meta['date']}, commit {meta['commit']}, {', '.join(meta['versions'])}; "
             f"`{meta['command']}`; {meta['windows']} WikiText-2 test windows of {meta['seq_len']} tokens, "
             f"{meta['new_tokens']} greedy tokens on each of 3 prompts; this machine's CPU, one OpenMP thread.", "",
             *lines, "", END]
    text = path.read_text() if path.is_file() else f"# Engines\n\n{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    path.write_text(head + "\n".join(block) + tail)


if __name__ == "__main__":
    sys.exit(main())
