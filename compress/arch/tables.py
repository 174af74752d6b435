"""Everything compress knows about each decoder-only family, in one table keyed by `config.model_type`: data only.

To support a new family, add ONE entry to `FAMILIES`; `get_arch` (arch/__init__.py) turns it into the `ArchSpec`
that every caller asks (the quantizers and AWQ, pruning, the rotation, the GGUF exporter, the lean decode loop, the
Hugging Face export). A family without an entry has its blocks found from the module tree and its `awq` pairs
derived from their structure, each checked function-preserving on its tiny model (arch/derive.py); it gets none of
the switches below. An entry holds:

- where things are: dotted attribute paths; `blocks`, `embed`, `final_norm`, `lm_head` from the model root;
  `attention`, `mlp` (linear layers) and `norms` relative to one decoder block.
- `awq`: the scaling pairs: (previous op, the linears that read its output, the module whose output the scale search
  compares). The previous op is a norm (its weight and bias are divided by the scales) or a linear (its output rows
  are divided). `awq_skip` names the pairs a family cannot scale, with the reason; `norm_offset` is 1 where a norm
  computes x * (1 + weight) (Gemma). `no_clip` lists linears the AWQ clipping search leaves alone (q/k: the softmax
  magnifies their error).
- `prune`: how structured pruning cuts each axis (below); absent: the family cannot be pruned.
- `rotate`: the linears that write into the residual stream (the rotation rotates their outputs), or why the family
  cannot be rotated; absent: no rotation entry.
- `gguf`: the GGUF architecture llama.cpp runs it as (`GGUFArch`); absent: the GGUF exporter refuses it.
- `lean`: the lean decode loop (serving/lean_decode.py) runs it: pre-norm blocks `x + attn(norm(x))`,
  `x + mlp(norm(x))`, rotary embeddings on the whole head in transformers' rotate-half layout, a gated MLP.
- `conv1d`: its linears are transformers' Conv1D ([in, out] weights, GPT-2).
- `vision`: a vision-language model (loaded with AutoModelForImageTextToText): the modules outside its language model,
  (path, what it is): the vision tower and the multimodal projector. Only the language model's decoder blocks are
  quantized; these, and anything else outside the language model but lm_head, stay float and are listed with the
  reason (stages/quantize.py). `cross_attention`: the submodule that marks a decoder block as a cross-attention layer
  reading the image features (Llama 3.2 Vision): the model skips such blocks on text, so text calibration never runs
  them; they stay float, listed (a text-only calibration pass passes them by).
"""
from __future__ import annotations

from dataclasses import dataclass

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
# Mixture-of-experts families (compress/arch/moe.py turns their fused expert tensors into experts.{e}.gate_proj, up_proj,
# down_proj). `*` in an awq pair stands for every expert of the block: the norm before the MoE block scales all
# experts' gate/up (and a shared expert's) jointly, its router's input columns follow in float (routing unchanged);
# each expert's up_proj -> down_proj is a pair of its own. A pair whose modules a block lacks (DeepSeek-V3's first
# dense blocks have no experts, its MoE blocks no dense MLP) does not apply to that block.
_MOE_AWQ = (
    _LLAMA_AWQ[0], _LLAMA_AWQ[1],
    ("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), "mlp"),
    ("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",), "mlp.experts.*.down_proj"),
)
_MOE = dict(_LLAMA, mlp=(), awq=_MOE_AWQ)
_SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
_QK_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
_FUSED_QKV = "v is fused into one qkv projection; scaling its rows would need a row-sliced pair"
_GELU = "a GELU sits between them, and GELU(x / s) != GELU(x) / s"
_GEMMA2_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

