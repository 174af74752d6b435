"""The memory plan: sizes read from a config alone match the published parameter counts; a run that cannot fit is
refused before any weight is read, naming the setting that makes it fit; `compress inspect` plans a model of any
size on the meta device (here a 70B config with no weights at all)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from compress.cli.commands import main
from compress.pipeline.memory_plan import GB, model_size, plan_memory
from compress.recipe import from_dict

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
LLAMA2_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)


def _recipe(threads: int = 0, **eval_):
    return from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 16, "seq_len": 512,
                                                         "threads": threads},
                      "stages": [{"stage": "quantize", "method": "gptq", "scheme": "W4A16"}],
                      "eval": {"seq_len": 2048, **eval_}})


def test_sizes_from_the_config_alone():
    size = model_size(LlamaConfig(**LLAMA2_7B))
    assert size.parameters == 6_738_415_616  # Llama-2-7B's published count
    # one Hessian per distinct input: q/k/v share the attention norm's output, gate/up the MLP norm's
    assert size.hessian_floats == 3 * 4096 ** 2 + 11008 ** 2
    # two GPTQ solves at once: down_proj's (K = 11008) and gate/up's (K = 4096, out 11008), each K² + 2·out·K
    assert size.two_solves == (11008 ** 2 + 2 * 4096 * 11008) + (4096 ** 2 + 2 * 11008 * 4096)
    assert size.block_linear_parameters == 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008)


def test_a_7b_model_at_float32_is_refused_on_24_gb_and_bfloat16_is_the_fix():
    recipe = _recipe()
    plan = plan_memory(recipe, LlamaConfig(**LLAMA2_7B), torch.float32, "cpu", available=int(24 * GB))
    assert plan.phases["load"]["weights"] == 6_738_415_616 * 4
    why = plan.problem(recipe)
    assert why is not None and "model.dtype=bfloat16" in why and "model.check_memory=false" in why
    plan = plan_memory(recipe, LlamaConfig(**LLAMA2_7B), torch.bfloat16, "cpu", available=int(24 * GB))
    assert plan.problem(recipe) is None
    evaluation = plan.phases["evaluation"]  # int4 with group-128 fp16 scales: about a quarter of the bf16 linears
    linear = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008)
    assert evaluation["compressed model"] == (6_738_415_616 - linear) * 2 + int(linear * (0.5 + 2 / 128))
    assert evaluation["baseline copy"] == 6_738_415_616 * 2
    tight = plan_memory(recipe, LlamaConfig(**LLAMA2_7B), torch.bfloat16, "cpu", available=int(16 * GB))
    assert "eval.baseline=false" in tight.problem(recipe)
    assert "baseline copy" not in plan_memory(_recipe(baseline=False), LlamaConfig(**LLAMA2_7B), torch.bfloat16,
                                              "cpu", available=int(16 * GB)).phases["evaluation"]


def test_loading_at_another_dtype_holds_the_largest_shard(tmp_path):
    from compress.pipeline.memory_plan import conversion_bytes
    from compress.model.load import checkpoint_files, load_config
    from tests.conftest import make_tiny_model

    make_tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50KB")
    files = checkpoint_files(str(tmp_path))
    config = load_config(str(tmp_path))
    assert len(files) > 1
    assert conversion_bytes(files, config, torch.float32) == max(f.stat().st_size for f in files)
    assert conversion_bytes(files, config, torch.bfloat16) == 0  # read at its own dtype: mapped, not copied


@pytest.fixture
def llama70b_config_only(tmp_path):
    folder = tmp_path / "llama-70b-config-only"
    LlamaConfig(**LLAMA2_70B).save_pretrained(folder)
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # not one weight
    return folder


def test_run_refuses_a_model_larger_than_the_machine_before_reading_weights(llama70b_config_only, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["run", "recipes/int4_rtn.yaml", "--no-progress", "--set", f"model={llama70b_config_only}",
                 "--set", "model.dtype=bfloat16", "--set", "model.stream=never", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "GB of host memory at its peak" in err and "model.check_memory=false" in err
    assert not out.exists()


def test_a_model_too_large_for_memory_is_streamed_when_the_streamed_plan_fits(llama70b_config_only, tmp_path, capsys):
    """model.stream: auto picks streaming for the 70B config (about 8 GB streamed at bf16 vs 140 GB whole); this
    folder has a config and no weights, so the run then stops when it opens the checkpoint, with that said."""
    out = tmp_path / "out"
    code = main(["run", "recipes/int4_rtn.yaml", "--no-progress", "--set", f"model={llama70b_config_only}",
                 "--set", "model.dtype=bfloat16", "--output", str(out)])
    err = capsys.readouterr().err
    assert "streaming it from disk block by block (model.stream: auto)" in err
    assert "bfloat16, streamed" in err and code == 2 and "model.safetensors" in err
    assert not out.exists()


def test_the_streamed_plan_holds_one_block_not_the_model():
    recipe = _recipe(max_windows=4)
    whole = plan_memory(recipe, LlamaConfig(**LLAMA2_70B), torch.bfloat16, "cpu", available=int(24 * GB))
    streamed = plan_memory(recipe, LlamaConfig(**LLAMA2_70B), torch.bfloat16, "cpu", available=int(24 * GB),
                           streamed=True)
    assert whole.problem(recipe) is not None and streamed.problem(recipe) is None
    passing = streamed.phases["streamed pass"]
    block = 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # one Llama-2-70B block (GQA, 8 KV heads)
    assert passing["one block"] == int(3.5 * block * 2)  # the block at bf16, its copies, the allocator's slack
    assert streamed.phases["embedding or head"]["embedding or head"] == 32000 * 8192 * 2  # one of them at a time
    assert passing["block statistics"] == 4 * (3 * 8192 ** 2 + 28672 ** 2)  # GPTQ's Hessians, float32
    assert passing["evaluation hidden states"] == 2 * 4 * 2048 * 8192 * 2
    # the two largest GPTQ solves (down_proj, K = 28672, and gate/up, K = 8192, at once on two threads): H/n and the
    # weight with its lazy update, float32, between the block's forwards (its weights alone resident then)
    solve = streamed.phases["GPTQ solve"]
    two = 28672 ** 2 + 2 * 8192 * 28672 + 8192 ** 2 + 2 * 28672 * 8192
    assert solve["GPTQ solve"] == 4 * two and solve["one block"] == block * 2
    assert "GPTQ solve" not in passing
    # one thread solves one layer at a time: the largest solve alone, and a peak that fits a 16 GB machine
    one = plan_memory(_recipe(threads=1, max_windows=4), LlamaConfig(**LLAMA2_70B), torch.bfloat16, "cpu",
                      available=int(24 * GB), streamed=True)
    assert one.phases["GPTQ solve"]["GPTQ solve"] == 4 * (28672 ** 2 + 2 * 8192 * 28672)
    assert one.peak[1] < 16 * GB < streamed.peak[1] < 17 * GB  # of a 138 GB model


def test_inspect_plans_a_70b_model_on_the_meta_device(llama70b_config_only, capsys):
    assert main(["inspect", "recipes/int4_rtn.yaml", "--set", f"model={llama70b_config_only}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    layers = report["stages"][0]
    assert len([e for e in layers if e["scheme"]]) == 80 * 7  # every block linear, lm_head ignored
    # the whole model (276 GB at float32 on a CPU) does not fit: `compress run` would stream it, one block at a time
    assert report["streamed"] and "streamed pass" in report["memory_plan"]["phases"]
    assert main(["inspect", "recipes/int4_rtn.yaml", "--set", f"model={llama70b_config_only}", "--set",
                 "model.stream=never", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["streamed"] and report["memory_plan"]["phases"]["load"]["weights"] == 68_976_648_192 * 4


def test_activations_that_do_not_fit_go_to_disk_before_the_model_is_streamed():
    from compress.pipeline.streamed import choose_plan

    recipe = from_dict({"model": {"source": "unused"}, "stages": [{"stage": "quantize", "method": "gptq",
                                                                   "scheme": "W4A16"}],
                        "calibration": {"kind": "wikitext2", "n_samples": 512, "seq_len": 2048},
                        "eval": {"seq_len": 2048, "max_windows": 4}})
    config = LlamaConfig(**LLAMA2_7B)  # 13.5 GB at bf16; 512 x 2048 calibration activations: 25.8 GB
    memory, chosen, stream, notes = choose_plan(recipe, config, torch.bfloat16, "cpu", available=int(24 * GB))
    assert not stream and chosen.calibration.offload == "disk" and "calibration.offload: disk" in notes[0]
    assert memory.problem(chosen) is None and recipe.calibration.offload == "memory"  # the recipe is not changed
    memory, chosen, stream, notes = choose_plan(recipe, config, torch.bfloat16, "cpu", available=int(16 * GB))
    assert stream and chosen.calibration.offload == "disk" and memory.problem(chosen) is None
    assert "streaming" in notes[0] and "offload: disk" in notes[1]
    memory, chosen, stream, _ = choose_plan(recipe, config, torch.bfloat16, "cpu", available=int(1 * GB))
    assert not stream and memory.problem(chosen) is not None  # nothing fits: refused, naming the fixes


def test_mixed_precision_on_a_70b_model_is_planned_block_by_block():
    """auto_precision's sensitivity pass holds one block, every block's input per window and, with GPTQ's errors,
    one block's Hessians and solutions: streamed, a 70B model's pass plans under 22 GB, its largest part being the
    kept states ((80 + 1) blocks × 4 windows × 512 tokens × 8192 × bfloat16, twice with the kept gradients)."""
    from compress.pipeline.streamed import stream_blockers

    stages = [{"stage": "auto_precision", "bytes_of": "W4A16_ASYM_G64", "n_samples": 4, "error_method": "gptq"},
              {"stage": "quantize", "method": "gptq", "scheme": "W4A16_ASYM_G64"}]
    recipe = from_dict({"model": {"source": "unused", "stream": "always"},
                        "calibration": {"kind": "wikitext2", "n_samples": 128, "seq_len": 512}, "stages": stages})
    assert stream_blockers(recipe) == []
    plan = plan_memory(recipe, LlamaConfig(**LLAMA2_70B), torch.bfloat16, "cpu", available=int(24 * GB),
                       streamed=True)
    parts = plan.phases["sensitivity pass"]
    assert parts["kept states"] == 2 * 81 * 4 * 512 * 8192 * 2
    assert 10 * GB < sum(parts.values()) < 24 * GB / 1.1  # the calibration pass, not this one, sets the peak
    resident = plan_memory(recipe, LlamaConfig(**LLAMA2_70B), torch.bfloat16, "cpu", available=int(24 * GB))
    assert resident.phases["sensitivity pass"]["weights"] > 130 * GB
    assert "sensitivity pass" not in plan_memory(_recipe(), LlamaConfig(**LLAMA2_70B), torch.bfloat16, "cpu").phases
    kl = from_dict({"model": {"source": "unused", "stream": "always"},
                    "calibration": {"kind": "wikitext2", "n_samples": 128, "seq_len": 512},
                    "stages": [{**stages[0], "sensitivity": "kl"}, stages[1]]})
    assert any("sensitivity: kl" in why for why in stream_blockers(kl))


def _block_linears(config) -> int:
    from compress.pipeline.memory_plan import model_size
    return model_size(config).block_linear_parameters


def test_a_cuda_run_plans_its_evaluation_on_the_device():
    """A CUDA run evaluates on the GPU (pipeline.on_device): the baseline and the compressed model are both there, so
    the device plan counts them, and a GPU too small for them is refused with the evaluation's own fix. The
    device's free memory is given: no GPU here."""
    recipe = _recipe()
    config = LlamaConfig(**LLAMA2_7B)
    plan = plan_memory(recipe, config, torch.bfloat16, "cuda", available=int(200 * GB),
                       device_available=int(80 * GB))
    host_eval = plan.phases["evaluation"]
    # the quantized layers' dequantized copy (it fits in half the 80 GB) is on the device, not on the host
    assert plan.device_phases["evaluation"] == {**{k: host_eval[k] for k in ("compressed model", "baseline copy",
                                                                              "logits")},
                                                "dequantized weights": _block_linears(config) * 2}
    assert "dequantized weights" not in host_eval
    assert "one block" in plan.device_phases["calibration"] and plan.problem(recipe) is None
    small = plan_memory(recipe, config, torch.bfloat16, "cuda", available=int(200 * GB),
                        device_available=int(16 * GB))
    why = small.problem(recipe)
    assert "(evaluation)" in why and "eval.baseline=false" in why and "cuda" in why
    without = plan_memory(_recipe(baseline=False), config, torch.bfloat16, "cuda", available=int(200 * GB),
                          device_available=int(16 * GB))
    assert "baseline copy" not in without.device_phases["evaluation"] and without.problem(recipe) is None


