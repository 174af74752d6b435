"""`compress run | eval | inspect`: argument parsing only; the work lives in pipeline/evaluate."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# The `compress` program's process defaults (importing the package sets none), before torch loads its OpenMP
# runtime: with several threads, idle OpenMP threads spin by default and stall small VMs; passive waiting costs
# nothing on a busy machine. A value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

EPILOG_RUN = """examples:
  compress run recipes/int4_rtn.yaml
  compress run recipes/int4_rtn.yaml --set stages.0.scheme.group_size=32 --set eval.max_windows=4
  compress run recipes/int8_absmax.yaml --set model=HuggingFaceTB/SmolLM2-360M --output runs/360m-int8

The run writes OUTPUT/report.md and report.json (baseline and compressed side by side), the quantized
model (model.safetensors + config.json + compress.json) and the recipe with its sha256.
"""

EPILOG_RUN += """
Prune and distill (recipes/minitron_prune_distill.yaml) also run data-parallel on several processes:
  accelerate launch --num_processes 2 -m compress run recipes/minitron_prune_distill.yaml
"""

EPILOG_EVAL = """examples:
  compress eval runs/int4_rtn --baseline default --max-windows 4
  compress eval default --max-windows 2 --no-speed
  compress eval runs/int4_rtn --baseline default --max-windows 4 --samples 64   # longer generated samples
  compress eval runs/awq_int4 --baseline default --tasks arc_easy,lambada_openai --task-limit 50
  compress eval runs/awq_int4/exports/compressed-tensors --baseline default --max-windows 4
  compress eval runs/awq_int4 --baseline default --suite quick       # eval/quick.yaml; flags override it
  compress eval runs/big/exports/dense --offload 8 --no-speed --tasks piqa   # larger than memory: 8 GB held

MODEL and --baseline accept `default`, a compress output folder, a Hugging Face folder, a .gguf file or a hub id.
"""

EPILOG_INSPECT = """examples:
  compress inspect recipes/int4_rtn.yaml
  compress inspect recipes/int4_rtn.yaml --set stages.0.scheme.group_size=128 --set stages.0.strict=false
  compress inspect runs/int4_rtn --dtype bfloat16          # a finished run: which kernel each layer uses

Given a compressed model folder instead of a recipe, inspect times every kernel that can run each quantized layer
shape (and the dense layer it replaces) at batch sizes --batches, and prints the dispatcher's choice per batch size
and why the other kernels cannot run it. bf16 / fp16 activations open torch's fast CPU int4 kernel.
"""


EPILOG_EXPORT = """formats (FORMAT: who loads it):
  dense               transformers, vLLM, SGLang, TensorRT-LLM: plain float weights (pruned models, any scheme)
  compressed-tensors  vLLM, SGLang, transformers: W4A16 / W8A16 packed, W8A8 int8, fp8 (+ KV-cache scales)
  awq                 vLLM, SGLang, transformers: int4 group, AutoAWQ GEMM layout
  gptq                vLLM, SGLang, transformers: int4 / int8 group or channel, GPTQ v1 layout
  fp8                 vLLM (quant_method fp8), TensorRT-LLM / ModelOpt (hf_quant_config.json)
  mlx                 mlx-lm (Apple silicon; mlx-cpu on Linux): int2-int6 / int8 group 32 / 64 / 128, MLX's affine
                      layout (codes and scales exactly; mixed bit widths and float layers per layer)
  gguf-f16 | gguf-q8_0 | gguf-q4_0 | gguf-q4_1   llama.cpp: int4 g32 sym -> q4_0, asym -> q4_1, int8 g32 -> q8_0
                      keep our codes exactly; anything else is dequantized and re-quantized (export.json says
                      which path each tensor took)
  gguf-q4_k | gguf-q5_k | gguf-q6_k | gguf-q4_k_m | gguf-q5_k_m   llama.cpp K-quants, llama-quantize's per-tensor
                      mix and fallbacks (Q5_0 / Q5_1 / Q8_0 for rows not a multiple of 256); calibrated on WikiText-2
                      (imatrix; GPTQ onto the grid for float layers) when the data is there

examples:
  compress export runs/awq_int4 --format compressed-tensors --format awq
  compress export runs/int8_g32 --format gguf-q8_0 --output /srv/models/smollm2-q8_0 --verify

