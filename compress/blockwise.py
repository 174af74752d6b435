"""The layer-by-layer runner: stream one decoder block at a time through calibration data.

1. Capture the inputs of block 0 (hidden states and the keyword arguments the model passes,
   such as the attention mask and rotary embeddings) with a pre-hook that stops the forward.
2. For each block: move it to the compute device, hand it to the stages (observe, solve,
   replace layers), then feed the *compressed* block's outputs to the next block.
No graph tracing: blocks are called exactly as the model calls them. Peak memory is the model
(on the offload device) + one block + the calibration activations on the compute device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .arch import ArchSpec, get_module, set_module
from .nn import QuantLinear, cached_dequantize, is_linear


class _StopForward(Exception):
    pass


@dataclass
class BlockInputs:
    hidden: list[Tensor]  # one [1, seq_len, hidden] per calibration sample, on the compute device
    kwargs: list[dict]  # what the model passes to every block besides hidden states, per sample


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _move_non_blocks(model: nn.Module, arch: ArchSpec, device) -> None:
    """Move everything except the decoder blocks (embeddings, rotary tables, final norm)."""
    blocks = arch.block_list(model)
    set_module(model, arch.blocks, nn.ModuleList())
    try:
        model.to(device)
    finally:
        set_module(model, arch.blocks, blocks)


@torch.no_grad()
def capture_block_inputs(model: nn.Module, arch: ArchSpec, samples: Tensor, device) -> BlockInputs:
    """Run the model's own forward up to block 0 for each sample [n, seq_len] and keep block 0's inputs."""
    block0 = arch.block_list(model)[0]
    captured = BlockInputs([], [])

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.hidden.append(hidden)
        captured.kwargs.append({k: v for k, v in kwargs.items() if k not in ("hidden_states",)})
        raise _StopForward

    handle = block0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for row in samples:
            try:
                model(input_ids=row[None].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return captured


def matmul_dtype(inputs: BlockInputs, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a block's matmuls run in: `compute_dtype` (under autocast) for a float32 model, else the model's."""
    dtype = inputs.hidden[0].dtype
    return compute_dtype if compute_dtype is not None and dtype == torch.float32 else dtype


@contextlib.contextmanager
def linear_weights_in(block: nn.Module, dtype: torch.dtype):
    """The float linear weights of `block` held as `dtype` copies for a burst of autocast forwards (autocast would
    otherwise cast every weight on every call); the float32 weights are back on exit, untouched."""
    saved = [(m, m.weight.data) for m in block.modules() if is_linear(m) and not isinstance(m, QuantLinear)
             and m.weight.dtype != dtype]
    try:
        for m, w in saved:
            m.weight.data = w.to(dtype)
        yield
    finally:
        for m, w in saved:
            m.weight.data = w


@torch.no_grad()
def block_forward(block: nn.Module, inputs: BlockInputs, compute_dtype: torch.dtype | None = None) -> list[Tensor]:
    """The block on every sample. `compute_dtype` (bfloat16) runs the matmuls of a float32 block in that dtype under
    autocast (a 16-bit model already computes in its own dtype); outputs return in the inputs' dtype, so the
    residual stream between blocks stays float32."""
    dtype = matmul_dtype(inputs, compute_dtype)
    if dtype == inputs.hidden[0].dtype:
        return [_first(block(h, **kw)) for h, kw in zip(inputs.hidden, inputs.kwargs)]
    device = inputs.hidden[0].device.type
    with torch.autocast(device_type=device, dtype=dtype), linear_weights_in(block, dtype):
        return [_first(block(h, **kw)).to(h.dtype) for h, kw in zip(inputs.hidden, inputs.kwargs)]


def relative_error(ref: list[Tensor], out: list[Tensor]) -> float:
    """||out - ref||^2 / ||ref||^2 summed over all samples."""
    num = sum(float((o.float() - r.float()).pow(2).sum()) for r, o in zip(ref, out))
    den = sum(float(r.float().pow(2).sum()) for r in ref)
    return num / max(den, 1e-30)


def _check_uniform_blocks(model: nn.Module, seq_len: int) -> None:
    """Blocks reuse block 0's attention mask. Families that mix sliding-window and global layers
    (Gemma 2/3, some Mistral/Qwen configs) build different masks per layer once seq_len exceeds
    the window, so refuse that case instead of calibrating with the wrong mask."""
    layer_types = set(getattr(model.config, "layer_types", None) or [])
    window = getattr(model.config, "sliding_window", None)
    if len(layer_types) > 1 and window and seq_len > window:
        raise ValueError(f"this model mixes attention types {sorted(layer_types)} with sliding_window={window}; "
                         f"calibration seq_len={seq_len} exceeds the window. Set calibration.seq_len <= {window}.")


OnBlock = Callable[[int, str, nn.Module, BlockInputs, object], None]
Observe = Callable[[int, str, nn.Module], object]  # returns a context manager (hooks), or None


def run_blockwise(model: nn.Module, arch: ArchSpec, samples: Tensor, on_block: OnBlock, device="cpu",
                  offload="cpu", progress: bool = True, observe: Observe | None = None,
                  compute_dtype: torch.dtype | None = None) -> list[float]:
    """Apply the stages to each decoder block in turn.

    Per block: `observe(index, name, block)` may return a context manager (e.g. a BlockObserver) that
    is active during the block's float forward; `on_block(index, name, block, inputs, observer)` then changes
    the block (smooths, quantizes, replaces layers). The block's outputs are recomputed and become
    the next block's inputs. Returns, per block, the relative output error the stages introduced:
    ||block'(x) - block(x)||^2 / ||block(x)||^2 on the block's (already compressed) inputs. `compute_dtype`: see
    block_forward (statistics are gathered from the activations as computed in that dtype).
    """
    model.eval()
    _check_uniform_blocks(model, samples.shape[1])
    _move_non_blocks(model, arch, device)
    inputs = capture_block_inputs(model, arch, samples, device)
    errors = []
    blocks = arch.block_list(model)
    for i in tqdm(range(len(blocks)), desc="blocks", unit="block", disable=not progress):
        block = blocks[i].to(device)
        observer = observe(i, f"{arch.blocks}.{i}", block) if observe else None
        if observer is not None:
            with observer:
                reference = block_forward(block, inputs, compute_dtype)
        else:
            reference = block_forward(block, inputs, compute_dtype)
        on_block(i, f"{arch.blocks}.{i}", block, inputs, observer)
        block = get_module(model, f"{arch.blocks}.{i}")  # a stage may have swapped the whole block
        with cached_dequantize(block, matmul_dtype(inputs, compute_dtype)):
            outputs = block_forward(block, inputs, compute_dtype)
        errors.append(relative_error(reference, outputs))
        inputs = BlockInputs(outputs, inputs.kwargs)
        block.to(offload)
        del reference, observer
    _move_non_blocks(model, arch, offload)
    return errors
