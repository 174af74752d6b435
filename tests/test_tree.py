"""Draft trees (serving/tree.py): the target's masked verify against decoding each branch on its own (bit for bit on
the few-row kernels, across their 16-row calls), the kept branch's cache, the head's tree against drafting each
branch as a chain, and decoding that equals plain decoding greedy and sampled while a trained head accepts more
tokens per target step than its chain."""
from __future__ import annotations

import contextlib

import pytest
import torch

from compress.serving import speculative as spec
from compress.serving.eagle import HeadStream, generate_eagle
from compress.serving.lean_decode import LeanStream, tree_layout, use_rows
from compress.serving.tree import DraftTree, TreeShape, draft_tree, generate_eagle_tree, walk, walk_drawn

from tests.test_eagle import AUX, HAS_ROWS, _trained_head, permutation_llama, random_head, small_llama

ROWS = [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_ROWS, reason="the few-row kernels do not build"))]


def _rows(*models, on: bool):
    stack = contextlib.ExitStack()
    if on:
        for m in models:
            stack.enter_context(use_rows(m))
    return stack


def random_tree(n: int, vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(torch.randint(0, vocab, (n,), generator=g).tolist(), parents)


def test_tree_layout_gives_depths_and_ancestors():
    depth, anc = tree_layout([-1, 0, 0, 1, 3, 2])
    assert depth.tolist() == [0, 1, 1, 2, 3, 2]
    assert anc[4].nonzero().flatten().tolist() == [0, 1, 3, 4] and anc[5].nonzero().flatten().tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="before its child"):
        tree_layout([-1, 2, 0])


@torch.no_grad()
@pytest.mark.parametrize("rows", ROWS)
def test_a_tree_verify_equals_decoding_each_branch(rows):
    """21 nodes (two calls of the 16-row kernels): every node's logits and features are those of decoding its branch
    token by token (bit for bit on the kernels), and after `keep` of one branch the next step is plain decoding's."""
    target = small_llama(vocab=96)
    prompt = [3, 17, 5, 9, 40, 2, 11]
    tree = random_tree(21, 96, seed=4)
    with _rows(target, on=rows):
        s = LeanStream(target, 64, AUX)
        s.forward(prompt[:-1], logits="none")
        start = s.length
        tree.tokens[0] = prompt[-1]
        logits = s.forward(tree.tokens, parents=tree.parents)
        feats = s.features
        same = torch.equal if rows else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
        for node in range(len(tree.tokens)):
            branch, a = [], node
            while a >= 0:
                branch.insert(0, a)
                a = tree.parents[a]
            ref = LeanStream(target, 64, AUX)
            want = ref.forward(prompt[:-1] + [tree.tokens[i] for i in branch])
            assert same(logits[node], want[-1]), node
            assert same(feats[node], ref.features[-1]), node
        leaf = max(range(len(tree.tokens)), key=lambda i: (tree_layout(tree.parents)[0][i], -i))
        branch, a = [], leaf
        while a >= 0:
            branch.insert(0, a)
            a = tree.parents[a]
        s.keep(start, branch)
        assert s.length == start + len(branch)
        nxt = s.forward([7])
        ref = LeanStream(target, 64, AUX)
        assert same(nxt[-1], ref.forward(prompt[:-1] + [tree.tokens[i] for i in branch] + [7])[-1])
    with pytest.raises(ValueError, match="increasing branch"):
        s.keep(start, [2, 1])


