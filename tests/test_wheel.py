"""A built wheel, installed into a fresh environment outside the checkout, finds the recipes, calibration presets,
evaluation suites and lm-eval task files it carries, and runs a shipped recipe by its checkout-relative name."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compress.calibrate.data import find_data_dir
from tests.conftest import make_tiny_model, requires_data
from tests.tiny_tokenizer import make_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.png",
                              "results")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(python of a fresh virtual environment holding only the wheel, a working folder outside the checkout). The
    environment sees this one's packages (torch, transformers...) but compress only from the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # the build writes build/ and egg-info: not into the checkout
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(root / "dist"), str(src)], check=True, cwd=root)
    wheel = next((root / "dist").glob("compress-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)], check=True)
    work = root / "work"
    work.mkdir()
    return python, work


def _py(python: Path, work: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, cwd=work).stdout


def test_the_wheel_carries_its_resource_folders(installed):
    python, work = installed
    out = json.loads(_py(python, work, (
        "import json, compress\n"
        "from compress.resources import resource_dir, find_recipe\n"
        "from compress.recipe import calib_presets, eval_suites\n"
        "print(json.dumps({'module': compress.__file__, 'calib': str(resource_dir('calib')),"
        " 'presets': calib_presets(), 'suites': eval_suites(), 'recipe': str(find_recipe('recipes/awq_int4.yaml')),"
        " 'tasks': sorted(p.name for p in (resource_dir('eval') / 'lm_eval').iterdir())}))")))
    venv = str(python.parent.parent)
    assert out["module"].startswith(venv), out["module"]  # the wheel's copy, not this checkout's
    assert out["calib"].startswith(venv) and "_bundled" in out["calib"]
    assert {"wikitext2", "awq-paper", "gptq-paper", "self-generated"} <= set(out["presets"])
    assert {"quick", "standard"} <= set(out["suites"])
    assert out["recipe"].startswith(venv) and out["recipe"].endswith("recipes/awq_int4.yaml")
    assert "adapters.py" in out["tasks"] and "arc_easy.yaml" in out["tasks"]


@requires_data
def test_the_installed_wheel_runs_a_shipped_recipe(installed):
    """recipes/int4_rtn.yaml from outside the checkout: its calibration preset, the quick evaluation suite and
    its lm-eval tasks all come from the wheel (on a tiny model, so the run takes seconds)."""
    python, work = installed
    model = work / "tiny"
    make_tiny_model("llama").save_pretrained(model)
    tok = make_tiny_tokenizer()
    tok.eos_token = "[PAD]"  # lm-eval needs an EOS id
    tok.save_pretrained(model)
    cmd = [str(python), "-m", "compress", "run", "recipes/int4_rtn.yaml", "--no-progress", "--output", "out",
           "--set", f"model={model}", "--set", "stages.0.scheme.group_size=16", "--set", "calibration.n_samples=2",
           "--set", "calibration.seq_len=32", "--set", "eval.suite=quick", "--set", "eval.seq_len=64",
           "--set", "eval.max_windows=1", "--set", "eval.task_limit=2", "--set", "eval.speed=false"]
    env = {**__import__("os").environ, "COMPRESS_DATA_DIR": str(find_data_dir())}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["calibration"]["preset"] == "wikitext2" and report["calibration"]["split"] == "validation"
    assert set(report["eval"]["lm_eval"]["scores"]["compressed"]) == {"arc_easy", "lambada_openai"}
    assert report["stages"][0]["quantized"] == 14
