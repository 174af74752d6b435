"""`compress run | inspect | eval` end to end on a tiny llama saved locally: no network, no shared data
(except `eval`, which needs WikiText-2 and skips without it)."""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from compress.cli.commands import main
from compress.export.native import load_compressed
from compress.core.nn import QuantLinear
from tests.conftest import make_tiny_model, requires_data
from tests.tiny_tokenizer import make_tiny_tokenizer, word_text

N_SAMPLES, SEQ_LEN = 2, 16
LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
OUTPUT_FILES = ["report.json", "report.md", "model.safetensors", "compress.json", "config.json", "recipe.yaml",
                "recipe.resolved.yaml", "tokenizer.json"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama (tied embeddings) + a word-level tokenizer, saved as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(word_text(4 * N_SAMPLES * SEQ_LEN) + "\n")  # one token per word: 4x what is needed
    return path


def _recipe(model_dir: Path, calib_file: Path, out: Path, **stage) -> dict:
    return {
        "model": {"source": str(model_dir), "dtype": "float32", "device": "cpu"},
        "calibration": {"kind": "files", "files": [str(calib_file)], "n_samples": N_SAMPLES, "seq_len": SEQ_LEN},
        "stages": [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16},
                    "ignore": ["lm_head"], **stage}],
        "eval": {"perplexity": False, "speed": True, "prefill_tokens": 8, "decode_tokens": 2, "speed_repeats": 1,
                 "samples": 4},
        "output": {"dir": str(out)},
    }


@pytest.fixture
def recipe_file(tmp_path, model_dir, calib_file) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("# tiny llama, int4 g16\n" + yaml.safe_dump(_recipe(model_dir, calib_file, tmp_path / "out"),
                                                                 sort_keys=False))
    return path


def _run(recipe_file: Path, *extra: str) -> int:
    return main(["run", str(recipe_file), "--no-progress", *extra])


def test_run_writes_a_complete_output_folder(tmp_path, recipe_file, capsys):
    assert _run(recipe_file) == 0
    out = tmp_path / "out"
    assert all((out / name).is_file() for name in OUTPUT_FILES), sorted(p.name for p in out.iterdir())
    assert list(tmp_path.glob(".*.tmp-*")) == []
    assert "# compress report" in capsys.readouterr().out

    report = json.loads((out / "report.json").read_text())
    text = recipe_file.read_text()
    assert report["recipe"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert report["recipe"]["text"] == text
    assert (out / "recipe.yaml").read_text() == text
    assert json.loads((out / "compress.json").read_text())["recipe_sha256"] == report["recipe"]["sha256"]

    cal = report["calibration"]
    assert (cal["kind"], cal["n_samples"], cal["seq_len"], cal["tokens"]) == ("files", N_SAMPLES, SEQ_LEN,
                                                                                N_SAMPLES * SEQ_LEN)
    assert re.fullmatch(r"[0-9a-f]{64}", cal["fingerprint"])

    errors = report["block_errors"]
    assert len(errors) == 2 and all(0 < e < 0.1 for e in errors), errors
    (stage,) = report["stages"]
    assert stage["scheme"] == "int4-g16-sym" and stage["quantized"] == len(LINEARS)
    assert stage["skipped"] == [{"name": "lm_head", "reason": "ignored (ignore: lm_head)"}]
    assert sorted(stage["layers"]) == sorted(LINEARS)

    models = report["eval"]["models"]
    assert set(models) == {"baseline", "compressed"}
    assert "protocol" not in report["eval"] and all("ppl" not in m for m in models.values())
    assert all(m["speed"]["prefill_tokens"] == 8 and m["speed"]["decode_tok_s"] > 0 for m in models.values())
    assert models["compressed"]["weights"]["quantized_over_bf16"] < 0.5  # 4-bit codes + fp16 scale per 16


def test_run_report_md_renders_without_perplexity(tmp_path, recipe_file):
    assert _run(recipe_file) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "None" not in md
    assert "not evaluated (eval.perplexity: false)" in md
    assert "| model | perplexity |" not in md  # no table of dashes
    assert "calibration: 2 × 16 tokens from files (calib.txt)" in md
    assert "| `lm_head` | ignored (ignore: lm_head) |" in md
    assert "## Per-block output error" in md and "## Speed (batch 1)" in md


def test_run_output_loads_back(tmp_path, recipe_file):
    assert _run(recipe_file) == 0
    model = load_compressed(tmp_path / "out")
    assert sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear)) == sorted(LINEARS)


