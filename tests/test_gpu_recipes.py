"""bench/gpu_recipes.py runs `compress run` on CUDA once per GPU session, with no chance to fix it there: its dry run
takes the same code on the CPU (tiny models, the same jobs, rows and results files), and what it decides (the
random model's bits, the comparison with the CPU references, the carried model's halves) is checked here."""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import requires_data

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_recipes.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_recipes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gr = _load()


def _sha(fields) -> str:
    digest = hashlib.sha256()
    for name, t in gr.random_tensors(fields):
        gr.digest_tensor(digest, name, t)
    return digest.hexdigest()


def test_the_random_model_is_the_same_bits_on_every_machine():
    """The GPU run compares its KL with a CPU run of the same random weights: numpy's frozen legacy RandomState per
    tensor name, whatever the dict order or the machine. Pinned: a change of the generator fails here, not there."""
    assert _sha(gr.TINY) == _sha(gr.TINY) == \
        "5e39f4086b9928bca7ea01481361782e59ff2ad3904448d3a55593205fb0c8f6"
    tensors = dict(gr.random_tensors(gr.TINY))
    assert "lm_head.weight" not in tensors  # tied: the embedding is the head
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    assert abs(float(w.std()) - gr.RANDOM_STD) < 0.002 and float(w.abs().max()) <= gr.RANDOM_STD * 3 ** 0.5
    assert float(tensors["model.norm.weight"].min()) == 1.0


@pytest.mark.slow  # 135M values: ~12 s
def test_the_committed_reference_was_computed_on_these_bits():
    reference = json.loads(gr.REFERENCE.read_text())
    assert reference["models"]["random"]["sha256"] == _sha(gr.SMOLLM2)
    assert all(r["protocol"] == list(gr.PROTOCOL) for r in reference["rows"].values())


def _rows(**over):
    row = {"id": "random/awq_int4/auto", "kind": "recipe", "model": "random", "recipe": "awq_int4", "dtype": "auto",
           "ok": True, "kl": 0.105, "wall_s": 30.0}
    return [{**row, **over}]


def test_each_recipe_is_compared_with_its_cpu_run_within_ten_percent():
    ref = {"models": {"random": {"sha256": "abc"}},
           "rows": {"random/awq_int4": {"kl": 0.1, "protocol": list(gr.PROTOCOL)}}}
    rows = _rows()
    verdicts = gr.compare(rows, ref, "abc")
    assert rows[0]["kl_vs_cpu"] == pytest.approx(1.05) and rows[0]["within_10pct"]
    assert verdicts["kl_within_10pct_of_cpu_auto"] == "1/1" and verdicts["recipes_completed"].startswith("1/1")
    assert "kl_cpu_bfloat16" not in rows[0]
    ref["rows"]["random/awq_int4/bfloat16"] = {"kl": 0.104, "protocol": list(gr.PROTOCOL)}  # shown beside it
    rows = _rows()
    gr.compare(rows, ref, "abc")
    assert rows[0]["kl_cpu_bfloat16"] == 0.104 and rows[0]["kl_cpu"] == 0.1
    assert "(bf16 0.10400)" in gr.render({"device_name": "x", "date": "d", "commit": "c", "torch": "t",
                                          "rows": [{**rows[0], "peak_rss_bytes": 1}], "verdicts": {}})
    rows = _rows(kl=0.111)
    gr.compare(rows, ref, "abc")
    assert not rows[0]["within_10pct"]
    rows = _rows()  # another random model, or another protocol: no verdict, and the row says why
    gr.compare(rows, ref, "other")
    assert "within_10pct" not in rows[0] and "differ" in rows[0]["vs_cpu"]
    ref["rows"]["random/awq_int4"]["protocol"] = ["calibration.n_samples=64"]
    rows = _rows()
    gr.compare(rows, ref, "abc")
    assert "within_10pct" not in rows[0] and "protocol" in rows[0]["vs_cpu"]
    rows = _rows(id="embedded/awq_int4/auto", model="embedded", wall_s=61.0)
    verdicts = gr.compare(rows, ref, "abc")
    assert verdicts["embedded/awq_int4/auto <= 60 s"] is False and "no CPU reference" in rows[0]["vs_cpu"]


def test_the_embedded_model_is_joined_from_its_two_halves_and_checked(tmp_path, monkeypatch):
    import compress.model.default_model as dm

    blob = bytes(range(256)) * 1000
    (tmp_path / "gguf.part1").write_bytes(blob[:1000])
    assert gr.join_gguf(tmp_path, tmp_path / "work") is None  # one half: no embedded model, not an error
    (tmp_path / "gguf.part2").write_bytes(blob[1000:])
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(blob).hexdigest())
    joined = gr.join_gguf(tmp_path, tmp_path / "work")
    assert joined.name == dm.GGUF_NAME and joined.read_bytes() == blob
    (tmp_path / "gguf.part2").write_bytes(blob[1001:])  # a half cut short: refused, naming the fix
    joined.unlink()
    with pytest.raises(ValueError, match="--prepare"):
        gr.join_gguf(tmp_path, tmp_path / "work")


