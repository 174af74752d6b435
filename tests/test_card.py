"""Model cards (compress/export/card.py) on real runs: the README.md that `compress run` writes in its folder and in
each export, and that `compress export` writes, must be a card the Hub reads (front matter that huggingface_hub
parses, the keys it uses with values it allows) whose metrics table holds the report's own numbers."""
from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, metadata_load

from compress.cli.commands import main
from compress.export.card import CARD, render_card
from tests.card_run import INT4, card_run

# The Hub's base_model_relation values (hub-docs, model-cards.md "Specifying a base model") and the text tasks of its
# pipeline_tag list (huggingface.js packages/tasks/src/pipelines.ts): written out here, not imported from the code
# under test.
HUB_RELATIONS = {"adapter", "merge", "quantized", "finetune"}
HUB_TEXT_TASKS = {"text-generation", "text2text-generation", "text-classification", "fill-mask"}
LIBRARY = {"dense": "transformers", "compressed-tensors": "transformers", "awq": "transformers",
           "gptq": "transformers", "fp8": "transformers", "modelopt-nvfp4": "transformers", "mlx": "mlx",
           "native": "compress"}
FORMAT_TAG = {"compressed-tensors": "compressed-tensors", "awq": "awq", "gptq": "gptq", "fp8": "fp8", "mlx": "mlx",
              "modelopt-nvfp4": "nvfp4"}