def reference_tree(head, target, prompt: list[int], shape: TreeShape) -> DraftTree:
    """The same tree drafted by plain chains: every expanded node's logits from a fresh HeadStream fed the exact
    entries and then its branch one entry at a time."""
    out = target(input_ids=torch.tensor([prompt[:-1]]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[j][0] for j in AUX], -1)
    embed = target.get_input_embeddings()
    ids = head.draft_ids

    def logits_after(branch: list[int]):
        hs = HeadStream(head, embed, 64)
        lg, h = hs.forward(prompt[1:], head.fc(feats))
        lg, h = lg[-1], h[-1]
        for token in branch:
            lg, h = hs.forward([token], h[None])
            lg, h = lg[-1], h[-1]
        return torch.log_softmax(lg.float(), -1)

    nodes = []  # (branch of tokens, score, parent, depth)

    def children(branch, base, parent, depth):
        v, j = logits_after(branch).topk(shape.branch)
        return [(branch + [int(ids[x])], base + float(s), parent, depth) for s, x in zip(v, j)]

    nodes += children([], 0.0, -1, 1)
    frontier = list(range(len(nodes)))
    for d in range(2, shape.depth + 1):
        grow = sorted(frontier, key=lambda i: (-nodes[i][1], i))[:shape.branch]
        frontier = []
        for i in grow:
            first = len(nodes)
            nodes += children(nodes[i][0], nodes[i][1], i, d)
            frontier += range(first, len(nodes))
    chosen = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][1], nodes[i][3], i))[:shape.tokens])
    index = {c: n + 1 for n, c in enumerate(chosen)}
    index[-1] = 0
    return DraftTree([prompt[-1]] + [nodes[c][0][-1] for c in chosen], [-1] + [index[nodes[c][2]] for c in chosen])


@torch.no_grad()
@pytest.mark.parametrize("shape", [TreeShape(4, 3, 10), TreeShape(3, 2, 6), TreeShape(1, 5, 5)])
def test_the_heads_tree_is_the_one_chains_draft(shape):
    target = small_llama(scale=2.0)
    head = random_head(target)
    prompt = [3, 17, 5, 9, 40, 2, 11, 8]
    out = target(input_ids=torch.tensor([prompt[:-1]]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[j][0] for j in AUX], -1)
    hs = HeadStream(head, target.get_input_embeddings(), 64)
    lg, h = hs.forward(prompt[1:], head.fc(feats))
    tree = draft_tree(hs, (lg[-1], h[-1]), prompt[-1], shape)
    want = reference_tree(head, target, prompt, shape)
    assert tree == want
    assert len(tree.tokens) == shape.tokens + 1 and all(p < i for i, p in enumerate(tree.parents))
    assert max(tree_layout(tree.parents)[0].tolist()) <= shape.depth


def test_walk_follows_the_targets_token_down_the_tree():
    tree = DraftTree([5, 1, 2, 3, 4], [-1, 0, 0, 1, 1])  # 1 -> {3, 4}
    logits = torch.full((5, 8), -5.0)
    logits[0, 1] = logits[1, 4] = logits[4, 6] = 5.0  # root -> 1 (node 1) -> 4 (node 4) -> 6 (not drafted)
    assert walk(tree, logits, 0.0) == ([1, 4], 6)
    logits[1, 4], logits[1, 7] = -5.0, 5.0
    assert walk(tree, logits, 0.0) == ([1], 7)


@pytest.mark.parametrize("rows", ROWS)
def test_tree_decoding_is_plain_decoding_greedy_and_sampled(rows):
    """With a random head (little accepted) and with a trained one on a learnable target (much accepted): the tokens
    are plain decoding's greedily and, with the head's top tokens as nodes, sampled (same seed), and the trained head
    emits more tokens per target step greedily with a tree than as a chain."""
    target = small_llama(scale=2.0)
    perm_target, _ = permutation_llama()
    cases = [(target, random_head(target)), (perm_target, _trained_head(perm_target, 96, 96))]
    prompt = [3, 17, 5, 9, 40, 2]
    for model, head in cases:
        with _rows(model, head, on=rows):
            for temperature in (0.0, 1.0):
                g = torch.Generator().manual_seed(0)
                plain = spec.generate_plain(model, prompt, 40, temperature, g, runtime="lean")
                for shape in (TreeShape(), TreeShape(2, 2, 3), TreeShape(6, 8, 24)):
                    g = torch.Generator().manual_seed(0)
                    got = generate_eagle_tree(model, head, prompt, 40, shape, temperature, g, sampling="top")
                    assert got.tokens == plain.tokens, (shape, temperature)
    model, head = cases[1]  # greedy: the chain's branch is in the tree, and more beside it
    chain = generate_eagle(model, head, prompt, 40, k=3)
    tree = generate_eagle_tree(model, head, prompt, 40, TreeShape())
    assert tree.tokens_per_step > chain.tokens_per_step + 0.3, (tree.tokens_per_step, chain.tokens_per_step)
    one = generate_eagle_tree(target, cases[0][1], prompt[:1], 10)  # no features before the first verify
    assert one.tokens == spec.generate_plain(target, prompt[:1], 10).tokens


