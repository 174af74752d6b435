"""The one evaluation protocol behind every accuracy table in the README.

WikiText-2 raw test, rows joined with "\\n\\n" and tokenized once (the GPTQ/AWQ perplexity protocol), the first
WINDOWS non-overlapping windows of SEQ_LEN tokens (16,376 predicted tokens: the whole split, about 140 windows,
takes ~28 minutes per model on this CPU), every model of a table scored in one loop over the same windows
against the same float32 baseline (SmolLM2-135M-Instruct, perplexity 19.134 on them). Compressed models are saved
with float32 float tensors (embeddings, norms), so a saved model differs from the baseline by its quantization
alone. Defaults are chosen on validation text (bench/validation_defaults.py), never on these windows.
"""
from __future__ import annotations

SPLIT, SEQ_LEN, WINDOWS = "test", 2048, 8
SAVE_FLOAT32 = ["--set", "output.save_dtype=float32"]  # `compress run` arguments: float tensors saved exactly
DESCRIPTION = (f"WikiText-2 {SPLIT}, the first {WINDOWS} windows of {SEQ_LEN} tokens "
               f"({WINDOWS * (SEQ_LEN - 1):,} predicted tokens), float32 baseline, float32 saves")


def windows(tokenizer):
    """The protocol's token windows [WINDOWS, SEQ_LEN]."""
    from compress.pipeline.report import eval_windows
    return eval_windows(tokenizer, SPLIT, SEQ_LEN, WINDOWS)


def as_dict() -> dict:
    return {"split": SPLIT, "seq_len": SEQ_LEN, "windows": WINDOWS, "baseline": "float32",
            "saves": "float32 float tensors", "description": DESCRIPTION}
