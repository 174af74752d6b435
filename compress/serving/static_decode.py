"""Greedy decoding over a static KV cache, one step captured in a CUDA graph and replayed per token.

The loop is lean_decode.py's (the model's own modules called one after another: norms, linears, MLP, rotary table,
head; the same families: `lean=True` in compress/arch/tables.py) with what a CUDA graph needs: every tensor a step
reads or writes lives at a fixed address, allocated once for `batch` sequences of up to `max_len` tokens (the KV cache [layers, batch,
kv_heads, max_len, head_dim] in the model's dtype, the token buffer, the rotary table, the position), and the step
is a function of those alone: the position is a device tensor, the cache is written with index_copy_ at it,
attention reads the whole cache with the slots past the position masked (at a few hundred tokens that costs less
than any data-dependent slice, which capture forbids), and the greedy token is taken inside the step and written
back to the token buffer for the next one. Nothing in it reads a device value on the host (tested with
cuda_graph.no_host_sync on the CPU, checked again before each capture on the GPU).

Why not transformers' own forward with StaticCache: in 5.x its mask construction and cache bookkeeping take
Python branches on their inputs and, outside torch.compile, may read tensors on the host (padding checks), so its
capture-safety depends on the version; the lean loop's does not, and it keeps QuantLinear layers on whatever kernel
the dispatcher installed (their direct launch path allocates outputs with torch.empty, which capture serves from the
graph's pool).

Prefill is eager (one forward over the prompt, SDPA with a causal mask, in chunks of sequences); each decode step
reads a token per sequence. On CUDA the first `decode` captures the step (after an eager check and a warm-up on a
side stream) and replays it; if capture is refused or fails, the steps run eagerly and `mode` says why. On a CPU the
same step function runs eagerly: the tests compare its tokens with transformers' greedy decoding.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .lean_decode import lean_problem
from ..kernels.cuda_graph import StepTimer, capture, capture_problem

GRAPH = "CUDA graph replays (static KV cache)"
EAGER = "eager steps (static KV cache)"
PREFILL_TOKENS = 16384  # tokens per prefill chunk: bounds the prefill's activations (a whole batch of 64 × 512 at once
#                         would hold several GB of MLP activations beside the weights)


def static_problem(model: nn.Module, max_len: int) -> str | None:
    """Why StaticDecoder cannot run `model` for `max_len` tokens (None: it can)."""
    problem = lean_problem(model, max_len)
    if problem:
        return problem
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind in ("dynamic", "longrope"):
        return f"rope_type {kind!r} rescales the rotary frequencies with the sequence length"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "modules with accelerate hooks (offloaded weights are copied in during the forward)"
    return None


def _rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """transformers' x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) = roll(x, half) * sign and
    the sign folded into the table (sin_signed = cat(-sin1, sin2)): 3 kernels instead of 5."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _norm(module: nn.Module, x: Tensor) -> Tensor:
    """An RMSNorm as one F.rms_norm call (one fused kernel where torch has it, against 8 for transformers' module:
    a decode step is hundreds of small kernels, each costing its launch); other norms call their module."""
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if type(module).__name__.endswith("RMSNorm") and eps is not None and w is not None and w.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return module(x)


