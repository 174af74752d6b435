"""bitsandbytes' own LLM.int8: every decoder-block linear replaced by `bnb.nn.Linear8bitLt`, which quantizes
the float weight itself (float16 row absmax) and picks outlier columns per batch. The reference our LLM.int8
is compared with (tests and bench/outlier_table.py); bitsandbytes runs on CPU here."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def to_bitsandbytes_int8(model: nn.Module, blocks_prefix: str, threshold: float = 6.0) -> int:
    """Swap nn.Linear layers under `blocks_prefix` for Linear8bitLt in place; returns how many."""
    import bitsandbytes as bnb

    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(blocks_prefix + ".")]
    for name in names:
        old = model.get_submodule(name)
        new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=old.bias is not None,
                                  has_fp16_weights=False, threshold=threshold)
        new.weight = bnb.nn.Int8Params(old.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data.clone(), requires_grad=False)
        new = new.to(old.weight.device)  # Int8Params quantizes on the move
        # A fresh module is in training mode, and in training bitsandbytes' CPU path dequantizes the weight
        # and multiplies in float (MatMul8bitFp): no int8 activations, no outlier split. Inference mode runs
        # LLM.int8 itself (MatMul8bitLt).
        new.eval()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return len(names)
