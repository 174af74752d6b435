"""Perplexity by the GPTQ/AWQ protocol, and agreement with a baseline on the same windows.

Protocol: the WikiText-2 test rows joined with "\\n\\n", tokenized once, cut into non-overlapping
windows of seq_len (stride = seq_len), the tail dropped; every window scores its seq_len - 1
next-token predictions. With a baseline, each window is run through every model in turn, so
KL(P_baseline || P_model) and top-1 agreement are computed without storing logits.
Logits are produced in chunks of positions so a 49k-token vocabulary at 2048 positions never
needs more than a few hundred MB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..calibrate.deferred import map_windows, parallel_safe

CHUNK = 512  # positions per logits chunk


@dataclass
class TextScores:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    kl: float | None = None  # mean KL(baseline || model) per token, nats
    top1_agreement: float | None = None  # share of positions whose argmax equals the baseline's


def _final_hidden(model: nn.Module, ids: Tensor, arch=None) -> Tensor:
    """The final hidden states (after the final norm): the output of the module that holds the decoder blocks
    (Llama 4's text model: its `base_model` is the causal-LM model itself). `arch`: the model's spec, if known."""
    out = _trunks(model, arch)[0](input_ids=ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _logits(model: nn.Module, hidden: Tensor, arch=None) -> Tensor:
    return final_logits(model, hidden, arch=arch)


def _arch(model: nn.Module):
    """The model's spec, or None where no decoder blocks are found (its base model is then the trunk)."""
    from ..arch import get_arch
    try:
        return get_arch(model)
    except ValueError:
        return None


class _BaseOutput:
    """What a base model's forward returns, as final_logits' stand-in: the given final hidden states; every other
    field (cache, attentions, router logits, ...) None."""

    def __init__(self, hidden: Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str):  # only for the fields not set
        return None

    def __getitem__(self, i):
        return (self.last_hidden_state,)[i]


def _trunks(model: nn.Module, arch=None) -> list[nn.Module]:
    """The modules between a causal-LM model and its decoder blocks (Llama: `model`; OPT: `model` and
    `model.decoder`, which OPTForCausalLM calls directly): what its forward may call for the final hidden states."""
    arch = arch or _arch(model)
    if arch is None:  # no decoder blocks found: the base model is the trunk
        return [getattr(model, "base_model", model)]
    if "." not in arch.blocks:  # the blocks sit on the model itself
        return [model]
    parts = arch.blocks.split(".")[:-1]
    return [model.get_submodule(".".join(parts[:k])) for k in range(1, len(parts) + 1)]


def final_logits(model: nn.Module, hidden: Tensor, head: nn.Module | None = None, arch=None) -> Tensor:
    """Float32 logits of final hidden states (after the final norm; [seq, hidden] or [batch, seq, hidden]) as the
    model's own causal-LM forward computes them: that forward runs with the module it calls for the final hidden
    states replaced by a stand-in that returns `hidden`, so the head and whatever the family does after it are the
    family's own code (Gemma's soft-capping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's
    lm_head_multiplier), gradients included. `head`: a head module used in place of the model's own for the call (a
    streamed run scores its float baseline with the original head after the quantize stage replaced the model's)."""
    own_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    trunks = [t for t in _trunks(model, arch) if t is not model] if own_head is not None else []
    if not trunks:  # no causal-LM wrapper around a decoder: the head alone
        return (head or own_head)(hidden).float()
    squeeze = hidden.dim() == 2
    h = hidden[None] if squeeze else hidden
    head_path = next(n for n, m in model.named_modules() if m is own_head) if head is not None else None
    own_forwards = [t.__dict__.get("forward") for t in trunks]  # instance-level forwards someone set: put back after
    for t in trunks:
        t.forward = lambda *args, **kwargs: _BaseOutput(h)
    if head_path is not None:
        model.set_submodule(head_path, head)
    try:  # forward(), not __call__: hooks others put on the model (a training loop's) must not see this stand-in call
        out = model.forward(inputs_embeds=h, use_cache=False)
    finally:
        for t, f in zip(trunks, own_forwards):
            del t.forward
            if f is not None:
                t.forward = f
        if head_path is not None:
            model.set_submodule(head_path, own_head)
    logits = (out.logits if hasattr(out, "logits") else out[0]).float()
    return logits[0] if squeeze else logits


@torch.no_grad()
def score_windows(models: dict[str, nn.Module], windows: Tensor, baseline: str | None = None,
                  device: str = "cpu", progress: bool = True) -> dict[str, TextScores]:
    """Score each model on windows [n, seq_len]; with `baseline`, add KL and top-1 against it."""
    archs = {n: _arch(m) for n, m in models.items()}  # found once, not per window
    final = {n: (lambda k, ids, m=m, a=archs[n]: _final_hidden(m, ids, a)[0, :-1]) for n, m in models.items()}
    heads = {n: _plain_head(m, archs[n]) for n, m in models.items()}
    if all(h is not None for h in heads.values()):  # no stand-in forward to swap in: windows may run side by side
        logits = {n: (lambda h, head=head: head(h).float()) for n, head in heads.items()}
        parallel = nn.ModuleList(models.values())
    else:
        logits = {n: (lambda h, m=m, a=archs[n]: _logits(m, h, a)) for n, m in models.items()}
        parallel = None
    return score_hidden(final, logits, windows, baseline, device, progress, parallel)


def _plain_head(model: nn.Module, arch) -> nn.Module | None:
    """The model's output head where its causal-LM forward computes nothing after it (the logits of random final
    hidden states through final_logits equal the head's own, bit for bit), else None. final_logits swaps a stand-in
    forward into the model for each call, which two threads must not do at once; the head alone is safe to share."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    param = next(model.parameters(), None)
    # a model whose windows stay serial anyway (accelerate's offload hooks: its weights may sit on the meta device)
    # is not probed
    if head is None or param is None or param.is_meta or not parallel_safe(model):
        return None
    width = getattr(head, "in_features", None) or model.config.get_text_config().hidden_size
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(param.device, param.dtype)
    return head if torch.equal(final_logits(model, probe, arch=arch), head(probe).float()) else None


@torch.no_grad()
def score_hidden(final: dict[str, Callable[[int, Tensor], Tensor]], logits: dict[str, Callable[[Tensor], Tensor]],
                 windows: Tensor, baseline: str | None = None, device: str = "cpu",
                 progress: bool = True, parallel_over: nn.Module | None = None) -> dict[str, TextScores]:
    """The scoring of score_windows from each model's final hidden states: `final[name](k, ids)` gives window k's
    [seq_len - 1, hidden] (computed now, or carried block by block by a streamed pass), `logits[name](h)` its
    float32 logits. `parallel_over`: the modules the callables run, where windows may go two at a time on worker
    threads (calibrate/deferred.map_windows; the scores are then a one-thread run's bit for bit); None: one at a time."""
    names = list(final)
    if baseline is not None:
        names.remove(baseline)
        names.insert(0, baseline)
    nll = {n: 0.0 for n in names}
    kl = {n: 0.0 for n in names}
    agree = {n: 0 for n in names}
    count = 0

    def window(k: int) -> list[tuple[str, float, float, int]]:
        """Window k's terms, chunk by chunk and model by model: (model, -log p of the targets, KL, top-1 matches)."""
        ids = windows[k][None].to(device)  # [1, S]
        targets = ids[0, 1:]
        hidden = {n: final[n](k, ids) for n in names}  # [S-1, H]
        terms = []
        for start in range(0, targets.numel(), CHUNK):
            sl = slice(start, start + CHUNK)
            base_logp = None
            for n in names:
                logp = torch.log_softmax(logits[n](hidden[n][sl]), dim=-1)  # [C, V]
                term = [n, float(logp.gather(1, targets[sl, None]).sum()), 0.0, 0]
                if n == baseline:
                    base_logp = logp
                elif base_logp is not None:
                    term[2] = float((base_logp.exp() * (base_logp - logp)).sum())
                    term[3] = int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
                terms.append(term)
        return terms

    # two windows at once on a CPU of more than one thread where the models allow it (calibrate/deferred.py); the
    # terms are added here in the windows' order, as one window at a time adds them
    runs = map_windows(parallel_over, range(len(windows)), window, str(device).split(":")[0]) \
        if parallel_over is not None else map(window, range(len(windows)))
    for terms in tqdm(runs, desc="perplexity windows", unit="win", disable=not progress, total=len(windows)):
        for n, logp_sum, kl_sum, matches in terms:
            nll[n] -= logp_sum
            kl[n] += kl_sum
            agree[n] += matches
        count += windows.shape[1] - 1
    out = {}
    for n in names:
        mean = nll[n] / count
        has_ref = baseline is not None
        out[n] = TextScores(math.exp(mean), mean, count,
                            kl=(kl[n] / count) if has_ref else None,
                            top1_agreement=(agree[n] / count if n != baseline else 1.0) if has_ref else None)
    return out
