"""bench/gpu_check.py is run once per GPU session with no chance to fix it there: its dry run exercises every
code path on CPU (the ops' reference paths, which decode the W4A16 layout as the kernel reads it), in the same
child processes and results file as on the GPU; the checker is tested here on planted errors."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from compress.kernels import gpu
from compress.kernels.prepack import GROUP_SIZES, w4a16_reference

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gc = _load()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    rc = gc.main(["--dry-run", "--out", str(out)])
    return rc, out, json.loads((out / "gpu_check.json").read_text())


def test_gpu_check_dry_run(dry_run):
    rc, out, result = dry_run
    assert rc == 0 and result["verdicts"]["all_correct"] and result["verdicts"]["complete"]
    rows = result["rows"]
    # one child per family wrote a "start" line and a row per planned case, in order, to the results file
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    for fam in gc.FAMILIES:
        planned = gc.family_cases(fam, True, False)
        assert [r["id"] for r in rows if r["family"] == fam] == list(range(len(planned)))
        assert [r["id"] for r in records if r.get("event") == "start" and r["family"] == fam] == \
            list(range(len(planned)))
    gemm = [r for r in rows if "tile_err" in r]
    assert gemm and all(r["ok"] and r["bad"] == 0 and r["deterministic"] and r["finite"] for r in gemm)
    assert all(r["rel_err"] <= gc.TOL["fp8" if r["kernel"] == "fp8_gemm" else r["dtype"]] for r in gemm)
    assert "| case | rel. err | worst tile (err) |" in (out / "gpu_check.md").read_text()
    # the shape bars read timed rows of the real shapes only (the dispatcher's reads every timed M), and only rows
    # that passed are timed
    v = result["verdicts"]
    assert W4_BARS[0] not in v and FP8_BAR not in v and W4_BARS[-1] in v
    assert any("us" in r for r in rows) and all(r["ok"] for r in rows if "us" in r)


def test_dry_run_records_the_harness_chains_and_baselines(dry_run):
    """Every run records the harness floor and the copy bandwidth; every timed case has each implementation and
    baseline timed single-call and chained with p10 / p50 / p90, the baselines' accuracy judged; the bars come from
    the chain timings, also on real rows put at the bars' shapes."""
    result = dry_run[2]
    assert set(result["harness"]) == set(gc.FAMILIES)
    for h in result["harness"].values():
        for key in ("floor_us", "chain_floor_us", "copy_us"):
            assert h[key]["p10"] <= h[key]["p50"] <= h[key]["p90"]
        assert h["chain_floor_us"]["copies"] == gc.CHAIN_MIN_COPIES and h["copy_bytes"] == 2 * gc.DRY_COPY_BYTES
    timed = [r for r in result["rows"] if r.get("timings")]
    w4 = [r for r in timed if r["kernel"] == "w4a16"]
    f8 = [r for r in timed if r["kernel"] == "fp8_gemm"]
    assert len(w4) == 2 * 3 + 6 * 3 and len(f8) == 2 * 2 * 3  # DRY_SHAPES (+ 6 formats) x DRY_MS
    for r in timed:
        for t in r["timings"].values():
            assert t["single"]["p10"] <= t["single"]["p50"] <= t["single"]["p90"]
            assert t["chain"]["copies"] == 2 and t["chain"]["p10"] <= t["chain"]["p50"] <= t["chain"]["p90"]
    for r in w4:  # torch's tinygemm takes bf16 activations only
        bf16 = r["dtype"] == "bfloat16"
        ours = {name for name, impl in gc.W4A16_IMPLS.items() if impl.rule(r["M"], r["N"], r["k_padded"],
                                                                            r["group"]) is None}
        assert {"v1", "v2", "v2 pdl"} <= ours and "dequant+cuBLAS" not in ours   # the dry run's M <= 16
        assert set(r["timings"]) == {"bf16", "dequant+matmul"} | ours | ({"torch tinygemm"} if bf16 else set())
        assert r["baselines"]["torch tinygemm"]["ok"] is (True if bf16 else None)
        chain = {k: t["chain"]["p50"] for k, t in r["timings"].items()}
        assert r["chain_vs_dense"] == pytest.approx(chain["bf16"] / chain[r["best_impl"]])
        assert r["dispatch_choice"] == min((c for c in chain if c != "bf16"), key=chain.get)
        assert r["dispatch_vs_dense"] == pytest.approx(chain["bf16"] / chain[r["dispatch_choice"]])
        single = {k: t["single"]["p50"] for k, t in r["timings"].items()}  # beside it: the same choice, one call
        assert r["dispatch_vs_dense_single"] == pytest.approx(single["bf16"] / min(v for k, v in single.items()
                                                                                   if k != "bf16"))
    for r in f8:
        base = {"bf16", "fp8 gemm", "_scaled_mm", "_scaled_mm fast accum"}
        layers = {"layer ours", "layer quantize + _scaled_mm", "layer quantize + _scaled_mm fast",
                  "torch quantize + _scaled_mm"} if r["scales"] == "row x channel" else set()
        assert set(r["timings"]) == base | layers and set(r["baselines"]) == {"_scaled_mm", "_scaled_mm fast accum"}
        assert all(b["ok"] for b in r["baselines"].values())
    v = result["verdicts"]
    assert v["w4a16_dispatch_vs_bf16"] == min(r["dispatch_vs_dense"] for r in w4)
    # real rows at the bars' shapes: the shape bars read them as they would on a GPU
    big = dict(next(r for r in w4 if r["M"] == 1 and r["dtype"] == "bfloat16" and r["group"] == 128
                    and not r["zeros"]), N=8192, K=28672)
    layer = dict(next(r for r in f8 if r["scales"] == "row x channel"), M=4096)
    v = gc.verdicts([big, layer])
    chain = {k: t["chain"]["p50"] for k, t in big["timings"].items()}
    assert v["w4a16_decode_large_vs_bf16"] == pytest.approx(chain["bf16"] / min(chain[i] for i in gc.W4A16_IMPLS
                                                                                 if i in chain))
    assert v[W4_BARS[0]] == (v["w4a16_decode_large_vs_bf16"] >= 3.0)
    chain = {k: t["chain"]["p50"] for k, t in layer["timings"].items()}
    best_layer = min(chain[f"layer {name}"] for name in gc.FP8_LAYER_IMPLS if f"layer {name}" in chain)
    assert v["fp8_layer_prefill_vs_bf16"] == pytest.approx(chain["bf16"] / best_layer)
    assert v["fp8_gemm_prefill_vs_scaled_mm"] == pytest.approx(chain["_scaled_mm"] / chain["fp8 gemm"])
    md = (dry_run[1] / "gpu_check.md").read_text()
    assert "## Harness" in md and "| w4a16 64x256 bf16 g128 M=1 | torch tinygemm |" in md