def test_eora_terms_are_counted_in_the_compressed_model():
    """The eora stage's A [r, in] and B [out, r] per block linear add r · Σ(out + in) values to what is stored."""
    base = _recipe()
    stages = [{"stage": "quantize", "method": "gptq", "scheme": "W4A16"}, {"stage": "eora", "rank": 16}]
    repaired = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 16, "seq_len": 512},
                          "stages": stages, "eval": {"seq_len": 2048}})
    config = LlamaConfig(**LLAMA2_7B)
    sides = 32 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert model_size(config).block_linear_sides == sides
    before, after = (plan_memory(r, config, torch.bfloat16, "cpu", available=int(64 * GB)).phases["evaluation"]
                     for r in (base, repaired))
    assert after["compressed model"] - before["compressed model"] == 16 * sides * 2


def test_allocated_eora_fits_are_counted_while_the_pass_runs():
    """With allocate the fits up to max_rank of every layer are held until the pass ends: max_rank · Σ(out + in)
    values at the run's width, on top of one layer's fit (a Llama-2-7B: rank 8, max_rank 64, bf16: 0.31 GB)."""
    config = LlamaConfig(**LLAMA2_7B)
    sides = model_size(config).block_linear_sides
    kl = {"stage": "kl_hessians"}
    quant = {"stage": "quantize", "method": "gptq", "scheme": {"dtype": "int3", "granularity": "group",
                                                                "group_size": 64, "symmetric": False}}

    def fit(**eora) -> int:
        recipe = from_dict({"model": "unused", "calibration": {"kind": "self", "n_samples": 16, "seq_len": 512},
                            "stages": [kl, quant, {"stage": "eora", "rank": 8, "weighting": "kl", **eora}],
                            "eval": {"seq_len": 2048}})
        return plan_memory(recipe, config, torch.bfloat16, "cpu", available=int(64 * GB)).phases["calibration"][
            "EoRA fit"]

    assert fit(allocate=True) - fit() == 64 * sides * 2
    assert fit(allocate=True, max_rank=16) - fit() == 16 * sides * 2