class StaticDecoder:
    """Greedy decoding of `batch` sequences of up to `max_len` tokens (prompt and generated) with `model`.

    `prefill(ids)` runs the prompts [batch, T] and takes the first greedy token; `decode(n)` takes n more (each step
    feeds the last token and appends the next); `tokens()` returns the generated ones; `rewind(length)` forgets
    everything from position `length` on (the cache slots are overwritten by the next steps). `graph`: capture the
    step in a CUDA graph (default: on CUDA); `mode` says how the steps ran."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, graph: bool | None = None):
        problem = static_problem(model, max_len)
        if problem:
            raise ValueError(f"the static decode loop cannot run this model: {problem}")
        cfg = model.config
        self.model, self.batch, self.max_len = model, batch, max_len
        self.base = model.model
        self.blocks = list(self.base.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        attn = self.blocks[0].self_attn
        self.head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        self.split_qkv = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        emb = self.base.embed_tokens.weight
        self.dtype, self.device = emb.dtype, emb.device
        shape = (len(self.blocks), batch, self.kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # seq[:, p] is the token at position p; the step feeds seq[:, pos] and writes seq[:, pos + 1]
        self.seq = torch.zeros(batch, max_len + 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.positions = torch.arange(max_len, device=self.device)
        with torch.no_grad():  # the rotary table for every position, computed once as the model computes it
            cos, sin = self.base.rotary_emb(emb[:1], self.positions[None])
        half = self.head_dim // 2
        self.cos = cos[0]  # [max_len, head_dim]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # signed for _rotate
        self.no_bias = torch.zeros(max_len, dtype=self.dtype, device=self.device)
        self.length = 0  # tokens in the cache (host copy of pos, kept without reading the device)
        self.prompt = 0
        self.use_graph = self.device.type == "cuda" if graph is None else graph
        self.graph = None
        self.mode: str | None = None  # set by the first decode
        self.ops_per_step: int | None = None  # operations a step runs, views excluded (counted before a capture)

    # --- the model, written out -------------------------------------------------------------------------------
    def _qkv(self, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q [b, T, H, D], rotated k and v [b, T, KV, D] of x [b, T, hidden]; cos / sin broadcast over
        [b, T, heads, D]. A fused qkv_proj (lean_decode.fuse_projections) is one matmul and q and k are rotated in
        one pass."""
        b, t = x.shape[:2]
        h, kv = self.heads, self.kv_heads
        qkv = getattr(attn, "qkv_proj", None)
        if qkv is not None:
            out = qkv(x).view(b, t, h + 2 * kv, self.head_dim)
            qk = _rotate(out[:, :, :h + kv], cos, sin)
            return qk[:, :, :h], qk[:, :, h:], out[:, :, h + kv:]
        q = attn.q_proj(x).view(b, t, h, self.head_dim)
        k = attn.k_proj(x).view(b, t, kv, self.head_dim)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), attn.v_proj(x).view(b, t, kv, self.head_dim)

    @staticmethod
    def _mlp(mlp: nn.Module, x: Tensor) -> Tensor:
        gate_up = getattr(mlp, "gate_up_proj", None)
        if gate_up is not None:
            g, u = gate_up(x).chunk(2, dim=-1)
        else:
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
        return mlp.down_proj(mlp.act_fn(g) * u)

    def _logits(self, h: Tensor) -> Tensor:
        return self.model.lm_head(_norm(self.base.norm, h))

    def _forward_prompt(self, ids: Tensor, rows: slice) -> Tensor:
        """Prompt tokens ids [b, T] at positions 0..T-1 for the sequences `rows`: fills their cache, returns the last
        position's logits [b, V]."""
        b, t = ids.shape
        h = self.base.embed_tokens(ids)  # [b, T, hidden]
        cos, sin = self.cos[:t, None], self.sin[:t, None]  # [T, 1, D], broadcast over [b, T, heads, D]
        groups = self.heads // self.kv_heads
        for i, block in enumerate(self.blocks):
            attn = block.self_attn
            q, k, v = self._qkv(attn, _norm(block.input_layernorm, h), cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, T, D]
            self.k[i, rows, :, :t] = k
            self.v[i, rows, :, :t] = v
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                               is_causal=True, scale=self.scaling)  # [b, H, T, D]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
            h = h + self._mlp(block.mlp, _norm(block.post_attention_layernorm, h))
        return self._logits(h[:, -1:])[:, 0]

    def _forward_token(self, tok: Tensor, pos: Tensor) -> Tensor:
        """One token per sequence, tok [B, 1], at position pos [1] (a device tensor): writes its keys and values
        into the cache at pos, attends over the cache with the slots past pos masked, returns logits [B, V]. About
        20 kernels a block (a fused q/k/v and gate/up): at batch 1 their launches are a visible part of a step."""
        b = tok.shape[0]
        h = self.base.embed_tokens(tok)  # [B, 1, hidden]
        cos = self.cos.index_select(0, pos)  # [1, D]: broadcast over [B, 1, heads, D]
        sin = self.sin.index_select(0, pos)
        bias = self.no_bias.masked_fill(self.positions > pos, float("-inf"))  # [max_len]: slots not yet written
        groups = self.heads // self.kv_heads
        for i, block in enumerate(self.blocks):
            attn = block.self_attn
            q, k, v = self._qkv(attn, _norm(block.input_layernorm, h), cos, sin)  # [B, 1, heads, D]
            kc, vc = self.k[i], self.v[i]  # [B, KV, max_len, D]
            kc.index_copy_(2, pos, k.reshape(b, self.kv_heads, 1, self.head_dim).to(kc.dtype))
            vc.index_copy_(2, pos, v.reshape(b, self.kv_heads, 1, self.head_dim).to(vc.dtype))
            q = q.reshape(b, self.kv_heads, groups, self.head_dim)  # query head kv * G + g reads KV head kv
            scores = torch.add(bias, torch.matmul(q, kc.transpose(2, 3)), alpha=self.scaling)  # [B, KV, G, max_len]
            o = torch.matmul(torch.softmax(scores, dim=-1), vc)  # [B, KV, G, D]; softmax accumulates in float32
            h = h + attn.o_proj(o.reshape(b, 1, self.heads * self.head_dim))
            h = h + self._mlp(block.mlp, _norm(block.post_attention_layernorm, h))
        return self._logits(h)[:, 0]

    def step(self) -> None:
        """One greedy step on the fixed-address state: feed seq[:, pos], write the argmax to seq[:, pos + 1], advance
        pos. What the CUDA graph captures."""
        logits = self._forward_token(self.seq.index_select(1, self.pos), self.pos)
        self.seq.index_copy_(1, self.pos + 1, logits.argmax(-1, keepdim=True))
        self.pos.add_(1)

    # --- the loop ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: Tensor) -> Tensor:
        """Run the prompts ids [batch, T] (eager) and take the first greedy token of each; returns it [batch]."""
        if ids.dim() != 2 or ids.shape[0] != self.batch:
            raise ValueError(f"prefill takes token ids [batch={self.batch}, T], got shape {tuple(ids.shape)}")
        t = ids.shape[1]
        if not 0 < t < self.max_len:
            raise ValueError(f"a prompt of {t} tokens leaves no room in max_len={self.max_len}; make it longer")
        ids = ids.to(self.device)
        chunk = max(1, PREFILL_TOKENS // t)
        for r in range(0, self.batch, chunk):
            rows = slice(r, min(r + chunk, self.batch))
            logits = self._forward_prompt(ids[rows], rows)
            self.seq[rows, t] = logits.argmax(-1)
        self.seq[:, :t] = ids
        self.pos.fill_(t)
        self.length = self.prompt = t
        return self.seq[:, t]

    def rewind(self, length: int) -> None:
        """Forget the tokens from position `length` on (at least one prompt token stays)."""
        if not 0 < length <= self.length:
            raise ValueError(f"rewind to {length}: between 1 and the current length {self.length}")
        self.pos.fill_(length)
        self.length = length

    def _capture(self) -> None:
        """Capture `step` once: an eager check that it is capture-safe, a warm-up, the capture. Every eager run and
        the capture start at the current position, which is restored after each (what they wrote beyond it is
        overwritten by the replays before it is read)."""
        start = self.pos.clone()
        stats: dict = {}
        problem = capture_problem(self.step, stats)
        self.ops_per_step = stats.get("ops")
        self.pos.copy_(start)
        if problem:
            self.mode = f"graph capture refused: {problem}; {EAGER}"
            return
        try:
            self.graph = capture(self.step, warmup=1, reset=lambda: self.pos.copy_(start))
            self.mode = GRAPH
        except Exception as e:  # noqa: BLE001 - any capture failure leaves eager steps, with the reason
            self.graph = None
            self.pos.copy_(start)
            self.mode = f"graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; {EAGER}"

    @torch.no_grad()
    def ready(self) -> str:
        """Capture the step if not yet done (after a prefill: `decode` calls it); returns `mode`."""
        if self.mode is None:
            if self.length == 0:
                raise ValueError("capture needs a prefill first (the step runs once at the current position)")
            if self.use_graph:
                self._capture()
            else:
                self.mode = EAGER + ("" if self.device.type != "cuda" else " (graph=False)")
        return self.mode

    @torch.no_grad()
    def decode(self, n: int) -> StepTimer:
        """n greedy steps for the whole batch; returns their timer (`times()`, `span()`: CUDA events, read once)."""
        if self.length == 0:
            raise ValueError("decode needs a prefill first")
        if self.length + n > self.max_len:
            raise ValueError(f"{self.length} + {n} tokens exceed max_len={self.max_len}; make it longer")
        if n:
            self.ready()
        timer = StepTimer(self.device)
        run = self.graph.replay if self.graph is not None else self.step
        for _ in range(n):
            timer.call(run)
        self.length += n
        return timer

    def tokens(self) -> Tensor:
        """The generated tokens [batch, length - prompt + 1] (the prefill's and every step's)."""
        return self.seq[:, self.prompt:self.length + 1]


@torch.no_grad()
def greedy_generate(model: nn.Module, ids: Tensor, new_tokens: int, graph: bool | None = None) -> Tensor:
    """`new_tokens` greedy tokens after the prompts ids [batch, T] on the static loop: [batch, new_tokens]."""
    dec = StaticDecoder(model, ids.shape[0], ids.shape[1] + new_tokens, graph)
    dec.prefill(ids)
    dec.decode(new_tokens - 1)
    return dec.tokens()
