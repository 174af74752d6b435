"""Trellis codes (issue 50, item 1): the codebook, Viterbi against brute force, the stored layout, the few-row decode
kernel against the dense decode, BlockLDLQ against plain GPTQ, the quantizer against GPTQ on one layer, and a run:
saved in compress's own checkpoint, read back as TrellisLinear layers, refused by every other format but dense."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from compress.calibrate.observers import InputStats
from compress.core.scheme import QuantScheme
from compress.core.trellis import TrellisFormat, TrellisLinear, codebook, from_tiles, pack_tiles, to_tiles, \
    unpack_tiles, walk_states
from compress.quantizers import LayerInputs, build_options, get_quantizer
from compress.quantizers.trellis import TrellisOptions, block_ldlq, damped_inverse_factor, quantize_trellis
from tests.conftest import run_tiny_recipe, tiny_recipe

kernels = pytest.importorskip("compress.kernels.trellis")


def _walk_values(start: int, steps: list[int], fmt: TrellisFormat) -> list[float]:
    """A walk decoded one state at a time, in plain Python."""
    cb, mask, s = codebook(fmt), (1 << fmt.state_bits) - 1, start
    out = [float(cb[s])]
    for b in steps:
        s = ((s << fmt.bits) | b) & mask
        out.append(float(cb[s]))
    return out


def test_codebook_is_the_byte_sum_of_an_lcg_and_near_gaussian():
    fmt = TrellisFormat(bits=2, state_bits=12)
    cb = codebook(fmt)
    for s in (0, 1, 4095):
        x = (s * 34038481 + 76625530) % 2 ** 32
        total = sum((x >> (8 * i)) & 0xFF for i in range(4))
        assert float(cb[s]) == pytest.approx((total - 510) / (4 * (256 ** 2 - 1) / 12) ** 0.5, rel=1e-6)
    assert abs(float(cb.mean())) < 0.05 and float(cb.std()) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("bits,state_bits", [(2, 4), (3, 5), (2, 5)])
def test_viterbi_finds_the_nearest_walk(bits, state_bits):
    """Against every walk of a short trellis: the error is the smallest there is, and the walk returned has it."""
    fmt = TrellisFormat(bits=bits, state_bits=state_bits, tile=2)  # T = 4 steps
    gen = torch.Generator().manual_seed(bits * 10 + state_bits)
    target = torch.randn(6, fmt.steps, generator=gen)
    start, steps, err = kernels.viterbi(target, fmt, codebook(fmt))
    for q in range(target.shape[0]):
        best = min(sum((a - b) ** 2 for a, b in zip(_walk_values(s0, list(bs), fmt), target[q].tolist()))
                   for s0 in range(1 << state_bits) for bs in itertools.product(range(1 << bits), repeat=3))
        mine = _walk_values(int(start[q]), steps[q].tolist(), fmt)
        assert float(err[q]) == pytest.approx(best, rel=1e-5, abs=1e-6)
        assert sum((a - b) ** 2 for a, b in zip(mine, target[q].tolist())) == pytest.approx(best, rel=1e-5, abs=1e-6)


def test_gaussian_error_beats_the_best_scalar_quantizer():
    """On unit Gaussian data, 2 bits per weight: below Lloyd-Max's 0.1175 (the best 4-level scalar quantizer), near
    the rate-distortion bound 2^-4 = 0.0625 (QTIP's 1MAD code at L = 16: ~0.069)."""
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    _, _, err = kernels.viterbi(x, TrellisFormat(bits=2, state_bits=12), codebook(TrellisFormat(bits=2, state_bits=12)))
    mse = float(err.sum()) / x.numel()
    assert 0.0625 < mse < 0.085


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_stored_tiles_round_trip_and_decode_as_walks(bits):
    fmt = TrellisFormat(bits=bits, state_bits=10, tile=4)
    gen = torch.Generator().manual_seed(bits)
    start = torch.randint(0, 1 << 10, (5,), generator=gen)
    steps = torch.randint(0, 1 << bits, (5, fmt.steps - 1), generator=gen)
    packed = pack_tiles(start, steps, fmt)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (5, fmt.tile_bytes)
    s2, b2 = unpack_tiles(packed, fmt)
    assert torch.equal(s2, start) and torch.equal(b2, steps)
    values = codebook(fmt)[walk_states(s2, b2, fmt)]
    for q in range(5):
        assert values[q].tolist() == pytest.approx(_walk_values(int(start[q]), steps[q].tolist(), fmt))
    w = torch.arange(8 * 12.0).reshape(8, 12)
    assert torch.equal(from_tiles(to_tiles(w, 4), 8, 12, 4), w)
    assert to_tiles(w, 4)[1].tolist() == w[:4, 4:8].reshape(-1).tolist()  # tile (0, 1), row by row


def _random_trellis(m: int, n: int, fmt: TrellisFormat, seed: int = 0):
    from compress.core.trellis import TrellisTensor, trellis_scheme

    gen = torch.Generator().manual_seed(seed)
    tiles = (m // fmt.tile) * (n // fmt.tile)
    start = torch.randint(0, 1 << fmt.state_bits, (tiles,), generator=gen)
    steps = torch.randint(0, 1 << fmt.bits, (tiles, fmt.steps - 1), generator=gen)
    signs = lambda k: (torch.randint(0, 2, (k,), generator=gen) * 2 - 1).to(torch.int8)  # noqa: E731
    scale = (torch.rand(m, 1, generator=gen) + 0.5).half()
    return TrellisTensor(pack_tiles(start, steps, fmt), scale, None, trellis_scheme(fmt), (m, n), None, fmt,
                         signs(n), signs(m))


@pytest.mark.parametrize("bits,rows", [(2, 1), (3, 5), (4, 16)])
def test_rows_kernel_is_the_dense_decode(bits, rows):
    fmt = TrellisFormat(bits=bits, state_bits=12, tile=16)
    qt = _random_trellis(48, 64, fmt, seed=bits)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7))
    y = kernels.trellis_rows(x, qt.qdata, qt.scale, fmt, codebook(fmt), 48)
    assert torch.allclose(y, x @ qt.decoded().T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="1..16 rows"):
        kernels.trellis_rows(torch.randn(17, 64), qt.qdata, qt.scale, fmt, codebook(fmt), 48)