def markdown_table(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table after `heading`: (header cells, rows of cells); fails unless every row has the
    header's width and the second line is the |---| separator."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip() for c in ln.strip().strip("|").split("|")])
    header, sep, rows = block[0], block[1], block[2:]
    assert all(re.fullmatch(r":?-{3,}:?", c) for c in sep) and len(sep) == len(header), sep
    assert rows and all(len(r) == len(header) for r in rows), block
    return header, rows


def _expected(label: str, name: str, report: dict):
    """The report value a metrics-table cell must show (None: "not measured")."""
    m = report.get("eval", {}).get("models", {}).get(name, {})
    memory = report.get("memory", {})
    if label.startswith("perplexity"):
        return m.get("ppl")
    if label.startswith("KL"):
        return m.get("kl")
    if label.startswith("top-1"):
        return m.get("top1_agreement")
    if label.startswith("weights in memory"):
        return (m.get("weights") or {}).get("total")
    if label.startswith("checkpoint on disk"):
        return memory.get({"baseline": "baseline_checkpoint_bf16_bytes", "compressed": "checkpoint_bytes"}.get(name))
    if label.startswith(("prefill", "decode")):
        return (m.get("speed") or {}).get(f"{label.split()[0]}_tok_s")
    if label == "lm-eval tasks":
        assert not report.get("eval", {}).get("lm_eval")
        return None
    _, task, metric = label.split()
    return report["eval"]["lm_eval"]["scores"][name][task][metric]["value"]


def validate(path: Path, report: dict, fmt: str, recipe: str, method: str = "rtn") -> dict:
    """Check the card at `path` as the Hub would read it, its metrics against `report` and its recipe block against
    the run's resolved recipe; returns its metadata."""
    card = ModelCard.load(path)  # raises on front matter that is not a YAML mapping
    meta = metadata_load(path)
    assert meta == card.data.to_dict() and card.text.lstrip().startswith("# ")
    assert meta["pipeline_tag"] in HUB_TEXT_TASKS and meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == ("gguf" if fmt.startswith("gguf-") else LIBRARY[fmt])
    tags = meta["tags"]
    assert isinstance(tags, list) and "compress" in tags and method in tags
    assert ("gguf" in tags and fmt[5:] in tags) if fmt.startswith("gguf-") else FORMAT_TAG.get(fmt, "compress") in tags
    if "base_model" in meta:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", meta["base_model"]) and meta["base_model_relation"] in HUB_RELATIONS
    else:
        assert "base_model_relation" not in meta  # a relation to nothing means nothing
    q = meta["quantization"]
    assert q["format"] == fmt and q["recipe_sha256"] == report["recipe"]["sha256"]
    header, rows = markdown_table(card.text, "## Evaluation")
    assert header[1:] == list(report["eval"]["models"])
    for label, *cells in rows:
        for name, cell in zip(header[1:], cells):
            want = _expected(label, name, report)
            if want is None:
                assert cell == "not measured", (label, name, cell)
            elif isinstance(want, int) and not isinstance(want, bool):
                assert int(cell.replace(",", "")) == want, (label, name, cell)
            else:
                assert math.isclose(float(cell.split(" ± ")[0]), want, rel_tol=1e-4, abs_tol=1e-12), \
                    (label, name, cell, want)
    assert f"## Recipe\n\nResolved (every default filled in):\n\n```yaml\n{recipe.rstrip()}\n```" in card.text
    return meta


def _report(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())


def _recipe(run: Path) -> str:
    return (run / "recipe.resolved.yaml").read_text()


def test_a_run_writes_a_valid_card_in_its_folder_and_each_export(card_run_dir):
    report = _report(card_run_dir)
    meta = validate(card_run_dir / CARD, report, "native", _recipe(card_run_dir))
    assert "base_model" not in meta  # the source is a local folder, not a hub id
    assert meta["quantization"]["schemes"] == {"int8-g32-sym": 14} and meta["quantization"]["bits"] == [8]
    assert "8-bit" in meta["tags"]
    for entry in report["exports"]:
        text = (card_run_dir / entry["folder"] / CARD).read_text()
        validate(card_run_dir / entry["folder"] / CARD, report, entry["format"], _recipe(card_run_dir))
        if entry.get("verify"):  # the export's own check, from its report entry
            assert f"KL {entry['verify']['kl']:.5g} nats/token" in text
    gguf = (card_run_dir / "exports" / "gguf-q8_0" / CARD).read_text()
    assert "--hf-repo OWNER/NAME --hf-file model-q8_0.gguf" in gguf and "vllm serve" not in gguf
    ct = (card_run_dir / "exports" / "compressed-tensors" / CARD).read_text()
    assert "vllm serve OWNER/NAME" in ct and "sglang.launch_server" in ct and "AutoModelForCausalLM" in ct
    assert "compress eval model" in (card_run_dir / CARD).read_text()


def test_base_model_and_relation_follow_the_source_and_the_stages(card_run_dir):
    report = _report(card_run_dir)
    hub = copy.deepcopy(report)
    hub["model"].update(source="HuggingFaceTB/SmolLM2-360M", kind="hub")
    meta = metadata_load_text(render_card(hub, "compressed-tensors"))
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-360M" and meta["base_model_relation"] == "quantized"
    cached = copy.deepcopy(report)
    cached["model"]["source"] = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123"
    assert metadata_load_text(render_card(cached, "dense"))["base_model"] == "Qwen/Qwen3-0.6B"
    default = copy.deepcopy(report)
    default["model"]["kind"] = "default"
    assert metadata_load_text(render_card(default, "native"))["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    pruned = copy.deepcopy(hub)
    pruned["stages"].insert(0, {"index": 0, "stage": "prune"})
    meta = metadata_load_text(render_card(pruned, "dense"))
    assert meta["base_model_relation"] == "finetune" and meta["base_model_relation"] in HUB_RELATIONS
    assert "prune" in meta["tags"] and not any(t.endswith("-bit") for t in meta["tags"])  # dense stores floats


def metadata_load_text(text: str) -> dict:
    return ModelCard(text).data.to_dict()


def test_lm_eval_scores_and_missing_figures_reach_the_table(card_run_dir, tmp_path):
    report = _report(card_run_dir)
    report["eval"]["lm_eval"] = {"scores": {
        "baseline": {"arc_easy": {"acc": {"value": 0.4375, "stderr": 0.0312}}},
        "compressed": {"arc_easy": {"acc": {"value": 0.40625, "stderr": 0.0309}}}}}
    del report["eval"]["models"]["compressed"]["speed"]
    recipe = _recipe(card_run_dir)
    (tmp_path / CARD).write_text(render_card(report, "awq", recipe, entry={"loaders": "vLLM, SGLang, transformers"}))
    validate(tmp_path / CARD, report, "awq", recipe)
    header, rows = markdown_table((tmp_path / CARD).read_text(), "## Evaluation")
    assert dict((r[0], r[1:]) for r in rows)["decode tokens/s (batch 1)"][1] == "not measured"


def test_an_mlx_card_names_mlx_lm(card_run_dir, tmp_path):
    """`mlx` is written by another exporter (not registered on this branch): its card is chosen by name."""
    report, recipe = _report(card_run_dir), _recipe(card_run_dir)
    (tmp_path / CARD).write_text(render_card(report, "mlx", recipe))
    meta = validate(tmp_path / CARD, report, "mlx", recipe)
    text = (tmp_path / CARD).read_text()
    assert meta["library_name"] == "mlx" and "mlx" in meta["tags"] and "from mlx_lm import" in text
    assert "vllm" not in text.lower()


def test_compress_export_writes_the_card_of_what_it_exports(card_run_dir, tmp_path, capsys):
    out = tmp_path / "dense"
    assert main(["export", str(card_run_dir), "--format", "dense", "--output", str(out)]) == 0
    meta = validate(out / CARD, _report(card_run_dir), "dense", _recipe(card_run_dir))
    assert meta["library_name"] == "transformers"
    assert (out / "export.json").is_file() and "Not reloaded and compared here" in (out / CARD).read_text()


@pytest.mark.slow
def test_every_format_a_tiny_run_writes_gets_a_valid_card(tmp_path):
    """Each export format, from a run whose scheme it can store (as tests/test_streamed_export.py pairs them)."""
    runs = {"int4": (INT4, ("dense", "gptq", "gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gguf-f16", "gguf-q4_k_m",
                            "gguf-q6_k")),
            "awq": ({**INT4, "symmetric": False}, ("awq", "mlx")),
            "fp8": ({"dtype": "fp8_e4m3", "granularity": "block", "group_size": 16,
                     "act": {"dtype": "fp8_e4m3", "granularity": "token"}}, ("fp8", "compressed-tensors")),
            "nvfp4": ("NVFP4", ("modelopt-nvfp4",))}
    from compress.export import FORMAT_NAMES
    seen = set()
    for name, (scheme, formats) in runs.items():
        run = card_run(tmp_path / name, formats, scheme, measure=False)
        report = _report(run)
        validate(run / CARD, report, "native", _recipe(run))
        for entry in report["exports"]:
            validate(run / entry["folder"] / CARD, report, entry["format"], _recipe(run))
            seen.add(entry["format"])
    assert {f for f in FORMAT_NAMES if not f.startswith("gguf-")} - {"native"} <= seen  # every HF-folder format
