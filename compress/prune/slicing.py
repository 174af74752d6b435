"""Physical structured pruning: slice weights, update the config, leave a model that plain transformers loads.

Each function takes the indices to KEEP (sorted, per layer where the axis is per layer) and edits the
model in place: parameters are replaced by sliced copies, the config and the modules' cached sizes are
updated, so `save_pretrained` + `AutoModelForCausalLM.from_pretrained` rebuild the same network.
Weights are [out_features, in_features] (nn.Linear) or [in, out] (GPT-2's Conv1D).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..arch import ArchSpec, families_with, family_spec, get_module


def prune_layout(model: nn.Module, axis: str) -> dict:
    """The family's pruning entry; a clear error when the family or this axis is not supported."""
    family = getattr(model.config, "model_type", None)
    spec = family_spec(model)
    layout = None if spec is None else spec.prune
    if layout is None:
        raise ValueError(f"structured pruning has no table for model_type {family!r}; add prune= to its FAMILIES "
                         f"entry in compress/arch/tables.py (known: {families_with('prune')})")
    if axis == "heads" and layout["heads"] not in ("separate", "fused"):
        raise ValueError(f"cannot prune heads of {family}: {layout['heads']}. Prune `mlp` or `depth` instead.")
    if axis == "hidden" and "hidden" in layout:
        raise ValueError(f"cannot prune the hidden size of {family}: {layout['hidden']}. Prune `mlp` or `depth` instead.")
    return layout


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D"


def _param(t: Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=like.requires_grad)


def slice_out(linear: nn.Module, idx: Tensor) -> None:
    """Keep output features `idx` (rows of a Linear weight, columns of a Conv1D weight) and their bias."""
    idx = idx.to(linear.weight.device)
    if _is_conv1d(linear):
        linear.weight = _param(linear.weight.data[:, idx], linear.weight)
        linear.nf = len(idx)
    else:
        linear.weight = _param(linear.weight.data[idx], linear.weight)
        linear.out_features = len(idx)
    if getattr(linear, "bias", None) is not None:
        linear.bias = _param(linear.bias.data[idx], linear.bias)


def slice_in(linear: nn.Module, idx: Tensor) -> None:
    """Keep input features `idx` (columns of a Linear weight, rows of a Conv1D weight)."""
    idx = idx.to(linear.weight.device)
    if _is_conv1d(linear):
        linear.weight = _param(linear.weight.data[idx], linear.weight)
        linear.nx = len(idx)
    else:
        linear.weight = _param(linear.weight.data[:, idx], linear.weight)
        linear.in_features = len(idx)