def test_the_gpu_plan_times_what_the_bars_read():
    """The plan a GPU runs (not the dry run's): the Llama-3-70B MLP shapes at the decode M values and M = 4096, the
    others at every M, and a timed case under every bar."""
    w4 = [c for c in gc.family_cases("w4a16", False, False) if c["timed"]]
    f8 = [c for c in gc.family_cases("fp8_gemm", False, False) if c["timed"]]
    for cases in (w4, f8):
        for shape in gc.LARGE_SHAPES:
            assert {c["M"] for c in cases if (c["N"], c["K"]) == shape} == {1, 16, 4096}
        assert {c["M"] for c in cases if (c["N"], c["K"]) == (8192, 8192)} == set(gc.MS)
    assert {(8192, 28672), (28672, 8192)} <= set(gc.SHAPES)
    for _, shape, m, _ in gc.W4A16_BARS:
        assert any((c["N"], c["K"], c["M"], c["dtype"], c["group"], c["zeros"]) == (*shape, m, "bfloat16", 128, False)
                   for c in w4)
    assert any(c["M"] == gc.FP8_LAYER_BAR[1] and c["scales"] == "row x channel" for c in f8)


def test_dry_run_covers_the_edge_cases(dry_run):
    rows = dry_run[2]["rows"]
    w4 = [r for r in rows if r["kernel"] == "w4a16" and "tile_err" in r]
    # every group size x zero point x dtype the kernel accepts
    assert {(r["dtype"], r["group"], r["zeros"]) for r in w4} == \
        {(dt, g, z) for dt in ("bfloat16", "float16") for g in GROUP_SIZES for z in (False, True)}
    assert {96, 192} <= {r["N"] for r in w4}                                # N % 64 != 0: one-strip blocks
    assert {(r["K"], r["k_padded"]) for r in w4 if r["k_padded"] != r["K"]} == {(576, 640), (200, 256), (64, 128)}
    assert {1, 3, 17, 65} <= {r["M"] for r in w4}                           # partial M tiles, not powers of two
    f8 = [r for r in rows if r["kernel"] == "fp8_gemm" and "tile_err" in r]
    assert {"row x channel", "tensor", "row x tensor", "tensor x channel"} == {r["scales"] for r in f8}
    assert {(136, 144), (8, 16)} <= {(r["N"], r["K"]) for r in f8}        # partial N and K tiles, smallest shape
    assert {(576, 576), (64, 200)} <= {(r["N"], r["K"]) for r in f8 if r["path"] == "layer"}  # quantize + GEMM
    # refusals are checked cases: the rule gives the reason and the path raises instead of running
    refused = {(r["kernel"], r["N"], r["K"]): r["refused"] for r in rows if "refused" in r}
    assert "N=100" in refused[("w4a16", 100, 256)] and "group_size=128" in refused[("w4a16", 64, 576)]
    assert "group_size=16" in refused[("w4a16", 64, 256)] and "multiple of 8" in refused[("fp8_gemm", 100, 256)]
    assert all(r["ok"] for r in rows if "refused" in r)
    quant = [r for r in rows if r["kernel"] == "fp8_quantize"]
    assert quant and all(r["wrong_codes"] == 0 and r["scales_ok"] and r["deterministic"] for r in quant)
    # each GEMM family proved once that its checker catches planted errors on a real output
    for fam in ("w4a16", "fp8_gemm"):
        assert sum("checker_selftest" in r for r in rows if r["family"] == fam) == 1
    (sanitizer,) = [r for r in rows if r["family"] == "sanitizer"]
    assert sanitizer["ok"] is None  # recorded, not a failure
    assert sanitizer["verdict"] in ("compute-sanitizer not installed", "not run in a dry run (CPU)")


