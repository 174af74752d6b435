"""A family's tiny model: its config class with small sizes, the same module structure.

`tiny_config(config)` shrinks a config (any decoder-only family's) to hidden 64, 4 heads of 16, 4 experts, a
256-token vocabulary and the fewest layers that still hold every kind of layer it has (each distinct entry of
`layer_types` and the other per-layer lists); `FAMILY_OVERRIDES` holds what a family needs beyond those generic rules
(its Mamba or linear-attention sizes, the layer pattern that shows all its block kinds). Where the scaling pairs of a
family are derived from its structure (arch/derive.py) they are found and checked on this model, so that the check
never needs the real model's weights (a streamed or meta-device model has none in memory).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

HIDDEN, HEADS, HEAD_DIM, VOCAB, EXPERTS = 64, 4, 16, 256, 4

# generic sizes, by config key (only keys the config has are set)
_SIZES: dict[str, Any] = {
    # width
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128, "intermediate_size_mlp": 128,
    "word_embed_proj_dim": HIDDEN,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
    # heads: as many key/value heads as query heads, so that v -> o is a pair the check can try (a real model with
    # grouped heads skips it at run time, with that reason)
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS, "attention_heads": HEADS,
    "num_key_value_heads": HEADS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM,
    "global_head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16,
    # linear attention / Mamba
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "mamba_chunk_size": 16, "chunk_size": 16,
    # vocabulary
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
    # experts
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
}
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "eod_token_id", "sep_token_id")
# keys that make the first layers differ from the rest: the tiny model keeps one layer past them
_FIRST_LAYERS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")

# text models whose rotary frequencies split into multimodal sections (Qwen2.5-VL's default: 16 + 24 + 24 of 64)
MROPE = ("qwen2_5_vl_text", "qwen3_vl_text")

# per family (config.model_type): what the generic rules above do not give
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2,
                  attn_layer_indices=[1]),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=1, expand=2,
                       layers_block_type=["mamba", "moe", "attention", "mlp"]),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_expand=2),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2,
                             layer_types=["mamba", "attention"], shared_intermediate_size=64),
    "zamba2": dict(mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1, attention_hidden_size=128,
                   attention_head_dim=32, adapter_rank=8),
    # Llama 3.2 Vision's text model: a cross-attention layer between two self-attention ones
    "mllama_text_model": dict(num_hidden_layers=3, cross_attention_layers=[1]),
}


# a vision-language model's vision config (by the composite config's model_type): the generic widths of _SIZES, 2
# layers, small images, and what must agree with the text model's width or the vision layers kept
VISION_LAYERS = ("num_hidden_layers", "depth")
VISION_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(out_hidden_size=HIDDEN, fullatt_block_indexes=[1]),
    "qwen3_vl": dict(out_hidden_size=HIDDEN, deepstack_visual_indexes=[0], num_position_embeddings=64),
    "gemma3": dict(image_size=32, patch_size=8),
    "mllama": dict(image_size=28, num_global_layers=1, intermediate_layers_indices=[0], vision_output_dim=2 * HIDDEN),
    "mistral3": dict(image_size=32, patch_size=8),
}
# and the composite config's own keys: Gemma 3 pools the 16 patches of a 32-pixel image to 4 tokens
COMPOSITE_OVERRIDES: dict[str, dict[str, Any]] = {"gemma3": dict(mm_tokens_per_image=4)}


def _tiny_vision(vision, model_type: str | None):
    """A vision config with the generic widths, 2 layers and the family's VISION_OVERRIDES."""
    d = vision.to_dict()
    for k, v in _SIZES.items():
        if k in ("hidden_size", "intermediate_size", "head_dim") or "heads" in k:
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
                d[k] = v
    for k in VISION_LAYERS:
        if isinstance(d.get(k), int):
            d[k] = 2
    d.update(VISION_OVERRIDES.get(model_type, {}))
    for k in ("architectures", "transformers_version", "model_type", "_name_or_path"):
        d.pop(k, None)
    return type(vision)(**d)


def _layer_count(d: dict) -> tuple[str | None, int | None]:
    for k in _LAYERS:
        if isinstance(d.get(k), int):
            return k, d[k]
    return None, None


def _is_index_list(v: list, n: int) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in v) and \
        all(a < b for a, b in zip(v, v[1:])) and (not v or v[-1] < n)


def _keep_layers(d: dict, n: int) -> int:
    """The fewest leading layers that hold every kind of layer: every distinct entry of each per-layer list (or
    string, Nemotron-H's pattern) of length n, one layer past `first_k_dense_replace` and its kin; at least 2."""
    keep = 2
    for k, v in d.items():
        if isinstance(v, (list, str)) and len(v) == n and n > 0 and not (isinstance(v, list) and _is_index_list(v, n)):
            seen, last = set(), 0
            for i, x in enumerate(v):
                key = repr(x)
                if key not in seen:
                    seen.add(key)
                    last = i
            keep = max(keep, last + 1)
    for k in _FIRST_LAYERS:
        if isinstance(d.get(k), int) and 0 < d[k] < n:
            keep = max(keep, d[k] + 1)
    return min(keep, n)


