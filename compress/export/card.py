"""The model card (README.md) of a run folder or an export, in the Hugging Face Hub's conventions: YAML front matter
(base_model, base_model_relation, library_name, pipeline_tag, tags, the quantization details), then what the model
is, how it was made, the measured figures, the recipe and how to load it.

Everything comes from plain dicts: the run's report (report.json, pipeline/report.py), the export's entry in
report["exports"] (format, folder, loaders, bytes, notes, verify) and its export.json record, and the resolved
recipe text. Written by the run (pipeline/source.py, `write_run_cards`) and by `compress export` (`write_export_card`);
`compress push` uploads it (push.py).

Front-matter decisions:
- base_model: the source's hub id. A hub id run (`model: owner/name`) gives it; `default` is SmolLM2-135M-Instruct;
  a local folder or .gguf file is not a hub id and gets no base_model, unless its path is a Hub cache snapshot
  (.../models--owner--name/snapshots/<sha>/), whose id the path spells. The Hub links only hub ids, so a card made
  from a local model says so and leaves the field for its author.
- base_model_relation (only beside base_model; the Hub's values are adapter, merge, quantized, finetune): `finetune`
  when the run pruned or distilled (the weights were retrained or the architecture cut, not only re-encoded),
  otherwise `quantized`.
- library_name: `transformers` for the Hugging Face folder formats (the Hub's own inference from config.json),
  `gguf` for GGUF files (the Hub lists them under library=gguf), `mlx` for MLX, `compress` for the native
  checkpoint (transformers cannot read its packed codes; the Hub would otherwise guess transformers).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

CARD = "README.md"
REPO_PLACEHOLDER = "OWNER/NAME"  # `compress push --repo` writes the repository id in its place
RELATIONS = ("adapter", "merge", "quantized", "finetune")  # the Hub's base_model_relation values
DEFAULT_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"  # `model: default` (model/default_model.py)
RETRAINED = {"prune", "prune_experts", "distill"}  # stages after which the weights are not the base model's re-encoded
FORMAT_TAGS = {"compressed-tensors": ["compressed-tensors"], "awq": ["awq"], "gptq": ["gptq"], "fp8": ["fp8"],
               "modelopt-nvfp4": ["modelopt", "nvfp4"], "mlx": ["mlx"], "native": [], "dense": []}
HF_CACHE = re.compile(r"models--([^/]+)--([^/]+)/snapshots/")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NOT_MEASURED = "not measured"


def base_model(report: dict) -> str | None:
    """The source model's hub id, or None when the run started from a local path (see the module docstring)."""
    model = report.get("model") or {}
    source, kind = str(model.get("source") or ""), model.get("kind")
    if kind == "default":
        return DEFAULT_BASE
    if kind == "hub" and HUB_ID.match(source):
        return source
    if (m := HF_CACHE.search(source.replace("\\", "/"))) is not None:
        return f"{m.group(1)}/{m.group(2)}"
    return None


def relation(report: dict) -> str:
    return "finetune" if any(s.get("stage") in RETRAINED for s in report.get("stages") or ()) else "quantized"


def library_name(fmt: str) -> str:
    if fmt.startswith("gguf-"):
        return "gguf"
    return {"mlx": "mlx", "native": "compress"}.get(fmt, "transformers")


def _bits(scheme: str) -> int | None:
    m = re.match(r"[a-z]*(\d+)", scheme)
    return int(m.group(1)) if m else None


def schemes(report: dict) -> dict[str, int]:
    """Weight scheme name -> number of linear layers stored in it, over the run's quantize stages."""
    out: dict[str, int] = {}
    for s in report.get("stages") or ():
        for scheme in (s.get("layers") or {}).values() if s.get("stage") == "quantize" else ():
            if isinstance(scheme, str) and _bits(scheme) is not None:
                out[scheme] = out.get(scheme, 0) + 1
    return out