def _reference_output(m=1024, n=4096, k=128, g=64):
    """A W4A16 output from the op's CPU reference path (decoding the kernel layout), with its float64 reference."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (n, k), generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
    z = torch.randint(0, 16, (n, k // g), generator=gen).float()
    x = (torch.randn(m, k, generator=gen) * 0.5).bfloat16()
    y = gpu.linear_w4a16(gpu.pack_w4a16(u, s, z, g, torch.bfloat16), x, None)
    return y, w4a16_reference(x, u, s.bfloat16().double(), z.double(), g)


def test_tile_check_catches_one_planted_tile_the_old_check_passes():
    """1024 x 4096 output, 16384 tiles. An error of 2.5% of the row RMS in one tile moves the whole-matrix error by
    2.5e-2 / sqrt(16384) = 2e-4 (on 4096 x 14336, by 5e-5): the old check passed it. Per element it is below the
    element bound (4 bf16 eps x (|ref| + row RMS) = 3.1% of the row RMS and more), so only the tile check sees it."""
    torch.set_num_threads(1)
    y, ref = _reference_output()
    tol, eps = gc.TOL["bfloat16"], gc.EPS["bfloat16"]
    clean = gc.judge(y, y, ref, tol, eps)
    assert clean["ok"] and clean["why"] == [], clean
    planted = gc.plant_tile_error(y, ref, (37, 201), 0.025)
    found = gc.judge(planted, planted, ref, tol, eps)
    assert found["rel_err"] <= tol  # what the whole-matrix check alone would have accepted
    assert found["bad"] == 0  # nor would an element-wise bound
    assert not found["ok"] and found["worst_tile"] == [37, 201]
    assert any(w.startswith("tile 37,201 (rows 592.., cols 3216..)") for w in found["why"]), found["why"]
    assert gc.checker_selftest(y, ref, tol, eps) == []


def test_element_count_and_poisoned_outputs():
    y, ref = _reference_output(m=40, n=96)
    tol, eps = gc.TOL["bfloat16"], gc.EPS["bfloat16"]
    one = y.clone()
    one[33, 70] += 0.3 * ref[33].pow(2).mean().sqrt().item()   # one element: invisible in any whole-tile norm
    found = gc.judge(one, one, ref, tol, eps)
    assert found["bad"] == 1 and found["first_bad"] == [33, 70] and not found["ok"]
    # every output allocation is NaN-poisoned while a case runs: an element the kernel never writes stays NaN
    never_written, _ = gc.run_twice(lambda: torch.empty(40, 96, dtype=torch.bfloat16), torch.device("cpu"))
    assert never_written.isnan().all() and not torch.are_deterministic_algorithms_enabled()
    unwritten = y.clone()
    unwritten[32:40, 16:32] = never_written[32:40, 16:32]       # an edge tile the kernel never wrote (M = 40)
    found = gc.judge(unwritten, unwritten, ref, tol, eps)
    assert not found["finite"] and found["bad"] == 128 and found["worst_tile"] == [2, 1] and not found["ok"]


def test_two_runs_must_agree_bit_for_bit():
    y, ref = _reference_output(m=20, n=64)
    other = y.clone()
    other.view(torch.int16)[3, 5] += 1  # one ulp: as accurate, not the same result
    found = gc.judge(y, other, ref, gc.TOL["bfloat16"], gc.EPS["bfloat16"])
    assert not found["ok"] and not found["deterministic"]
    assert found["why"] == ["nondeterministic (race?): the two runs differ in 1 element(s)"]
    nan = torch.full((2, 2), float("nan"))
    assert gc.differing(nan, nan.clone()) == 0  # the same bits are the same result, NaN included


def test_a_crash_or_a_hang_costs_one_row(tmp_path):
    """The child hangs in case 2 and aborts (as a CUDA fault does) in the last case: each of those cases gets a failed
    row saying what happened, and after the hang a fresh child runs the rest. The stall limit is 8 s, not 2: on a
    loaded 2-core machine a fresh child's first case (it imports torch) once took longer than 2 s."""
    last = len(gc.family_cases("fp8_quantize", True, False)) - 1
    rc = gc.main(["--dry-run", "--out", str(tmp_path), "--families", "fp8_quantize", "--no-sanitizer", "--stall", "8",
                  "--plant", f"fp8_quantize:2:hang,fp8_quantize:{last}:abort"])
    assert rc == 1
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["id"]: r for r in result["rows"]}
    assert sorted(rows) == list(range(last + 1))
    assert rows[2]["ok"] is False and rows[2]["crashed"] and "made no progress for 8 s (hang?)" in rows[2]["why"][0]
    assert rows[last]["ok"] is False and rows[last]["crashed"]
    assert "killed by SIGABRT during this case" in rows[last]["why"][0]
    assert all(rows[i]["ok"] for i in range(last) if i != 2)
    v = result["verdicts"]
    assert not v["all_correct"] and v["complete"] and v["failed_cases"] == {"fp8_quantize": 2}
    assert v[FP8_BAR] == gc.NOT_EVALUATED
    failures = (tmp_path / "gpu_check.md").read_text().split("## Failures")[1].split("##")[0]
    assert rows[last]["case"] in failures and "SIGABRT" in failures


