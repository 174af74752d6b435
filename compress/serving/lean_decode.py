"""A lean decode loop for Llama-style decoders: the model's own modules (norms, linears, MLP, rotary embedding,
head), called one after another over a preallocated float32 KV cache, without transformers' per-call machinery.

At batch 1 on a CPU a step of the 135M embedded model is ~70 ms, and what is not matmul is fixed per call: output
recording, mask construction, the attention-interface dispatch and the cache object in transformers' forward
(~12 ms a step here), and tens of microseconds around each of a block's 7 matmul calls. That cost does not shrink
with the weights, so it is what keeps a 4× smaller draft from costing a quarter of a step (README, "Speculative
decoding"). Here each block is its norms, q/k/v/o (or one fused q/k/v: `fuse_projections`), the rotation written
out (`rotate_half`, as transformers), attention as two batched matmuls in float32 (`attend`: several times cheaper
than scaled_dot_product_attention's kernel at a few query rows, and exact in bfloat16 models too), and the MLP
(gate/up fused where fused). QuantLinear layers keep their dispatched kernels and input rotations. Logits equal
transformers' to float rounding (tests/test_lean_decode.py, per family); plain and speculative decoding both use
it when it applies, so every comparison stays like for like.

With `use_rows` (kernels/cpu_rows.c) the stack runs in C: few-row matmuls that stream the weights once for up to 16
rows (a verify of a few drafted tokens costs about one decode step; past about 4 float32 rows the arithmetic adds)
and the block's other operations, one call per 16 tokens instead of ~35 torch calls a block. A row's result does not depend on the rows beside it, so a verify equals
the decode steps it replaces bit for bit.

Families: those whose decoder block is `x + attn(norm(x))` then `x + mlp(norm(x))` with rotary position embeddings
on the whole head and full causal attention: those whose entry in compress/arch/tables.py says `lean=True`. Anything
else (sliding windows, soft-capping, q/k norms, post-norms, a compress KV-cache wrapper) is answered by `lean_problem`
with the reason, and the caller falls back to transformers.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from ..arch import families_with, family_spec
from ..kernels.cpu_rows import MAX_ROWS, load as load_rows, rows_linear, rows_reason
from ..core.nn import QuantLinear

ROWS_ATTR = "rows_kernel"  # set by use_rows for the duration of its block


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is the concatenation of `layers`' outputs on the same input (q/k/v, gate/up): float
    nn.Linear weights concatenated, or QuantLinear codes, scales and zero points concatenated along the output rows
    (every format here packs codes along the input, and a group never spans two rows, so the fused layer holds
    exactly the same numbers). Dynamically quantized activations fuse too: their scales come from the input, which
    the fused layers share (fp8 per token: a decode step quantizes x once instead of three times). None where that
    does not hold: mixed types or schemes, statically quantized activations (a calibrated scale per layer) or
    outlier features, a per-tensor scale (NVFP4's global scale differs per layer), an input rotation."""
    if any(getattr(m, "input_rotation", None) is not None for m in layers):
        return None
    if all(type(m) is nn.Linear for m in layers):
        w = torch.cat([m.weight.detach() for m in layers])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=any(m.bias is not None for m in layers), dtype=w.dtype,
                          device=w.device)
        fused.weight = nn.Parameter(w, requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None else
                                                 w.new_zeros(m.out_features) for m in layers]), requires_grad=False)
        return fused
    first = layers[0]
    act = first.scheme.act
    if not all(type(m) is QuantLinear and m.scheme == first.scheme and not m.rank for m in layers) or \
            (act is not None and (not act.dynamic or act.outlier_threshold is not None)) \
            or first.global_scale is not None or first.scheme.granularity == "tensor":
        return None
    bias = [m.bias for m in layers]
    ref = next((b for b in bias if b is not None), None)
    fused = QuantLinear(first.in_features, sum(m.out_features for m in layers), first.scheme, bias=ref is not None,
                        dtype=torch.float32 if ref is None else ref.dtype, device=first.qdata.device)
    fused.qdata = torch.cat([m.qdata for m in layers])
    fused.scale = torch.cat([m.scale for m in layers])
    fused.zero_point = None if first.zero_point is None else torch.cat([m.zero_point for m in layers])
    if ref is not None:
        fused.bias = nn.Parameter(torch.cat([b.detach() if b is not None else ref.new_zeros(m.out_features)
                                             for b, m in zip(bias, layers)]), requires_grad=False)
    return fused