def _dry_run(tmp_path, *extra) -> tuple[int, dict]:
    out, work = tmp_path / "out", tmp_path / "work"
    rc = gr.main(["--dry-run", "--out", str(out), "--work", str(work), *extra])
    result = json.loads((out / "gpu_recipes_dry_run.json").read_text())
    where = work if "--compact" in extra else out  # --compact: the .json alone comes back
    assert sorted(p.name for p in out.iterdir()) == (["gpu_recipes_dry_run.json"] if "--compact" in extra else
                                                     [f"gpu_recipes_dry_run.{e}" for e in ("json", "jsonl", "log", "md")])
    lines = (where / "gpu_recipes_dry_run.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [r["id"] for r in result["rows"]]
    assert "| run | ok |" in result["markdown"]
    return rc, result


@requires_data
def test_dry_run_takes_every_recipe_and_the_large_model_through_compress_run(tmp_path):
    rc, result = _dry_run(tmp_path, "--in-process")
    rows = {r["id"]: r for r in result["rows"]}
    assert rc == 0
    for recipe in gr.RECIPES:
        r = rows[f"random/{recipe}/auto"]
        assert r["ok"] and r["kl"] > 0 and r["ppl"] > 1 and r["device"] == "cpu" and r["peak_rss_bytes"] > 0
        assert {"load", "compress", "eval"} <= set(r["timings_s"]) and r["random_sha256"] == _sha(gr.TINY)
        assert r["vs_cpu"].startswith("no CPU reference")  # a dry run compares with nothing but a given file
    assert [e["format"] for e in rows["random/nvfp4/auto"]["exports"]] == ["compressed-tensors", "modelopt-nvfp4"]
    assert all(e["verify_kl"] is not None for e in rows["random/nvfp4/auto"]["exports"])
    assert rows["embedded/awq_int4/auto"]["skipped"] == "a dry run has no embedded model"
    build, resident, streamed = (rows[k] for k in ("large/build", "large/gptq_int4/resident",
                                                   "large/gptq_int4/streamed"))
    assert build["ok"] and build["bytes_on_disk"] > 0 and build["parameters"] > 0
    assert resident["ok"] and streamed["ok"] and streamed["streamed"] and not resident["streamed"]
    assert resident["kl"] == streamed["kl"] and resident["ppl"] == streamed["ppl"]  # the same run, bit for bit
    assert result["verdicts"]["large streamed == resident (KL, perplexity)"] is True
    assert result["verdicts"]["recipes_completed"] == "5/5 attempted (5 skipped)"
    assert not (tmp_path / "work" / "large").exists()  # the large model is removed after its runs


@requires_data
def test_a_budget_skips_what_does_not_fit_and_says_so(tmp_path):
    rc, result = _dry_run(tmp_path, "--in-process", "--budget", "0", "--models", "random", "--recipes", "fp8_dynamic",
                          "--compact")
    skipped = {r["id"]: r["skipped"] for r in result["rows"]}
    assert rc == 0 and skipped["random/fp8_dynamic/auto"].startswith("budget: 0 s left")
    assert skipped["large/build"].startswith("budget") and skipped["large/gptq_int4/resident"] == \
        "large/build did not complete"


@requires_data
@pytest.mark.slow  # every job in its own process, as on the GPU: ~90 s
def test_dry_run_in_child_processes(tmp_path):
    rc, result = _dry_run(tmp_path)
    assert rc == 0 and all(r["ok"] for r in result["rows"] if not r.get("skipped"))
    assert all(r["process_s"] >= r.get("wall_s", 0) for r in result["rows"] if r.get("ok"))


@requires_data
def test_an_in_process_run_leaves_the_environment_as_it_found_it(tmp_path, monkeypatch):
    """The jobs' COMPRESS_DATA_DIR (a cut-down data folder in a dry run) must not outlive the run: later evaluations
    in the same process would read that folder (found when the suite's lm-eval tests ran after this file)."""
    monkeypatch.delenv("COMPRESS_DATA_DIR", raising=False)
    before = dict(__import__("os").environ)
    _dry_run(tmp_path, "--in-process", "--budget", "0", "--models", "random", "--recipes", "fp8_dynamic", "--compact")
    assert dict(__import__("os").environ) == before