def test_bad_trees_are_refused():
    assert TreeShape.parse("5,4,15") == TreeShape(5, 4, 15) and str(TreeShape(3, 2, 6)) == "3,2,6"
    for text, match in (("5,4", "DEPTH,BRANCH,TOKENS"), ("0,4,15", "depth"), ("5,0,15", "branch"),
                        ("5,4,64", "tokens")):
        with pytest.raises(ValueError, match=match):
            TreeShape.parse(text)
    target = small_llama()
    head = random_head(target)
    with pytest.raises(ValueError, match="lean decode path"):
        generate_eagle_tree(target, head, [1, 2, 3], 4, runtime="transformers")
    with pytest.raises(ValueError, match="trained for a target"):
        generate_eagle_tree(small_llama(vocab=120), head, [1, 2, 3], 4)


def test_offset_prompts_are_disjoint_from_the_reported_ones():
    """--prompt-offset 0.5 (where tree shapes are chosen): the same split's stretches, each starting half a stretch
    later, so no chosen-on prompt shares a token position with a reported one."""
    from compress.calibrate.data import tokenize_joined, wikitext2_rows
    from compress.measure.speculation import wikitext_prompts
    from tests.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    ids = tokenize_joined(wikitext2_rows("test"), tok)[0]
    step = ids.numel() // 8
    base, off = wikitext_prompts(tok, 8, 32), wikitext_prompts(tok, 8, 32, offset=0.5)
    starts = [int((i + 0.5) * step) for i in range(8)]
    assert off == [ids[s:s + 32].tolist() for s in starts] and base[0] == ids[:32].tolist()
    assert all(abs(s - i * step) >= 32 for s in starts for i in range(8))
    with pytest.raises(ValueError, match="0 <= offset < 1"):
        wikitext_prompts(tok, 8, 32, offset=1.0)


@pytest.mark.parametrize("rows", ROWS)
def test_an_int8_head_drafts_nearly_as_well_and_stays_exact(rows):
    """speculate --head-int8: the head's layer and lm_head rounded to int8 per channel (fc kept float) read a
    fraction of the bytes, decoding with it is still plain decoding's, and it is accepted about as often."""
    from compress.core.nn import QuantLinear
    from compress.measure.memory import weight_bytes
    from compress.measure.speculation import int8_head

    target, _ = permutation_llama()
    head = _trained_head(target, 96, 96)
    small = int8_head(head)
    assert isinstance(small.midlayer.self_attn.q_proj, QuantLinear) and isinstance(small.lm_head, QuantLinear)
    assert type(small.fc) is torch.nn.Linear and type(head.lm_head) is torch.nn.Linear  # the original untouched
    assert weight_bytes(small)["total"] < 0.5 * weight_bytes(head)["total"]
    prompt = [3, 17, 5, 9, 40, 2]
    plain = spec.generate_plain(target, prompt, 40)
    with _rows(target, head, small, on=rows):
        full = generate_eagle_tree(target, head, prompt, 40)
        got = generate_eagle_tree(target, small, prompt, 40)
        chain = generate_eagle(target, small, prompt, 40, k=3)
    assert got.tokens == chain.tokens == plain.tokens
    assert got.accepted >= 0.8 * full.accepted > 0, (got.accepted, full.accepted)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()) + 1e9 * float(counts[~keep].sum())


