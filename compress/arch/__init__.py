"""Architecture specs: one record per family (arch/tables.py's FAMILIES, keyed by config.model_type), with a generic
fallback found from the module tree. Every question a family raises is answered by its ArchSpec: where its blocks,
linears and norms are, its scaling pairs, how it is pruned and rotated, how GGUF names it, whether the lean decode loop
runs it, whether its linears are Conv1D."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from .moe import ExpertLinears
from ..core.nn import is_linear
from .paths import _has, block_pairs, get_module, resolve, set_module  # noqa: F401 (the package's names)
from .tables import FAMILIES, GGUFArch
from .vlm import auto_model_class, is_vision_language  # noqa: F401 (the package's names)


@dataclass(frozen=True)
class ArchSpec:
    family: str  # config.model_type, or "generic:<model_type>" when found from the module tree
    blocks: str
    embed: str
    final_norm: str
    lm_head: str
    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    norms: tuple[str, ...]
    awq: tuple[tuple[str, tuple[str, ...], str], ...] = ()  # (previous op, balance linears, inspect module)
    awq_skip: tuple[tuple[str, str], ...] = ()  # (pair, reason it cannot be scaled)
    norm_offset: float = 0.0  # 1.0 where a norm computes x * (1 + weight)
    no_clip: tuple[str, ...] = ()
    # what the family's entry switches on; a family without an entry has none of them
    prune: dict | None = field(default=None, hash=False)  # how each pruning axis is cut (compress/prune)
    rotate: tuple[str, ...] | str | None = None  # the residual-stream writers, or why it cannot be rotated
    gguf: GGUFArch | None = None  # the GGUF architecture llama.cpp runs it as
    lean: bool = False  # the lean decode loop runs it
    conv1d: bool = False  # linears are transformers' Conv1D ([in, out] weights)
    vision: tuple[tuple[str, str], ...] = ()  # a vision-language model's modules outside its language model
    cross_attention: str = ""  # the submodule of a cross-attention block (reads the images; skipped on text)

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        return get_module(model, self.blocks)


def get_arch(model: nn.Module) -> ArchSpec:
    """The spec for `model`: its table entry checked against the module tree, else the generic fallback."""
    spec = family_spec(model)
    if spec is not None:
        _check(model, spec)
        return spec
    return _generic(model, getattr(model.config, "model_type", None))


def family_spec(model: nn.Module) -> ArchSpec | None:
    """The spec of `model`'s family as its table entry states it (not checked against the module tree: cheap, for
    the callers that ask only what the family switches on), or None for a family without an entry."""
    model_type = getattr(model.config, "model_type", None)
    entry = FAMILIES.get(model_type)
    return None if entry is None else ArchSpec(family=model_type, **entry)


def language_model(arch: ArchSpec) -> str:
    """The path of the module that holds the decoder blocks (a vision-language model's language model)."""
    return arch.blocks.rpartition(".")[0]


def multimodal_part(arch: ArchSpec, name: str) -> str | None:
    """What part of a vision-language model module `name` lies in when it is outside the language model and is not
    the output head: the part its `vision` entry names ("vision tower", "multimodal projector"), else "module outside
    the language model"; None inside the language model, for the head, and for a text-only model."""
    if not arch.vision or name == arch.lm_head or name.startswith(arch.lm_head + ".") or \
            name.startswith(language_model(arch) + "."):
        return None
    return next((what for path, what in arch.vision if name == path or name.startswith(path + ".")),
                "module outside the language model")


def cross_attention_blocks(model: nn.Module, arch: ArchSpec) -> list[int]:
    """Indices of the decoder blocks that are cross-attention layers (arch.cross_attention): they read the image
    features, and the model's forward skips them on text."""
    if not arch.cross_attention:
        return []
    return [i for i, b in enumerate(arch.block_list(model)) if _has(b, arch.cross_attention)]


def families_with(switch: str) -> list[str]:
    """The model types whose entry switches `switch` (an ArchSpec field: prune, gguf, lean, ...) on, sorted."""
    return sorted(f for f, entry in FAMILIES.items() if entry.get(switch))


def _check(model: nn.Module, spec: ArchSpec) -> None:
    blocks = spec.block_list(model)
    missing = [p for p in (spec.embed, spec.final_norm, spec.lm_head) if not _has(model, p)]
    paths = spec.attention + spec.mlp + spec.norms
    missing += [f"{spec.blocks}.0.{p}" for p in dict.fromkeys(paths) if not _has(blocks[0], p)]
    # a scaling pair must apply to some block (MoE families mix dense and expert blocks)
    missing += [f"{spec.blocks}.*.{p}" for pair in spec.awq if not any(block_pairs(b, (pair,)) for b in blocks)
                for p in (pair[0], *pair[1], pair[2])]
    if missing:
        raise ValueError(f"model_type {spec.family!r}: the architecture table in compress/arch/tables.py names "
                         f"modules this model lacks: {missing}. Fix that entry for this transformers version.")


def _generic(model: nn.Module, model_type: str | None, derive_pairs: bool = True) -> ArchSpec:
    """Find the decoder blocks as the ModuleList with num_hidden_layers identical children, or, in a hybrid model
    whose layers are of several classes (Jamba: Mamba and attention layers), with num_hidden_layers children that
    all hold linear layers. Linear, norm and final-norm paths are read from one block of each class; the AWQ
    scaling pairs are derived from the blocks' structure (`derive_pairs`, _with_derived_pairs)."""
    n_layers = getattr(model.config, "num_hidden_layers", None)
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and not isinstance(m, ExpertLinears) and len(m) > 0
             and (n_layers is None or len(m) == n_layers)]
    candidates = [name for name, m in lists if len({type(c) for c in m}) == 1
                  and any(is_linear(x) for x in m[0].modules())]
    if not candidates:  # a hybrid stack: blocks of several classes, each with its own linears
        candidates = [name for name, m in lists if len({type(c) for c in m}) > 1
                      and all(any(is_linear(x) for x in c.modules()) for c in m)]
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    if len(candidates) != 1 or out is None or inp is None:
        raise ValueError(
            f"cannot find the decoder blocks of model_type {model_type!r} (candidates: {candidates or 'none'}). "
            "Add an entry to FAMILIES in compress/arch/tables.py with blocks=, embed=, final_norm=, lm_head=, "
            "attention=, mlp= and norms= paths for this family.")
    names = {id(m): n for n, m in model.named_modules()}
    kinds: dict[tuple, nn.Module] = {}  # one block of each layout (Bamba's Mamba and attention layers share a class)
    for b in get_module(model, candidates[0]):
        kinds.setdefault(tuple(n for n, _ in b.named_modules()), b)
    linears, norms, attn = {}, {}, {}
    for b in kinds.values():
        for n, m in b.named_modules():
            if is_linear(m):
                linears[n] = None
                if any(_MIXER.search(type(get_module(b, p)).__name__) for p in _prefixes(n)):
                    attn[n] = None
            elif "norm" in type(m).__name__.lower():
                norms[n] = None
    linears, norms, attn = tuple(linears), tuple(norms), tuple(attn)
    spec = ArchSpec(
        family=f"generic:{model_type}", blocks=candidates[0], embed=names[id(inp)],
        final_norm=_final_norm(model, candidates[0]), lm_head=names[id(out)], attention=attn,
        mlp=tuple(n for n in linears if n not in attn), norms=norms,
        awq_skip=(("all pairs", f"no scaling pairs are known for model_type {model_type!r}: add `awq=` to its "
                                "entry in compress/arch/tables.py"),),
    )
    return _with_derived_pairs(model, spec) if derive_pairs else spec


