"""Train an EAGLE-3 draft head (serving/eagle.py) for a target, quantized or not, on the target's own generations.

Data. Prompts from WikiText-2 train (never the test text `compress speculate` measures on) are continued by the target
itself, half greedily and half sampled (temperature `sample_temperature`), so the head learns the text the target
writes in both modes. One more forward over every sequence gives the target's hidden states at the head's three
layers and its logits, of which only the draft vocabulary's are kept (log-softmax over it, float16): the teacher.
The draft vocabulary is the `draft_vocab` tokens most frequent in those generations (EAGLE-3's choice).

Training ("training-time test"). The head's entries are unrolled `ttt_steps` times as drafting meets them: step 0
reads the target's features at every position; step s ≥ 1 at position p reads step s − 1's output at p − 1 and
attends to the exact entries up to p − s and to its own chain (steps 1..s at p − s + 1..p); every step at position p
embeds token p + 1 and is scored against the target's distribution for token p + 2 (cross-entropy with the teacher's
probabilities over the draft vocabulary, steps weighted equally). The target never trains: only its features are read.
The tests check the unrolled attention against HeadStream decoding the same chain one entry at a time.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..serving.eagle import EagleHead, head_config


@dataclass(frozen=True)
class HeadTraining:
    """What `compress draft-head` does: `sequences` prompts of `prompt_tokens` continued by `new_tokens` (and
    `text_sequences` stretches of text as long, read as they are); `epochs` passes of AdamW at `lr` (cosine to 10%,
    5% warm-up) over batches of `batch` sequences, unrolled `ttt_steps`."""
    sequences: int = 384
    prompt_tokens: int = 64
    new_tokens: int = 192
    generate_batch: int = 16
    sample_temperature: float = 0.8
    text_sequences: int = 0  # WikiText-2 validation windows of prompt + new tokens, teacher-forced, beside them
    draft_vocab: int = 4096
    epochs: int = 10
    batch: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.0
    ttt_steps: int = 3
    bf16: bool = True  # train under bfloat16 autocast where the CPU computes it natively (AMX / AVX512-BF16)
    seed: int = 0

    def __post_init__(self):
        for name in ("sequences", "prompt_tokens", "new_tokens", "generate_batch", "draft_vocab", "epochs", "batch",
                     "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft-head training: {name} = {getattr(self, name)} must be >= 1")
        if self.text_sequences < 0:
            raise ValueError(f"draft-head training: text_sequences = {self.text_sequences} must be >= 0")
        if self.lr <= 0 or self.sample_temperature <= 0:
            raise ValueError("draft-head training: lr and sample_temperature must be > 0")
        if self.ttt_steps > self.prompt_tokens + self.new_tokens - 2:
            raise ValueError(f"ttt_steps {self.ttt_steps} is longer than the sequences")

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def generate_sequences(target: nn.Module, prompts: Tensor, cfg: HeadTraining, progress=None) -> Tensor:
    """The target's continuations of `prompts` [N, P] -> [N, P + new_tokens]: even batches greedy, odd ones sampled."""
    from transformers import GenerationConfig

    out = []
    g = torch.Generator().manual_seed(cfg.seed)
    for b, start in enumerate(range(0, prompts.shape[0], cfg.generate_batch)):
        ids = prompts[start:start + cfg.generate_batch]
        sample = b % 2 == 1
        # transformers' sampling draws from torch's global generator and takes no other: seeded per batch from ours
        torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g)))
        gc = GenerationConfig(max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens, do_sample=sample,
                              temperature=cfg.sample_temperature if sample else None, top_k=None, top_p=None,
                              pad_token_id=0, eos_token_id=None)
        out.append(target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc))
        if progress:
            progress(min(start + cfg.generate_batch, prompts.shape[0]), prompts.shape[0])
    return torch.cat(out)


def frequent_ids(sequences: Tensor, n: int, vocab: int) -> Tensor:
    """The `n` ids most frequent in `sequences` (ties and unseen ids: lowest first), sorted."""
    counts = torch.bincount(sequences.flatten(), minlength=vocab).double()
    counts += torch.linspace(1e-3, 0, vocab, dtype=torch.float64)
    return torch.topk(counts, min(n, vocab)).indices.sort().values


