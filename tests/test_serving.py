"""The static-cache decode loop (serving/static_decode.py) takes transformers' greedy tokens on each family it
accepts, with float layers and with QuantLinears on a dispatched kernel; its step is capture-safe by construction
(run under cuda_graph.no_host_sync, which raises on every operation a CUDA graph cannot capture: checked here to
catch each kind); on a machine without CUDA a requested capture fails and the loop decodes eagerly, saying so. The
dispatcher's CUDA timings go through the same capture and fall back to eager calls with the reason."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from compress.arch import get_arch
from compress.measure.speed import _static_speed
from compress.kernels import dispatch
from compress.serving.lean_decode import fuse_projections
from compress.core.scheme import W4A16, FP8_DYNAMIC
from compress.serving import (HostSync, StaticDecoder, capture_problem, greedy_generate, no_host_sync,
                              static_problem)
from compress.kernels.cuda_graph import percentile
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)  # varied, untied logits


def tiny(config_cls, **kw):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**{**SMALL, **kw}), attn_implementation="sdpa").eval()


@torch.no_grad()
def plain_greedy(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n greedy tokens by full forwards over the growing sequence (no cache): the tokens [B, n] and the logits
    that chose each [B, n, V]."""
    seq, logits = ids, []
    for _ in range(n):
        last = model(seq).logits[:, -1]
        logits.append(last)
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
    return seq[:, ids.shape[1]:], torch.stack(logits, 1)


def prompts(batch: int = 2, t: int = 11) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cls", [LlamaConfig, Qwen2Config], ids=["llama", "qwen2"])  # Qwen2: q/k/v biases
def test_greedy_tokens_equal_transformers(cls):
    model = tiny(cls)
    ids = prompts()
    ref, ref_logits = plain_greedy(model, ids, 12)
    assert torch.equal(greedy_generate(model, ids, 12), ref)
    # the logits themselves, through a decoder whose cache is longer than needed (masked slots)
    dec = StaticDecoder(model, 2, 40)
    with torch.no_grad():
        first = dec._forward_prompt(ids, slice(0, 2))
        torch.testing.assert_close(first, ref_logits[:, 0], rtol=1e-4, atol=1e-4)
        dec.prefill(ids)
        logits = dec._forward_token(dec.seq.index_select(1, dec.pos), dec.pos)
    torch.testing.assert_close(logits, ref_logits[:, 1], rtol=1e-4, atol=1e-4)


def test_fused_projections_and_rewind_give_the_same_tokens():
    model = tiny(LlamaConfig)
    ids = prompts()
    ref, _ = plain_greedy(model, ids, 8)
    fuse_projections(model)
    dec = StaticDecoder(model, 2, 24)
    dec.prefill(ids)
    dec.decode(7)
    assert torch.equal(dec.tokens(), ref)
    dec.rewind(ids.shape[1] + 3)  # forget the last 4 steps: the same tokens come again
    dec.decode(4)
    assert torch.equal(dec.tokens(), ref)
    dec.prefill(ids.flip(0))  # a new prefill reuses the decoder (and a captured graph, on CUDA)
    dec.decode(7)
    assert torch.equal(dec.tokens(), ref.flip(0))


def test_quantized_layers_on_a_dispatched_kernel():
    """int4 QuantLinears with a CPU kernel forced on every layer: the loop's tokens are the model's own."""
    model = tiny(LlamaConfig)
    stage = QuantizeStage(scheme=replace(W4A16, group_size=32), ignore=("lm_head",))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    assert dispatch.install_kernel(model, "torch int4pack (CPU, bf16 activations)", torch.float32) == {}
    ids = prompts()
    ref, _ = plain_greedy(model, ids, 6)
    assert torch.equal(greedy_generate(model, ids, 6), ref)
    dec = StaticDecoder(model, 2, 20)
    dec.prefill(ids)
    assert capture_problem(dec.step) is None  # the kernel's launch path is capture-safe too


def test_step_is_capture_safe_and_the_check_catches_each_unsafe_kind():
    model = tiny(Qwen2Config)
    dec = StaticDecoder(model, 2, 24)
    dec.prefill(prompts())
    with no_host_sync():
        dec.step()
        dec.step()
    x = torch.arange(6.0)
    unsafe = {"item": (lambda: x.sum().item(), "_local_scalar_dense"),
              "branch": (lambda: bool(x.max() > 2), "_local_scalar_dense"),
              "nonzero": (lambda: torch.nonzero(x), "nonzero"),
              "bool mask": (lambda: x[x > 2], "boolean mask"),
              "host data": (lambda: torch.tensor([1.0, 2.0]) + x[:2], "host data"),
              "repeat_interleave": (lambda: torch.repeat_interleave(x[:2].long()), "without output_size"),
              "to host": (lambda: torch.zeros(2, device="meta").to("cpu"), "from meta to cpu"),
              "copy between devices": (lambda: x[:2].copy_(torch.zeros(2, device="meta")), "between")}
    with no_host_sync():
        (x * torch.tensor(2.0)).sum()  # a 0-dim host scalar goes by value: capture takes it
    for name, (fn, why) in unsafe.items():
        with pytest.raises(HostSync, match=why):
            with no_host_sync():
                fn()
                pytest.fail(f"{name} was not caught")

    class Syncing(StaticDecoder):  # a step that reads its position on the host: what the check exists for
        def _forward_token(self, tok, pos):
            return super()._forward_token(tok, pos)[:, :int(pos) + 100]

    bad = Syncing(model, 2, 24)
    bad.prefill(prompts())
    assert "_local_scalar_dense" in capture_problem(bad.step)


