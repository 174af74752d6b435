"""Recipe validation: every key checked, errors naming the key and the file, `--set` overrides, plans."""
from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import pytest
import transformers
import yaml

from compress.arch import get_arch
from compress.stages.quantize import plan_quantize
from compress.recipe import RecipeError, from_dict, load_recipe
from compress.resources import resource_dir
from compress.core.scheme import PRESETS, W4A16_G64
from tests.conftest import make_tiny_model

RECIPES = sorted(resource_dir("recipes").glob("*.yaml"))

BASE = {
    "model": "default",
    "stages": [{"stage": "quantize", "method": "rtn",
                "scheme": {"dtype": "int4", "granularity": "group", "group_size": 64, "symmetric": True}}],
}


def _write(tmp_path: Path, data: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _with(**changes) -> dict:
    data = copy.deepcopy(BASE)
    data.update(changes)
    return data


def _stage(**fields) -> dict:
    return {"stage": "quantize", **fields}


def _plan(model, **stage_fields):
    """The plan for `model` under a quantize stage built through recipe validation."""
    recipe = from_dict({"model": "default", "stages": [_stage(**stage_fields)]})
    return plan_quantize(model, get_arch(model), recipe.stages[0])


def _by_name(plan) -> dict:
    return {e.name: e for e in plan.layers}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_load(path):
    recipe = load_recipe(path)
    assert recipe.path == str(path)
    assert len(recipe.stages) >= 1
    assert all(st.scheme.bits in (3, 4, 8) for st in recipe.stages if getattr(st, "scheme", None) is not None)
    assert recipe.output.dir.startswith("runs/")


def test_shipped_recipes_exist():
    assert {p.name for p in RECIPES} >= {"int4_rtn.yaml", "int8_absmax.yaml", "int8_zeropoint.yaml", "awq_int4.yaml",
                                         "gptq_int4.yaml", "awq_gptq_int4.yaml", "awq_int3.yaml", "llm_int8.yaml",
                                         "smoothquant_w8a8.yaml", "fp8_dynamic.yaml", "fp8_static_kv.yaml"}


def test_static_schemes_need_calibration(tmp_path):
    for name in ("W8A8_STATIC", "FP8", "LLM_INT8_STATIC"):
        with pytest.raises(RecipeError, match="needs calibration data"):
            load_recipe(_write(tmp_path, _with(stages=[_stage(scheme=name)])))
    assert load_recipe(_write(tmp_path, _with(stages=[_stage(scheme="FP8_DYNAMIC")]))).calibration is None


def test_nested_activation_scheme_mapping(tmp_path):
    stage = _stage(scheme={"dtype": "int8", "granularity": "channel", "scale_dtype": "float32",
                           "act": {"dtype": "int8", "granularity": "token", "outlier_threshold": 4.0}})
    recipe = load_recipe(_write(tmp_path, _with(stages=[stage])))
    assert recipe.stages[0].scheme.act.outlier_threshold == 4.0
    with pytest.raises(RecipeError, match=r"stages\.0\.scheme\.act\.granularity"):
        load_recipe(_write(tmp_path, _with(stages=[_stage(scheme={"dtype": "int8", "granularity": "channel",
                                                                   "act": {"granularity": "row"}})])))


def test_set_plant_outliers_on_a_string_model(tmp_path):
    path = _write(tmp_path, _with())
    recipe = load_recipe(path, ["model.plant_outliers={channels: 2, factor: 30}"])
    assert recipe.model.source == "default" and recipe.model.plant_outliers.channels == 2


def test_channel_scheme_mapping_without_group_size_loads():
    recipe = from_dict(_with(stages=[_stage(scheme={"dtype": "int8", "granularity": "channel"})]))
    assert recipe.stages[0].scheme.granularity == "channel"
    assert recipe.stages[0].scheme.group_size is None


BAD = [
    pytest.param(_with(quantise=[]), r"unknown top-level key `quantise`", id="unknown-top-level-key"),
    pytest.param(_with(stages=[_stage(group_szie=64)]), r"unknown key `stages\.0\.group_szie`",
                 id="unknown-stage-key"),
    pytest.param(_with(stages=[_stage(), {"stage": "sparsify"}]), r"`stages\.1\.stage` is 'sparsify'; known stages",
                 id="unknown-stage"),
    pytest.param(_with(stages=[_stage(), {"stage": "prune", "mlp": 0.5}]),
                 r"`stages\.1` \(prune\) must come before the quantization stages", id="prune-after-quantize"),
    pytest.param(_with(stages=[{"stage": "distill"}]), r"`stages\.0` \(distill\) repairs a pruned model.*"
                 r"put a `stage: prune` before it", id="distill-without-prune"),
    pytest.param(_with(stages=[{"stage": "prune"}]), r"`stages\.0`: prune needs exactly one of", id="prune-no-target"),
    pytest.param(_with(stages=[{"stage": "prune", "mlp": 0.5, "axes": ["width"]}]), r"`stages\.0`: prune.axes: unknown axis 'width'",
                 id="prune-bad-axis"),
    pytest.param(_with(stages=[{"stage": "prune", "mlp": 0.5}, {"stage": "distill", "warmup_steps": 500}]),
                 r"`stages\.1`: distill warmup_steps=500 >= steps=100", id="distill-bad-warmup"),
    pytest.param(_with(stages=[_stage(scheme={"dtype": "int9"})]),
                 r"`stages\.0\.scheme\.dtype` is 'int9'; allowed values: 'int8', 'int7'", id="bad-dtype"),
    pytest.param(_with(calibration={"kind": "files", "n_samples": "many"}),
                 r"`calibration\.n_samples` must be an integer, got 'many'", id="wrong-type"),
    pytest.param(_with(eval={"speed": "yes"}), r"`eval\.speed` must be true or false", id="wrong-bool"),
    pytest.param({"stages": BASE["stages"]}, r"missing `model:`", id="missing-model"),
    pytest.param(_with(stages=[]), r"`stages` must be a non-empty list", id="no-stages"),
    pytest.param(_with(stages=[_stage(method="magic")]), r"`stages\.0`: unknown quantization method 'magic'",
                 id="unknown-method"),
    pytest.param(_with(model={"source": "default", "device": 0}), r"`model\.device` must be a string",
                 id="model-field-type"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_bad_recipe_names_key_and_file(tmp_path, data, message):
    path = _write(tmp_path, data, "bad.yaml")
    with pytest.raises(RecipeError, match=re.escape(str(path)) + ": " + message):
        load_recipe(path)


def test_from_dict_names_the_given_file():
    with pytest.raises(RecipeError, match=r"^my/recipe\.yaml: unknown top-level key `bogus`"):
        from_dict(_with(bogus=1), "my/recipe.yaml")


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match=r"nope\.yaml does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match=re.escape(str(path)) + ": not valid YAML"):
        load_recipe(path)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_scheme_preset_string(tmp_path, name):
    calibration = {"kind": "self", "n_samples": 1, "seq_len": 8}  # static schemes calibrate their input scales
    recipe = load_recipe(_write(tmp_path, _with(stages=[_stage(scheme=name)], calibration=calibration)))
    assert recipe.stages[0].scheme == PRESETS[name]


def test_unknown_preset_lists_known_ones(tmp_path):
    path = _write(tmp_path, _with(stages=[_stage(scheme="W5A16")]))
    known = re.escape(str(sorted(PRESETS)))
    with pytest.raises(RecipeError, match=re.escape(str(path)) + r": `stages\.0\.scheme`: unknown scheme preset "
                                          r"'W5A16'; known presets: " + known):
        load_recipe(path)


def test_set_group_size_on_mapping_scheme(tmp_path):
    path = _write(tmp_path, BASE)
    recipe = load_recipe(path, ["stages.0.scheme.group_size=32"])
    assert recipe.stages[0].scheme.group_size == 32
    assert recipe.stages[0].scheme.dtype == "int4"
    assert recipe.overrides == ("stages.0.scheme.group_size=32",)
    assert load_recipe(path).stages[0].scheme.group_size == 64  # the file itself is unchanged


def test_set_group_size_on_preset_string_scheme(tmp_path):
    path = _write(tmp_path, _with(stages=[_stage(scheme="W4A16_G64")]))
    sch = load_recipe(path, ["stages.0.scheme.group_size=32"]).stages[0].scheme
    assert sch.group_size == 32
    assert (sch.dtype, sch.granularity, sch.symmetric) == (W4A16_G64.dtype, W4A16_G64.granularity,
                                                           W4A16_G64.symmetric)


def test_set_model_on_mapping_model_sets_source(tmp_path):
    path = _write(tmp_path, _with(model={"source": "default", "dtype": "float32"}))
    recipe = load_recipe(path, ["model=foo/bar"])
    assert recipe.model.source == "foo/bar"
    assert recipe.model.dtype == "float32"


def test_set_model_on_string_model(tmp_path):
    recipe = load_recipe(_write(tmp_path, BASE), ["model=foo/bar"])
    assert recipe.model.source == "foo/bar"


def test_set_creates_a_missing_section(tmp_path):
    recipe = load_recipe(_write(tmp_path, BASE), ["eval.max_windows=4", "output.overwrite=true"])
    assert recipe.eval.max_windows == 4
    assert recipe.output.overwrite is True


def test_set_bad_index(tmp_path):
    path = _write(tmp_path, BASE)
    with pytest.raises(RecipeError, match=r"--set stages\.5: `5` is not an index of a list of 1 items in "
                                          + re.escape(str(path))):
        load_recipe(path, ["stages.5.method=rtn"])


def test_set_one_past_the_end_appends_a_stage(tmp_path):
    data = _with(calibration="wikitext2")
    recipe = load_recipe(_write(tmp_path, data), ["stages.1.stage=tune_scales", "stages.1.epochs=2"])
    assert [s.name for s in recipe.stages] == ["quantize", "tune_scales"] and recipe.stages[1].epochs == 2
    with pytest.raises(RecipeError, match=r"--set stages\.2: `2` is not an index of a list of 1 items in .* \(index 1 "
                                          r"appends an item\)"):
        load_recipe(_write(tmp_path, data), ["stages.2.stage=tune_scales"])


def test_a_number_without_a_dot_reads_as_a_number(tmp_path):
    data = _with(calibration="wikitext2")
    data["stages"] = [*data["stages"], {"stage": "tune_scales", "lr": "3e-3"}]  # what YAML makes of `lr: 3e-3`
    recipe = load_recipe(_write(tmp_path, data), ["stages.1.min_lr=1e-4"])
    assert recipe.stages[1].lr == 0.003 and recipe.stages[1].min_lr == 0.0001
    with pytest.raises(RecipeError, match=r"`stages\.1\.lr` must be a number, got 'fast'"):
        load_recipe(_write(tmp_path, data), ["stages.1.lr=fast"])


def test_set_without_equals(tmp_path):
    with pytest.raises(RecipeError, match=r"expected KEY=VALUE"):
        load_recipe(_write(tmp_path, BASE), ["stages.0.method"])


def test_set_value_is_still_validated(tmp_path):
    path = _write(tmp_path, BASE)
    with pytest.raises(RecipeError, match=re.escape(str(path)) + r": `stages\.0\.scheme\.dtype` is 'int9'"):
        load_recipe(path, ["stages.0.scheme.dtype=int9"])


def test_non_divisible_group_size_strict_names_layer_and_divisors():
    model = make_tiny_model("llama")  # hidden 64: 64 % 48 != 0
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: in_features=64 is not divisible "
                                         r"by group_size=48; group sizes that divide it: \[16, 32, 64\]"):
        _plan(model, scheme={"dtype": "int4", "group_size": 48})


def test_non_divisible_group_size_lenient_skips_with_reason():
    model = make_tiny_model("llama")
    plan = _plan(model, scheme={"dtype": "int4", "group_size": 48}, strict=False)
    layers = _by_name(plan)
    assert plan.quantized == []
    assert layers["model.layers.0.self_attn.q_proj"].reason == \
        "in_features=64 % group_size=48 != 0 (strict: false)"
    assert layers["model.layers.1.mlp.down_proj"].reason == "in_features=128 % group_size=48 != 0 (strict: false)"
    assert "lm_head" in layers["lm_head"].reason


def test_mixed_divisibility_lenient_keeps_the_divisible_layers():
    model = make_tiny_model("llama")  # in_features 64 (q/k/v/o/gate/up) and 128 (down_proj)
    plan = _plan(model, scheme={"dtype": "int4", "group_size": 128}, strict=False)
    assert {e.name for e in plan.quantized} == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}


def test_regex_ignore_leaves_layers_in_float_with_pattern():
    plan = _plan(make_tiny_model("llama"), scheme="W8A16", ignore=["lm_head", r"re:.*mlp\..*"])
    layers = _by_name(plan)
    mlp = [n for n in layers if ".mlp." in n]
    assert len(mlp) == 6
    for name in mlp:
        assert layers[name].scheme is None
        assert layers[name].reason == r"ignored (ignore: re:.*mlp\..*)"
    assert {e.name for e in plan.quantized} == {n for n in layers if ".self_attn." in n}


def test_regex_targets_match_from_the_start_of_the_name():
    plan = _plan(make_tiny_model("llama"), scheme="W8A16", targets=[r"re:model\.layers\.1\."])
    assert {e.name for e in plan.quantized} == {n for n in _by_name(plan) if n.startswith("model.layers.1.")}
    # `re:self_attn` does not match names that only contain it: patterns are anchored at the start
    assert _plan(make_tiny_model("llama"), scheme="W8A16", targets=["re:self_attn"]).quantized == []


def test_class_name_targets():
    model = make_tiny_model("gpt2")  # blocks use transformers' Conv1D, lm_head is nn.Linear
    conv = _plan(model, scheme="W8A16", targets=["Conv1D"], ignore=[])
    assert {e.kind for e in conv.quantized} == {"Conv1D"} and len(conv.quantized) == 8
    assert _by_name(conv)["lm_head"].reason == "not matched by targets ['Conv1D']"
    linear = _plan(model, scheme="W8A16", targets=["Linear"], ignore=[])
    assert linear.quantized == []  # only lm_head is an nn.Linear, and it is tied to the embedding
    assert "tie_word_embeddings" in _by_name(linear)["lm_head"].reason


def test_plain_name_target():
    plan = _plan(make_tiny_model("llama"), scheme="W8A16", targets=["model.layers.0.mlp.down_proj"])
    assert [e.name for e in plan.quantized] == ["model.layers.0.mlp.down_proj"]


@pytest.mark.parametrize("family", ["gpt_neox", "llama", "opt"])
def test_lm_head_alias(family):
    model = make_tiny_model(family)
    plan = _plan(model, scheme="W8A16", ignore=["lm_head"])
    head = get_arch(model).lm_head
    assert _by_name(plan)[head].reason == "ignored (ignore: lm_head)"
    assert len(plan.quantized) == len(plan.layers) - 1


def test_lm_head_alias_on_a_differently_named_head():
    # BioGPT calls its output projection `output_projection` and is found by the generic arch fallback
    config = transformers.BioGptConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert get_arch(model).lm_head == "output_projection"
    plan = _plan(model, scheme="W8A16", ignore=["lm_head"])
    assert [(e.name, e.reason) for e in plan.skipped] == [("output_projection", "ignored (ignore: lm_head)")]


def test_recipe_sha256_is_the_file_text(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("# a comment is part of the hash\n" + yaml.safe_dump(BASE))
    recipe = load_recipe(path)
    assert recipe.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert recipe.text == path.read_text()
    assert load_recipe(path, ["stages.0.scheme.group_size=32"]).sha256 == recipe.sha256


def test_recipe_sha256_changes_with_the_text(tmp_path):
    a = load_recipe(_write(tmp_path, BASE, "a.yaml"))
    b = load_recipe(_write(tmp_path, _with(stages=[_stage(scheme="W4A16_G64")]), "b.yaml"))
    assert a.sha256 != b.sha256 and len(a.sha256) == 64


def test_resolved_yaml_round_trips(tmp_path):
    recipe = load_recipe(_write(tmp_path, _with(stages=[_stage(scheme="W8A16")])))
    again = from_dict(yaml.safe_load(recipe.resolved_yaml()))
    assert again.stages == recipe.stages
    assert (again.model, again.eval, again.output) == (recipe.model, recipe.eval, recipe.output)


def test_eval_suite_fills_the_eval_section_and_recipe_keys_win():
    from compress.recipe import from_dict
    stages = [{"stage": "quantize", "scheme": "W8A16"}]
    quick = from_dict({"model": "default", "stages": stages, "eval": {"suite": "quick", "max_windows": 2}})
    assert quick.eval.tasks == ("arc_easy", "lambada_openai") and quick.eval.task_limit == 20
    assert quick.eval.max_windows == 2 and quick.eval.seq_len == 1024
    standard = from_dict({"model": "default", "stages": stages, "eval": "standard"})
    assert len(standard.eval.tasks) == 7 and standard.eval.speed_batches == (1, 4, 16, 64)
    assert standard.eval.max_windows is None and standard.eval.accelerators == ("H100-SXM", "H200")


def test_unknown_eval_suite_names_the_known_ones():
    from compress.recipe import RecipeError, from_dict
    with pytest.raises(RecipeError, match="quick"):
        from_dict({"model": "default", "stages": [{"stage": "quantize", "scheme": "W8A16"}], "eval": "nightly"})


@pytest.mark.parametrize("module,table", [("awq_gptq_table", "RUNS"), ("outlier_table", "ROWS"),
                                          ("memory_plan_check", "RUNS"), ("large_models", "RUNS"), ("moe", "RUNS")])
def test_every_bench_run_is_a_valid_recipe(module, table):
    """The README's tables name runs of the bench scripts: each must resolve to a recipe that loads (a recipe whose
    default changed under a run, or a stage index past the list, breaks a documented command before anyone runs it)."""
    import importlib
    runs = getattr(importlib.import_module(f"bench.{module}"), table)
    bad = {}
    for name, (path, overrides, *_) in runs.items():
        try:
            load_recipe(Path(__file__).resolve().parent.parent / path, overrides)
        except (RecipeError, ValueError, OSError) as exc:
            bad[name] = str(exc)
    assert runs and not bad, bad
