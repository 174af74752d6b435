"""Layers a serving engine loads into one fused module, so that they must share one quantization scheme.

vLLM builds Llama-like families with q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj` (each model's
`packed_modules_mapping`), and a MoE block's experts in one fused-experts module whose gate, up and down projections
take one scheme, the one it reads for expert 0 (compressed_tensors_moe.get_moe_method: "All MoE projections need to
have same quantization scheme"; checked against vLLM 0.32). A checkpoint that gives the parts of such a module
different schemes, or quantizes some and leaves others in float, is refused or misread there. Mixed precision
therefore chooses one scheme per group (auto_precision's `fused_groups`), and the exports engines load check it.
"""
from __future__ import annotations

from typing import Iterable

from .moe import EXPERT

# leaf names fused together when they sit side by side in one module (vLLM's packed_modules_mapping entries)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("in_proj_qkvz", "in_proj_ba"))


def group_key(name: str) -> tuple[str, ...] | str:
    """What `name` is fused into: a MoE block's experts, a sibling set in its parent module, or itself alone."""
    if (m := EXPERT.search(name)) is not None:
        return (name[:m.start()], "experts")
    parent, _, leaf = name.rpartition(".")
    for siblings in SIBLINGS:
        if leaf in siblings:
            return (parent, *siblings)
    return name


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """`names` partitioned into the groups that must share one scheme (a layer fused with nothing is a group of its
    own), in order of first appearance."""
    groups: dict = {}
    for n in names:
        groups.setdefault(group_key(n), []).append(n)
    return list(groups.values())


def fused_label(group: list[str]) -> str:
    """A short name for a group in messages: `model.layers.0.self_attn.{q_proj,k_proj,v_proj}`."""
    if len(group) == 1:
        return group[0]
    key = group_key(group[0])
    if key[-1] == "experts":
        return f"{key[0]}.experts.* ({len(group)} expert layers)"
    return f"{key[0]}.{{{','.join(key[1:])}}}"