def test_a_spent_budget_leaves_cases_not_run(tmp_path):
    assert gc.main(["--dry-run", "--out", str(tmp_path), "--families", "w4a16", "--no-sanitizer",
                    "--budget", "5"]) == 1
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["rows"] and all(r["ok"] is None and r["not_run"] == "the run's time budget is spent"
                                  for r in result["rows"])
    assert not result["verdicts"]["complete"] and not result["verdicts"]["all_correct"]


W4_BARS = [gc.bar_key(name, at_least) for name, _, _, at_least in gc.W4A16_BARS] + \
    [gc.bar_key(gc.DISPATCH_BAR[0], gc.DISPATCH_BAR[2])]
FP8_BAR = gc.bar_key(gc.FP8_LAYER_BAR[0], gc.FP8_LAYER_BAR[2])


def _w4_row(**kw) -> dict:
    """A timed W4A16 row as time_w4a16 summarizes one (the fields the bars read)."""
    row = dict(kernel="w4a16", family="w4a16", N=8192, K=8192, M=1, dtype="bfloat16", group=128, zeros=False, ok=True,
               vs_dense=1.5, best_single_vs_dense=1.5, best_impl="v1", chain_vs_dense=3.0,
               chain_vs_dense_by_impl={"v1": 3.0}, dispatch_choice="v1", dispatch_vs_dense=3.0,
               dispatch_vs_dense_single=1.5)
    row.update(kw)
    row["case"] = f"w4a16 {row['N']}x{row['K']} M={row['M']} {row['dtype']}"
    return row