def stored_bits(report: dict, fmt: str) -> list[int]:
    """The bit widths the folder's weights are stored in: a GGUF type's, or the run's schemes' (none for dense)."""
    if fmt.startswith("gguf-"):
        qtype = fmt[5:]
        return [16] if qtype == "f16" else [int(qtype[1])]
    if fmt == "dense":
        return []
    return sorted({_bits(s) for s in schemes(report)})


def methods(report: dict) -> list[str]:
    """The run's methods as tags: each quantize stage's method, the other stages by name."""
    out = []
    for s in report.get("stages") or ():
        name = s.get("method") if s.get("stage") == "quantize" else s.get("stage")
        if name and name not in out:
            out.append(str(name))
    return out


def front_matter(report: dict, fmt: str) -> dict:
    base = base_model(report)
    tags = ["compress", *methods(report), *(f"{b}-bit" for b in stored_bits(report, fmt)),
            *(["gguf", fmt[5:]] if fmt.startswith("gguf-") else FORMAT_TAGS.get(fmt, [fmt]))]
    meta: dict = {"base_model": base, "base_model_relation": relation(report)} if base else {}
    meta.update(library_name=library_name(fmt), pipeline_tag="text-generation",
                tags=list(dict.fromkeys(tags)))
    recipe = report.get("recipe") or {}
    meta["quantization"] = {"produced_by": f"compress {report.get('compress_version', '')}".strip(), "format": fmt,
                            "methods": methods(report), "schemes": schemes(report),
                            "bits": stored_bits(report, fmt), "recipe_sha256": recipe.get("sha256") or None}
    return meta


# --- the body ----------------------------------------------------------------------------------------------------

def _g(x) -> str:
    return NOT_MEASURED if x is None else f"{x:.5g}"


def _bytes(n) -> str:
    return NOT_MEASURED if n is None else f"{int(n):,}"


