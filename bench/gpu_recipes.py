"""`compress run` on CUDA (issue 44, item 7): five recipes on SmolLM2-135M, and gptq_int4 on a Llama-2-7B shape.

What it measures, every run through the API `compress run` uses (recipe.load_recipe + pipeline.run), each in its own
child process (one failure is one row; peak GPU and host memory are that run's own):

1. Recipes awq_int4, gptq_int4, awq_gptq_int4, fp8_dynamic and nvfp4 (its compressed-tensors and modelopt-nvfp4
   exports written and reloaded) with model.device: cuda and the run's dtype auto (bfloat16 on CUDA, what users
   run), on PROTOCOL (below): calibration, evaluation and export verification on the GPU. Per run: completes (or
   the error as the row), wall time of run() and per phase (the report's timings: load, compress, save, eval,
   export; CUDA-synchronized), KL to the baseline, top-1, perplexity of both models, peak GPU memory
   (torch.cuda.max_memory_allocated, and reserved) and peak host RSS (getrusage), and the KL against the same
   recipe's CPU run (bench/results/gpu_recipes_cpu_reference.json, computed with `--reference`): within
   KL_TOLERANCE (10%) or not. `--dtypes auto,float32` adds float32-weight runs (the CPU reference's dtype): a miss
   in bfloat16 that float32 meets is the dtype, not the device.
   Models: "embedded", the real SmolLM2-135M-Instruct (its GGUF: COMPRESS_DEFAULT_GGUF, or the two halves
   .gpu_carry/gguf.part1 + part2, joined and checked against the pinned sha256), and "random", SmolLM2-135M's exact
   LlamaConfig with deterministic random weights (uniform, std RANDOM_STD, norms 1; numpy's frozen legacy
   RandomState seeded per tensor name, built on the CPU: bit-identical on any machine, its sha256 checked against
   the reference's) and SmolLM2's real tokenizer (.gpu_carry/tokenizer).
2. A Llama-2-7B shape (hidden 4096, MLP 11008, 32 blocks, 32 heads; SmolLM2's 49,152-token vocabulary, untied:
   6.9 B parameters) with random bfloat16 weights generated on the GPU and written as 5 GB safetensors shards (13.9
   GB of disk, written twice by the shard writer); then gptq_int4 with 16 x 512 calibration tokens, resident
   (model.stream: never) and streamed from disk block by block (always): per-phase wall time, peak GPU and host
   memory. The model is deleted afterwards.

PROTOCOL (the recipes' own stages and schemes; on the GPU and in the CPU reference alike): 32 calibration windows
of 512 tokens (WikiText-2 validation, seed 0; the recipes ask 64-128, which the CPU reference could not afford), the
first 4 WikiText-2 test windows of 2048 tokens for perplexity and KL, no speed measurement, exports verified on 1
window. Bars (issue 44): every recipe completes with KL within 10% of its CPU run; awq_int4 on the embedded model
<= 60 s (run() wall time); Llama-2-7B-shape gptq_int4 <= 180 s on one GPU.

How a GPU session runs it. The GPU machine has no network, no `gguf`, `compressed-tensors` or `pydantic`, neither
../shared/data nor the default model, and transformers 5.17 (the dry run passes under 5.17 too); everything it lacks
comes in .gpu_carry/, which git ignores, and each device call carries at most 64 MiB (the working tree, 4.3 MB,
included):

  here, once:   python bench/gpu_recipes.py --prepare      # writes .gpu_carry/: tokenizer/ (SmolLM2's, from the
                # GGUF: 3.4 MB), data/wikitext-2-raw/ (test + validation, 2.4 MB), whl/ (the 7 wheels of WHEELS for
                # CPython 3.12 from the package index, 3.0 MB), gguf.part1 and gguf.part2 (the 98 MB GGUF in halves,
                # 47 MiB each). --no-wheels skips the download.
  device call 1 (about 10 minutes; carry [".gpu_carry/tokenizer", ".gpu_carry/data", ".gpu_carry/whl",
                ".gpu_carry/gguf.part1"]: 60 MiB with the tree):
                python bench/gpu_recipes.py --out $OUT --models random --budget 540
  device call 2 (optional: the embedded model; made within the 30 s the machine stays warm, so that what call 1
                carried is still there; carry [".gpu_carry/gguf.part2"]):
                python bench/gpu_recipes.py --out $OUT --models embedded --parts recipes --budget 300
  from bench/gpu_run.sh, where $OUT returns at most 8 files:
                timeout 600 python3 bench/gpu_recipes.py --out "$OUT" --compact --models random --budget 540

Call 1 alone is complete for the random model and the 7B shape; without the halves (or COMPRESS_DEFAULT_GGUF) the
embedded rows are skipped with the reason. A session has 15 minutes of device time, the machine's start (1-2
minutes) included: with both calls, give call 1 --budget 420 and call 2 --budget 240 (or leave the 7B part to
another session: --parts recipes). Job ids are MODEL/RECIPE/DTYPE and large/...; --only picks some by pattern. The wheels go into --work/site (pip --no-index --target), the data folder
becomes COMPRESS_DATA_DIR. Expected on an H100 (estimates; nothing has run on a GPU yet): 30-60 s per recipe on the
135M model (a GGUF load is about 8 s, twice per run: the model, then the baseline), 60 s to build the 7B model, 2.5-3.5
minutes per 7B run (GPTQ's column loop is launch-bound: ~36k columns per block, ~100 s of the run). --budget (s)
skips a run that its estimate (ESTIMATE_S) says would not fit, recorded as such; a started run is killed at the
budget's end. Results in --out (else $OUT, else bench/results/gpu_recipes/): gpu_recipes.jsonl (a row per run as it
ends), gpu_recipes.json and .md (rows, comparison with the CPU runs, bars; rewritten after every row; the .json
holds the markdown too), gpu_recipes.log (the children's output). Exit status 0 when every run that was attempted
completed.

  OMP_NUM_THREADS=1 python bench/gpu_recipes.py --reference --models random,embedded --budget 100000
                # the CPU references, one run at a time (here: 1.5-8 minutes each on one shared core)
  python bench/gpu_recipes.py --dry-run --out DIR      # CPU, tiny models, the same jobs (tests/test_gpu_recipes.py)
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPES = ("awq_int4", "gptq_int4", "awq_gptq_int4", "fp8_dynamic", "nvfp4")
PROTOCOL = ("calibration.n_samples=32", "calibration.seq_len=512", "calibration.seed=0", "eval.split=test",
            "eval.max_windows=4", "eval.seq_len=2048", "eval.speed=false", "eval.baseline=true",
            "output.verify_windows=1", "output.overwrite=true")
LARGE_RECIPE = "gptq_int4"
LARGE_PROTOCOL = ("calibration.n_samples=16", "calibration.seq_len=512", "eval.max_windows=2", "eval.seq_len=2048",
                  "eval.speed=false", "output.overwrite=true")
DRY_PROTOCOL = ("calibration.n_samples=4", "calibration.seq_len=32", "eval.max_windows=2", "eval.seq_len=64",
                "calibration.threads=1", "eval.threads=1")  # applied after PROTOCOL / LARGE_PROTOCOL
KL_TOLERANCE = 0.10
LOG_TAIL = 200_000  # characters of each child's output kept in the log
BARS_S = {"embedded/awq_int4/auto": 60.0, "large/gptq_int4/resident": 180.0, "large/gptq_int4/streamed": 180.0}
ESTIMATE_S = {"recipe": 45.0, "build": 60.0, "large": 200.0}  # what a job must have left to start (H100 guesses)

# SmolLM2-135M-Instruct's config as transformers reads it from the GGUF file (compress.model.load.load_config("default"))
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=False)
# dry-run stand-ins: widths every recipe's groups divide (64, 16), a vocabulary holding the byte tokenizer's ids
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=320, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=256,
            eos_token_id=256, pad_token_id=256)
TINY_LARGE = dict(TINY, hidden_size=128, intermediate_size=256, num_hidden_layers=3, tie_word_embeddings=False)
RANDOM_STD, RANDOM_SEED = 0.02, 0

CARRY = ROOT / ".gpu_carry"
REFERENCE = ROOT / "bench" / "results" / "gpu_recipes_cpu_reference.json"
WHEELS = ("gguf==0.19.0", "compressed-tensors==0.20.1", "pydantic==2.13.4", "pydantic-core==2.46.4",
          "annotated-types==0.7.0", "typing-inspection==0.4.2", "loguru==0.7.3")


# ----------------------------------------------------------------------------------------------- models

def llama_config(fields: dict):
    from transformers import LlamaConfig
    return LlamaConfig(**fields)


def random_tensors(fields: dict, seed: int = RANDOM_SEED, std: float = RANDOM_STD):
    """(name, float32 tensor) of a Llama of `fields` in name order: uniform weights of standard deviation `std`
    from numpy's legacy RandomState (its stream is frozen across numpy versions) seeded by the name's crc32 and
    `seed`, norms 1; the head is left out when it is tied. The same bits on any machine."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(llama_config(fields))
    shapes = {n: tuple(p.shape) for n, p in skeleton.state_dict().items()}
    if fields.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    half_width = std * 3 ** 0.5
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shapes[name])
            continue
        state = np.random.RandomState((zlib.crc32(name.encode()) + 1_000_003 * seed) % 2 ** 32)
        values = (state.random_sample(int(np.prod(shapes[name]))) * 2 - 1) * half_width
        yield name, torch.from_numpy(values.astype(np.float32)).reshape(shapes[name])