class Slice(nn.Module):
    """Rows [start, end) of a fused linear's output: what stands in for q_proj, k_proj, ... once they are fused,
    so transformers' forward still runs the model (computing the fused product once per slice)."""

    def __init__(self, fused: nn.Module, start: int, end: int):
        super().__init__()
        self.fused, self.start, self.end = fused, start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: Tensor) -> Tensor:
        return self.fused(x)[..., self.start:self.end]


FUSIONS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def fuse_projections(model: nn.Module) -> list[str]:
    """Fuse every block's q/k/v and gate/up projections in place (`self_attn.qkv_proj`, `mlp.gate_up_proj`; the
    originals become Slices of them), so that the lean path makes 3 matmul calls per block instead of 7: at batch 1
    on a CPU each call costs tens of microseconds beyond its bytes. For a lean-path family only; returns the
    projections left apart, with the reason."""
    problem = lean_problem(model, 1)
    if problem:
        raise ValueError(f"fusing projections is for the lean decode path, which cannot run this model: {problem}")
    left = []
    for i, block in enumerate(model.model.layers):
        for owner_name, fused_name, names in FUSIONS:
            owner = getattr(block, owner_name)
            layers = [getattr(owner, n) for n in names]
            fused = fuse_linears(layers)
            if fused is None:
                left.append(f"layers.{i}.{owner_name}: {'/'.join(names)} differ in type or scheme, or rotate their input")
                continue
            setattr(owner, fused_name, fused)
            start = 0
            for n, m in zip(names, layers):
                setattr(owner, n, Slice(fused, start, start + m.out_features))
                start += m.out_features
    return left


def lean_problem(model: nn.Module, max_len: int) -> str | None:
    """Why `model` cannot decode on the lean path for sequences up to `max_len` tokens (None: it can)."""
    cfg = model.config
    family, spec = getattr(cfg, "model_type", None), family_spec(model)
    if spec is None or not spec.lean:
        return f"model_type {family!r} is not one of the lean path's families {tuple(families_with('lean'))}"
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in (None, "sdpa", "eager"):
        return f"attention implementation {impl!r} (a compress KV-cache wrapper or another kernel) is not reproduced"
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", True)  # Mistral's window applies whenever it is set
    if uses_window and window is not None and max_len > window:
        return f"sliding-window attention ({window} tokens) is not implemented on the lean path"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())) and uses_window:
        return "layers with sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def _linear(module: nn.Module, x: Tensor) -> Tensor:
    """module(x), on the few-row kernel `use_rows` attached to it when x has at most MAX_ROWS rows."""
    rows = getattr(module, ROWS_ATTR, None)
    if rows is not None and x.numel() <= MAX_ROWS * x.shape[-1]:
        return rows(x)
    inner = getattr(module, "inner", None)  # a draft's VocabSubsetHead: its rows' linear, scattered
    if inner is not None and getattr(inner, ROWS_ATTR, None) is not None and x.numel() <= MAX_ROWS * x.shape[-1]:
        sub = _linear(inner, x)
        return sub.new_full((*sub.shape[:-1], module.vocab), float("-inf")).index_copy_(-1, module.ids, sub)
    return module(x)


