"""Two Kronecker sides of every planned layer's KL Hessian, one decoder block at a time (the kl_hessians stage;
GPTQ's `output_hessians`, quantizers/gptq_kron.py).

For a linear y = W x inside the model, the Hessian of the KL to the original model at the original weights is the
Fisher of its output distribution. With labels sampled from the model's own prediction it is Σ_t (x xᵀ) ⊗ (g gᵀ),
g the gradient of the sampled log-likelihood at the layer's output. Per layer this pass sums the output side,
H_out = Σ g gᵀ, and the input side with each token weighted by |g|², Σ |g|² x xᵀ (the first step of the best
Kronecker fit, from H_out = I), over every token of the windows.

It is fisher_blocks' pass: block 0's inputs captured, every block run forward once with its output kept, labels
sampled at the top (the same generator as the sensitivity passes), then the blocks again from last to first, each
recomputed from its kept input with autograd on and the gradient at its output pushed through it, its planned
layers' sums taken as it passes. Each layer's pair is written, as soon as its block is done, to
`<folder>/<layer>.safetensors` (float32), so memory holds the kept states ((blocks + 1) × windows × seq_len × hidden
values, and one set of gradients) and one block's sums ([out, out] and [in, in] per layer).

For AutoRound against the model's loss (`block_sides`), the pass sums instead, per block that holds a planned layer,
G = Σ g gᵀ of the gradients at the block's output (the ones it pushes into the block), written to
`<folder>/<block>.safetensors` [hidden, hidden] (quantizers/autoround.block_metric).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ..arch import get_arch, get_module
from ..calibrate.blockwise import BlockInputs, ResidentBlocks, _first, block_forward, capture_block_inputs
from ..core.nn import linear_shape
from ..measure.ppl import final_logits
from ..quantizers.autoround import KEY_BLOCK, block_fisher_path
from ..quantizers.gptq_kron import KEY_IN, KEY_OUT, output_hessian_path
from .fisher_blocks import _remove
from .mixed import sample_labels

INDEX = "index.json"  # written last: the folder is complete


def outside_blocks(model: nn.Module, names: list[str]) -> list[str]:
    """The layers of `names` that are not inside a decoder block (this pass hooks block layers only)."""
    prefix = get_arch(model).blocks + "."
    return [n for n in names if not n.startswith(prefix)]


def owning_blocks(model: nn.Module, names: list[str]) -> dict[int, list[str]]:
    """The layers of `names` (inside the decoder blocks) by the index of the block that holds them."""
    prefix = get_arch(model).blocks + "."
    owner: dict[int, list[str]] = {}
    for n in names:
        owner.setdefault(int(n[len(prefix):].split(".")[0]), []).append(n)
    return owner


def complete(folder: Path, names: list[str], seed: int, tokens: int, block_sides: bool = False) -> bool:
    """Whether `folder` already holds these layers' Hessians (or, `block_sides`, their blocks' output Fishers) from
    the same windows and seed (a resumed run)."""
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError):
        return False
    return (index.get("seed") == seed and index.get("tokens") == tokens and set(index.get("layers", [])) == set(names)
            and index.get("block_sides", False) == block_sides)


def output_hessians(model: nn.Module, windows: Tensor, names: list[str], folder: Path, seed: int = 0,
                    progress=None, blocks=None, device=None, compute_dtype: torch.dtype | None = None,
                    block_sides: bool = False) -> dict:
    """Write both sides of every layer in `names` (inside the decoder blocks) to `folder` (see the module docstring);
    with `block_sides`, the Fisher at the output of every block holding one of them instead (AutoRound's loss);
    returns the folder's index. `blocks`: the block source (default: the model's own, ResidentBlocks); `device`:
    where the blocks compute (default: where the input embedding is); `compute_dtype` (bfloat16): the blocks'
    matmuls, forward and backward, under autocast, as the calibration pass computes (the sums stay float32).
    Every parameter's requires_grad is restored on return."""
    arch = get_arch(model)
    if bad := outside_blocks(model, names):
        raise ValueError(f"the output-side Hessians are computed for layers inside the decoder blocks; {bad[0]} "
                         f"is not{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}: leave it out of the "
                         "quantize stage (`ignore:`) or quantize it in a stage of its own")
    folder.mkdir(parents=True, exist_ok=True)
    n_blocks = len(arch.block_list(model))
    owner = owning_blocks(model, names)
    if device is None:
        device = model.get_input_embeddings().weight.device
    blocks = blocks or ResidentBlocks(model, arch, offload=device)
    norm = get_module(model, arch.final_norm)
    gen = torch.Generator().manual_seed(seed)
    done, steps = [0], 2 * n_blocks + 1

    def step(what: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(what, done[0], steps)

    def park(t: Tensor) -> Tensor:
        return t.detach().to("cpu")

    params = {id(p): (p, p.requires_grad) for p in model.parameters()}
    model.requires_grad_(False)
    handles: list = []
    try:
        inputs, _ = capture_block_inputs(model, arch, windows, device)
        kwargs = inputs.arguments.of
        states = [[park(h) for h in inputs.hidden]]
        for b in range(n_blocks):  # forward, every block's input kept
            block = blocks.load(b, device).requires_grad_(False)
            with torch.no_grad():
                states.append([park(h) for h in block_forward(
                    block, BlockInputs([h.to(device) for h in states[-1]], kwargs(b)), compute_dtype)])
            blocks.done(b, block)
            step("kl hessians: forward")
        grads = []
        for h in states[-1]:  # the top: labels sampled from the model, the gradient at the last block's output
            h = h.to(device).requires_grad_()
            logits = final_logits(model, norm(h), arch=arch)[0]
            nn.functional.cross_entropy(logits, sample_labels(logits, gen), reduction="sum").backward()
            grads.append(park(h.grad))
        step("kl hessians: head")
        for b in reversed(range(n_blocks)):  # backward, the block's layers' output gradients summed
            prefix = f"{arch.blocks}.{b}."
            if block_sides and b in owner:
                _write_block(folder, prefix[:-1], grads, device)
            if block_sides and b == 0:  # no block below wants the gradient at this one's input
                step("kl hessians: backward")
                break
            block = blocks.load(b, device).requires_grad_(False)
            sums = {} if block_sides else {n: _Sums(block.get_submodule(n[len(prefix):]), device)
                                           for n in owner.get(b, [])}
            handles = [h for n, acc in sums.items() for h in acc.attach(block.get_submodule(n[len(prefix):]))]
            new_grads = []
            for h, kw, g in zip(states[b], kwargs(b), grads):
                x = h.to(device).detach().requires_grad_()  # block 0 too: its layers' outputs need the graph
                with _autocast(device, compute_dtype):
                    out = _first(block(x, **kw))
                out.backward(g.to(device, out.dtype))
                new_grads.append(park(x.grad) if b > 0 else None)
            grads = new_grads
            _remove(handles)
            for n, acc in sums.items():
                _write(folder, n, acc)
            blocks.done(b, block)
            step("kl hessians: backward")
    finally:
        _remove(handles)
        for p, flag in params.values():
            if not p.is_meta:
                p.requires_grad_(flag)
    index = {"seed": seed, "tokens": int(windows.numel()), "windows": int(windows.shape[0]),
             "seq_len": int(windows.shape[1]), "layers": sorted(names), "block_sides": block_sides}
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    return index


class _Sums:
    """One layer's two sums: H_out = Σ g gᵀ over its output gradients, and the input Hessian with each token weighted
    by how much the loss reads the layer's output there, Σ |g|² x xᵀ (the first step of the best Kronecker fit of
    Σ (x xᵀ) ⊗ (g gᵀ), from H_out = I). Hooks: the forward keeps the window's inputs, the gradient adds both."""

    def __init__(self, module: nn.Module, device):
        out_f, in_f = linear_shape(module)
        self.out = torch.zeros(out_f, out_f, device=device)
        self.inp = torch.zeros(in_f, in_f, device=device)
        self.x: Tensor | None = None

    def attach(self, module: nn.Module) -> list:
        def forward(_module, args, out):
            if isinstance(out, Tensor) and out.requires_grad:
                self.x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                out.register_hook(self.add)
        return [module.register_forward_hook(forward)]

    def add(self, g: Tensor) -> None:
        g2 = g.reshape(-1, g.shape[-1]).float()
        self.out.addmm_(g2.T, g2)
        x, self.x = self.x, None
        self.inp.addmm_((x * g2.square().sum(1, keepdim=True)).T, x)


def _write(folder: Path, name: str, acc: _Sums) -> None:
    """One layer's file, written beside its place and renamed into it."""
    path = output_hessian_path(folder, name)
    tmp = path.with_name(path.name + ".tmp")
    save_file({KEY_OUT: acc.out.to("cpu").contiguous(), KEY_IN: acc.inp.to("cpu").contiguous()}, str(tmp))
    os.replace(tmp, path)


def _write_block(folder: Path, prefix: str, grads: list[Tensor], device) -> None:
    """The Fisher at block `prefix`'s output, Σ g gᵀ over every window's tokens, written beside its place and renamed
    into it (quantizers/autoround.block_metric reads it)."""
    total = None
    for g in grads:
        g2 = g.to(device).reshape(-1, g.shape[-1]).float()
        total = g2.T @ g2 if total is None else total.addmm_(g2.T, g2)
    path = block_fisher_path(folder, prefix)
    tmp = path.with_name(path.name + ".tmp")
    save_file({KEY_BLOCK: total.to("cpu").contiguous()}, str(tmp))
    os.replace(tmp, path)


def _autocast(device, dtype: torch.dtype | None):
    """Autocast to `dtype` on `device`'s type (off for None or float32)."""
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, dtype=dtype or torch.float32,
                          enabled=dtype is not None and dtype != torch.float32)


__all__ = ["INDEX", "complete", "outside_blocks", "output_hessians", "owning_blocks"]