def test_capture_is_refused_or_fails_into_eager_steps_with_the_reason():
    model = tiny(LlamaConfig)
    ids = prompts()
    ref, _ = plain_greedy(model, ids, 5)
    dec = StaticDecoder(model, 2, 20, graph=True)  # no CUDA here: torch.cuda.Stream() raises in the capture
    dec.prefill(ids)
    dec.decode(4)
    assert dec.mode.startswith("graph capture failed") and dec.mode.endswith("eager steps (static KV cache)")
    assert torch.equal(dec.tokens(), ref)


def test_refusals_and_bounds():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=320))
    assert "gpt2" in static_problem(gpt2, 32)
    assert "rope_type 'dynamic'" in static_problem(tiny(LlamaConfig, rope_scaling={"rope_type": "dynamic",
                                                                                    "factor": 2.0}), 32)
    with pytest.raises(ValueError, match="cannot run this model"):
        StaticDecoder(gpt2, 1, 32)
    dec = StaticDecoder(tiny(LlamaConfig), 2, 16)
    with pytest.raises(ValueError, match="prefill first"):
        dec.decode(1)
    with pytest.raises(ValueError, match=r"batch=2"):
        dec.prefill(prompts(batch=3))
    with pytest.raises(ValueError, match="no room"):
        dec.prefill(prompts(t=16))
    dec.prefill(prompts(t=10))
    with pytest.raises(ValueError, match="exceed max_len"):
        dec.decode(7)
    dec.decode(6)
    assert dec.tokens().shape == (2, 7)


def test_speed_on_the_static_loop_reports_how_it_decoded():
    model = tiny(LlamaConfig)
    r = _static_speed(model, prompts(1, 8), 4, 1, "cpu")
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["decode_ms_p90"] >= r["decode_ms_p50"] > 0
    assert r["decode_mode"] == "eager steps (static KV cache)"
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 90) == 5.0


def test_dispatch_times_on_cuda_fall_back_to_eager_calls_with_the_reason(monkeypatch):
    """No GPU here: torch.cuda.synchronize is replaced by a no-op (the only CUDA call the eager fallback makes);
    the capture itself really runs and really fails, first for a call that syncs, then for lack of CUDA."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    x = torch.arange(4.0)
    notes: list[str] = []
    assert dispatch._time(lambda: x * x.sum().item(), torch.device("cuda"), 3, None, notes) > 0
    assert len(notes) == 1 and "HostSync" in notes[0] and "_local_scalar_dense" in notes[0]
    dispatch._time(lambda: x * 2, torch.device("cuda"), 3, None, notes)
    assert len(notes) == 2 and "HostSync" not in notes[1]  # capture-safe, but no CUDA to capture on


def test_install_kernel_forces_one_kernel_and_lists_what_it_refuses():
    model = tiny(LlamaConfig)
    stage = QuantizeStage(scheme=FP8_DYNAMIC, ignore=("lm_head",))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    left = dispatch.install_kernel(model, "torch int4pack (CPU)", torch.bfloat16)
    assert len(left) == 3 * 7 and all("int4 weight-only" in why for why in left.values())
    with pytest.raises(ValueError, match="registered: torch int4pack"):
        dispatch.install_kernel(model, "no such kernel", torch.bfloat16)


def test_dynamic_fp8_layers_fuse_and_keep_their_tokens():
    """fp8 weights with per-token dynamic activations fuse (q/k/v, gate/up): each token's scale comes from the input
    the fused layers share, so the fused model decodes the same tokens; static activation scales stay apart."""
    from compress.serving.lean_decode import fuse_linears
    from compress.core.nn import QuantLinear

    model = tiny(LlamaConfig)
    stage = QuantizeStage(scheme=FP8_DYNAMIC, ignore=("lm_head",))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    ids = prompts()
    ref = greedy_generate(model, ids, 6)
    assert fuse_projections(model) == []
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert torch.equal(greedy_generate(model, ids, 6), ref)
    static = replace(FP8_DYNAMIC, act=replace(FP8_DYNAMIC.act, granularity="tensor", dynamic=False))
    layers = [QuantLinear(64, 64, static), QuantLinear(64, 64, static)]
    assert fuse_linears(layers) is None
