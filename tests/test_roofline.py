"""The roofline model against the lecture's hand-computed Llama-2-13B figures on an H100, from the config alone."""
from __future__ import annotations

import pytest
import transformers

from compress.serving.roofline import ACCELERATORS, decode, get_accelerator, max_batch, model_facts, prefill_seconds
from tests.conftest import make_tiny_model


def llama2_13b(kv_heads: int = 40) -> transformers.LlamaConfig:
    # meta-llama/Llama-2-13b-hf config.json
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                    num_attention_heads=40, num_key_value_heads=kv_heads,
                                    max_position_embeddings=4096, tie_word_embeddings=False)


def test_llama2_13b_on_h100_matches_the_lecture():
    m = model_facts(llama2_13b())
    assert m.params == 13_015_864_320  # the published 13.0B
    assert m.kv_bytes_per_token() == 2 * 40 * 40 * 128 * 2 == 819_200  # K and V, 40 layers, 5120 wide, bf16
    d = decode(m, ACCELERATORS["H100-SXM"], batch=1, context=1024)
    assert d["bytes_moved"] / 1e9 == pytest.approx(26.9, abs=0.05)  # 26.03 GB weights + 0.84 GB KV cache
    assert d["latency_s"] * 1e3 == pytest.approx(8.0, abs=0.05)  # 26.9 GB / 3.35 TB/s
    assert d["tokens_per_s"] == pytest.approx(125, abs=1)
    assert d["bound"] == "memory" and d["intensity"] < 2 < d["crossover"]  # ~1 FLOP/byte against ~295


def test_grouped_query_attention_fits_a_larger_batch():
    h100 = ACCELERATORS["H100-SXM"]
    mha, gqa = model_facts(llama2_13b()), model_facts(llama2_13b(kv_heads=8))
    assert gqa.kv_bytes_per_token() * 5 == mha.kv_bytes_per_token()
    # (80 GB - 26.0 GB) / (1024 tokens x KV bytes per token); the GQA model has fewer K/V weights too
    assert max_batch(mha, h100, 1024) == 64
    assert max_batch(gqa, h100, 1024) == int((80e9 - gqa.weight_bytes) / (1024 * 163_840))
    assert max_batch(gqa, h100, 1024) > 5 * max_batch(mha, h100, 1024)
    # at a batch the MHA model cannot hold, GQA decodes ~14x more tokens/s than MHA at B=1
    assert decode(gqa, h100, 256, 1024)["tokens_per_s"] > 10 * decode(mha, h100, 1, 1024)["tokens_per_s"]


def test_throughput_grows_with_batch_until_compute_bound():
    m, h100 = model_facts(llama2_13b()), ACCELERATORS["H100-SXM"]
    speeds = [decode(m, h100, b, 16)["tokens_per_s"] for b in (1, 16, 64, 256, 1024)]
    assert speeds == sorted(speeds)
    # short contexts: ~B FLOP per byte of weights passes the ~295 FLOP/byte crossover between 256 and 1024
    assert decode(m, h100, 256, 16)["bound"] == "memory" and decode(m, h100, 1024, 16)["bound"] == "compute"
    # long contexts: every sequence reads its own KV cache, so intensity stays low and decode memory-bound
    assert decode(m, h100, 1024, 1024)["bound"] == "memory"