@torch.no_grad()
def teacher_data(target: nn.Module, sequences: Tensor, aux_layers: tuple[int, ...], ids: Tensor, batch: int = 8,
                 progress=None) -> tuple[Tensor, Tensor]:
    """Per token: the target's hidden states entering `aux_layers`, concatenated [N, T, 3H] (bfloat16), and its
    log-probabilities over the draft vocabulary `ids`, renormalised [N, T, len(ids)] (float16). The target's own head
    runs one sequence at a time, so no batch × length × vocabulary logits tensor is built (a 128k vocabulary)."""
    feats, teach = [], []
    head = target.get_output_embeddings()
    for start in range(0, sequences.shape[0], batch):
        out = target.model(input_ids=sequences[start:start + batch], output_hidden_states=True)
        feats.append(torch.cat([out.hidden_states[j] for j in aux_layers], -1).to(torch.bfloat16))
        last = out.last_hidden_state  # after the final norm: what the head reads
        teach += [torch.log_softmax(head(last[i:i + 1])[..., ids].float(), -1).to(torch.float16)
                  for i in range(last.shape[0])]
        if progress:
            progress(min(start + batch, sequences.shape[0]), sequences.shape[0])
    return torch.cat(feats), torch.cat(teach)


def init_head(target: nn.Module, draft_vocab: int, ids: Tensor, aux_layers=None, seed: int = 0) -> EagleHead:
    """A new head for `target`: lm_head from the target's output rows of the draft vocabulary, `norm` from its final
    norm, `fc` passing the deepest feature layer through and o_proj, down_proj zero (so a new head starts as the
    target's late-layer readout), the rest at random (seeded). That start predicts token p + 1 where p + 2 is asked,
    so its first loss is high (~17 nats), but on the embedded model it trains to a lower held-out KL at every epoch
    than a random `fc` (2.48 against 2.69 after 10 epochs; docs/results.md, "EAGLE-3 draft heads")."""
    torch.manual_seed(seed)
    head = EagleHead(head_config(target.config, draft_vocab, aux_layers)).float()
    with torch.no_grad():
        h = head.config.hidden_size
        if head.config.target_hidden_size == h:
            deepest = max(range(3), key=lambda i: head.aux_layers[i])
            head.fc.weight.zero_()
            head.fc.weight[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.lm_head.weight.copy_(head_rows(target.get_output_embeddings(), ids))
        norm = getattr(target.model, "norm", None)
        weight = getattr(norm, "weight", None)
        if weight is not None and weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.detach().float())
    head.set_vocab(ids)
    return head


def head_rows(out: nn.Module, ids: Tensor) -> Tensor:
    """Rows `ids` of an output head as float32: a float linear's weight rows, or a QuantLinear's dequantized codes
    (with its low-rank term, if any)."""
    from ..core.nn import QuantLinear

    if isinstance(out, QuantLinear):
        rows = out.qtensor().dequantize(torch.float32)[ids]
        return rows if not out.rank else rows + (out.lora_b.float()[ids] @ out.lora_a.float())
    weight = getattr(out, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"the target's output head ({type(out).__name__}) is neither a linear nor a QuantLinear: "
                         "a head cannot start from its rows")
    return weight.detach()[ids].float()


def _shift(x: Tensor, d: int) -> Tensor:
    """x [..., T, D] moved d positions later along T (row p holds row p − d; the first d rows zero)."""
    if d == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:-2], d, x.shape[-1]), x[..., :-d, :]], -2)


def _repeat(x: Tensor, groups: int) -> Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def ttt_logits(head: EagleHead, emb: Tensor, feats: Tensor, steps: int) -> list[Tensor]:
    """The unrolled head over a batch: emb [B, T, H] (entry p's token: p + 1), feats [B, T, 3H] (the target's at p)
    -> per step s the draft-vocabulary logits [B, T, dv] (valid from position s on)."""
    b, t, _ = emb.shape
    pos = torch.arange(t, device=emb.device)[None].expand(b, t)
    groups = head.heads // head.kv_heads
    causal = torch.ones(t, t, dtype=torch.bool, device=emb.device).tril()
    hidden = head.fc(feats)
    keys, values, out = [], [], []
    for s in range(steps):
        q, k, v = head.qkv(emb, hidden, pos)
        keys.append(_repeat(k, groups))
        values.append(_repeat(v, groups))
        if s == 0:
            scores = (q @ keys[0].transpose(-1, -2) * head.scaling).masked_fill(~causal, float("-inf"))
            o = torch.softmax(scores, -1) @ values[0]
        else:
            exact = (q @ keys[0].transpose(-1, -2) * head.scaling).masked_fill(~causal.tril(-s), float("-inf"))
            chain_k = [_shift(keys[j], s - j) for j in range(1, s + 1)]  # step j's entry at p − s + j
            chain_v = [_shift(values[j], s - j) for j in range(1, s + 1)]
            chain = torch.stack([(q * kk).sum(-1) for kk in chain_k], -1) * head.scaling  # [B, heads, T, s]
            p = torch.softmax(torch.cat([exact, chain], -1), -1)
            o = p[..., :t] @ values[0] + sum(p[..., t + i, None] * vv for i, vv in enumerate(chain_v))
        prenorm = head.finish(o, hidden)
        out.append(head.logits(prenorm))
        hidden = _shift(prenorm, 1)  # step s + 1 at p reads step s's output at p − 1
    return out


