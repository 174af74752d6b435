"""tune_scales: the quantized scales trained by distillation with the codes fixed. The gain's gradient against the
hand formula, the exact identity at the start and the stored result at the end, recovery on a tiny model with the
codes untouched, the recipe rules, the memory plan, and a whole `compress run`. `train: [lowrank]`: the eora stage's
low-rank terms trained the same way (in float32, stored back in their dtype), recovering more than their fit."""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import yaml
from torch import nn

from compress.distill.kd import distill
from compress.arch import get_arch
from compress.export.native import load_compressed
from compress.core.nn import QuantLinear, is_linear, linear_weight
from compress.quantizers.rtn import quantize_rtn
from compress.recipe import RecipeError, load_recipe
from compress.distill.scale_tuning import scale_gains, tunable_layers, tuning
from compress.export.adapter import lowrank_layers
from compress.core.scheme import FP8, MXFP4A16, W8A8, QuantScheme
from compress.stages.distill import DistillStage
from compress.stages.tune_scales import TuneScalesStage
from tests.conftest import TINY_CONFIGS, make_tiny_model, run_tiny_recipe

INT3_G32 = QuantScheme("int3", "group", 32, False)
INT4_G32 = QuantScheme("int4", "group", 32, False)
QUIET = dict(progress=False, log=lambda m: None)


def quantize_blocks(model: nn.Module, scheme: QuantScheme) -> nn.Module:
    """A copy of `model` with every linear inside the decoder blocks replaced by its RTN QuantLinear."""
    out = copy.deepcopy(model)
    for block in get_arch(out).block_list(out):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if is_linear(child):
                    qt = quantize_rtn(linear_weight(child).detach(), scheme)
                    setattr(parent, name, QuantLinear.from_module(child, qt))
    return out