def test_run_without_baseline_or_speed(tmp_path, recipe_file):
    assert _run(recipe_file, "--set", "eval.baseline=false", "--set", "eval.speed=false") == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(report["eval"]["models"]) == ["compressed"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "None" not in md and "## Speed" not in md


def test_second_run_needs_overwrite(tmp_path, recipe_file, capsys):
    assert _run(recipe_file) == 0
    capsys.readouterr()
    assert _run(recipe_file) == 2
    err = capsys.readouterr().err
    assert "compress run: error: output folder" in err and "--overwrite" in err

    assert _run(recipe_file, "--overwrite", "--set", "stages.0.scheme.group_size=32") == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["stages"][0]["scheme"] == "int4-g32-sym"  # the folder was replaced
    assert report["recipe"]["overrides"] == ["stages.0.scheme.group_size=32", "output.overwrite=true"]
    assert list(tmp_path.glob(".*.tmp-*")) == []


def test_run_output_flag(tmp_path, recipe_file):
    assert _run(recipe_file, "--output", str(tmp_path / "elsewhere")) == 0
    assert (tmp_path / "elsewhere" / "report.json").is_file()
    assert not (tmp_path / "out").exists()


def test_strict_group_size_error_leaves_nothing(tmp_path, model_dir, calib_file, capsys):
    path = tmp_path / "g48.yaml"
    path.write_text(yaml.safe_dump(_recipe(model_dir, calib_file, tmp_path / "out",
                                           scheme={"dtype": "int4", "group_size": 48})))
    assert _run(path) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_proj: in_features=64 is not divisible by group_size=48" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g48.yaml"]