def _rows_of_heads(heads: Tensor, head_dim: int, offset: int = 0) -> Tensor:
    # head h owns rows [h * head_dim, (h + 1) * head_dim)
    return (offset + heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def _set_attrs(module: nn.Module, **values) -> None:
    for name, value in values.items():
        if hasattr(module, name):
            setattr(module, name, value)


def prune_heads(model: nn.Module, arch: ArchSpec, keep_q: list[Tensor], keep_kv: list[Tensor]) -> None:
    """Keep query heads `keep_q[layer]` and KV heads `keep_kv[layer]` (indices into the original heads).

    Every kept query head must belong to a kept KV group, and every layer keeps the same counts (the config
    holds one num_attention_heads); the kept query heads are renumbered so that head i maps to KV head
    i // (n_q / n_kv), which is how transformers' grouped-query attention pairs them.
    """
    layout = prune_layout(model, "heads")
    cfg, keys = model.config, layout["config"]
    n_q, n_kv = getattr(cfg, keys["heads"]), getattr(cfg, keys["kv_heads"], None) or getattr(cfg, keys["heads"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    new_q, new_kv = len(keep_q[0]), len(keep_kv[0])
    if any(len(q) != new_q for q in keep_q) or any(len(k) != new_kv for k in keep_kv) or new_q % new_kv:
        raise ValueError(f"every layer must keep the same number of heads, with query heads a multiple of KV heads; "
                         f"got {[len(q) for q in keep_q]} query / {[len(k) for k in keep_kv]} KV")
    group = n_q // n_kv
    for layer, (block, q, kv) in enumerate(zip(arch.block_list(model), keep_q, keep_kv)):
        q, kv = q.sort().values, kv.sort().values
        groups = q // group
        if not torch.equal(torch.repeat_interleave(kv, new_q // new_kv), groups):
            raise ValueError(f"layer {layer}: kept query heads {q.tolist()} do not fill kept KV groups {kv.tolist()} "
                             f"evenly ({group} query heads per KV head)")
        attn = layout["attn"]
        if layout["heads"] == "fused":
            qkv = get_module(block, attn["qkv"])
            rows = torch.cat([_rows_of_heads(q, head_dim), _rows_of_heads(kv, head_dim, n_q * head_dim),
                              _rows_of_heads(kv, head_dim, (n_q + n_kv) * head_dim)])
            slice_out(qkv, rows)
        else:
            slice_out(get_module(block, attn["q"]), _rows_of_heads(q, head_dim))
            slice_out(get_module(block, attn["k"]), _rows_of_heads(kv, head_dim))
            slice_out(get_module(block, attn["v"]), _rows_of_heads(kv, head_dim))
        slice_in(get_module(block, attn["o"]), _rows_of_heads(q, head_dim))
        attn_module = get_module(block, attn["o"].rpartition(".")[0])
        _set_attrs(attn_module, num_heads=new_q, num_attention_heads=new_q, num_key_value_heads=new_kv,
                   num_key_value_groups=new_q // new_kv, head_dim=head_dim)
    setattr(cfg, keys["heads"], new_q)
    setattr(cfg, keys["kv_heads"], new_kv)
    cfg.head_dim = head_dim  # explicit: families that derive it from hidden_size / heads would change it


def prune_mlp(model: nn.Module, arch: ArchSpec, keep: list[Tensor]) -> None:
    """Keep intermediate channels `keep[layer]` of every MLP (same count in every layer)."""
    layout = prune_layout(model, "mlp")
    cfg, key = model.config, layout["config"]["intermediate"]
    size = len(keep[0])
    if any(len(k) != size for k in keep):
        raise ValueError(f"every layer must keep the same number of MLP channels; got {[len(k) for k in keep]}")
    for block, idx in zip(arch.block_list(model), keep):
        idx = idx.sort().values
        for name in layout["mlp_in"]:
            linear = get_module(block, name)
            if layout.get("fused_halves"):  # rows [gate | up]
                half = (linear.weight.shape[1] if _is_conv1d(linear) else linear.weight.shape[0]) // 2
                slice_out(linear, torch.cat([idx, idx + half]))
            else:
                slice_out(linear, idx)
        slice_in(get_module(block, layout["mlp_out"]), idx)
        _set_attrs(get_module(block, layout["mlp_out"].rpartition(".")[0]) if "." in layout["mlp_out"] else block,
                   intermediate_size=size)
    setattr(cfg, key, size)


def prune_hidden(model: nn.Module, arch: ArchSpec, keep: Tensor) -> list[str]:
    """Keep residual-stream channels `keep` everywhere: embeddings, every norm, every projection that reads or
    writes the residual stream, the final norm and the LM head. Returns notes on what changed beyond slicing."""
    layout = prune_layout(model, "hidden")
    cfg, notes = model.config, []
    keep = keep.sort().values
    old = cfg.hidden_size
    if getattr(cfg, "head_dim", None) is None:
        cfg.head_dim = old // cfg.num_attention_heads
    embed, head = get_module(model, arch.embed), get_module(model, arch.lm_head)
    tied = head.weight is embed.weight
    embed.weight = _param(embed.weight.data[:, keep], embed.weight)
    embed.embedding_dim = len(keep)
    if tied:
        head.weight = embed.weight
    else:
        slice_in(head, keep)
    if layout.get("embed_scale") == "sqrt_hidden" and hasattr(embed, "embed_scale"):
        embed.embed_scale.fill_(len(keep) ** 0.5)  # what the reloaded model computes from the new hidden_size
        embed.scalar_embed_scale = len(keep) ** 0.5
        notes.append(f"embedding multiplier sqrt(hidden_size) changes from {old ** 0.5:.3f} to {len(keep) ** 0.5:.3f}")
    norms = [get_module(model, arch.final_norm)]
    readers = list(layout["mlp_in"])
    writers = [layout["mlp_out"]]
    attn = layout["attn"]
    readers += [attn["qkv"]] if layout["heads"] == "fused" else [attn["q"], attn["k"], attn["v"]]
    writers.append(attn["o"])
    for block in arch.block_list(model):
        norms += [get_module(block, n) for n in layout["hidden_norms"]]
        for name in readers:
            slice_in(get_module(block, name), keep)
        for name in writers:
            slice_out(get_module(block, name), keep)
        _set_attrs(block, hidden_size=len(keep))
    for norm in norms:
        norm.weight = _param(norm.weight.data[keep], norm.weight)
        if getattr(norm, "bias", None) is not None:
            norm.bias = _param(norm.bias.data[keep], norm.bias)
        if hasattr(norm, "normalized_shape"):
            norm.normalized_shape = (len(keep),)
    cfg.hidden_size = len(keep)
    notes.append("norms now normalise over the kept channels only (as in Minitron); distillation repairs the shift")
    return notes


def prune_layers(model: nn.Module, arch: ArchSpec, keep: list[int]) -> None:
    """Keep decoder blocks `keep` (in order); renumber their cache indices and per-layer config lists."""
    layout = prune_layout(model, "depth")
    blocks = arch.block_list(model)
    keep = sorted(keep)
    if not keep or keep[-1] >= len(blocks):
        raise ValueError(f"keep must name at least one of the {len(blocks)} blocks, got {keep}")
    kept = nn.ModuleList([blocks[i] for i in keep])
    for new, block in enumerate(kept):
        for m in block.modules():
            if hasattr(m, "layer_idx"):
                m.layer_idx = new
    parent, _, name = arch.blocks.rpartition(".")
    setattr(get_module(model, parent) if parent else model, name, kept)
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == len(blocks):
        cfg.layer_types = [types[i] for i in keep]
    setattr(cfg, layout["config"]["layers"], len(keep))
