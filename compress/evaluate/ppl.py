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

CHUNK = 512  # positions per logits chunk


@dataclass
class TextScores:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    kl: float | None = None  # mean KL(baseline || model) per token, nats
    top1_agreement: float | None = None  # share of positions whose argmax equals the baseline's


def _final_hidden(model: nn.Module, ids: Tensor) -> Tensor:
    out = model.base_model(input_ids=ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _logits(model: nn.Module, hidden: Tensor) -> Tensor:
    return head_logits(model.get_output_embeddings(), model.config, hidden)


def head_logits(head: nn.Module, config, hidden: Tensor) -> Tensor:
    """Float32 logits of final hidden states through `head` (with the config's logit soft-capping)."""
    logits = head(hidden).float()
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:  # Gemma 2
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def score_windows(models: dict[str, nn.Module], windows: Tensor, baseline: str | None = None,
                  device: str = "cpu", progress: bool = True) -> dict[str, TextScores]:
    """Score each model on windows [n, seq_len]; with `baseline`, add KL and top-1 against it."""
    final = {n: (lambda k, ids, m=m: _final_hidden(m, ids)[0, :-1]) for n, m in models.items()}
    logits = {n: (lambda h, m=m: _logits(m, h)) for n, m in models.items()}
    return score_hidden(final, logits, windows, baseline, device, progress)


@torch.no_grad()
def score_hidden(final: dict[str, Callable[[int, Tensor], Tensor]], logits: dict[str, Callable[[Tensor], Tensor]],
                 windows: Tensor, baseline: str | None = None, device: str = "cpu",
                 progress: bool = True) -> dict[str, TextScores]:
    """The scoring of score_windows from each model's final hidden states: `final[name](k, ids)` gives window k's
    [seq_len - 1, hidden] (computed now, or carried block by block by a streamed pass), `logits[name](h)` its
    float32 logits."""
    names = list(final)
    if baseline is not None:
        names.remove(baseline)
        names.insert(0, baseline)
    nll = {n: 0.0 for n in names}
    kl = {n: 0.0 for n in names}
    agree = {n: 0 for n in names}
    count = 0
    for k, row in enumerate(tqdm(windows, desc="perplexity windows", unit="win", disable=not progress)):
        ids = row[None].to(device)  # [1, S]
        targets = ids[0, 1:]
        hidden = {n: final[n](k, ids) for n in names}  # [S-1, H]
        for start in range(0, targets.numel(), CHUNK):
            sl = slice(start, start + CHUNK)
            base_logp = None
            for n in names:
                logp = torch.log_softmax(logits[n](hidden[n][sl]), dim=-1)  # [C, V]
                nll[n] -= float(logp.gather(1, targets[sl, None]).sum())
                if n == baseline:
                    base_logp = logp
                elif base_logp is not None:
                    kl[n] += float((base_logp.exp() * (base_logp - logp)).sum())
                    agree[n] += int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
        count += targets.numel()
    out = {}
    for n in names:
        mean = nll[n] / count
        has_ref = baseline is not None
        out[n] = TextScores(math.exp(mean), mean, count,
                            kl=(kl[n] / count) if has_ref else None,
                            top1_agreement=(agree[n] / count if n != baseline else 1.0) if has_ref else None)
    return out
