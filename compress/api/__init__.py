"""The Python API: compress the model already in memory, evaluate it, save and export it, load it back.

    import compress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    result = compress.compress(model, tokenizer, "recipes/awq_int4.yaml", dataset=texts)
    result.report.ppl, result.report.kl          # the report, as an object (result.report.data: report.json)
    result.save("out/awq")                        # the run folder `compress run` writes
    result.export("compressed-tensors", "out/ct") # any format of `compress export --help`
    model, tokenizer = compress.load("out/awq")

The command line is a layer over these functions: `compress run` is `run`, `compress eval` is `evaluate`.
"""
from __future__ import annotations

from .result import Report, Result
from .session import compress, evaluate, load, run

__all__ = ["compress", "evaluate", "load", "run", "Report", "Result"]
