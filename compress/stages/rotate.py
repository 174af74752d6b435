"""The `rotate` stage: a random rotation of the residual stream folded into the weights (compress/transforms/rotation.py), before
calibration, so that the quantize stages after it see incoherent weights; the float model's function is unchanged."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from ..arch import ArchSpec, get_module
from ..transforms.rotation import rotation_problem
from .base import ModelStageContext, Plan, StageBase, StageRecord, inline

KINDS = ("hadamard", "orthogonal")


@dataclass
class RotateRecord(StageRecord):
    """The rotate stage's report section: what rotate_model did (the rotation, norms folded, linears rotated, an
    untied head) and, with online_hadamard, what rotate_mlp_inputs did."""

    rotation: dict = inline()
    online: dict = inline()


@dataclass(frozen=True)
class RotateStage(StageBase):
    """Recipe stage `rotate` (QuaRot / SpinQuant's R1, folded; no rotation at run time, so every export format holds
    the result). kind: hadamard (a randomised Hadamard matrix, QuaRot's; a random orthogonal one where no Hadamard
    matrix of the hidden size can be built, reported) or orthogonal (a random orthogonal matrix). seed: the random
    signs (or matrix). A tied lm_head is untied (it takes the final norm's gain): the checkpoint grows by one float
    copy of the head, reported.

    online_hadamard: also rotate the input of every block's MLP down projection at run time (QuaRot's online
    Hadamard, SpinQuant's R4): its weight is folded to W·Q and x·Q is computed before it, so its weight and its
    activations (the MLP's intermediate channels, where the largest activation outliers live) are quantized in the
    rotated basis. That needs the runtime to apply the Hadamard: the compress checkpoint holds it (`compress eval`,
    `compress verify`), and the export formats refuse it, with the reason (their loaders do not apply it)."""

    kind: Literal["hadamard", "orthogonal"] = "hadamard"
    seed: int = 0
    online_hadamard: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rotate.kind is {self.kind!r}; use one of {list(KINDS)}")

    name: ClassVar[str] = "rotate"
    whole_model: ClassVar[bool] = True

    def plan(self, model: nn.Module, arch: ArchSpec, claimed: dict[str, int], index: int) -> str:
        if (why := rotation_problem(model, arch)) is not None:
            raise ValueError(f"stage {index} (rotate): {why}")
        d = model.get_input_embeddings().weight.shape[1]
        text = (f"\nstage {index}: rotate the residual stream ({self.kind}, order {d}, seed {self.seed}), folded "
                "into the embedding, every block's input and output projections and the head")
        if self.online_hadamard:
            from ..transforms.rotation import hadamard_factors, mlp_out_name
            name = mlp_out_name(arch)
            if name is None or not isinstance(get_module(arch.block_list(model)[0], name), nn.Linear):
                raise ValueError(f"stage {index} (rotate): online_hadamard needs the MLP's down projection as an "
                                 f"nn.Linear, which {arch.family!r} does not have (its prune entry's mlp_out: {name})")
            n = get_module(arch.block_list(model)[0], name).in_features
            text += (f"; and an online Hadamard on every {name} input ({hadamard_factors(n)[1]}, order {n}), "
                     "applied at run time")
        return text

    def describe(self, plan: Plan, index: int) -> tuple[list[str], str]:
        return [plan.steps[index]], plan.steps[index].strip()

    def export_problem(self, formats: tuple[str, ...], index: int, check) -> str | None:
        """The online Hadamard is applied at run time by the compress checkpoint alone: every format refuses it."""
        if not self.online_hadamard:
            return None
        from ..export import get_exporter
        return (f"cannot export to {', '.join(formats)}: the rotate stage's online_hadamard rotates every MLP down "
                "projection's input at run time, which none of these formats' loaders "
                f"({'; '.join(get_exporter(f).loaders for f in formats)}) apply. Drop output.formats (the compress "
                "checkpoint in OUTPUT/model holds it: `compress eval`, `compress verify`), or set "
                "rotate.online_hadamard: false")

    def run_model(self, ctx: ModelStageContext, index: int) -> dict:
        from ..transforms.rotation import rotate_model

        ctx.log(f"stage {index}: rotate — the residual stream, folded into the weights ...")
        record = RotateRecord(index, "rotate", rotate_model(ctx.model, ctx.arch, self.kind, self.seed))
        if self.online_hadamard:
            from ..transforms.rotation import rotate_mlp_inputs
            record.online = rotate_mlp_inputs(ctx.model, ctx.arch, self.seed)
        return record.to_json()

    @staticmethod
    def render(section: dict, models: dict) -> list[str]:
        lines = ["", f"## Stage {section['index']}: rotate", "",
                 f"Residual stream rotated by a {section['rotation']} (seed {section['seed']}), folded into the "
                 f"weights: {section['norms_folded']} norm gains folded into the linears that read them, "
                 f"{section['linears_rotated']} linears and the embedding rotated. The float model computes the same "
                 "function" + ("." if section.get("online_hadamard") else "; nothing is rotated at run time.")]
        if section.get("online_hadamard"):
            lines.append(f"Every block's `{section['online_hadamard']}` rotates its input at run time by a randomised "
                         f"Hadamard of order {section['online_order']} ({section['online_transform']}), folded into "
                         "its weight: only the compress checkpoint holds this (the export formats refuse it).")
        if section.get("untied_lm_head"):
            lines.append(f"The lm_head was tied to the embedding and is now its own matrix (it took the final norm's "
                         f"gain): {section['untied_bytes'] / 1e6:.1f} MB more in float.")
        return lines
