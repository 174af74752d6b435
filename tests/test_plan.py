"""The capacity planner against the course's worked examples (Llama-2-13B on an H100; a 30B model for 100 users at
32k context), its search against brute force, and its refusals. Configs only: nothing is downloaded."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest
import transformers

from compress.serving import planner as P
from compress.cli import plan as plan_cmd
from compress.serving.roofline import ACCELERATORS, decode, max_batch, model_facts, prefill_seconds
from compress.prune.minitron import count_params

H100 = ACCELERATORS["H100-SXM"]
COURSE = P.Assumptions(memory_utilization=1.0, activation_factor=0)  # the course's arithmetic: 80 GB, no activations
QUESTION = P.Workload(users=100, context=32768, ttft_s=0.5)  # "100 users, 32k context, TTFT under 500 ms on H100s"


@pytest.fixture(scope="module")
def llama13():
    return P.load_shape("llama-2-13b")


@pytest.fixture(scope="module")
def qwen32():
    return P.load_shape("qwen2.5-32b")


def test_llama2_13b_on_h100_batch_1_matches_the_course(llama13):
    assert llama13.params == 13_015_864_320  # the published 13.0B, as tests/test_roofline.py counts it
    assert P.weight_bytes(llama13, "bf16") / 1e9 == pytest.approx(26.03, abs=0.01)
    r = P.plan(llama13, "H100-SXM", "bf16", "bf16", P.Workload(users=1, context=1024), COURSE)
    p = r["plan"]
    assert (p["accelerators"], p["tp"], p["batch"]) == (1, 1, 1)
    assert p["weights_gb"] + p["kv_gb"] == pytest.approx(26.9, abs=0.05)  # 26.03 GB weights + 0.84 GB KV read
    assert p["step_s"] * 1e3 == pytest.approx(8.0, abs=0.05)  # 26.9 GB / 3.35 TB/s
    assert p["tokens_per_s"] == pytest.approx(125, abs=1)
    assert p["max_batch_memory"] == 64 == max_batch(model_facts(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
        tie_word_embeddings=False)), H100, 1024)  # (80 - 26.0) GB / 0.84 GB per sequence
    # with the server's defaults (90% of memory usable, activations of an 8192-token chunk) fewer fit
    served = P.plan(llama13, "H100-SXM", "bf16", "bf16", P.Workload(users=1, context=1024))["plan"]
    assert 50 <= served["max_batch_memory"] < 64 and served["activations_gb"] == pytest.approx(1.1, abs=0.1)


def test_one_accelerator_step_and_prefill_equal_the_roofline(llama13):
    facts = model_facts(transformers.LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                                 num_hidden_layers=40, num_attention_heads=40,
                                                 tie_word_embeddings=False))
    for batch, context in ((1, 1024), (16, 16), (64, 1024), (1024, 16)):  # memory- and compute-bound steps
        ours = P.step_seconds(llama13, H100, "bf16", "bf16", COURSE, 1, batch, context)
        assert ours == pytest.approx(decode(facts, H100, batch, context)["latency_s"], rel=1e-9)
    ttft = P.ttft_seconds(llama13, H100, "bf16", replace(COURSE, prefill_chunk=4096), 1, 4096)
    assert ttft == pytest.approx(prefill_seconds(facts, H100, 4096), rel=1e-9)
    assert P.ttft_seconds(llama13, H100, "fp8", COURSE, 1, 4096) < 0.55 * ttft  # fp8 compute: about half


def test_grouped_query_attention_enlarges_the_batch_by_about_the_head_ratio(llama13):
    rows = {o["option"]: o for o in P.options(llama13, H100, "bf16", "bf16", P.Workload(1, 1024), COURSE)}
    mha, gqa = rows["this plan: bf16 weights, bf16 KV"], rows["GQA 5:1 (8 KV heads)"]
    assert mha["kv_gb_per_user"] == pytest.approx(5 * gqa["kv_gb_per_user"])
    # the variant's weights equal those of a real 8-KV-head config (fewer k/v projections), so its batch is the
    # roofline's for that config
    real = transformers.LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                    num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                                    tie_word_embeddings=False)
    assert gqa["weight_gb"] * 1e9 == pytest.approx(2 * count_params(real), rel=1e-9)
    variant = next(v for label, _, v in P.variants(llama13) if label == "GQA 5:1 (8 KV heads)")
    assert variant.linears == P.shape_from_config(real).linears  # what int4 stores: the k/v projections shrink
    assert gqa["max_batch"] == max_batch(model_facts(real), H100, 1024) == 341
    assert 5 <= gqa["max_batch"] / mha["max_batch"] < 5.5
    assert rows["MQA (1 KV head)"]["max_batch"] > 35 * mha["max_batch"]
    mla = rows["MLA (latent 512 + 64 per token and layer)"]
    assert mla["kv_gb_per_user"] * 1e9 == pytest.approx(40 * 576 * 2 * 1024)  # DeepSeek-V2's 512 + 64 per layer


def test_the_30b_question_int4_and_int8_kv_halve_the_accelerators_and_ttft_binds_at_500ms(qwen32):
    # Qwen2.5-32B, 100 users x 32k tokens on H100s. At 500 ms no bf16-compute layout prefills 32k tokens in time:
    # TP 8 needs 0.36 s of compute + 0.17 s of all-reduces; int4 weights are read faster but computed in bf16.
    for weights, kv in (("bf16", "bf16"), ("int4", "int8")):
        with pytest.raises(ValueError, match=r"TP 8: TTFT 0\.53\d s .*target 0\.5 s") as err:
            P.plan(qwen32, "H100-SXM", weights, kv, QUESTION)
        assert "weight-only int4 does not speed prefill" in str(err.value)
    free = {wk: P.without_ttft(qwen32, H100, *wk, QUESTION, P.Assumptions()).accelerators
            for wk in (("bf16", "bf16"), ("int4", "int8"))}
    assert free == {("bf16", "bf16"): 16, ("int4", "int8"): 8}
    # a target TP 8 meets: bf16 needs 2 replicas of 8 (59 users fit in 72 GB x 8), int4 + int8 KV one (126 fit)
    relaxed = replace(QUESTION, ttft_s=0.6)
    bf16 = P.plan(qwen32, "H100-SXM", "bf16", "bf16", relaxed, compare=(("int4", "int8"),))
    assert (bf16["plan"]["accelerators"], bf16["plan"]["replicas"], bf16["plan"]["tp"]) == (16, 2, 8)
    row = next(o for o in bf16["options"] if o["option"] == "int4 weights, int8 KV")
    assert (row["accelerators"], row["tp"], row["max_batch"]) == (8, 8, 126)
    # fp8 compute (W8A8 e4m3) meets 500 ms: one replica of TP 8 holds all 100 users with an fp8 KV cache
    fp8 = P.plan(qwen32, "H100-SXM", "fp8", "fp8", QUESTION)
    assert (fp8["plan"]["accelerators"], fp8["plan"]["batch"]) == (8, 100)
    assert fp8["plan"]["ttft_s"] == pytest.approx(0.352, abs=0.002)


def test_sensitivity_reports_the_assumption_that_breaks_the_plan(qwen32):
    r = P.plan(qwen32, "H100-SXM", "fp8", "fp8", QUESTION)
    first = r["breaks_first"]
    assert first["assumption"] == "users" and first["breaks_at"] == 126 and first["accelerators_after"] == 16
    # the reported break point is exact: one user fewer still fits the plan's 8 accelerators
    for users, want in ((125, 8), (126, 16)):
        best, _ = P.search(qwen32, H100, "fp8", "fp8", replace(QUESTION, users=users), P.Assumptions())
        assert best.accelerators == want
    compute = next(s for s in r["sensitivity"] if s["assumption"] == "compute_efficiency")
    assert compute["accelerators_after"] is None  # below ~55% of peak no layout meets the TTFT target
    below = replace(P.Assumptions(), compute_efficiency=compute["breaks_at"])
    above = replace(P.Assumptions(), compute_efficiency=compute["breaks_at"] * 1.01)
    assert P.search(qwen32, H100, "fp8", "fp8", QUESTION, below)[0] is None
    assert P.search(qwen32, H100, "fp8", "fp8", QUESTION, above)[0].accelerators == 8


def _brute_force(shape, weights, kv, work, a, max_tp=8):
    """Fewest accelerators by trying every replica count, memory summed byte by byte."""
    best = None
    for tp in (t for t in P.TP_SIZES if t <= max_tp and shape.heads % t == 0):
        for replicas in range(1, work.users + 1):
            b = math.ceil(work.users / replicas)
            m = P.memory_split(shape, H100, weights, kv, a, tp, work.context)
            fits = m["weights"] + m["activations"] + b * (m["kv_seq"] + m["logits_seq"]) <= m["usable"]
            fast = not work.tokens_per_s or 1 / P.step_seconds(shape, H100, weights, kv, a, tp, b,
                                                               work.context) >= work.tokens_per_s
            ttft = not work.ttft_s or P.ttft_seconds(shape, H100, weights, a, tp, work.prompt) <= work.ttft_s
            if fits and fast and ttft:
                if best is None or replicas * tp < best:
                    best = replicas * tp
                break
    return best


def test_the_search_equals_brute_force_over_a_grid(llama13):
    for users in (1, 7, 40, 150):
        for context in (512, 4096, 16384):
            for tps in (None, 20.0, 60.0):
                for weights, kv in (("bf16", "bf16"), ("int4", "fp8")):
                    work = P.Workload(users, context, ttft_s=1.0, tokens_per_s=tps)
                    best, _ = P.search(llama13, H100, weights, kv, work, P.Assumptions())
                    got = None if best is None else best.accelerators
                    assert got == _brute_force(llama13, weights, kv, work, P.Assumptions()), (users, context, tps)


def test_kv_heads_split_over_tensor_parallel_ranks_and_replicate_below_one_each(llama13):
    assert set(P.LINK_GBS) == set(ACCELERATORS)  # every accelerator has an interconnect for TP > 1
    mqa = replace(llama13, kv_heads=1)
    assert [llama13.cache_width(tp) for tp in (1, 2, 8)] == [2 * 40 * 128, 2 * 20 * 128, 2 * 5 * 128]
    assert [mqa.cache_width(tp) for tp in (1, 8)] == [256, 256]  # one KV head: every rank holds it
    assert P.deploy(P.load_shape("llama-30b"), H100, "bf16", "bf16", P.Workload(1, 1024), P.Assumptions(),
                    8).problem == "52 attention heads do not split over TP 8"


def test_hybrid_local_global_layers_read_from_a_config_and_counted():
    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=32)
    s = P.shape_from_config(cfg, "tiny-gemma3")
    assert (s.local_layers, s.window) == (10, 32)  # 5 local : 1 global
    assert s.cached_tokens(32) == 12 * 32 and s.cached_tokens(1000) == 2 * 1000 + 10 * 32
    full = replace(s, local_layers=0, window=None)
    assert s.prefill_attn_flops(32) == full.prefill_attn_flops(32)  # within the window: no saving
    assert s.prefill_attn_flops(1000) < full.prefill_attn_flops(1000) / 3


def test_bits_per_weight_count_codes_scales_and_zero_points(llama13):
    from compress.core.scheme import W4A16, W4A16_ASYM_G64, W8A16

    assert P.bits_per_weight(None, 5120) == 16
    assert P.bits_per_weight(W4A16, 5120) == 4 + 16 / 128
    assert P.bits_per_weight(W4A16_ASYM_G64, 5120) == 4 + (16 + 4) / 64
    assert P.bits_per_weight(W8A16, 5120) == 8 + 16 / 5120
    assert P.bits_per_weight(W4A16, 576) == 16  # 576 % 128: left bf16, as the quantize stage would
    # int4 g128 blocks + bf16 embedding and head: 12.69B x 4.125 / 8 + 0.33B x 2 bytes
    assert P.weight_bytes(llama13, "int4") / 1e9 == pytest.approx(7.20, abs=0.01)
    assert P.kv_element_bytes("int8", llama13) == 1 + 2 / 128 and P.kv_element_bytes("int4", llama13) == 0.625


def test_inputs_are_validated_with_errors_that_name_the_fix(llama13, tmp_path):
    with pytest.raises(ValueError, match="known: H100-SXM, H200"):
        P.plan(llama13, "TPU-v9", "bf16", "bf16", P.Workload(1, 1024))
    for bad in (dict(users=0, context=1024), dict(users=1, context=-5), dict(users=1, context=1024, ttft_s=0),
                dict(users=1, context=1024, prompt_tokens=2048)):
        with pytest.raises(ValueError, match="users|context|ttft_s|prompt_tokens"):
            P.Workload(**bad)
    with pytest.raises(ValueError, match=r"at batch 1 \(target 2000\)") as err:  # above the roofline at TP 8
        P.plan(llama13, "H100-SXM", "bf16", "bf16", P.Workload(1, 1024, tokens_per_s=2000))
    assert "TP 8: 553.8 tokens/s" in str(err.value) and "--weights int4" in str(err.value)  # 1 ms + 80 all-reduces
    with pytest.raises(ValueError, match="does not fit: .* 24.0 GB usable|weights 26.0"):
        P.plan(llama13, "RTX-4090", "bf16", "bf16", P.Workload(1, 1024), max_tp=1)
    with pytest.raises(ValueError, match="unknown weight scheme 'int5'.*int4"):
        P.plan(llama13, "H100-SXM", "int5", "bf16", P.Workload(1, 1024))
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'fp4'"):
        P.plan(llama13, "H100-SXM", "bf16", "fp4", P.Workload(1, 1024))
    with pytest.raises(ValueError, match="max_tp must be one of"):
        P.plan(llama13, "H100-SXM", "bf16", "bf16", P.Workload(1, 1024), max_tp=3)
    with pytest.raises(ValueError, match="bandwidth_efficiency must be in"):
        P.Assumptions(bandwidth_efficiency=1.5)
    with pytest.raises(ValueError, match="no such file or folder.*llama-2-13b"):
        P.load_shape(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="mixture of experts"):
        P.shape_from_config(transformers.MixtralConfig(num_local_experts=4, num_hidden_layers=1), "moe")


def test_a_local_config_folder_is_read_without_weights(tmp_path):
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    s = P.load_shape(str(tmp_path))
    assert (s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab) == (2, 4, 2, 16, 256)
    assert s.params == 2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 - 2 * 64 * 32 + 2 * 64) + 64


def _parse(argv):
    parser = argparse.ArgumentParser(prog="compress")
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_plans_a_builtin_model_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = _parse(["plan", "llama-2-13b", "--users", "100", "--context", "4096", "--tokens-per-s", "30",
                   "--weights", "int4", "--kv", "fp8", "--compare", "int8:int8", "--output", str(out)])
    assert args.command == "plan" and plan_cmd.run(args) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    p = saved["plan"]
    assert f"PLAN: {p['accelerators']} x H100-SXM" in text and "breaks first:" in text
    assert saved["workload"] == {"users": 100, "context": 4096, "ttft_s": None, "tokens_per_s": 30.0,
                                 "prompt_tokens": None}
    assert p["tokens_per_s"] >= 30 and p["replicas"] * p["batch"] >= 100
    assert any(o["option"] == "int8 weights, int8 KV" for o in saved["options"])
    with pytest.raises(ValueError, match="WEIGHTS:KV"):
        plan_cmd.run(_parse(["plan", "--model", "llama-2-13b", "--users", "1", "--context", "8", "--compare", "int4"]))
    with pytest.raises(ValueError, match="unknown accelerator"):
        plan_cmd.run(_parse(["plan", "llama-2-13b", "--users", "1", "--context", "8", "--accelerator", "TPU-v5e"]))


def test_nvfp4_on_blackwell_counts_e4m3_scales_and_prefills_at_the_fp4_rate():
    from compress.serving.roofline import ACCELERATORS

    b200 = ACCELERATORS["B200"]
    assert P.bits_per_weight(P.weight_scheme("nvfp4"), 4096) == 4.5  # e2m1 + an e4m3 scale per 16
    assert P.bits_per_weight(P.weight_scheme("mxfp4"), 4096) == 4.25  # e2m1 + an e8m0 scale per 32
    assert P.bits_per_weight(P.weight_scheme("mxfp8"), 4096) == 8.25
    assert P.kv_element_bytes("nvfp4", P.builtin_shape("llama-2-13b")) == 0.5625
    assert P.compute_peak(b200, "nvfp4") == 4 * P.compute_peak(b200, "bf16") == 2 * P.compute_peak(b200, "fp8")
    assert P.compute_peak(b200, "nvfp4a16") == P.compute_peak(b200, "bf16")  # weight-only: bf16 matmuls
    assert P.compute_peak(H100, "nvfp4") == P.compute_peak(H100, "fp8")  # Hopper has no fp4 tensor cores
    shape, a = P.builtin_shape("llama-2-13b"), P.Assumptions()
    ttft = {w: P.ttft_seconds(shape, b200, w, a, 1, 4096) for w in ("bf16", "nvfp4")}
    assert ttft["nvfp4"] < ttft["bf16"] / 3  # compute-bound prefill, 4x the peak (minus the weight reads)
