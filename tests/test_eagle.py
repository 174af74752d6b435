"""EAGLE-3 draft heads (serving/eagle.py, distill/eagle.py, export/eagle.py): the target's features on every decode
path, the unrolled training attention against step-by-step decoding, exact speculative decoding with a head (greedy
token for token, sampling in distribution), training that raises agreement, and the checkpoint vLLM loads."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from compress.distill.eagle import (HeadTraining, evaluate_head, frequent_ids, init_head, teacher_data, train_head,
                                    ttt_logits, ttt_loss)
from compress.export.eagle import write_head
from compress.kernels.cpu_rows import RowsUnavailable, load
from compress.serving import speculative as spec
from compress.serving.eagle import (ARCHITECTURE, EagleHead, HeadStream, default_aux_layers, generate_eagle,
                                    head_config, is_head_folder, load_head)
from compress.serving.lean_decode import LeanStream, use_rows

try:
    load()
    HAS_ROWS = True
except RowsUnavailable:
    HAS_ROWS = False

AUX = (1, 2, 3)


def small_llama(seed: int = 0, vocab: int = 96, layers: int = 4, scale: float = 1.0, hidden: int = 64, heads: int = 4):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    return model


def random_head(target, draft_vocab: int = 48, seed: int = 1) -> EagleHead:
    """A head with every weight random (init_head zeroes o_proj and down_proj, which would hide attention bugs)."""
    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head = init_head(target, draft_vocab, ids, AUX, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.1)
    return head


def test_default_aux_layers_and_config_are_vllms():
    assert default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="--aux-layers"):
        default_aux_layers(4)  # (2, 2, 1): not three distinct layers
    target = small_llama()
    cfg = head_config(target.config, 40, AUX)
    assert cfg.architectures == [ARCHITECTURE] and cfg.num_hidden_layers == 1 and cfg.draft_vocab_size == 40
    assert cfg.eagle_aux_hidden_state_layer_ids == list(AUX) and cfg.target_hidden_size == 64
    with pytest.raises(ValueError, match="three distinct hidden-state ids"):
        head_config(target.config, 40, (1, 9, 2))
    with pytest.raises(ValueError, match="three distinct hidden-state ids"):
        head_config(target.config, 40, (1, 1, 2))
    assert head_config(target.config, 40, (3, 1, 2)).eagle_aux_hidden_state_layer_ids == [1, 2, 3]  # vLLM's order
    with pytest.raises(ValueError, match="draft vocabulary"):
        head_config(target.config, 1000, AUX)


@torch.no_grad()
@pytest.mark.parametrize("rows", [False, True])
def test_stream_features_are_the_hidden_states_entering_the_layers(rows):
    """LeanStream's features equal transformers' hidden_states[j] (the input of layer j), across a prefill, a decode
    step and a verify; on the block kernel the captured run's logits are bit for bit those of an uncaptured run."""
    if rows and not HAS_ROWS:
        pytest.skip("the few-row kernels do not build here")
    target = small_llama(vocab=320)
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    aux = (0, 2, 3)  # the embedding too
    ref = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([ref.hidden_states[j][0] for j in aux], -1)
    with use_rows(target) if rows else torch.no_grad():
        s = LeanStream(target, 64, aux)
        plain = LeanStream(target, 64)
        assert (s.c_blocks is not None) == rows
        got, logits = [], []
        for chunk in (ids[:20], ids[20:21], ids[21:30]):
            logits.append(s.forward(chunk))
            got.append(s.features)
            if rows:
                assert torch.equal(logits[-1], plain.forward(chunk))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    s2 = spec.make_stream(target, 64, "transformers", aux)
    s2.forward(ids)
    torch.testing.assert_close(s2.features, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="feature layers"):
        LeanStream(target, 64, (0, 4))  # 4 layers: ids 0..3