def test_bars_read_the_right_rows():
    """Each bar takes the chain-mode ratio of our fastest implementation on its own rows only: the single-call ratio
    stands beside it and decides nothing."""
    rows = [
        _w4_row(K=28672, chain_vs_dense=3.1, chain_vs_dense_by_impl={"v1": 2.5, "v2": 3.1}, best_impl="v2",
                best_single_vs_dense=2.2, chain_vs_dense_baselines={"torch tinygemm": 2.8}),
        _w4_row(chain_vs_dense=2.5, chain_vs_dense_by_impl={"v1": 2.5}),            # 8192x8192, M = 1: below 2.6
        _w4_row(M=16, chain_vs_dense=2.3, chain_vs_dense_by_impl={"v1": 2.3}),      # above 2.2
        _w4_row(M=64, chain_vs_dense=0.5, dispatch_vs_dense=0.95),                  # in no shape bar
        _w4_row(M=4096, chain_vs_dense=0.3, dispatch_vs_dense=0.85, dispatch_choice="dequant+matmul"),
        _w4_row(M=8192, chain_vs_dense=0.1, dispatch_vs_dense=0.1),                 # beyond the dispatcher's bar
        _w4_row(dtype="float16", chain_vs_dense=1.0),                               # not bf16 g128: no shape bar
        dict(kernel="fp8_gemm", family="fp8_gemm", N=4096, K=4096, M=4096, case="fp8 a", ok=True, chain_vs_dense=1.6,
             chain_layer_vs_dense=1.5, chain_layer_vs_dense_by_impl={"ours": 1.5}, layer_impl="ours",
             layer_vs_dense=1.2, chain_vs_scaled_mm=0.7, chain_vs_scaled_mm_fast_accum=0.6),
        dict(kernel="fp8_gemm", family="fp8_gemm", N=8192, K=28672, M=4096, case="fp8 b", ok=True,
             chain_vs_dense=1.5, chain_layer_vs_dense=1.3, chain_layer_vs_dense_by_impl={"ours": 1.3},
             layer_impl="ours", layer_vs_dense=1.1),
        dict(kernel="fp8_gemm", family="fp8_gemm", N=4096, K=4096, M=16, case="fp8 c", ok=True, chain_vs_dense=0.2,
             chain_layer_vs_dense=0.2, chain_layer_vs_dense_by_impl={"ours": 0.2}),
    ]
    v = gc.verdicts(rows)
    d = v["bar_details"]
    assert v["w4a16_decode_large_ge_3x"] is True and v["w4a16_decode_large_vs_bf16"] == 3.1
    assert d["w4a16_decode_large"]["impl"] == "v2" and d["w4a16_decode_large"]["single_call"] == 2.2
    assert d["w4a16_decode_large"]["per_implementation"] == {"v1": 2.5, "v2": 3.1, "torch tinygemm": 2.8}
    assert v["w4a16_decode_ge_2_6x"] is False and v["w4a16_decode_vs_bf16"] == 2.5  # the fp16 row is not read
    assert v["w4a16_batch16_ge_2_2x"] is True and v["w4a16_batch16_vs_bf16"] == 2.3
    # the dispatcher's choice at every M up to 4096 (M = 8192 is outside), any format
    assert v["w4a16_dispatch_ge_0_9x"] is False and v["w4a16_dispatch_vs_bf16"] == 0.85
    assert d["w4a16_dispatch"]["at"].endswith("M=4096 bfloat16") and d["w4a16_dispatch"]["impl"] == "dequant+matmul"
    # the W8A8 layer (quantize + GEMM) at M = 4096 on every shape: 1.3 < 1.4 although the GEMM alone is 1.5x
    assert v[FP8_BAR] is False and v["fp8_layer_prefill_vs_bf16"] == 1.3 and d["fp8_layer_prefill"]["at"] == "fp8 b"
    assert v["fp8_gemm_prefill_vs_bf16"] == 1.5 and v["fp8_gemm_prefill_vs_scaled_mm"] == 0.7
    assert v["fp8_gemm_prefill_vs_scaled_mm_fast_accum"] == 0.6 and v["all_correct"]
    # a kernel that failed any correctness case gets no speed verdict, whatever its times
    failed_w4 = _w4_row(N=576, K=576, M=3, ok=False, chain_vs_dense=9.0)
    v = gc.verdicts(rows + [failed_w4])
    assert all(v[k] == gc.NOT_EVALUATED for k in W4_BARS) and "w4a16_decode_large_vs_bf16" not in v
    assert v[FP8_BAR] is False and not v["all_correct"]
    # the W8A8 bar needs the quantize kernel too, and a sanitizer error counts against the kernels it names
    for bad in (dict(kernel="fp8_quantize", M=3, ok=False),
                dict(kernel="compute-sanitizer", kernels=["fp8_gemm"], M=None, ok=False)):
        v = gc.verdicts(rows + [bad])
        assert v[FP8_BAR] == gc.NOT_EVALUATED and v["w4a16_decode_large_ge_3x"] is True
    # the cases a child ran under a sanitizer that could not run on the device do not count
    refused = [dict(kernel="compute-sanitizer", family="sanitizer", tool="memcheck", M=None, ok=None),
               dict(kernel="w4a16", family="sanitizer:memcheck", M=17, ok=False)]
    assert gc.verdicts(rows + refused)["all_correct"]
    assert gc.verdicts(rows + [dict(refused[0], ok=True), refused[1]])[W4_BARS[0]] == gc.NOT_EVALUATED
    # a case that never ran leaves the run incomplete, not correct
    v = gc.verdicts(rows + [dict(kernel="w4a16", M=1, ok=None, not_run="the run's time budget is spent")])
    assert not v["all_correct"] and not v["complete"]
    # a baseline torch gets wrong is reported, and fails none of ours
    v = gc.verdicts(rows + [_w4_row(M=2, baselines={"torch tinygemm": {"ok": False, "why": ["tile"]}})])
    assert v["inaccurate_baselines"] == {"torch tinygemm": 1} and v["all_correct"]