# Structured pruning (compress/prune): how each axis is cut, per family.
#   heads: "separate" (q/k/v rows and o columns by head), "fused" (one qkv linear, rows [q | k | v]) or the
#          reason the family cannot lose heads. mlp_in: linears whose output rows are the intermediate
#          channels (`fused_halves` when gate and up share one linear, rows [gate | up]); mlp_out: the linear
#          that reads them. hidden_norms: the norms over the residual width. config: the config keys to update.
_SEPARATE = dict(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj")
_TIED_WIDTH = "{family} derives head_dim from hidden_size / num_attention_heads, so its attention width is tied to {axis}"
_LLAMA_PRUNE = dict(
    heads="separate", attn=_SEPARATE, mlp_in=("mlp.gate_proj", "mlp.up_proj"), mlp_out="mlp.down_proj",
    hidden_norms=("input_layernorm", "post_attention_layernorm"),
    config=dict(heads="num_attention_heads", kv_heads="num_key_value_heads", head_dim="head_dim",
                intermediate="intermediate_size", hidden="hidden_size", layers="num_hidden_layers"),
)
# Residual-stream rotation (compress/transforms/rotation.py, stage `rotate`): the linears that write into the residual stream
# (their outputs are rotated); the readers are the `awq` pairs whose previous op is a norm (its gain is folded into
# them first). A string: why the family cannot be rotated.
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")
_LAYERNORM = ("{family}'s LayerNorm subtracts the mean, which a rotation of the residual stream does not preserve "
              "(QuaRot first folds the mean subtraction into the weights: not built)")
_MOE_ROTATE = "mixture of experts: rotating every expert and its router is not built yet"


# GGUF (compress/export/gguf.py): the architecture llama.cpp runs a family as.
@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture: the llama.cpp graph, and gguf's tensor-name table
    permute_qk: bool  # attn_q / attn_k rows permuted per head from rotate-half to the interleaved pairs of its RoPE
    biases: tuple[str, ...] = ()  # the projections whose bias the file holds
    qk_norms: tuple[str, ...] = ()  # per-head q/k RMSNorms of a block


_GGUF_LLAMA = GGUFArch("llama", permute_qk=True)
_GGUF_QKV_BIAS = ("q_proj", "k_proj", "v_proj")

# Vision-language models (issue 48): the language model sits at model.language_model (transformers 5), the vision
# tower and the projector beside it. Rotation and pruning are refused: the projector writes image features into the
# residual stream and its width, which neither transform follows.
_LM = "model.language_model"
_VLM = dict(_LLAMA, blocks=f"{_LM}.layers", embed=f"{_LM}.embed_tokens", final_norm=f"{_LM}.norm")
_VLM_ROTATE = ("vision-language model: the multimodal projector writes image features into the residual stream, and "
               "rotating its output is not built")
_TOWER_PROJECTOR = (("model.vision_tower", "vision tower"), ("model.multi_modal_projector", "multimodal projector"))

# the one table
FAMILIES: dict[str, dict] = {
    "llama": dict(_LLAMA, prune=_LLAMA_PRUNE, rotate=_WRITERS, gguf=_GGUF_LLAMA, lean=True),
    "mistral": dict(_LLAMA, prune=_LLAMA_PRUNE, rotate=_WRITERS, lean=True,
                    gguf=_GGUF_LLAMA),  # convert_hf_to_gguf.py registers Mistral as LlamaModel
    "qwen2": dict(_LLAMA, prune=_LLAMA_PRUNE, rotate=_WRITERS, lean=True,  # NeoX-style RoPE in llama.cpp: no permutation
                  gguf=GGUFArch("qwen2", permute_qk=False, biases=_GGUF_QKV_BIAS)),
    # Seed-OSS (ByteDance): Qwen2's block (q/k/v biases) with its own head_dim; llama.cpp's seed_oss graph
    "seed_oss": dict(_LLAMA, prune=_LLAMA_PRUNE, rotate=_WRITERS, lean=True,
                     gguf=GGUFArch("seed_oss", permute_qk=False, biases=_GGUF_QKV_BIAS)),
    "qwen3": dict(_LLAMA, norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
                  prune=_LLAMA_PRUNE, rotate=_WRITERS),
    "gemma": dict(_LLAMA, norm_offset=1.0, prune=dict(_LLAMA_PRUNE, embed_scale="sqrt_hidden"), rotate=_WRITERS),
    "gemma2": dict(_LLAMA, norm_offset=1.0, norms=_GEMMA2_NORMS,
                   # post_attention_layernorm normalises the attention *output*; the MLP reads pre_feedforward
                   awq=(_LLAMA_AWQ[0], _LLAMA_AWQ[1], ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"),
                                                       "mlp"), _LLAMA_AWQ[3]),
                   prune=dict(_LLAMA_PRUNE, embed_scale="sqrt_hidden", hidden_norms=_GEMMA2_NORMS),
                   rotate=("Gemma 2's post-attention and post-feedforward norms apply a gain to the attention and MLP "
                           "outputs before the residual add; a rotation does not pass through a per-channel gain")),
    "phi3": dict(_LLAMA, attention=("self_attn.qkv_proj", "self_attn.o_proj"),
                 mlp=("mlp.gate_up_proj", "mlp.down_proj"),
                 awq=(("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
                      ("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp")),
                 awq_skip=(("self_attn.qkv_proj -> self_attn.o_proj", _FUSED_QKV),
                           ("mlp.gate_up_proj -> mlp.down_proj", "up is fused with gate in gate_up_proj")),
                 no_clip=("self_attn.qkv_proj",),
                 prune=dict(_LLAMA_PRUNE, heads="fused", attn=dict(qkv="self_attn.qkv_proj", o="self_attn.o_proj"),
                            mlp_in=("mlp.gate_up_proj",), fused_halves=True),
                 rotate=_WRITERS),
    # llama.cpp's llama graph with expert_count: softmax top-k, renormalised
    "mixtral": dict(_MOE, rotate=_MOE_ROTATE, gguf=_GGUF_LLAMA),
    "qwen3_moe": dict(_MOE, norms=_QK_NORMS, rotate=_MOE_ROTATE,
                      gguf=GGUFArch("qwen3moe", permute_qk=False, qk_norms=("self_attn.q_norm", "self_attn.k_norm"))),
    "olmoe": dict(_MOE, norms=_QK_NORMS, rotate=_MOE_ROTATE),
    "qwen2_moe": dict(_MOE, mlp=_SHARED + ("mlp.shared_expert.down_proj",), awq=(
        _MOE_AWQ[0], _MOE_AWQ[1],
        ("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj") + _SHARED, "mlp"),
        _MOE_AWQ[3], ("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",), "mlp.shared_expert.down_proj")),
        rotate=_MOE_ROTATE),
    # gpt-oss: its experts compute (clamp(up) + 1) * glu(clamp(gate)), and (up / s + 1) != (up + 1) / s: only the norm
    # pair scales.
    "gpt_oss": dict(_MOE, awq=_MOE_AWQ[:3], awq_skip=(
        ("mlp.experts.*.up_proj -> mlp.experts.*.down_proj", "gpt-oss multiplies the gate by (up + 1) after a "
         "clamp: scaling up's rows does not scale what down_proj reads"),), rotate=_MOE_ROTATE),
    # DeepSeek-V3: multi-head latent attention (q through a low-rank q_a/q_b when q_lora_rank is set, k/v through
    # kv_a_proj_with_mqa and its norm): no attention pairs are known; the first first_k_dense_replace blocks have a
    # dense MLP, the others experts plus shared experts.
    "deepseek_v3": dict(
        _LLAMA, attention=("self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"), mlp=(),
        norms=("input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm"),
        awq=(_LLAMA_AWQ[2], _LLAMA_AWQ[3],
             ("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj",
                                           "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "mlp"),
             _MOE_AWQ[3],
             ("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",), "mlp.shared_experts.down_proj")),
        awq_skip=(("input_layernorm -> attention", "multi-head latent attention: q_a_proj / kv_a_proj_with_mqa read "
                   "the norm, but their pairs are not mapped yet"),),
        no_clip=(), rotate=_MOE_ROTATE),
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
        prune=dict(heads=_TIED_WIDTH.format(family="OPT", axis="hidden_size"), hidden=_TIED_WIDTH.format(
            family="OPT", axis="the heads"), mlp_in=("fc1",), mlp_out="fc2",
            config=dict(intermediate="ffn_dim", layers="num_hidden_layers")),
        rotate=_LAYERNORM.format(family="OPT"),
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
        prune=dict(heads=_TIED_WIDTH.format(family="GPT-NeoX", axis="hidden_size"), hidden=_TIED_WIDTH.format(
            family="GPT-NeoX", axis="the heads"), mlp_in=("mlp.dense_h_to_4h",), mlp_out="mlp.dense_4h_to_h",
            config=dict(intermediate="intermediate_size", layers="num_hidden_layers")),
        rotate=_LAYERNORM.format(family="GPT-NeoX"),
    ),
    "gpt2": dict(
        blocks="transformer.h", embed="transformer.wte", final_norm="transformer.ln_f", lm_head="lm_head",
        attention=("attn.c_attn", "attn.c_proj"), mlp=("mlp.c_fc", "mlp.c_proj"), norms=("ln_1", "ln_2"),
        awq=(("ln_1", ("attn.c_attn",), "attn"), ("ln_2", ("mlp.c_fc",), "mlp")),
        awq_skip=(("attn.c_attn -> attn.c_proj", _FUSED_QKV), ("mlp.c_fc -> mlp.c_proj", _GELU)),
        no_clip=("attn.c_attn",),
        prune=dict(heads=_TIED_WIDTH.format(family="GPT-2", axis="n_embd"), hidden=_TIED_WIDTH.format(
            family="GPT-2", axis="the heads"), mlp_in=("mlp.c_fc",), mlp_out="mlp.c_proj",
            config=dict(intermediate="n_inner", layers="n_layer")),
        rotate=_LAYERNORM.format(family="GPT-2"), conv1d=True,
    ),
    "qwen2_5_vl": dict(_VLM, vision=(("model.visual", "vision tower (its merger is the projector)"),),
                       rotate=_VLM_ROTATE),
    "qwen3_vl": dict(_VLM, norms=_QK_NORMS, vision=(("model.visual", "vision tower (its mergers are the projector)"),),
                     rotate=_VLM_ROTATE),
    "gemma3": dict(_VLM, norms=_GEMMA2_NORMS + ("self_attn.q_norm", "self_attn.k_norm"), norm_offset=1.0,
                   awq=(_LLAMA_AWQ[0], _LLAMA_AWQ[1], ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"),
                                                       "mlp"), _LLAMA_AWQ[3]),
                   vision=_TOWER_PROJECTOR, rotate=_VLM_ROTATE),
    "mistral3": dict(_VLM, vision=_TOWER_PROJECTOR, rotate=_VLM_ROTATE),
    # Llama 3.2 Vision: self-attention blocks as Llama's, and cross-attention blocks (cross_attn) that read the images
    "mllama": dict(_VLM, vision=(("model.vision_model", "vision tower"), ("model.multi_modal_projector",
                                                                          "multimodal projector")),
                   cross_attention="cross_attn", rotate=_VLM_ROTATE),
}
