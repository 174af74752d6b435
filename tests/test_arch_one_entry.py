"""A dense family is one entry of compress/arch/tables.py's FAMILIES (issue 47 item 5): Seed-OSS was added through
that entry alone, and these tests show what it switches on: RTN, GPTQ and AWQ with its scaling pairs, a GGUF file
llama.cpp runs with our logits, a rotation that keeps the function, structured pruning on every axis, and the lean
decode loop. Without the entry (monkeypatched away) every one of those is refused, naming the table."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from compress.arch import family_spec, get_arch
from compress.arch.tables import FAMILIES
from compress.arch.tiny import tiny_config, tiny_model
from compress.prune import count_params, minitron_prune
from compress.prune.slicing import prune_layout
from compress.serving.lean_decode import LeanStream, lean_problem
from compress.stages.prune import PruneStage
from compress.transforms.rotation import rotate_model, rotation_problem

FAMILY = "seed_oss"
ROOT = Path(__file__).resolve().parents[1] / "compress"
QUIET = dict(progress=False, log=lambda *_: None)


def seed_oss(seed: int = 0) -> torch.nn.Module:
    """A tiny Seed-OSS as real ones are: grouped heads, a head_dim of its own (not hidden / heads), q/k/v biases
    (random here, so that a dropped or misplaced bias shows)."""
    config = tiny_config(transformers.AutoConfig.for_model(FAMILY), {"num_key_value_heads": 2, "head_dim": 32})
    torch.manual_seed(seed)
    model = tiny_model(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    return model


def ids(n: int = 3, t: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(1))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def test_the_family_is_named_in_its_table_entry_only():
    """Nothing else in compress names the family: the entry is the whole change."""
    where = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if re.search(r"\bseed_oss\b", p.read_text())]
    assert where == ["arch/tables.py"]
    spec = family_spec(seed_oss())
    assert spec.family == FAMILY and spec.lean and spec.gguf.name == "seed_oss" and spec.prune["mlp_out"]


def test_without_the_entry_everything_it_switches_on_is_refused(monkeypatch):
    monkeypatch.delitem(FAMILIES, FAMILY)
    model = seed_oss()
    from compress.export.gguf import gguf_problems
    arch = get_arch(model)
    assert arch.family == f"generic:{FAMILY}"  # still quantized: blocks found, pairs derived
    assert "not one of the lean path's families" in lean_problem(model, 64)
    (refused,) = gguf_problems(model, "f16")
    assert "is not an architecture the GGUF exporter writes" in refused and "qwen3_moe: those whose" in refused
    assert "no rotation entry" in rotation_problem(model, arch)
    with pytest.raises(ValueError, match="add prune= to its FAMILIES entry"):
        prune_layout(model, "mlp")


@pytest.mark.parametrize("method", ["rtn", pytest.param("gptq", marks=pytest.mark.slow), "awq"])
def test_rtn_gptq_awq_run_with_the_entrys_pairs(method, tmp_path):
    """The coverage matrix's run (tests/coverage_families.py) on the family's tiny model: the spec is the entry (not
    derived), every parameter is quantized or listed, and AWQ scales the entry's pairs (v -> o is skipped under
    grouped heads: 6 of 8)."""
    from tests.coverage_families import run_method
    from tests.tiny_tokenizer import word_text
    calib = tmp_path / "calib.txt"
    calib.write_text(word_text(1024) + "\n")
    row = run_method(FAMILY, method, calib)
    assert row.ok, row.reason
    assert row.arch == FAMILY and row.quantized + row.listed == row.params and row.quantized > 0
    assert row.replay_error <= 1e-5
    assert (row.pairs, row.pair_slots) == (6, 8)


def test_gguf_export_runs_in_llama_cpp_with_our_logits(tmp_path):
    """llama.cpp's seed_oss graph: no q/k permutation (NeoX RoPE, as transformers' rotate-half), the q/k/v biases
    in the file, key_length = head_dim."""
    pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    from compress.export.gguf import write_gguf
    from compress.export.gguf_llama_cpp import llama_cpp_logits
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model, x = seed_oss(), ids()
    with torch.no_grad():
        ref = model(input_ids=x, use_cache=False).logits.float()
    for qtype, max_rel in (("f16", 0.005), ("q8_0", 0.03)):  # measured 0.00045 and 0.0115
        path = tmp_path / f"{qtype}.gguf"
        report = write_gguf(model, byte_bpe_tokenizer(), path, qtype)
        out = llama_cpp_logits(path, x)
        assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.98
        assert rel_err(out, ref) < max_rel, (qtype, rel_err(out, ref))
    assert report["arch"] == "seed_oss" and "blk.0.attn_q.bias" in report["tensors"]
    fields = gguf.GGUFReader(str(tmp_path / "f16.gguf")).fields
    assert fields["general.architecture"].contents() == "seed_oss"
    assert fields["seed_oss.attention.key_length"].contents() == 32


def test_rotation_keeps_the_function():
    model = seed_oss().double()
    x = ids(2, 12)
    with torch.no_grad():
        before = model(x).logits
    report = rotate_model(model, get_arch(model), "hadamard", seed=0)
    with torch.no_grad():
        after = model(x).logits
    assert report["linears_rotated"] > 0
    assert float((after - before).abs().max()) < 1e-5 * float(before.abs().max())  # measured 1.7e-7


@pytest.mark.parametrize("stage, key, value", [
    (dict(mlp=0.5), "intermediate", 64), (dict(heads=0.5), "heads", 2), (dict(hidden=0.5), "hidden", 32),
    (dict(depth=0.5), "layers", 1)])
def test_pruning_cuts_every_axis_and_reloads_with_plain_transformers(stage, key, value, tmp_path):
    model = seed_oss()
    report = minitron_prune(model, get_arch(model), ids(6, 24),
                            PruneStage(**{"n_samples": 6, "depth_samples": 3, "multiple_of": 8, **stage}), **QUIET)
    assert report["pruned"][key] == value
    assert report["parameters_after"] == sum(p.numel() for p in model.parameters()) == count_params(model.config)
    x = ids(2, 16)
    with torch.no_grad():
        logits = model(x).logits
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_lean_decode_equals_transformers_across_appends_and_crops():
    model = seed_oss()
    x = ids(1, 40)
    ref = model(x).logits[0]
    assert lean_problem(model, 64) is None
    s = LeanStream(model, max_len=64)
    a = s.forward(x[0, :17].tolist())
    c = s.forward(x[0, 17:25].tolist())
    s.crop(21)
    d = s.forward(x[0, 21:].tolist())
    torch.testing.assert_close(torch.cat([a, c[:4], d]), ref, rtol=1e-4, atol=1e-4)
