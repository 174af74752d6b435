"""The stage registry: every stage is reached through STAGES and its lifecycle; nothing outside compress/stages/
switches on a stage's class; and a new stage is one class plus one registry line (the recipe loader, the runner and
the report renderer take it with no edit)."""
from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

import compress
from compress.arch import get_arch
from compress.pipeline.report import render_markdown
from compress.core.nn import QuantLinear
from compress.pipeline.calibration import compress_model
from compress.recipe import from_dict, to_plain
from compress.stages import STAGES, StageBase, make_plan
from compress.stages.base import Needs
from tests.conftest import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

PACKAGE = Path(compress.__file__).parent


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_registered_stage_is_a_frozen_dataclass_with_the_lifecycle(name):
    cls = STAGES[name]
    assert cls.name == name and issubclass(cls, StageBase)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    assert "name" not in {f.name for f in dataclasses.fields(cls)}  # a class attribute, not a recipe key


def _isinstance_targets(node: ast.Call) -> list[str]:
    if not (isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
        return []
    second = node.args[1]
    items = second.elts if isinstance(second, ast.Tuple) else [second]
    return [n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else "" for n in items]


def test_no_switch_over_stage_classes_outside_the_stages_package():
    classes = {cls.__name__ for cls in STAGES.values()}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "stages":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and classes & set(_isinstance_targets(node)):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and any(a.name in classes for a in node.names):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports a stage class")
    assert not offenders, f"stage classes used outside compress/stages/: {offenders}"


@dataclass(frozen=True)
class CountInputsStage(StageBase):
    """A toy block stage: records, per block, how many tokens each linear of the next quantize stage was observed
    on. It lives only in this test: what the runner needs of a stage is its lifecycle, nothing else."""

    every: int = 1

    name: ClassVar[str] = "count_inputs"

    @property
    def needs_calibration(self) -> bool:
        return True

    def needs(self, plan, index):
        return Needs(abs_max=True)

    def begin(self, ctx, index):
        ctx.records[index] = {}

    def on_block(self, ctx, block, index):
        if block.index % self.every == 0:
            ctx.records[index][block.prefix] = {n: s.tokens for n, s in sorted(block.observer.stats.items())}

    def report(self, ctx, index):
        return {"index": index, "stage": self.name, "blocks": ctx.records[index]}

    @staticmethod
    def render(section, models):
        return ["", f"## Stage {section['index']}: count_inputs", "", f"{len(section['blocks'])} blocks counted"]


def test_a_new_stage_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(STAGES, "count_inputs", CountInputsStage)
    recipe = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 3, "seq_len": 8},
                        "stages": [{"stage": "count_inputs", "every": 2},
                                   {"stage": "quantize", "scheme": {"dtype": "int4", "group_size": 16}}]})
    assert to_plain(recipe.stages[0]) == {"stage": "count_inputs", "every": 2}
    model = make_tiny_model("llama")
    arch = get_arch(model)
    sections, _ = compress_model(model, make_tiny_tokenizer(), recipe, make_plan(model, arch, recipe.stages), "cpu",
                                 progress=False, log=lambda *_: None)
    counted = sections["stages"][0]["blocks"]
    n_blocks = len(arch.block_list(model))
    assert list(counted) == [f"{arch.blocks}.{i}" for i in range(0, n_blocks, 2)]
    assert all(t == 3 * 8 for block in counted.values() for t in block.values())  # every observed token
    assert set(next(iter(counted.values()))) >= {"self_attn.q_proj", "mlp.down_proj"}
    assert "count_inputs" in render_markdown({"stages": sections["stages"]})
    with pytest.raises(ValueError, match="needs calibration data"):
        from_dict({"model": "unused", "stages": [{"stage": "count_inputs"}, {"stage": "quantize"}]})


def test_the_plan_resolves_each_smoothing_stage_to_the_next_quantize_stage():
    recipe = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 2, "seq_len": 8},
                        "stages": [{"stage": "smoothquant"}, {"stage": "quantize", "scheme": "W8A8"},
                                   {"stage": "awq"}, {"stage": "quantize", "scheme": {"dtype": "int4", "group_size": 16},
                                                      "ignore": ["re:.*self_attn.*", "lm_head"]}]})
    model = make_tiny_model("llama")
    plan = make_plan(model, get_arch(model), recipe.stages)
    assert plan.target(0) == (recipe.stages[1], plan.steps[1]) and plan.target(2) == (recipe.stages[3], plan.steps[3])
    # the second quantize stage finds every layer already claimed by the first
    assert plan.steps[3].quantized == [] and all("quantized by stage 1" in e.reason for e in plan.steps[3].layers
                                                 if e.name != "lm_head" and "self_attn" not in e.name)
    assert plan.needs() == Needs(abs_mean=True, abs_max=True, replay_samples=4)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # planning changes nothing
