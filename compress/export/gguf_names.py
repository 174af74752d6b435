"""Tensor names in GGUF files, from gguf's own table: gguf.TensorNameMap (get_tensor_name_map), the one
llama.cpp's convert_hf_to_gguf.py names tensors by. The writer (gguf.py) names the tensors it writes with it and
the reader (compress/model/gguf_source.py) maps a file's tensors back to the model's names with it, so both agree with
llama.cpp by construction.

gguf 0.19's TensorNameMap(arch) updates its class-wide block table with the architecture's own entries (ARCTIC's:
post_attention_layernorm -> ffn_norm_exps), so once an ARCTIC map is built in a process, later maps of llama, qwen2
and qwen3moe (which have no ffn_norm_exps) name no post_attention_layernorm; the writer then refuses the model,
naming that tensor, rather than writing a wrong name.
"""
from __future__ import annotations


def gguf_package():
    """The `gguf` package, or an ImportError that names the install."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("the GGUF export needs the `gguf` package: pip install gguf") from exc
    return gguf


def tensor_name_map(architecture: str, n_blocks: int):
    """gguf's TensorNameMap of the GGUF architecture `architecture` (general.architecture: llama, qwen2,
    qwen3moe, ...) over `n_blocks` decoder blocks; None when this gguf does not know the architecture."""
    gguf = gguf_package()
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture), None)
    return None if arch is None else gguf.get_tensor_name_map(arch, n_blocks)


def gguf_name(table, name: str) -> str | None:
    """The GGUF name of the model's tensor or module `name`, a .weight / .bias suffix kept
    (model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight); None when `table` has none."""
    stem, dot, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "")
    found = table.get_name(stem)
    return None if found is None else found + dot + suffix


def block_names(architecture: str, modules) -> dict[str, str]:
    """{module name within a decoder block: its GGUF name within blk.N} for `modules` (self_attn.q_proj ->
    attn_q)."""
    table = tensor_name_map(architecture, 1)
    return {m: gguf_name(table, f"model.layers.0.{m}").removeprefix("blk.0.") for m in modules}
