"""Draft trees for speculative decoding with an EAGLE-3 head (EAGLE-2's dynamic tree, Li et al. 2024): the head
proposes several continuations at once, and the target verifies all of them in one forward.

Drafting. From the last exact entry the head's `branch` most likely tokens are the first level. Each further level
runs the head once over the `branch` nodes of the level below with the highest path score (the sum of the head's
log-probabilities from the root), each reading its parent's output, and takes each one's `branch` most likely
tokens. After `depth` levels the `tokens` nodes of highest path score (a child never scores above its parent, so
they form a tree) are what the target verifies: with the last committed token as the root, in one forward whose
rows attend to the committed text and their own ancestors only (lean_decode.LeanStream, `parents`). (Drawn trees,
for sampling: children drawn instead of taken, and none dropped; `draft_tree`.) On this project's CPUs a forward of up
to 16 rows reads the float32 weights once (kernels/cpu_rows.c), but past a few rows the float32 arithmetic sets its
cost: a root and 15 nodes cost about 1.8 decode steps of the embedded model, which is why trees lose to the chain on
this CPU (docs/results.md, "EAGLE-3 draft heads"); where a verify of 16 rows costs what one does, they need not.

Verification walks down from the root. Greedily (`walk`): the target's argmax at each node, and on to the child
holding it, so the output is plain decoding's token for token (the few-row kernels' rows are bit for bit the decode
steps'). Sampling has two rules. `top` (SGLang's target-only rule, as we read it): the same walk with the target's
own draw at each node (one draw per token from the same generator: plain decoding's tokens again), accepted only where
the draw lands on one of the head's top tokens. `drawn` (the default): each node's children are drawn from the head's
distribution without replacement, and `walk_drawn` verifies them by recursive rejection (Jeon et al. 2024): exact in
distribution, and at least the chain's acceptance at the first child.

After a round the target's cache keeps the accepted branch (LeanStream.keep) and the head's tree entries are
cropped and replaced by exact entries for the accepted tokens, as in the chain (eagle.generate_eagle).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .eagle import EagleHead, HeadStream, check_target, prefill
from .lean_decode import LeanStream, _linear, lean_problem
from .speculative import K_MAX, Generation, _probs, _runtime_name, _sample, check_settings, emitted


SAMPLINGS = ("drawn", "top")


@dataclass(frozen=True)
class TreeShape:
    """A draft tree's size: `depth` levels, `branch` nodes expanded per level and children taken per node, `tokens`
    nodes verified (the root is one more row)."""
    depth: int = 5
    branch: int = 4
    tokens: int = 15

    def __post_init__(self):
        if not 1 <= self.depth <= 16:
            raise ValueError(f"tree depth {self.depth}: use 1..16 levels")
        if not 1 <= self.branch <= 16:
            raise ValueError(f"tree branch {self.branch}: use 1..16 nodes per level (the head's rows per call)")
        if not 1 <= self.tokens <= 63:
            raise ValueError(f"tree tokens {self.tokens}: use 1..63 (15 keeps a verify in one call of the few-row "
                             "kernels with the root)")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'DEPTH,BRANCH,TOKENS' (e.g. 5,4,15)."""
        try:
            depth, branch, tokens = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"tree {text!r}: give DEPTH,BRANCH,TOKENS, e.g. 5,4,15") from None
        return cls(depth, branch, tokens)

    def __str__(self) -> str:
        return f"{self.depth},{self.branch},{self.tokens}"


@dataclass
class DraftTree:
    """The verified tree: node 0 is the root (the last committed token, parent -1); nodes 1.. are drafted, each
    after its parent."""
    tokens: list[int]
    parents: list[int]
    drawn_from: dict[int, Tensor] | None = None  # drawn trees: node -> the head's distribution its children came from

    def children(self, node: int) -> dict[int, int]:
        """token -> child node."""
        return {t: i for i, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == node}