def test_smaller_weights_decode_faster_in_proportion():
    h100 = ACCELERATORS["H100-SXM"]
    bf16 = model_facts(llama2_13b())
    int4 = model_facts(llama2_13b(), weight_bytes=bf16.weight_bytes // 4)
    ratio = decode(int4, h100, 1, 1)["tokens_per_s"] / decode(bf16, h100, 1, 1)["tokens_per_s"]
    assert ratio == pytest.approx(4, rel=0.01)


def test_prefill_is_compute_bound_and_fp8_halves_it():
    m, h100 = model_facts(llama2_13b()), ACCELERATORS["H100-SXM"]
    t = prefill_seconds(m, h100, 1024)
    assert t == pytest.approx((2 * m.params * 1024 + 2 * 40 * 1024 ** 2 * 5120) / 989.4e12)
    assert prefill_seconds(m, h100, 1024, "fp8") == pytest.approx(t / 2, rel=0.01)
    assert prefill_seconds(m, ACCELERATORS["A100-80GB"], 1024, "fp8") > t  # no fp8 tensor cores: bf16 rate
    assert prefill_seconds(m, h100, 1024, "fp4") == prefill_seconds(m, h100, 1024, "fp8")  # Hopper: no fp4 cores


def test_blackwell_runs_fp4_at_twice_its_fp8_rate_and_others_fall_back():
    b200, h100, a100 = ACCELERATORS["B200"], ACCELERATORS["H100-SXM"], ACCELERATORS["A100-80GB"]
    assert [b200.peak_tflops(c) for c in ("bf16", "fp8", "fp4")] == [2250, 4500, 9000]  # the datasheet, dense
    assert [h100.peak_tflops(c) for c in ("bf16", "fp8", "fp4")] == [989.4, 1978.9, 1978.9]
    assert [a100.peak_tflops(c) for c in ("bf16", "fp8", "fp4")] == [312, 312, 312]
    m = model_facts(llama2_13b())
    assert prefill_seconds(m, b200, 1024, "fp4") == pytest.approx(prefill_seconds(m, b200, 1024, "bf16") / 4)
    # decode at batch 1 is bandwidth-bound: the fp4 rate does not change it, 8 / 3.35 TB/s does
    assert decode(m, b200, 1, 1024, compute="fp4")["latency_s"] == decode(m, b200, 1, 1024)["latency_s"]
    assert decode(m, h100, 1, 1024)["latency_s"] / decode(m, b200, 1, 1024)["latency_s"] == pytest.approx(8 / 3.35)
    with pytest.raises(ValueError, match="bf16, fp8, fp4"):
        b200.peak_tflops("int2")


def test_the_report_roofline_assumes_the_activations_precision():
    from compress.arch import get_arch
    from compress.pipeline.report import matmul_compute
    from dataclasses import replace

    from compress.core.scheme import NVFP4, get_preset
    from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize

    assert matmul_compute(make_tiny_model("llama")) == "bf16"
    nvfp4_dynamic = replace(NVFP4, act=replace(NVFP4.act, dynamic=True))  # a static one needs calibration
    for sch, expected in ((get_preset("NVFP4A16"), "bf16"), (get_preset("FP8_DYNAMIC"), "fp8"),
                          (nvfp4_dynamic, "fp4"), (get_preset("MXFP4"), "fp4"), (get_preset("W4A4_INT"), "fp8")):
        model = make_tiny_model("llama")
        stage = QuantizeStage(scheme=sch)
        apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
        assert matmul_compute(model) == expected, sch


def test_unknown_accelerator_names_the_known_ones():
    with pytest.raises(ValueError, match="H100-SXM"):
        get_accelerator("TPU-v9")


def test_weights_that_do_not_fit_give_no_batch():
    assert max_batch(model_facts(llama2_13b()), ACCELERATORS["RTX-4090"], 1024) == 0  # 26 GB > 24 GB


def test_serving_bytes_count_floats_at_bf16_and_quantized_layers_as_stored():
    from compress.arch import get_arch
    from compress.measure.memory import serving_bytes
    from compress.core.nn import QuantLinear
    from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
    from compress.core.scheme import scheme
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama")  # float32 in memory, tied embedding counted once
    n_params = sum(p.numel() for p in model.parameters())
    assert serving_bytes(model) == 2 * n_params
    stage = QuantizeStage(scheme=scheme("int4", "group", 16))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    floats = sum(p.numel() for p in model.parameters())
    assert serving_bytes(model) == 2 * floats + sum(m.qtensor().nbytes for m in quant)


def test_pareto_frontier_keeps_exactly_the_undominated_runs():
    from compress.measure.pareto import frontier
    rows = [{"run": "a", "weight_bytes": 100, "ppl": 20.0}, {"run": "b", "weight_bytes": 50, "ppl": 22.0},
            {"run": "c", "weight_bytes": 60, "ppl": 23.0},  # dominated by b: bigger and worse
            {"run": "d", "weight_bytes": 30, "ppl": 30.0}, {"run": "e", "weight_bytes": 100, "ppl": 21.0},  # e: by a
            {"run": "f", "weight_bytes": None, "ppl": 1.0}]  # not measured: not plotted
    assert frontier(rows, "weight_bytes", higher_x_better=False) == ["a", "b", "d"]
    speed = [{"run": "x", "decode_tok_s": 10.0, "ppl": 20.0}, {"run": "y", "decode_tok_s": 30.0, "ppl": 25.0},
             {"run": "z", "decode_tok_s": 20.0, "ppl": 26.0}]
    assert frontier(speed, "decode_tok_s", higher_x_better=True) == ["x", "y"]


def test_a_head_dim_per_layer_is_averaged_not_refused():
    """Gemma 4's global layers have their own head_dim (32 against 16 here), which transformers refuses to read from
    the config as one value: the facts use the mean over the layers, so the KV bytes per token are the model's."""
    from compress.serving.roofline import attention_dims

    config = make_tiny_model("gemma4_text").config
    assert [c.head_dim for c in config.per_layer_config] == [16, 32]
    assert attention_dims(config) == (24, 2)
    m = model_facts(config, params=1000)
    assert m.kv_bytes_per_token(2) == 2 * 2 * (16 + 32) * 2  # K and V, 2 KV heads, both layers, 2 bytes
