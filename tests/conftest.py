"""Shared fixtures: tiny random models of several families (no downloads), seeds, data paths."""
from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin

import pytest
import torch
import transformers

torch.set_num_threads(1)  # two OpenMP threads stall on the 2-core CI machines

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=128),
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=16, sliding_window=128),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "opt": lambda: transformers.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256,
                                          word_embed_proj_dim=64),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=256),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            bos_token_id=0, eos_token_id=0),
}

_MOE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
# mixture-of-experts families: 4 experts of width 32 (gpt-oss: 64), top-2; fused 3-D expert tensors in transformers 5
TINY_MOE_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**_MOE, intermediate_size=32, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_MOE, intermediate_size=96, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=64, num_experts=4,
                                                     num_experts_per_tok=2, decoder_sparse_step=1),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_MOE, intermediate_size=96, moe_intermediate_size=32,
                                                     num_experts=4, num_experts_per_tok=2, head_dim=16),
    "olmoe": lambda: transformers.OlmoeConfig(**_MOE, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(**_MOE, intermediate_size=64, num_local_experts=4,
                                                 num_experts_per_tok=2, head_dim=16, sliding_window=128,
                                                 layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **(_MOE | dict(num_key_value_heads=4)), intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}

_LOCAL_GLOBAL = dict(**_COMMON | dict(num_hidden_layers=2), sliding_window=48,
                     layer_types=["sliding_attention", "full_attention"])
# families whose decoder loop passes each layer its own arguments (transformers 5.25): Gemma 3 and Cohere 2 a mask and
# rotary embedding per layer type (local and global layers), Gemma 4 per-layer inputs too, with its KV-sharing layers
# reading the keys and values an earlier layer of their type wrote; EXAONE 4 a mask per layer type. Local windows of
# 48 tokens: 64-token evaluation windows exceed them; tests set shorter windows where they want the calibration
# windows to exceed them too (each layer then replays with its own mask).
TINY_PER_LAYER_CONFIGS = {
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_LOCAL_GLOBAL, head_dim=16),
    "cohere2": lambda: transformers.Cohere2Config(**_LOCAL_GLOBAL, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "gemma4_text": lambda: transformers.Gemma4TextConfig(**_LOCAL_GLOBAL, head_dim=16, global_head_dim=32,
                                                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
    "gemma4_kv_shared": lambda: transformers.Gemma4TextConfig(
        **(_LOCAL_GLOBAL | dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)),
        head_dim=16, per_layer_config={}, hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
        num_kv_shared_layers=2),  # one head_dim for all layers (per_layer_config={}): a run plans memory by it
    "exaone4": lambda: transformers.Exaone4Config(**_LOCAL_GLOBAL, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


_HYBRID = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_SSM = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=16)
_DELTANET = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
# hybrid and heterogeneous stacks (issue 45 item 4): Mamba layers beside attention (Jamba: of two classes, its MoE
# every other layer; Bamba; Falcon-H1: both in every layer; Nemotron-H: Mamba, attention, MLP and MoE blocks), gated
# DeltaNet linear attention (Qwen3-Next with MoE, Qwen3.5), Kimi Delta Attention beside MLA, Llama 4's experts fed
# stacked rows, a chunked-attention layer (8-token chunks) and a global one without rotary embeddings; 2 layers
# (Nemotron-H: one of each of its 4 kinds), 4 experts
TINY_HYBRID_CONFIGS = {
    "jamba": lambda: transformers.JambaConfig(
        **_HYBRID, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=16),
    "bamba": lambda: transformers.BambaConfig(**_HYBRID, **_SSM, num_hidden_layers=2, attn_layer_indices=[1]),
    "falcon_h1": lambda: transformers.FalconH1Config(**_HYBRID, **_SSM, num_hidden_layers=2, mamba_d_ssm=128),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **_HYBRID, head_dim=16, layers_block_type=["mamba", "attention", "mlp", "moe"], ssm_state_size=8,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16, n_routed_experts=4,
        n_shared_experts=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, num_experts_per_tok=2,
        n_group=1, topk_group=1),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **_HYBRID, **_DELTANET, num_hidden_layers=2, decoder_sparse_step=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**_HYBRID, **_DELTANET, num_hidden_layers=2),
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        **(_HYBRID | dict(num_key_value_heads=4)), num_hidden_layers=2, moe_intermediate_size=32, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, n_group=1,
        topk_group=1, num_experts_per_tok=2, num_local_experts=4, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **_HYBRID, intermediate_size_mlp=128, num_hidden_layers=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layers=[1, 0]),
}


def make_tiny_model(family: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = (TINY_CONFIGS | TINY_MOE_CONFIGS | TINY_PER_LAYER_CONFIGS | TINY_HYBRID_CONFIGS)[family]()
    for k, v in config_overrides.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_llama():
    return make_tiny_model("llama")


def shared_data_dir() -> Path | None:
    from compress.calibrate.data import find_data_dir
    return find_data_dir()


requires_data = pytest.mark.skipif(
    shared_data_dir() is None,
    reason="needs the shared evaluation data (../shared/data or COMPRESS_DATA_DIR); it is not on this machine")


# In CI (CI=true) a skipped test is a failure, except for the one thing CI machines lack: a GPU. A missing package,
# tool or data folder there means the install is wrong, and a skip would hide it.
GPU_SKIP = re.compile(r"\b(GPU|CUDA device|no CUDA|cuda is not available)\b", re.I)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_ci_skip(report) -> None:
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not GPU_SKIP.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI, which must run every test but the GPU ones: {reason}\n"
                           "Install what it needs in .ci/run (or mark the reason as a missing GPU if that is what it is).")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_ci_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # a module-level importorskip skips the whole file at collection
    outcome = yield
    _fail_ci_skip(outcome.get_result())


def tiny_recipe(tmp_path: Path, stages: list[dict], eval_spec: dict, formats: tuple[str, ...] = (),
                out: str = "out") -> Path:
    """A recipe file for `stages` on a saved tiny llama (tmp_path/tiny: word tokenizer; tmp_path/calib.txt: a
    word-text calibration file), writing to tmp_path/`out` and exporting to `formats`; returns its path."""
    import yaml

    from tests.tiny_tokenizer import make_tiny_tokenizer, word_text

    folder = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text(word_text(4096) + "\n")
    recipe = {"model": {"source": str(folder), "dtype": "float32", "device": "cpu"},
              "calibration": {"kind": "files", "files": [str(calib)], "n_samples": 4, "seq_len": 64},
              "stages": stages, "eval": eval_spec, "output": {"dir": str(tmp_path / out), "formats": list(formats)}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path / "recipe.yaml"


def run_tiny_recipe(tmp_path: Path, stages: list[dict], eval_spec: dict, formats: tuple[str, ...] = ()) -> Path:
    """`compress run` of tiny_recipe's recipe; returns the output folder."""
    from compress import load_recipe, run

    run(load_recipe(tiny_recipe(tmp_path, stages, eval_spec, formats)), progress=False)
    return tmp_path / "out"


@pytest.fixture(scope="session")
def card_run_dir(tmp_path_factory) -> Path:
    """One finished tiny run with a compressed-tensors and a gguf-q8_0 export, measured (tests/card_run.py), shared
    by tests/test_card.py and tests/test_push.py."""
    from tests.card_run import card_run
    return card_run(tmp_path_factory.mktemp("card-run"), ("compressed-tensors", "gguf-q8_0"))