def digest_tensor(digest, name: str, t) -> None:
    """Feed (name, shape, dtype, bytes) of a CPU tensor to a hashlib digest: a model's sha256 is its tensors fed in
    name order."""
    digest.update(f"{name}|{list(t.shape)}|{t.dtype}|".encode())
    digest.update(t.contiguous().reshape(-1).numpy().tobytes())


def build_random(folder: Path, fields: dict, tokenizer: Path) -> dict:
    """The random model of `fields` (random_tensors) as a float32 safetensors folder with the tokenizer's files.
    Returns its sha256 (digest_tensor), parameter count and build seconds."""
    from compress.export.shards import ShardWriter

    t = time.perf_counter()
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer, digest, count = ShardWriter(tmp), hashlib.sha256(), 0
    for name, tensor in random_tensors(fields):
        digest_tensor(digest, name, tensor)
        writer.add(name, tensor)
        count += tensor.numel()
    writer.finish()
    config = llama_config(fields)
    config.dtype = "float32"
    config.save_pretrained(tmp)
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return {"sha256": digest.hexdigest(), "parameters": count, "seconds": round(time.perf_counter() - t, 1)}


def build_large(folder: Path, fields: dict, tokenizer: Path, device: str) -> dict:
    """A Llama of `fields` with random bfloat16 weights (normal, std 0.02; norms 1) generated on `device`, written
    tensor by tensor as 5 GB safetensors shards with the tokenizer's files. Returns seconds, bytes, parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    from compress.export.shards import ShardWriter

    t = time.perf_counter()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(llama_config(fields))
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardWriter(tmp)
    gen = torch.Generator(device=device).manual_seed(0)
    count = 0
    for name, p in skeleton.state_dict().items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            tensor = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
            tensor = tensor.to(torch.bfloat16)
        writer.add(name, tensor)
        count += tensor.numel()
        del tensor
    writer.finish()
    config = llama_config(fields)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp)
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"seconds": round(time.perf_counter() - t, 1), "bytes_on_disk": size, "parameters": count}


def byte_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (256 byte tokens, no merges, one special token: ids < 257) saved in `folder`: the dry
    run's stand-in for SmolLM2's, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------------------------- carrying

def prepare(carry: Path, wheels: bool = True, gguf: bool = True) -> dict:
    """Fill `carry` with what the GPU machine lacks: SmolLM2's tokenizer extracted from the GGUF file, WikiText-2's
    test and validation files, the wheels of WHEELS (pip download for CPython 3.12, manylinux x86-64) and the GGUF
    file in two halves. Returns the bytes of each part."""
    from transformers import AutoTokenizer

    from compress.calibrate.data import find_data_dir
    from compress.model.default_model import default_model_path

    carry.mkdir(parents=True, exist_ok=True)
    path = default_model_path()
    tok = carry / "tokenizer"
    shutil.rmtree(tok, ignore_errors=True)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tok)
    data = find_data_dir()
    if data is None:
        raise FileNotFoundError("no WikiText-2 folder: set COMPRESS_DATA_DIR (the shared data folder)")
    (carry / "data" / "wikitext-2-raw").mkdir(parents=True, exist_ok=True)
    for name in ("wiki.test.raw", "wiki.valid.raw"):
        shutil.copy(data / "wikitext-2-raw" / name, carry / "data" / "wikitext-2-raw" / name)
    if wheels:
        shutil.rmtree(carry / "whl", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-q",
                        "-d", str(carry / "whl"), *WHEELS], check=True)
    if gguf:
        blob = path.read_bytes()
        half = len(blob) // 2
        (carry / "gguf.part1").write_bytes(blob[:half])
        (carry / "gguf.part2").write_bytes(blob[half:])
    return {p.name: sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
            for p in sorted(carry.iterdir())}


def join_gguf(carry: Path, work: Path) -> Path | None:
    """The embedded model's GGUF from the two carried halves, checked against its pinned sha256 (None: no halves)."""
    from compress.model.default_model import GGUF_NAME, GGUF_SHA256, sha256

    parts = [carry / "gguf.part1", carry / "gguf.part2"]
    if not all(p.is_file() for p in parts):
        return None
    target = work / GGUF_NAME
    if not (target.is_file() and sha256(target) == GGUF_SHA256):
        work.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            for p in parts:
                out.write(p.read_bytes())
        if sha256(target) != GGUF_SHA256:
            target.unlink()
            raise ValueError(f"{parts[0]} + {parts[1]} do not join into {GGUF_NAME} (sha256 differs): carry both "
                             "halves written by --prepare")
    return target