def _dense_q(signs: torch.Tensor) -> torch.Tensor:
    """Q = H·diag(signs)/√n as the rotate stage's OnlineHadamard has it, dense."""
    from compress.transforms.rotation import OnlineHadamard

    return OnlineHadamard(signs.numel(), signs.float())(torch.eye(signs.numel()))


def test_dequantize_undoes_the_rotations():
    """W = Q_out diag(scale) C Q_inᵀ, with Q the randomised Hadamard transforms of the stored signs."""
    from compress.core.hadamard import rotated

    qt = _random_trellis(32, 48, TrellisFormat(bits=2, state_bits=8, tile=16))
    q_out, q_in = _dense_q(qt.signs_out), _dense_q(qt.signs_in)
    assert torch.allclose(q_in @ q_in.T, torch.eye(48), atol=1e-5)
    assert torch.allclose(qt.dequantize(), q_out @ qt.decoded() @ q_in.T, atol=1e-5)
    assert torch.allclose(q_out.T @ qt.dequantize() @ q_in, qt.decoded(), atol=1e-4)
    w = torch.randn(32, 48, dtype=torch.float64)  # the quantizer's Q_outᵀ W Q_in, in float64
    assert torch.allclose(rotated(w, qt.signs_out, qt.signs_in), q_out.T.double() @ w @ q_in.double(), atol=1e-6)
    assert rotated(w, qt.signs_out, qt.signs_in).dtype == torch.float64


def _spd(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=gen) * torch.logspace(0.5, -0.5, n)
    return (x.T @ x).double()


