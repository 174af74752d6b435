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
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .distributed import active, reduce_sums
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
    """Move everything except the decoder blocks (embeddings, rotary tables, final norm). Tensors on the meta device
    (a streamed model's head while the blocks pass) stay there; tied parameters stay tied."""
    blocks = arch.block_list(model)
    set_module(model, arch.blocks, nn.ModuleList())
    try:
        if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            model.to(device)
            return
        moved: dict[int, Tensor] = {}
        for m in model.modules():
            for store, wrap in ((m._parameters, True), (m._buffers, False)):
                for k, t in store.items():
                    if t is None or t.is_meta:
                        continue
                    if id(t) not in moved:
                        new = t.to(device)  # `t` itself when it is there already
                        moved[id(t)] = t if new is t else \
                            (nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new)
                    store[k] = moved[id(t)]
    finally:
        set_module(model, arch.blocks, blocks)


def call_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by parameter name, in the order of `module.forward`'s signature (extra keyword arguments
    last): a block called with positional arguments besides the hidden states (GPT-2 passes its causal mask third)
    is called again by name with all of them."""
    sig = inspect.signature(module.forward)
    bound = sig.bind(*args, **kwargs)
    named = {}
    for k, v in bound.arguments.items():
        if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(v)
        else:
            named[k] = v
    return named


@torch.no_grad()
def capture_block_inputs(model: nn.Module, arch: ArchSpec, samples: Tensor, device,
                         spill_dir: Path | None = None) -> tuple[BlockInputs, Tensor | None]:
    """Run the model's own forward up to block 0 for each sample [n, seq_len] and keep block 0's inputs; with
    `spill_dir`, in a memory-mapped file there, one sample at a time (returned as the second value; else None)."""
    block0 = arch.block_list(model)[0]
    captured = BlockInputs([], [])
    store: list = []

    def hook(module, args, kwargs):
        named = call_arguments(module, args, kwargs)
        hidden = named.pop(next(iter(named)))
        if spill_dir is not None:
            if not store:
                store.append(spill(spill_dir, "a", hidden, len(samples)))
            hidden = _keep(hidden, store[0], len(captured.hidden))
        captured.hidden.append(hidden)
        captured.kwargs.append(named)
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
    return captured, (store[0] if store else None)


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


def _keep(out: Tensor, store: Tensor | None, i: int) -> Tensor:
    """A sample's output, or its copy in row i of a file-backed store (then only one sample is in memory at once)."""
    if store is None:
        return out
    store[i].copy_(out)
    return store[i]


@torch.no_grad()
def block_forward(block: nn.Module, inputs: BlockInputs, compute_dtype: torch.dtype | None = None,
                  store: Tensor | None = None) -> list[Tensor]:
    """The block on every sample. `compute_dtype` (bfloat16) runs the matmuls of a float32 block in that dtype under
    autocast (a 16-bit model already computes in its own dtype); outputs return in the inputs' dtype, so the
    residual stream between blocks stays float32. `store` ([n, 1, seq_len, hidden], e.g. a Spill): write the outputs
    there and return views of it."""
    dtype = matmul_dtype(inputs, compute_dtype)
    if dtype == inputs.hidden[0].dtype:
        return [_keep(_first(block(h, **kw)), store, i) for i, (h, kw) in enumerate(zip(inputs.hidden, inputs.kwargs))]
    device = inputs.hidden[0].device.type
    with torch.autocast(device_type=device, dtype=dtype), linear_weights_in(block, dtype):
        return [_keep(_first(block(h, **kw)).to(h.dtype), store, i)
                for i, (h, kw) in enumerate(zip(inputs.hidden, inputs.kwargs))]


def spill(folder: Path, name: str, like: Tensor, n: int) -> Tensor:
    """A [n, *like.shape] tensor backed by a file in `folder` (memory-mapped, shared): the calibration activations
    of `calibration.offload: disk`, which the kernel pages out instead of holding in memory."""
    path = folder / f"{name}.bin"
    numel = n * like.numel()
    path.write_bytes(b"")
    os.truncate(path, numel * like.element_size())
    return torch.from_file(str(path), shared=True, size=numel, dtype=like.dtype).view(n, *like.shape)


def relative_error(ref: list[Tensor], out: list[Tensor]) -> float:
    """||out - ref||^2 / ||ref||^2 summed over all samples (over every process's samples in a data-parallel pass)."""
    num = sum(float((o.float() - r.float()).pow(2).sum()) for r, o in zip(ref, out))
    den = sum(float(r.float().pow(2).sum()) for r in ref)
    if active():
        num, den = reduce_sums([num, den])
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


OnBlock = Callable[[int, str, nn.Module, BlockInputs | None, object], None]
Observe = Callable[[int, str, nn.Module], object]  # returns a context manager (hooks), or None


class ResidentBlocks:
    """Blocks of a model held in memory: moved to the compute device for their turn, back to `offload` after."""

    def __init__(self, model: nn.Module, arch: ArchSpec, offload="cpu"):
        self.blocks, self.offload = arch.block_list(model), offload

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def load(self, i: int, device) -> nn.Module:
        return self.blocks[i].to(device)

    def done(self, i: int, block: nn.Module) -> None:
        block.to(self.offload)