def install_wheels(carry: Path, work: Path) -> tuple[str | None, str]:
    """pip install the carried wheels into work/site (no index, no dependencies): (that folder or None, what
    happened). A failed install is not fatal: the runs that need a missing package fail as their rows."""
    wheels = sorted((carry / "whl").glob("*.whl"))
    if not wheels:
        return None, f"no wheels in {carry / 'whl'}"
    site = work / "site"
    if not (site / ".done").is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            return None, f"pip install of the carried wheels failed: {(done.stderr or done.stdout)[-1500:]}"
        (site / ".done").write_text("\n".join(w.name for w in wheels))
    return str(site), f"installed into {site}: {', '.join(w.name for w in wheels)}"


# ----------------------------------------------------------------------------------------------- jobs

def plan_jobs(args, sources: dict) -> list[dict]:
    """The runs in order: per model, the recipes in each dtype; then the large model (build, resident, streamed).
    `sources`: model name -> source folder or file (absent: not available, its jobs carry the reason)."""
    jobs = []
    parts = args.parts.split(",")
    device = "cpu" if args.dry_run or args.reference else "cuda"
    dtypes = args.dtypes.split(",")
    for dtype in dtypes:
        for model in args.models.split(","):
            if "recipes" not in parts:
                continue
            for recipe in args.recipes.split(","):
                overrides = [f"model={sources.get(model)}", f"model.device={device}", f"model.dtype={dtype}",
                             *PROTOCOL]
                if args.reference:
                    overrides += ["calibration.threads=1", "eval.threads=1"]
                if args.dry_run:
                    overrides += list(DRY_PROTOCOL)
                jobs.append({"id": f"{model}/{recipe}/{dtype}", "kind": "recipe", "model": model, "recipe": recipe,
                             "dtype": dtype, "device": device, "overrides": overrides,
                             "missing": None if sources.get(model) else sources.get(f"{model}:why", "not available")})
    if "large" in parts and not args.reference:
        folder = str(Path(args.work) / "large")
        jobs.append({"id": "large/build", "kind": "build", "device": device, "folder": folder,
                     "fields": TINY_LARGE if args.dry_run else LLAMA2_7B, "tokenizer": sources.get("tokenizer")})
        for mode, stream in (("resident", "never"), ("streamed", "always")):
            # one dtype for both (a streamed bf16 checkpoint would stay bf16 on a CPU with native bf16, where the
            # resident run computes in float32): the two runs must be the same run, bit for bit
            same = "bfloat16" if device.startswith("cuda") else "float32"
            overrides = [f"model={folder}", f"model.device={device}", f"model.stream={stream}", f"model.dtype={same}",
                         *LARGE_PROTOCOL]
            if args.dry_run:
                overrides += list(DRY_PROTOCOL)
            jobs.append({"id": f"large/{LARGE_RECIPE}/{mode}", "kind": "recipe", "model": "large",
                         "recipe": LARGE_RECIPE, "dtype": "auto", "device": device, "overrides": overrides,
                         "needs": "large/build", "missing": None})
    if args.only:
        jobs = [j for j in jobs if any(fnmatch.fnmatch(j["id"], p) for p in args.only.split(","))]
    return jobs


