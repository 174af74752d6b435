"""How transformers' forward is called for decoding, across its versions: the KV cache's keyword, and asking for the
last position's logits only."""
from __future__ import annotations

import inspect

from torch import nn


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x calls the KV cache `cache`; 4.x called it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def last_logits_kwarg(model: nn.Module) -> dict:
    """Prefill needs the last position's logits only (a server samples from them): skip the rest when the model
    can, so a batch × context × vocabulary logits tensor is never built."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
