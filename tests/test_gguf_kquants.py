"""K-quant blocks (Q4_K, Q5_K, Q6_K) and the Q5_0 / Q5_1 fallbacks: our byte layouts decoded by gguf-py, our
quantizers against llama.cpp's C ggml_quantize_chunk, byte for byte."""
from __future__ import annotations

import numpy as np
import pytest

from compress.export import gguf_kquants as kq
from tests.conftest import requires_data

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

from compress.export.ggml_reference import ggml_quantize  # noqa: E402

KINDS = ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]


def random_fields(kind: str, n: int, rng) -> dict:
    """Random values for every field of n blocks, over each field's whole range."""
    d = (rng.standard_normal(n) * 0.01).astype(np.float16).astype(np.float32)
    if kind in ("Q4_K", "Q5_K"):
        return {"d": np.abs(d), "dmin": np.abs(d[::-1]).copy(), "sc": rng.integers(0, 64, (n, 8)),
                "m": rng.integers(0, 64, (n, 8)), "q": rng.integers(0, 16 if kind == "Q4_K" else 32, (n, 256))}
    if kind == "Q6_K":
        return {"d": d, "sc": rng.integers(-128, 128, (n, 16)), "q": rng.integers(0, 64, (n, 256))}
    fields = {"d": d, "q": rng.integers(0, 32, (n, 32))}
    if kind == "Q5_1":
        fields["m"] = d[::-1].copy()
    return fields


def pack(kind: str, f: dict) -> np.ndarray:
    if kind == "Q4_K":
        return kq.pack_q4_k(f["d"], f["dmin"], f["sc"], f["m"], f["q"])
    if kind == "Q5_K":
        return kq.pack_q5_k(f["d"], f["dmin"], f["sc"], f["m"], f["q"])
    if kind == "Q6_K":
        return kq.pack_q6_k(f["d"], f["sc"], f["q"])
    if kind == "Q5_0":
        return kq.pack_q5_0(f["d"], f["q"])
    return kq.pack_q5_1(f["d"], f["m"], f["q"])


