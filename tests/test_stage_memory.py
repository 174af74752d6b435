"""The stage protocol's memory, streaming and export answers.

The memory plan of every shipped recipe (and the variants that take other branches of a stage's terms: fsdp,
gradient checkpointing, solved sensitivities, AutoRound) on Llama-2-7B's and a small Mixtral's config, host and
device, resident and streamed, is the one recorded in tests/data/stage_memory_plans.json, computed before the
stages answered their own terms (`python tests/test_stage_memory.py --write` rewrites it: only when a plan is meant
to change)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from compress.pipeline.memory_plan import GB, plan_memory
from compress.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path(__file__).parent / "data" / "stage_memory_plans.json"
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
MIXTRAL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
               max_position_embeddings=4096)
VARIANTS = {  # recipe -> extra override sets (each planned like the recipe itself)
    "minitron_prune_distill.yaml": [["stages.1.fsdp=true"]],
    "awq_gptq_tune_int4.yaml": [["stages.2.gradient_checkpointing=true"]],
    "auto_precision_4bit.yaml": [["stages.0.error_method=gptq"], ["stages.0.error_method=awq_gptq",
                                                                   "stages.0.seq_len=256"]],
    "autoround_int4.yaml": [["calibration.offload=disk"]],
}


def plans() -> dict:
    out = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        config = MixtralConfig(**MIXTRAL) if "moe" in path.name else LlamaConfig(**LLAMA2_7B)
        for extra in [[], *VARIANTS.get(path.name, [])]:
            recipe = load_recipe(path, extra)
            for dtype, device, streamed in ((torch.float32, "cpu", False), (torch.bfloat16, "cuda:0", False),
                                            (torch.bfloat16, "cpu", True)):
                plan = plan_memory(recipe, config, dtype, device, available=int(64 * GB),
                                   device_available=int(80 * GB), conversion=12345, streamed=streamed)
                tight = plan_memory(recipe, config, dtype, device, available=int(2 * GB),
                                    device_available=int(1 * GB), streamed=streamed)
                key = f"{path.name} {' '.join(extra)} {dtype} {device}{' streamed' if streamed else ''}"
                out[key] = {"plan": plan.to_dict(), "lines": plan.lines(), "problem": tight.problem(recipe)}
    return out


def test_every_shipped_recipe_plans_as_before():
    reference = json.loads(REFERENCE.read_text())
    now = json.loads(json.dumps(plans()))
    assert sorted(now) == sorted(reference)
    changed = [k for k in reference if now[k] != reference[k]]
    assert not changed, f"{len(changed)} plans changed, e.g. {changed[0]}: {now[changed[0]]} != {reference[changed[0]]}"


def _basis(hidden: int, mlp: int, **kw):
    from compress.pipeline.memory_plan import model_size
    from compress.recipe import CalibrationSpec
    from compress.stages.base import MemoryBasis

    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1000)
    return MemoryBasis(model_size(config), 2, kw.pop("calibration", CalibrationSpec(n_samples=4, seq_len=64)), **kw)


@pytest.mark.parametrize("hidden,mlp", [(64, 160), (128, 320)])
def test_gptq_holds_one_hessian_per_distinct_input_and_one_solve(hidden, mlp):
    """A Llama block's linears read four distinct inputs (q/k/v the attention norm's output, o_proj the attention's,
    gate/up the MLP norm's, down_proj the MLP's): 3·hidden² + mlp² float32 Hessians; the solve beside them is the
    widest K² + 2·out·K (down_proj: mlp² + 2·hidden·mlp, or gate/up's hidden² + 2·mlp·hidden where larger). On a
    CPU pass of more than one thread two inputs' solves run at once: the two largest (down_proj's and gate/up's)."""
    from compress.recipe import CalibrationSpec
    from compress.stages import QuantizeStage

    down, gate_up = mlp ** 2 + 2 * hidden * mlp, hidden ** 2 + 2 * mlp * hidden
    one_thread = _basis(hidden, mlp, calibration=CalibrationSpec(n_samples=4, seq_len=64, threads=1))
    memory = QuantizeStage(method="gptq").pass_memory(one_thread)
    assert memory.statistics == {"Hessians": 4 * (3 * hidden ** 2 + mlp ** 2)}
    assert memory.between == {"GPTQ solve": 4 * max(down, gate_up)}
    assert memory.during == {"block tuning": 0}
    assert QuantizeStage(method="gptq").pass_memory(_basis(hidden, mlp, device="cuda:0")).between == memory.between
    both = QuantizeStage(method="gptq").pass_memory(_basis(hidden, mlp))  # threads: 0, all cores
    assert both.between == {"GPTQ solve": 4 * (down + gate_up)}
    rtn = QuantizeStage(method="rtn").pass_memory(_basis(hidden, mlp))
    assert rtn.statistics == {} and rtn.between == {"GPTQ solve": 0}


def test_quantize_stores_the_block_linears_at_its_bits_and_a_scale_per_group():
    from compress.core.scheme import W4A16
    from compress.stages import QuantizeStage

    basis = _basis(128, 320)
    linear = 2 * (4 * 128 * 128 + 3 * 128 * 320)
    assert basis.size.block_linear_parameters == linear
    stored = QuantizeStage(scheme=W4A16).stored_bytes(basis)
    assert stored == basis.weights - 2 * linear + int(linear * (0.5 + 2 / W4A16.group_size))
    from compress.stages import AWQStage
    assert AWQStage().stored_bytes(basis) is None  # it only moves scales


def test_a_scale_search_keeps_its_windows_of_every_linear_input():
    from compress.stages import AWQStage, SmoothQuantStage

    basis = _basis(64, 160)
    inputs = 64 + 64 + 64 + 160  # q/k/v, o_proj, gate/up, down_proj
    assert AWQStage(search_samples=3).pass_memory(basis).statistics == {"kept windows": 4 * 3 * 64 * inputs}
    assert SmoothQuantStage().pass_memory(basis).statistics == {}  # no alpha grid: nothing replayed
    assert SmoothQuantStage(alpha_grid=(0.4, 0.6), search_samples=2).pass_memory(basis).statistics == {
        "kept windows": 4 * 2 * 64 * inputs}


def test_distill_holds_the_teacher_and_adamw_beside_the_student_and_says_what_shrinks_it():
    from compress.stages import DistillStage

    basis = _basis(64, 160, compressed=1000)
    distill, evaluation = DistillStage().memory_phases(basis)
    n = basis.size.parameters
    assert distill.name == "distill" and distill.parts == {"weights": 2 * n, "teacher and optimizer": 2 * n + 14 * n}
    assert evaluation.name == "evaluation" and evaluation.parts == {"pruned copy": 1000}
    assert DistillStage().memory_phases(_basis(64, 160, streamed=True)) == []
    assert "teacher and AdamW" in DistillStage().memory_fix(distill.parts)
    assert DistillStage().memory_fix({"weights": 1}) is None


def test_the_sensitivity_pass_grows_with_solved_errors_and_holds_blocks_when_streamed():
    from compress.stages import AutoPrecisionStage

    rtn = AutoPrecisionStage(bits_per_weight=4.5, n_samples=2)
    (phase,) = rtn.memory_phases(_basis(64, 160))
    assert phase.after_pass and phase.parts["weights"] == _basis(64, 160).weights and "Hessians" not in phase.parts
    assert phase.parts["kept states"] == 3 * 2 * 64 * 64 * 2  # (blocks + 1) × windows × tokens × hidden × 2 bytes
    (solved,) = AutoPrecisionStage(bits_per_weight=4.5, n_samples=2, error_method="gptq").memory_phases(
        _basis(64, 160))
    assert solved.parts["kept states"] == 2 * phase.parts["kept states"] and solved.parts["Hessians"] > 0
    (streamed,) = rtn.memory_phases(_basis(64, 160, streamed=True))
    assert "weights" not in streamed.parts and streamed.parts["one block"] == 2 * _basis(64, 160).size.block_parameters * 2


def test_tune_scales_checkpointing_holds_one_block_of_dequantized_weights():
    from compress.stages import TuneScalesStage

    (full,) = TuneScalesStage().memory_phases(_basis(64, 160, compressed=10))
    (one,) = TuneScalesStage(gradient_checkpointing=True).memory_phases(_basis(64, 160, compressed=10))
    assert full.parts["compressed model"] == 10 and full.parts["teacher"] == _basis(64, 160).weights
    assert one.parts["dequantized weights"] * 2 == full.parts["dequantized weights"]  # two blocks


def test_the_stages_that_cannot_stream_say_why():
    from compress.stages import AutoPrecisionStage, PruneStage, QuantizeStage, TuneScalesStage

    assert "tune_scales trains the whole compressed model" in TuneScalesStage().stream_problem()
    assert "sensitivity: kl" in AutoPrecisionStage(bits_per_weight=4, sensitivity="kl").stream_problem()
    assert AutoPrecisionStage(bits_per_weight=4).stream_problem() is None
    assert "prune acts on the whole model" in PruneStage(mlp=0.5).stream_problem()
    assert QuantizeStage().stream_problem() is None


def test_the_online_hadamard_refuses_every_format_by_name():
    from compress.stages import QuantizeStage, RotateStage

    why = RotateStage(online_hadamard=True).export_problem(("gguf-q4_0", "gptq"), 0, None)
    assert why.startswith("cannot export to gguf-q4_0, gptq:") and "rotate.online_hadamard: false" in why
    assert "llama.cpp" in why  # the loaders that do not apply it
    assert RotateStage().export_problem(("gguf-q4_0",), 0, None) is None
    assert QuantizeStage().export_problem(("gguf-q4_0",), 1, None) is None


def test_an_auto_precision_menu_is_refused_by_the_format_that_cannot_hold_it():
    """The planned model (int4 g16) exports to GPTQ; the int5 the menu may give a layer at run time does not, and
    int8 / int4 mixed across layers does not either (one scheme per GPTQ checkpoint); compressed-tensors holds both."""
    from compress.arch import get_arch
    from compress.export import ExportError
    from compress.pipeline.resident import check_formats
    from compress.recipe import from_dict
    from compress.stages.base import make_plan
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama")
    int5 = {"dtype": "int5", "group_size": 16, "symmetric": False}
    int4 = {"dtype": "int4", "group_size": 16}
    data = {"model": "unused", "calibration": {"kind": "self", "n_samples": 2, "seq_len": 16},
            "stages": [{"stage": "auto_precision", "menu": ["W8A16", int5], "bits_per_weight": 6},
                       {"stage": "quantize", "method": "gptq", "scheme": int4}]}
    recipe = from_dict(data)
    plan = make_plan(model, get_arch(model), recipe.stages)
    with pytest.raises(ExportError, match="cannot export to gptq: `stages.0` \\(auto_precision\\) may give layers "
                                          "int5-g16-asym"):
        check_formats(model, plan, ("gptq",))
    mixed = from_dict({**data, "stages": [{**data["stages"][0], "menu": ["W8A16", int4]}, data["stages"][1]]})
    with pytest.raises(ExportError, match="different schemes of its menu, and a gptq checkpoint cannot mix them"):
        check_formats(model, make_plan(model, get_arch(model), mixed.stages), ("gptq",))
    check_formats(model, make_plan(model, get_arch(model), mixed.stages), ("compressed-tensors",))


# What the runner must not know: the stage classes, and the settings only one stage has (read through getattr or an
# attribute). The lifecycle's own names (whole_model, after_calibration, stores_weights, needs_teacher and the
# methods of StageBase) are the protocol, and may be read.
STAGE_SPECIFIC = ["online_hadamard", "fused_groups", "fsdp", "gradient_checkpointing", "error_method", "gptq_samples",
                  "n_samples", "batch_size", "scheme", "method", "search_samples", "alpha_grid", "block_tuning",
                  "schemes_offered", "sensitivity_bytes", "tuning_bytes", "tune_scales_bytes", "needs"]
RUNNER = ["compress/pipeline/memory_plan.py", "compress/pipeline/resident.py", "compress/pipeline/streamed.py",
          "compress/transforms/rotation.py"]


def stage_knowledge(source: str) -> list[str]:
    """Where `source` names a stage class, tests a stage's name, or reads a stage-specific setting of anything
    called stage / s / st / target / tune (an attribute, or getattr with the name as a string). Comments and
    docstrings are prose: skipped (the AST holds neither)."""
    import ast

    from compress.stages import STAGES

    classes = {c.__name__ for c in STAGES.values()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in classes:
            found.append(node.id)
        elif isinstance(node, ast.ImportFrom):
            found += [a.name for a in node.names if a.name in classes]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Subscript)):
            owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
            if (owner in ("s", "st", "stage", "target", "tune") or owner.startswith(("plan.stages", "recipe.stages"))) \
                    and node.attr in STAGE_SPECIFIC:
                found.append(f"{owner}.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in STAGE_SPECIFIC:
            found.append(f"getattr(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in STAGES
                                                   for c in node.comparators):
            found.append(f"== {next(c.value for c in node.comparators if isinstance(c, ast.Constant))!r}")
    return found


@pytest.mark.parametrize("path", RUNNER)
def test_the_runner_knows_no_stage_by_class_name_or_setting(path):
    assert stage_knowledge((ROOT / path).read_text()) == []


def test_the_stage_knowledge_check_sees_each_kind_of_special_case():
    code = ("from ..stages import TuneScalesStage\n"
            "a = [s for s in stages if getattr(s, 'online_hadamard', False)]\n"
            "b = stage.fused_groups\n"
            "c = next(s for s in recipe.stages if s.name == 'auto_precision')\n"
            "d = [s.needs(None, i) for i, s in enumerate(recipe.stages)]\n"
            "e = getattr(plan.stages[index], 'fused_groups', False)\n"
            "f = isinstance(x, TuneScalesStage)\n")
    assert sorted(stage_knowledge(code)) == sorted([
        "TuneScalesStage", "getattr(..., 'online_hadamard')", "stage.fused_groups", "== 'auto_precision'", "s.needs",
        "getattr(..., 'fused_groups')", "TuneScalesStage"])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(plans(), indent=1) + "\n")