def test_one_column_blocks_are_gptq():
    """block_ldlq with blocks of one column and rounding to integers is GPTQ's loop, written out plainly here."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 10, generator=gen, dtype=torch.float64) * 3
    u = damped_inverse_factor(_spd(10, 3), 0.01)
    mine = block_ldlq(w, u, 1, lambda x, j: torch.round(x))
    ref, work = torch.zeros_like(w), w.clone()
    for j in range(10):
        ref[:, j] = torch.round(work[:, j])
        work[:, j + 1:] -= ((work[:, j] - ref[:, j]) / u[j, j])[:, None] * u[j, j + 1:][None, :]
    assert torch.allclose(mine.double(), ref, atol=1e-5)


def test_block_feedback_lowers_the_output_error():
    """Blocks of 4 columns rounded jointly: pushing each block's error onto the later columns leaves less output
    error tr(E H Eᵀ) than rounding every block alone."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(16, 24, generator=gen, dtype=torch.float64) * 2
    h = _spd(24, 5) + 50 * torch.ones(24, 24, dtype=torch.float64)  # strongly correlated inputs
    cost = lambda q: float(torch.trace((w - q) @ h @ (w - q).T))  # noqa: E731
    with_feedback = block_ldlq(w, damped_inverse_factor(h, 0.01), 4, lambda x, j: torch.round(x)).double()
    assert cost(with_feedback) < 0.7 * cost(torch.round(w))


def _layer_inputs(n: int, seed: int) -> tuple[torch.Tensor, LayerInputs]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, n, generator=gen) @ (torch.eye(n) + 0.1 * torch.randn(n, n, generator=gen))
    x[:, :3] *= 10  # outlier input channels
    return x, LayerInputs("model.layers.0.mlp.up_proj", InputStats(hessian=x.T @ x, tokens=x.shape[0]))


@pytest.mark.parametrize("bits,margin", [(2, 0.3), (3, 0.5)])
def test_trellis_beats_gptq_on_one_layer(bits, margin):
    """The layer's output error at k bits per weight (plus a row scale): well below GPTQ's with a scale and zero
    point per 64 weights (more bytes), on a weight with an outlier column and inputs with outlier channels."""
    x, inputs = _layer_inputs(128, 9)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(10)) * 0.02
    w[:, 5] *= 8
    rel = lambda q: float(((q - w) @ x.T).pow(2).sum() / (w @ x.T).pow(2).sum())  # noqa: E731
    qt = quantize_trellis(w, QuantScheme(dtype=f"int{bits}", granularity="channel", group_size=None),
                          TrellisOptions(state_bits=10), inputs)
    grid = QuantScheme(dtype=f"int{bits}", granularity="group", group_size=64, symmetric=False)
    gq = get_quantizer("gptq").quantize(w, grid, build_options("gptq", None), inputs)
    assert rel(qt.dequantize()) < margin * rel(gq.dequantize())
    assert qt.nbytes <= gq.nbytes  # equal here: 64 x 128 is small enough for the signs (int8) to count


def test_refitted_row_scales_never_raise_the_error():
    """After the codes are chosen each rotated row's scale is refitted to them (least squares against H̃): the
    layer's output error (the rotations keep its total) drops below what the RMS scales left."""
    x, inputs = _layer_inputs(64, 11)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(12)) * 0.02
    scheme = QuantScheme(dtype="int2", granularity="channel", group_size=None)
    total = lambda q: float(((q - w) @ x.T).pow(2).sum())  # noqa: E731
    plain = total(quantize_trellis(w, scheme, TrellisOptions(state_bits=8, refit_scales=False), inputs).dequantize())
    refit = total(quantize_trellis(w, scheme, TrellisOptions(state_bits=8), inputs).dequantize())
    assert refit < 0.995 * plain


