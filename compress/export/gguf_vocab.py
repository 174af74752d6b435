"""The tokenizer of a GGUF file (tokenizer.ggml.* keys): built from a Hugging Face byte-level BPE tokenizer as
llama.cpp's convert_hf_to_gguf.py builds it (`hf_vocab`, `write_hf_vocab`), or copied from the .gguf file the model
came from (`copy_gguf_tokenizer`).
"""
from __future__ import annotations

import json
from pathlib import Path

from .gguf_names import gguf_package

# llama.cpp's tokenizer.ggml.pre names (src/llama-vocab.cpp maps each to its own splitting regexes) and the
# Hugging Face pre-tokenizers that split text the same way.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt-2": "ByteLevel(use_regex=True)",
    "smollm": "Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]",
    "llama-bpe": "Sequence[Split(llama-3 regex), ByteLevel(use_regex=False)]",
    "qwen2": "Sequence[Split(qwen2 regex), ByteLevel(use_regex=False)]",
}
# gguf.TokenType values
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _pre_name(spec: dict | None) -> str | None:
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "ByteLevel" and spec.get("use_regex", True):
        return "gpt-2"
    if kind != "Sequence":
        return None
    parts = spec.get("pretokenizers", [])
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = (parts[0].get("pattern") or {}).get("Regex")
        return {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}.get(regex)
    return None


def hf_vocab(tokenizer, n_vocab: int, pre: str | None = None) -> dict:
    """tokenizer.ggml.* values for a byte-level BPE (GPT-2 style) Hugging Face fast tokenizer, laid out as
    convert_hf_to_gguf.py's _set_vocab_gpt2 does: ids the tokenizer lacks become UNUSED [PAD<i>] tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("the GGUF tokenizer is built from a fast (tokenizers) tokenizer; this one is "
                         f"{type(tokenizer).__name__}. Pass source_gguf= when the model came from a .gguf file")
    spec = json.loads(backend.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or \
        (spec.get("decoder") or {}).get("type") == "ByteLevel"
    if spec["model"]["type"] != "BPE" or not byte_level:
        raise ValueError(f"the GGUF exporter builds byte-level BPE (GPT-2 style) vocabularies; this tokenizer is "
                         f"{spec['model']['type']} without byte-level pre-tokenization (SentencePiece style). "
                         "Convert with llama.cpp's convert_hf_to_gguf.py, or pass source_gguf= when the model came "
                         "from a .gguf file")
    if pre is None:
        pre = _pre_name(spec.get("pre_tokenizer"))
        if pre is None:
            known = "; ".join(f"{k} = {v}" for k, v in PRE_TOKENIZERS.items())
            raise ValueError(f"unknown pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:300]}: llama.cpp needs "
                             f"its name (tokenizer.ggml.pre). Known here: {known}. Pass pre=<llama.cpp name> (see "
                             "llama.cpp's src/llama-vocab.cpp) if you know which one splits the same way")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())} but the embedding has {n_vocab} rows")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        tok = reverse[i]
        if tok in added:
            info = decoder.get(i)
            if info is not None and not info.normalized:  # llama.cpp expects added tokens pre-normalized
                tok = tokenizer.decode(tokenizer.encode(tok, add_special_tokens=False))
            types.append(CONTROL if info is None or info.special else USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(tok)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    plain = tokenizer("a", add_special_tokens=False).input_ids
    special = tokenizer("a", add_special_tokens=True).input_ids
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = {"model": "gpt2", "pre": pre, "tokens": tokens, "token_type": types, "merges": merges,
           "bos": bos, "eos": eos, "unk": tokenizer.unk_token_id, "pad": tokenizer.pad_token_id,
           "add_bos": bos is not None and len(special) > len(plain) and special[0] == bos,
           "add_eos": eos is not None and len(special) > len(plain) and special[-1] == eos,
           "chat_template": tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str)
           else None}
    if not merges:
        raise ValueError("the tokenizer has no BPE merges; llama.cpp's gpt2 vocabulary needs them")
    return out


def write_hf_vocab(writer, v: dict) -> None:
    writer.add_tokenizer_model(v["model"])
    writer.add_tokenizer_pre(v["pre"])
    writer.add_token_list(v["tokens"])
    writer.add_token_types(v["token_type"])
    writer.add_token_merges(v["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if v[key] is not None:
            add(v[key])
    writer.add_add_bos_token(v["add_bos"])
    writer.add_add_eos_token(v["add_eos"])
    if v["chat_template"]:
        writer.add_chat_template(v["chat_template"])


def copy_gguf_tokenizer(writer, reader, source_gguf: str | Path, n_vocab: int) -> list[str]:
    """Copy every tokenizer.* key of `reader` (a GGUFReader on source_gguf), types and bytes as they are.
    Returns the keys."""
    gguf = gguf_package()
    keys = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [x.item() if hasattr(x, "item") else x for x in field.contents()]
            if key == "tokenizer.ggml.tokens" and len(value) != n_vocab:
                raise ValueError(f"{source_gguf} has {len(value)} tokens but the model's embedding has {n_vocab} rows")
            writer.add_key_value(key, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), vtype)
        else:
            writer.add_key_value(key, field.contents(), vtype)
        keys.append(key)
    if "tokenizer.ggml.tokens" not in keys:
        raise ValueError(f"{source_gguf} has no tokenizer.ggml.tokens; export with source_gguf=None to build the "
                         "tokenizer from the Hugging Face one")
    return keys