def test_chains_copy_the_weights_until_they_outgrow_the_l2():
    mib = 2 ** 20
    assert gc.chain_copies(8 * mib, 50 * mib) == (13, None)       # 8.4 MB int4 4096x4096: 13 copies > 100 MiB
    assert gc.chain_copies(470 * mib, 50 * mib) == (8, None)      # bf16 8192x28672: the 8 copies at least
    copies, note = gc.chain_copies(2 ** 30, 50 * mib)             # past the cap: fewer copies, said so
    assert copies == gc.CHAIN_CAP_BYTES // 2 ** 30 and "GiB cap" in note
    copies, note = gc.chain_copies(4, 50 * mib)                   # a tiny operand: the most copies, said so
    assert copies == gc.CHAIN_MAX_COPIES and "less than twice the L2" in note
    assert gc.percentiles([float(i) for i in range(1, 11)]) == {"p10": 1.9, "p50": 5.5, "p90": 9.1, "n": 10}
    # each layer of a chain reads its own copy (a transposed weight stays transposed), and the time is per layer
    timer = gc.Timer(torch.device("cpu"), 2, chain_repeats=2)
    w = torch.randn(8, 4).t()
    seen = []
    t = timer.chain(lambda op: seen.append((op[0].data_ptr(), op[0].stride(), float(op[0].sum()))), (w, 1))
    assert t["copies"] == 2 and t["n"] == 2 and len(seen) == 2 * 3 and t["bytes"] == 2 * w.nbytes
    assert len({p for p, _, _ in seen}) == 2 and {s for _, s, _ in seen} == {w.stride()}
    assert {v for _, _, v in seen} == {float(w.sum())}