def random_ids(rows: int, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def test_gain_gradient_equals_the_hand_formula():
    torch.manual_seed(0)
    layer = QuantLinear.from_module(nn.Linear(64, 8, bias=False),
                                    quantize_rtn(torch.randn(8, 64), INT4_G32))
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    with scale_gains(layer, [""]) as (gain,):
        with torch.no_grad():
            gain.copy_(0.1 * torch.randn(gain.shape))
        ((layer(x) - y) ** 2).sum().backward()
        # by hand: W = (u - z) * s * exp(g) per group; dL/dW = 2 (x Wᵀ - y)ᵀ x; dL/dg = Σ_group dL/dW ⊙ W
        w = layer.qtensor().dequantize().double()  # the parametrized scale: s * exp(g)
        d_w = 2 * (x.double() @ w.T - y.double()).T @ x.double()
        expected = (d_w * w).view(8, 2, 32).sum(-1)
        torch.testing.assert_close(gain.grad.double(), expected, rtol=1e-4, atol=1e-6)


def test_identity_at_the_start_and_the_tuned_scale_stored_in_its_dtype():
    teacher = make_tiny_model("llama")
    student = quantize_blocks(teacher, INT4_G32)
    names, skipped = tunable_layers(student)
    assert len(names) == 14 and not skipped  # 2 blocks × (q, k, v, o, gate, up, down)
    modules = dict(student.named_modules())
    before = {n: (modules[n].qdata.clone(), modules[n].scale.clone(), modules[n].zero_point.clone()) for n in names}
    ids = random_ids(2, 16, 0)
    with torch.no_grad():
        ref = student(ids).logits
    set_to = {}
    with scale_gains(student, names) as gains:
        assert all(p.requires_grad for p in gains)
        assert [p for p in student.parameters() if p.requires_grad] == gains
        with torch.no_grad():
            torch.testing.assert_close(student(ids).logits, ref, rtol=0, atol=0)  # gain 0: exactly the same model
            for n, g in zip(names, gains):
                g.copy_(0.2 * torch.randn(g.shape))
                set_to[n] = (before[n][1].float() * torch.exp(g)).half()
    for n in names:
        m = modules[n]
        assert not hasattr(m, "parametrizations") and "scale" in dict(m.named_buffers())
        assert m.scale.dtype == torch.float16
        torch.testing.assert_close(m.scale, set_to[n], rtol=0, atol=0)
        assert torch.equal(m.qdata, before[n][0]) and torch.equal(m.zero_point, before[n][2])
    assert not any(p.requires_grad for p in student.parameters())


def test_tuning_recovers_most_of_the_kl_with_the_codes_unchanged(tmp_path):
    teacher = make_tiny_model("llama")
    student = quantize_blocks(teacher, INT3_G32)
    names, _ = tunable_layers(student)
    modules = dict(student.named_modules())
    codes = {n: (modules[n].qdata.clone(), modules[n].zero_point.clone(), modules[n].scale.clone()) for n in names}
    cfg = DistillStage(steps=40, batch_size=4, seq_len=32, lr=1e-2, min_lr=1e-3, warmup_steps=0, eval_every=0,
                       checkpoint_every=0)
    with scale_gains(student, names):
        out = distill(student, teacher, random_ids(64, 32, 2), cfg, tmp_path, eval_ids=random_ids(4, 32, 3), **QUIET)
    first, last = out["curve"][0]["kl"], out["curve"][-1]["kl"]
    # measured: KL 0.00051 -> 0.00035 on held-out ids (ratio 0.69; a random tiny model's quantization error is small
    # and noise-like); with the gains left out of the forward the ratio is 1
    assert last < 0.8 * first
    for n in names:
        assert torch.equal(modules[n].qdata, codes[n][0]) and torch.equal(modules[n].zero_point, codes[n][1])
    assert any(not torch.equal(modules[n].scale, codes[n][2]) for n in names)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_starts_exactly_where_quantization_left_it_and_tunes(tmp_path, family):
    teacher = make_tiny_model(family)
    student = quantize_blocks(teacher, INT3_G32)
    names, skipped = tunable_layers(student)
    assert len(names) >= 8 and not skipped
    ids = random_ids(4, 32, 0)
    with torch.no_grad():
        ref = student(ids).logits
    cfg = DistillStage(steps=4, batch_size=2, seq_len=32, lr=1e-2, min_lr=1e-3, warmup_steps=0, eval_every=0,
                       checkpoint_every=0)
    with scale_gains(student, names):
        with torch.no_grad():
            torch.testing.assert_close(student(ids).logits, ref, rtol=0, atol=0)
        out = distill(student, teacher, ids, cfg, tmp_path, eval_ids=ids[:1], **QUIET)
    assert out["steps"] == 4 and out["curve"][-1]["kl"] is not None
    with torch.no_grad():
        assert not torch.equal(student(ids).logits, ref)


def test_activation_quantized_and_microscaled_layers_are_not_tuned_with_the_reason():
    model = nn.Sequential(*(QuantLinear.from_module(nn.Linear(64, 32), quantize_rtn(torch.randn(32, 64), s))
                            for s in (INT4_G32, W8A8, FP8, MXFP4A16)))
    names, skipped = tunable_layers(model)
    assert names == ["0"]
    assert set(skipped) == {"1", "2", "3"}
    assert "activations are quantized" in skipped["1"] and "activations are quantized" in skipped["2"]
    assert "block scales are encoded (e8m0)" in skipped["3"]


QUANTIZE = {"stage": "quantize", "method": "rtn",
            "scheme": {"dtype": "int4", "granularity": "group", "group_size": 64, "symmetric": False}}


@pytest.mark.parametrize("stages,calibration,message", [
    pytest.param([{"stage": "tune_scales"}], "wikitext2",
                 r"`stages\.0` \(tune_scales\) tunes the scales of quantized layers; put a `stage: quantize` before it",
                 id="no-quantize"),
    pytest.param([QUANTIZE, {"stage": "tune_scales"}, {"stage": "kv_cache"}], "wikitext2",
                 r"`stages\.1` \(tune_scales\) runs after the calibration pass, but \['kv_cache'\] come after it",
                 id="not-last"),
    pytest.param([QUANTIZE, {"stage": "tune_scales"}], None, r"`stages\.1` \(tune_scales\) needs calibration data",
                 id="no-calibration"),
    pytest.param([QUANTIZE, {"stage": "tune_scales", "lr": 1e-4, "min_lr": 1e-3}], "wikitext2",
                 r"`stages\.1`: tune_scales min_lr=0\.001, lr=0\.0001", id="bad-lr"),
    pytest.param([QUANTIZE, {"stage": "tune_scales", "steps": 8, "epochs": 2}], "wikitext2",
                 r"`stages\.1`: tune_scales sets both epochs=2 and steps=8; set one of them", id="steps-and-epochs"),
    pytest.param([QUANTIZE, {"stage": "tune_scales", "steps": -3}], "wikitext2",
                 r"`stages\.1`: tune_scales steps=-3; use a positive integer", id="negative-steps"),
    pytest.param([QUANTIZE, {"stage": "tune_scales", "train": ["lowrank"]}], "wikitext2",
                 r"`stages\.1` \(tune_scales\) trains low-rank terms \(train: \[lowrank\]\), but no `stage: eora` "
                 r"before it sets any", id="lowrank-without-eora"),
    pytest.param([QUANTIZE, {"stage": "tune_scales", "train": ["scales", "zero_points"]}], "wikitext2",
                 r"`stages\.1`: tune_scales train=\['scales', 'zero_points'\]; name one or both of "
                 r"\['scales', 'lowrank'\] once", id="unknown-train"),
    pytest.param([QUANTIZE, {"stage": "tune_scales", "train": []}], "wikitext2",
                 r"`stages\.1`: tune_scales train=\[\]", id="empty-train"),
])
def test_recipe_rules(tmp_path, stages, calibration, message):
    data = {"model": "default", "stages": stages}
    if calibration:
        data["calibration"] = calibration
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(RecipeError, match=re.escape(str(path)) + ": " + message):
        load_recipe(path)


def test_steps_replace_the_epochs_count():
    """`steps` sets the optimizer steps (a part of an epoch draws distinct windows: distill's seeded permutation);
    unset, one epoch over 128 windows of 4 is 32."""
    assert TuneScalesStage().training(128, 512).steps == 32
    assert TuneScalesStage(epochs=2).training(128, 512).steps == 64
    assert TuneScalesStage(steps=16).training(128, 512).steps == 16


def test_memory_plan_counts_the_teacher_and_a_streamed_run_refuses_it():
    import transformers

    from compress.pipeline.memory_plan import plan_memory
    from compress.recipe import from_dict
    from compress.pipeline.streamed import stream_blockers

    data = {"model": "default", "calibration": "wikitext2",
            "stages": [QUANTIZE, {"stage": "tune_scales", "batch_size": 2}]}
    recipe = from_dict(data)
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    plan = plan_memory(recipe, config, torch.bfloat16, "cpu", available=1 << 40)
    phase = plan.phases["tune_scales"]
    assert phase["teacher"] == 2 * 6_738_415_616  # the bf16 original beside the compressed model
    checkpointed = plan_memory(from_dict({**data, "stages": [QUANTIZE, {"stage": "tune_scales", "batch_size": 2,
                                                                        "gradient_checkpointing": True}]}),
                               config, torch.bfloat16, "cpu", available=1 << 40).phases["tune_scales"]
    assert checkpointed["dequantized weights"] * 32 == phase["dequantized weights"]
    assert checkpointed["activations"] < phase["activations"] / 4
    assert any("tune_scales" in why for why in stream_blockers(recipe))


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """The same tiny quantization run with and without tune_scales."""
    spec = {"perplexity": True, "max_windows": 2, "seq_len": 64, "speed": False, "split": "test", "samples": 0}
    scheme = {"dtype": "int3", "granularity": "group", "group_size": 32, "symmetric": False}
    plain = run_tiny_recipe(tmp_path_factory.mktemp("plain"), [{**QUANTIZE, "scheme": scheme}], spec)
    tuned = run_tiny_recipe(tmp_path_factory.mktemp("tuned"), [
        {**QUANTIZE, "scheme": scheme},
        {"stage": "tune_scales", "epochs": 10, "batch_size": 2, "lr": 1e-2, "eval_windows": 1, "eval_seq_len": 64}],
        spec)
    return plain, tuned


def test_run_tunes_the_scales_keeps_the_codes_and_reports_it(tiny_runs):
    plain, tuned = tiny_runs
    report = json.loads((tuned / "report.json").read_text())
    section = report["stages"][1]
    assert section["stage"] == "tune_scales" and section["layers"] == 14 and section["steps"] == 20
    assert section["not_tuned"] == {} and section["parameters"] == sum(
        m.scale.numel() for m in load_compressed(tuned).modules() if isinstance(m, QuantLinear))
    assert [p["step"] for p in section["curve"]] == [0, 20]
    assert "tune" in report["timings"]
    a, b = load_compressed(plain), load_compressed(tuned)
    qa = {n: m for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    qb = {n: m for n, m in b.named_modules() if isinstance(m, QuantLinear)}
    assert qa.keys() == qb.keys() and len(qa) == 14
    assert all(torch.equal(qa[n].qdata, qb[n].qdata) and torch.equal(qa[n].zero_point, qb[n].zero_point) for n in qa)
    assert any(not torch.equal(qa[n].scale, qb[n].scale) for n in qa)
    md = (tuned / "report.md").read_text()
    assert "## Stage 1: tune_scales" in md and "14 layers" in md


# ---------------------------------------------------------------- train: [lowrank] (the eora stage's terms)

def with_svd_terms(model: nn.Module, rank: int, dtype: torch.dtype) -> nn.Module:
    """Every block QuantLinear given the plain reference repair: the top-`rank` SVD of its weight error, B = U S,
    A = Vᵀ, stored at `dtype` (what the eora stage does in the unweighted norm)."""
    floats = {n: linear_weight(m).detach().float() for n, m in model.named_modules() if is_linear(m)}
    student = quantize_blocks(model, INT3_G32)
    for name, m in student.named_modules():
        if isinstance(m, QuantLinear):
            u, sv, vh = torch.linalg.svd(floats[name] - m.qtensor().dequantize(), full_matrices=False)
            m.set_lowrank(vh[:rank].contiguous().to(dtype), (u[:, :rank] * sv[:rank]).contiguous().to(dtype))
    return student


def test_lowrank_terms_train_in_float32_and_go_back_to_their_dtype():
    student = with_svd_terms(make_tiny_model("llama"), 4, torch.bfloat16)
    names = list(lowrank_layers(student))
    assert len(names) == 14
    modules = dict(student.named_modules())
    kept = {n: (modules[n].qdata.clone(), modules[n].scale.clone()) for n in names}
    ids = random_ids(2, 16, 0)
    with torch.no_grad():
        ref = student(ids).logits
    with tuning(student, [], names) as params:
        assert len(params) == 28 and all(p.dtype == torch.float32 and p.requires_grad for p in params)
        assert {id(p) for p in student.parameters() if p.requires_grad} == {id(p) for p in params}
        with torch.no_grad():
            torch.testing.assert_close(student(ids).logits, ref, rtol=0, atol=0)  # bf16 -> float32 is exact
            for p in params:
                p.add_(1e-3)
            moved = {n: (modules[n].lora_a.clone(), modules[n].lora_b.clone()) for n in names}
    for n in names:
        m = modules[n]
        assert m.lora_a.dtype == m.lora_b.dtype == torch.bfloat16 and not m.lora_a.requires_grad
        assert torch.equal(m.lora_a, moved[n][0].bfloat16()) and torch.equal(m.lora_b, moved[n][1].bfloat16())
        assert torch.equal(m.qdata, kept[n][0]) and torch.equal(m.scale, kept[n][1])
    assert not any(p.requires_grad for p in student.parameters())


def test_training_the_terms_recovers_more_than_their_fit_and_keeps_the_codes_and_scales(tmp_path):
    teacher = make_tiny_model("llama")
    student = with_svd_terms(teacher, 4, torch.float32)
    names = list(lowrank_layers(student))
    modules = dict(student.named_modules())
    kept = {n: (modules[n].qdata.clone(), modules[n].scale.clone(), modules[n].lora_b.clone()) for n in names}
    # lr 1e-3: the terms' entries are on the tiny model's weight scale (about 0.02); at 1e-2 the KL rises
    cfg = DistillStage(steps=40, batch_size=4, seq_len=32, lr=1e-3, min_lr=1e-4, warmup_steps=0, eval_every=0,
                       checkpoint_every=0)
    with tuning(student, [], names):
        out = distill(student, teacher, random_ids(64, 32, 2), cfg, tmp_path, eval_ids=random_ids(4, 32, 3), **QUIET)
    first, last = out["curve"][0]["kl"], out["curve"][-1]["kl"]
    # measured: held-out KL 3.33e-4 -> 2.55e-4 from the SVD fit (ratio 0.76; a random tiny model's error is
    # noise-like, so the fit is near the best its rank does); the terms left out of the training: distill refuses
    assert last < 0.85 * first, (first, last)
    for n in names:
        assert torch.equal(modules[n].qdata, kept[n][0]) and torch.equal(modules[n].scale, kept[n][1])
    assert all(not torch.equal(modules[n].lora_b, kept[n][2]) for n in names)


def test_memory_plan_counts_the_terms_training():
    import transformers

    from compress.pipeline.memory_plan import model_size, plan_memory
    from compress.recipe import from_dict

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    stages = [QUANTIZE, {"stage": "eora", "rank": 8}, {"stage": "tune_scales", "train": ["scales", "lowrank"]}]
    plan = plan_memory(from_dict({"model": "default", "calibration": "wikitext2", "stages": stages}), config,
                       torch.bfloat16, "cpu", available=1 << 40)
    values = 8 * model_size(config).block_linear_sides
    # a float32 copy of bf16 terms, its gradient and AdamW's two moments
    assert plan.phases["tune_scales"]["low-rank terms' training"] == values * 4 * 4
    scales_only = plan_memory(from_dict({"model": "default", "calibration": "wikitext2",
                                         "stages": stages[:2] + [{"stage": "tune_scales"}]}),
                              config, torch.bfloat16, "cpu", available=1 << 40)
    assert "low-rank terms' training" not in scales_only.phases["tune_scales"]


def test_run_trains_the_eora_terms_and_keeps_the_codes_and_scales(tiny_runs_lowrank):
    plain, tuned = tiny_runs_lowrank
    report = json.loads((tuned / "report.json").read_text())
    section = report["stages"][2]
    assert section["stage"] == "tune_scales" and section["train"] == ["lowrank"]
    assert section["layers"] == 0 and section["parameters"] == 0 and section["lowrank_layers"] == 14
    b = load_compressed(tuned)
    terms = [m for m in b.modules() if isinstance(m, QuantLinear) and m.rank]
    assert section["lowrank_parameters"] == sum(m.lora_a.numel() + m.lora_b.numel() for m in terms)
    # (recovery is asserted on the test above; this tiny run's one held-out window of random-model text is noise)
    a = load_compressed(plain)
    qa = {n: m for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    qb = {n: m for n, m in b.named_modules() if isinstance(m, QuantLinear)}
    assert qa.keys() == qb.keys() and len(qa) == 14
    assert all(torch.equal(qa[n].qdata, qb[n].qdata) and torch.equal(qa[n].scale, qb[n].scale) for n in qa)
    assert all(qa[n].lora_a.shape == qb[n].lora_a.shape and not torch.equal(qa[n].lora_b, qb[n].lora_b) for n in qa)
    md = (tuned / "report.md").read_text()
    assert "tune_scales (the low-rank terms trained by distillation" in md and "14 layers' low-rank terms" in md


@pytest.fixture(scope="module")
def tiny_runs_lowrank(tmp_path_factory):
    """The same tiny GPTQ int3 + eora run with and without the terms trained."""
    spec = {"perplexity": False, "speed": False, "samples": 0}
    stages = [{**QUANTIZE, "method": "gptq", "scheme": {"dtype": "int3", "group_size": 32, "symmetric": False}},
              {"stage": "eora", "rank": 4}]
    plain = run_tiny_recipe(tmp_path_factory.mktemp("plain"), stages, spec)
    tuned = run_tiny_recipe(tmp_path_factory.mktemp("tuned"), stages + [
        {"stage": "tune_scales", "train": ["lowrank"], "epochs": 10, "batch_size": 2, "lr": 1e-3, "eval_windows": 1,
         "eval_seq_len": 64}], spec)
    return plain, tuned
