"""Speculative decoding: a cheap draft model proposes K tokens, the target checks them in one forward, and the
output is exactly what the target alone would produce (greedy: token for token; sampling: in distribution).

Sampling (Leviathan et al. 2023; Chen et al. 2023): with p the draft's distribution and q the target's at a position,
a drafted token x is kept with probability min(1, q(x) / p(x)); on the first rejection the token is drawn from the
normalised residual max(q − p, 0) and the round ends; if all K are kept, one more token is drawn from the target's
distribution after them. Every round emits at least one token, and each emitted token is distributed as q.
Greedy: a drafted token is kept while it equals the target's argmax; the first mismatch is replaced by the argmax.

With α the probability that a drafted token is accepted (taken as independent of position), one target step emits
    E[tokens] = (1 − α^(K+1)) / (1 − α)
and costs one target forward over K + 1 tokens plus K draft forwards. `predicted_speedup` turns that into a speed-up
from the cost of each; `roofline_speedup` takes the costs from the roofline model of an accelerator.

Caches: each model keeps a KV cache of every committed token but the last; after a round the caches are cropped back
to the accepted prefix, so nothing is recomputed. Batch 1. Runtime: `lean` runs Llama-style models through
lean_decode.LeanStream (their own modules over a preallocated cache, without transformers' per-call overhead),
`transformers` through the model's forward with a DynamicCache; `auto` (the default) takes lean where it applies.
Plain and speculative decoding of one comparison use the same runtime.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

K_MAX = 8  # the adaptive schedule's largest draft length
RUNTIMES = ("auto", "lean", "transformers")


def residual(q: Tensor, p: Tensor) -> Tensor:
    """The normalised residual max(q − p, 0) over the last axis; where q ≤ p everywhere (q = p), q itself."""
    r = (q - p).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), q)


def _sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def accept_sampled(tokens: Tensor, p: Tensor, q: Tensor, generator: torch.Generator | None = None,
                   resample_residual: bool = True) -> tuple[Tensor, Tensor]:
    """Verify drafted `tokens` [B, K] drawn from `p` [B, K, V] against the target's `q` [B, K + 1, V] (row K: the
    distribution after all K). Returns (n accepted [B] in 0..K, the next token [B]: from the residual at the first
    rejection, from q[:, K] when all K are kept). Vectorised over B so the exactness test can run 10^6 rounds.
    `resample_residual=False` draws the rejection token from q instead: the mistake the tests show is biased."""
    b, k = tokens.shape
    px = p.gather(-1, tokens[..., None])[..., 0]
    qx = q[:, :k].gather(-1, tokens[..., None])[..., 0]
    u = torch.rand(b, k, generator=generator, dtype=q.dtype, device=q.device)
    keep = u < (qx / px.clamp_min(torch.finfo(px.dtype).tiny)).clamp(max=1)  # u < min(1, q/p); p(x) > 0 as x ~ p
    n = torch.where(keep.all(-1), torch.full((b,), k, device=q.device), (~keep).int().argmax(-1))
    rows = torch.arange(b, device=q.device)
    q_n = q[rows, n]
    if k:
        p_n = p[rows, n.clamp(max=k - 1)]
        fix = residual(q_n, p_n) if resample_residual else q_n
        dist = torch.where((n < k)[:, None], fix, q_n)
    else:
        dist = q_n
    return n, _sample(dist, generator)


def accept_greedy(tokens: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification: `tokens` [B, K], `target_logits` [B, K + 1, V]. Drafted tokens are kept while they equal
    the target's argmax; returns (n accepted [B], the target's argmax at position n [B])."""
    best = target_logits.argmax(-1)  # [B, K + 1]
    k = tokens.shape[1]
    match = tokens == best[:, :k]
    n = torch.where(match.all(-1), torch.full_like(best[:, 0], k), (~match).int().argmax(-1))
    return n, best.gather(1, n[:, None])[:, 0]


