"""The fisher sensitivity pass (precision.py) one decoder block at a time: memory bounded by one block, so that
mixed precision chooses for models that do not fit, streamed from disk like the calibration pass.

The whole-model pass holds, for every window, every planned layer's output error under every option until the
backward reaches it (about 20 GB for a 7B model with the default menu). Here the residual stream is cut at the
blocks instead:

1. forward: block 0's inputs (and every block's arguments) are captured as the calibration pass captures them,
   then each block runs on each window and its output (the next block's input) is kept: (blocks + 1) × windows × seq_len × hidden values;
2. at the top, the final norm and the head give the logits, labels are sampled from them (the same generator, in
   the same order, as the whole-model pass) and the gradient of the sampled log-likelihood reaches the last block's
   output;
3. backward: each block again, last to first, recomputed from its kept input with autograd on, and the gradient at
   its output pushed through it to its input. With round-to-nearest errors the planned layers of the block are
   hooked meanwhile (precision.FisherSums), which is the whole-model pass's computation, block by block;
4. with solved errors (gptq, awq_rtn, awq_gptq) the gradient at every block's output is kept instead, and a last
   forward takes the blocks in order: the Hessian windows' float inputs to the block (carried from block to block)
   give its layers' solutions (precision.solve_layers), then the block is recomputed and backpropagated once more,
   hooked, with those errors; only one block's solutions exist at a time.

By the chain rule the gradient at a layer's output is the whole model's, so the costs equal the whole-model pass's
(tests compare them). Blocks come from a block source (`load(i, device)` / `done(i, block)`: blockwise.ResidentBlocks
for a model in memory, StreamedReads for one on disk); the kept states stay on the CPU.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor, nn

from ..arch import get_arch, get_module
from ..calibrate.blockwise import (BlockInputs, ReplayWarning, ResidentBlocks, _first, block_forward,
        capture_block_inputs)
from ..measure.ppl import final_logits
from .mixed import FisherSums, rtn_error, sample_labels, solve_layers, solved_error
from ..model.streaming import check_streamable, trim_heap


class StreamedReads:
    """A streamed model's blocks read from disk for their turn and released after it (nothing is written)."""

    def __init__(self, streamed):
        self.streamed = streamed

    def load(self, i: int, device) -> nn.Module:
        return self.streamed.load(i).to(device)

    def done(self, i: int, block: nn.Module) -> None:
        self.streamed.release(block)
        trim_heap()


def blocks_problem(model: nn.Module, names: list[str]) -> str | None:
    """Why the fisher pass of layers `names` cannot run block by block (None when it can). Windows longer than a
    layer's sliding window are no reason: every block replays with its own mask (capture_block_inputs)."""
    try:
        arch = get_arch(model)
    except ValueError as e:
        return str(e)
    if why := check_streamable(model, arch):
        return why
    head = model.get_output_embeddings()
    for n in names:
        if not n.startswith(arch.blocks + ".") and model.get_submodule(n) is not head:
            return f"{n} lies outside the decoder blocks and is not the head"
    if getattr(model.config, "num_kv_shared_layers", 0):
        return (f"its last {model.config.num_kv_shared_layers} layers read the keys and values of earlier layers "
                "(num_kv_shared_layers): the gradient crosses blocks there, which a block-by-block backward cuts")
    return None