@torch.no_grad()
def draft_tree(stream: HeadStream, last: tuple[Tensor, Tensor], root: int, shape: TreeShape,
               depth: int | None = None, draw: float = 0.0, generator: torch.Generator | None = None) -> DraftTree:
    """The head's tree after the committed text: `last` the last exact entry's (draft-vocabulary logits, pre-norm
    output), `root` the last committed token. Appends the expanded nodes' entries to `stream` (crop them after).
    `depth` caps shape.depth (no level past the tokens still to decode).

    draw = 0: each node's children are the head's `branch` most likely tokens and the `tokens` best nodes are kept.
    draw = T > 0 (for sampling, verified by `walk_drawn`): each expanded node's children are drawn from the head's
    distribution at T without replacement (Gumbel top-k, in draw order), as many as the budget of `tokens` leaves
    when the node is expanded, and none is dropped after: a node's children then depend only on what was drawn before
    them, which recursive rejection needs to stay exact."""
    head = stream.head
    ids = head.draft_ids
    vocab = head.config.vocab_size
    levels = min(shape.depth, depth or shape.depth)
    exact = stream.length  # the head's exact entries; the last one sits at position exact - 1
    k = min(shape.branch, ids.numel())
    # per node: token, parent node (-1: the root), path score, depth, the entry slot once expanded
    tok, par, score, dep, slot = [], [], [], [], []
    out = {-1: last[1]}  # node -> the pre-norm output of the entry that predicts its children
    drawn_from = {}  # node -> the head's distribution (target vocabulary) its children were drawn from

    def add(logits: Tensor, parent: int, base: float, d: int) -> None:
        if draw:
            n = min(k, shape.tokens - len(tok))
            if n <= 0:
                return
            lp = torch.log_softmax(logits.float() / draw, -1)
            u = torch.rand(lp.shape, generator=generator).clamp_(1e-20, 1 - 1e-7).to(lp.device)
            j = (lp - torch.log(-torch.log(u))).topk(n).indices  # n draws without replacement, in draw order
            v, q = lp[j], lp.exp()
            drawn_from[parent] = q.new_zeros(vocab).index_copy_(0, ids, q)
        else:
            v, j = torch.log_softmax(logits.float(), -1).topk(k)
        for value, index in zip(v.tolist(), j.tolist()):
            tok.append(int(ids[index]))
            par.append(parent)
            score.append(base + value)
            dep.append(d)
            slot.append(-1)

    add(last[0], -1, 0.0, 1)
    frontier = list(range(len(tok)))
    for d in range(2, levels + 1):
        grow = sorted(frontier, key=lambda i: (-score[i], i))[:shape.branch]
        if draw:  # only the nodes the budget leaves children for
            grow = grow[:-(-(shape.tokens - len(tok)) // k)]
        if not grow:
            break
        start = stream.length
        visible = torch.zeros(len(grow), start + len(grow), dtype=torch.bool, device=stream.k.device)
        visible[:, :exact] = True
        for r, node in enumerate(grow):
            slot[node] = start + r
            a = node
            while a >= 0:  # its expanded ancestors' entries and its own
                visible[r, slot[a]] = True
                a = par[a]
        hidden = torch.stack([out[par[i]] for i in grow])
        positions = torch.tensor([exact - 1 + dep[i] for i in grow], device=stream.k.device)
        logits, h = stream.forward([tok[i] for i in grow], hidden, positions, visible)
        frontier = []
        for r, node in enumerate(grow):
            out[node] = h[r]
            first = len(tok)
            add(logits[r], node, score[node], d)
            frontier += range(first, len(tok))
    # the best `tokens` nodes (ties: shallower, then earlier, so a parent always precedes its child), in creation order
    chosen = list(range(len(tok))) if draw else \
        sorted(sorted(range(len(tok)), key=lambda i: (-score[i], dep[i], i))[:shape.tokens])
    index = {node: n + 1 for n, node in enumerate(chosen)}
    index[-1] = 0
    return DraftTree([root] + [tok[i] for i in chosen], [-1] + [index[par[i]] for i in chosen],
                     {index[node]: q for node, q in drawn_from.items()} if draw else None)


def walk(tree: DraftTree, logits: Tensor, temperature: float,
         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify `tree` against the target's logits for its rows [T, V]: from the root, the target's token at each
    node (argmax, or one draw at `temperature`) and on to the child holding it. Returns (the accepted nodes, in
    order; the target's token after the last of them)."""
    path, node = [], 0
    while True:
        row = logits[node]
        token = int(row.argmax()) if temperature == 0 else int(_sample(_probs(row, temperature), generator))
        child = tree.children(node).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def walk_drawn(tree: DraftTree, logits: Tensor, temperature: float,
               generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify a drawn tree (draft_tree with draw = temperature) by recursive rejection (Jeon et al. 2024, without
    replacement): at a node with target distribution p and children x1, x2, ... drawn from the head's q, x_i is kept
    with probability min(1, p(x_i) / q(x_i)); on a rejection p becomes the normalised residual max(p − q, 0) and q
    loses x_i (renormalised); after the last child the token is drawn from p. Every emitted token is distributed as
    the target's own (tests/test_tree.py)."""
    from .speculative import residual

    path, node = [], 0
    while True:
        p = _probs(logits[node], temperature)
        kids = [i for i, parent in enumerate(tree.parents) if parent == node]  # in draw order
        q = tree.drawn_from.get(node) if kids else None
        for child in kids:
            x = tree.tokens[child]
            u = torch.rand((), generator=generator, dtype=p.dtype)
            if u < (p[x] / q[x]).clamp(max=1):
                path.append(child)
                node = child
                break
            p = residual(p, q)
            q = q.clone()
            q[x] = 0
            q = q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)
        else:
            return path, int(_sample(p, generator))


@torch.no_grad()
def generate_eagle_tree(target: nn.Module, head: EagleHead, prompt: list[int], max_new_tokens: int,
                        shape: TreeShape = TreeShape(), temperature: float = 0.0,
                        generator: torch.Generator | None = None, eos_token_id: int | None = None,
                        runtime: str = "auto", sampling: str = "drawn") -> Generation:
    """Speculative decoding with an EAGLE-3 head drafting a tree each round (module docstring). The target runs on
    the lean decode path (a tree needs its masked verify); Generation.record counts a round's tree nodes as proposed
    and its accepted branch as accepted. `sampling` (temperature > 0): 'drawn' (default) draws the nodes from the
    head and verifies them by recursive rejection (in distribution); 'top' keeps the head's top tokens and walks
    with the target's own draws (token for token plain decoding's)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"tree sampling {sampling!r}: use one of {SAMPLINGS}")
    draw = temperature if temperature > 0 and sampling == "drawn" else 0.0

    check_settings(prompt, max_new_tokens, 1, temperature)
    check_target(head, target)
    t_start = time.perf_counter()
    max_len = len(prompt) + max_new_tokens + shape.tokens + K_MAX + 1
    tree_len = max_len + (shape.depth - 1) * shape.branch
    problem = "--runtime transformers" if runtime == "transformers" else lean_problem(target, max_len)
    if problem:
        raise ValueError(f"a draft tree is verified on the lean decode path, which cannot run this target ({problem});"
                         " draft a chain instead (no --tree)")
    tgt = LeanStream(target, max_len, head.aux_layers)
    hs = HeadStream(head, target.get_input_embeddings(), tree_len)
    dtype = head.fc.weight.dtype
    committed = list(prompt)
    gen = Generation([], 0.0, runtime=_runtime_name(tgt))
    last = prefill(tgt, hs, committed, gen)
    n_prompt = len(prompt)
    while len(committed) - n_prompt < max_new_tokens:
        levels = max_new_tokens - (len(committed) - n_prompt) - 1  # the verify adds one token of its own
        exact = hs.length
        t0 = time.perf_counter()
        if last is None or levels == 0:
            tree = DraftTree([committed[-1]], [-1])
        else:
            tree = draft_tree(hs, last, committed[-1], shape, levels, draw, generator)
        t_draft = time.perf_counter() - t0
        start = tgt.length
        t0 = time.perf_counter()
        logits = tgt.forward(tree.tokens, parents=tree.parents)
        feats = tgt.features
        t_verify = time.perf_counter() - t0
        path, nxt = (walk_drawn if draw else walk)(tree, logits, temperature, generator)
        new = emitted([tree.tokens[i] for i in path], len(path), nxt, eos_token_id)
        committed += new
        rows = [0] + path
        tgt.keep(start, rows)
        t0 = time.perf_counter()
        hs.crop(exact)
        lg, h = hs.forward(new, _linear(head.fc, feats[rows][:len(new)].to(dtype)))
        last = lg[-1], h[-1]
        t_draft += time.perf_counter() - t0
        gen.record(len(tree.tokens) - 1, len(path), t_draft, t_verify)
        if eos_token_id is not None and committed[-1] == eos_token_id:
            break
    gen.tokens = committed[n_prompt:n_prompt + max_new_tokens]
    gen.seconds = time.perf_counter() - t_start
    return gen
