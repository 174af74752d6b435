"""Calibration statistics for the GGUF K-quant export: per linear layer, the mean x^2 of every input column
(llama.cpp's importance matrix: tools/imatrix accumulates x^2 over every token a matmul sees and llama-quantize
divides by the count) and, optionally, the input Hessian X^T X / n that GPTQ onto the GGUF grid uses."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.nn import QuantLinear


@torch.no_grad()
def calibration_stats(model: nn.Module, windows: Tensor, hessians: bool = False, batch_size: int = 1) \
        -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Run token windows (int64 [B, T]) through `model`; returns ({module name: mean x^2 [in]},
    {module name: X^T X / n [in, in]} or {} without `hessians`) for every nn.Linear / QuantLinear."""
    sums: dict[str, Tensor] = {}
    grams: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    seen: dict = {}  # one forward's statistics per input tensor: q / k / v (gate / up) share theirs

    def hook(name):
        def fn(_module, args):
            key = id(args[0])  # the entry holds the tensor, so no other input can take its id this forward
            if key not in seen:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
                seen[key] = (args[0], (x * x).sum(0).double(), (x.T @ x).double() if hessians else None, x.shape[0])
            _, sq, gram, n = seen[key]
            sums[name] = sums.get(name, 0) + sq  # float64 across windows
            counts[name] = counts.get(name, 0) + n
            if hessians:
                grams[name] = grams.get(name, 0) + gram
        return fn

    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, QuantLinear)):
            hooks.append(module.register_forward_pre_hook(hook(name)))
    try:
        for i in range(0, windows.shape[0], batch_size):
            seen.clear()
            model(input_ids=windows[i:i + batch_size], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    imatrix = {k: (v / counts[k]).float() for k, v in sums.items()}
    return imatrix, {k: (v / counts[k]).float() for k, v in grams.items()}


EXPORT_WINDOWS, EXPORT_SEQ_LEN = 32, 512  # what bench/gguf_kquants.py measured


def export_calibration(model: nn.Module, tokenizer) -> tuple[dict, str]:
    """Statistics for a K-quant export run from `compress export` / a recipe's output.formats: EXPORT_WINDOWS
    windows of EXPORT_SEQ_LEN tokens of WikiText-2 validation (seed 0, the calibration preset's text), the imatrix
    for every layer and Hessians where a linear layer is still float (GPTQ onto the GGUF grid). Returns
    (write_gguf keyword arguments, the note for the report); without local WikiText-2 the statistics are empty and
    the note says the file was quantized as llama-quantize does without --imatrix."""
    from ..calibrate.data import TextSource, calibration_windows, find_data_dir

    if tokenizer is None or find_data_dir() is None:
        return {}, ("no calibration text (WikiText-2 under COMPRESS_DATA_DIR) or tokenizer: quantized without an "
                    "importance matrix, as llama-quantize without --imatrix")
    float_linears = any(isinstance(m, nn.Linear) for n, m in model.named_modules() if ".layers." in n)
    ids = calibration_windows(TextSource(), tokenizer, model, EXPORT_WINDOWS, EXPORT_SEQ_LEN, 0)
    imatrix, hessians = calibration_stats(model, ids, hessians=float_linears)
    how = "imatrix" + (" + GPTQ onto the GGUF grid for float layers" if float_linears else "")
    return ({"imatrix": imatrix, "hessians": hessians or None},
            f"calibrated ({how}) on {EXPORT_WINDOWS} x {EXPORT_SEQ_LEN} tokens of WikiText-2 validation, seed 0")
