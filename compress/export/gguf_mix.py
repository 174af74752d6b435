"""Which llama.cpp block type each tensor of a K-quant GGUF file gets: llama-quantize's mixes.

Follows src/llama-quant.cpp (ggml-org/llama.cpp @ 007dbbf3; checked against the llama.cpp bundled with
llama-cpp-python 0.3.36 by tests/test_gguf_kquants.py, which quantizes the same F16 file with its
llama_model_quantize and compares every tensor's type and bytes): llama_tensor_get_type_impl, then
tensor_type_fallback. The rules implemented, for the dense and MoE Llama-family graphs this exporter writes:

  output.weight, and token_embd when the embeddings are tied: Q8_0 if its rows are not whole super-blocks
      (ncols % 256), else Q6_K (the Q8_0 default keeps Q8_0)
  Q4_K_M / Q5_K_M (default Q4_K / Q5_K):
      attn_v   Q6_K in the use_more_bits layers (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2)
      ffn_down Q6_K in the use_more_bits layers
      with 8 experts (Mixtral): attn_v and attn_k Q8_0, attn_output Q5_K
  Q6_K: every tensor Q6_K
  pure q4_k / q5_k (llama-quantize --pure): every linear in the type; token_embd / output as above (our
      writer's habit of keeping the embedding above a 4-bit type; --pure would write them in the type too)
  fallback, a row of ncols % 256 != 0 weights: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even
      32 does not divide it.
"""
from __future__ import annotations

import re

# llama.cpp block formats we write; the K-quant ones with llama-quantize's per-tensor mixes (gguf_mix.py)
GGUF_TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")

QK_K = 256
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# our format -> (llama.cpp default type, general.file_type name, whether the _M rules apply)
K_FORMATS = {
    "q4_k": ("Q4_K", "MOSTLY_Q4_K_S", False),  # no pure-Q4_K ftype exists; Q4_K_S is the nearest name
    "q5_k": ("Q5_K", "MOSTLY_Q5_K_S", False),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K", False),
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M", True),
    "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M", True),
}
BLOCK = {"Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32,
         "F16": 1, "F32": 1}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _layer(gname: str) -> int:
    match = re.match(r"blk\.(\d+)\.", gname)
    if match is None:
        raise ValueError(f"cannot tell the layer of tensor {gname!r}")
    return int(match.group(1))


def fallback(kind: str, ncols: int) -> tuple[str, str | None]:
    """tensor_type_fallback: the type actually written for rows of `ncols`, and why it changed (None: it did not)."""
    if ncols % BLOCK[kind] == 0:
        return kind, None
    new = FALLBACK.get(kind, "F16")
    if ncols % BLOCK[new]:
        new = "F16"
    return new, f"ncols {ncols} not divisible by {BLOCK[kind]} (required for {kind}): llama.cpp's fallback {new}"


def tensor_type(fmt: str, gname: str, ncols: int, n_layer: int, tied: bool, n_expert: int = 0) \
        -> tuple[str, str | None]:
    """(ggml type name, fallback note or None) for GGUF tensor `gname` whose rows hold `ncols` weights, in
    K-quant format `fmt` (a key of K_FORMATS)."""
    default, _, mix = K_FORMATS[fmt]
    kind = default
    if gname == "output.weight" or (tied and gname == "token_embd.weight"):
        return ("Q8_0" if ncols % QK_K else "Q6_K"), None  # the output rule (no fallback: already checked)
    if mix and gname != "token_embd.weight":
        what = gname.split(".")[2]
        i = _layer(gname)
        if what == "attn_v":
            kind = "Q8_0" if n_expert == 8 else "Q6_K" if use_more_bits(i, n_layer) else default
        elif what == "attn_k" and n_expert == 8:
            kind = "Q8_0"
        elif what.startswith("ffn_down") and use_more_bits(i, n_layer):
            kind = "Q6_K"
        elif what == "attn_output" and n_expert == 8 and fmt == "q4_k_m":
            kind = "Q5_K"
    return fallback(kind, ncols)