def test_sanitizer_runs_are_recorded_and_gate_the_kernels_they_name(tmp_path):
    """run_sanitizer with a stand-in tool (a shell script printing what compute-sanitizer prints): memcheck clean,
    racecheck reporting a race in the W4A16 kernel. The cases it would run are run here in-process, on CPU."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\n"
                    'echo "$PYTORCH_NO_CUDA_MEMORY_CACHING $*" >> "$(dirname "$0")/args.txt"\n'
                    'if [ "$2" = racecheck ]; then\n'
                    '  echo "========= Error: Race reported between Write access at w4a16_kernel<1, 1, 1, true>+0x1a0"\n'
                    '  echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"\n'
                    'else echo "========= ERROR SUMMARY: 0 errors"; fi\n')
    fake.chmod(0o755)
    run = gc.Run(gc.parse_args(["--dry-run", "--out", str(tmp_path)]), tmp_path)
    gc.run_sanitizer(run, str(fake))
    calls = (tmp_path / "args.txt").read_text().splitlines()
    assert [c.split()[:3] for c in calls] == [["1", "--tool", "memcheck"], ["1", "--tool", "racecheck"]]
    assert "--child sanitizer:memcheck" in calls[0] and "--child sanitizer:racecheck" in calls[1]
    rows = gc.read_results(run.results)
    assert [(r["tool"], r["ok"], r["errors"]) for r in rows] == [("memcheck", True, 0), ("racecheck", False, 1)]
    assert rows[1]["kernels"] == ["w4a16"]
    v = gc.verdicts(rows)
    assert v[W4_BARS[0]] == gc.NOT_EVALUATED and FP8_BAR not in v and not v["all_correct"]
    # the cases the tool would wrap run as a child family of their own
    assert gc.child("sanitizer:memcheck", 0, tmp_path / "cases.jsonl", 1, True, False, 2, None) == 0
    cases = [r for r in gc.read_results(tmp_path / "cases.jsonl") if "event" not in r]
    assert {r["kernel"] for r in cases} == set(gc.FAMILIES) and all(r["ok"] for r in cases)


def test_sanitizer_reports_are_read(tmp_path, monkeypatch):
    clean = "========= COMPUTE-SANITIZER\n...\n========= ERROR SUMMARY: 0 errors\n"
    assert gc.parse_sanitizer(clean) == {"errors": 0, "warnings": 0, "families": []}
    race = ("========= Error: Race reported between Write access at w4a16_kernel<1, 1, 1, true>+0x1a0\n"
            "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")
    assert gc.parse_sanitizer(race) == {"errors": 1, "warnings": 1, "families": ["w4a16"]}
    refused = "========= Error: Device not supported\n========= Target application returned an error\n"
    assert gc.parse_sanitizer(refused)["errors"] is None  # the tool could not run: not a kernel failure
    tool = tmp_path / "bin" / "compute-sanitizer"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert gc.find_sanitizer() == str(tool)


def test_split_k_sweep_dry_run(tmp_path):
    """bench/w4a16_splits.py runs once per GPU session with no chance to fix it there: its dry run takes the same
    code path on the CPU (the op's reference path) and writes its results file."""
    spec = importlib.util.spec_from_file_location("w4a16_splits", SCRIPT.parent / "w4a16_splits.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert sweep.main(["--dry-run", "--out", str(tmp_path), "--ms", "1", "--splits", "1,2", "--tag", "t"]) == 0
    rows = json.loads((tmp_path / "w4a16_splits_t.json").read_text())["rows"]
    assert [(r["M"], sorted(r["us"])) for r in rows] == [(1, ["1", "2"])] and not rows[0]["mismatch"]


def test_in_model_check_dry_run(tmp_path):
    """bench/gpu_e2e.py's dry run: quantized tiny Llama and Qwen2, the dispatch planned and installed on the CPU
    kernels, every layer compared with its reference path on the model's own inputs (the hooks must see every
    QuantLinear, and the CPU int4 kernel must stay within the W4A16 bound)."""
    spec = importlib.util.spec_from_file_location("gpu_e2e", SCRIPT.parent / "gpu_e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    assert e2e.main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_e2e.json").read_text())["results"]
    assert [(r["family"], r["scheme"]) for r in results] == [(f, s) for f in e2e.CONFIGS for s in e2e.SCHEMES]
    for r in results:
        assert len(r["layer_rel_err"]) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
        assert r["ok"] and r["worst_layer_rel_err"] < e2e.BOUND[r["scheme"]]
    w4 = [r for r in results if r["scheme"].startswith("W4A16")]
    assert all(r["worst_layer_rel_err"] > 0 for r in w4)  # the CPU int4 kernel ran, not the reference path again