def sample_data(rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed weights with the rows that hit the quantizers' edge cases, and an imatrix with zeros."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, (rows, cols)) * 0.01).astype(np.float32)
    w[1] = 0  # all-zero blocks: scale 0
    w[2] = 0.5  # constant: max == min
    w[3] = np.abs(w[3])  # min > 0: the fit's min is clamped to 0
    w[4] = -np.abs(w[4])
    w[5, : cols // 2] = -1e-3
    imatrix = rng.exponential(1.0, cols).astype(np.float32)
    imatrix[:40] = 0  # columns never active in calibration
    return w, imatrix


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_decode_through_gguf_py_exactly_as_ours(kind):
    """pack_* bytes -> gguf-py's decoder == our decoder, bit for bit; unpack(pack(fields)) == fields. 7 rows (odd)
    of 2 super-blocks (K-quants) or 18 blocks (Q5_0 / Q5_1: SmolLM2's 576 columns)."""
    rng = np.random.default_rng(0)
    rows, cols = 7, 512 if kind.endswith("_K") else 576
    n = rows * cols // kq.BLOCK_WEIGHTS[kind]
    fields = random_fields(kind, n, rng)
    raw = pack(kind, fields).reshape(rows, -1)
    assert raw.shape == (rows, n // rows * kq.BLOCK_BYTES[kind])
    theirs = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(rows, cols)
    ours = kq.dequantize(raw, kind, (rows, cols))
    assert np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # bitwise, -0.0 included
    back = kq.unpack(raw, kind)
    for name, value in fields.items():
        want = value.astype(np.float32) if value.dtype.kind == "f" else value
        assert np.array_equal(back[name], want), name


@pytest.mark.parametrize("imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_bytes_equal_ggml_quantize_chunk(kind, imatrix):
    """Our numpy port of ggml-quants.c (make_qkx2/qkx3/qx/qp_quants, the ref and imatrix row quantizers) writes
    the very bytes of llama.cpp's C ggml_quantize_chunk: every block identical (measured 100% on these and on
    SmolLM2's weights; sums follow the C loops' order)."""
    cols = 768 if kind.endswith("_K") else 576
    w, im = sample_data(37, cols)
    im = im if imatrix else None
    ours = kq.quantize(w, kind, im)
    ref = ggml_quantize(w, kind, im)
    assert ours.shape == ref.shape
    same = (ours.reshape(-1, kq.BLOCK_BYTES[kind]) == ref.reshape(-1, kq.BLOCK_BYTES[kind])).all(-1)
    assert same.all(), f"{int((~same).sum())} of {same.size} blocks differ"


def test_imatrix_lowers_the_weighted_error():
    """With the importance matrix the weighted squared error (what llama.cpp minimises) is lower than without."""
    w, im = sample_data(64, 512, seed=3)
    im = im ** 2  # a few dominant columns, as real activations have
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        err = {}
        for name, qw in (("plain", None), ("imatrix", im)):
            deq = kq.dequantize(kq.quantize(w, kind, qw), kind, w.shape)
            err[name] = float((((deq - w) ** 2) * im).sum())
        assert err["imatrix"] < 0.9 * err["plain"], (kind, err)


def test_rows_that_are_not_whole_super_blocks_are_refused():
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks .* falls back to Q5_0"):
        kq.quantize(np.zeros((2, 576), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="imatrix has 10 values for rows of 256"):
        kq.quantize(np.zeros((2, 256), np.float32), "Q6_K", np.ones(10, np.float32))


# ---------------------------------------------------------------- the K-quant export formats

def kquant_model(layers: int = 8, tied: bool = False, seed: int = 0):
    """A random Llama whose hidden size (256) is one super-block and whose MLP width (320) is not, weights rounded
    to fp16 (what llama-quantize reads from an F16 file)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=320,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def llama_quantize(src, dst, ftype: int) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


@pytest.mark.parametrize("fmt, ftype", [("q4_k_m", 15), ("q5_k_m", 17), ("q6_k", 18)])
def test_k_mix_equals_llama_quantize_tensor_for_tensor(tmp_path, fmt, ftype):
    """Our gguf-<fmt> file and llama-quantize's (llama.cpp bundled with llama-cpp-python, run on our F16 file of the
    same weights) hold the same type for every tensor (the _M rules: attn_v / ffn_down Q6_K in the use_more_bits
    layers, output Q6_K, ...; ffn_down's 320-wide rows fall back to Q5_0 / Q5_1 / Q8_0) and the same bytes."""
    from compress.export.gguf import write_gguf
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model, tok = kquant_model(), byte_bpe_tokenizer()
    write_gguf(model, tok, tmp_path / "f16.gguf", "f16")
    llama_quantize(tmp_path / "f16.gguf", tmp_path / "ref.gguf", ftype)
    report = write_gguf(model, tok, tmp_path / "ours.gguf", fmt)
    ours = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "ours.gguf")).tensors}
    ref = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "ref.gguf")).tensors}
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.array(ours[name].data), np.array(t.data)), name
    downs = {i: report["tensors"][f"blk.{i}.ffn_down.weight"] for i in range(8)}
    assert all(d["type"] == {"q4_k_m": "Q5_0", "q5_k_m": "Q5_1", "q6_k": "Q8_0"}[fmt] or
               (fmt != "q6_k" and d["type"] == "Q8_0") for d in downs.values())
    assert all("not divisible by 256" in d["fallback"] for d in downs.values())
    if fmt == "q4_k_m":  # use_more_bits(i, 8): layers 0, 3, 6, 7
        assert [report["tensors"][f"blk.{i}.attn_v.weight"]["type"] for i in range(8)] == \
            ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
        assert report["tensors"]["output.weight"]["type"] == "Q6_K"
        assert report["tensors"]["token_embd.weight"]["type"] == "Q4_K"


