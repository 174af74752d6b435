"""Mixture-of-experts models: fused expert tensors become one linear layer per expert and projection, computing what
the fused module computes; every parameter is quantized or listed with its reason; calibration reaches each expert
through the tokens routed to it, and an expert that saw too few falls back by the stated rule, never to NaN."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from compress.arch import get_arch
from compress.cli.commands import main
from compress.model.load import load_model
from compress.export.native import load_compressed
from compress.arch.moe import ROUTER_REASON, ExpertLinears, moe_blocks, router_names, unfuse_experts
from compress.core.nn import QuantLinear
from compress.quantizers import quantize_rtn
from compress.quantizers.rtn import RTNOptions
from compress.core.scheme import QuantScheme
from compress.stages.quantize import QuantizeStage, plan_quantize

from .conftest import TINY_CONFIGS, TINY_MOE_CONFIGS, make_tiny_model
from .tiny_tokenizer import make_tiny_tokenizer, word_text

MOE = sorted(TINY_MOE_CONFIGS)
SCHEME = QuantScheme("int4", group_size=16)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", MOE)
def test_unfused_experts_compute_what_the_fused_module_computes(family):
    """The reference is transformers' own fused module (its eager forward); the unfused experts are views of its
    tensors where they are rows of them (a copy for gpt-oss's transposed, interleaved layout) and give the same
    logits."""
    model = make_tiny_model(family)
    fused = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Experts")}
    shapes = {n: {k: tuple(p.shape) for k, p in m.named_parameters()} for n, m in fused.items()}
    storages = {n: {p.untyped_storage().data_ptr() for p in m.parameters()} for n, m in fused.items()}
    with torch.no_grad():
        want = model(_ids()).logits
    assert sorted(unfuse_experts(model)) == sorted(fused)
    blocks = moe_blocks(model)
    assert set(blocks) == set(fused) and all(isinstance(b, ExpertLinears) for b in blocks.values())
    for name, block in blocks.items():
        experts = next(iter(shapes[name].values()))[0]
        assert len(block) == experts
        per_expert = [p for e in block for p in e.parameters()]
        if not block.layout.transposed and block.layout.concatenated:  # rows of the fused tensors: views
            assert {p.untyped_storage().data_ptr() for p in per_expert} <= storages[name]
        assert all(p.is_contiguous() for p in per_expert)  # gpt-oss's strided slices copied, expert by expert
        assert sum(p.numel() for p in per_expert) == sum(torch.Size(s).numel() for s in shapes[name].values())
    with torch.no_grad():
        got = model(_ids()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert unfuse_experts(model) == []  # idempotent


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS) + MOE)
def test_every_parameter_is_quantized_or_listed_with_a_reason(family):
    """Quantized weights + parameters listed in float (with a reason) = all of the model's parameters, for every
    family; a MoE model's experts are quantized (the bulk of its weights) and its routers listed in float."""
    model = make_tiny_model(family)
    unfuse_experts(model)
    plan = plan_quantize(model, get_arch(model), QuantizeStage(scheme=SCHEME, strict=False))
    quantized = sum(e.shape[0] * e.shape[1] for e in plan.quantized)
    listed = sum(n for _, n, _ in plan.float_params)
    assert quantized + listed == sum(p.numel() for p in model.parameters())
    assert all(why for _, _, why in plan.float_params)
    names = {e.name for e in plan.quantized}
    for moe, block in moe_blocks(model).items():
        projections = ("gate_proj", "up_proj", "down_proj") if block.layout.has_gate else ("up_proj", "down_proj")
        assert {f"{moe}.{e}.{p}" for e in range(len(block)) for p in projections} <= names
    routers = router_names(model)
    assert bool(routers) == (family in MOE)
    reasons = {n.rsplit(".", 1)[0]: why for n, _, why in plan.float_params}
    for r in routers:
        assert r not in names and ROUTER_REASON in reasons[r]


def _write_model(folder, family: str, seed: int = 0, edit=None):
    model = make_tiny_model(family, seed)
    if edit is not None:
        edit(model)
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def _run(tmp_path, folder, method: str, prepend: list = (), **stage) -> dict:
    calib = tmp_path / "calib.txt"
    calib.write_text(word_text(512) + "\n")
    recipe = {"model": {"source": str(folder), "dtype": "float32", "device": "cpu"},
              "calibration": {"kind": "files", "files": [str(calib)], "n_samples": 4, "seq_len": 16},
              "stages": [*prepend, {"stage": "quantize", "method": method,
                                    "scheme": {"dtype": "int4", "group_size": 16}, **stage}],
              "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "r.yaml"), "--no-progress"]) == 0
    return json.loads((tmp_path / "out" / "report.json").read_text())


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("family", MOE)
def test_every_method_calibrates_every_expert_and_the_checkpoint_reloads(tmp_path, family, method):
    """RTN, GPTQ and AWQ (+ RTN) on each MoE family: every expert is quantized (GPTQ with the Hessian of the tokens
    routed to it), the report counts each expert's tokens (each block sees n × seq_len tokens, top-k experts each),
    and the saved checkpoint reloads to a model close to the float one."""
    folder = _write_model(tmp_path / "model", family)
    stages = [{"stage": "awq", "n_grid": 5}] if method == "awq" else []
    report = _run(tmp_path, folder, "rtn" if method == "awq" else method, prepend=stages)
    stage = report["stages"][-1]
    float_model = load_model(str(folder), "float32").model
    blocks = moe_blocks(float_model)
    top_k = float_model.config.num_experts_per_tok
    assert set(stage["experts"]) == set(blocks)
    for moe, row in stage["experts"].items():
        assert len(row["tokens"]) == len(blocks[moe]) and sum(row["tokens"]) == 4 * 16 * top_k
    reloaded = load_compressed(tmp_path / "out")
    experts = [n for n, m in reloaded.named_modules() if isinstance(m, QuantLinear) and ".experts." in n]
    assert len(experts) == sum(len(b) * (3 if b.layout.has_gate else 2) for b in blocks.values())
    with torch.no_grad():
        q, f = reloaded(_ids(1)).logits, float_model(_ids(1)).logits
    kl = torch.nn.functional.kl_div(q.log_softmax(-1), f.log_softmax(-1), log_target=True, reduction="batchmean")
    assert torch.isfinite(q).all() and 0 < float(kl) < 0.05


def test_an_expert_no_token_reaches_falls_back_to_round_to_nearest_and_is_listed(tmp_path):
    """gpt-oss's router has a bias: -1e4 on expert 3 means no calibration token is routed to it. GPTQ cannot solve
    without its inputs: its weights are round-to-nearest (equal to RTN's codes), finite, and the report says so;
    the routed experts are GPTQ (different codes)."""
    def starve(model):
        for block in model.model.layers:
            block.mlp.router.bias.data[3] = -1e4

    folder = _write_model(tmp_path / "model", "gpt_oss", edit=starve)
    stage = _run(tmp_path, folder, "gptq")["stages"][0]
    for moe, row in stage["experts"].items():
        assert row["tokens"][3] == 0 and min(row["tokens"][:3]) > 0
        assert set(row["fallback"]) == {"3"} and "round-to-nearest" in row["fallback"]["3"]
    reloaded = load_compressed(tmp_path / "out")
    float_model = load_model(str(folder), "float32").model
    for i in range(2):
        for e, same in ((3, True), (0, False)):
            name = f"model.layers.{i}.mlp.experts.{e}.down_proj"
            got = reloaded.get_submodule(name).qtensor()
            rtn = quantize_rtn(float_model.get_submodule(name).weight.detach(), SCHEME, RTNOptions())
            assert torch.isfinite(got.scale).all()
            assert torch.equal(got.codes(), rtn.codes()) == same, name
    with torch.no_grad():
        assert torch.isfinite(reloaded(_ids(2)).logits).all()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_scales_folded_before_the_experts_leave_the_model_and_its_routing_unchanged(family):
    """The norm -> every expert's gate/up pair: dividing the norm by s and multiplying the experts' (and a shared
    expert's) input columns by s changes nothing only if the routers reading the norm take s too (followers);
    without them the routing moves and the logits change."""
    import dataclasses

    from compress.transforms.smoothing import fold_scales, usable_pairs

    def folded(with_followers: bool) -> torch.Tensor:
        model = make_tiny_model(family)
        unfuse_experts(model)
        arch = get_arch(model)
        s = torch.rand(64, generator=torch.Generator().manual_seed(1)) * 4 + 0.25
        for block in arch.block_list(model):
            names = {n for n, _ in block.named_modules()}
            pairs = [p for p in usable_pairs(block, arch.awq, names, []) if p.label.startswith("post_attention")]
            assert len(pairs) == 1 and len(pairs[0].balance) >= 8 and pairs[0].followers
            pair = pairs[0] if with_followers else dataclasses.replace(pairs[0], followers=[])
            fold_scales(pair, s, arch.norm_offset, {})
        with torch.no_grad():
            return model(_ids()).logits

    with torch.no_grad():
        want = make_tiny_model(family)(_ids()).logits
    torch.testing.assert_close(folded(True), want, rtol=1e-4, atol=1e-4)
    assert (folded(False) - want).abs().max() > 1e-2


def test_awq_scales_every_expert_and_the_quantized_moe_reloads(tmp_path):
    """AWQ on Qwen2-MoE (experts, a shared expert and its gate): the joint norm pair and every expert's up -> down
    pair are searched (never worse than unscaled on the search's own loss), and the saved model reloads close to
    the float one."""
    folder = _write_model(tmp_path / "model", "qwen2_moe")
    calib = tmp_path / "calib.txt"
    calib.write_text(word_text(512) + "\n")
    recipe = {"model": {"source": str(folder), "dtype": "float32", "device": "cpu"},
              "calibration": {"kind": "files", "files": [str(calib)], "n_samples": 4, "seq_len": 16},
              "stages": [{"stage": "awq", "n_grid": 5},
                         {"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16}}],
              "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "r.yaml"), "--no-progress"]) == 0
    blocks = json.loads((tmp_path / "out" / "report.json").read_text())["stages"][0]["blocks"]
    for blk in blocks:
        pairs = {p["pair"]: p for p in blk["pairs"] if not p["skipped"]}
        joint = "post_attention_layernorm -> mlp.experts.*.gate_proj, mlp.experts.*.up_proj, " \
                "mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj"
        assert joint in pairs
        assert sum(1 for p in blk["pairs"] if p["pair"] == "mlp.experts.*.up_proj -> mlp.experts.*.down_proj") == 4
        assert all(p["loss"] <= p["loss_identity"] for p in pairs.values())
    reloaded = load_compressed(tmp_path / "out")
    with torch.no_grad():
        q, f = reloaded(_ids(1)).logits, load_model(str(folder), "float32").model(_ids(1)).logits
    kl = torch.nn.functional.kl_div(q.log_softmax(-1), f.log_softmax(-1), log_target=True, reduction="batchmean")
    assert 0 < float(kl) < 0.05


def test_inspect_shows_the_experts_and_the_memory_plan_counts_them(tmp_path, capsys):
    """`compress inspect` lists each expert projection once per block with the expert count, the routers in float
    with the reason, and what else stays float; the memory plan's model size counts every expert's weights."""
    from transformers import AutoConfig

    from compress.pipeline.memory_plan import model_size

    folder = _write_model(tmp_path / "model", "mixtral")
    recipe = {"model": {"source": str(folder)},
              "stages": [{"stage": "quantize", "method": "rtn", "scheme": {"dtype": "int4", "group_size": 16}}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["inspect", str(tmp_path / "r.yaml")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.*.down_proj" in out and "(4 experts)" in out
    assert "layers quantized" in out and "router" in out and "other parameters kept in float" in out
    size = model_size(AutoConfig.from_pretrained(folder))
    model = make_tiny_model("mixtral")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    attention = sum(p.numel() for n, p in model.named_parameters() if "self_attn" in n and n.endswith("weight"))
    assert size.block_linear_parameters == experts + attention


@pytest.mark.parametrize("family", MOE)
def test_exports_use_the_hub_names_and_reload_with_plain_transformers(tmp_path, family, capsys):
    """The dense export names every tensor as transformers' own save_pretrained does for the family (Mixtral's
    block_sparse_moe.experts.{e}.w1, Qwen's experts.{e}.gate_proj, gpt-oss's fused tensors): the names vLLM's
    loaders read. Plain `from_pretrained` reloads it with no missing or unexpected tensor, and so it does the
    compressed-tensors export (routers in its `ignore` list), logits equal to the compress checkpoint's up to the
    bf16 the exports store. gpt-oss has no per-expert layout: formats other than dense are refused, naming dense."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from compress.model.load import _compressed_tensors_kwargs

    folder = _write_model(tmp_path / "model", family)
    experts = _run(tmp_path, folder, "rtn")["stages"][0]["experts"]  # RTN needs no data, yet counts the tokens
    assert experts and all(sum(r["tokens"]) > 0 and not r["fallback"] for r in experts.values())
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved_by_transformers = set(f.keys())
    compressed = load_compressed(tmp_path / "out")
    with torch.no_grad():
        want = compressed(_ids(3)).logits
    for fmt in ("dense", "compressed-tensors"):
        export = tmp_path / fmt
        code = main(["export", str(tmp_path / "out"), "--format", fmt, "--output", str(export)])
        if family == "gpt_oss" and fmt != "dense":
            assert code == 2 and "export `dense`" in capsys.readouterr().err
            continue
        assert code == 0
        with safe_open(export / "model.safetensors", "pt") as f:
            names = set(f.keys())
        if fmt == "dense":
            assert names == saved_by_transformers
        else:
            config = json.loads((export / "config.json").read_text())["quantization_config"]
            routers = {n for n in names if n.endswith(("gate.weight", "router.weight"))}
            assert routers and {n.rsplit(".", 1)[0] for n in routers} <= set(config["ignore"])
        model, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True,
                                                           **_compressed_tensors_kwargs(export))
        assert not info["missing_keys"] and not info["unexpected_keys"]
        with torch.no_grad():
            got = model(_ids(3)).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0.02)


def test_two_processes_reduce_an_experts_statistics_that_only_one_of_them_saw(tmp_path):
    """Data-parallel calibration of a MoE block over 2 gloo processes where only rank 0's windows reach expert 3:
    the ranks agree on which layers anyone saw, rank 1 joins with zeros, and both end with the one-process
    statistics of all the windows (Hessians to 1e-6 relative), for every expert."""
    from safetensors.torch import load_file

    from tests.calib_worker import MOE_LINEARS, flat, moe_block, observe
    from tests.test_streaming import _torchrun

    _torchrun(["tests/calib_worker.py", str(tmp_path), "moe"], tmp_path)
    ranks = [load_file(str(tmp_path / f"rank-{i}.safetensors")) for i in range(2)]
    index = MOE_LINEARS.index("experts.3.gate_proj")
    assert bool(ranks[0]["saw"][index]) and not bool(ranks[1]["saw"][index])
    single = flat(observe(*moe_block(), MOE_LINEARS), MOE_LINEARS)
    assert int(single["experts.3.gate_proj.tokens"]) > 0
    for key, ref in single.items():
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        if key.endswith(("tokens", "abs_max")):
            assert torch.equal(ranks[0][key], ref), key
        else:
            assert float((ranks[0][key] - ref).norm() / ref.norm()) < 1e-6, key


# ---------------------------------------------------------------- expert pruning

def _naive_reap(model, samples) -> dict[str, list[float]]:
    """REAP from its definition, token by token, with the fused tensors of a second copy of the model: for each MoE
    block the routing (index, weight) of every token, and expert j's output f_j(x) = down_j(act(gate_j x) * up_j x)
    from the fused [E, 2I, H] / [E, H, I] tensors (Mixtral's layout)."""
    fused = make_tiny_model("mixtral")  # the same seed: the same weights, still fused
    captured = {}
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda m, args, i=i: captured.setdefault(i, []).append((args[0], args[1], args[2])))
        for i, layer in enumerate(fused.model.layers)]
    with torch.no_grad():
        fused(input_ids=samples, use_cache=False)
    for h in hooks:
        h.remove()
    out = {}
    for i, calls in captured.items():
        experts = fused.model.layers[i].mlp.experts
        total, count = [0.0] * 4, [0] * 4
        for x, index, weights in calls:
            for t in range(x.shape[0]):
                for k in range(index.shape[1]):
                    j = int(index[t, k])
                    gate, up = (experts.gate_up_proj[j] @ x[t]).chunk(2)
                    y = experts.down_proj[j] @ (torch.nn.functional.silu(gate) * up)
                    total[j] += float(weights[t, k]) * float(y.detach().norm())
                    count[j] += 1
        out[f"model.layers.{i}.mlp.experts"] = [s / max(n, 1) for s, n in zip(total, count)]
    return out


def test_reap_scores_equal_their_definition_and_the_best_experts_are_kept():
    from compress.prune.experts import expert_scores, kept_experts

    model = make_tiny_model("mixtral")
    unfuse_experts(model)
    samples = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(4))
    scores = expert_scores(model, samples, "reap", batch_size=2)
    naive = _naive_reap(model, samples)
    for name, row in scores.items():
        assert row["score"] == pytest.approx(naive[name], rel=1e-5)
        assert sum(row["tokens"]) == 3 * 16 * 2
    kept = kept_experts(scores, 3)
    for name, idx in kept.items():
        dropped = ({0, 1, 2, 3} - set(idx)).pop()
        assert scores[name]["score"][dropped] == min(scores[name]["score"])
    frequency = expert_scores(model, samples, "frequency")
    assert all(row["score"] == [float(t) for t in row["tokens"]] for row in frequency.values())


def test_pruning_an_expert_no_token_reaches_changes_nothing_and_plain_transformers_loads_it(tmp_path):
    """gpt-oss with expert 3 starved by its router's bias: REAP scores it 0, prune_experts (keep 3) drops it, the
    routers lose its row and bias, the config says 3, the logits are exactly the original's (gpt-oss softmaxes over
    the chosen top-k only), and the dense export loads with plain from_pretrained to the same logits."""
    from transformers import AutoModelForCausalLM

    def starve(model):
        for block in model.model.layers:
            block.mlp.router.bias.data[3] = -1e4

    folder = _write_model(tmp_path / "model", "gpt_oss", edit=starve)
    calib = tmp_path / "calib.txt"
    calib.write_text(word_text(512) + "\n")
    recipe = {"model": {"source": str(folder), "dtype": "float32", "device": "cpu"},
              "calibration": {"kind": "files", "files": [str(calib)], "n_samples": 4, "seq_len": 16},
              "stages": [{"stage": "prune_experts", "keep": 3, "n_samples": 4, "seq_len": 16}],
              "eval": {"perplexity": False, "speed": False, "samples": 0}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "r.yaml"), "--no-progress"]) == 0
    section = json.loads((tmp_path / "out" / "report.json").read_text())["stages"][0]
    assert section["experts_before"] == 4 and section["experts_after"] == 3
    for row in section["blocks"].values():
        assert row["kept"] == [0, 1, 2] and row["tokens"][3] == 0 and row["score"][3] == 0
    pruned = load_compressed(tmp_path / "out")
    assert pruned.config.num_local_experts == 3
    assert pruned.model.layers[0].mlp.router.weight.shape[0] == 3 == pruned.model.layers[0].mlp.router.bias.shape[0]
    original = load_model(str(folder), "float32").model
    for p in original.parameters():  # the checkpoint keeps float tensors at output.save_dtype (bfloat16)
        p.data = p.data.bfloat16().float()
    with torch.no_grad():
        torch.testing.assert_close(pruned(_ids(5)).logits, original(_ids(5)).logits, rtol=0, atol=1e-6)
    assert main(["export", str(tmp_path / "out"), "--format", "dense", "--output", str(tmp_path / "dense")]) == 0
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(plain(_ids(5)).logits, original(_ids(5)).logits, rtol=0, atol=0.02)  # bf16


def test_prune_experts_plans_the_new_shape_and_refuses_what_cannot_be(tmp_path, capsys):
    from compress.stages.prune_experts import PruneExpertsStage

    model = make_tiny_model("qwen3_moe")
    unfuse_experts(model)
    step = PruneExpertsStage(ratio=0.5).plan(model, get_arch(model), {}, 0)
    assert "4 -> 2 experts in each of 2 MoE blocks" in step.line
    assert len(moe_blocks(step.reshaped)["model.layers.0.mlp.experts"]) == 2
    with pytest.raises(ValueError, match="fewer than the 2 each token is routed to"):
        PruneExpertsStage(keep=1).plan(model, get_arch(model), {}, 0)
    with pytest.raises(ValueError, match="exactly one of `keep`"):
        PruneExpertsStage()
    dense = make_tiny_model("llama")
    with pytest.raises(ValueError, match="no mixture-of-experts blocks"):
        PruneExpertsStage(keep=2).plan(dense, get_arch(dense), {}, 0)


def test_a_pruned_mixtral_routes_as_the_original_with_the_dropped_experts_masked():
    """Reference: the original Mixtral whose router gives the dropped experts -inf logits (its softmax over the
    rest equals the pruned router's, then the same top-2 and renormalisation). The pruned model, with the router
    rows and experts re-indexed, gives the same logits."""
    import types

    from compress.prune.experts import expert_scores, kept_experts, prune_experts

    samples = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    pruned = make_tiny_model("mixtral")
    unfuse_experts(pruned)
    kept = kept_experts(expert_scores(pruned, samples), 3)
    assert len({tuple(k) for k in kept.values()}) > 1 or kept["model.layers.0.mlp.experts"] != [0, 1, 2]
    prune_experts(pruned, kept)
    assert pruned.config.num_local_experts == 3 and pruned.model.layers[1].mlp.gate.weight.shape[0] == 3

    reference = make_tiny_model("mixtral")

    def masked(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        logits[:, self.dropped] = float("-inf")
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    for i, layer in enumerate(reference.model.layers):
        layer.mlp.gate.dropped = sorted({0, 1, 2, 3} - set(kept[f"model.layers.{i}.mlp.experts"]))
        layer.mlp.gate.forward = types.MethodType(masked, layer.mlp.gate)
    with torch.no_grad():
        torch.testing.assert_close(pruned(_ids(7)).logits, reference(_ids(7)).logits, rtol=1e-5, atol=1e-5)
