"""The `mlx` export (mlx-lm's affine layout), checked against a bit-stream unpacker written here from MLX's layout
(not from compress.export.mlx):

    weight [N, K * b / 32] uint32: row n is one little-endian bit stream, code k at bits b*k .. b*k + b - 1, bit i of
    the stream is bit i % 32 of word i // 32; scales, biases [N, K / G]; w = scales * q + biases.

Fast: packing for every bit width MLX takes, exact round trips of our asymmetric and symmetric codes, refusals by
layer name, mlx-lm's `quantization` config entry (mixed precision, float layers), the reader `compress verify` uses,
the registries. Slow (where mlx-lm's interpreter is found: COMPRESS_MLX_PYTHON, or mlx_lm importable here): our
packing against `mx.quantize` / `mx.dequantize` themselves, and mlx-lm serving a tiny model's export.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from compress.core.nn import QuantLinear
from compress.core.scheme import FP8_DYNAMIC, MXFP4A16, W8A8, W8A16, scheme
from compress.engines import EngineUnavailable, get_engine
from compress.engines import mlx as mlx_engine
from compress.export import EXPORTERS, FORMAT_NAMES, ExportError, export_model
from compress.export.mlx import MLX_BITS, mlx_dequantize, mlx_tensors, pack_mlx, problems, unpack_mlx
from compress.export.verify import compare_logits, model_logits, verify_export
from compress.quantizers.rtn import quantize_rtn
from tests.conftest import make_tiny_model
from tests.tiny_tokenizer import byte_bpe_tokenizer

WINDOWS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
INT = {2: "int2", 3: "int3", 4: "int4", 5: "int5", 6: "int6", 8: "int8"}


# ------------------------------------------------------------------ the reference, from the layout

def reference_words(u: torch.Tensor, bits: int) -> list[list[int]]:
    """Each row's codes as one Python integer bit stream, cut into 32-bit words (unsigned)."""
    out = []
    for row in u.tolist():
        stream = sum(int(c) << (bits * k) for k, c in enumerate(row))
        out.append([(stream >> (32 * j)) & 0xFFFFFFFF for j in range(len(row) * bits // 32)])
    return out


def reference_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 words [N, W] -> codes [N, 32 W / b], reading each row's stream bit by bit."""
    rows = []
    for row in (words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist():
        stream = sum(int(w) << (32 * j) for j, w in enumerate(row))
        rows.append([(stream >> (bits * k)) & ((1 << bits) - 1) for k in range(len(row) * 32 // bits)])
    return torch.tensor(rows, dtype=torch.int64)


def as_unsigned(words: torch.Tensor) -> list[list[int]]:
    return (words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()


def quantize_layers(model, choose) -> torch.nn.Module:
    """Replace each decoder Linear with QuantLinear(RTN) under the scheme `choose(name)` gives (None: float)."""
    for name, module in list(model.named_modules()):
        for child, linear in list(module.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(linear, torch.nn.Linear) and child != "lm_head" and (s := choose(full)) is not None:
                setattr(module, child, QuantLinear.from_module(linear, quantize_rtn(linear.weight.detach(), s)))
    return model


# ------------------------------------------------------------------ packing and round trips

@pytest.mark.parametrize("bits", MLX_BITS)
def test_packing_is_each_rows_little_endian_bit_stream(bits):
    u = torch.randint(0, 2 ** bits, (3, 64), generator=torch.Generator().manual_seed(bits))
    words = pack_mlx(u, bits)
    assert words.dtype == torch.uint32 and tuple(words.shape) == (3, 64 * bits // 32)
    assert as_unsigned(words) == reference_words(u, bits)
    assert torch.equal(reference_codes(words, bits), u) and torch.equal(unpack_mlx(words, bits), u)


@pytest.mark.parametrize("bits", MLX_BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_our_codes_round_trip_exactly(bits, symmetric):
    """Codes, scales and biases (-scale * zero) in float32 hold our grid bit for bit: the reference dequantization
    scales * q + biases equals ours exactly."""
    s = scheme(INT[bits], "group", 32, symmetric=symmetric)
    qt = quantize_rtn(torch.randn(16, 128, generator=torch.Generator().manual_seed(7)), s)
    t = mlx_tensors(qt, torch.float32)
    q = reference_codes(t["weight"], bits)
    assert torch.equal(q, (qt.codes() - s.qmin).to(torch.int64))
    zero = qt.zero_point.float() if qt.zero_point is not None else torch.full_like(qt.scale.float(), 2 ** (bits - 1))
    assert torch.equal(t["scales"], qt.scale.float()) and torch.equal(t["biases"], -qt.scale.float() * zero)
    groups = lambda x: x.repeat_interleave(32, 1)  # noqa: E731
    assert torch.equal(q.float() * groups(t["scales"]) + groups(t["biases"]), qt.dequantize())
    assert torch.equal(mlx_dequantize(t["weight"], t["scales"], t["biases"], bits), qt.dequantize())


def test_float16_biases_are_exact_for_symmetric_grids_and_close_for_asymmetric_ones():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    sym = quantize_rtn(w, scheme("int4", "group", 64))
    assert torch.equal(mlx_dequantize(**mlx_tensors(sym), bits=4), sym.dequantize())  # -8 s: a power of two
    asym = quantize_rtn(w, scheme("int4", "group", 64, symmetric=False))
    step = asym.scale.float().repeat_interleave(64, 1)
    off = (mlx_dequantize(**mlx_tensors(asym), bits=4) - asym.dequantize()).abs() / step
    assert 0 < float(off.max()) < 15 * 2 ** -11  # z <= 15: -s z rounded to 11 bits


def test_fractional_zero_points_map_onto_biases():
    """HQQ's float16 zero points are still w = s * u - s * z: MLX's biases hold them."""
    s = replace(scheme("int4", "group", 64, symmetric=False), zero_point_dtype="float16")
    qt = quantize_rtn(torch.randn(8, 128, generator=torch.Generator().manual_seed(4)), s)
    qt.zero_point = (qt.zero_point.float() + 0.25).half()  # off the integer grid
    got = mlx_dequantize(**mlx_tensors(qt, torch.float32), bits=4)
    assert torch.allclose(got, qt.dequantize(), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ refusals

def test_problems_refuse_by_layer_name_with_the_fix():
    fixes = {"q_proj": FP8_DYNAMIC, "k_proj": MXFP4A16, "v_proj": W8A8, "o_proj": W8A16,
             "gate_proj": scheme("int4", "group", 16), "up_proj": scheme("int7", "group", 32),
             "down_proj": scheme("int4", "group", 128)}  # down_proj: in_features 128 / 128 fine; see below
    model = quantize_layers(make_tiny_model("llama"), lambda n: fixes[n.rsplit(".", 1)[-1]] if ".0." in n else None)
    model.model.layers[1].self_attn.q_proj = QuantLinear.from_module(
        model.model.layers[1].self_attn.q_proj,
        quantize_rtn(model.model.layers[1].self_attn.q_proj.weight.detach(), scheme("int4", "group", 64)))
    found = problems(model)
    text = "\n".join(found)
    expect = {"model.layers.0.self_attn.q_proj": "quantize to an integer scheme",
              "model.layers.0.self_attn.k_proj": "microscaled values (MXFP4)",
              "model.layers.0.self_attn.v_proj": "act: null",
              "model.layers.0.self_attn.o_proj": "set granularity: group, group_size: 64",
              "model.layers.0.mlp.gate_proj": "set group_size: 64",
              "model.layers.0.mlp.up_proj": "use dtype: int6 or int8"}
    for name, fix in expect.items():
        assert any(line.startswith(name + " (") and fix in line for line in found), (name, text)
    assert len(found) == len(expect), text  # down_proj (int4 g128 on 128 inputs) and the int4 g64 layer are fine


def test_a_refused_model_is_refused_before_anything_is_written(tmp_path):
    model = quantize_layers(make_tiny_model("llama"), lambda n: W8A16)
    with pytest.raises(ExportError, match=r"cannot export to mlx:\n  model.layers.0.self_attn.q_proj \(int8-channel"):
        export_model(model, byte_bpe_tokenizer(), "mlx", tmp_path / "mlx")
    assert not (tmp_path / "mlx").exists()


# ------------------------------------------------------------------ config, names, reader

ROPE = {"rope_theta": 100000.0, "rope_type": "default"}  # SmolLM2's base, not mlx-lm's default 10000


def mixed_model():
    """int4 g32 asym mostly, int8 g64 sym in the MLPs' down_proj, layer 1's o_proj left in float; SmolLM2's rotary
    base, which transformers 5 writes only inside rope_parameters."""
    def choose(name):
        if name.endswith("layers.1.self_attn.o_proj"):
            return None
        if name.endswith("down_proj"):
            return scheme("int8", "group", 64)
        return scheme("int4", "group", 32, symmetric=False)
    model = make_tiny_model("llama", rope_parameters=dict(ROPE))
    with torch.no_grad():  # sharp attention, so that the rotary base shows in the logits (random weights: flat)
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(6)
            block.self_attn.k_proj.weight.mul_(6)
    return quantize_layers(model, choose)


def test_config_entry_names_and_mixed_precision(tmp_path):
    model = mixed_model()
    out = tmp_path / "mlx"
    record = export_model(model, byte_bpe_tokenizer(), "mlx", out)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {
        "group_size": 32, "bits": 4,
        "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
        "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8}}
    assert record["format"] == "mlx" and record["quantization"] == config["quantization"]
    assert config["rope_theta"] == 100000.0 and "rope_scaling" not in config  # what mlx-lm's llama reads
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        floated = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
        scales = f.get_tensor("model.layers.0.self_attn.q_proj.scales")
    assert q.dtype == torch.uint32 and tuple(q.shape) == (64, 64 * 4 // 32)
    assert down.dtype == torch.uint32 and tuple(down.shape) == (64, 128 * 8 // 32)
    assert floated.dtype == torch.float16 and tuple(floated.shape) == (64, 64)
    assert scales.dtype == torch.float16 and tuple(scales.shape) == (64, 2)
    assert "model.layers.1.self_attn.o_proj.scales" not in names and "lm_head.weight" not in names  # tied
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.biases"} <= names
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    result = verify_export(out, model, WINDOWS)  # the reader: scales * q + biases into a transformers model
    assert result["kl"] < 1e-4 and result["top1_agreement"] == 1.0, result


def test_registries_name_the_format_and_the_engine(monkeypatch, tmp_path):
    from compress.cli.commands import EPILOG_EXPORT

    assert "mlx" in FORMAT_NAMES and EXPORTERS["mlx"].loaders == "mlx-lm (Apple silicon; mlx-cpu on Linux)"
    assert "\n  mlx " in EPILOG_EXPORT
    engine = get_engine("mlx")
    assert engine.formats("mlx") is None and "--format mlx" in engine.formats("awq")
    monkeypatch.setenv("COMPRESS_MLX_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(EngineUnavailable, match="--engine-python"):
        mlx_engine.interpreter()


# ------------------------------------------------------------------ the real library (slow)

def _mlx_python() -> str:
    try:
        return mlx_engine.interpreter()
    except EngineUnavailable as exc:
        pytest.skip(f"mlx-lm is not installed here (set COMPRESS_MLX_PYTHON to its interpreter): {exc}")


MX_SCRIPT = """
import sys, numpy as np, mlx.core as mx
d = dict(np.load(sys.argv[1]))
out = {}
for bits in (2, 3, 4, 5, 6, 8):
    for g in (32, 64, 128):
        wq, s, b = mx.quantize(mx.array(d["w"]), group_size=g, bits=bits)
        out[f"wq{bits}_{g}"], out[f"s{bits}_{g}"], out[f"b{bits}_{g}"] = np.array(wq), np.array(s), np.array(b)
        ours = mx.dequantize(mx.array(d[f"ours{bits}_{g}"]), mx.array(d[f"os{bits}_{g}"]),
                             mx.array(d[f"ob{bits}_{g}"]), group_size=g, bits=bits)
        out[f"deq{bits}_{g}"] = np.array(ours)
np.savez(sys.argv[2], **out)
"""


@pytest.mark.slow
def test_packing_agrees_with_mx_quantize_and_dequantize(tmp_path):
    """mx.quantize's words are our pack_mlx of its own codes, and mx.dequantize reads our tensors as we do."""
    python = _mlx_python()
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    ours = {"w": w.numpy()}
    for bits in MLX_BITS:
        for g in (32, 64, 128):
            qt = quantize_rtn(w, scheme(INT[bits], "group", g, symmetric=bits % 2 == 0))
            t = mlx_tensors(qt, torch.float32)
            ours[f"ours{bits}_{g}"] = t["weight"].view(torch.int32).numpy().view(np.uint32)
            ours[f"os{bits}_{g}"], ours[f"ob{bits}_{g}"] = t["scales"].numpy(), t["biases"].numpy()
            ours[f"ref{bits}_{g}"] = qt.dequantize().numpy()
    np.savez(tmp_path / "in.npz", **ours)
    subprocess.run([python, "-c", MX_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], check=True)
    got = dict(np.load(tmp_path / "out.npz"))
    for bits in MLX_BITS:
        for g in (32, 64, 128):
            words = torch.from_numpy(got[f"wq{bits}_{g}"].view(np.int32)).view(torch.uint32)
            codes = unpack_mlx(words, bits)
            assert int(codes.max()) < 2 ** bits
            assert as_unsigned(pack_mlx(codes, bits)) == as_unsigned(words), (bits, g)
            assert torch.equal(reference_codes(words, bits), codes)
            assert np.array_equal(got[f"deq{bits}_{g}"], ours[f"ref{bits}_{g}"]), (bits, g)


@pytest.mark.slow
def test_mlx_lm_serves_the_export_of_a_tiny_model(tmp_path):
    """mlx_lm.load reads a mixed export (int4 g32 asym, int8 g64, a float layer) and, computing in float32, gives our
    model's next-token distribution: the same top-1 everywhere, KL under 1e-5 (the float16 float tensors and
    biases are all that differ); its quantized layers are the ones we wrote."""
    python = _mlx_python()
    model = mixed_model()
    out = tmp_path / "mlx"
    export_model(model, byte_bpe_tokenizer(), "mlx", out)
    from compress.engines.check import engine_check
    result = engine_check(out, model, WINDOWS, [[5, 6, 7]], "mlx", max_new_tokens=6, dtype="float32", python=python)
    assert result["loads"], result["error"]
    assert result["kernels"] == ["QuantizedLinear affine 4-bit g32 x11", "QuantizedLinear affine 8-bit g64 x2"]
    assert result["top1_agreement"] == 1.0 and result["mean_abs_dlogp"] < 1e-3 and result["greedy_match"] == [6]
    ours = model_logits(model, WINDOWS)
    kl = [compare_logits(ours[i], logits)["kl"]
          for i, logits in enumerate(mlx_engine.iter_mlx_logits(out, WINDOWS, "float32", python))]
    assert len(kl) == 2 and max(kl) < 1e-5, kl