class BlockVisitor:
    """Something that rides along the pass without changing the blocks (the streamed evaluation): `start` once
    the non-block modules are on the device, `loaded` with each float block before the stages see it, `compressed`
    with it after."""

    def start(self, model: nn.Module, arch: ArchSpec, device) -> None:
        pass

    def loaded(self, i: int, block: nn.Module) -> None:
        pass

    def compressed(self, i: int, block: nn.Module) -> None:
        pass

    def done(self, i: int, inputs: BlockInputs | None, errors: list[float]) -> None:
        """After block i has gone (`inputs`: the next block's calibration inputs; `errors` so far)."""


def run_blockwise(model: nn.Module, arch: ArchSpec, samples: Tensor | None, on_block: OnBlock, device="cpu",
                  offload="cpu", progress: bool = True, observe: Observe | None = None,
                  compute_dtype: torch.dtype | None = None, spill_dir: Path | None = None,
                  blocks=None, visitors: tuple[BlockVisitor, ...] = (), start: int = 0,
                  restore=None) -> list[float]:
    """Apply the stages to each decoder block in turn.

    Per block: `observe(index, name, block)` may return a context manager (e.g. a BlockObserver) that
    is active during the block's float forward; `on_block(index, name, block, inputs, observer)` then changes
    the block (smooths, quantizes, replaces layers). The block's outputs are recomputed and become
    the next block's inputs. Returns, per block, the relative output error the stages introduced:
    ||block'(x) - block(x)||^2 / ||block(x)||^2 on the block's (already compressed) inputs. `compute_dtype`: see
    block_forward (statistics are gathered from the activations as computed in that dtype). `spill_dir` (a CPU run
    with calibration.offload: disk): the block inputs, float outputs and compressed outputs live in memory-mapped files
    there instead of in memory; the results are the same bit for bit. `samples` None: no calibration data (the
    stages act on each block without statistics; no errors are measured). `blocks`: where each block comes from and
    goes after its turn (`begin()` once the block-0 inputs are captured, `load(i, device)`, `done(i, block)`,
    `end()` after the last block; ResidentBlocks by default, streaming.StreamedBlocks
    reads them from disk); `visitors`: see BlockVisitor. `start` > 0 resumes an interrupted pass at that block:
    `restore(inputs)` then returns (the block's calibration inputs, the errors so far) from the checkpoint, given
    the freshly captured block-0 inputs (their keyword arguments are reused).
    """
    model.eval()
    if samples is not None:
        _check_uniform_blocks(model, samples.shape[1])
    _move_non_blocks(model, arch, device)
    if spill_dir is not None and torch.device(device).type != "cpu":
        raise ValueError("calibration.offload: disk spills CPU activations; on an accelerator keep them there "
                         "(offload: memory) or lower calibration.n_samples")
    inputs, stores = None, [None, None, None]
    if samples is not None:
        inputs, captured_store = capture_block_inputs(model, arch, samples, device, spill_dir)
        if spill_dir is not None:  # block inputs (already in "a"), float outputs, compressed outputs
            n, like = len(inputs.hidden), inputs.hidden[0]
            stores = [captured_store, spill(spill_dir, "reference", like, n), spill(spill_dir, "b", like, n)]
    for v in visitors:
        v.start(model, arch, device)
    errors: list[float] = []
    if start:
        restored, errors = restore(inputs)
        if inputs is not None:
            for k, h in enumerate(restored.hidden):  # into the captured tensors (a spill file's rows, if spilled)
                inputs.hidden[k].copy_(h)
    blocks = blocks or ResidentBlocks(model, arch, offload)
    blocks.begin()
    n = len(arch.block_list(model))
    for i in tqdm(range(start, n), desc="blocks", unit="block", disable=not progress, initial=start, total=n):
        block = blocks.load(i, device)
        for v in visitors:
            v.loaded(i, block)
        observer = observe(i, f"{arch.blocks}.{i}", block) if observe else None
        reference = None
        if inputs is not None:
            with observer if observer is not None else contextlib.nullcontext():
                reference = block_forward(block, inputs, compute_dtype, stores[1])
        on_block(i, f"{arch.blocks}.{i}", block, inputs, observer)
        observer = None  # the block's statistics (Hessians: 0.7 GB for a 7B block) are not needed past its stages
        block = get_module(model, f"{arch.blocks}.{i}")  # a stage may have swapped the whole block
        if inputs is not None:
            with cached_dequantize(block, matmul_dtype(inputs, compute_dtype)):
                outputs = block_forward(block, inputs, compute_dtype, stores[2])
            errors.append(relative_error(reference, outputs))
            inputs = BlockInputs(outputs, inputs.kwargs)
            stores[0], stores[2] = stores[2], stores[0]  # the next block writes over these inputs
        for v in visitors:
            v.compressed(i, block)
        blocks.done(i, block)
        del reference, observer
        for v in visitors:
            v.done(i, inputs, errors)
    blocks.end()
    _move_non_blocks(model, arch, offload)
    return errors
