"""The trellis codes' two kernels on this CPU, one thread (issue 50, item 1).

Encoding: Viterbi (kernels/trellis.c) on 64 walks of 256 unit-Gaussian values at k = 2, 3, 4 bits and L = 8..16 state
bits: the mean squared error per value (against Lloyd-Max's best scalar quantizer at k bits: 0.1175, 0.03454,
0.009497, and the Gaussian rate-distortion bound 2^-2k) and milliseconds per walk of 256 weights.

Decoding: one decode step's matmul, SmolLM2-135M's four linear shapes at 1 and 4 rows, with the weights out of cache
(layers cycled, as in a real decode step):

- torch F.linear on float32 weights (the baseline), and compress's few-row kernels (kernels/cpu_rows.c) on float32
  and on int4 g64 weights;
- TrellisLinear's forward at 2, 3 and 4 bits (L = 12) with the dispatcher's `compress trellis rows (CPU)` kernel
  installed: the stored tiles decoded by kernels/trellis.c as they are read, between the two fast Hadamard rotations;
  and the tile kernel alone.

Times are medians in µs per layer, with the ratio to F.linear float32 in the same run.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/trellis_kernels.py [--out bench/results/trellis_kernels.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from compress.core.nn import QuantLinear
from compress.core.qtensor import QuantizedTensor
from compress.core.scheme import QuantScheme
from compress.core.trellis import TrellisFormat, TrellisLinear, TrellisTensor, codebook, pack_tiles, trellis_scheme
from compress.kernels.cpu_rows import load, rows_linear
from compress.kernels.dispatch import install_kernel
from compress.kernels.trellis import trellis_rows, viterbi

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.verify_matmul import median_us  # noqa: E402
LLOYD_MAX = {2: 0.1175, 3: 0.03454, 4: 0.009497}  # the best scalar quantizer of a unit Gaussian at k bits
SHAPES = {"q/o_proj": (576, 576), "k/v_proj": (192, 576), "gate/up_proj": (1536, 576), "down_proj": (576, 1536)}
MB_CYCLED = 64  # float32 weights cycled per timing: beyond this CPU's caches


def random_trellis(m: int, n: int, fmt: TrellisFormat, gen: torch.Generator) -> TrellisLinear:
    """A layer of random walks (decode speed does not depend on which walk a tile takes)."""
    tiles = (m // fmt.tile) * (n // fmt.tile)
    start = torch.randint(0, 1 << fmt.state_bits, (tiles,), generator=gen)
    steps = torch.randint(0, 1 << fmt.bits, (tiles, fmt.steps - 1), generator=gen)
    signs = lambda k: (torch.randint(0, 2, (k,), generator=gen) * 2 - 1).to(torch.int8)  # noqa: E731
    qt = TrellisTensor(pack_tiles(start, steps, fmt), torch.ones(m, 1, dtype=torch.float16), None,
                       trellis_scheme(fmt), (m, n), None, fmt, signs(n), signs(m))
    layer = TrellisLinear.from_module(torch.nn.Linear(n, m, bias=False), qt)
    left = install_kernel(layer, "compress trellis rows (CPU)", torch.float32)  # what a decode's dispatch plan picks
    assert not left, left
    return layer


def int4_layer(w: torch.Tensor) -> QuantLinear:
    from compress.core.primitives import compute_qparams, quantize_affine

    scheme = QuantScheme(dtype="int4", granularity="group", group_size=64, symmetric=False)
    scale, zero = compute_qparams(w, scheme)
    qt = QuantizedTensor.from_codes(quantize_affine(w, scale, zero, scheme), scale, zero, scheme)
    return QuantLinear.from_module(torch.nn.Linear(w.shape[1], w.shape[0], bias=False), qt)


def encoding(gen: torch.Generator) -> list[dict]:
    x = torch.randn(64, 256, generator=gen)
    rows = []
    for k in (2, 3, 4):
        for state_bits in (8, 10, 12, 14, 16):
            fmt = TrellisFormat(bits=k, state_bits=state_bits)
            cb = codebook(fmt)
            viterbi(x[:1], fmt, cb)  # built and warm
            t0 = time.perf_counter()
            _, _, err = viterbi(x, fmt, cb)
            ms = (time.perf_counter() - t0) / x.shape[0] * 1e3
            mse = float(err.sum()) / x.numel()
            row = {"bits": k, "state_bits": state_bits, "mse": round(mse, 5), "lloyd_max": LLOYD_MAX[k],
                   "bound": round(2.0 ** (-2 * k), 5), "ms_per_walk": round(ms, 3)}
            rows.append(row)
            print(json.dumps(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/trellis_kernels.json")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = load()
    gen = torch.Generator().manual_seed(0)
    encode = encoding(gen)
    rows_out = []
    for label, (m, n) in SHAPES.items():
        copies = max(2, MB_CYCLED * 2 ** 20 // (4 * m * n))
        ws = [torch.randn(m, n, generator=gen) * 0.02 for _ in range(copies)]
        f32 = []
        for w in ws:
            lin = torch.nn.Linear(n, m, bias=False).requires_grad_(False)
            lin.weight.copy_(w)
            f32.append(rows_linear(lin, lib))
        int4 = [rows_linear(int4_layer(w), lib) for w in ws]
        per_bits = {b: [random_trellis(m, n, TrellisFormat(bits=b, state_bits=12), gen) for _ in range(copies)]
                    for b in (2, 3, 4)}
        cb = {b: codebook(TrellisFormat(bits=b, state_bits=12)) for b in per_bits}
        for rows in (1, 4):
            x = torch.randn(rows, n, generator=gen)

            def cycle(fn, layers):
                return lambda: [fn(layer) for layer in layers]

            t = {"torch F.linear f32": median_us(cycle(lambda w: F.linear(x, w), ws), args.repeats),
                 "rows kernel f32": median_us(cycle(lambda r: r(x), f32), args.repeats),
                 "rows kernel int4 g64": median_us(cycle(lambda r: r(x), int4), args.repeats)}
            for b, layers in per_bits.items():
                with torch.no_grad():
                    t[f"trellis int{b} forward"] = median_us(cycle(lambda layer: layer(x), layers), args.repeats)
                    t[f"trellis int{b} tiles only"] = median_us(
                        cycle(lambda layer: trellis_rows(x, layer.qdata, layer.scale, layer.trellis, cb[b], m), layers),
                        args.repeats)
            base = t["torch F.linear f32"]
            row = {"shape": label, "out": m, "in": n, "rows": rows, "layers_cycled": copies,
                   "us_per_layer": {k: round(v / copies, 1) for k, v in t.items()},
                   "vs_torch_f32": {k: round(v / base, 2) for k, v in t.items()}}
            rows_out.append(row)
            print(json.dumps(row))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    result = {"date": datetime.date.today().isoformat(), "commit": commit.strip(), "cpu": cpu, "threads": 1,
              "command": "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/trellis_kernels.py",
              "encoding": encode, "decoding": rows_out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
