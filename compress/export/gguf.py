"""GGUF for llama.cpp: one .gguf file holding the weights in a llama.cpp block format, the model's
hyper-parameters, the tokenizer and the chat template.

This module checks a model (`gguf_problems`) and writes the file (`write_gguf`). The parts it writes with:
gguf_names.py (tensor names: gguf's own TensorNameMap), gguf_encode.py (block formats: exact re-encoding of our
codes, float quantization), gguf_kquants.py / gguf_mix.py (K-quants and llama-quantize's per-tensor mixes),
gguf_vocab.py (tokenizer), gguf_llama_cpp.py (running the file in llama.cpp).

A quantized layer whose grid is the block format's is re-encoded from its integer codes and scales as they are
("exact"): llama.cpp then computes with the very weights the in-memory model uses. Any other quantized layer is
dequantized and quantized again with llama.cpp's quantizer ("requantized"); float layers are quantized from
float ("quantized-from-float"). Norms and biases stay F32.

Tensor names and hyper-parameter keys follow llama.cpp's converter (convert_hf_to_gguf.py,
conversion/llama.py): for the llama architecture the rows of attn_q / attn_k are permuted per head from
the rotate-half layout transformers uses to the interleaved pairs llama.cpp's RoPE reads.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import Tensor, nn

from ..arch import families_with, family_spec
from ..arch.moe import ExpertLinears
from ..arch.tables import GGUFArch
from ..core.nn import QuantLinear, linear_shape, linear_weight
from .gguf_encode import (BLOCK, encode_exact, encode_q4_0, encode_q4_1, encode_q8_0, exact_fit,  # noqa: F401
                          ggml_type, permute_rows, quantize_float)
from .gguf_llama_cpp import iter_llama_cpp_logits, llama_cpp_logits, load_llama_cpp  # noqa: F401
from .gguf_mix import BLOCK as MIX_BLOCK, GGUF_TYPES, K_FORMATS, tensor_type
from .gguf_names import block_names, gguf_name, gguf_package, tensor_name_map
from .gguf_vocab import (CONTROL, NORMAL, PRE_TOKENIZERS, UNUSED, USER_DEFINED, copy_gguf_tokenizer,  # noqa: F401
                         hf_vocab, write_hf_vocab)
from .hf import resident

# The families written, and as which GGUF architecture (its name, whether attn_q / attn_k rows are permuted for
# llama.cpp's RoPE, the biases and q/k norms the file holds): the `gguf=` of their entry in compress/arch/tables.py.
# A decoder block's tensors as transformers names them, in the order the file holds them; their GGUF names come from
# gguf's own TensorNameMap (gguf_names.py), as llama.cpp's converter names them
NORMS = ("input_layernorm", "post_attention_layernorm")
BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
# a MoE block's router, and its experts as llama.cpp stacks them: one 3-D tensor [E, out, in] per projection
ROUTER = "mlp.gate"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LINEARS = block_names("llama", BLOCK_LINEARS)  # {block linear: its GGUF name}: self_attn.q_proj -> attn_q


# ---------------------------------------------------------------- model structure

def _rope(config) -> tuple[str, float]:
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    rope_type = params.get("rope_type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "rope_scaling", None):
        rope_type = config.rope_scaling.get("rope_type", config.rope_scaling.get("type", rope_type))
    return rope_type, float(theta)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _tied(model: nn.Module) -> bool:
    head = model.get_output_embeddings()
    return head is not None and not isinstance(head, QuantLinear) and \
        head.weight is model.get_input_embeddings().weight


def gguf_arch(model: nn.Module) -> GGUFArch | None:
    """The GGUF architecture `model`'s family is written as (its table entry's `gguf`), or None."""
    spec = family_spec(model)
    return None if spec is None else spec.gguf


def _entries(model: nn.Module, record: GGUFArch) -> list[tuple[str, str, str]]:
    """(GGUF tensor name, HF module or parameter name, role) for every tensor of the file, in order; the GGUF
    names from gguf's table for the architecture (gguf_names.py). Roles: embed, output, linear, norm, bias, experts."""
    arch = record.name
    table = tensor_name_map(arch, model.config.num_hidden_layers)
    if table is None:
        raise ValueError(f"gguf {version('gguf')} does not know the GGUF architecture {arch!r}; pip install -U gguf")

    def entry(param: str, hf: str, role: str) -> tuple[str, str, str]:
        """`param`: the tensor's name as gguf's table knows it (a module's weight, a stacked expert projection)."""
        gname = gguf_name(table, param)
        if gname is None:
            raise ValueError(f"gguf's {arch} tensor table (TensorNameMap) has no name for {param}: llama.cpp's "
                             f"{arch} graph does not read such a tensor; export `dense`")
        return gname, hf, role

    out = [entry("model.embed_tokens.weight", "model.embed_tokens", "embed")]
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}"
        moe = isinstance(getattr(model.get_submodule(f"{p}.mlp"), "experts", None), ExpertLinears)
        out += [entry(f"{p}.{hf}.weight", f"{p}.{hf}.weight", "norm") for hf in NORMS + record.qk_norms]
        for hf in BLOCK_LINEARS:
            if moe and hf.startswith("mlp."):
                continue
            out.append(entry(f"{p}.{hf}.weight", f"{p}.{hf}", "linear"))
            if hf.rpartition(".")[2] in record.biases:
                out.append(entry(f"{p}.{hf}.bias", f"{p}.{hf}.bias", "bias"))
        if moe:  # the router (float), then each projection of every expert stacked
            out.append(entry(f"{p}.{ROUTER}.weight", f"{p}.{ROUTER}.weight", "norm"))
            out += [entry(f"{p}.mlp.experts.{proj}.weight", f"{p}.mlp.experts|{proj}", "experts")
                    for proj in EXPERT_PROJECTIONS]
    out.append(entry("model.norm.weight", "model.norm.weight", "norm"))
    if not _tied(model):
        out.append(entry("lm_head.weight", "lm_head", "output"))
    return out


