"""Where things are in each decoder-only family: data only.

Paths are dotted attribute paths: `blocks`, `embed`, `final_norm`, `lm_head` from the model
root; `attention`, `mlp` (linear layers) and `norms` relative to one decoder block.
To support a new family, add one entry keyed by its `config.model_type`.
"""
from __future__ import annotations

_LLAMA = dict(
    blocks="model.layers", embed="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
    attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    norms=("input_layernorm", "post_attention_layernorm"),
)

ARCH_TABLE: dict[str, dict] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": dict(_LLAMA, norms=("input_layernorm", "post_attention_layernorm",
                                 "self_attn.q_norm", "self_attn.k_norm")),
    "gemma": _LLAMA,
    "gemma2": dict(_LLAMA, norms=("input_layernorm", "post_attention_layernorm",
                                  "pre_feedforward_layernorm", "post_feedforward_layernorm")),
    "phi3": dict(_LLAMA, attention=("self_attn.qkv_proj", "self_attn.o_proj"),
                 mlp=("mlp.gate_up_proj", "mlp.down_proj")),
    "opt": dict(
        blocks="model.decoder.layers", embed="model.decoder.embed_tokens",
        final_norm="model.decoder.final_layer_norm", lm_head="lm_head",
        attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
        mlp=("fc1", "fc2"), norms=("self_attn_layer_norm", "final_layer_norm"),
    ),
    "gpt_neox": dict(
        blocks="gpt_neox.layers", embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head", attention=("attention.query_key_value", "attention.dense"),
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), norms=("input_layernorm", "post_attention_layernorm"),
    ),
    "gpt2": dict(
        blocks="transformer.h", embed="transformer.wte", final_norm="transformer.ln_f", lm_head="lm_head",
        attention=("attn.c_attn", "attn.c_proj"), mlp=("mlp.c_fc", "mlp.c_proj"), norms=("ln_1", "ln_2"),
    ),
}
