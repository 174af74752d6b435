"""compress: quantize, prune and distill Hugging Face causal LMs, and score what it cost.

The Python API (api/): `compress.compress(model, tokenizer, recipe)` compresses a model already loaded and returns
a Result (model, report, .save(), .export()); `compress.evaluate`, `compress.load`, `compress.run` (a recipe file,
as `compress run`).

Importing the package changes nothing in the process (no environment variables, no torch import): the names below
load on first use. The `compress` command sets its own process defaults in cli/commands.py.
"""
from ._version import __version__

__all__ = ["__version__", "compress", "evaluate", "load", "run", "Result", "Report", "QuantScheme",
           "QuantizedTensor", "PRESETS", "quantize_rtn", "load_recipe"]

_LAZY = {"QuantScheme": "core.scheme", "PRESETS": "core.scheme", "QuantizedTensor": "core.qtensor",
         "quantize_rtn": "quantizers", "compress": "api", "evaluate": "api", "load": "api", "run": "api",
         "Result": "api", "Report": "api"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'compress' has no attribute {name!r}")


def load_recipe(path, overrides=()):
    from .recipe import load_recipe as _load
    return _load(path, overrides)