def _state_names(model: nn.Module, entries) -> set[str]:
    """The state-dict keys the entries cover."""
    covered = set()
    for _, hf, role in entries:
        if role in ("norm", "bias"):
            covered.add(hf)
            continue
        if role == "experts":
            moe, proj = hf.split("|")
            for e in range(len(model.get_submodule(moe))):
                name = f"{moe}.{e}.{proj}"
                covered |= {f"{name}.{k}" for k in model.get_submodule(name).state_dict()}
            continue
        module = model.get_submodule(hf)
        covered |= {f"{hf}.{k}" for k in module.state_dict()}
    if _tied(model):
        covered.add("lm_head.weight")
    return covered


# ---------------------------------------------------------------- what GGUF cannot hold

def gguf_problems(model: nn.Module, qtype: str) -> list[str]:
    """Why `model` cannot be written as GGUF `qtype` (empty: it can), each with the way out."""
    if qtype not in GGUF_TYPES:
        return [f"unknown GGUF type {qtype!r}; choose one of {', '.join(GGUF_TYPES)}"]
    cls = type(model).__name__
    record = gguf_arch(model)
    if record is None or not cls.endswith("ForCausalLM"):
        return [f"{cls} ({getattr(model.config, 'model_type', '?')}) is not an architecture the GGUF exporter "
                f"writes (it writes the model types {', '.join(families_with('gguf'))}: those whose entry in "
                "compress/arch/tables.py has gguf=); export `dense` and convert it with llama.cpp's "
                "convert_hf_to_gguf.py, or export another format"]
    problems = _config_problems(model, record.name)
    try:
        entries = _entries(model, record)
        uncovered = sorted(set(model.state_dict()) - _state_names(model, entries))
    except AttributeError as exc:
        return problems + [f"{cls}: module layout differs from the one this exporter maps ({exc})"]
    except ValueError as exc:  # gguf names no such architecture or tensor
        return problems + [str(exc)]
    if uncovered:
        problems.append(f"tensors with no GGUF counterpart in this exporter: {uncovered[:6]}"
                        f"{' ...' if len(uncovered) > 6 else ''}")
    return problems + _shape_problems(model) + _layer_problems(model, qtype)