@torch.no_grad()
def test_unrolled_training_equals_drafting_one_entry_at_a_time():
    """ttt_logits (every position of every unrolled step at once) against HeadStream: exact entries up to e, then
    step s at position e + s reads step s − 1's output; the two agree at every e and s."""
    target = small_llama()
    head = random_head(target)
    seq = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    out = target(input_ids=seq, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[j] for j in AUX], -1)
    emb = target.get_input_embeddings()(seq)
    steps = 4
    unrolled = ttt_logits(head, emb[:, 1:], feats[:, :-1], steps)
    tokens = seq[0].tolist()
    for e in (0, 5, 17):
        hs = HeadStream(head, target.get_input_embeddings(), 64)
        lg, h = hs.forward(tokens[1:e + 2], head.fc(feats[0, :e + 1]))
        torch.testing.assert_close(lg, unrolled[0][0, :e + 1], rtol=1e-5, atol=1e-5)
        for s in range(1, steps):
            lg, h = hs.forward([tokens[e + s + 1]], h[-1:])
            torch.testing.assert_close(lg[0], unrolled[s][0, e + s], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("runtime", ["lean", "transformers"])
def test_greedy_speculation_with_a_head_equals_plain_decoding(runtime):
    target = small_llama(scale=2.0)
    head = random_head(target)
    prompt = [3, 17, 5, 9, 40, 2]
    plain = spec.generate_plain(target, prompt, 30, runtime=runtime)
    for k, adaptive in ((1, False), (4, False), (3, True)):
        got = generate_eagle(target, head, prompt, 30, k=k, adaptive=adaptive, runtime=runtime)
        assert got.tokens == plain.tokens
        assert got.proposed > 0 and got.target_steps < 31
    one = generate_eagle(target, head, prompt[:1], 10, k=3, runtime=runtime)  # no features before the first verify
    assert one.tokens == spec.generate_plain(target, prompt[:1], 10, runtime=runtime).tokens


@torch.no_grad()
def test_sampling_with_a_head_follows_the_target():
    """The first token after a prompt, sampled through generate_eagle with a random head (K = 1: the drafted token
    is judged by min(1, q/p) and replaced from the residual): χ² against the target's softmax over its 24 tokens
    (1,000 draws), and far from the head's own distribution."""
    target = small_llama(vocab=24, layers=4, scale=3.0).double()
    head = random_head(target, draft_vocab=16).double()
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)  # a draft distribution far from the target's, and not one-hot
    prompt = [1, 5, 7, 2, 11]
    q = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    hs = HeadStream(head, target.get_input_embeddings(), 16)
    feats = torch.cat([h[0] for i, h in enumerate(target(input_ids=torch.tensor([prompt[:-1]]),
                                                         output_hidden_states=True).hidden_states) if i in AUX], -1)
    p_sub = torch.softmax(hs.forward(prompt[1:], head.fc(feats))[0][-1].double(), -1)
    p = torch.zeros(24, dtype=torch.float64).index_copy_(0, head.draft_ids, p_sub)
    g = torch.Generator().manual_seed(0)
    n = 1000
    draws = torch.tensor([generate_eagle(target, head, prompt, 1, k=1, temperature=1.0, generator=g,
                                         runtime="transformers").tokens[0] for _ in range(n)])
    counts = torch.bincount(draws, minlength=24).double()

    def chi2(probs):
        expected = probs * n
        keep = expected > 0
        return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()) + 1e9 * float(counts[~keep].sum())

    assert chi2(q) < 23 + 6 * math.sqrt(2 * 23)
    assert chi2(p) > 200


def test_a_head_for_another_target_is_refused():
    head = random_head(small_llama())
    other = small_llama(vocab=120)
    with pytest.raises(ValueError, match="trained for a target"):
        generate_eagle(other, head, [1, 2, 3], 4)


def permutation_llama(vocab: int = 96, seed: int = 0, hidden: int = 64, heads: int = 4, blocks: float = 0.0):
    """A target whose next token is a fixed permutation π of the current one (its blocks add nothing, or `blocks`
    of what they would, its head's row for π(x) is x's embedding): learnable, so a head trained on it must come to
    predict π(token p + 1)."""
    model = small_llama(seed, vocab=vocab, hidden=hidden, heads=heads)
    model.config.tie_word_embeddings = False
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.o_proj.weight.mul_(blocks)
            block.mlp.down_proj.weight.mul_(blocks)
        emb = model.get_input_embeddings().weight
        model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        model.lm_head.weight.copy_(emb[torch.argsort(perm)] * 4.0)
    return model, perm


