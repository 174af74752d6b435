"""The layer-by-layer runner: stream one decoder block at a time through calibration data.

1. Capture the inputs of block 0 (hidden states) and the arguments the model passes every block besides them
   (its attention mask and rotary embeddings, which differ per layer type in Gemma 2/3/4 and Cohere 2, per-layer
   inputs, positions) by the model's own forward, with stand-ins for the blocks (capture_block_inputs).
2. For each block: move it to the compute device, hand it to the stages (observe, solve,
   replace layers), then feed the *compressed* block's outputs to the next block, with that block's arguments.
No graph tracing: blocks are called exactly as the model calls them. Peak memory is the model
(on the offload device) + one block + the calibration activations on the compute device.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .distributed import active, reduce_sums
from ..arch import ArchSpec, cross_attention_blocks, get_module, set_module
from ..core.nn import QuantLinear, cached_dequantize, is_linear, linear_shape
from ..core.profile import Profile, phase_of
from .deferred import map_windows


class _StopForward(Exception):
    pass


@dataclass
class BlockArguments:
    """Every block's arguments besides the hidden states, per calibration sample, as the model's own forward passes
    them: `per_block[i][k]` is block i's on sample k, by parameter name (rotary embeddings of its layer type, its
    mask, its slice of per-layer inputs, cache positions, ...).

    What is stored: per (block, sample) one reference to a dict; the dicts, and the tensors in them, are shared
    wherever they are the same. A model computes one rotary embedding and one mask per layer type and passes the
    very same tensors to every block of that type, so those are held once per sample, and the capture keeps one copy
    of equal tensors across samples (the masks and rotary tables of equal-length windows): the arguments of a
    Llama-like model cost one set per distinct window length, whatever the number of blocks and windows; only what
    really differs per block (Gemma 3n/4's per-layer inputs: views of one [seq, blocks, d] tensor per sample)
    costs per block. `problems`: why replaying the blocks with these arguments is not the model's own forward
    (empty when it is); `state`: the per-sample objects that several blocks share and the real blocks write into
    (Gemma 4's shared_kv_states: the keys and values of its KV-sharing layers), see `fork`."""
    per_block: list[list[dict]]
    problems: list[str]
    state: list = field(default_factory=list)
    # blocks the model's forward passes by on these inputs (Llama 3.2 Vision's cross-attention layers on text): their
    # hidden states go through unchanged, as in the model (block_forward)
    skipped: frozenset[int] = frozenset()

    def of(self, i: int) -> list[dict] | None:
        """Block i's arguments per sample (None past the last block)."""
        return self.per_block[i] if i < len(self.per_block) else None

    def fork(self) -> BlockArguments:
        """The same arguments with fresh copies of the shared state, for a second stream of hidden states carried
        through the same blocks (a streamed run's baseline beside its compressed model): each stream's blocks then
        read the keys and values its own earlier blocks wrote."""
        if not self.state:
            return self
        fresh = {id(s): copy.copy(s) for s in self.state}
        rebuilt: dict[int, dict] = {}

        def swap(kw: dict) -> dict:
            if id(kw) not in rebuilt:
                rebuilt[id(kw)] = {k: fresh.get(id(v), v) for k, v in kw.items()}
            return rebuilt[id(kw)]

        return BlockArguments([[swap(kw) for kw in block] for block in self.per_block], self.problems,
                              list(fresh.values()), self.skipped)


@dataclass
class BlockInputs:
    hidden: list[Tensor]  # one [1, seq_len, hidden] per calibration sample, on the compute device
    kwargs: list[dict] | None  # what the model passes this block besides hidden states, per sample
    arguments: BlockArguments | None = None  # every block's (capture_block_inputs); None: `kwargs` for every block
    block: int = 0  # the block these inputs are for

    def at(self, i: int, hidden: list[Tensor] | None = None) -> BlockInputs:
        """Block i's inputs: `hidden` (default: these hidden states) with block i's arguments."""
        hidden = self.hidden if hidden is None else hidden
        if self.arguments is None:
            return BlockInputs(hidden, self.kwargs)
        return BlockInputs(hidden, self.arguments.of(i), self.arguments, i)

    @property
    def skipped(self) -> bool:
        """The model's forward passes these hidden states by this block (BlockArguments.skipped)."""
        return self.arguments is not None and self.block in self.arguments.skipped

    def advance(self, outputs: list[Tensor]) -> BlockInputs:
        """The next block's inputs: this block's `outputs` with the next block's arguments."""
        return self.at(self.block + 1, outputs)

    def fork(self) -> BlockInputs:
        """These inputs for a second stream through the same blocks (BlockArguments.fork)."""
        if self.arguments is None:
            return BlockInputs(list(self.hidden), self.kwargs)
        arguments = self.arguments.fork()
        return BlockInputs(list(self.hidden), arguments.of(self.block), arguments, self.block)


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


def call_arguments(module: nn.Module, args: tuple, kwargs: dict,
                   signature: inspect.Signature | None = None) -> dict:
    """A call's arguments by parameter name, in the order of `module.forward`'s signature (extra keyword arguments
    last): a block called with positional arguments besides the hidden states (GPT-2 passes its causal mask third)
    is called again by name with all of them. `signature`: module.forward's, when that is replaced for the call."""
    sig = signature or inspect.signature(module.forward)
    bound = sig.bind(*args, **kwargs)
    named = {}
    for k, v in bound.arguments.items():
        if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(v)
        else:
            named[k] = v
    return named


class _PassedOn:
    """What a stand-in block returns besides its hidden states, where the model's loop unpacks more than one value:
    found in a later block's arguments, it shows the loop passes the blocks' outputs on (which only the real block
    computes)."""

    def __repr__(self) -> str:
        return "<a block's output>"


_PASSED_ON = _PassedOn()
# the forms a decoder loop of transformers 5 takes a block's output in: `hidden = layer(...)`,
# `hidden = layer(...)[0]`, `hidden, attn_weights = layer(...)` (Bamba; GLM-MoE-DSA passes its second value on), ...
_FORMS = (("a tensor", lambda h: h), ("a 1-tuple", lambda h: (h,)), ("a pair", lambda h: (h, _PASSED_ON)),
          ("a triple", lambda h: (h, _PASSED_ON, _PASSED_ON)))


def _follow(model: nn.Module, blocks: list[nn.Module], signatures: list, ids: Tensor | dict, form,
            last: int | None = None) -> list[list]:
    """One sample's forward through the model with every block's forward replaced by a stand-in that records the
    block's arguments by name and returns its hidden states unchanged (in `form`), so that the model's own loop
    computes every per-block argument; stopped at the last block (or at block `last`: the final norm and the head
    do not run). `ids`: the token ids [1, seq_len], or all of a sample's model inputs by name (a vision-language
    model's input_ids with its image inputs: calibrate/images.py). Returns, per block, the (hidden states, other
    arguments) of each call it received."""
    calls: list[list] = [[] for _ in blocks]
    last = len(blocks) - 1 if last is None else last

    def stand_in(i: int):
        def forward(*args, **kwargs):
            named = call_arguments(blocks[i], args, kwargs, signatures[i])
            hidden = named.pop(next(iter(named)))
            calls[i].append((hidden, named))
            if i == last:
                raise _StopForward
            return form(hidden)
        return forward

    own = [b.__dict__.get("forward") for b in blocks]  # an instance-level forward someone set: put back after
    try:
        for i, b in enumerate(blocks):
            b.forward = stand_in(i)
        try:
            model(**(ids if isinstance(ids, dict) else {"input_ids": ids}), use_cache=False)
        except _StopForward:
            pass
    finally:
        for b, f in zip(blocks, own):
            del b.forward
            if f is not None:
                b.forward = f
    return calls


def _passed_on(named: dict) -> list[str]:
    """The arguments that hold a stand-in's extra output (see _PassedOn)."""
    def has(v) -> bool:
        if v is _PASSED_ON:
            return True
        if type(v) in (tuple, list):
            return any(has(x) for x in v)
        return type(v) is dict and any(has(x) for x in v.values())
    return [k for k, v in named.items() if has(v)]


def _without_passed_on(v):
    if v is _PASSED_ON:
        return None
    if type(v) in (tuple, list):
        return type(v)(_without_passed_on(x) for x in v)
    return {k: _without_passed_on(x) for k, x in v.items()} if type(v) is dict else v


def _chain_break(calls: list[list]) -> int | None:
    """The first block i whose hidden states (what its stand-in returned) are not what the next block called (i + 1,
    or the one after the blocks the loop passed by) received: the model's loop changes them between blocks, or takes
    the block's output in another form. None: unchanged."""
    called = [i for i, c in enumerate(calls) if c]
    for i, j in zip(called, called[1:]):
        out, nxt = calls[i][0][0], calls[j][0][0]
        if not (nxt is out or (isinstance(nxt, Tensor) and nxt.shape == out.shape and nxt.dtype == out.dtype
                               and torch.equal(nxt, out))):
            return i
    return None


def _how_to_follow(model: nn.Module, arch: ArchSpec, blocks, signatures, ids: Tensor | dict):
    """The form the model's loop takes a block's output in, found on the first sample (the first form with which
    the forward reaches the last block, every block called once, the hidden states passed on unchanged), with that
    sample's calls and the problems of replaying with them; (None, block 0's calls, problems) when no form reaches
    the last block."""
    family, failures, fallback = arch.family, [], None
    cross = set(cross_attention_blocks(model, arch))  # skipped by the model's loop without images, run with them
    images = isinstance(ids, dict) and "pixel_values" in ids
    expected = [0 if i in cross and not images else 1 for i in range(len(blocks))]
    for name, form in _FORMS:
        try:
            calls = _follow(model, blocks, signatures, ids, form)
        except Exception as e:  # this form is not what the loop expects (or the loop cannot run outside the blocks)
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        counts = [len(c) for c in calls]
        if counts != expected:
            failures.append(f"{name}: the blocks were called {counts} times")
            continue
        broken = _chain_break(calls)
        if broken is None:
            return form, calls, []
        fallback = fallback or (form, calls, [
            f"{family}: the model changes the hidden states between blocks {broken} and {broken + 1} (or takes a "
            f"block's output in a form the replay does not know): replaying the blocks one after the other does not "
            f"apply that change"])
    if fallback is not None:
        return fallback
    block0 = _follow(model, blocks, signatures, ids, _FORMS[0][1], last=0)  # what the old capture kept
    return None, block0, [f"{family}: the model's forward could not be followed past block 0 with stand-in blocks "
                          f"({'; '.join(failures)}): every block replays block 0's arguments"]


class _Canonical:
    """Captured argument values, each kept once: the same object across blocks stays one object; equal tensors
    across samples (same shape, dtype, device, strides) become the first one; equal non-empty tuples, lists and
    dicts of those become one. Empty mutable containers passed to blocks (state the real blocks fill, e.g. Gemma
    4's shared_kv_states) stay one per sample and are listed in `state`."""

    RECENT = 4  # tensors of one kind compared against (masks and rotary tables match the last sample's)

    def __init__(self):
        self.recent: dict[tuple, list[Tensor]] = {}
        self.containers: dict[tuple, object] = {}
        self.state: list = []
        self.seen: dict[int, tuple] = {}

    def sample(self) -> None:
        self.seen = {}  # by object within one sample's forward (each value is kept alive there)

    def __call__(self, v):
        if (hit := self.seen.get(id(v))) is not None:
            return hit[1]
        if isinstance(v, Tensor):
            c = self._tensor(v)
        elif type(v) in (tuple, list, dict) and len(v):
            items = ({k: self(x) for k, x in v.items()} if type(v) is dict else type(v)(self(x) for x in v))
            key = (type(v), tuple((k, id(x)) for k, x in items.items()) if type(v) is dict
                   else tuple(id(x) for x in items))
            c = self.containers.setdefault(key, items)
        else:
            c = v
            if isinstance(v, (MutableMapping, list)) and not len(v):
                self.state.append(v)
        self.seen[id(v)] = (v, c)
        return c

    def _tensor(self, t: Tensor) -> Tensor:
        if t.is_meta:
            return t
        recent = self.recent.setdefault((t.shape, t.dtype, t.device, t.stride(), t.requires_grad), [])
        for c in recent:
            if torch.equal(c, t):
                return c
        recent.insert(0, t)
        del recent[self.RECENT:]
        return t

    def arguments(self, named: dict) -> dict:
        values = {k: self(v) for k, v in named.items()}
        return self.containers.setdefault((dict, tuple((k, id(v)) for k, v in values.items())), values)


class ReplayWarning(UserWarning):
    """Replaying the blocks with the captured arguments is not the model's own forward (BlockArguments.problems)."""


@torch.no_grad()
def capture_block_inputs(model: nn.Module, arch: ArchSpec, samples, device,
                         spill_dir: Path | None = None) -> tuple[BlockInputs, Tensor | None]:
    """Block 0's inputs for each sample [n, seq_len] (or each of a vision-language model's image-caption samples,
    calibrate/images.py ImageSamples: its model inputs by name, at its own length), and every block's other
    arguments (BlockArguments), by the model's own forward: each block's forward is replaced meanwhile by a stand-in
    that records its arguments and returns its hidden states unchanged, so the model's loop computes each block's
    rotary embeddings, mask, per-layer inputs and positions as it does in a real forward, and no block computes (a
    streamed model's blocks stay on the meta device). With `spill_dir`, block 0's hidden states go to a memory-mapped
    file there, one sample at a time (returned as the second value; else None). Whatever keeps the replay from being
    the model's own forward is in the arguments' `problems` (and warned about)."""
    blocks = arch.block_list(model)
    signatures = [inspect.signature(b.forward) for b in blocks]
    hidden: list[Tensor] = []
    per_block: list[list[dict]] = [[] for _ in blocks]
    store: list = []
    canonical = _Canonical()
    form, problems, passed_on, skipped = None, [], set(), set()
    for k, row in enumerate(samples):
        ids = _sample_inputs(model, row, device) if isinstance(row, dict) else row[None].to(device)
        if k == 0:
            form, calls, problems = _how_to_follow(model, arch, blocks, signatures, ids)
        else:
            calls = _follow(model, blocks, signatures, ids, form or _FORMS[0][1], None if form else 0)
        h = calls[0][0][0]
        if spill_dir is not None:
            if not store:
                store.append(spill(spill_dir, "a", h, len(samples)))
            h = _keep(h, store[0], len(hidden))
        hidden.append(h)
        for i, block_calls in enumerate(calls if form is not None else calls[:1]):
            if not block_calls:  # a block the model's loop passed by (a cross-attention layer on text)
                skipped.add(i)
                per_block[i].append({})
                continue
            named = block_calls[0][1]
            if names := _passed_on(named):
                passed_on.update(names)
                named = {n: _without_passed_on(v) for n, v in named.items()}
            per_block[i].append(canonical.arguments(named))
        canonical.sample()
    if form is None:
        per_block = [per_block[0]] * len(blocks)
    if passed_on:
        problems.append(f"{arch.family}: the model passes what a block returns besides its hidden states on to the "
                        f"next block (as {sorted(passed_on)}); the replay passes None there, as to the first block")
    for p in problems:
        warnings.warn(f"calibration replay is not the model's own forward: {p}", ReplayWarning, stacklevel=3)
    arguments = BlockArguments(per_block, problems, canonical.state, frozenset(skipped))
    return BlockInputs(hidden, arguments.of(0), arguments, 0), (store[0] if store else None)


def _sample_inputs(model: nn.Module, sample: dict, device) -> dict:
    """A sample's model inputs on `device`, its float ones (pixel values) in the model's dtype, as a processor's
    output is passed to a model loaded in bfloat16."""
    dtype = model.get_input_embeddings().weight.dtype
    return {k: v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in sample.items()}


def matmul_dtype(inputs: BlockInputs, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a block's matmuls run in: `compute_dtype` (under autocast) for a float32 model, else the model's."""
    dtype = inputs.hidden[0].dtype
    return compute_dtype if compute_dtype is not None and dtype == torch.float32 else dtype


@contextlib.contextmanager
def linear_weights_in(block: nn.Module, dtype: torch.dtype, exclude: tuple[nn.Module, ...] = ()):
    """The float linear weights of `block` held as `dtype` copies for a burst of autocast forwards (autocast would
    otherwise cast every weight on every call); the float32 weights are back on exit, untouched. `exclude`: linears
    left as they are (those whose weights the caller swaps itself)."""
    saved = [(m, m.weight.data) for m in block.modules() if is_linear(m) and not isinstance(m, QuantLinear)
             and m.weight.dtype != dtype and not any(m is e for e in exclude)]
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
                  store: Tensor | None = None, reference: list[Tensor] | None = None):
    """The block on every sample. `compute_dtype` (bfloat16) runs the matmuls of a float32 block in that dtype under
    autocast (a 16-bit model already computes in its own dtype); outputs return in the inputs' dtype, so the
    residual stream between blocks stays float32. `store` ([n, 1, seq_len, hidden], e.g. a Spill): write the outputs
    there and return views of it.

    On a CPU of more than one thread two windows run at once, one thread each (threads.window_workers), where every
    hook on the block is deferrable (calibrate/deferred.py): the hooks' calls are kept on the workers and run here in
    the windows' order, so what they accumulate is what one window at a time gives. The outputs are a one-thread
    run's bit for bit (a matmul's rounding can depend on its thread count).

    `reference` (the float block's outputs on the same windows): each window's squared-error terms against it are
    computed beside its forward, on the thread that ran it (not afterwards on the caller's, the workers idle), and
    (outputs, relative_error of the outputs against it) is returned."""
    if inputs.kwargs is None:
        raise ValueError(f"no block {inputs.block} to run: these are the last block's outputs")
    if inputs.skipped:  # the model passes the hidden states by this block (a cross-attention layer on text)
        kept = [_keep(h, store, i) for i, h in enumerate(inputs.hidden)]
        return kept if reference is None else (kept, relative_error(reference, kept))
    dtype = matmul_dtype(inputs, compute_dtype)
    cast = dtype != inputs.hidden[0].dtype
    device = inputs.hidden[0].device.type

    def forward(i: int) -> Tensor:  # autocast is per thread: entered by whichever thread runs the window
        h, kw = inputs.hidden[i], inputs.kwargs[i]
        if not cast:
            return _first(block(h, **kw))
        with torch.autocast(device_type=device, dtype=dtype):
            return _first(block(h, **kw)).to(h.dtype)

    def window(i: int):
        out = forward(i)
        return out if reference is None else (out, error_terms(reference[i], out))

    with linear_weights_in(block, dtype) if cast else contextlib.nullcontext():
        done = list(map_windows(block, range(len(inputs.hidden)), window, device))
    if reference is None:
        return [_keep(out, store, i) for i, out in enumerate(done)]
    return [_keep(out, store, i) for i, (out, _) in enumerate(done)], summed_error([t for _, t in done])


def spill(folder: Path, name: str, like: Tensor, n: int) -> Tensor:
    """A [n, *like.shape] tensor backed by a file in `folder` (memory-mapped, shared): the calibration activations
    of `calibration.offload: disk`, which the kernel pages out instead of holding in memory."""
    path = folder / f"{name}.bin"
    numel = n * like.numel()
    path.write_bytes(b"")
    os.truncate(path, numel * like.element_size())
    return torch.from_file(str(path), shared=True, size=numel, dtype=like.dtype).view(n, *like.shape)


def linear_flop(block: nn.Module, tokens: int) -> int:
    """Floating-point operations of the block's linear layers on `tokens` tokens (2 per weight per token; attention's
    own products and the element-wise work are left out: a profile's rates are those of the matmuls)."""
    n = 0
    for m in block.modules():
        if is_linear(m):
            out_features, in_features = linear_shape(m)
            n += out_features * in_features
    return 2 * n * tokens


def forward_work(block: nn.Module, inputs: BlockInputs, compute_dtype: torch.dtype | None) -> tuple[int, int, str]:
    """(flop, bytes, dtype) of a block forward over `inputs`, for profile.phase."""
    tokens = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
    return linear_flop(block, tokens), 0, str(matmul_dtype(inputs, compute_dtype)).replace("torch.", "")


def error_terms(ref: Tensor, out: Tensor) -> tuple[float, float]:
    """One sample's (||out - ref||^2, ||ref||^2)."""
    return float((out.float() - ref.float()).pow(2).sum()), float(ref.float().pow(2).sum())


def relative_error(ref: list[Tensor], out: list[Tensor]) -> float:
    """||out - ref||^2 / ||ref||^2 summed over all samples (over every process's samples in a data-parallel pass)."""
    return summed_error([error_terms(r, o) for r, o in zip(ref, out)])


def summed_error(terms: list[tuple[float, float]]) -> float:
    """relative_error from the samples' error_terms, added in the samples' order."""
    num = sum(t[0] for t in terms)
    den = sum(t[1] for t in terms)
    if active():
        num, den = reduce_sums([num, den])
    return num / max(den, 1e-30)


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


@dataclass(frozen=True)
class BlockPass:
    """How run_blockwise goes through the blocks, beyond the model, its calibration samples and the stages'
    `on_block`; a caller builds it once.

    `device`: where each block computes (the non-block modules go there for the pass; `offload`: where they and a
    resident model's blocks go back to after). `observe(index, name, block)` may return a context manager (e.g. a
    BlockObserver) that is active during the block's float forward. `compute_dtype`: see block_forward (statistics
    are gathered from the activations as computed in that dtype). `spill_dir` (a CPU run with calibration.offload:
    disk): the block inputs, float outputs and compressed outputs live in memory-mapped files there instead of in
    memory; the results are the same bit for bit. `blocks`: where each block comes from and goes after its turn
    (`begin()` once the block-0 inputs are captured, `load(i, device)`, `done(i, block)`, `end()` after the last
    block; ResidentBlocks by default, streaming.StreamedBlocks reads them from disk); `visitors`: see BlockVisitor.
    `start` > 0 resumes an interrupted pass at that block: `restore(inputs)` then returns (the block's calibration
    inputs, the errors so far) from the checkpoint, given the freshly captured block-0 inputs (every block's
    arguments are captured afresh). `notes` (a list) receives why replaying the blocks with their captured arguments
    is not the model's own forward, where it is not (also warned about as a ReplayWarning). `profile`
    (core/profile.py): the pass's phases are timed into it (capture, read, float forward, solves, compressed
    forward, the visitors' own phases)."""
    device: str | torch.device = "cpu"
    offload: str | torch.device = "cpu"
    progress: bool = True
    observe: Observe | None = None
    compute_dtype: torch.dtype | None = None
    spill_dir: Path | None = None
    blocks: object = None
    visitors: tuple[BlockVisitor, ...] = ()
    start: int = 0
    restore: Callable | None = None
    notes: list[str] | None = None
    profile: Profile | None = None


def run_blockwise(model: nn.Module, arch: ArchSpec, samples: Tensor | None, on_block: OnBlock,
                  options: BlockPass = BlockPass()) -> list[float]:
    """Apply the stages to each decoder block in turn, as `options` (BlockPass) says.

    Per block: the `observe` of `options` may return a context manager that is active during the block's float
    forward; `on_block(index, name, block, inputs, observer)` then changes the block (smooths, quantizes, replaces
    layers). The block's outputs are recomputed and become the next block's inputs. Returns, per block, the
    relative output error the stages introduced: ||block'(x) - block(x)||^2 / ||block(x)||^2 on the block's
    (already compressed) inputs. `samples` None: no calibration data (the stages act on each block without
    statistics; no errors are measured). Each block is replayed with its own arguments as the model's forward
    passes them (capture_block_inputs).
    """
    o = options
    device, offload, progress, observe, compute_dtype = o.device, o.offload, o.progress, o.observe, o.compute_dtype
    spill_dir, blocks, visitors, start, restore, notes = o.spill_dir, o.blocks, o.visitors, o.start, o.restore, o.notes
    profile = o.profile
    model.eval()
    if start and (shared := getattr(model.config, "num_kv_shared_layers", 0)):
        raise ValueError(f"cannot resume at block {start}: the last {shared} layers of this model read the keys and "
                         "values that earlier layers computed in the same forward (num_kv_shared_layers), and the "
                         "blocks before the resume point are not run again; run without --resume to start over")
    _move_non_blocks(model, arch, device)
    if spill_dir is not None and torch.device(device).type != "cpu":
        raise ValueError("calibration.offload: disk spills CPU activations; on an accelerator keep them there "
                         "(offload: memory) or lower calibration.n_samples")
    inputs, stores = None, [None, None, None]
    if samples is not None:
        with phase_of(profile, "capture"):
            inputs, captured_store = capture_block_inputs(model, arch, samples, device, spill_dir)
        if notes is not None:
            notes += inputs.arguments.problems
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
            inputs = inputs.at(start)
    blocks = blocks or ResidentBlocks(model, arch, offload)
    blocks.begin()
    n = len(arch.block_list(model))
    for i in tqdm(range(start, n), desc="blocks", unit="block", disable=not progress, initial=start, total=n):
        with phase_of(profile, "read"):
            block = blocks.load(i, device)
        for v in visitors:
            v.loaded(i, block)
        observer = observe(i, f"{arch.blocks}.{i}", block) if observe else None
        reference = None
        if inputs is not None:
            with observer if observer is not None else contextlib.nullcontext(), \
                    phase_of(profile, "float forward", *forward_work(block, inputs, compute_dtype)):
                reference = block_forward(block, inputs, compute_dtype, stores[1])
        with phase_of(profile, "solves"):
            on_block(i, f"{arch.blocks}.{i}", block, inputs, observer)
        observer = None  # the block's statistics (Hessians: 0.7 GB for a 7B block) are not needed past its stages
        block = get_module(model, f"{arch.blocks}.{i}")  # a stage may have swapped the whole block
        # a model computing in its own dtype (no autocast): its weight-only layers dequantized once for the
        # calibration windows and the visitors' forwards (the streamed evaluation's, in that dtype too)
        shared = inputs is not None and visitors and matmul_dtype(inputs, compute_dtype) == inputs.hidden[0].dtype
        with cached_dequantize(block, inputs.hidden[0].dtype, weight_only=True) if shared else \
                contextlib.nullcontext():
            if inputs is not None:
                with phase_of(profile, "compressed forward", *forward_work(block, inputs, compute_dtype)), \
                        cached_dequantize(block, matmul_dtype(inputs, compute_dtype)):
                    outputs, error = block_forward(block, inputs, compute_dtype, stores[2], reference)
                    errors.append(error)
                inputs = inputs.advance(outputs)
                stores[0], stores[2] = stores[2], stores[0]  # the next block writes over these inputs
            for v in visitors:
                v.compressed(i, block)
        with phase_of(profile, "offload"):  # a streamed block's tensors written (phase "writing") and released
            blocks.done(i, block)
        del reference, observer
        with phase_of(profile, "checkpoint"):  # a streamed run's progress saved after each block
            for v in visitors:
                v.done(i, inputs, errors)
    blocks.end()
    _move_non_blocks(model, arch, offload)
    return errors
