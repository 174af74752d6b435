"""The README's install (`pip install .`, no extras) runs the shipped recipes (tests/plain_install.py): the packages
only an optional extra installs are blocked in a subprocess; and, with -m slow, a fresh virtual environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plain_install import ROOT, extras_only_modules


def rows(out: str) -> dict:
    parsed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r.get("recipe", "compress"): r for r in parsed}


def test_the_extras_hold_only_what_no_shipped_recipe_needs():
    """compressed-tensors (nvfp4.yaml's and mxfp4.yaml's export) is a core dependency; llama-cpp-python (running a
    GGUF file), lm-eval (tasks) and bitsandbytes (a test reference) are extras."""
    modules = extras_only_modules()
    assert {"llama_cpp", "lm_eval", "bitsandbytes"} <= modules
    assert not {"compressed_tensors", "gguf", "transformers", "safetensors"} & modules


def test_every_shipped_export_runs_without_the_extras(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "plain_install.py"), str(tmp_path), "--exports",
                           "--block-extras"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    found = rows(done.stdout)
    assert found["gguf_q4_k_m.yaml"]["exports"]["gguf-q4_k_m"].startswith(
        "not verified: llama-cpp-python is not installed")  # written, and the report says it was not run
    assert found["nvfp4.yaml"]["exports"]["compressed-tensors"].startswith("transformers + compressed-tensors")
    assert found["mxfp4.yaml"]["exports"]["compressed-tensors"].startswith("transformers + compressed-tensors")


@pytest.mark.slow  # a fresh virtual environment: torch from the package index, then `pip install .` (minutes)
def test_pip_install_dot_in_a_fresh_environment_runs_the_shipped_recipes(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)  # the CPU build (.ci/run installs it first too)
    subprocess.run(pip + [str(ROOT), "pytest"], check=True)  # pytest: tests/conftest.py builds the tiny model
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "tests" / "plain_install.py"), str(work),
                           "--inspect", "--exports"], capture_output=True, text=True, cwd=work,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    found = rows(done.stdout)
    assert Path(found["compress"]["compress"]).is_relative_to(venv)  # the installed package ran, not the checkout
    assert {r for r in found if r.endswith(".yaml")} >= {p.name for p in (ROOT / "recipes").glob("*.yaml")}