def test_training_raises_agreement_and_the_unrolled_steps_improve():
    """A few epochs on the target's own greedy and sampled continuations: held-out KL falls and top-1 agreement
    with the target rises at every unrolled step, and a trained head is accepted more often in decoding."""
    from compress.distill.eagle import generate_sequences

    target, perm = permutation_llama()
    # random prompts as long as the continuations: there token p + 1 does not follow from token p, so the head must
    # read its own input token (the embedding), not only the target's features at p
    prompts = torch.randint(0, 96, (48, 16), generator=torch.Generator().manual_seed(0))
    cfg = HeadTraining(sequences=48, prompt_tokens=16, new_tokens=16, generate_batch=16, draft_vocab=96, epochs=8,
                       batch=8, lr=3e-3, ttt_steps=3)
    seqs = generate_sequences(target, prompts, cfg)
    assert seqs.shape == (48, 32) and torch.equal(seqs[:, :16], prompts)
    assert torch.equal(seqs[0, 17:], perm[seqs[0, 16:-1]])  # greedy: π applied token after token
    ids = frequent_ids(seqs, 96, 96)
    feats, teacher = teacher_data(target, seqs, AUX, ids)
    assert feats.shape == (48, 32, 192) and teacher.shape == (48, 32, 96)
    head = init_head(target, 96, ids, AUX)
    emb = target.get_input_embeddings()(seqs).detach().float()
    before = evaluate_head(head, emb[40:], feats[40:], teacher[40:], cfg)
    history = train_head(head, target.get_input_embeddings(), seqs, feats, teacher, cfg, holdout=8)
    after = history[-1]
    assert all(a < 0.5 * b for a, b in zip(after["heldout_kl"], before["heldout_kl"])), (before, after)
    assert all(a > b + 0.3 for a, b in zip(after["heldout_agreement"], before["heldout_agreement"])), (
        before["heldout_agreement"], after["heldout_agreement"])
    fresh = init_head(target, 96, ids, AUX)
    prompt = seqs[44, :16].tolist()
    trained = generate_eagle(target, head, prompt, 48, k=3)
    untrained = generate_eagle(target, fresh, prompt, 48, k=3)
    assert trained.tokens == untrained.tokens == spec.generate_plain(target, prompt, 48).tokens
    assert trained.accepted > untrained.accepted + 10, (trained.accepted, untrained.accepted)