def worker(job: dict, out_dir: Path) -> dict:
    """One job in this process; its row."""
    import torch

    cuda = job["device"].startswith("cuda")  # a fresh process: the peaks below are this job's own
    if job["kind"] == "build":
        row = build_large(Path(job["folder"]), job["fields"], Path(job["tokenizer"]), job["device"])
    else:
        from compress.pipeline.resident import run
        from compress.recipe import load_recipe

        recipe = load_recipe(ROOT / "recipes" / f"{job['recipe']}.yaml",
                             [*job["overrides"], f"output.dir={out_dir / job['id'].replace('/', '-')}"])
        t = time.perf_counter()
        report = run(recipe, progress=False, log=lambda m: print(m, file=sys.stderr, flush=True))
        if cuda:
            torch.cuda.synchronize()
        row = {"wall_s": round(time.perf_counter() - t, 2), **report_figures(report)}
        shutil.rmtree(recipe.output.dir, ignore_errors=True)
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cuda:
        row.update(peak_gpu_allocated_bytes=torch.cuda.max_memory_allocated(),
                   peak_gpu_reserved_bytes=torch.cuda.max_memory_reserved(), gpu=torch.cuda.get_device_name())
    return row


def report_figures(report: dict) -> dict:
    models = report["eval"]["models"]
    comp, base = models["compressed"], models.get("baseline", {})
    errors = report.get("block_errors") or []
    return {
        "timings_s": {k: round(v, 2) for k, v in report["timings"].items()},
        "kl": comp.get("kl"), "top1": comp.get("top1_agreement"), "ppl": comp.get("ppl"), "ppl_baseline": base.get("ppl"),
        "tokens": comp.get("tokens"), "model_dtype": report["model"]["dtype"], "device": report["model"]["device"],
        "calibration_dtype": (report.get("calibration") or {}).get("compute_dtype"),
        "calibration_tokens": (report.get("calibration") or {}).get("tokens"),
        "eval_fingerprint": (report["eval"].get("protocol") or {}).get("tokens_fingerprint"),
        "block_error_max": max(errors) if errors else None, "streamed": bool(report.get("streamed")),
        "peak_cuda_bytes_report": report["eval"].get("peak_cuda_bytes"),
        "exports": [{"format": e["format"], "bytes": e["bytes"], "verify_kl": (e.get("verify") or {}).get("kl"),
                     "verify_top1": (e.get("verify") or {}).get("top1_agreement")} for e in report.get("exports", [])],
    }