def metric_rows(report: dict) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(model names, rows of (metric, one cell per model)): the figures of report.json's eval section, each printed
    from its value ("not measured" where the report has none)."""
    ev = report.get("eval") or {}
    models = ev.get("models") or {"baseline": {}, "compressed": {}}
    names = list(models)
    memory = report.get("memory") or {}

    def row(label, get):
        return label, [get(n, m) for n, m in models.items()]

    def speed(key):
        return lambda n, m: _g((m.get("speed") or {}).get(key))

    proto = ev.get("protocol")
    where = f"WikiText-2 {proto['split']}, {proto['windows']} × {proto['seq_len']} tokens" if proto else "WikiText-2"
    rows = [row(f"perplexity ({where})", lambda n, m: _g(m.get("ppl"))),
            row("KL to baseline (nats/token)", lambda n, m: _g(m.get("kl"))),
            row("top-1 agreement with baseline", lambda n, m: _g(m.get("top1_agreement"))),
            row("weights in memory (bytes)", lambda n, m: _bytes((m.get("weights") or {}).get("total"))),
            row("checkpoint on disk (bytes; baseline at bf16)", lambda n, m: _bytes(
                memory.get("baseline_checkpoint_bf16_bytes") if n == "baseline" else
                memory.get("checkpoint_bytes") if n == "compressed" else None)),
            row("prefill tokens/s (batch 1)", speed("prefill_tok_s")),
            row("decode tokens/s (batch 1)", speed("decode_tok_s"))]
    lm = ev.get("lm_eval")
    if lm:
        for task, metrics in next(iter(lm["scores"].values())).items():
            for metric in metrics:
                rows.append(row(f"lm-eval {task} {metric}", lambda n, m, t=task, k=metric: _score(lm, n, t, k)))
    else:
        rows.append(row("lm-eval tasks", lambda n, m: NOT_MEASURED))
    return names, rows


def _score(lm: dict, name: str, task: str, metric: str) -> str:
    v = ((lm["scores"].get(name) or {}).get(task) or {}).get(metric)
    if v is None:
        return NOT_MEASURED
    return _g(v["value"]) + (f" ± {v['stderr']:.2g}" if v.get("stderr") is not None else "")


def _metrics_lines(report: dict) -> list[str]:
    names, rows = metric_rows(report)
    ev = report.get("eval") or {}
    proto = ev.get("protocol")
    first_speed = next((m["speed"] for m in (ev.get("models") or {}).values() if m.get("speed")), None)
    lines = ["## Evaluation", "",
             "Measured by the run that made this model (report.json / report.md beside the checkpoint), the baseline "
             "and the compressed model on the same tokens." if ev else
             "The run this folder came from left no report.json here: nothing was measured.", ""]
    if proto:
        lines.append(f"Perplexity over {proto['windows']} window(s) of {proto['seq_len']} tokens of WikiText-2 "
                     f"{proto['split']} ({'limited by max_windows' if proto.get('max_windows') else 'whole split'}), "
                     f"{proto['dtype']}; KL and top-1 agreement of next-token predictions against the baseline.")
    if first_speed:
        lines.append(f"Speed: prefill {first_speed['prefill_tokens']} tokens, {first_speed['decode_tokens']} greedy "
                     f"decode steps, on {first_speed['device']} ({first_speed['threads']} thread(s)): the run's own "
                     "measurement, not a serving engine's.")
    lines += ["", "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return lines


def _export_check_lines(entry: dict | None, fmt: str) -> list[str]:
    if entry is None:
        return []
    v = entry.get("verify") or {}
    lines = ["", f"This folder ({fmt}): {_bytes(entry.get('bytes'))} bytes of weight files."]
    if v:
        lines.append(f"Reloaded with {v['loader']} and compared with the compressed model on {v['positions']} "
                     f"positions of {v.get('text', 'WikiText-2')}: KL {_g(v['kl'])} nats/token, top-1 agreement "
                     f"{_g(v['top1_agreement'])}.")
    else:
        lines.append("Not reloaded and compared here; `compress verify FOLDER` does it.")
    return lines + [f"- note: {n}" for n in entry.get("notes") or ()]


def _made_lines(report: dict, fmt: str, base: str | None, entry: dict | None) -> list[str]:
    model = report.get("model") or {}
    source = model.get("source") or "an unrecorded model"
    lines = ["## How it was made", ""]
    lines.append(f"- source: `{base}`" if base else
                 f"- source: `{source}`, a local {'file' if str(source).endswith('.gguf') else 'folder'}, not a "
                 "Hub id, so the front matter names no base_model: add `base_model: owner/name` if it is one")
    if model.get("family"):
        lines.append(f"- architecture: {model['family']}, {model.get('parameters', 0) / 1e6:.1f}M parameters"
                     + (f" ({model['parameters_after'] / 1e6:.1f}M after)" if model.get("parameters_after")
                        not in (None, model.get("parameters")) else ""))
    cal = report.get("calibration")
    if cal:
        lines.append(f"- calibration: {cal.get('n_samples')} × {cal.get('seq_len')} tokens ({cal.get('kind')}), "
                     f"seed {cal.get('seed')}")
    for s in report.get("stages") or ():
        what = s.get("scheme") or ""
        count = f" on {s['quantized']} linear layers" if s.get("quantized") is not None else ""
        skipped = [k["name"] for k in s.get("skipped") or () if isinstance(k, dict) and "name" in k]
        lines.append(f"- stage {s.get('index', '')}: {s.get('stage')}"
                     + (f" ({s['method']})" if s.get("method") else "") + (f", {what}" if what else "") + count
                     + (f"; kept in float: {', '.join(skipped)}" if skipped else ""))
    layer_schemes = schemes(report)
    if len(layer_schemes) > 1:
        lines.append("- layers per scheme: " + ", ".join(f"{k} × {v}" for k, v in layer_schemes.items()))
    readers = (entry or {}).get("loaders") or READERS.get(fmt)
    lines.append(f"- stored as: {fmt}" + (f" (read by {readers})" if readers else ""))
    rec = report.get("recipe") or {}
    lines.append(f"- made with compress {report.get('compress_version', '?')}"
                 + (f", recipe sha256 `{rec['sha256']}`" if rec.get("sha256") else "")
                 + (f", {report['created']}" if report.get("created") else ""))
    return lines


READERS = {"mlx": "mlx-lm on Apple silicon", "native": "compress"}  # formats without a report entry's `loaders`


# --- how to load it, per format -----------------------------------------------------------------------------------

def _hf_snippets(loaders: str) -> list[str]:
    r = REPO_PLACEHOLDER
    out = []
    if "vLLM" in loaders:
        out += ["vLLM:", "", "```bash", f"vllm serve {r}", "```", "", "```python", "from vllm import LLM", "",
                f'llm = LLM(model="{r}")', 'print(llm.generate("The capital of France is")[0].outputs[0].text)',
                "```", ""]
    if "SGLang" in loaders:
        out += ["SGLang:", "", "```bash", f"python -m sglang.launch_server --model-path {r}", "```", ""]
    if "transformers" in loaders:
        out += ["transformers:", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'tokenizer = AutoTokenizer.from_pretrained("{r}")',
                f'model = AutoModelForCausalLM.from_pretrained("{r}", device_map="auto")',
                'ids = tokenizer("The capital of France is", return_tensors="pt").to(model.device)',
                "print(tokenizer.decode(model.generate(**ids, max_new_tokens=20)[0]))", "```", ""]
    if "TensorRT-LLM" in loaders:
        out += ["TensorRT-LLM reads the checkpoint as well (hf_quant_config.json).", ""]
    return out


def _gguf_snippets(fmt: str, record: dict | None) -> list[str]:
    r, file = REPO_PLACEHOLDER, (record or {}).get("file") or f"model-{fmt[5:]}.gguf"
    return ["llama.cpp:", "", "```bash", f"llama-cli --hf-repo {r} --hf-file {file} -p \"The capital of France is\"",
            f"llama-server --hf-repo {r} --hf-file {file}", "```", "", "llama-cpp-python:", "", "```python",
            "from llama_cpp import Llama", "", f'llm = Llama.from_pretrained(repo_id="{r}", filename="{file}")',
            'print(llm("The capital of France is", max_tokens=20)["choices"][0]["text"])', "```", ""]


def _mlx_snippets() -> list[str]:
    r = REPO_PLACEHOLDER
    return ["mlx-lm (Apple silicon):", "", "```bash", "pip install mlx-lm",
            f'mlx_lm.generate --model {r} --prompt "The capital of France is"', "```", "", "```python",
            "from mlx_lm import generate, load", "", f'model, tokenizer = load("{r}")',
            'print(generate(model, tokenizer, prompt="The capital of France is", max_tokens=20))', "```", ""]


def _native_snippets() -> list[str]:
    r = REPO_PLACEHOLDER
    return ["This is compress's own checkpoint (packed integer codes + compress.json): compress reads it, and "
            "exports it to the serving formats without recomputing.", "", "```bash",
            f"hf download {r} --local-dir model", "compress eval model --max-windows 4",
            "compress export model --format compressed-tensors --format gguf-q8_0", "```", "", "```python",
            "from compress.model.load import load_model", "",
            'loaded = load_model("model")  # loaded.model: a torch module with compress\'s quantized linears',
            "```", ""]


def load_lines(fmt: str, entry: dict | None, record: dict | None) -> list[str]:
    lines = ["## How to load it", "", f"`{REPO_PLACEHOLDER}` is this repository (`compress push` fills it in).", ""]
    if fmt.startswith("gguf-"):
        return lines + _gguf_snippets(fmt, record)
    if fmt == "mlx":
        return lines + _mlx_snippets()
    if fmt == "native":
        return lines + _native_snippets()
    loaders = (entry or {}).get("loaders") or (record or {}).get("loaders") or "vLLM, SGLang, transformers"
    return lines + _hf_snippets(loaders)


def render_card(report: dict, fmt: str, recipe: str | None = None, entry: dict | None = None,
                record: dict | None = None) -> str:
    """README.md for a folder of format `fmt` ("native" for the run folder itself), from the run's report, the
    export's report entry and export.json record (None for the run folder), and the resolved recipe YAML."""
    meta = front_matter(report, fmt)
    base = meta.get("base_model")
    title = f"{base.split('/')[-1] if base else Path(str((report.get('model') or {}).get('source') or 'model')).name}"
    scheme_names = ", ".join(schemes(report)) or "no quantized layers"
    what = {"native": "compress's own checkpoint", "dense": "plain float weights (the compressed values)"}.get(
        fmt, fmt)
    body = [f"# {title} — {fmt} ({scheme_names})", "",
            f"{'A pruned / distilled' if relation(report) == 'finetune' else 'A quantized'} version of "
            + (f"[{base}](https://huggingface.co/{base})" if base else f"`{title}`")
            + f" ({', '.join(methods(report)) or 'no stages'}), stored as {what}. Made with "
              "compress from the recipe below; compress wrote this card from the run's report.", ""]
    body += _made_lines(report, fmt, base, entry) + [""] + _metrics_lines(report) + _export_check_lines(entry, fmt)
    if recipe:
        body += ["", "## Recipe", "", "Resolved (every default filled in):", "", "```yaml", recipe.rstrip("\n"), "```"]
    body += [""] + load_lines(fmt, entry, record)
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + "\n".join(body)


