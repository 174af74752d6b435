"""Module paths inside a model or a decoder block: what the architecture specs name, read and replaced. Its own module
so that the spec finder (__init__) and the pair derivation (derive) both read it without importing each other."""
from __future__ import annotations

from torch import nn

from ..core.nn import attach_input_rotation


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The module at dotted `path` under `root` (`root` itself for ''; a scaling pair whose linears sit in both
    the attention and the MLP of a parallel block compares the whole block's outputs)."""
    module = root
    for part in path.split(".") if path else ():
        if not hasattr(module, part):
            raise AttributeError(f"{type(root).__name__} has no submodule {path!r} (stopped at {part!r})")
        module = getattr(module, part)
    return module


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put `new` at `path`. A linear that rotates its input at run time (rotation.attach_input_rotation: the
    weights were folded for it) passes its rotation on to the module that replaces it (a QuantLinear, AutoRound's
    trainable copy), so no replacement can drop it."""
    parent, _, name = path.rpartition(".")
    owner = get_module(root, parent) if parent else root
    old = getattr(owner, name, None)
    rotation = getattr(old, "input_rotation", None)
    if rotation is not None and getattr(new, "input_rotation", None) is None:
        attach_input_rotation(new, rotation)
    setattr(owner, name, new)


def resolve(block: nn.Module, path: str) -> list[str]:
    """The names `path` stands for in `block`: itself, or with `*` (an expert index, `mlp.experts.*.up_proj`) one
    per expert; [] where the block lacks it."""
    if "*" not in path:
        return [path] if _has(block, path) else []
    head, _, tail = path.partition(".*.")
    if not _has(block, head):
        return []
    names = [f"{head}.{e}.{tail}" for e in range(len(get_module(block, head)))]
    return names if all(_has(block, n) for n in names) else []


def block_pairs(block: nn.Module, pairs) -> list[tuple[str, tuple[str, ...], str, tuple[str, ...]]]:
    """(previous op, balance linears, inspect module, followers) of each scaling pair as it applies to `block`.
    A `*` in the previous op makes one pair per expert (the same index throughout); a `*` in the balance linears
    only stands for all experts, and the block's routers beside them become followers: they read the same input,
    so their input columns take the scales too (in float, never searched or quantized), and the routing is
    unchanged. A pair whose modules the block lacks does not apply to it."""
    from .moe import ROUTER_NAMES
    out = []
    for prev, balance, inspect in pairs:
        if "*" in prev:
            prevs = resolve(block, prev)
            for e, p in enumerate(prevs):
                sub = [b.replace(".*.", f".{e}.") for b in balance]
                if all(_has(block, b) for b in sub):
                    out.append((p, tuple(sub), inspect.replace(".*.", f".{e}."), ()))
            continue
        names = [resolve(block, b) for b in balance]
        if not _has(block, prev) or not all(names) or not _has(block, inspect):
            continue
        followers = []
        for b in balance:
            if "*" in b:
                owner = b.partition(".*.")[0].rpartition(".")[0]
                followers += [f"{owner}.{r}" if owner else r for r in ROUTER_NAMES
                              if _has(block, f"{owner}.{r}" if owner else r)]
        out.append((prev, tuple(n for group in names for n in group), inspect, tuple(dict.fromkeys(followers))))
    return out


def _has(root: nn.Module, path: str) -> bool:
    try:
        get_module(root, path)
        return True
    except AttributeError:
        return False


def is_tied(model: nn.Module, head_name: str) -> bool:
    """Whether the head shares the input embedding's weight (tie_word_embeddings)."""
    head = get_module(model, head_name)
    return bool(getattr(model.config, "tie_word_embeddings", False)) and \
        getattr(head, "weight", None) is model.get_input_embeddings().weight


def untie_lm_head(model: nn.Module, head_name: str) -> None:
    """Give lm_head its own float copy of the embedding matrix and mark the model untied everywhere transformers
    looks when it re-ties (transformers 5.x): `tie_word_embeddings` on the config, on `get_text_config()` (composite
    models keep it there) and on every nested PreTrainedModel's config (`tie_weights()` re-reads each of them), and
    the cached `all_tied_weights_keys` mapping that `tie_weights(recompute_mapping=False)` and the loaders read.
    Without the config change, load_compressed's `tie_weights()` would point lm_head back at the embedding."""
    head, embed = get_module(model, head_name), model.get_input_embeddings()
    if head.weight is embed.weight:
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    configs = [model.config]
    if hasattr(model.config, "get_text_config"):
        configs.append(model.config.get_text_config())
    configs += [m.config for m in model.modules() if m is not model and hasattr(m, "all_tied_weights_keys")]
    for config in configs:
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    for m in model.modules():
        if hasattr(m, "all_tied_weights_keys") and hasattr(m, "get_expanded_tied_weights_keys"):
            m.all_tied_weights_keys = m.get_expanded_tied_weights_keys(all_submodels=True)
