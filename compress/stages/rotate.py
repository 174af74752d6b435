"""The `rotate` stage: a random rotation of the residual stream folded into the weights (compress/rotation.py), before
calibration, so that the quantize stages after it see incoherent weights; the float model's function is unchanged."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from ..arch import ArchSpec
from ..rotation import rotation_problem
from .base import ModelStageContext, Plan, StageBase

KINDS = ("hadamard", "orthogonal")


@dataclass(frozen=True)
class RotateStage(StageBase):
    """Recipe stage `rotate` (QuaRot / SpinQuant's R1, folded; no rotation at run time, so every export format holds
    the result). kind: hadamard (a randomised Hadamard matrix, QuaRot's; a random orthogonal one where no Hadamard
    matrix of the hidden size can be built, reported) or orthogonal (a random orthogonal matrix). seed: the random
    signs (or matrix). A tied lm_head is untied (it takes the final norm's gain): the checkpoint grows by one float
    copy of the head, reported."""

    kind: Literal["hadamard", "orthogonal"] = "hadamard"
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rotate.kind is {self.kind!r}; use one of {list(KINDS)}")

    name: ClassVar[str] = "rotate"
    whole_model: ClassVar[bool] = True

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> str:
        if (why := rotation_problem(model, arch)) is not None:
            raise ValueError(f"stage {index} (rotate): {why}")
        d = model.get_input_embeddings().weight.shape[1]
        return (f"\nstage {index}: rotate the residual stream ({self.kind}, order {d}, seed {self.seed}), folded "
                "into the embedding, every block's input and output projections and the head")

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        return [plan.steps[index]], plan.steps[index].strip()

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        from ..rotation import rotate_model

        ctx.log(f"stage {index}: rotate — the residual stream, folded into the weights ...")
        return {"index": index, "stage": "rotate", **rotate_model(ctx.model, ctx.arch, self.kind, self.seed)}

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = ["", f"## Stage {section['index']}: rotate", "",
                 f"Residual stream rotated by a {section['rotation']} (seed {section['seed']}), folded into the "
                 f"weights: {section['norms_folded']} norm gains folded into the linears that read them, "
                 f"{section['linears_rotated']} linears and the embedding rotated. The float model computes the same "
                 "function; nothing is rotated at run time."]
        if section.get("untied_lm_head"):
            lines.append(f"The lm_head was tied to the embedding and is now its own matrix (it took the final norm's "
                         f"gain): {section['untied_bytes'] / 1e6:.1f} MB more in float.")
        return lines