def run_child(job: dict, out_dir: Path, env: dict, timeout: float, log) -> dict:
    """The job in a fresh process (`--worker`): its row, or the failure (exit status, timeout, output tail)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job), "--out", str(out_dir)]
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, output, code = done.stdout, done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        stdout, output, code = "", "".join(text), f"timeout after {timeout:.0f} s"
    log(f"===== {job['id']} (exit {code})\n{output}")
    row = next((json.loads(line[4:]) for line in reversed(stdout.splitlines()) if line.startswith("ROW ")), None)
    process_s = round(time.perf_counter() - t, 1)
    if row is None:
        return {"ok": False, "error": f"exit {code}", "log_tail": output[-3000:], "process_s": process_s}
    return {"ok": True, **row, "process_s": process_s}


def run_inline(job: dict, out_dir: Path) -> dict:
    t = time.perf_counter()
    try:
        row = {"ok": True, **worker(job, out_dir)}
    except Exception as exc:  # noqa: BLE001 - a failed run is a row
        row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000]}
    return {**row, "process_s": round(time.perf_counter() - t, 1)}


# ----------------------------------------------------------------------------------------------- results

def reference_key(model: str, recipe: str, dtype: str = "auto") -> str:
    """A CPU reference row's key: MODEL/RECIPE for the CPU's own dtype (auto: float32 weights), MODEL/RECIPE/DTYPE
    for another (bfloat16: what the model dtype alone does to the KL, the GPU run's dtype, on the CPU)."""
    return f"{model}/{recipe}" + ("" if dtype == "auto" else f"/{dtype}")


def compare(rows: list[dict], reference: dict | None, random_sha: str | None) -> dict:
    """Each completed recipe row against its CPU reference (same model and recipe): kl_vs_cpu = KL / reference KL,
    within_10pct; and the bars. Returns the verdicts."""
    refs = (reference or {}).get("rows", {})
    same_random = reference is not None and random_sha is not None and \
        reference.get("models", {}).get("random", {}).get("sha256") == random_sha
    for r in rows:
        if r.get("kind") != "recipe" or not r.get("ok") or r.get("model") == "large":
            continue
        ref = refs.get(f"{r['model']}/{r['recipe']}")
        if ref is None or ref.get("kl") is None or r.get("kl") is None:
            r["vs_cpu"] = "no CPU reference for this model and recipe"
            continue
        if r["model"] == "random" and not same_random:
            r["vs_cpu"] = "the random model's weights differ from the reference's (sha256): not comparable"
            continue
        if ref.get("protocol") != list(PROTOCOL):
            r["vs_cpu"] = "the reference was computed on another protocol"
            continue
        r["kl_cpu"] = ref["kl"]
        r["kl_vs_cpu"] = r["kl"] / ref["kl"]
        r["within_10pct"] = abs(r["kl_vs_cpu"] - 1) <= KL_TOLERANCE
        bf16 = refs.get(reference_key(r["model"], r["recipe"], "bfloat16"))
        if bf16 is not None and bf16.get("kl") is not None:  # the CPU with bfloat16 weights, as the GPU's auto
            r["kl_cpu_bfloat16"] = bf16["kl"]
    verdicts = {}
    recipe_rows = [r for r in rows if r.get("kind") == "recipe" and r.get("model") != "large"]
    attempted = [r for r in recipe_rows if not r.get("skipped")]
    verdicts["recipes_completed"] = f"{sum(bool(r.get('ok')) for r in attempted)}/{len(attempted)} attempted " \
                                    f"({len(recipe_rows) - len(attempted)} skipped)"
    compared = [r for r in attempted if "within_10pct" in r]
    for dtype in sorted({r["dtype"] for r in compared}):
        mine = [r for r in compared if r["dtype"] == dtype]
        verdicts[f"kl_within_10pct_of_cpu_{dtype}"] = f"{sum(r['within_10pct'] for r in mine)}/{len(mine)}"
    for key, bar in BARS_S.items():
        row = next((r for r in rows if r["id"] == key and r.get("ok")), None)
        verdicts[f"{key} <= {bar:.0f} s"] = None if row is None else row["wall_s"] <= bar
    # the streamed run is the resident run block by block (on CUDA its blocks reach the device through the
    # read-ahead's pinned copies, core/transfer.py): the same scores
    pair = [next((r for r in rows if r["id"] == f"large/{LARGE_RECIPE}/{m}" and r.get("ok")), None)
            for m in ("resident", "streamed")]
    verdicts["large streamed == resident (KL, perplexity)"] = None if None in pair else all(
        pair[0].get(k) == pair[1].get(k) for k in ("kl", "ppl"))
    return verdicts


def fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def render(result: dict) -> str:
    gb = 1e9
    lines = [f"# compress run on CUDA ({result['device_name']})", "",
             f"{result['date']}, commit {result['commit']}, torch {result['torch']}; protocol: "
             f"{' '.join(PROTOCOL)} (large: {' '.join(LARGE_PROTOCOL)}). KL CPU: the same recipe's CPU run, float32 "
             f"weights (in brackets: bfloat16 weights, the GPU's dtype, on the CPU); ratio: this run's KL over the "
             f"float32 one, ✓ within {KL_TOLERANCE:.0%} (reference: {result.get('reference_note', '')}).", "",
             "| run | ok | wall s | phases s | KL | KL CPU | ratio | ppl | ppl base | top-1 | GPU peak GB | host peak GB |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['id']} | skipped: {r['skipped']} |||||||||||")
            continue
        if not r.get("ok"):
            lines.append(f"| {r['id']} | **failed**: {r.get('error', '')[:200]} |||||||||||")
            continue
        phases = ", ".join(f"{k} {v:.1f}" for k, v in (r.get("timings_s") or {}).items())
        if r.get("kind") == "build":
            phases = f"built: {r['parameters'] / 1e9:.2f} B parameters, {r['bytes_on_disk'] / gb:.1f} GB on disk"
            r = {**r, "wall_s": r.get("seconds")}
        cpu = fmt(r.get("kl_cpu"), ".5f") + (f" (bf16 {r['kl_cpu_bfloat16']:.5f})" if "kl_cpu_bfloat16" in r else "")
        ratio = fmt(r.get("kl_vs_cpu"), ".3f") + (" ✓" if r.get("within_10pct") else " ✗" if "within_10pct" in r
                                                   else "")
        lines.append(f"| {r['id']} | yes | {fmt(r.get('wall_s'), '.1f')} | {phases or r.get('note', '')} | "
                     f"{fmt(r.get('kl'), '.5f')} | {cpu} | {ratio} | {fmt(r.get('ppl'), '.3f')} "
                     f"| {fmt(r.get('ppl_baseline'), '.3f')} | {fmt(r.get('top1'), '.4f')} | "
                     f"{fmt(r.get('peak_gpu_allocated_bytes') and r['peak_gpu_allocated_bytes'] / gb, '.2f')} | "
                     f"{fmt(r['peak_rss_bytes'] / gb, '.2f')} |")
    lines += ["", "Verdicts: " + "; ".join(f"{k}: {v}" for k, v in result["verdicts"].items())]
    return "\n".join(lines) + "\n"


def environment(args, work: Path, log) -> tuple[dict, dict]:
    """(child environment, model sources): the data folder, the wheels, the models each mode runs on."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    carry = Path(args.carry)
    sources: dict = {}
    if not args.dry_run and not args.reference:
        site, sources["wheels"] = install_wheels(carry, work)
        log(f"wheels: {sources['wheels']}")
        if site is not None:
            sys.path.insert(0, site)
            env["PYTHONPATH"] = os.pathsep.join([site, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not os.environ.get("COMPRESS_DATA_DIR") and (carry / "data" / "wikitext-2-raw").is_dir():
        env["COMPRESS_DATA_DIR"] = os.environ["COMPRESS_DATA_DIR"] = str(carry / "data")
    from compress.calibrate.data import find_data_dir
    data = find_data_dir()
    if data is None:
        raise FileNotFoundError(f"no WikiText-2: set COMPRESS_DATA_DIR or carry {carry}/data (--prepare writes it)")
    if args.dry_run:  # the first lines of each split: tiny windows need little text, and tokenizing it is instant
        tiny = work / "data-head" / "wikitext-2-raw"
        tiny.mkdir(parents=True, exist_ok=True)
        for name in ("wiki.test.raw", "wiki.valid.raw"):
            lines = (data / "wikitext-2-raw" / name).read_text(encoding="utf-8").splitlines(keepends=True)
            (tiny / name).write_text("".join(lines[:400]), encoding="utf-8")
        env["COMPRESS_DATA_DIR"] = os.environ["COMPRESS_DATA_DIR"] = str(tiny.parent)
    if args.dry_run:
        tokenizer = byte_tokenizer(work / "tokenizer-bytes")
        fields = TINY
    else:
        tokenizer, fields = carry / "tokenizer", SMOLLM2
        if not (tokenizer / "tokenizer.json").is_file():
            tokenizer = work / "tokenizer-smollm2"  # extracted here when the GGUF file is (the CPU reference)
            from transformers import AutoTokenizer

            from compress.model.default_model import default_model_path
            try:
                gguf = default_model_path(fetch=False)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"no tokenizer: carry {carry}/tokenizer (--prepare writes it) or give "
                                        f"the default model ({exc})") from None
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tokenizer)
    sources["tokenizer"] = str(tokenizer)
    models = args.models.split(",")
    if "random" in models:
        built = build_random(work / "random-model", fields, tokenizer)
        sources["random"], sources["random:sha256"] = str(work / "random-model"), built["sha256"]
        log(f"random model built in {built['seconds']} s, sha256 {built['sha256']}")
        sources["random:build"] = built
    if "embedded" in models:
        if args.dry_run:
            sources["embedded:why"] = "a dry run has no embedded model"
        elif os.environ.get("COMPRESS_DEFAULT_GGUF"):
            sources["embedded"] = "default"
        else:
            try:
                gguf = join_gguf(carry, work)
                if gguf is None:
                    from compress.model.default_model import default_model_path
                    gguf = default_model_path(fetch=False)
                env["COMPRESS_DEFAULT_GGUF"] = str(gguf)
                sources["embedded"] = "default"
            except (FileNotFoundError, ValueError) as exc:
                sources["embedded:why"] = f"no embedded model: {exc}"
    return env, sources


def commit() -> str:
    """HEAD of this checkout (COMPRESS_COMMIT names it for a copy without git, e.g. a `git archive` snapshot)."""
    if os.environ.get("COMPRESS_COMMIT"):
        return os.environ["COMPRESS_COMMIT"]
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip() or "unknown"


def write_reference(path: Path, rows: list[dict], sources: dict, argv: list[str]) -> None:
    """The CPU rows as the GPU run's reference, merged into `path` (rows of other models and dtypes are kept); each
    row names the command, commit and date it was computed with."""
    import torch

    ref = json.loads(path.read_text()) if path.is_file() else {"rows": {}, "models": {}}
    run = {"command": "OMP_NUM_THREADS=1 python bench/gpu_recipes.py " + " ".join(argv), "commit": commit(),
           "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "machine": f"{os.cpu_count()} CPU cores, "
                      f"{'AMX/AVX512-BF16' if _cpu_bf16() else 'no bf16 instructions'} (calibration.dtype auto: "
                      f"{next((r.get('calibration_dtype') for r in rows if r.get('ok')), '?')} matmuls)"}
    ref.update(protocol=list(PROTOCOL), **run)  # the latest run's, at the top
    if sources.get("random:sha256"):
        ref["models"]["random"] = {"sha256": sources["random:sha256"], "std": RANDOM_STD, "seed": RANDOM_SEED,
                                   "config": SMOLLM2}
    for r in rows:
        if r.get("ok"):
            ref["rows"][reference_key(r["model"], r["recipe"], r["dtype"])] = {
                "protocol": list(PROTOCOL), **{k: r.get(k) for k in ("kl", "top1", "ppl", "ppl_baseline", "wall_s",
                                                                    "timings_s", "model_dtype", "calibration_dtype",
                                                                    "eval_fingerprint", "exports")},
                **{k: run[k] for k in ("commit", "date", "command")}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ref, indent=1) + "\n")


def _cpu_bf16() -> bool:
    from compress.core.nn import cpu_has_bf16
    return cpu_has_bf16()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="results folder (default $OUT, else bench/results/gpu_recipes)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all runs; a run that would not fit is "
                    "skipped (recorded)")
    ap.add_argument("--models", default="random,embedded", help="random, embedded (comma-separated)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--parts", default="recipes,large", help="recipes, large (comma-separated)")
    ap.add_argument("--dtypes", default="auto", help="model.dtype of the recipe runs: auto (bfloat16 on CUDA, float32 "
                    "on a CPU), float32, bfloat16 (with --reference: what the GPU's dtype alone does, on the CPU)")
    ap.add_argument("--only", help="comma-separated job ids or patterns (e.g. 'random/*/auto,large/*')")
    ap.add_argument("--carry", default=str(CARRY), help="the carried folder (--prepare writes it)")
    ap.add_argument("--work", default=os.environ.get("COMPRESS_GPU_WORK", "/tmp/compress-gpu"),
                    help="scratch folder: built models, outputs (the 7B model takes 14 GB)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny models: the same code, meaningless figures")
    ap.add_argument("--reference", action="store_true", help="compute the CPU references (writes --reference-file)")
    ap.add_argument("--reference-file", default=str(REFERENCE))
    ap.add_argument("--in-process", action="store_true", help="run the jobs in this process (no isolation; tests)")
    ap.add_argument("--prepare", action="store_true", help="write the carried folder (here, not on the GPU)")
    ap.add_argument("--no-wheels", action="store_true", help="--prepare without downloading wheels")
    ap.add_argument("--compact", action="store_true", help="one file in --out, the .json (rewritten after every row; "
                    "it holds the markdown too): for a caller whose $OUT returns few files. The .jsonl and the "
                    "children's log stay in --work")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """The command line; the environment variables a run sets for its jobs (COMPRESS_DATA_DIR, ...) are restored on
    return, so an in-process run (tests) leaves the caller's environment as it found it."""
    saved = dict(os.environ)
    try:
        return _main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu_recipes")
    if args.worker:
        job = json.loads(args.worker)
        print("ROW " + json.dumps(worker(job, out)), flush=True)  # --out: the parent's runs folder
        return 0
    if args.prepare:
        print(json.dumps(prepare(Path(args.carry), wheels=not args.no_wheels), indent=1))
        return 0
    start = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_recipes_dry_run" if args.dry_run else "gpu_recipes"
    logfile = open((work if args.compact else out) / f"{stem}.log", "a")

    def log(msg: str) -> None:
        logfile.write(msg[-LOG_TAIL:] + "\n")  # a child's output: its end (the whole is rarely needed)
        logfile.flush()

    env, sources = environment(args, work, log)
    import torch
    reference = json.loads(Path(args.reference_file).read_text()) if Path(args.reference_file).is_file() else None
    if args.dry_run and args.reference_file == str(REFERENCE):  # tiny models: only a reference given for them
        reference = None
    jobs = plan_jobs(args, sources)
    rows: list[dict] = []
    rows_file = (work if args.compact else out) / f"{stem}.jsonl"
    rows_file.write_text("")
    result = {}
    for job in jobs:
        row = {k: job.get(k) for k in ("id", "kind", "model", "recipe", "dtype", "device")}
        left = args.budget - (time.perf_counter() - start)
        needed = 0.0 if args.dry_run else ESTIMATE_S["large" if job.get("model") == "large" else job["kind"]]
        failed_need = job.get("needs") and not any(r["id"] == job["needs"] and r.get("ok") for r in rows)
        if job.get("missing"):
            row["skipped"] = job["missing"]
        elif failed_need:
            row["skipped"] = f"{job['needs']} did not complete"
        elif left < needed:
            row["skipped"] = f"budget: {max(left, 0):.0f} s left, this run needs about {needed:.0f} s"
        else:
            print(f"{job['id']} ...", flush=True)
            row.update(run_inline(job, work / "runs") if args.in_process else
                       run_child(job, work / "runs", env, max(left, 60.0), log))
        if row.get("model") == "random":
            row["random_sha256"] = sources.get("random:sha256")
        rows.append(row)
        with open(rows_file, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{job['id']}: " + ("skipped: " + row["skipped"] if row.get("skipped") else
                                  f"ok, {row.get('wall_s', row.get('seconds'))} s, KL {row.get('kl')}"
                                  if row.get("ok") else f"FAILED {row.get('error')}"), flush=True)
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit(), "torch": torch.__version__, "argv": argv,
                  "device_name": next((r["gpu"] for r in rows if r.get("gpu")), "no GPU row"),
                  "protocol": list(PROTOCOL), "large_protocol": list(LARGE_PROTOCOL),
                  "random_model": sources.get("random:build"), "wheels": sources.get("wheels"),
                  "reference_note": "none" if reference is None else
                  f"{reference.get('date')}, commit {reference.get('commit')}, {reference.get('machine')}",
                  "rows": rows}
        result["verdicts"] = compare(rows, reference, sources.get("random:sha256"))
        result["markdown"] = render(result)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        if not args.compact:
            (out / f"{stem}.md").write_text(result["markdown"])
        if args.reference:  # after every row: an interrupted reference run keeps what it finished
            write_reference(Path(args.reference_file), rows, sources, argv)
    shutil.rmtree(work / "large", ignore_errors=True)
    attempted = [r for r in rows if not r.get("skipped")]
    print(render(result) if result else "no runs", flush=True)
    return 0 if all(r.get("ok") for r in attempted) else 1


if __name__ == "__main__":
    sys.exit(main())
