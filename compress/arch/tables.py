"""Where things are in each decoder-only family: data only.

Paths are dotted attribute paths: `blocks`, `embed`, `final_norm`, `lm_head` from the model
root; `attention`, `mlp` (linear layers) and `norms` relative to one decoder block.
To support a new family, add one entry keyed by its `config.model_type`.

`awq` lists the scaling pairs: (previous op, the linears that read its output, the module whose
output the scale search compares). The previous op is a norm (its weight and bias are divided by
the scales) or a linear (its output rows are divided). `awq_skip` names the pairs a family cannot
scale, with the reason; `norm_offset` is 1 where a norm computes x * (1 + weight) (Gemma).
`no_clip` lists linears the AWQ clipping search leaves alone (q/k: the softmax magnifies their error).
"""
from __future__ import annotations

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_AWQ = (
    ("input_layernorm", _QKV, "self_attn"),
    ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
_LLAMA = dict(
    blocks="model.layers", embed="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
    attention=_QKV + ("self_attn.o_proj",),
    mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    norms=("input_layernorm", "post_attention_layernorm"),
    awq=_LLAMA_AWQ, no_clip=("self_attn.q_proj", "self_attn.k_proj"),
)
_FUSED_QKV = "v is fused into one qkv projection; scaling its rows would need a row-sliced pair"
_GELU = "a GELU sits between them, and GELU(x / s) != GELU(x) / s"

ARCH_TABLE: dict[str, dict] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": dict(_LLAMA, norms=("input_layernorm", "post_attention_layernorm",
                                 "self_attn.q_norm", "self_attn.k_norm")),
    "gemma": dict(_LLAMA, norm_offset=1.0),
    "gemma2": dict(_LLAMA, norm_offset=1.0,
                   norms=("input_layernorm", "post_attention_layernorm",
                          "pre_feedforward_layernorm", "post_feedforward_layernorm"),
                   # post_attention_layernorm normalises the attention *output*; the MLP reads pre_feedforward
                   awq=(_LLAMA_AWQ[0], _LLAMA_AWQ[1], ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"),
                                                       "mlp"), _LLAMA_AWQ[3])),
    "phi3": dict(_LLAMA, attention=("self_attn.qkv_proj", "self_attn.o_proj"),
                 mlp=("mlp.gate_up_proj", "mlp.down_proj"),
                 awq=(("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
                      ("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp")),
                 awq_skip=(("self_attn.qkv_proj -> self_attn.o_proj", _FUSED_QKV),
                           ("mlp.gate_up_proj -> mlp.down_proj", "up is fused with gate in gate_up_proj")),
                 no_clip=("self_attn.qkv_proj",)),
    "opt": dict(
        blocks="model.decoder.layers", embed="model.decoder.embed_tokens",
        final_norm="model.decoder.final_layer_norm", lm_head="lm_head",
        attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
        mlp=("fc1", "fc2"), norms=("self_attn_layer_norm", "final_layer_norm"),
        awq=(("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
             ("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj"),
             ("final_layer_norm", ("fc1",), "fc1"),
             ("fc1", ("fc2",), "fc2")),  # ReLU(x / s) = ReLU(x) / s for s > 0
        no_clip=("self_attn.q_proj", "self_attn.k_proj"),
    ),
    "gpt_neox": dict(
        blocks="gpt_neox.layers", embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head", attention=("attention.query_key_value", "attention.dense"),
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), norms=("input_layernorm", "post_attention_layernorm"),
        awq=(("input_layernorm", ("attention.query_key_value",), "attention"),
             ("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp")),
        awq_skip=(("attention.query_key_value -> attention.dense", _FUSED_QKV),
                  ("mlp.dense_h_to_4h -> mlp.dense_4h_to_h", _GELU)),
        no_clip=("attention.query_key_value",),
    ),
    "gpt2": dict(
        blocks="transformer.h", embed="transformer.wte", final_norm="transformer.ln_f", lm_head="lm_head",
        attention=("attn.c_attn", "attn.c_proj"), mlp=("mlp.c_fc", "mlp.c_proj"), norms=("ln_1", "ln_2"),
        awq=(("ln_1", ("attn.c_attn",), "attn"), ("ln_2", ("mlp.c_fc",), "mlp")),
        awq_skip=(("attn.c_attn -> attn.c_proj", _FUSED_QKV), ("mlp.c_fc -> mlp.c_proj", _GELU)),
        no_clip=("attn.c_attn",),
    ),
}
