"""Calibration statistics for the GGUF K-quant export: per linear layer, the mean x^2 of every input column
(llama.cpp's importance matrix: tools/imatrix accumulates x^2 over every token a matmul sees and llama-quantize
divides by the count) and, optionally, the input Hessian X^T X / n that GPTQ onto the GGUF grid uses."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn import QuantLinear


@torch.no_grad()
def calibration_stats(model: nn.Module, windows: Tensor, hessians: bool = False, batch_size: int = 1) \
        -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Run token windows (int64 [B, T]) through `model`; returns ({module name: mean x^2 [in]},
    {module name: X^T X / n [in, in]} or {} without `hessians`) for every nn.Linear / QuantLinear."""
    sums: dict[str, Tensor] = {}
    grams: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def hook(name):
        def fn(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()  # [tokens, in]
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
            if hessians:
                grams[name] = grams.get(name, 0) + x.T @ x
        return fn

    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, QuantLinear)):
            hooks.append(module.register_forward_pre_hook(hook(name)))
    try:
        for i in range(0, windows.shape[0], batch_size):
            model(input_ids=windows[i:i + batch_size], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    imatrix = {k: (v / counts[k]).float() for k, v in sums.items()}
    return imatrix, {k: (v / counts[k]).float() for k, v in grams.items()}
