"""Structured pruning (Minitron): importance scores, targets, and physical slicing."""
from .importance import Importance, activation_importance, layer_drop_ppl
from .minitron import TargetShape, count_params, minitron_prune, resolve_shape
from .slicing import prune_heads, prune_hidden, prune_layers, prune_mlp

__all__ = ["Importance", "TargetShape", "activation_importance", "count_params", "layer_drop_ppl",
           "minitron_prune", "prune_heads", "prune_hidden", "prune_layers", "prune_mlp", "resolve_shape"]