def _config_problems(model: nn.Module, arch: str) -> list[str]:
    """What in the config llama.cpp's `arch` graph does not compute."""
    config = model.config
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r}: llama.cpp's {arch} graph uses SiLU")
    rope_type, _ = _rope(config)
    if rope_type != "default":
        problems.append(f"RoPE scaling {rope_type!r} is not written by this exporter (plain RoPE only); export "
                        "`dense` and convert it with llama.cpp's convert_hf_to_gguf.py")
    if arch == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        problems.append("attention_bias / mlp_bias: this exporter writes bias-free llama models")
    if arch == "qwen3moe":
        if not getattr(config, "norm_topk_prob", True):
            problems.append("norm_topk_prob: false: llama.cpp's qwen3moe graph renormalises the top-k routing "
                            "weights; export `dense`")
        dense = [i for i, layer in enumerate(model.model.layers)
                 if not isinstance(getattr(layer.mlp, "experts", None), ExpertLinears)]
        if dense:
            problems.append(f"blocks {dense[:4]} have a dense MLP (mlp_only_layers / decoder_sparse_step): "
                            "llama.cpp's qwen3moe graph expects experts in every block")
    if arch in ("qwen2", "qwen3moe") and getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window: llama.cpp's qwen2 graph attends to the whole context")
    return problems


def _shape_problems(model: nn.Module) -> list[str]:
    """Linear layers whose shape is not the config's (GGUF holds one width per model), and MoE experts llama.cpp
    cannot run."""
    config = model.config
    n_head, n_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, _head_dim(config)
    expect = {"self_attn.q_proj": (n_head * head_dim, config.hidden_size),
              "self_attn.k_proj": (n_kv * head_dim, config.hidden_size),
              "self_attn.v_proj": (n_kv * head_dim, config.hidden_size),
              "self_attn.o_proj": (config.hidden_size, n_head * head_dim),
              "mlp.gate_proj": (config.intermediate_size, config.hidden_size),
              "mlp.up_proj": (config.intermediate_size, config.hidden_size),
              "mlp.down_proj": (config.hidden_size, config.intermediate_size)}
    problems = []
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        checks = dict(expect)
        if isinstance(experts, ExpertLinears):
            if not experts.layout.has_gate or experts.layout.bias:
                problems.append(f"model.layers.{i}.mlp.experts: llama.cpp's experts are gated and bias-free")
                continue
            width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            checks = {k: v for k, v in expect.items() if not k.startswith("mlp.")}
            checks |= {f"mlp.experts.{e}.{k.partition('.')[2]}": tuple(width if d == config.intermediate_size else d
                                                                        for d in v)
                       for k, v in expect.items() if k.startswith("mlp.") for e in range(len(experts))}
        for rel, shape in checks.items():
            m = layer.get_submodule(rel)
            got = (m.out_features, m.in_features) if isinstance(m, QuantLinear) else tuple(linear_weight(m).shape)
            if got != shape:
                problems.append(f"model.layers.{i}.{rel}: shape {got} differs from the config's {shape}; GGUF "
                                "holds one width per model (fix the config or export `dense`)")
    return problems


