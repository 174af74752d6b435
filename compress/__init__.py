"""compress: quantize, prune and distill Hugging Face causal LMs, and score what it cost."""
import os

from ._version import __version__  # noqa: F401

# With several OpenMP threads, idle threads spin by default and stall small VMs; passive waiting costs
# nothing on a busy machine. Must be set before torch loads its OpenMP runtime (a user's value wins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .qtensor import QuantizedTensor  # noqa: E402
from .quantizers import quantize_rtn  # noqa: E402
from .scheme import PRESETS, QuantScheme  # noqa: E402

__all__ = ["__version__", "QuantScheme", "QuantizedTensor", "PRESETS", "quantize_rtn", "load_recipe", "run"]


def load_recipe(path, overrides=()):
    from .recipe import load_recipe as _load
    return _load(path, overrides)


def run(recipe, **kwargs):
    from .pipeline import run as _run
    return _run(recipe, **kwargs)