def decoded_weights(model, path) -> dict:
    """{GGUF name: float32 weight} of every 2-D tensor of file `path` as gguf-py decodes it, q / k rows put back
    in transformers' order."""
    import torch

    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists ne0 (columns) first
        w = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(shape).copy()).float()
        n = heads.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if n:  # llama.cpp's interleaved rotary pairs back to transformers' halves
            w = w.reshape(n, shape[0] // n // 2, 2, shape[1]).transpose(1, 2).reshape(shape)
        out[t.name] = w
    return out


def decoded_model(model, path):
    """A copy of float `model` holding the weights of GGUF file `path` as gguf-py decodes them."""
    import copy

    import torch

    from compress.export.gguf import LINEARS

    out = copy.deepcopy(model)
    weights = decoded_weights(model, path)
    with torch.no_grad():
        out.get_input_embeddings().weight.copy_(weights["token_embd.weight"])
        for i, layer in enumerate(out.model.layers):
            for hf, gg in LINEARS.items():
                layer.get_submodule(hf).weight.copy_(weights[f"blk.{i}.{gg}.weight"])
    return out


@pytest.mark.parametrize("fmt", ["q6_k", "q5_k_m", "q4_k_m"])
def test_k_quant_file_runs_in_llama_cpp(tmp_path, fmt):
    """llama.cpp runs the file as the weights we wrote: its logits against transformers running those decoded
    weights differ by llama.cpp's 8-bit activation blocks only (Q8_0 of the same float model: 0.016)."""
    import torch

    from compress.export.gguf import write_gguf
    from compress.export.gguf_llama_cpp import llama_cpp_logits
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model = kquant_model(layers=2, tied=True)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    path = tmp_path / f"{fmt}.gguf"
    write_gguf(model, byte_bpe_tokenizer(), path, fmt)
    with torch.no_grad():
        ref = decoded_model(model, path)(input_ids=ids, use_cache=False).logits.float()
    out = llama_cpp_logits(path, ids)
    rel = float((out - ref).norm() / ref.norm())
    assert rel < 0.04, rel  # measured 0.013 for each format
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.97


def test_int4_codes_go_exactly_into_the_32_weight_fallback_types(tmp_path):
    """int4 g32 layers whose rows are not super-blocks (64 columns) take llama.cpp's fallback types, which hold our
    grid: symmetric codes into Q5_0 (and Q8_0 where the mix asks for Q6_K), bit for bit."""
    import torch

    from compress.arch import get_arch
    from compress.export.gguf import LINEARS, write_gguf
    from compress.core.scheme import scheme
    from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
    from tests.conftest import make_tiny_model
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model = make_tiny_model("llama")
    stage = QuantizeStage(scheme=scheme("int4", "group", 32))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "q4_k_m")
    decoded = decoded_weights(model, tmp_path / "m.gguf")
    for i in range(2):
        for hf, gg in LINEARS.items():
            entry = report["tensors"][f"blk.{i}.{gg}.weight"]
            assert entry["path"] == "exact" and entry["type"] in ("Q5_0", "Q8_0") and "fallback" in entry
            ours = model.model.layers[i].get_submodule(hf).qtensor().dequantize(torch.float32)
            assert torch.equal(decoded[f"blk.{i}.{gg}.weight"], ours), (i, hf)
    # use_more_bits(i, 2) holds for layer 1 only: its attn_v is Q6_K -> Q8_0, layer 0's Q4_K -> Q5_0
    assert [report["tensors"][f"blk.{i}.attn_v.weight"]["type"] for i in range(2)] == ["Q5_0", "Q8_0"]


@pytest.fixture(scope="module")
def calibrated():
    """A float K-quant-shaped model and its calibration statistics on 4 random windows of 64 tokens."""
    import torch

    from compress.export.gguf_calib import calibration_stats

    model = kquant_model(layers=2, tied=True)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    imatrix, hessians = calibration_stats(model, ids, hessians=True)
    return model, imatrix, hessians


def test_int4_layers_on_k_grids_are_requantized_with_the_imatrix(tmp_path, calibrated):
    """Our int4 g32 scales are not on Q4_K's 6-bit super-block grid: such a layer is dequantized and quantized
    again by llama.cpp's imatrix quantizer (bytes equal ggml_quantize_chunk's with the same imatrix)."""
    import copy

    import torch

    from compress.arch import get_arch
    from compress.export.gguf import write_gguf
    from compress.core.scheme import scheme
    from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model, imatrix, _ = calibrated
    model = copy.deepcopy(model)
    stage = QuantizeStage(scheme=scheme("int4", "group", 32, symmetric=False))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "q4_k_m", imatrix=imatrix)
    entry = report["tensors"]["blk.0.attn_output.weight"]
    assert (entry["path"], entry["type"], entry["method"]) == ("requantized", "Q4_K", "imatrix")
    assert "not on that grid" in entry["reason"]
    w = model.model.layers[0].self_attn.o_proj.qtensor().dequantize(torch.float32).numpy()
    expect = ggml_quantize(w, "Q4_K", imatrix["model.layers.0.self_attn.o_proj"].numpy())
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert np.array_equal(np.array(stored["blk.0.attn_output.weight"].data), expect)
    assert report["tensors"]["blk.0.ffn_down.weight"]["fallback"]  # 320 columns: Q5_0 / Q8_0, exact or not