def acceptance_rate(accepted: int, rejected: int) -> float:
    """The maximum-likelihood α of the lecture's model (each drafted token accepted independently with probability α,
    judged only while all before it were accepted): accepted tokens over judged ones."""
    return accepted / (accepted + rejected) if accepted + rejected else float("nan")


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one target step emits when each drafted token is accepted with probability α: (1 − α^(K+1)) / (1 − α)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate {alpha} is not in [0, 1]")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Speed-up over plain decoding, in units of one plain target step: E[tokens] / (verify_cost + K · draft_cost),
    draft_cost and verify_cost the time of one draft step and of the target's (K+1)-token forward over one target
    step."""
    return expected_tokens(alpha, k) / (verify_cost + k * draft_cost)


def best_k(alpha: float, draft_cost: float, verify_cost=lambda k: 1.0, k_max: int = K_MAX) -> int:
    """The draft length in 1..k_max with the largest predicted speed-up."""
    return max(range(1, k_max + 1), key=lambda k: predicted_speedup(alpha, k, draft_cost, verify_cost(k)))


def roofline_speedup(alpha: float, k: int, target, draft, accelerator, context: int = 1024) -> dict:
    """The roofline's speed-up of speculative decoding at batch 1 on `accelerator`: each cost is the roofline latency
    of one forward (a draft step: one token; the verify step: K + 1 tokens of one sequence, which read the weights
    and the KV cache once and do K + 1 times the FLOPs). target / draft: roofline.ModelFacts."""
    from .roofline import decode

    def step(m, tokens: int) -> float:
        one = decode(m, accelerator, 1, context)
        peak = one["crossover"] * accelerator.bandwidth_tbs * 1e12
        return max(one["bytes_moved"] / (accelerator.bandwidth_tbs * 1e12), tokens * one["flops"] / peak)

    plain = step(target, 1)
    draft_cost, verify_cost = step(draft, 1) / plain, step(target, k + 1) / plain
    return {"accelerator": accelerator.name, "k": k, "alpha": alpha, "draft_cost": draft_cost,
            "verify_cost": verify_cost, "expected_tokens": expected_tokens(alpha, k),
            "speedup": predicted_speedup(alpha, k, draft_cost, verify_cost)}


def _verify_estimate(measured: dict[int, list[float]], k: int) -> float:
    """The verify step's time with `k` drafted tokens: the median measured at k; unmeasured, the dearest measured at
    a shorter length (a (K+1)-token forward costs at least as much as a shorter one: the optimistic bound, so the
    schedule tries the length once), or with none shorter the cheapest longer one. Memory-bound hardware makes it
    flat in k; a CPU's matmul can jump at some row count (4 here, float32), which only measuring finds."""
    if k in measured:
        return statistics.median(measured[k])
    shorter = [statistics.median(v) for j, v in measured.items() if j < k]
    return max(shorter) if shorter else min(statistics.median(v) for v in measured.values())


@dataclass
class Generation:
    """What a generation produced and what it cost."""
    tokens: list[int]  # the new tokens only
    seconds: float
    target_steps: int = 0  # target forwards after the prefill
    proposed: int = 0  # drafted tokens offered for verification
    accepted: int = 0
    rejected: int = 0  # rounds that ended at a rejected draft token (the others accepted all K)
    draft_seconds: float = 0.0  # the rounds' draft steps
    target_seconds: float = 0.0  # the rounds' verify steps
    prefill_seconds: tuple[float, float] = (0.0, 0.0)  # target, draft
    ks: list[int] = field(default_factory=list)  # the draft length of every round
    runtime: str = "transformers"  # the decode loop the target ran on (lean or transformers)

    @property
    def alpha(self) -> float:
        """α as the lecture's formula means it, the chance that a drafted token is accepted given that all before it
        were: accepted / (accepted + rejected). (accepted / proposed counts the tokens after a rejection, which are
        never judged, as failures: it falls with K for the same draft.)"""
        return acceptance_rate(self.accepted, self.rejected)

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / self.target_steps if self.target_steps else float("nan")

    def record(self, k: int, n: int, draft_s: float, verify_s: float) -> None:
        """One round: k tokens drafted in draft_s, n of them accepted by a verify of verify_s."""
        self.target_steps += 1
        self.proposed += k
        self.accepted += n
        self.rejected += n < k
        self.draft_seconds += draft_s
        self.target_seconds += verify_s
        self.ks.append(k)