Exports go to RUN_DIR/exports/FORMAT/ unless --output is given; nothing is recomputed. A compress checkpoint is
read one decoder block at a time, so a model larger than memory exports in the memory of one block.
"""

EPILOG_VERIFY = """examples:
  compress verify runs/awq_int4/exports/compressed-tensors
  compress verify runs/int8_absmax/exports/gguf-q8_0 --windows 4 --seq-len 512
  compress verify runs/awq_int4/exports/awq --engine vllm --engine-python ~/vllm/bin/python
  compress verify runs/int4_rtn/exports/gguf-q4_1 --engine llama.cpp
  compress verify runs/int4_rtn/exports/mlx --engine mlx --engine-python ~/mlx/bin/python --engine-dtype float32

Reloads the export through its loader (transformers + compressed-tensors, llama-cpp-python; AWQ / GPTQ /
per-tensor fp8 are read with their published layout, since their serving kernels need a GPU) and prints the
KL divergence and top-1 agreement of its next-token predictions against the source model, on WikiText-2 test
windows.

--engine loads the export in the serving engine itself (vLLM in its own Python: --engine-python or
COMPRESS_VLLM_PYTHON; mlx-lm likewise, or COMPRESS_MLX_PYTHON; llama.cpp through llama-cpp-python) and prints,
against the source model on the same tokens: mean |delta log p| of each next token, top-1 agreement, how many greedy tokens match on 3 prompts, decode
tokens/s, the method and kernels the engine chose, or the engine's own error when it refuses the checkpoint.
Where an engine default changes the model (vLLM CPU quantizes int4 layers' activations to int8), both runs are
shown: the default, and with the setting that serves the exported model (VLLM_CPU_INT4_W4A8=0).
"""


EPILOG_PUSH = """examples:
  compress push runs/awq_int4/exports/compressed-tensors --repo my-org/SmolLM2-135M-awq-int4 --dry-run
  compress push runs/int8_g32/exports/gguf-q8_0 --repo my-org/SmolLM2-135M-GGUF --private
  compress push runs/int4_rtn --repo my-org/SmolLM2-135M-int4-compress        # the native checkpoint

Uploads the folder to a Hugging Face model repository (created if needed; files added or replaced, none deleted)
with its model card (README.md, written by `compress run` and `compress export`; OWNER/NAME in its snippets
becomes --repo). Every file but hidden ones goes; a run folder's exports/ stays behind: push each export to its
own repository. --dry-run lists the files and prints the card without contacting the Hub. The token: --token,
else HF_TOKEN or `hf auth login`'s.
"""


EPILOG_REPORT = """examples:
  compress report runs/int8_absmax runs/int4_rtn runs/awq_int4 --output runs/report
  compress report runs/* --output runs/report

Accuracy (perplexity, KL, top-1, lm-eval accuracy ± stderr) against memory (weights as served) and speed (measured
decode tokens/s, roofline prediction), with the Pareto frontier marked in the table and the PNG plots.
"""


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value (dotted path, YAML value); repeatable, e.g. "
                        "--set stages.0.scheme.group_size=32 --set model=HuggingFaceTB/SmolLM2-360M; an index one "
                        "past a list's end appends: --set stages.2.stage=tune_scales")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compress", description="Quantize Hugging Face causal LMs and score what it cost in accuracy, "
                                     "memory and speed.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a recipe end to end: load, calibrate, compress, save, evaluate, report",
                       epilog=EPILOG_RUN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/int4_rtn.yaml")
    _add_set(p)
    p.add_argument("--output", help="output folder (overrides output.dir)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--max-windows", type=int, help="evaluate on at most N perplexity windows (quick runs)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--resume", action="store_true",
                   help="continue a crashed run's distill stage from its newest checkpoint (in OUTPUT.work/)")

    p = sub.add_parser("eval", help="evaluate a model (optionally against a baseline) and write a report",
                       epilog=EPILOG_EVAL, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model to evaluate")
    p.add_argument("--baseline", help="reference model for KL divergence and top-1 agreement")
    p.add_argument("--suite", help="an evaluation suite from eval/ (quick, standard): its settings, then the flags "
                                    "given here over them")
    p.add_argument("--split", help="WikiText-2 split: test (default), validation, or a percent slice such as "
                                   "'validation[50%%:]'")
    p.add_argument("--seq-len", type=int, help="window length in tokens (default 2048)")
    p.add_argument("--max-windows", type=int, help="at most N windows (default: the whole split)")
    p.add_argument("--no-speed", action="store_true", help="skip the tokens/s measurement")
    p.add_argument("--samples", type=int, metavar="N",
                   help="greedy continuations of the report's three prompts, at most N new tokens (default 32; 0: "
                        "none)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable timings)")
    p.add_argument("--output", help="folder for report.json / report.md (default: print the markdown)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--tasks", help="lm-eval tasks, comma-separated (arc_easy,arc_challenge,piqa,winogrande,boolq,"
                                   "lambada_openai,wikitext), read from the local data folder")
    p.add_argument("--task-limit", type=int, help="documents per lm-eval task (default: the whole split)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype the models are loaded in (default auto: float32 on a CPU, bfloat16 on CUDA; with "
                        "--offload, the checkpoint's own)")
    p.add_argument("--offload", type=float, metavar="GB",
                   help="for a model larger than memory: hold at most GB of weights in memory and offload the rest "
                        "to a temporary folder on disk (accelerate's device_map; Hugging Face folders such as a "
                        "dense or compressed-tensors export), at the checkpoint's own dtype unless --dtype says "
                        "otherwise. Perplexity, KL and lm-eval give the resident figures, slower; speed is a short run (32 "
                        "prefill tokens, 4 decode steps, once) that times the disk reads as much as the model")

    p = sub.add_parser("inspect", help="show the resolved per-layer plan of a recipe without running it",
                       epilog=EPILOG_INSPECT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML, or a compressed model folder (a run's output) to show its kernels")
    _add_set(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model folder only: activation dtype to time the kernels in (default bfloat16)")
    p.add_argument("--device", default="cpu", help="model folder only: cpu or cuda (default cpu)")
    p.add_argument("--batches", default="1,4,16,64", help="model folder only: batch sizes (rows) to time")
    p.add_argument("--threads", type=int, default=1, help="model folder only: CPU threads (default 1)")
    p.add_argument("--float-copy", action="store_true",
                   help="model folder only: also consider keeping a dequantized float copy of a layer (dense speed "
                        "at large batch sizes, dense memory where chosen)")

    from ..export import FORMAT_NAMES
    p = sub.add_parser("export", help="export a finished run to serving formats (vLLM, SGLang, TensorRT-LLM, "
                                      "llama.cpp) without recomputing", epilog=EPILOG_EXPORT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a `compress run` output folder (or any model folder compress loads)")
    p.add_argument("--format", dest="formats", action="append", required=True, choices=FORMAT_NAMES,
                   metavar="FORMAT", help="export format; repeatable (see below)")
    p.add_argument("--output", help="export folder (one --format only; default RUN_DIR/exports/FORMAT)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="safetensors formats: shards of at most this many GB (default 5, as transformers)")
    p.add_argument("--verify", action="store_true", help="reload each export and compare it with the run's model")
    p.add_argument("--windows", type=int, default=2, help="windows for --verify (default 2)")
    p.add_argument("--seq-len", type=int, default=512, help="window length for --verify (default 512)")

    p = sub.add_parser("verify", help="reload an export through its target's loader and compare it with its source",
                       epilog=EPILOG_VERIFY, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir", help="an export folder (has export.json)")
    p.add_argument("--source", help="model to compare against (default: the run the export came from)")
    p.add_argument("--windows", type=int, default=2, help="WikiText-2 test windows (default 2)")
    p.add_argument("--seq-len", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--engine", choices=("vllm", "llama.cpp", "mlx"),
                   help="load the export in this serving engine instead of its Python loader (see below)")
    p.add_argument("--engine-python", metavar="PYTHON",
                   help="the engine's interpreter, when it lives in its own virtual environment (vLLM, mlx-lm)")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine setting (environment variable), repeatable, e.g. VLLM_CPU_INT4_W4A8=0")
    p.add_argument("--engine-dtype", default="bfloat16",
                   help="the engine's compute dtype (default bfloat16; mlx: auto keeps the checkpoint's)")
    p.add_argument("--new-tokens", type=int, default=32, help="--engine: greedy tokens per prompt (default 32)")

    p = sub.add_parser("report", help="put finished runs side by side: one page, JSON and Pareto plots",
                       epilog=EPILOG_REPORT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders written by `compress run`")
    p.add_argument("--output", default="runs/report", help="folder for report.md, report.json and the PNGs "
                                                          "(default runs/report)")
    from .plan import add_parser as add_plan_parser
    from .speculate import add_parser as add_speculate_parser
    from .generate import add_parser as add_generate_parser
    from .draft_head import add_parser as add_draft_head_parser
    add_speculate_parser(sub)
    add_draft_head_parser(sub)
    add_plan_parser(sub)
    p = sub.add_parser("push", help="upload a run or an export, with its model card, to the Hugging Face Hub",
                       epilog=EPILOG_PUSH, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", metavar="RUN_OR_EXPORT", help="a `compress run` output folder or an export folder")
    p.add_argument("--repo", required=True, help="the model repository, owner/name")
    p.add_argument("--private", action="store_true", help="create the repository private (an existing one keeps "
                                                          "its visibility)")
    p.add_argument("--dry-run", action="store_true", help="list the files and print the card; upload nothing")
    p.add_argument("--token", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    p.add_argument("--write-card", action="store_true",
                   help="write (or rewrite) README.md from the folder's report.json / export.json first")
    add_generate_parser(sub)
    return parser


def cmd_speculate(args) -> int:
    from .speculate import run

    return run(args)


def cmd_draft_head(args) -> int:
    from .draft_head import run

    return run(args)


def cmd_plan(args) -> int:
    from .plan import run

    return run(args)


def cmd_push(args) -> int:
    from ..export.push import push

    push(args.folder, args.repo, private=args.private, dry_run=args.dry_run, token=args.token,
         write_card=args.write_card)
    return 0


def cmd_generate(args) -> int:
    from .generate import run

    return run(args)


def cmd_report(args) -> int:
    from ..measure.pareto import write

    out = Path(args.output)
    write([Path(d) for d in args.run_dirs], out)
    print((out / "report.md").read_text())
    return 0


def _run_source(run_dir: Path) -> str | None:
    """The model a run started from (its GGUF carries the tokenizer metadata a GGUF export copies)."""
    for name, keys in (("report.json", ("model", "source")), ("compress.json", ("source",))):
        path = run_dir / name
        if path.is_file():
            value = json.loads(path.read_text())
            for k in keys:
                value = value.get(k) if isinstance(value, dict) else None
            if value:
                return str(value)
    return None


def _verify_windows(tokenizer, n: int, seq_len: int):
    from ..pipeline.report import eval_windows
    return eval_windows(tokenizer, "test", seq_len, n)


def _print_verify(fmt: str, result: dict) -> None:
    print(f"{fmt}: loaded with {result['loader']}; over {result['positions']} positions KL {result['kl']:.3e} nats, "
          f"top-1 agreement {result['top1_agreement']:.4f}")


def cmd_export(args) -> int:
    from ..export import check_export, export_model
    from ..export.card import write_export_card
    from ..export.verify import verify_export
    from ..model.load import load_model
    from ..model.streaming import open_compressed, stream_parts

    run_dir = Path(args.run_dir)
    if args.output and len(args.formats) > 1:
        raise ValueError("--output names one folder; give one --format with it (or omit --output)")
    # a compress checkpoint is read one decoder block at a time, so a model of any size exports in the memory of
    # one block; anything else transformers loads is loaded whole, and so is a run with eora's low-rank terms (its
    # adapter is written from the model in memory; the run that made them held the whole model)
    native = (run_dir / "compress.json").is_file() and \
        "lowrank" not in json.loads((run_dir / "compress.json").read_text())
    whole = None if native else load_model(str(run_dir))
    skeleton = open_compressed(run_dir).model if native else whole.model
    for fmt in args.formats:  # every format checked before anything is written
        check_export(skeleton, fmt)
    source = _run_source(run_dir)
    meta = {"source_model": str(run_dir.resolve()), "original_model": source}
    recipe = run_dir / "recipe.yaml"
    if recipe.is_file():
        import hashlib
        text = recipe.read_text()
        meta.update(recipe_sha256=hashlib.sha256(text.encode()).hexdigest(), recipe=text)
    for fmt in args.formats:
        out = Path(args.output) if args.output else run_dir / "exports" / fmt
        streamed = open_compressed(run_dir) if native else None
        model, tokenizer = (streamed.model, streamed.tokenizer) if native else (whole.model, whole.tokenizer)
        record = export_model(model, tokenizer, fmt, out, meta, overwrite=args.overwrite,
                              source_gguf=source if source and source.endswith(".gguf") else None,
                              max_shard_bytes=int(args.max_shard_gb * 10 ** 9),
                              parts=stream_parts(streamed) if native else None)
        print(f"{fmt}: wrote {out}")
        for note in record.get("notes") or []:
            print(f"  note: {note}")
        verified = None
        if args.verify:  # the comparison needs the whole model
            whole = whole or load_model(str(run_dir))
            verified = verify_export(out, whole.model, _verify_windows(whole.tokenizer, args.windows, args.seq_len))
            _print_verify(fmt, verified)
        write_export_card(out, run_dir, record, verified)  # README.md: the Hub's model card (export/card.py)
    return 0


def cmd_verify(args) -> int:
    from ..export.verify import read_record, verify_export
    from ..model.load import load_model

    record = read_record(args.export_dir)
    source = args.source or record.get("source_model")
    if not source:
        raise ValueError(f"{args.export_dir}/export.json names no source model; pass --source MODEL")
    loaded = load_model(source)
    if args.engine:
        return _verify_engine(args, record, loaded)
    result = verify_export(args.export_dir, loaded.model, _verify_windows(loaded.tokenizer, args.windows,
                                                                           args.seq_len))
    if args.json:
        print(json.dumps({"format": record["format"], **result}, indent=2))
    else:
        _print_verify(record["format"], result)
    return 0


def _verify_engine(args, record: dict, loaded) -> int:
    from ..engines.check import engine_check, prompt_ids
    from ..engines.report import engine_lines

    env = {}
    for item in args.engine_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-env {item!r}: give KEY=VALUE, e.g. VLLM_CPU_INT4_W4A8=0")
        env[key] = value
    result = engine_check(args.export_dir, loaded.model, _verify_windows(loaded.tokenizer, args.windows, args.seq_len),
                          prompt_ids(loaded.tokenizer), args.engine, args.new_tokens, args.engine_dtype, env,
                          args.engine_python)
    print(json.dumps(result, indent=2) if args.json else "\n".join(engine_lines(result)))
    return 0 if result["loads"] else 1


def _quiet_libraries() -> None:
    """--no-progress also silences the progress bars transformers draws itself (GGUF conversion, weight loading)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def process_age() -> float:
    """Seconds since this process started (its interpreter start-up and imports, before the command began)."""
    import psutil
    return max(0.0, time.time() - psutil.Process().create_time())


def cmd_run(args) -> int:
    from ..api import run
    from ..core.profile import Profile

    profile = Profile(startup=process_age())  # the report's profile covers the process: imports included
    overrides = list(args.overrides)
    if args.output:
        overrides.append(f"output.dir={args.output}")
    if args.overwrite:
        overrides.append("output.overwrite=true")
    if args.max_windows is not None:
        overrides.append(f"eval.max_windows={args.max_windows}")
    if args.no_progress:
        _quiet_libraries()
    report = run(args.recipe, overrides, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr),
                 resume=args.resume, profile=profile)
    if not report.data:  # a helper process under `accelerate launch`: the main process writes the report
        return 0
    print(report.markdown())
    return 0


def cmd_eval(args) -> int:
    import torch

    from ..api.session import evaluate_loaded
    from ..pipeline.report import render_markdown, write_report
    from ..model.load import load_model, resolve_device
    from ..recipe import EvalSpec, build, eval_suite_settings

    device = resolve_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    flags = {"split": args.split, "seq_len": args.seq_len, "max_windows": args.max_windows,
             "speed": False if args.no_speed else None, "samples": args.samples,
             "tasks": [t.strip() for t in args.tasks.split(",")] if args.tasks else None, "task_limit": args.task_limit}
    settings = eval_suite_settings(args.suite, "--suite") if args.suite else {}
    spec = build(EvalSpec, {**settings, **{k: v for k, v in flags.items() if v is not None}}, "eval",
                 f"--suite {args.suite}" if args.suite else "compress eval")
    with contextlib.ExitStack() as stack:
        def offload():  # each offloaded model gets its own temporary folder, removed at the end
            if args.offload is None:
                return None
            if args.offload <= 0:
                raise ValueError(f"--offload {args.offload}: give the GB of weights to hold in memory, e.g. 8")
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="compress-offload-"))
            return int(args.offload * 1e9), folder

        loaded = load_model(args.model, args.dtype, device, offload=offload())
        models = {"model": loaded.model}
        if args.baseline:
            models = {"baseline": load_model(args.baseline, args.dtype, device, offload=offload()).model, **models}
        report = evaluate_loaded(models, loaded.tokenizer, spec, device, not args.no_progress,
                                 {"source": loaded.source, "kind": loaded.kind})
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
        write_report(report, args.output)
    print(render_markdown(report))
    return 0


def cmd_inspect_model(args) -> int:
    """`compress inspect MODEL_DIR`: the measured kernel dispatch of a compressed model."""
    import torch

    from ..kernels.dispatch import plan_dispatch, render
    from ..model.load import load_model

    torch.set_num_threads(args.threads)
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise ValueError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    loaded = load_model(args.recipe, args.dtype, args.device)
    plan = plan_dispatch(loaded.model, batches, float_copy=args.float_copy).to_dict()
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    if not plan["layers"]:
        print(f"{args.recipe}: no quantized layers; every matmul is torch's dense one")
        return 0
    print(f"model: {loaded.source} [{loaded.kind}]\n")
    print("\n".join(render(plan)))
    return 0


def cmd_inspect(args) -> int:
    if Path(args.recipe).is_dir():
        return cmd_inspect_model(args)
    from ..arch import get_arch
    from ..pipeline.memory_plan import conversion_bytes
    from ..measure.machine import machine_peaks
    from ..model.load import checkpoint_files, model_skeleton, resolve_device, resolve_dtype, streamed_dtype
    from ..pipeline.time_plan import time_lines, time_plan
    from ..recipe import load_recipe, to_plain
    from ..stages import make_plan
    from ..pipeline.streamed import choose_plan

    recipe = load_recipe(args.recipe, args.overrides)
    spec = recipe.model
    source, kind, model = model_skeleton(spec.source, spec.revision, spec.trust_remote_code)  # no weights read
    arch = get_arch(model)
    plan = make_plan(model, arch, recipe.stages)  # the plan `compress run` follows
    described = [stage.describe(plan, i) for i, stage in enumerate(recipe.stages)]
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    files = checkpoint_files(spec.source)
    memory, recipe, stream, notes = choose_plan(recipe, model.config, dtype, device,
                                                conversion_bytes(files, model.config, dtype))
    threads = (recipe.calibration or recipe.model).threads
    timing = time_plan(model, arch, recipe, plan.needs().hessian, sum(f.stat().st_size for f in files),
                       streamed_dtype(spec.dtype, device, model.config) if stream else dtype, device,
                       machine_peaks(device, threads if threads > 0 else os.cpu_count() or 1))
    if args.json:
        print(json.dumps({"arch": to_plain(arch), "stages": [data for _, data in described],
                          "memory_plan": memory.to_dict(), "streamed": stream, "time_plan": timing}, indent=2))
        return 0
    print(f"recipe: {recipe.path} (sha256 {recipe.sha256[:16]}…)")
    print(f"model: {source} [{kind}], family {arch.family}, blocks at `{arch.blocks}` "
          f"({len(arch.block_list(model))} blocks), lm_head `{arch.lm_head}`")
    print(f"  attention linears: {', '.join(arch.attention)}\n  mlp linears: {', '.join(arch.mlp)}\n"
          f"  norms: {', '.join(arch.norms)}")
    cal = recipe.calibration
    print("calibration: " + (f"{cal.n_samples} × {cal.seq_len} tokens, kind {cal.kind}, seed {cal.seed}"
                             if cal else "none (no calibration pass)"))
    for lines, _ in described:
        print("\n".join(lines))
    print("\n" + "\n".join(notes + memory.lines() + time_lines(timing)))
    if (why := memory.problem(recipe)) is not None:
        print(f"`compress run` would refuse this: {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"run": cmd_run, "eval": cmd_eval, "inspect": cmd_inspect, "export": cmd_export,
               "verify": cmd_verify, "report": cmd_report, "speculate": cmd_speculate, "draft-head": cmd_draft_head,
               "plan": cmd_plan, "push": cmd_push, "generate": cmd_generate}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted; no partial output was left behind", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, OSError, RuntimeError, ImportError) as exc:
        print(f"compress {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
