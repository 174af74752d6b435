"""EAGLE-3 draft heads (Li et al. 2025): one decoder layer that reads the target's own hidden states and proposes the
next tokens, in the checkpoint layout vLLM and SGLang load (`LlamaForCausalLMEagle3`).

The head. `fc` maps the target's hidden states at three layers (`eagle_aux_hidden_state_layer_ids`; id j is the
input of target layer j, 0 the embedding, vLLM's convention and transformers' `hidden_states[j]`), concatenated, to
one hidden state. Its decoder layer (`midlayer`) normalises the embedding of a token (`input_layernorm`) and a hidden
state (`hidden_norm`), attends over both concatenated (q/k/v read 2·H), adds the attention to the un-normalised
hidden state (the residual), then an MLP; `norm` and `lm_head` give logits over a draft vocabulary of
`draft_vocab_size` tokens (target id = draft index + `d2t`). The embedding is the target's (not stored: vLLM shares
the target's when the checkpoint has none).

Alignment. The head's entry at position i pairs the hidden state for position i with the embedding of token i + 1
and predicts token i + 2. An exact entry takes the target's features at i (through `fc`); after the last exact entry
the head feeds its own output (the pre-norm hidden state, not through `fc`) into the next position, which is how it
drafts several tokens from one target forward. After the target verifies a round, the self-fed entries are cropped
and replaced by exact entries for the accepted tokens (`generate_eagle`). Training unrolls the same self-feeding
(distill/eagle.py, "training-time test"), so what the head is trained on is what it meets when drafting.

Exactness is the verifier's (speculative.accept_greedy / accept_sampled): the head only proposes; tokens outside its
draft vocabulary get probability 0 from it and are drawn from the residual.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from .lean_decode import _linear, _rotate, attend
from .speculative import (K_MAX, Generation, _probs, _runtime_name, _sample, accept_greedy, accept_sampled,
        adapted_k, check_settings, emitted, make_stream)

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """vLLM's default choice for a Llama target of `n_layers` layers: the inputs of layers 2, n/2 and n − 3."""
    if n_layers < 6:
        raise ValueError(f"vLLM's default feature layers (2, n/2, n - 3) are not three distinct layers of a target of "
                         f"{n_layers} layers; name three with --aux-layers")
    return 2, n_layers // 2, n_layers - 3


def head_config(target_config, draft_vocab: int, aux_layers: tuple[int, ...] | None = None,
                intermediate: int | None = None):
    """The head's LlamaConfig for a Llama-family target: one layer of the target's width (it reads the target's
    embedding), attention shape, rotary embedding, vocabulary and norm epsilon; its own MLP width (default the
    target's); `draft_vocab` rows in its head."""
    from transformers import LlamaConfig

    t = target_config
    n_layers = t.num_hidden_layers
    aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(n_layers)
    if len(set(aux)) != 3 or not all(0 <= a < n_layers for a in aux):
        raise ValueError(f"aux layers {aux}: give three distinct hidden-state ids in 0..{n_layers - 1} (j = the input "
                         "of layer j; --aux-layers)")
    aux = tuple(sorted(aux))  # vLLM collects them walking the layers: in ascending order whatever the list's
    if not 1 <= draft_vocab <= t.vocab_size:
        raise ValueError(f"draft vocabulary {draft_vocab}: use 1..{t.vocab_size} (the target's vocabulary)")
    heads = t.num_attention_heads
    h = t.hidden_size
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(t, "rope_theta", 1e4)}
    cfg = LlamaConfig(hidden_size=h, intermediate_size=intermediate or t.intermediate_size, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", heads),
                      head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, vocab_size=t.vocab_size,
                      rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
                      hidden_act=t.hidden_act, rope_parameters=dict(rope), tie_word_embeddings=False,
                      bos_token_id=getattr(t, "bos_token_id", None), eos_token_id=getattr(t, "eos_token_id", None))
    cfg.architectures = [ARCHITECTURE]
    cfg.draft_vocab_size = draft_vocab
    cfg.target_hidden_size = t.hidden_size
    cfg.eagle_aux_hidden_state_layer_ids = list(aux)
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(cfg.hidden_size, eps), RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn, self.mlp = _Attention(cfg), _MLP(cfg)