def test_the_checkpoint_is_vllms_layout_and_reads_back(tmp_path):
    target = small_llama()
    head = random_head(target)
    out = write_head(head, tmp_path / "head", torch.float32, notes={"why": "test"})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 48 and cfg["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (64, 128)  # q/k/v read embedding | hidden
        assert f.get_tensor("fc.weight").shape == (64, 192)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert not any("embed_tokens" in n or "rotary" in n for n in names)
    assert is_head_folder(out) and not is_head_folder(tmp_path)
    back = load_head(out)
    for (n, a), (m, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    assert torch.equal(back.draft_ids, head.draft_ids.sort().values) and int(back.t2d.sum()) == 48
    prompt = [3, 17, 5, 9]
    assert generate_eagle(target, back, prompt, 12, k=3).tokens == generate_eagle(target, head, prompt, 12, k=3).tokens
    with pytest.raises(ValueError, match="draft-head"):
        load_head(tmp_path)
    whole = write_head(random_head(target, draft_vocab=96), tmp_path / "whole", torch.float32)
    with safe_open(str(whole / "model.safetensors"), "pt") as f:  # vLLM refuses a map for the whole vocabulary
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
    assert torch.equal(load_head(whole).draft_ids, torch.arange(96))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="ttt_steps"):
        HeadTraining(prompt_tokens=2, new_tokens=2, ttt_steps=3)
    with pytest.raises(ValueError, match="epochs"):
        HeadTraining(epochs=0)
    target = small_llama()
    head = random_head(target)
    with pytest.raises(ValueError, match="distinct ids"):
        head.set_vocab(torch.zeros(48, dtype=torch.int64))


def test_the_commands_train_a_head_and_measure_it(tmp_path, capsys):
    """`compress draft-head` end to end on a tiny local model (generation, teacher pass, training, the folder; a
    second run reads its --cache), then `compress speculate` with the head as the draft: greedy outputs exact."""
    from compress.cli.commands import main
    from tests.conftest import make_tiny_model
    from tests.tiny_tokenizer import make_tiny_tokenizer

    folder = tmp_path / "tiny"
    make_tiny_model("llama", num_hidden_layers=4).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    out, cache = tmp_path / "head", tmp_path / "data"
    args = ["draft-head", str(folder), "--output", str(out), "--sequences", "6", "--prompt-tokens", "12",
            "--new-tokens", "10", "--epochs", "2", "--batch", "2", "--holdout", "2", "--draft-vocab", "64",
            "--aux-layers", "3,1,2", "--cache", str(cache)]
    assert main(args) == 0
    notes = json.loads((out / "training.json").read_text())
    assert [h["epoch"] for h in notes["history"]] == [1, 2] and len(notes["history"][-1]["heldout_kl"]) == 3
    assert {"generate", "teacher", "train"} <= set(notes["seconds"]) and notes["aux_layers"] == [1, 2, 3]
    assert is_head_folder(out) and "compress speculate" in capsys.readouterr().out
    assert main(args) == 0
    assert json.loads((out / "training.json").read_text())["data"].startswith("read from")
    assert main(args + ["--text-sequences", "3", "--draft-vocab", "80"]) == 0  # new data, the same generations
    notes = json.loads((out / "training.json").read_text())
    assert notes["generations"].startswith("read from") and "generate" not in notes["seconds"]
    assert notes["settings"]["text_sequences"] == 3 and load_head(out).config.draft_vocab_size == 80
    from safetensors.torch import load_file

    data = load_file(str(cache / "data.safetensors"))
    assert data["sequences"].shape == (9, 22) and torch.equal(data["sequences"][3:], load_file(
        str(cache / "generations.safetensors"))["sequences"])  # text first, the generations (held out from) last
    result = tmp_path / "spec.json"
    assert main(["speculate", str(folder), "--draft", str(out), "--prompts", "2", "--prompt-tokens", "16",
                 "--max-new-tokens", "6", "--k", "1-2", "--tree", "3,2,4", "--output", str(result)]) == 0
    measured = json.loads(result.read_text())
    assert measured["greedy_mismatches"] == 0 and [r["k"] for r in measured["rows"]] == [1, 2, "adaptive",
                                                                                          "tree 3,2,4"]
    assert measured["tree_mismatches"] == 0 and measured["rows"][-1]["alpha"] is None
    assert "| tree 3,2,4 (mean" in capsys.readouterr().out
    assert main(["speculate", str(folder), "--draft", "self-int4", "--tree", "3,2,4"]) == 2
    assert "for an EAGLE-3 head draft" in capsys.readouterr().err
    assert any("EAGLE-3 head" in n for n in measured["notes"])
    assert main(["speculate", str(folder), "--draft", str(out), "--draft-int4"]) == 2
    assert "--draft-int4 and --draft-vocab apply to whole-model drafts" in capsys.readouterr().err
    assert main(["draft-head", str(folder), "--output", str(out), "--holdout", "300"]) == 2


def _trained_head(target, vocab: int, draft_vocab: int, epochs: int = 8):
    from compress.distill.eagle import generate_sequences

    prompts = torch.randint(0, vocab, (48, 8), generator=torch.Generator().manual_seed(0))
    cfg = HeadTraining(sequences=48, prompt_tokens=8, new_tokens=24, generate_batch=16, draft_vocab=draft_vocab,
                       epochs=epochs, batch=8, lr=3e-3, ttt_steps=3)
    seqs = generate_sequences(target, prompts, cfg)
    ids = frequent_ids(seqs, draft_vocab, vocab)
    feats, teacher = teacher_data(target, seqs, AUX, ids)
    head = init_head(target, draft_vocab, ids, AUX)
    train_head(head, target.get_input_embeddings(), seqs, feats, teacher, cfg)
    return head


@pytest.mark.slow
def test_vllm_serves_the_head_and_accepts_what_compress_accepts(tmp_path):
    """vLLM itself (its eagle3 speculative method) loads a head written by write_head for a target saved as a
    Hugging Face folder: its greedy tokens equal its own plain decoding and ours, and the share of drafted tokens
    it accepts is compress's within 0.1 (0.45 here; a head read with its feature layers reversed is accepted about
    half as often; vLLM reads the listed layers in ascending order, as head_config stores them). Skipped only where
    no vLLM interpreter is found."""
    from compress.engines.base import EngineUnavailable
    from compress.engines.vllm import interpreter
    from compress.engines.vllm_eagle import serve_with_head
    from tests.tiny_tokenizer import make_tiny_tokenizer

    try:
        python = interpreter()
    except EngineUnavailable as e:
        pytest.skip(str(e))
    # head_dim 64 (a size vLLM's CPU attention runs); blocks that change the hidden state, so that a head served
    # with other feature layers than it was trained on is accepted less
    target, _ = permutation_llama(vocab=256, hidden=128, heads=2, blocks=2.0)
    head = _trained_head(target, 256, 224)  # a vocabulary map (d2t) for vLLM to read
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    out = write_head(head, tmp_path / "head", torch.float32)
    prompts = [torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    ours = [generate_eagle(target, head, p, 16, k=3) for p in prompts]
    assert sum(g.accepted for g in ours) > 15
    plain = serve_with_head(str(folder), str(out), prompts, 3, 16, speculative=False, python=python)
    served = serve_with_head(str(folder), str(out), prompts, 3, 16, python=python)
    assert served["loads"], served.get("error")
    assert served["greedy"] == plain["greedy"] == [g.tokens for g in ours]
    # vLLM drafts from its prefill on (its first draft guesses the second new token; ours the first), so the rounds
    # fall differently and the counts differ by a few; the acceptance rates agree
    ours_rate = sum(g.accepted for g in ours) / sum(g.proposed for g in ours)
    assert abs(served["accepted_per_draft_token"] - ours_rate) < 0.1, (served, ours_rate)


def test_a_quantized_target_trains_its_own_head():
    """The head of a quantized target (int4 layers, an int8 head) reads that target's own hidden states and starts
    from its dequantized head rows; greedy decoding with it stays exact."""
    from compress.core.nn import QuantLinear
    from compress.measure.speculation import int4_copy

    target, _ = int4_copy(small_llama(scale=2.0), dtype=torch.float32, fuse=False)
    assert isinstance(target.lm_head, QuantLinear)
    seqs = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))
    ids = frequent_ids(seqs, 32, 96)
    feats, teacher = teacher_data(target, seqs, AUX, ids)
    out = target(input_ids=seqs[:1], output_hidden_states=True)
    torch.testing.assert_close(feats[0].float(), torch.cat([out.hidden_states[j][0] for j in AUX], -1),
                               rtol=1e-2, atol=1e-2)  # stored in bfloat16
    want = torch.log_softmax(out.logits[0][..., ids], -1)  # the whole model's logits, over the draft vocabulary
    torch.testing.assert_close(teacher[0].float(), want, rtol=2e-3, atol=2e-3)  # stored in float16
    head = init_head(target, 32, ids, AUX)
    rows = target.lm_head(torch.eye(64)).T[ids]  # the int8 head's dequantized rows
    torch.testing.assert_close(head.lm_head.weight, rows)
    cfg = HeadTraining(sequences=8, prompt_tokens=8, new_tokens=8, draft_vocab=32, epochs=1, batch=4)
    train_head(head, target.get_input_embeddings(), seqs, feats, teacher, cfg)
    prompt = [3, 17, 5, 9]
    assert generate_eagle(target, head, prompt, 12, k=3).tokens == spec.generate_plain(target, prompt, 12).tokens
