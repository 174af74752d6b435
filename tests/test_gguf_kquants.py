"""K-quant blocks (Q4_K, Q5_K, Q6_K) and the Q5_0 / Q5_1 fallbacks: our byte layouts decoded by gguf-py, our
quantizers against llama.cpp's C ggml_quantize_chunk, byte for byte."""
from __future__ import annotations

import numpy as np
import pytest

from compress.export import gguf_kquants as kq

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