def test_recursive_rejection_over_drawn_children_emits_the_targets_distribution(monkeypatch):
    """A root with 3 children drawn without replacement from a draft q far from the target p (5 symbols): the first
    token walk_drawn emits follows p (χ², 20,000 rounds), and the residual's part shows: without it (p kept after a
    rejection) the same rounds are far off."""
    import compress.serving.speculative as spec_mod

    p = torch.tensor([0.05, 0.1, 0.5, 0.25, 0.1])
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    logits = torch.log(p)[None].expand(4, 5).contiguous()  # every row's target distribution p (temperature 1)
    g = torch.Generator().manual_seed(0)

    def rounds(n=20000):
        counts = torch.zeros(5)
        for _ in range(n):
            keys = torch.log(q) - torch.log(-torch.log(torch.rand(5, generator=g)))
            tree = DraftTree([0] + keys.topk(3).indices.tolist(), [-1, 0, 0, 0], {0: q})
            path, nxt = walk_drawn(tree, logits, 1.0, g)
            counts[tree.tokens[path[0]] if path else nxt] += 1
        return counts

    assert _chi2(rounds(), p) < 4 + 6 * 8 ** 0.5
    monkeypatch.setattr(spec_mod, "residual", lambda target, draft: target)  # the mistake: p kept after a rejection
    assert _chi2(rounds(5000), p) > 100


def test_drawn_tree_decoding_follows_the_target():
    """generate_eagle_tree at temperature 1 with drawn nodes: the first two new tokens' distributions are the
    target's (χ² over 1,000 generations against the exact marginals), with a random head far from it."""
    target = small_llama(vocab=24, layers=4, scale=3.0)
    head = random_head(target, draft_vocab=16)
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    prompt = [1, 5, 7, 2, 11]
    with torch.no_grad():
        q1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
        rows = target(input_ids=torch.tensor([prompt + [t] for t in range(24)])).logits[:, -1].double()
        q2 = (q1[:, None] * torch.softmax(rows, -1)).sum(0)
    g = torch.Generator().manual_seed(0)
    firsts, seconds, accepted = torch.zeros(24), torch.zeros(24), 0
    for _ in range(1000):
        got = generate_eagle_tree(target, head, prompt, 2, TreeShape(1, 3, 3), 1.0, g)
        firsts[got.tokens[0]] += 1
        seconds[got.tokens[1]] += 1
        accepted += got.accepted
    assert _chi2(firsts, q1) < 23 + 6 * 46 ** 0.5 and _chi2(seconds, q2) < 23 + 6 * 46 ** 0.5
    assert accepted > 50  # the drawn nodes were accepted at times: the rejection path is not all that ran
    for shape in (TreeShape(3, 2, 2), TreeShape(4, 3, 7), TreeShape(5, 4, 15)):  # budgets spent before the last level
        got = generate_eagle_tree(target, head, prompt, 12, shape, 1.0, g)
        assert len(got.tokens) == 12 and got.proposed <= shape.tokens * got.target_steps


def test_measure_draft_reports_tree_rows():
    """A tree row beside the chain's: no chain α, its draft cost per round, and the mismatch count only where the
    outputs must be plain decoding's (greedy or `top`; drawn nodes are exact in distribution only)."""
    from compress.measure.speculation import measure_draft

    target = small_llama(scale=2.0)
    head = random_head(target)
    prompts = [[3, 17, 5, 9, 40, 2], [8, 1, 30, 7, 12, 6]]
    shape = TreeShape(3, 2, 4)
    for temperature, sampling, mismatches in ((0.0, "drawn", 0), (1.0, "top", 0), (1.0, "drawn", None)):
        got = measure_draft(target, head, prompts, 12, ks=(2,), adaptive=False, temperature=temperature,
                            trees=(shape,), tree_sampling=sampling)
        chain, tree = got["rows"]
        assert tree["k"] == "tree 3,2,4" and tree["alpha"] is None and chain["alpha"] is not None
        assert got["tree_mismatches"] == mismatches and tree["tokens"] == chain["tokens"] == 24
        assert tree["draft_cost"] > 0 and tree["predicted_speedup"] > 0
    with pytest.raises(ValueError, match="drafted by an EAGLE-3 head"):
        measure_draft(target, small_llama(seed=1), prompts, 4, ks=(2,), trees=(shape,))