def test_format_and_scheme_checks_name_the_fix():
    with pytest.raises(ValueError, match="2, 3 or 4 bits"):
        TrellisFormat(bits=5)
    with pytest.raises(ValueError, match="at most 16"):
        TrellisFormat(bits=2, state_bits=17)
    with pytest.raises(ValueError, match="between 2 and 64"):
        TrellisFormat(tile=1)
    problem = get_quantizer("trellis").problem
    assert "granularity: channel" in problem(QuantScheme(dtype="int3", granularity="group", group_size=64))
    assert "int2, int3 or int4" in problem(QuantScheme(dtype="int8", granularity="channel", group_size=None))
    assert problem(QuantScheme(dtype="int3", granularity="channel", group_size=None)) is None


TRELLIS = {"stage": "quantize", "method": "trellis", "scheme": {"dtype": "int2", "granularity": "channel"},
           "options": {"state_bits": 8}}
NO_EVAL = {"perplexity": False, "speed": False, "baseline": False, "samples": 0}


def test_a_run_saves_trellis_layers_that_load_back(tmp_path):
    from compress.export.native import load_compressed
    from compress.kernels.cpu_rows import rows_reason

    out = run_tiny_recipe(tmp_path, [TRELLIS], NO_EVAL, formats=("native", "dense"))
    meta = json.loads((out / "compress.json").read_text())
    assert len(meta["trellis"]) == 14 and meta["trellis"]["model.layers.0.mlp.down_proj"] == \
        {"bits": 2, "state_bits": 8, "tile": 16}
    model = load_compressed(out)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, TrellisLinear) and "trellis" in rows_reason(layer)
    import transformers
    dense = transformers.AutoModelForCausalLM.from_pretrained(out / "exports" / "dense", dtype=torch.float32)
    assert torch.allclose(dense.model.layers[1].mlp.down_proj.weight, layer.qtensor().dequantize(), atol=1e-2)
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        a, b = model(ids).logits, dense(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_other_formats_are_refused_before_any_work(tmp_path):
    from compress import load_recipe, run

    with pytest.raises(Exception, match="trellis codes.*no gptq loader"):
        run(load_recipe(tiny_recipe(tmp_path, [TRELLIS], NO_EVAL, formats=("gptq",))), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_layer_that_is_not_whole_tiles_is_named(tmp_path):
    from compress import load_recipe, run

    stage = TRELLIS | {"options": {"state_bits": 8, "tile": 48}}
    with pytest.raises(Exception, match="48×48 trellis tiles"):
        run(load_recipe(tiny_recipe(tmp_path, [stage], NO_EVAL)), progress=False)


def test_fast_rotation_is_the_dense_one():
    from compress.core.hadamard import rotate_by
    from compress.transforms.rotation import OnlineHadamard

    for n in (48, 64, 96):  # Paley ⊗ Sylvester, Sylvester, and 96 = 12 · 8
        signs = (torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(n)) * 2 - 1).to(torch.int8)
        q, x = OnlineHadamard(n, signs.float())(torch.eye(n)), torch.randn(3, 2, n)  # Q, as the rotate stage has it
        assert torch.allclose(q @ q.T, torch.eye(n), atol=1e-5)
        assert torch.allclose(rotate_by(x, signs), x @ q, atol=1e-5)
        assert torch.allclose(rotate_by(x, signs, transpose=True), x @ q.T, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 whatever autocast (tune_scales trains under it)
            y = rotate_by(x, signs)
        assert y.dtype == torch.float32 and torch.allclose(y, x @ q, atol=1e-5)


def test_the_dispatcher_decodes_few_rows_with_the_trellis_kernel():
    """install_kernel puts the trellis rows kernel on a TrellisLinear (its forward is then the dequantize+matmul
    forward, for 3 rows and for 40, 16 at a time) and refuses it for a grid layer; grid kernels refuse the trellis
    layer even where its scheme (int4 per channel) is one they read."""
    from compress.core.nn import QuantLinear
    from compress.kernels.dispatch import install_kernel, registry
    from compress.quantizers.rtn import quantize_rtn, RTNOptions

    fmt = TrellisFormat(bits=4, state_bits=10, tile=16)
    qt = _random_trellis(48, 64, fmt, seed=5)
    layer = TrellisLinear.from_module(torch.nn.Linear(64, 48), qt)
    w = qt.dequantize()
    left = install_kernel(layer, "compress trellis rows (CPU)", torch.float32)
    assert left == {} and layer.dispatch is not None
    for rows in (3, 40):
        x = torch.randn(rows, 64)
        assert torch.allclose(layer(x), x @ w.T + layer.bias, atol=1e-4)
    grid = QuantLinear.from_module(torch.nn.Linear(64, 48), quantize_rtn(
        torch.randn(48, 64), QuantScheme(dtype="int4", granularity="channel", group_size=None), RTNOptions(), None))
    assert "holds a grid" in install_kernel(grid, "compress trellis rows (CPU)", torch.float32)[""]
    for name, kernel in registry().items():
        if not kernel.trellis:
            plain = TrellisLinear.from_module(torch.nn.Linear(64, 48), qt)
            assert "holds trellis codes" in install_kernel(plain, name, torch.float32)[""]


def _kl_folder(tmp_path, name: str, h_out: torch.Tensor, h_in: torch.Tensor):
    from safetensors.torch import save_file

    from compress.quantizers.gptq_kron import KEY_IN, KEY_OUT, output_hessian_path

    path = output_hessian_path(tmp_path, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({KEY_OUT: h_out.float().contiguous(), KEY_IN: h_in.float().contiguous()}, str(path))
    return str(tmp_path)


def test_a_flat_output_side_changes_nothing_and_a_skewed_one_lowers_the_kronecker_cost(tmp_path):
    """Against the KL's two sides: an output side c·I (every output alike, in the rotated basis too) carries nothing
    between row blocks (the codes equal the input-side-only coding, bit for bit); a skewed, correlated one lowers
    tr(ΔW H_in ΔWᵀ H_out) below the coding that ignores it."""
    x, inputs = _layer_inputs(64, 13)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(14)) * 0.02
    h_in = inputs.hessian()
    scheme = QuantScheme(dtype="int2", granularity="channel", group_size=None)
    base = TrellisOptions(state_bits=8)
    flat = _kl_folder(tmp_path / "flat", inputs.name, 3 * torch.eye(64), h_in)
    plain = quantize_trellis(w, scheme, base, inputs)
    same = quantize_trellis(w, scheme, TrellisOptions(state_bits=8, output_hessians=flat), inputs)
    assert torch.equal(plain.qdata, same.qdata)
    gen = torch.Generator().manual_seed(15)
    mix = torch.randn(64, 64, generator=gen)
    h_out = (mix @ mix.T + 0.1 * torch.eye(64)) * torch.logspace(1, -1, 64)[:, None]
    h_out = (h_out + h_out.T) / 2 + 64 * torch.eye(64)
    skew = _kl_folder(tmp_path / "skew", inputs.name, h_out, h_in)
    cost = lambda q: float(torch.trace((q - w) @ h_in @ (q - w).T @ h_out))  # noqa: E731
    kl = quantize_trellis(w, scheme, TrellisOptions(state_bits=8, output_hessians=skew), inputs)
    assert cost(kl.dequantize()) < 0.9 * cost(plain.dequantize())


def test_kl_hessians_feed_a_trellis_run(tmp_path):
    out = run_tiny_recipe(tmp_path, [{"stage": "kl_hessians", "n_samples": 2}, TRELLIS], NO_EVAL)
    report = json.loads((out / "report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["kl_hessians", "quantize"]
    assert isinstance(__import__("compress.export.native", fromlist=["x"]).load_compressed(out).model.layers[0]
                      .self_attn.q_proj, TrellisLinear)


def test_tune_scales_tunes_a_trellis_layers_row_scales_by_the_hand_formula():
    """W = Q_out · diag(s·e^g) C · Q_inᵀ: dL/dg_i = Σ_j (Q_outᵀ (dL/dW) Q_in)_ij · W̃_ij, W̃ = diag(s·e^g) C the
    rotated weight; the walks and signs untouched, the tuned scale stored as float16."""
    from compress.core.hadamard import rotated
    from compress.distill.scale_tuning import scale_gains, tunable_layers

    qt = _random_trellis(32, 48, TrellisFormat(bits=2, state_bits=8, tile=16))
    layer = TrellisLinear.from_module(torch.nn.Linear(48, 32, bias=False), qt)
    model = torch.nn.Sequential(layer)
    names, skipped = tunable_layers(model)
    assert names == ["0"] and skipped == {}
    codes = layer.qdata.clone()
    x, y = torch.randn(16, 48), torch.randn(16, 32)
    plain = qt.dequantize()
    with scale_gains(model, names) as (gain,):
        # the walks decoded once for the tuning: the same weight up to float32 rounding
        assert layer._unscaled is not None
        torch.testing.assert_close(layer.qtensor().dequantize(), plain, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            gain.copy_(0.1 * torch.randn(gain.shape))
        ((layer(x) - y) ** 2).sum().backward()
        tt = layer.qtensor()
        w, w_rot = tt.dequantize().double(), tt.decoded().double()
        d_w = 2 * (x.double() @ w.T - y.double()).T @ x.double()
        expected = (rotated(d_w, layer.signs_out, layer.signs_in) * w_rot).sum(1, keepdim=True)
        torch.testing.assert_close(gain.grad.double(), expected, rtol=1e-4, atol=1e-6)
        tuned = (qt.scale.float() * torch.exp(gain.detach())).half()
    assert layer.scale.dtype == torch.float16 and torch.equal(layer.scale, tuned)
    assert torch.equal(layer.qdata, codes) and layer._unscaled is None
    with scale_gains(model, names, decode_once=False):  # gradient checkpointing: the walks decoded per forward
        assert layer._unscaled is None
        torch.testing.assert_close(layer(x), x @ layer.qtensor().dequantize().T)


def test_a_run_tunes_trellis_row_scales(tmp_path):
    """trellis codes, then tune_scales: every block layer's row scales tuned, its walks kept."""
    from compress.export.native import load_compressed

    plain = run_tiny_recipe(tmp_path / "plain", [TRELLIS], NO_EVAL)
    tuned = run_tiny_recipe(tmp_path / "tuned", [TRELLIS, {"stage": "tune_scales", "epochs": 2, "batch_size": 2,
                                                           "eval_windows": 0}], NO_EVAL)
    section = json.loads((tuned / "report.json").read_text())["stages"][1]
    assert section["layers"] == 14 and section["not_tuned"] == {}
    a, b = (dict(load_compressed(p).named_modules()) for p in (plain, tuned))
    layers = [n for n, m in a.items() if isinstance(m, TrellisLinear)]
    assert len(layers) == 14 and section["parameters"] == sum(a[n].out_features for n in layers)
    assert all(torch.equal(a[n].qdata, b[n].qdata) and torch.equal(a[n].signs_in, b[n].signs_in) for n in layers)
    assert all(not torch.equal(a[n].scale, b[n].scale) for n in layers)


def test_eora_repairs_trellis_layers(tmp_path):
    """A low-rank repair after trellis codes: every block layer carries the term, kept through our checkpoint."""
    from compress.export.native import load_compressed

    out = run_tiny_recipe(tmp_path, [TRELLIS, {"stage": "eora", "rank": 4}], NO_EVAL)
    eora = json.loads((out / "report.json").read_text())["stages"][1]
    assert eora["stage"] == "eora" and eora["repaired"] == 14 and eora["mean_error_removed"] > 0.05
    layer = load_compressed(out).model.layers[1].mlp.gate_proj
    assert isinstance(layer, TrellisLinear) and layer.rank == 4