def check_settings(prompt: list[int], max_new_tokens: int, k: int, temperature: float) -> None:
    """A speculative decoding's arguments, each refused with what to use instead."""
    if max_new_tokens < 1 or not prompt:
        raise ValueError("speculative decoding needs a non-empty prompt and max_new_tokens >= 1")
    if not 1 <= k <= 64:
        raise ValueError(f"draft length k={k}: use 1..64 (the adaptive schedule picks from 1..{K_MAX})")
    if temperature < 0:
        raise ValueError(f"temperature {temperature} < 0; use 0 for greedy")


def emitted(drafted: list[int], n: int, nxt: int, eos_token_id: int | None) -> list[int]:
    """A round's new tokens: the n accepted drafts and the target's own, cut after an end-of-sequence token."""
    new = drafted[:n] + [nxt]
    return new[:new.index(eos_token_id) + 1] if eos_token_id is not None and eos_token_id in new else new


def adapted_k(gen: Generation, verify_s: dict[int, list[float]]) -> int:
    """The adaptive schedule's next K: the largest predicted speed-up from α so far (Laplace: never 0 or 1 after a
    round), the measured draft step and the verify step measured at each length."""
    alpha = (gen.accepted + 1) / (gen.accepted + gen.rejected + 2)
    return best_k(alpha, gen.draft_seconds / gen.proposed, lambda j: _verify_estimate(verify_s, j))


class _Stream:
    """One model's KV cache over the committed tokens: `forward(tokens)` appends them and returns their logits."""

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...] = ()):
        from transformers import DynamicCache

        from .hf_forward import cache_kwarg, last_logits_kwarg

        self.model, self.kw = model, cache_kwarg(model)
        self.aux_layers, self.features = tuple(aux_layers), None
        self.last_only = last_logits_kwarg(model)  # {"logits_to_keep": 1} where the model takes it
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.device = next(model.parameters()).device

    def forward(self, tokens: list[int], logits: str = "all") -> Tensor | None:
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise TypeError("a stream takes a flat, non-empty list of token ids (ints)")
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(self.length, self.length + len(tokens), device=self.device)[None]
        kw = {self.kw: self.cache, **(self.last_only if logits != "all" else {})}
        if self.aux_layers:
            kw["output_hidden_states"] = True
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **kw)
        if self.aux_layers:  # hidden_states[j]: the input of layer j (0: the embedding)
            self.features = torch.cat([out.hidden_states[j][0] for j in self.aux_layers], -1).float()
        self.length += len(tokens)
        if logits == "none":
            return None
        return out.logits[0, -1:].float() if logits == "last" else out.logits[0].float()  # [1 or len(tokens), V]

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: a negative count of tokens to remove
            self.length = length


def make_stream(model: nn.Module, max_len: int, runtime: str = "auto", aux_layers: tuple[int, ...] = ()):
    """A decoding stream for `model`: the lean path (lean_decode.LeanStream) where it applies and `runtime` allows,
    else transformers' forward with its cache. runtime 'lean' insists (an error names why it cannot). `aux_layers`:
    after each forward, `stream.features` holds the hidden states entering those layers, concatenated [T, n·H]
    float32 (an EAGLE-3 head's input)."""
    from .lean_decode import LeanStream, lean_problem

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: use one of {RUNTIMES}")
    if runtime == "lean" or (runtime == "auto" and lean_problem(model, max_len) is None):
        return LeanStream(model, max_len, aux_layers)
    return _Stream(model, aux_layers)


def _runtime_name(stream) -> str:
    return "transformers" if isinstance(stream, _Stream) else "lean"


def _probs(logits: Tensor, temperature: float) -> Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def _check_models(target: nn.Module, draft: nn.Module) -> None:
    vt, vd = target.get_output_embeddings().out_features, draft.get_output_embeddings().out_features
    if vt != vd:
        raise ValueError(f"the draft's vocabulary ({vd} logits) is not the target's ({vt}): a draft must share the "
                         "target's tokenizer; use a model of the same family (a pruned or quantized copy of it)")