def write_card(folder: str | Path, report: dict, fmt: str, recipe: str | None = None, entry: dict | None = None,
               record: dict | None = None) -> Path:
    path = Path(folder) / CARD
    path.write_text(render_card(report, fmt, recipe, entry, record), encoding="utf-8")
    return path


def write_folder_card(folder: str | Path) -> Path:
    """(Re)write the card of a run folder or an export folder from the files in it and its run's: what `compress
    push --write-card` does for a folder written before compress wrote cards."""
    folder = Path(folder)
    record = _read_json(folder / "export.json")
    if record is not None:  # an export: inside its run (RUN/exports/FORMAT, moved with it), or where it was written
        inside = folder.parent.name == "exports" and (folder.parent.parent / "compress.json").is_file()
        run_dir = folder.parent.parent if inside else Path(record.get("source_model") or folder.parent.parent)
        report = _read_json(run_dir / "report.json") or {}
        entry = next((e for e in report.get("exports") or () if (run_dir / e["folder"]).resolve() == folder.resolve()),
                     None)
        return write_export_card(folder, run_dir, record, (entry or {}).get("verify"))
    if (folder / "compress.json").is_file():
        report = _read_json(folder / "report.json") or {"model": {"source": (_read_json(folder / "compress.json")
                                                                            or {}).get("source")}}
        return write_card(folder, report, "native", _recipe_text(folder))
    raise FileNotFoundError(f"{folder} is neither a compress run folder (compress.json) nor an export (export.json): "
                            "there is nothing to write its card from")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _recipe_text(run_dir: Path) -> str | None:
    path = run_dir / "recipe.resolved.yaml"
    return path.read_text() if path.is_file() else None


def write_run_cards(report: dict, folder: str | Path) -> None:
    """The card of a run folder (its native checkpoint, when the run saved one) and of each export in it."""
    folder = Path(folder)
    recipe = _recipe_text(folder)
    if (folder / "compress.json").is_file():
        write_card(folder, report, "native", recipe)
    for entry in report.get("exports") or ():
        export = folder / entry["folder"]
        write_card(export, report, entry["format"], recipe, entry, _read_json(export / "export.json"))


def write_export_card(out: str | Path, run_dir: str | Path, record: dict, verify: dict | None = None) -> Path:
    """The card of an export that `compress export` wrote from the finished run `run_dir` (its report.json and
    resolved recipe, when it has them)."""
    from ..measure.memory import folder_bytes

    run_dir, out = Path(run_dir), Path(out)
    report = _read_json(run_dir / "report.json") or {"model": {"source": record.get("original_model")}}
    entry = {"format": record["format"], "folder": str(out), "loaders": record.get("loaders", ""),
             "bytes": folder_bytes(out), "notes": record.get("notes") or [], **({"verify": verify} if verify else {})}
    return write_card(out, report, record["format"], _recipe_text(run_dir), entry, record)