def test_inspect_lists_every_linear(recipe_file, capsys):
    assert main(["inspect", str(recipe_file)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in LINEARS:
        (line,) = [ln for ln in lines if ln.split()[:1] == [name]]
        assert line.rstrip().endswith("int4-g16-sym"), line
    (head,) = [ln for ln in lines if ln.split()[:1] == ["lm_head"]]
    assert re.search(r"256×64\s+float  \(ignored \(ignore: lm_head\)\)$", head), head
    assert "14 layers quantized, 1 left in float" in out
    assert "calibration: 2 × 16 tokens, kind files, seed 0" in out


def test_inspect_json(recipe_file, capsys):
    assert main(["inspect", str(recipe_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["arch"]["blocks"] == "model.layers"
    (layers,) = plan["stages"]
    assert {e["name"]: e["scheme"] for e in layers} == {**{n: "int4-g16-sym" for n in LINEARS}, "lm_head": None}
    assert [e["reason"] for e in layers if e["name"] == "lm_head"] == ["ignored (ignore: lm_head)"]


def test_run_refuses_an_auto_precision_budget_below_its_menu_before_measuring(tmp_path, model_dir, calib_file, capsys):
    recipe = _recipe(model_dir, calib_file, tmp_path / "out", method="gptq")
    recipe["stages"].insert(0, {"stage": "auto_precision", "menu": ["W8A16"], "bits_per_weight": 6, "n_samples": 1})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 2
    err = capsys.readouterr().err
    assert "stage 0 (auto_precision): the budget of" in err and "below the smallest the menu allows" in err
    assert "fisher sensitivity of" not in err


def test_run_refuses_an_auto_precision_menu_an_export_cannot_hold_before_measuring(tmp_path, model_dir, calib_file,
                                                                                  capsys):
    """The quantize stage's own scheme (int4) exports to GPTQ; the int5 its auto_precision menu offers would not,
    and is only chosen at run time: refused before the sensitivity pass, naming the menu entry."""
    recipe = _recipe(model_dir, calib_file, tmp_path / "out", method="gptq")
    menu = [{"dtype": "int8", "granularity": "channel"}, {"dtype": "int5", "group_size": 16, "symmetric": False}]
    recipe["stages"].insert(0, {"stage": "auto_precision", "menu": menu, "bits_per_weight": 6, "n_samples": 1})
    recipe["output"]["formats"] = ["gptq"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 2
    err = capsys.readouterr().err
    assert "cannot export to gptq: `stages.0` (auto_precision) may give layers int5-g16-asym" in err
    assert "remove it from that menu" in err and "fisher sensitivity of" not in err and "calibrating" not in err
    assert not (tmp_path / "out").exists()
    menu[1]["dtype"] = "int4"  # int8 and int4: GPTQ holds each, but one scheme per checkpoint
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 2
    err = capsys.readouterr().err
    assert "gives layers different schemes of its menu, and a gptq checkpoint cannot mix them" in err
    assert "calibrating" not in err and not (tmp_path / "out").exists()
    recipe["output"].update(formats=["compressed-tensors"], verify_windows=0)  # one config group per scheme
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 0


@requires_data
def test_eval_against_baseline(tmp_path, recipe_file, model_dir, capsys):
    assert _run(recipe_file) == 0
    capsys.readouterr()
    report_dir = tmp_path / "eval"
    argv = ["eval", str(tmp_path / "out"), "--baseline", str(model_dir), "--no-speed", "--seq-len", "64",
            "--max-windows", "2", "--no-progress", "--output", str(report_dir)]
    assert main(argv) == 0
    assert "# compress report" in capsys.readouterr().out
    report = json.loads((report_dir / "report.json").read_text())
    assert report["model"] == {"source": str(tmp_path / "out"), "kind": "compressed"}
    ev = report["eval"]
    assert (ev["protocol"]["windows"], ev["protocol"]["seq_len"]) == (2, 64)
    base, quant = ev["models"]["baseline"], ev["models"]["model"]
    assert base["tokens"] == quant["tokens"] == 2 * 63
    assert all(math.isfinite(m["ppl"]) and m["ppl"] > 1 for m in (base, quant))
    assert base["kl"] == 0 and base["top1_agreement"] == 1
    assert quant["kl"] > 0 and 0 <= quant["top1_agreement"] <= 1
    assert all("speed" not in m for m in (base, quant))
    md = (report_dir / "report.md").read_text()
    assert "None" not in md and "| model |" in md


def _lm_eval_model(tmp_path, model_dir) -> Path:
    """The tiny llama with an EOS token, which lm-eval needs (the tiny word-level tokenizer has none)."""
    pytest.importorskip("lm_eval")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.eos_token = "[PAD]"
    tok.save_pretrained(tmp_path / "model")
    make_tiny_model("llama").save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.slow  # 27 s of lm-eval tasks; the default suite scores lm-eval through `compress eval` and `run` too
@requires_data
def test_eval_suite_with_flags_over_it(tmp_path, model_dir, capsys):
    """--suite quick brings its tasks and settings; flags given on the command line win."""
    model_dir = _lm_eval_model(tmp_path, model_dir)
    report_dir = tmp_path / "eval"
    argv = ["eval", str(model_dir), "--suite", "quick", "--no-speed", "--seq-len", "64", "--max-windows", "1",
            "--task-limit", "2", "--no-progress", "--output", str(report_dir)]
    assert main(argv) == 0
    ev = json.loads((report_dir / "report.json").read_text())["eval"]
    assert (ev["protocol"]["windows"], ev["protocol"]["seq_len"]) == (1, 64)
    assert sorted(ev["lm_eval"]["tasks"]) == ["arc_easy", "lambada_openai"]  # from eval/quick.yaml
    assert "speed" not in ev["models"]["model"]
    assert main(["eval", str(model_dir), "--suite", "nosuch"]) == 2
    assert "evaluation suite 'nosuch' not found" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "eval", "inspect", "export", "verify", "report", "speculate", "plan",
                                     "push", "generate"])
def test_subcommand_help_shows_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: compress {command}" in out
    assert "examples:" in out and f"  compress {command} " in out


def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: compress" in out and "{run,eval,inspect,export,verify,report,speculate,draft-head,plan,push,generate}" in out


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_bad_recipe_key_exits_2_naming_the_key(tmp_path, model_dir, calib_file, command, capsys):
    data = _recipe(model_dir, calib_file, tmp_path / "out")
    data["stages"][0]["group_szie"] = 32
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"compress {command}: error: {path}: unknown key `stages.0.group_szie`" in err
    assert not (tmp_path / "out").exists()


def test_bad_set_override_exits_2(recipe_file, capsys):
    assert main(["inspect", str(recipe_file), "--set", "stages.3.method=rtn"]) == 2
    assert "--set stages.3: `3` is not an index of a list of 1 items" in capsys.readouterr().err


def test_inspect_shows_awq_pairs_and_skips(tmp_path, model_dir, calib_file, capsys):
    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["stages"] = [{"stage": "awq", "n_grid": 3}] + recipe["stages"]
    path = tmp_path / "awq.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "stage 0: awq for int4-g16-sym" in out
    assert re.search(r"input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj\s+scaled", out)
    assert re.search(r"self_attn.v_proj -> self_attn.o_proj\s+skipped: .*grouped-query attention", out)
    assert re.search(r"mlp.up_proj -> mlp.down_proj\s+scaled", out)


def test_run_with_awq_and_gptq_reports_pairs(tmp_path, model_dir, calib_file):
    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["stages"] = [{"stage": "awq", "n_grid": 3, "search_samples": 1},
                        {**recipe["stages"][0], "method": "gptq"}]
    path = tmp_path / "awq_gptq.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["awq", "quantize"]
    assert len(report["stages"][0]["blocks"]) == 2 and len(report["stages"][0]["blocks"][0]["pairs"]) == 4
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Stage 0: awq" in md and "grouped-query attention" in md
    # the pairs AWQ could not scale are in the report's summary (its header), not only in its stage section
    header = md.split("\n## ")[0]
    assert "- **AWQ: clipping only on 2 of 8 scaling pairs, because: `self_attn.v_proj -> self_attn.o_proj`: " \
           "self_attn.v_proj has 32 outputs but self_attn.o_proj read [64] (grouped-query attention) (2 blocks)**" \
           in header
    reloaded = load_compressed(tmp_path / "out")
    assert sum(isinstance(m, QuantLinear) for m in reloaded.modules()) == len(LINEARS)


def _run_stages(tmp_path, model_dir, calib_file, stages, **model) -> dict:
    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["stages"] = stages
    recipe["model"].update(model)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    return json.loads((tmp_path / "out" / "report.json").read_text())


def test_run_smoothquant_gptq_static_w8a8(tmp_path, model_dir, calib_file):
    report = _run_stages(tmp_path, model_dir, calib_file, [
        {"stage": "smoothquant", "alpha_grid": [0.4, 0.6], "search_samples": 1},
        {"stage": "quantize", "method": "gptq", "scheme": "W8A8_STATIC"}])
    sq, q = report["stages"]
    assert sq["stage"] == "smoothquant" and len(sq["blocks"]) == 2
    assert all(v["input_scale"] > 0 for v in q["layer_info"].values()) and len(q["layer_info"]) == len(LINEARS)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Stage 0: smoothquant (alpha searched over [0.4, 0.6])" in md and "static input scale" in md
    reloaded = load_compressed(tmp_path / "out")
    assert all(float(m.input_scale) > 0 for m in reloaded.modules() if isinstance(m, QuantLinear))


def test_run_fp8_with_kv_cache_scales(tmp_path, model_dir, calib_file):
    report = _run_stages(tmp_path, model_dir, calib_file, [
        {"stage": "quantize", "scheme": "FP8"}, {"stage": "kv_cache", "dtype": "fp8_e4m3"}])
    kv = report["stages"][1]["layers"]
    assert sorted(kv) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(v["k_scale"] > 0 and v["v_scale"] > 0 for v in kv.values())
    assert "## Stage 1: kv_cache (fp8_e4m3)" in (tmp_path / "out" / "report.md").read_text()
    meta = json.loads((tmp_path / "out" / "compress.json").read_text())
    assert sorted(meta["kv_cache"]) == sorted(kv)


def test_run_llm_int8_on_planted_outliers_counts_outlier_features(tmp_path, model_dir, calib_file):
    report = _run_stages(tmp_path, model_dir, calib_file, [{"stage": "quantize", "scheme": "LLM_INT8_STATIC"}],
                         plant_outliers={"channels": 3, "factor": 60.0})
    assert len(report["model"]["planted_outliers"]["channels"]) == 3
    info = report["stages"][0]["layer_info"]
    assert info["model.layers.1.self_attn.q_proj"]["outlier_features_calibration"] >= 3
    md = (tmp_path / "out" / "report.md").read_text()
    assert "LLM.int8 outlier features" in md
    reloaded = load_compressed(tmp_path / "out")
    assert reloaded.model.layers[1].mlp.up_proj.outlier_cols.numel() >= 3


def test_inspect_shows_smoothquant_pairs_kv_and_kernels(tmp_path, model_dir, calib_file, capsys):
    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["stages"] = [{"stage": "smoothquant"}, {"stage": "quantize", "scheme": "W8A8"}, {"stage": "kv_cache"}]
    path = tmp_path / "sq.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "stage 0: smoothquant, alpha 0.5" in out and "[int8 _int_mm]" in out
    assert "stage 2: kv_cache fp8_e4m3" in out and "self_attn" in out


# ---------------------------------------------------------------- prune + distill (Minitron)

def _minitron_recipe(model_dir: Path, calib_file: Path, out: Path, *more_stages, **distill) -> dict:
    recipe = _recipe(model_dir, calib_file, out)
    recipe["stages"] = [
        {"stage": "prune", "mlp": 0.5, "n_samples": 2, "seq_len": SEQ_LEN, "multiple_of": 8},
        {"stage": "distill", "steps": 4, "batch_size": 2, "seq_len": SEQ_LEN, "warmup_steps": 1, "eval_every": 2,
         "checkpoint_every": 2, "eval_windows": 0, "data": {"kind": "files", "files": [str(calib_file)]}, **distill},
        *more_stages]
    return recipe


def test_prune_distill_output_loads_with_plain_transformers(tmp_path, model_dir, calib_file):
    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    prune, distill = report["stages"]
    assert prune["pruned"]["intermediate"] == 64 and prune["parameter_ratio"] < 0.8
    assert distill["steps"] == 4 and distill["tokens"] == 4 * 2 * SEQ_LEN and len(distill["curve"]) == 3
    assert report["model"]["parameters_after"] == prune["parameters_after"]
    assert not (tmp_path / "out.work").exists()  # checkpoints are removed once the run has finished
    import transformers
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # no compress code involved
    assert plain.config.intermediate_size == 64 and plain.model.layers[0].mlp.down_proj.in_features == 64
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Stage 0: prune (Minitron; axes: mlp)" in md and "| MLP channels | 128 | 64 |" in md
    assert "## Stage 1: distill" in md


def test_prune_distill_then_quantize_evaluates_before_and_after(tmp_path, model_dir, calib_file):
    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out",
                              {"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16},
                               "ignore": ["lm_head"]})
    recipe["eval"] = {"perplexity": False, "speed": False, "samples": 0}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(report["eval"]["models"]) == ["baseline", "pruned", "compressed"]
    assert report["stages"][2]["quantized"] == len(LINEARS)
    reloaded = load_compressed(tmp_path / "out")
    assert reloaded.model.layers[1].mlp.down_proj.in_features == 64
    assert isinstance(reloaded.model.layers[1].mlp.down_proj, QuantLinear)


def test_inspect_shows_the_pruned_shape_and_plans_on_it(tmp_path, model_dir, calib_file, capsys):
    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out",
                              {"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16}})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "stage 0: prune (Minitron), axes mlp:" in out and "MLP 128 -> 2 blocks, hidden 64, 4q/2kv heads, MLP 64" in out
    assert "stage 1: distill from the original: 4 steps" in out
    assert "model.layers.0.mlp.down_proj" in out and "64×64" in out  # down_proj planned at its pruned width


def test_resume_without_a_checkpoint_exits_2_naming_the_folder(tmp_path, model_dir, calib_file, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_minitron_recipe(model_dir, calib_file, tmp_path / "out"), sort_keys=False))
    assert main(["run", str(path), "--no-progress", "--resume"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


@requires_data
def test_distill_recovery_curve_is_plotted(tmp_path, model_dir, calib_file):
    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out", eval_windows=1, eval_seq_len=32)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 0
    curve = json.loads((tmp_path / "out" / "report.json").read_text())["stages"][1]["curve"]
    assert [p["step"] for p in curve] == [0, 2, 4] and all(p["ppl"] > 1 and p["kl"] >= 0 for p in curve)
    png = (tmp_path / "out" / "recovery_curve_stage1.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![recovery curve](recovery_curve_stage1.png)" in (tmp_path / "out" / "report.md").read_text()


def test_accelerate_launch_runs_the_recipe_on_two_processes(tmp_path, model_dir, calib_file):
    """`accelerate launch` with two CPU processes (DDP over gloo): both distill, only rank 0 writes the output.
    accelerate's `--cpu` launcher starts one process unless MPI is set up, so `--multi_gpu` with no visible GPU
    is the way to get torchrun's two processes on CPU."""
    import os
    import socket
    import subprocess
    import sys

    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out", batch_size=1)
    recipe["eval"] = {"perplexity": False, "speed": False, "samples": 0}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "--main_process_port", str(port), "-m", "compress", "run", str(path), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    distill = json.loads((tmp_path / "out" / "report.json").read_text())["stages"][1]
    assert distill["processes"] == 2 and distill["tokens"] == 4 * 1 * 2 * SEQ_LEN  # steps × batch × processes


def test_a_plan_that_fails_on_the_pruned_shapes_fails_before_distillation(tmp_path, model_dir, calib_file, capsys):
    # group 64 divides every layer of the original (64, 128 wide) but not the pruned MLP (96): the plan is made on a
    # meta model of the pruned shape before any pruning or training, so nothing is spent and nothing is left behind
    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out",
                              {"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 64}})
    recipe["stages"][0]["mlp"] = 0.75
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--no-progress"]) == 2
    assert "mlp.down_proj: in_features=96 is not divisible by group_size=64" in capsys.readouterr().err
    assert not (tmp_path / "out.work").exists() and not (tmp_path / "out").exists()


def test_a_run_that_fails_after_distillation_resumes_from_its_checkpoint(tmp_path, model_dir, calib_file, capsys,
                                                                        monkeypatch):
    import compress.pipeline.source

    recipe = _minitron_recipe(model_dir, calib_file, tmp_path / "out",
                              {"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 32}})
    recipe["stages"][0]["mlp"] = 0.75
    recipe["eval"] = {"perplexity": False, "speed": False, "samples": 0}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    def crash(*_args, **_kwargs):  # the process dies in the calibration pass, after distillation
        raise RuntimeError("simulated crash after distillation")

    with monkeypatch.context() as patch:
        patch.setattr(compress.pipeline.source, "compress_model", crash)
        assert main(["run", str(path), "--no-progress"]) == 2
    assert "simulated crash" in capsys.readouterr().err
    checkpoints = tmp_path / "out.work" / "distill-1" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000004"]
    assert not (tmp_path / "out").exists()
    assert main(["run", str(path), "--no-progress", "--resume"]) == 0
    distill = json.loads((tmp_path / "out" / "report.json").read_text())["stages"][1]
    assert distill["resumed_from"] == 4 and distill["steps"] == 4
    assert not (tmp_path / "out.work").exists()


def test_run_exports_each_format_and_verifies_it(tmp_path, model_dir, calib_file):
    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["output"].update(formats=["compressed-tensors", "dense"], verify_windows=2)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [e["format"] for e in report["exports"]] == ["compressed-tensors", "dense"]
    for e in report["exports"]:
        record = json.loads((tmp_path / "out" / e["folder"] / "export.json").read_text())
        # the run's provenance: the original model as given (not the model object), the checkpoint beside it
        assert record["original_model"] == report["model"]["source"] == str(model_dir)
        assert record["source_model"] == str((tmp_path / "out").resolve())
        assert record["recipe_sha256"] == report["recipe"]["sha256"]
        assert e["verify"]["kl"] < 1e-3 and e["verify"]["top1_agreement"] > 0.99, e
    assert "## Exports" in (tmp_path / "out" / "report.md").read_text()


def test_run_refuses_an_impossible_export_before_calibrating(tmp_path, model_dir, calib_file, capsys):
    recipe = _recipe(model_dir, calib_file, tmp_path / "out", scheme={"dtype": "int3", "group_size": 16})
    recipe["output"]["formats"] = ["gptq"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 2
    err = capsys.readouterr().err
    assert "cannot export to gptq" in err and "calibrating" not in err
    assert not (tmp_path / "out").exists()


@requires_data
def test_export_and_verify_commands_on_a_finished_run(tmp_path, recipe_file, capsys):
    assert _run(recipe_file) == 0
    out = tmp_path / "out"
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["export", str(out), "--format", "awq", "--format", "gptq", "--verify", "--windows", "1",
                 "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    assert "awq: wrote" in printed and "gptq: loaded with compress reader" in printed
    assert (out / "model.safetensors").read_bytes() == before  # the run is never modified
    assert main(["export", str(out), "--format", "awq"]) == 2  # exists: needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["verify", str(out / "exports" / "awq"), "--windows", "1", "--seq-len", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["format"] == "awq" and result["kl"] < 1e-3 and result["top1_agreement"] > 0.99


def test_report_predicts_serving_on_the_accelerators_asked_for(tmp_path, model_dir, calib_file):
    from compress.serving.roofline import ACCELERATORS, decode, model_facts

    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["eval"].update(accelerators=["H100-SXM", "RTX-4090"], roofline_context=256, roofline_batches=[1, 8])
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 0
    models = json.loads((tmp_path / "out" / "report.json").read_text())["eval"]["models"]
    base, comp = models["baseline"]["roofline"][0], models["compressed"]["roofline"][0]
    assert [r["accelerator"]["name"] for r in models["compressed"]["roofline"]] == ["H100-SXM", "RTX-4090"]
    assert comp["weight_bytes"] == models["compressed"]["weights"]["serving_bf16"] < base["weight_bytes"]
    expect = decode(model_facts(load_compressed(tmp_path / "out").config, comp["weight_bytes"]),
                    ACCELERATORS["H100-SXM"], 8, 256)
    assert comp["decode"]["8"]["tokens_per_s"] == pytest.approx(expect["tokens_per_s"])
    assert comp["decode"]["1"]["tokens_per_s"] > base["decode"]["1"]["tokens_per_s"]  # fewer bytes per token
    assert "## Roofline predictions" in (tmp_path / "out" / "report.md").read_text()


@requires_data
def test_run_scores_lm_eval_tasks_for_baseline_and_compressed(tmp_path, model_dir, calib_file):
    recipe = _recipe(_lm_eval_model(tmp_path, model_dir), calib_file, tmp_path / "out")
    recipe["eval"].update(tasks=["lambada_openai"], task_limit=3, speed=False)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 0
    lm = json.loads((tmp_path / "out" / "report.json").read_text())["eval"]["lm_eval"]
    assert set(lm["scores"]) == {"baseline", "compressed"} and lm["limit"] == 3
    d = lm["vs_baseline"]["compressed"]["lambada_openai"]["acc"]
    assert d["stderr"] is not None and d["within_noise"] == (abs(d["delta"]) < 2 * d["stderr"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## lm-eval tasks" in md and "| lambada_openai | perplexity |" in md and "± standard error" in md
    assert "%)" not in md.split("## lm-eval tasks")[1].split("##")[0]  # no ratio of two noisy scores
    assert main(["report", str(tmp_path / "out"), "--output", str(tmp_path / "rep")]) == 0
    row = json.loads((tmp_path / "rep" / "report.json").read_text())["runs"][1]
    acc = lm["scores"]["compressed"]["lambada_openai"]["acc"]
    assert row["lm_eval_acc"] == acc["value"] and row["lm_eval_acc_stderr"] == pytest.approx(acc["stderr"])
    assert f"{acc['value']:.3f} ± {acc['stderr']:.3f} (1 tasks)" in (tmp_path / "rep" / "report.md").read_text()


def test_speed_sweep_over_batch_and_context_skips_what_does_not_fit(tmp_path, model_dir, calib_file):
    from compress.measure.speed import speed_sweep, sweep_bytes

    recipe = _recipe(model_dir, calib_file, tmp_path / "out")
    recipe["eval"].update(speed_batches=[1, 4], speed_contexts=[8, 16], decode_tokens=2, speed_repeats=1)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert _run(path) == 0
    sweep = json.loads((tmp_path / "out" / "report.json").read_text())["eval"]["models"]["compressed"]["speed_sweep"]
    assert [(p["batch"], p["prefill_tokens"]) for p in sweep] == [(1, 8), (4, 8), (1, 16), (4, 16)]
    assert all(p["prefill_tok_s"] > 0 and p["decode_tok_s"] > 0 and "dequantize" in p["kernel"] for p in sweep)
    assert "## Speed sweep" in (tmp_path / "out" / "report.md").read_text()
    model = make_tiny_model("llama")
    points = speed_sweep(model, 256, [1, 64], [16], decode_tokens=1, repeats=1, budget=sweep_bytes(model, 8, 16))
    assert "skipped" not in points[0] and "half the free memory" in points[1]["skipped"]


@requires_data
def test_report_puts_runs_side_by_side_with_the_frontier(tmp_path, model_dir, calib_file, capsys):
    for name, sch in (("int4", {"dtype": "int4", "group_size": 16}), ("int8", {"dtype": "int8", "granularity": "channel"})):
        recipe = _recipe(model_dir, calib_file, tmp_path / name, scheme=sch)
        recipe["eval"].update(perplexity=True, max_windows=1, seq_len=32, speed_repeats=1)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        assert _run(path) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "int4"), str(tmp_path / "int8"), "--output", str(tmp_path / "rep")]) == 0
    page = capsys.readouterr().out
    result = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [r["run"] for r in result["runs"]] == ["baseline", "int4", "int8"]
    int4, int8 = result["runs"][1], result["runs"][2]
    assert int4["weight_bytes"] < int8["weight_bytes"] < result["runs"][0]["weight_bytes"]
    assert "int4" in result["frontier"]["pareto_memory.png"]  # the smallest is always on the memory frontier
    for png in ("pareto_memory.png", "pareto_speed_measured.png", "pareto_speed_predicted.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 1000 and f"![{png}]" in page


def _run_and_export(recipe_file: Path, out: Path, fmt: str) -> Path:
    """Run the tiny recipe, export it as `fmt`, and give the export's tokenizer the EOS id lm-eval needs (the tiny
    word-level tokenizer has none). Returns the export folder."""
    from transformers import AutoTokenizer

    assert _run(recipe_file) == 0
    assert main(["export", str(out), "--format", fmt]) == 0
    export = out / "exports" / fmt
    tok = AutoTokenizer.from_pretrained(export)
    tok.eos_token = "[PAD]"
    tok.save_pretrained(export)
    return export


@requires_data
def test_eval_scores_an_exported_checkpoint_on_lm_eval_tasks(tmp_path, recipe_file, capsys):
    pytest.importorskip("lm_eval")
    out = tmp_path / "out"
    export = _run_and_export(recipe_file, out, "compressed-tensors")
    capsys.readouterr()
    assert main(["eval", str(export), "--baseline", str(out), "--no-speed", "--max-windows", "1", "--seq-len", "32",
                 "--tasks", "lambada_openai", "--task-limit", "2", "--output", str(tmp_path / "ev")]) == 0
    lm = json.loads((tmp_path / "ev" / "report.json").read_text())["eval"]["lm_eval"]
    assert lm["limit"] == 2 and set(lm["scores"]) == {"baseline", "model"}
    assert lm["recovery"]["model"]["lambada_openai"]["perplexity"] == pytest.approx(1, rel=0.05)  # same weights


@pytest.mark.slow  # 22 s: the embedded model through accelerate's disk offload (bench/large_models.py --offload-eval runs it at 7B)
@requires_data
def test_eval_offloads_a_model_to_disk_with_the_same_figures(tmp_path, recipe_file, capsys):
    """`compress eval --offload GB`: accelerate's device_map keeps (here all) modules on disk; perplexity, KL and
    lm-eval equal the resident evaluation's, weights are still counted, speed is a short run labelled offloaded; a compress
    checkpoint is refused with the way out (export it first)."""
    pytest.importorskip("lm_eval")
    out = tmp_path / "out"
    export = _run_and_export(recipe_file, out, "dense")
    reports = {}
    # the export is bfloat16: resident at that dtype, offloaded at the checkpoint's own (10 kB: every module on disk)
    for name, extra in (("resident", ["--dtype", "bfloat16"]), ("offloaded", ["--offload", "0.00001"])):
        assert main(["eval", str(export), "--baseline", str(export), "--max-windows", "2", "--seq-len", "32",
                     "--tasks", "lambada_openai", "--task-limit", "2", "--output", str(tmp_path / name),
                     "--no-progress", *extra]) == 0
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())["eval"]
    resident, offloaded = reports["resident"], reports["offloaded"]
    for n in ("baseline", "model"):
        assert offloaded["models"][n]["ppl"] == pytest.approx(resident["models"][n]["ppl"], rel=1e-6)
        assert offloaded["models"][n]["weights"]["total"] == resident["models"][n]["weights"]["total"] > 0
        speed = offloaded["models"][n]["speed"]  # a short run through the offloaded modules, labelled
        assert speed["offloaded_modules"] == offloaded["models"][n]["offloaded"]["modules_on_disk"]
        assert speed["decode_tok_s"] > 0 and (speed["prefill_tokens"], speed["decode_tokens"]) == (32, 4)
        assert "offloaded_modules" not in resident["models"][n]["speed"]
        assert offloaded["models"][n]["offloaded"]["modules_on_disk"] >= 1
    assert offloaded["models"]["model"]["kl"] == pytest.approx(0, abs=1e-9)
    assert offloaded["lm_eval"]["scores"] == resident["lm_eval"]["scores"]
    md = (tmp_path / "offloaded" / "report.md").read_text()
    assert "## Offloaded to disk" in md and "(disk offload: " in md and "time the disk" in md
    assert "offloaded to disk" in offloaded["samples"]["skipped"] and len(resident["samples"]["prompts"]) == 3
    capsys.readouterr()
    assert main(["eval", str(out), "--offload", "1", "--no-speed", "--max-windows", "1", "--seq-len", "32"]) == 2
    assert "compress export DIR --format dense" in capsys.readouterr().err