# the token mixers whose linears a generic spec lists as `attention`, by module class: attention, and the
# state-space (Mamba) and linear-attention (gated DeltaNet) layers that take its place in hybrid models
_MIXER = re.compile(r"attention|mamba|mixer|deltanet|ssm", re.I)
_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "norm_f", "ln_f", "final_norm")


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _final_norm(model: nn.Module, blocks: str) -> str:
    """The path of the norm the model applies after its blocks, found beside them: the only norm among the children
    of the module that holds the blocks (Bamba's `final_layernorm`, Nemotron-H's `norm_f`), else the one with a
    final norm's usual name (Gemma 4 also has `per_layer_projection_norm` there); "" when neither is found."""
    owner = blocks.rpartition(".")[0]
    children = dict(get_module(model, owner).named_children() if owner else model.named_children())
    norms = [n for n, m in children.items() if "norm" in type(m).__name__.lower() and not isinstance(m, nn.ModuleList)]
    name = norms[0] if len(norms) == 1 else next((n for n in _FINAL_NORMS if n in norms), "")
    return f"{owner}.{name}" if owner and name else name


def _with_derived_pairs(model: nn.Module, spec: ArchSpec) -> ArchSpec:
    """`spec` with the scaling pairs derived from its blocks' structure and checked on the family's tiny model;
    the pairs that cannot be used, and why, in awq_skip (inspect and the run's report say them)."""
    from dataclasses import replace

    from .derive import derive
    model_type = spec.family.removeprefix("generic:")
    try:
        found = derive(model, lambda tiny: _generic(tiny, getattr(tiny.config, "model_type", None),
                                                     derive_pairs=False).blocks)
    except Exception as e:  # the tiny model of this family cannot be built or run: no pairs, and why
        return replace(spec, awq_skip=(("all pairs", (
            f"no scaling pairs are known for model_type {model_type!r}, and deriving them from its blocks' "
            f"structure failed on its tiny model ({type(e).__name__}: {e}); add `awq=` to its entry in "
            "compress/arch/tables.py")),))
    skip = found.awq_skip
    if not found.awq:
        skip = (("all pairs", f"no function-preserving scaling pair was found in the blocks of model_type "
                              f"{model_type!r} (the reasons per pair follow)"),) + skip
    return replace(spec, awq=found.awq, awq_skip=skip, norm_offset=found.norm_offset, no_clip=found.no_clip)