def ttt_loss(head: EagleHead, emb: Tensor, feats: Tensor, teacher: Tensor, steps: int) -> tuple[Tensor, dict]:
    """Mean over steps of the cross-entropy to the teacher (log-probabilities [B, T, dv] of token p + 1's successor,
    i.e. teacher row p + 1 for entry p) over valid positions; with each step's KL (the cross-entropy less the
    teacher's entropy: 0 for a perfect head) and top-1 agreement."""
    logits = ttt_logits(head, emb[:, 1:], feats[:, :-1], steps)  # entry p: token p + 1, the features at p
    target_lp = teacher[:, 1:].float()
    losses, stats = [], {"kl": [], "agreement": []}
    for s, lg in enumerate(logits):
        lp = torch.log_softmax(lg[:, s:].float(), -1)
        tlp = target_lp[:, s:]
        tp = tlp.exp()
        losses.append(-(tp * lp).sum(-1).mean())
        with torch.no_grad():
            stats["kl"].append(float((tp * (tlp - lp)).sum(-1).mean()))
            stats["agreement"].append(float((lg[:, s:].argmax(-1) == tlp.argmax(-1)).float().mean()))
    return sum(losses) / len(losses), stats


def _autocast(cfg: HeadTraining):
    """bfloat16 autocast on a CPU with native bf16 when cfg.bf16 (~1.5× faster steps here; losses stay float32)."""
    from .kd import native_bf16

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16 and native_bf16())


def train_head(head: EagleHead, embed: nn.Module, sequences: Tensor, feats: Tensor, teacher: Tensor,
               cfg: HeadTraining, holdout: int = 0, progress=None) -> list[dict]:
    """AdamW over the head's weights (the embedding is the target's, frozen). The last `holdout` sequences are left
    out and scored after each epoch. Returns the history (per epoch: train loss, held-out KL and agreement per
    unrolled step)."""
    n = sequences.shape[0] - holdout
    if n < 1:
        raise ValueError(f"{sequences.shape[0]} sequences leave none to train on after holding out {holdout}")
    params = [p for name, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    per_epoch = math.ceil(n / cfg.batch)
    total = per_epoch * cfg.epochs
    warm = max(1, total // 20)
    g = torch.Generator().manual_seed(cfg.seed)
    history, step, t0 = [], 0, time.perf_counter()
    head.train()
    for epoch in range(cfg.epochs):
        order = torch.randperm(n, generator=g)
        running = []
        for i in range(per_epoch):
            rows = order[i * cfg.batch:(i + 1) * cfg.batch]
            lr = cfg.lr * (step + 1) / warm if step < warm else \
                cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.no_grad():
                emb = embed(sequences[rows]).float()  # per batch: the whole set's embeddings would be N·T·H floats
            with _autocast(cfg):
                loss, _ = ttt_loss(head, emb, feats[rows].float(), teacher[rows], cfg.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            running.append(loss.item())
            step += 1
            if progress:
                progress(step, total, running[-1])
        row = {"epoch": epoch + 1, "train_loss": sum(running) / len(running), "seconds": time.perf_counter() - t0}
        if holdout:
            with torch.no_grad():
                emb = embed(sequences[n:]).float()
            row.update(evaluate_head(head, emb, feats[n:], teacher[n:], cfg))
        history.append(row)
    head.eval()
    return history


@torch.no_grad()
def evaluate_head(head: EagleHead, emb: Tensor, feats: Tensor, teacher: Tensor, cfg: HeadTraining) -> dict:
    """Held-out KL to the target and top-1 agreement with it over the draft vocabulary, per unrolled step."""
    was = head.training
    head.eval()
    parts = []
    for start in range(0, emb.shape[0], cfg.batch):
        sl = slice(start, start + cfg.batch)
        with _autocast(cfg):
            parts.append(ttt_loss(head, emb[sl], feats[sl].float(), teacher[sl], cfg.ttt_steps)[1])
    head.train(was)
    mean = lambda key: [sum(p[key][s] for p in parts) / len(parts) for s in range(cfg.ttt_steps)]  # noqa: E731
    return {"heldout_kl": mean("kl"), "heldout_agreement": mean("agreement")}