def _layer_problems(model: nn.Module, qtype: str) -> list[str]:
    """Quantized layers GGUF cannot hold: activation quantization, rows that are not whole blocks."""
    act, unaligned = [], []
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        if m.scheme.act is not None:
            act.append(f"{name} ({m.scheme.name})")
        elif qtype != "f16" and m.in_features % BLOCK:
            unaligned.append(f"{name} (in_features={m.in_features})")
    problems = []
    if act:
        problems.append(f"{len(act)} layers quantize their activations at run time, e.g. {act[0]}: GGUF stores "
                        "weight-only formats; export the dense or compressed-tensors format instead")
    if unaligned:
        problems.append(f"{len(unaligned)} quantized layers have rows that are not a whole number of {BLOCK}-weight "
                        f"{qtype.upper()} blocks, e.g. {unaligned[0]}; export gguf-f16, or quantize with a group "
                        f"size that is a multiple of {BLOCK}")
    return problems


# ---------------------------------------------------------------- writer

def write_gguf(model: nn.Module, tokenizer, path: str | Path, qtype: str, source_gguf: str | None = None, *,
               embed_qtype: str | None = None, pre: str | None = None, name: str | None = None,
               parts: Iterable | None = None, imatrix: dict | None = None, hessians: dict | None = None) -> dict:
    """Write `model` to the .gguf file `path` with its weights in `qtype` (one of GGUF_TYPES).

    K-quant formats (q4_k, q5_k, q6_k, q4_k_m, q5_k_m): each tensor's type follows llama-quantize's mix and
    fallback rules (gguf_mix.py). imatrix: {HF module name: mean x^2 per input column} from calibration
    (calibration_stats): float and requantized weights are then quantized with llama.cpp's importance-weighted
    quantizer, as llama-quantize --imatrix does. hessians: {HF module name: X^T X / n [in, in]}: float weights
    are quantized by GPTQ onto the very block grid llama.cpp's imatrix quantizer picks (gguf_gptq.py).

    source_gguf: the .gguf the model was loaded from; its tokenizer.* keys (vocabulary, merges, special ids,
    chat template) are copied as they are. Without it they are built from `tokenizer` (byte-level BPE).
    embed_qtype: type of token_embd (and of a float output head); default q8_0 for the 4-bit types (as
    llama-quantize keeps the output / tied embedding above the 4-bit type), else `qtype`.
    pre: llama.cpp's pre-tokenizer name, when the Hugging Face one is not in PRE_TOKENIZERS.
    parts: streaming.stream_parts of a streamed model; each tensor is encoded when its part is in memory and goes
    to a temporary file beside `path` at once (the file's header, written first, needs every tensor's size), so
    memory holds one block.
    Returns the report: per GGUF tensor its type and path (exact, requantized, quantized-from-float,
    dequantized, float), counts, notes.
    """
    embed_qtype = _check_types(model, qtype, embed_qtype)
    gguf = gguf_package()
    record = gguf_arch(model)
    arch = record.name
    n_vocab = model.get_input_embeddings().weight.shape[0]
    notes: list[str] = []

    # tokenizer first: its errors come before any tensor work
    vocab = None
    if source_gguf is None:
        if tokenizer is None:
            raise ValueError("write_gguf needs the tokenizer (or source_gguf=, the .gguf the model came from)")
        vocab = hf_vocab(tokenizer, n_vocab, pre)

    reader = None
    if source_gguf is not None:
        reader = gguf.GGUFReader(str(source_gguf))
        if name is None and "general.name" in reader.fields:
            name = str(reader.fields["general.name"].contents())
    writer = gguf.GGUFWriter(str(path), arch, use_temp_file=True)
    writer.temp_file = tempfile.TemporaryFile(dir=Path(path).parent)  # encoded tensors wait on disk, not in memory
    _write_hyperparameters(writer, model, arch, qtype, name)
    if source_gguf is not None:
        copy_gguf_tokenizer(writer, reader, source_gguf, n_vocab)
        tokenizer_note = f"tokenizer.* copied from {source_gguf}"
    else:
        write_hf_vocab(writer, vocab)
        tokenizer_note = f"built from the Hugging Face tokenizer (tokenizer.ggml.pre={vocab['pre']!r})"
        if not vocab["chat_template"]:
            notes.append("the tokenizer has no chat template; none written")
    notes += _model_notes(model, arch)

    encoder = _TensorEncoder(writer, model, qtype, imatrix, hessians)
    _add_tensors(encoder, model, record, embed_qtype, parts)
    tensors = encoder.tensors
    fallbacks = [g for g, t in tensors.items() if "fallback" in t]
    if fallbacks:
        notes.append(f"{len(fallbacks)} tensors have rows that are not whole 256-weight super-blocks and took "
                     f"llama.cpp's fallback type (e.g. {fallbacks[0]}: {tensors[fallbacks[0]]['fallback']})")
    if embed_qtype != qtype and not encoder.kmix:
        notes.append(f"token_embd{'' if _tied(model) else ' and output'} in {embed_qtype.upper()} (float in the "
                     f"model; llama-quantize likewise keeps the output / tied embedding above a 4-bit type); "
                     "pass embed_qtype= to change")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    counts = dict(Counter(t["path"] for t in tensors.values()))
    types = dict(Counter(t["type"] for t in tensors.values()))
    return {"qtype": qtype, "arch": arch, "file": Path(path).name, "bytes": Path(path).stat().st_size,
            "tokenizer": tokenizer_note, "tensors": tensors, "counts": counts, "types": types,
            "tied_embeddings": _tied(model), "notes": notes}