class EagleHead(nn.Module):
    """An EAGLE-3 draft head (module names as in the checkpoint vLLM loads). `qkv`, `finish` and `logits` are the
    layer's three parts, shared by decoding (HeadStream) and training (distill/eagle.py)."""

    def __init__(self, config):
        super().__init__()
        missing = [k for k in CONFIG_KEYS if getattr(config, k, None) is None]
        if missing:
            raise ValueError(f"an EAGLE-3 head config needs {missing}; build it with head_config()")
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        h = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config=config)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.config.eagle_aux_hidden_state_layer_ids)

    @property
    def draft_ids(self) -> Tensor:
        """The target token id of each draft-vocabulary row."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_vocab(self, ids: Tensor) -> None:
        """Make the draft vocabulary the sorted target ids `ids` (d2t, t2d)."""
        ids = ids.to(torch.int64).sort().values
        if ids.numel() != self.d2t.numel() or ids.unique().numel() != ids.numel():
            raise ValueError(f"the draft vocabulary needs {self.d2t.numel()} distinct ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def qkv(self, emb: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """emb, hidden [B, T, H], positions [B, T] -> q [B, heads, T, D], k and v [B, kv_heads, T, D] (rotated)."""
        a = self.midlayer
        x = torch.cat([a.input_layernorm(emb), a.hidden_norm(hidden)], -1)
        b, t, _ = x.shape
        q = _linear(a.self_attn.q_proj, x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = _linear(a.self_attn.k_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = _linear(a.self_attn.v_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, o: Tensor, residual: Tensor) -> Tensor:
        """The attention output o [B, heads, T, D] and the residual (the un-normalised hidden state) [B, T, H] -> the
        layer's output before `norm` [B, T, H] (what the next self-fed position reads)."""
        a = self.midlayer
        b, _, t, _ = o.shape
        h = residual + _linear(a.self_attn.o_proj, o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        x = a.post_attention_layernorm(h)
        return h + _linear(a.mlp.down_proj, nn.functional.silu(_linear(a.mlp.gate_proj, x)) * _linear(a.mlp.up_proj, x))

    def logits(self, prenorm: Tensor) -> Tensor:
        """Logits over the draft vocabulary."""
        return _linear(self.lm_head, self.norm(prenorm))


class HeadStream:
    """The head's KV cache over one sequence: `forward(tokens, hidden)` appends entries (token i + 1's id and the
    hidden state for position i) and returns their draft-vocabulary logits [T, draft_vocab] and pre-norm outputs
    [T, H]; `crop(length)` forgets the entries from `length` on."""

    def __init__(self, head: EagleHead, embed: nn.Module, max_len: int):
        self.head, self.embed, self.max_len = head, embed, max_len
        p = head.fc.weight
        shape = (head.kv_heads, max_len, head.head_dim)
        self.k, self.v = torch.zeros(shape, device=p.device), torch.zeros(shape, device=p.device)
        self.length = 0

    @torch.no_grad()
    def forward(self, tokens: list[int], hidden: Tensor, positions: Tensor | None = None,
                mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Entries at positions start, start + 1, ... each seeing those before it; or (a draft tree's nodes,
        serving/tree.py) at `positions` [T], each seeing the entries `mask` [T, start + T] names."""
        t, start = len(tokens), self.length
        end = start + t
        if hidden.shape[0] != t:
            raise ValueError(f"{t} tokens but {hidden.shape[0]} hidden states")
        if end > self.max_len:
            raise ValueError(f"{end} entries exceed the head stream's max_len {self.max_len}")
        if (positions is None) != (mask is None):
            raise ValueError("a tree's entries need both their positions and their mask")
        dtype = self.head.fc.weight.dtype
        ids = torch.tensor([tokens], device=self.k.device)
        pos = torch.arange(start, end, device=self.k.device)[None] if positions is None else positions[None]
        emb, hid = self.embed(ids).to(dtype), hidden[None].to(dtype)
        q, k, v = self.head.qkv(emb, hid, pos)
        self.k[:, start:end], self.v[:, start:end] = k[0], v[0]
        if mask is None and t > 1:
            mask = torch.arange(end, device=self.k.device)[None] <= pos[0, :, None]
        o = attend(q[0], self.k[:, :end], self.v[:, :end], mask, self.head.scaling).to(dtype)
        out = self.head.finish(o[None], hid)
        self.length = end
        return self.head.logits(out)[0].float(), out[0]

    def crop(self, length: int) -> None:
        self.length = min(max(length, 0), self.length)


def _full(logits: Tensor, ids: Tensor, vocab: int) -> Tensor:
    """Draft-vocabulary logits [.., dv] -> the target vocabulary's [.., V], -inf outside the draft vocabulary."""
    return logits.new_full((*logits.shape[:-1], vocab), float("-inf")).index_copy_(-1, ids, logits)


def check_target(head: EagleHead, target: nn.Module) -> int:
    """The target's vocabulary, after checking that `head` was trained for a target of its vocabulary and width."""
    vocab = target.get_output_embeddings().out_features
    if head.config.vocab_size != vocab or head.config.target_hidden_size != target.config.hidden_size:
        raise ValueError(f"this head was trained for a target of vocabulary {head.config.vocab_size} and width "
                         f"{head.config.target_hidden_size}, not {vocab} and {target.config.hidden_size}")
    return vocab


def prefill(tgt, hs: HeadStream, committed: list[int], gen: Generation) -> tuple[Tensor, Tensor] | None:
    """The target reads all committed tokens but the last, the head their features (timed into gen.prefill_seconds).
    Returns the last exact entry's (logits, pre-norm output), which predicts the token after committed[-1]; None for
    a one-token prompt (no features yet)."""
    if len(committed) < 2:
        return None
    head = hs.head
    t0 = time.perf_counter()
    tgt.forward(committed[:-1], logits="none")
    t1 = time.perf_counter()
    lg, h = hs.forward(committed[1:], _linear(head.fc, tgt.features.to(head.fc.weight.dtype)))
    gen.prefill_seconds = (t1 - t0, time.perf_counter() - t1)
    return lg[-1], h[-1]


@torch.no_grad()
def generate_eagle(target: nn.Module, head: EagleHead, prompt: list[int], max_new_tokens: int, k: int = 4,
                   temperature: float = 0.0, adaptive: bool = False, generator: torch.Generator | None = None,
                   eos_token_id: int | None = None, runtime: str = "auto") -> Generation:
    """Speculative decoding with an EAGLE-3 head as the draft: the same rounds, verification and timing as
    speculative.generate_speculative (exact: greedy token for token, sampling in distribution), the draft's K
    proposals made by the head from the target's features of the last verify."""
    check_settings(prompt, max_new_tokens, k, temperature)
    vocab = check_target(head, target)
    t_start = time.perf_counter()
    max_len = len(prompt) + max_new_tokens + K_MAX + max(k, K_MAX)
    tgt = make_stream(target, max_len, runtime, aux_layers=head.aux_layers)
    hs = HeadStream(head, target.get_input_embeddings(), max_len)
    ids = head.draft_ids
    dtype = head.fc.weight.dtype
    committed = list(prompt)
    gen = Generation([], 0.0, runtime=_runtime_name(tgt))
    last = prefill(tgt, hs, committed, gen)
    n_prompt = len(prompt)
    verify_s: dict[int, list[float]] = {}
    while len(committed) - n_prompt < max_new_tokens:
        # the verify adds one token of its own: r tokens to go need at most r − 1 drafted (as vLLM drafts)
        k_round = 0 if last is None else min(k, max_new_tokens - (len(committed) - n_prompt) - 1)
        t0 = time.perf_counter()
        drafted, p_rows = [], []
        if k_round:
            logits, h = last
            for j in range(k_round):
                if temperature == 0:
                    token = int(ids[logits.argmax()])
                else:
                    p_rows.append(_probs(_full(logits, ids, vocab), temperature))
                    token = int(_sample(p_rows[-1], generator))
                drafted.append(token)
                if j + 1 < k_round:
                    lg, hh = hs.forward([token], h[None])
                    logits, h = lg[-1], hh[-1]
        t_draft = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = tgt.forward([committed[-1], *drafted])
        feats = tgt.features
        t_verify = time.perf_counter() - t0
        if not drafted:  # no features yet (a one-token prompt): a plain step
            n = 0
            nxt = logits[0].argmax() if temperature == 0 else _sample(_probs(logits[0], temperature), generator)
        elif temperature == 0:
            n, nxt = accept_greedy(torch.tensor([drafted]), logits[None])
        else:
            n, nxt = accept_sampled(torch.tensor([drafted]), torch.stack(p_rows)[None],
                                    _probs(logits, temperature)[None], generator)
        n = int(n)
        new = emitted(drafted, n, int(nxt), eos_token_id)
        exact = len(committed) - 1  # the head's exact entries before this round
        committed += new
        tgt.crop(len(committed) - 1)
        t0 = time.perf_counter()  # the head's catch-up: exact entries for the accepted tokens
        hs.crop(exact)
        lg, h = hs.forward(new, _linear(head.fc, feats[:len(new)].to(dtype)))
        last = lg[-1], h[-1]
        t_draft += time.perf_counter() - t0
        gen.record(k_round, n, t_draft, t_verify)
        if eos_token_id is not None and committed[-1] == eos_token_id:
            break
        if k_round:
            verify_s.setdefault(k_round, []).append(t_verify)
        if adaptive and gen.proposed:
            k = adapted_k(gen, verify_s)
    gen.tokens = committed[n_prompt:n_prompt + max_new_tokens]
    gen.seconds = time.perf_counter() - t_start
    return gen


def is_head_folder(path) -> bool:
    """Whether `path` is a folder holding an EAGLE-3 head (its config.json names LlamaForCausalLMEagle3)."""
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or ())
    except (OSError, ValueError):
        return False


def load_head(path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """Read an EAGLE-3 head folder (config.json + model.safetensors, vLLM's layout) written by export/eagle.py or
    any EAGLE-3 trainer with the same names."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    folder = Path(path)
    if not is_head_folder(folder):
        raise ValueError(f"{folder} is not an EAGLE-3 head folder (config.json with architectures "
                         f"[{ARCHITECTURE!r}]); train one with `compress draft-head TARGET --output DIR`")
    raw = json.loads((folder / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in CONFIG_KEYS and k != "architectures"})
    cfg.architectures = raw["architectures"]
    for key in CONFIG_KEYS:
        setattr(cfg, key, raw.get(key))
    if cfg.target_hidden_size is None:
        cfg.target_hidden_size = cfg.hidden_size
    if cfg.draft_vocab_size is None:
        cfg.draft_vocab_size = cfg.vocab_size
    if cfg.eagle_aux_hidden_state_layer_ids is None:
        raise ValueError(f"{folder}/config.json has no eagle_aux_hidden_state_layer_ids: the target layers the head "
                         "reads must be named (vLLM's default depends on the target's depth)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights (only safetensors are read)")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    head = EagleHead(cfg)
    state = {k: v for k, v in state.items() if not k.startswith("embed_tokens")}  # the target's embedding is used
    if "d2t" not in state:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][state["d2t"] + torch.arange(cfg.draft_vocab_size)] = True
    head.load_state_dict(state, strict=True)
    return head.to(dtype).eval()