@torch.no_grad()
def generate_plain(model: nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None, eos_token_id: int | None = None,
                   runtime: str = "auto") -> Generation:
    """Plain autoregressive decoding with the KV cache (the baseline): argmax at temperature 0, else a draw."""
    t0 = time.perf_counter()
    stream = make_stream(model, len(prompt) + max_new_tokens, runtime)
    logits = stream.forward(prompt, logits="last")[-1]
    t_prefill = time.perf_counter() - t0
    out, steps = [], 0
    while True:
        token = int(logits.argmax()) if temperature == 0 else int(_sample(_probs(logits, temperature), generator))
        out.append(token)
        if len(out) >= max_new_tokens or token == eos_token_id:
            break
        logits = stream.forward([token])[-1]
        steps += 1
    return Generation(out, time.perf_counter() - t0, target_steps=steps, prefill_seconds=(t_prefill, 0.0),
                      runtime=_runtime_name(stream))


@torch.no_grad()
def generate_speculative(target: nn.Module, draft: nn.Module, prompt: list[int], max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, adaptive: bool = False,
                         generator: torch.Generator | None = None, eos_token_id: int | None = None,
                         runtime: str = "auto") -> Generation:
    """Speculative decoding of `max_new_tokens` after `prompt` (token ids), batch 1. k: the draft length (the first
    one when `adaptive`: then each round picks the K in 1..8 of the largest predicted speed-up from the acceptance
    rate so far, the measured draft step and the verify step measured at each length)."""
    check_settings(prompt, max_new_tokens, k, temperature)
    _check_models(target, draft)
    t_start = time.perf_counter()
    max_len = len(prompt) + max_new_tokens + K_MAX + max(k, K_MAX)  # a round may draft past the end: cropped
    tgt, drf = make_stream(target, max_len, runtime), make_stream(draft, max_len, runtime)
    committed = list(prompt)
    gen = Generation([], 0.0, runtime=_runtime_name(tgt))
    if len(committed) > 1:  # prefill both caches with all but the last token (timed apart from the rounds)
        t0 = time.perf_counter()
        tgt.forward(committed[:-1], logits="none")
        t1 = time.perf_counter()
        drf.forward(committed[:-1], logits="none")
        gen.prefill_seconds = (t1 - t0, time.perf_counter() - t1)
    n_prompt = len(prompt)
    verify_s: dict[int, list[float]] = {}  # draft length -> the measured verify times
    while len(committed) - n_prompt < max_new_tokens:
        k_round = min(k, max_new_tokens - (len(committed) - n_prompt))  # never draft past the end
        # draft K tokens
        t0 = time.perf_counter()
        drafted, p_rows = [], []
        feed = committed[drf.length:]
        for _ in range(k_round):
            logits = drf.forward(feed, logits="last")[-1]
            if temperature == 0:
                token = int(logits.argmax())
            else:
                p_rows.append(_probs(logits, temperature))
                token = int(_sample(p_rows[-1], generator))
            drafted.append(token)
            feed = [token]
        t_draft = time.perf_counter() - t0
        # verify them in one target forward: rows 0..K are the target's distributions for d1..dK and the bonus
        t0 = time.perf_counter()
        logits = tgt.forward([committed[-1], *drafted])
        t_verify = time.perf_counter() - t0
        tokens = torch.tensor([drafted])
        if temperature == 0:
            n, nxt = accept_greedy(tokens, logits[None])
        else:
            n, nxt = accept_sampled(tokens, torch.stack(p_rows)[None], _probs(logits, temperature)[None], generator)
        n = int(n)
        committed += emitted(drafted, n, int(nxt), eos_token_id)
        tgt.crop(len(committed) - 1)
        drf.crop(len(committed) - 1)
        gen.record(k_round, n, t_draft, t_verify)
        if eos_token_id is not None and committed[-1] == eos_token_id:
            break
        verify_s.setdefault(k_round, []).append(t_verify)
        if adaptive:
            k = adapted_k(gen, verify_s)
    gen.tokens = committed[n_prompt:n_prompt + max_new_tokens]
    gen.seconds = time.perf_counter() - t_start
    return gen