def test_gptq_on_the_gguf_grid_keeps_the_grid_and_lowers_the_layer_loss(tmp_path, calibrated):
    """With Hessians the codes come from GPTQ on the grid llama.cpp's imatrix quantizer chose: d, dmin and the
    6-bit sub-block scales are that quantizer's, only codes move, and the calibration loss tr(E H E^T) drops."""
    import torch

    from compress.export.gguf import write_gguf
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    model, imatrix, hessians = calibrated
    report = write_gguf(model, byte_bpe_tokenizer(), tmp_path / "m.gguf", "q4_k_m", imatrix=imatrix,
                        hessians=hessians)
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    for i in range(2):
        for hf, gg in (("self_attn.o_proj", "attn_output"), ("self_attn.v_proj", "attn_v")):
            name = f"blk.{i}.{gg}.weight"
            kind = report["tensors"][name]["type"]
            assert report["tensors"][name]["method"] == "gptq"
            assert kind == ("Q6_K" if gg == "attn_v" and i == 1 else "Q4_K")  # use_more_bits(1, 2)
            key = f"model.layers.{i}.{hf}"
            w = model.model.layers[i].get_submodule(hf).weight.detach().numpy()
            raw_gptq = np.array(stored[name].data)
            raw_rtn = kq.quantize(w, kind, imatrix[key].numpy())
            f_g, f_r = kq.unpack(raw_gptq, kind), kq.unpack(raw_rtn, kind)
            for field in f_r:
                if field != "q":
                    assert np.array_equal(f_g[field], f_r[field]), (name, field)
            h = hessians[key].double()
            loss = {}
            for how, raw in (("gptq", raw_gptq), ("rtn", raw_rtn)):
                e = torch.from_numpy(kq.dequantize(raw, kind, w.shape) - w).double()
                loss[how] = float(torch.trace(e @ h @ e.T))
            # measured 0.02-0.05 (attn_output) and 0.36-0.38 (attn_v) of the imatrix quantizer's loss
            assert loss["gptq"] < 0.6 * loss["rtn"], (name, loss)


@pytest.mark.slow  # ~25 s: tokenizing WikiText-2 validation with the tiny tokenizer
@requires_data
def test_export_model_calibrates_k_quant_exports(tmp_path, monkeypatch):
    """`compress export` / output.formats: a K-quant export runs the calibration pass itself (WikiText-2
    validation) and says so in export.json; float layers go through GPTQ onto the GGUF grid."""
    from compress.export import export_model
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    import compress.export.gguf_calib as calib

    monkeypatch.setattr(calib, "EXPORT_WINDOWS", 2)
    monkeypatch.setattr(calib, "EXPORT_SEQ_LEN", 64)
    record = export_model(kquant_model(layers=2, tied=True), byte_bpe_tokenizer(), "gguf-q4_k_m", tmp_path / "m")
    assert record["calibration"].startswith("calibrated (imatrix + GPTQ onto the GGUF grid for float layers) "
                                            "on 2 x 64 tokens")
    assert record["tensors"]["blk.0.attn_q.weight"]["method"] == "gptq"


def test_k_quant_export_without_calibration_text_says_so(tmp_path, monkeypatch):
    import compress.calibrate.data
    from compress.export import export_model
    from tests.tiny_tokenizer import byte_bpe_tokenizer

    monkeypatch.setattr(compress.calibrate.data, "find_data_dir", lambda: None)
    record = export_model(kquant_model(layers=2, tied=True), byte_bpe_tokenizer(), "gguf-q4_k_m", tmp_path / "m")
    assert "without an importance matrix, as llama-quantize without --imatrix" in record["calibration"]
    assert "method" not in record["tensors"]["blk.0.attn_q.weight"]