def fisher_by_blocks(model: nn.Module, windows: Tensor, modules: dict[str, nn.Module], menu, nbytes: np.ndarray,
                     seed: int, progress, error_method: str, awq, hessian_windows: Tensor, hessian_budget: int,
                     blocks=None, device=None) -> dict[str, np.ndarray]:
    """precision.fisher_pass's costs, block by block (see the module docstring). `blocks`: the block source
    (default: the model's own blocks, ResidentBlocks); `device`: where the blocks compute (default: where the
    input embedding is). Every parameter's requires_grad is restored on return."""
    arch = get_arch(model)
    names = list(modules)
    n_blocks = len(arch.block_list(model))
    norm, head = get_module(model, arch.final_norm), model.get_output_embeddings()
    owner = {i: n_blocks if modules[n] is head else int(n[len(arch.blocks) + 1:].split(".")[0])
             for i, n in enumerate(names)}

    def layers(b: int) -> dict[int, tuple[str, nn.Module]]:
        return {i: (names[i], modules[names[i]]) for i, o in owner.items() if o == b}

    if device is None:
        device = model.get_input_embeddings().weight.device
    blocks = blocks or ResidentBlocks(model, arch, offload=device)
    solved_errors = error_method != "rtn"
    sums, gen = FisherSums(nbytes, menu), torch.Generator().manual_seed(seed)
    steps = n_blocks * (3 if solved_errors else 2)
    done = [0]

    def step():
        done[0] += 1
        if progress is not None:
            progress("fisher blocks (forward, backward" + (", solve" if solved_errors else "") + ")", done[0], steps)

    def park(t: Tensor) -> Tensor:  # kept states and gradients wait on the CPU
        return t.detach().to("cpu")

    def backward(block: nn.Module, hidden: Tensor, kw: dict, grad: Tensor, need_input: bool) -> Tensor | None:
        h = hidden.to(device).detach().requires_grad_()
        _first(block(h, **kw)).backward(grad.to(device))
        return park(h.grad) if need_input else None

    params = {id(p): (p, p.requires_grad) for p in model.parameters()}
    model.requires_grad_(False)
    handles = []
    try:
        inputs, _ = capture_block_inputs(model, arch, windows, device)
        kwargs = inputs.arguments.of  # block b's arguments, as the model's forward passes them
        states = [[park(h) for h in inputs.hidden]]
        for b in range(n_blocks):  # 1. forward, every block's input kept
            block = blocks.load(b, device).requires_grad_(False)
            states.append([park(h) for h in block_forward(block, BlockInputs([h.to(device) for h in states[-1]],
                                                                             kwargs(b)))])
            blocks.done(b, block)
            step()
        if any(len(s) for s in inputs.arguments.state):
            warnings.warn(f"{arch.family}: the blocks share state that earlier blocks write for later ones (the keys "
                          "and values of KV-sharing layers): the block-by-block backward does not carry gradients "
                          "through it, so these sensitivities differ from the whole-model pass's", ReplayWarning)
        # 2. the top: labels sampled from the model, the gradient at the last block's output (and the head's costs)
        rtn = rtn_error(menu)
        if not solved_errors:
            handles = [sums.attach(i, m, rtn) for i, (_n, m) in layers(n_blocks).items()]
        labels, grads = [], []
        for h in states[-1]:
            h = h.to(device).requires_grad_()
            logits = final_logits(model, norm(h), arch=arch)[0]
            labels.append(sample_labels(logits, gen))
            nn.functional.cross_entropy(logits, labels[-1], reduction="sum").backward()
            grads.append(park(h.grad))
        _remove(handles)
        kept = {}  # block -> the gradient at its output, for step 4
        for b in reversed(range(n_blocks)):  # 3. backward
            if solved_errors:
                kept[b] = grads
                if b == 0:  # block 0's input gradient is not needed
                    break
            block = blocks.load(b, device).requires_grad_(False)
            if not solved_errors:
                handles = [sums.attach(i, m, rtn) for i, (_n, m) in layers(b).items()]
            grads = [backward(block, h, kw, g, b > 0)
                     for h, kw, g in zip(states[b], kwargs(b), grads)]
            _remove(handles)
            blocks.done(b, block)
            step()
        if solved_errors:  # 4. forward again: each block's solutions from the Hessian windows, then its costs
            solved = _SolvedPass(menu, nbytes, error_method, awq, hessian_budget, int(hessian_windows.numel()),
                                 progress, len(names))
            carried, _ = capture_block_inputs(model, arch, hessian_windows, device)
            hidden = carried.hidden
            for b in range(n_blocks):
                block = blocks.load(b, device).requires_grad_(False)
                out: list = []

                def forward(block=block, out=out, hidden=hidden, b=b):
                    out[:] = block_forward(block, carried.at(b, hidden))
                error = solved.solve(forward, layers(b))
                hidden = out
                handles = [sums.attach(i, m, error) for i, (_n, m) in layers(b).items()]
                for h, kw, g in zip(states[b], kwargs(b), kept.pop(b)):
                    backward(block, h, kw, g, False)
                _remove(handles)
                blocks.done(b, block)
                step()
            if top := layers(n_blocks):  # the head: its inputs on the Hessian windows are the final norm's outputs
                error = solved.solve(lambda: [head(norm(h)) for h in hidden], top)
                handles = [sums.attach(i, m, error) for i, (_n, m) in top.items()]
                for h, y in zip(states[-1], labels):
                    h = h.to(device).requires_grad_()
                    nn.functional.cross_entropy(final_logits(model, norm(h), arch=arch)[0], y,
                                                reduction="sum").backward()
                _remove(handles)
    finally:
        _remove(handles)
        for p, flag in params.values():
            if not p.is_meta:
                p.requires_grad_(flag)
    return sums.costs(windows.numel())


class _SolvedPass:
    """solve_layers for one block's layers at a time, with one progress count over all of them."""

    def __init__(self, menu, nbytes, method, awq, hessian_budget, tokens, progress, total):
        self.args = (menu, nbytes, tokens, method, awq, hessian_budget)
        self.progress, self.total, self.done, self.method = progress, total, 0, method

    def tick(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(f"{self.method} solutions", self.done, self.total)

    def solve(self, forward, layers: dict):
        if not layers:
            forward()
            return None
        return solved_error(solve_layers(forward, layers, *self.args, on_solved=self.tick))


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


__all__ = ["StreamedReads", "blocks_problem", "fisher_by_blocks"]