def _per_layer(v):
    """A layer's own sizes (Gemma 4's per_layer_config): a head_dim of its own stays different from the others'."""
    if not isinstance(v, dict):
        return v
    return {k: (2 * HEAD_DIM if k == "head_dim" else _SIZES.get(k, x)) if isinstance(x, int) else x
            for k, x in v.items()}


def tiny_config(config, overrides: dict | None = None):
    """A copy of `config` (a transformers config) with small sizes and the fewest layers that keep every kind of
    layer; `overrides` (and FAMILY_OVERRIDES for its model_type) set last. A composite config (a vision-language
    model's) has its text config shrunk so, and its vision config too (_tiny_vision)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        out = copy.deepcopy(config)
        setattr(out, next(k for k, v in vars(config).items() if v is text), tiny_config(text, overrides))
        if getattr(config, "vision_config", None) is not None:
            out.vision_config = _tiny_vision(config.vision_config, config.model_type)
        for k, v in COMPOSITE_OVERRIDES.get(config.model_type, {}).items():
            setattr(out, k, v)
        return out
    d = config.to_dict()
    for k, v in _SIZES.items():
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            d[k] = v
    if isinstance(d.get("qk_rope_head_dim"), int) and "head_dim" in d:  # multi-head latent attention: rotary width
        d["head_dim"] = d["qk_rope_head_dim"]
    elif "head_dim" in d and d["head_dim"] is None:  # derived from hidden_size / heads: the same, said once
        d["head_dim"] = HEAD_DIM
    key, n = _layer_count(d)
    if key is not None:
        keep = _keep_layers(d, n)
        # layers that read the keys and values of an earlier layer of their type (Gemma 3n/4's last
        # num_kv_shared_layers): the kept layers twice, the second time sharing
        shared = d.get("num_kv_shared_layers") or 0
        twice = 0 < shared < n and keep < n
        for k, v in list(d.items()):
            if isinstance(v, (list, str)) and len(v) == n and k != key:
                if isinstance(v, list) and _is_index_list(v, n):
                    d[k] = [x for x in v if x < keep] + ([x + keep for x in v if x < keep] if twice else [])
                else:
                    d[k] = v[:keep] * (2 if twice else 1)
            elif isinstance(v, list) and v and _is_index_list(v, n):  # indices of layers (mlp_only_layers)
                d[k] = [x for x in v if x < keep] + ([x + keep for x in v if x < keep] if twice else [])
            elif isinstance(v, dict) and v and all(str(x).isdigit() for x in v):  # per layer index (Gemma 4)
                d[k] = {x: _per_layer(y) for x, y in v.items() if int(x) < keep}
                if twice:
                    d[k] |= {str(int(x) + keep).zfill(len(str(x))) if isinstance(x, str) else x + keep: y
                             for x, y in d[k].items()}
        d[key] = keep * (2 if twice else 1)
        if twice:
            d["num_kv_shared_layers"] = keep
    for k in _TOKENS:
        v = d.get(k)
        if isinstance(v, int) and v >= VOCAB:
            d[k] = {"pad_token_id": 0, "bos_token_id": 1}.get(k, 2)
        elif isinstance(v, list):
            d[k] = [x if x < VOCAB else 2 for x in v]
    if d.get("model_type") in MROPE:  # multimodal rotary sections: temporal, height, width of HEAD_DIM / 2 = 8
        d["rope_parameters"] = {**(d.get("rope_parameters") or {}), "mrope_section": [2, 3, 3]}
    if isinstance(d.get("max_position_embeddings"), int):
        d["max_position_embeddings"] = min(d["max_position_embeddings"], 4096)
    d.update(FAMILY_OVERRIDES.get(d.get("model_type"), {}))
    d.update(overrides or {})
    for k in ("architectures", "transformers_version", "model_type", "_name_or_path"):
        d.pop(k, None)
    return type(config)(**d)


def tiny_model(config, seed: int = 0) -> nn.Module:
    """A float32 model of `config` (already tiny) on the CPU with eager attention, in eval mode, its fused experts
    unfused (compress/arch/moe.py), and every weight that initialises to one value (zeros, ones) given random values
    around it, so that no module's output is trivially independent of its inputs."""
    from .vlm import auto_model_class
    from .moe import unfuse_experts

    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    with torch.device("cpu"):  # also inside a caller's meta-device context
        model = auto_model_class(config).from_config(config).float().eval()
    if any(p.is_meta for p in model.parameters()):
        raise RuntimeError("the tiny model was built without weights (inside accelerate's init_empty_weights?)")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                base = float(p.flatten()[0])
                p.add_(torch.randn(p.shape, generator=g) * (0.1 * abs(base) if base else 0.02))
    unfuse_experts(model)
    return model