def _check_types(model: nn.Module, qtype: str, embed_qtype: str | None) -> str:
    """Refuse what cannot be written (gguf_problems, an embed_qtype that does not apply); the embedding's type."""
    problems = gguf_problems(model, qtype)
    if problems:
        raise ValueError("cannot export to GGUF " + qtype + ":\n  " + "\n  ".join(problems))
    if qtype in K_FORMATS and embed_qtype is not None:
        raise ValueError(f"embed_qtype= is for the 32-block types; {qtype} types token_embd / output by "
                         "llama-quantize's rules (gguf_mix.py)")
    if embed_qtype is None:
        embed_qtype = "q8_0" if qtype in ("q4_0", "q4_1") else qtype
    if embed_qtype not in GGUF_TYPES:
        raise ValueError(f"embed_qtype={embed_qtype!r}; choose one of {', '.join(GGUF_TYPES)}")
    return embed_qtype


def _write_hyperparameters(writer, model: nn.Module, arch: str, qtype: str, name: str | None) -> None:
    """The model's general.* and <arch>.* keys, as llama.cpp's converter writes them."""
    gguf = gguf_package()
    config = model.config
    n_head, n_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, _head_dim(config)
    n_vocab, hidden = model.get_input_embeddings().weight.shape
    writer.add_name(name or Path(str(getattr(config, "_name_or_path", "") or arch)).name or arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(_rope(config)[1])
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim * n_head != hidden:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(n_vocab)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    file_types = {"f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"} | \
        {k: v[1] for k, v in K_FORMATS.items()}
    writer.add_file_type(int(getattr(gguf.LlamaFileType, file_types[qtype])))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _model_notes(model: nn.Module, arch: str) -> list[str]:
    """What of the model the file does not carry, or llama.cpp computes differently."""
    config = model.config
    notes = []
    window = getattr(config, "sliding_window", None)
    if arch == "llama" and window and window < config.max_position_embeddings:
        notes.append(f"sliding_window={window}: llama.cpp's llama graph attends to the full context, so outputs "
                     f"match only for contexts up to {window} tokens")
    if any(getattr(m, "k_scale", None) is not None and hasattr(m, "kv_cache_dtype") for m in model.modules()):
        notes.append("fp8 KV-cache scales are not part of GGUF; they were left out (llama.cpp picks its KV type "
                     "at load time)")
    return notes


class _TensorEncoder:
    """Encodes the file's tensors one by one into `writer` (their bytes wait in its temporary file) and keeps the
    report's entry of each in `tensors`: block type, path (exact, requantized, quantized-from-float, dequantized,
    float), shape, notes."""

    def __init__(self, writer, model: nn.Module, qtype: str, imatrix: dict | None, hessians: dict | None):
        self.writer, self.model, self.qtype = writer, model, qtype
        self.kmix = qtype in K_FORMATS
        config = model.config
        self.n_expert = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
        self.imatrix, self.hessians = imatrix or {}, hessians or {}
        self.tensors: dict[str, dict] = {}

    def pick(self, gname: str, ncols: int, target: str) -> tuple[str, dict]:
        """The block type of tensor `gname` (lower case) and the report's note on a fallback."""
        if not self.kmix:
            return target, {}
        kind, why = tensor_type(self.qtype, gname, ncols, self.model.config.num_hidden_layers, _tied(self.model),
                                self.n_expert)
        return kind.lower(), ({"fallback": why} if why else {})

    def encode_float(self, w: Tensor, ggml: str, hf: str | None) -> tuple[np.ndarray, dict]:
        """Block bytes of float weights `w` in `ggml`, with the calibration statistics of layer `hf` if any."""
        h = self.hessians.get(hf) if hf is not None else None
        im = self.imatrix.get(hf) if hf is not None else None
        if ggml in ("F16", "F32", "Q8_0") or (h is None and im is None):
            return quantize_float(w, ggml), {}
        if ggml in ("Q4_0", "Q4_1"):
            return quantize_float(w, ggml), {"note": "imatrix not used for Q4_0 / Q4_1 (not ported)"}
        im = np.asarray(im if im is not None else torch.diagonal(torch.as_tensor(h)), np.float32)
        if h is not None:
            from .gguf_gptq import quantize_gptq_gguf
            return quantize_gptq_gguf(w, torch.as_tensor(h), ggml, im), {"method": "gptq"}
        return quantize_float(w, ggml, im), {"method": "imatrix"}

    def add_float(self, gname: str, w: Tensor, target: str, path_name: str, hf: str | None = None, **extra) -> None:
        ggml = target.upper()
        if ggml not in ("F16", "F32") and w.shape[-1] % MIX_BLOCK[ggml]:
            ggml, extra = "F16", {**extra, "note": f"row of {w.shape[-1]} is not a whole number of blocks: F16"}
        data, how = self.encode_float(w, ggml, hf)
        raw = None if ggml in ("F16", "F32") else ggml_type(ggml)
        self.writer.add_tensor(gname, data, raw_dtype=raw)
        self.tensors[gname] = {"type": ggml, "path": path_name if ggml != "F16" or target == "f16" else "float",
                               "shape": list(w.shape), **extra, **how}

    def add_linear(self, gname: str, module: nn.Module, target: str, heads: int | None, hf: str | None = None) -> None:
        """A linear layer's weight: its codes as they are where they fit `target`'s grid, else from float; rows
        permuted per head when `heads` is given."""
        target, extra = self.pick(gname, linear_shape(module)[1], target)
        if not isinstance(module, QuantLinear):
            w = linear_weight(module).detach().float()
            w = w if heads is None else permute_rows(w, heads)
            self.add_float(gname, w, target, "float" if target == "f16" else "quantized-from-float", hf, **extra)
            return
        qt = module.qtensor()
        why = exact_fit(qt, target)
        if why is None:
            data, notes_ = encode_exact(qt, target, heads)
            self.writer.add_tensor(gname, data, raw_dtype=ggml_type(target))
            self.tensors[gname] = {"type": target.upper(), "path": "exact", "shape": list(qt.shape),
                                   "scheme": qt.scheme.name, **extra, **notes_}
            return
        w = qt.dequantize(torch.float32)
        w = w if heads is None else permute_rows(w, heads)
        self.add_float(gname, w, target, "dequantized" if target == "f16" else "requantized", hf,
                       scheme=qt.scheme.name, reason=why, **extra)

    def add_experts(self, gname: str, moe: str, proj: str, target: str) -> None:
        """Every expert's `proj` as one [E, out, in] tensor: each expert's rows encoded as its own 2-D tensor would
        be (exactly where its codes fit the grid), stacked; requantized from float for all when one does not."""
        layers = [self.model.get_submodule(f"{moe}.{e}.{proj}") for e in range(len(self.model.get_submodule(moe)))]
        n_out, n_in = linear_shape(layers[0])
        target, fell = self.pick(gname, n_in, target)
        fits = [isinstance(m, QuantLinear) and exact_fit(m.qtensor(), target) is None for m in layers]
        if all(fits):
            data = np.stack([encode_exact(m.qtensor(), target, None)[0] for m in layers])
            path_name, extra = "exact", {"scheme": layers[0].scheme.name}
        else:
            floats = [m.qtensor().dequantize(torch.float32) if isinstance(m, QuantLinear) else
                      linear_weight(m).detach().float() for m in layers]
            ggml = target.upper() if target == "f16" or floats[0].shape[-1] % MIX_BLOCK[target.upper()] == 0 \
                else "F16"
            data = np.stack([quantize_float(w, ggml) for w in floats])  # no per-expert calibration statistics
            target = ggml.lower()
            path_name = "float" if target == "f16" and not isinstance(layers[0], QuantLinear) else \
                "dequantized" if target == "f16" else \
                "requantized" if isinstance(layers[0], QuantLinear) else "quantized-from-float"
            extra = {}
        self.writer.add_tensor(gname, data, raw_dtype=None if target in ("f16", "f32") else ggml_type(target))
        self.tensors[gname] = {"type": target.upper(), "path": path_name, "shape": [len(layers), n_out, n_in],
                               **extra, **fell}


def _present(model: nn.Module, hf: str, role: str) -> bool:
    """Whether the entry's tensor is in memory (a streamed model holds one part at a time)."""
    if role == "experts":
        moe, proj = hf.split("|")
        return resident(model.get_submodule(f"{moe}.0.{proj}"))
    if role in ("norm", "bias"):
        return not model.get_parameter(hf).is_meta
    if role == "embed":  # looked up each time: a streamed part assigns new tensors
        return not model.get_input_embeddings().weight.is_meta
    return resident(model.get_submodule(hf))


def _add_tensors(encoder: _TensorEncoder, model: nn.Module, record: GGUFArch, embed_qtype: str,
                 parts: Iterable | None) -> None:
    """Every tensor of the file in _entries' order, each encoded once its part of the model is in memory."""
    qtype, config, permute = encoder.qtype, model.config, record.permute_qk
    pending = _entries(model, record)
    for _ in parts if parts is not None else (None,):
        later = []
        for gname, hf, role in pending:
            if not _present(model, hf, role):
                later.append((gname, hf, role))
            elif role in ("norm", "bias"):  # qwen2 biases: rows unpermuted
                encoder.add_float(gname, model.get_parameter(hf).detach(), "f32", "float")
            elif role == "experts":
                encoder.add_experts(gname, *hf.split("|"), qtype)
            elif role == "embed":
                emb = model.get_input_embeddings().weight.detach()
                target, fell = encoder.pick(gname, emb.shape[1], embed_qtype)
                encoder.add_float(gname, emb, target, "float" if target == "f16" else "quantized-from-float",
                                  "lm_head" if _tied(model) else None, **fell)  # tied: the output matmul's statistics
            elif role == "output":
                module = model.get_submodule(hf)
                encoder.add_linear(gname, module, embed_qtype if not isinstance(module, QuantLinear) else qtype, None,
                                   hf)
            else:
                heads = None
                if permute and hf.endswith("q_proj"):
                    heads = config.num_attention_heads
                elif permute and hf.endswith("k_proj"):
                    heads = config.num_key_value_heads
                encoder.add_linear(gname, model.get_submodule(hf), qtype, heads, hf)
        pending = later
    if pending:
        raise ValueError(f"GGUF export: tensors never in memory: {[g for g, _, _ in pending][:5]}")