@contextlib.contextmanager
def use_rows(model: nn.Module, int8_activations: bool = False):
    """Attach the few-row CPU kernels (kernels/cpu_rows.py) to every linear of `model` that they run: float32
    nn.Linear, QuantLinear int4 and int8 weight-only. The lean loop then computes 1..16 rows on them (a decode step, a
    speculative verify), and one row's result is the same bits whichever rows share the call. Where every layer of
    every block has one (and the block is what cpu_rows.c computes: RMSNorm, SiLU, float32), a forward runs the whole
    stack in one C call per 16 tokens, a prefill included. Yields the layers left on their own forward with the
    reason; the packed copies (for float32 layers, the weights once more; at most half the free memory, the layers
    beyond it stay on their own forward and are listed) are dropped on exit. Raises
    cpu_rows.RowsUnavailable when the kernels cannot be built here. int8_activations: int4 layers compute W4A8 where
    the CPU has VNNI (x rounded to int8 per weight group: an approximation, for a speculative draft, whose errors cost
    only acceptance; never for a target)."""
    import psutil

    lib = load_rows()
    attached, left = [], []
    budget = psutil.virtual_memory().available // 2  # the packed copies never take more than half of what is free
    try:
        for name, module in model.named_modules():
            if not (type(module) is nn.Linear or isinstance(module, QuantLinear)):
                continue
            problem = rows_reason(module)
            if problem:
                left.append(f"{name}: {problem}")
                continue
            rows = rows_linear(module, lib, int8_activations) if budget > 0 else None
            size = 0 if rows is None else sum(t.numel() * t.element_size() for t in
                                              (rows.weight, rows.scale, rows.zero_scale, rows.bias) if t is not None)
            if rows is None or size > budget:
                budget = 0
                left.append(f"{name}: its packed copy would not fit in half the free memory")
                continue
            budget -= size
            setattr(module, ROWS_ATTR, rows)
            attached.append(module)
        yield left
    finally:
        for module in attached:
            delattr(module, ROWS_ATTR)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T · scale + mask) v in float32 for one sequence, grouped-query: q [H, T, D], k and v [KV, L, D]
    (query head j reads KV head j // (H / KV), as transformers' repeat_kv), mask [T, L] bool or None -> [H, T, D].
    Two batched matmuls over the KV heads: at a handful of query rows this is several times cheaper on a CPU than
    scaled_dot_product_attention's kernel (which also runs bfloat16 slowly here)."""
    h, t, d = q.shape
    kv = k.shape[0]
    groups = h // kv
    scores = torch.bmm(q.float().reshape(kv, groups * t, d), k.transpose(1, 2)) * scale  # [KV, groups*T, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(groups, 1), float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v).reshape(h, t, d)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanStream:
    """One sequence's decoding state on the lean path: `forward(tokens, logits)` appends tokens to the KV cache and
    returns their logits ([T, V] float32 for logits='all', [1, V] for 'last', None for 'none'); `crop(length)`
    forgets every token from `length` on (rejected draft tokens), with nothing recomputed."""

    def __init__(self, model: nn.Module, max_len: int = 4096, aux_layers: tuple[int, ...] = ()):
        problem = lean_problem(model, max_len)
        if problem:
            raise ValueError(f"the lean decode path cannot run this model: {problem}")
        cfg = model.config
        self.model, self.max_len = model, max_len
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
        shape = (len(self.blocks), self.kv_heads, max_len, self.head_dim)  # float32 whatever the weights' dtype
        self.k = torch.zeros(shape, device=self.device)
        self.v = torch.zeros(shape, device=self.device)
        self.length = 0
        if any(not 0 <= j < len(self.blocks) for j in aux_layers):
            raise ValueError(f"feature layers {tuple(aux_layers)}: ids are 0..{len(self.blocks) - 1} (the input of "
                             "layer j)")
        self.aux_layers, self.features = tuple(aux_layers), None  # features: [T, n·H] after each forward
        self.c_blocks, self.c_problem = self._c_blocks()

    def _c_blocks(self):
        """The blocks as cpu_rows.c's block kernel reads them, when `use_rows` prepared every linear of every block
        and the block is what that kernel computes; else (None, the reason). The stream holds references to what the
        pointers point at, so they stay valid for its life."""
        from ..kernels.cpu_rows import CBlock, c_linear

        act = getattr(self.model.config, "hidden_act", None)
        if act not in ("silu", "swish"):
            return None, f"activation {act!r} (the block kernel computes SiLU)"
        if self.dtype != torch.float32 or self.head_dim > 1024:
            return None, "float32 models with head_dim <= 1024 only"
        arr, keep, lib = (CBlock * len(self.blocks))(), [], None
        for i, block in enumerate(self.blocks):
            attn, mlp = block.self_attn, block.mlp
            norms = (block.input_layernorm, block.post_attention_layernorm)
            if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") and
                       n.weight.dtype == torch.float32 for n in norms):
                return None, f"layers.{i}: norms are not float32 RMSNorm"
            qkv, gate_up = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
            # fused: q holds q|k|v and gate holds gate|up, the absent k, v, up are n = 0 for the kernel
            layers = {"q": attn.q_proj if qkv is None else qkv, "k": attn.k_proj if qkv is None else None,
                      "v": attn.v_proj if qkv is None else None, "o": attn.o_proj,
                      "gate": mlp.gate_proj if gate_up is None else gate_up,
                      "up": mlp.up_proj if gate_up is None else None,
                      "down": mlp.down_proj}
            rows = {name: getattr(m, ROWS_ATTR, None) for name, m in layers.items() if m is not None}
            if any(r is None for r in rows.values()):
                return None, f"layers.{i}: not every linear has a few-row kernel (use_rows)"
            lib = rows["q"].lib
            keep += [*rows.values(), *(n.weight for n in norms)]
            arr[i] = CBlock(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].variance_epsilon,
                            norms[1].variance_epsilon, **{name: c_linear(rows.get(name)) for name in layers},
                            kcache=self.k[i].data_ptr(), vcache=self.v[i].data_ptr())
        self._keep, self._lib = keep, lib
        return arr, None

    @torch.no_grad()
    def forward(self, tokens: list[int], logits: str = "all", parents: list[int] | None = None) -> Tensor | None:
        """Append `tokens` and return their logits. `parents` (a speculative draft tree, serving/tree.py): token i
        continues token parents[i] (< i; -1: the committed text), sits at position length + its depth and attends to
        the committed tokens and its ancestors only; `keep` then commits one branch."""
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise TypeError("a stream takes a flat, non-empty list of token ids (ints)")
        t, start = len(tokens), self.length
        if start + t > self.max_len:
            raise ValueError(f"{start + t} tokens exceed the stream's max_len {self.max_len}; make it longer")
        ids = torch.tensor([tokens], device=self.device)
        anc = None
        if parents is None:
            pos = torch.arange(start, start + t, device=self.device)[None]
        else:
            depth, anc = tree_layout(parents)
            if len(parents) != t:
                raise ValueError(f"{t} tokens but {len(parents)} parents")
            pos = (start + depth).to(self.device)[None]
        h = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(h, pos)
        cos, sin = cos[0, None], sin[0, None]  # [1, T, head_dim]
        end = start + t
        feats = [None] * len(self.aux_layers)
        if self.c_blocks is not None:  # the whole stack in one call per MAX_ROWS tokens (cpu_rows.c)
            import ctypes

            h = h[0].contiguous()
            cos, sin = cos[0].contiguous(), sin[0].contiguous()
            cuts = sorted({0, len(self.blocks), *self.aux_layers})  # segments between the captured layers' inputs
            base, size = ctypes.addressof(self.c_blocks), ctypes.sizeof(self.c_blocks[0])
            if self.aux_layers:
                feats = [h.new_empty(t, h.shape[-1]) for _ in self.aux_layers]
            tree = None if anc is None else anc.to(torch.uint8).contiguous()  # [T, T], row i's ancestors
            for c in range(0, t, MAX_ROWS):
                n = min(MAX_ROWS, t - c)
                for a, b in zip(cuts, cuts[1:] + [None]):
                    for f, j in zip(feats, self.aux_layers):
                        if j == a:
                            f[c:c + n] = h[c:c + n]
                    if b is None:
                        break
                    rc = self._lib.compress_blocks(base + a * size, b - a, h[c].data_ptr(), n, start + c,
                                                   cos[c].data_ptr(), sin[c].data_ptr(), self.heads, self.kv_heads,
                                                   self.head_dim, self.max_len, self.scaling,
                                                   None if tree is None else tree[c].data_ptr(), start, t)
                    if rc:
                        raise RuntimeError("the block kernel refused this step (a shape outside its limits)")
            self._features(feats)
            return self._finish(h[None], end, logits)
        mask = None
        if anc is not None:  # the committed tokens, then the tree's ancestors
            mask = torch.cat([anc.new_ones(t, start), anc], 1).to(self.device)
        elif t > 1:  # query i (position start + i) sees keys 0..start + i
            mask = torch.arange(end, device=self.device)[None] <= pos[0, :, None]
        for i, block in enumerate(self.blocks):
            for n, j in enumerate(self.aux_layers):
                if j == i:
                    feats[n] = h[0]
            attn = block.self_attn
            x = block.input_layernorm(h)
            qkv = getattr(attn, "qkv_proj", None)
            if qkv is not None:  # fuse_projections
                q, k, v = _linear(qkv, x)[0].split(self.split_qkv, dim=-1)
            else:
                q, k, v = _linear(attn.q_proj, x)[0], _linear(attn.k_proj, x)[0], _linear(attn.v_proj, x)[0]
            q = q.view(t, self.heads, self.head_dim).transpose(0, 1)  # [H, T, D]
            k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
            v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.k[i, :, start:end] = k
            self.v[i, :, start:end] = v
            o = attend(q, self.k[i, :, :end], self.v[i, :, :end], mask, self.scaling)
            h = h + _linear(attn.o_proj, o.transpose(0, 1).reshape(1, t, self.heads * self.head_dim).to(h.dtype))
            mlp = block.mlp
            x = block.post_attention_layernorm(h)
            gate_up = getattr(mlp, "gate_up_proj", None)
            if gate_up is not None:  # fuse_projections (LlamaMLP: down(act(gate(x)) * up(x)))
                g, u = _linear(gate_up, x).chunk(2, dim=-1)
            else:
                g, u = _linear(mlp.gate_proj, x), _linear(mlp.up_proj, x)
            h = h + _linear(mlp.down_proj, mlp.act_fn(g) * u)
        self._features(feats)
        return self._finish(h, end, logits)

    def _features(self, feats: list) -> None:
        self.features = torch.cat(feats, -1).float() if self.aux_layers else None

    def _finish(self, h: Tensor, end: int, logits: str) -> Tensor | None:
        self.length = end
        if logits == "none":
            return None
        if logits == "last":
            h = h[:, -1:]
        return _linear(self.model.lm_head, self.base.norm(h))[0].float()

    def crop(self, length: int) -> None:
        """Forget the tokens from `length` on (their cache rows are overwritten by the next forward); a length at or
        past the end keeps everything, as DynamicCache.crop does."""
        if length < 0:
            raise ValueError(f"crop to {length}: a length is >= 0")
        self.length = min(length, self.length)

    def keep(self, start: int, rows: list[int]) -> None:
        """After a tree forward that began at `start`: keep its `rows` (a branch: increasing, each the parent of the
        next) as the tokens at start, start + 1, ... and forget the rest. Their keys were rotated at those positions,
        so the moved cache rows are what decoding the branch token by token writes."""
        if not rows or any(b <= a for a, b in zip(rows, rows[1:])) or rows[0] < 0 or start + rows[-1] >= self.length:
            raise ValueError(f"rows {rows} are not an increasing branch of the tree at {start}..{self.length}")
        src = torch.tensor(rows, device=self.device) + start
        n = len(rows)
        self.k[:, :, start:start + n] = self.k[:, :, src]
        self.v[:, :, start:start + n] = self.v[:, :, src]
        self.length = start + n


def tree_layout(parents: list[int]) -> tuple[Tensor, Tensor]:
    """A draft tree given by each node's parent (parents[i] < i, -1 for a node on the committed text) -> each
    node's depth [T] (0 for those) and its ancestors and itself [T, T] bool."""
    t = len(parents)
    depth = torch.zeros(t, dtype=torch.int64)
    anc = torch.eye(t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p}: a parent comes before its child (or is -1)")
        if p >= 0:
            depth[i] = depth[p] + 1
            anc[i] |= anc[p]
    return depth, anc
