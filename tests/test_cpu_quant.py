"""kernels/cpu_quant.c: one-pass fake quantization, torch's fake_quantize bit for bit (the AWQ searches' trial weights
and clipping errors)."""
import pytest
import torch

from compress.core.scheme import QuantScheme
from compress.kernels import cpu_quant
from compress.kernels.cpu_quant import fake_quantize_rows
from compress.quantizers.rtn import fake_quantize

if cpu_quant.load() is None:
    pytest.skip("cpu_quant.c cannot be built here (no C compiler)", allow_module_level=True)


def _weights(n: int = 300, k: int = 768) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * (torch.rand(1, k, generator=g) * 3)
    w[0, :64] = 0.0  # an all-zero group: scale 1
    w[1, :64] = -0.0
    w[2, :64] = 1e-30  # a scale that rounds to zero in float16
    w[3, 5] = 100.0  # an outlier stretching its group
    w[4, 64:128] = 7e4  # a float16 scale that overflows to inf
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits, every NaN as one pattern (a float16 scale that overflows makes NaNs, whose payload torch's
    bfloat16 cast keeps or not depending on the CPU's instructions)."""
    bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return torch.where(t.isnan(), torch.full_like(bits, -1), bits)


SCHEMES = [QuantScheme(dtype=d, granularity=gran, group_size=g, symmetric=sym, scale_dtype=sd)
           for d in ("int2", "int3", "int4", "int8") for gran, g in (("group", 32), ("group", 128), ("channel", None))
           for sym in (False, True) for sd in ("float16", "bfloat16", "float32")]


@pytest.mark.parametrize("sch", SCHEMES, ids=lambda s: f"{s.name}-{s.scale_dtype}")
def test_fake_quantize_rows_is_torchs_bit_for_bit(sch):
    """Q(w), Q(w * s) / s as bfloat16 and float32, and Q(clamp(w, lo, hi)) - w: the same bits as fake_quantize, on
    zeros of both signs, outliers and scales that round to zero or overflow, on one thread and in two bands."""
    w = _weights()
    s = torch.rand(768, generator=torch.Generator().manual_seed(1)) * 4 + 0.01
    for threads in (1, 2):
        assert torch.equal(_bits(fake_quantize_rows(w, sch, threads=threads)), _bits(fake_quantize(w, sch)))
        want = fake_quantize(w * s[None], sch).div_(s[None])
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(w.shape, dtype=dtype)
            assert fake_quantize_rows(w, sch, s, out, threads) is out
            assert torch.equal(_bits(out), _bits(want.to(dtype)))
    g = sch.group_size or 768
    wg = w.reshape(300, 768 // g, g)
    lo0, hi0 = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    lo, hi = lo0 * 0.7, hi0 * 0.8
    clipped = torch.minimum(torch.maximum(wg, lo[..., None]), hi[..., None]).reshape(w.shape)
    want = fake_quantize(clipped, sch) - w
    got = fake_quantize_rows(w, sch, clip=(lo, hi), minus_w=True, threads=2)
    assert torch.equal(_bits(got), _bits(want))


def test_it_declines_what_it_does_not_compute():
    """None (the caller's torch path) for float formats, microscaling, per-tensor scales, 16-bit inputs and a group
    that does not divide the row; a bad argument is an error that names it."""
    w = torch.randn(64, 256)
    assert fake_quantize_rows(w, QuantScheme(dtype="int4", granularity="tensor", group_size=None)) is None
    assert fake_quantize_rows(w, QuantScheme(dtype="fp8_e4m3", granularity="channel", group_size=None)) is None
    assert fake_quantize_rows(w.bfloat16(), QuantScheme(dtype="int4", granularity="group", group_size=64)) is None
    assert fake_quantize_rows(w[:, :96], QuantScheme(dtype="int4", granularity="channel", group_size=None)) is not None
    with pytest.raises(ValueError, match="colmul"):
        fake_quantize_rows(w, QuantScheme(dtype="int4", granularity="group", group_size=64), torch.ones(255))
    with pytest.raises(ValueError, match="out must be"):
        fake_quantize_rows(w, QuantScheme(dtype="int4", granularity="group", group_size=64),
                           out=torch.empty(64, 256, dtype=torch.bfloat16), minus_w=True)


def test_awq_searches_fall_back_to_torch_bit_for_bit(monkeypatch):
    """Without the kernel (no C compiler) the trial weights and the clipping ranges are the same as with it."""
    import compress.quantizers.awq as awq
    from torch import nn

    torch.manual_seed(0)
    m = nn.Linear(256, 200, bias=False)
    s = torch.rand(256) + 0.5
    x = torch.randn(512, 256) * (1 + 8 * (torch.rand(256) > 0.95))
    sch = QuantScheme(dtype="int4", granularity="group", group_size=64, symmetric=False)
    with_kernel = awq.scaled_trials([m], s, [sch], torch.bfloat16)[0], awq.search_clip(m.weight, x, sch)
    monkeypatch.setattr(cpu_quant, "load", lambda: None)
    assert fake_quantize_rows(m.weight.detach(), sch) is None
    without = awq.scaled_trials([m], s, [sch], torch.bfloat16)[0], awq.search_clip(m.weight, x, sch)
    assert torch.equal(with_kernel[0], without[0])
    assert torch.equal(with_kernel[1][0], without[1][0]) and torch.equal(with_kernel[1][1], without[1][1])


def test_the_c_sources_ship_in_the_package():
    """Every C source of compress/kernels (built on first use) is package data, so `pip install .` carries it: the
    wheel held none of them before, and an installed copy then ran only torch's paths."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "compress.kernels"]
    sources = [p.relative_to(root / "compress" / "kernels").as_posix()
               for p in (root / "compress" / "kernels").rglob("*") if p.suffix in (".c", ".cu", ".h", ".cpp")]
    assert "cpu_quant.c" in sources
    assert [s for s in sources if not any(fnmatch.fnmatch(s, pat) for pat in patterns)] == []


@pytest.mark.parametrize("sch", [QuantScheme(dtype="int4", granularity="group", group_size=64, symmetric=False),
                                 QuantScheme(dtype="int3", granularity="group", group_size=32, symmetric=True),
                                 QuantScheme(dtype="int2", granularity="channel", group_size=None, symmetric=False,
                                             scale_dtype="bfloat16")], ids=lambda s: s.name)
def test_autorounds_rounding_and_sign_step_are_torchs_bit_for_bit(sch, monkeypatch):
    """The tuning step's rounded weight (float32 and bfloat16), its inside mask and scale-gradient factor, and the
    SignSGD step on V, from the C kernels, equal rounding_forward's and the torch step's, with offsets V that push
    codes out of range and clipping that shrinks the groups (so some codes clamp)."""
    from compress.quantizers.autoround import Rounding, RoundingGrid, rounded_weight, rounding_forward, sign_step

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.05
    r = Rounding.start(w, sch)
    r.v.uniform_(-0.5, 0.5, generator=g)
    r.alpha.uniform_(0.7, 1.0, generator=g)
    r.beta.uniform_(0.7, 1.0, generator=g)
    grid = RoundingGrid.of(w, sch)
    deq, ref = rounding_forward(grid, r)
    for dtype in (torch.float32, torch.bfloat16):
        hat, saved = rounded_weight(grid, r, dtype)
        assert torch.equal(_bits(hat), _bits(deq.to(dtype)))
        assert torch.equal(saved.inside, ref.inside) and torch.equal(_bits(saved.ds_factor), _bits(ref.ds_factor))
        assert torch.equal(saved.scale, ref.scale)
    assert 0 < ref.inside.mean() < 1  # some codes clamped
    grad = torch.randn(w.shape, generator=g)
    grad[0, :10] = 0.0
    want = (r.v - 1e-2 * torch.sign(grad)).clamp_(-0.5, 0.5)
    r.v.grad = grad
    v0 = r.v.clone()
    sign_step(r, 1e-2, 1e-2, minmax=False)
    assert torch.equal(r.v, want) and r.v.grad is None
    # without the kernel (no C compiler, or an accelerator) the torch path gives the same
    monkeypatch.setattr(cpu_quant, "load", lambda: None)
    hat, saved = rounded_weight(grid, r, torch.bfloat16)
    deq2, _ = rounding_forward(grid, r)
    assert torch.equal(_bits(hat), _bits(deq2.to(torch.bfloat16))) and saved.inside.shape == ref.inside.shape
    r.v, r.v.grad = v0, grad
    sign_step(r, 1e-2, 1e-2, minmax=False)
    assert torch.equal(r.v, want)
