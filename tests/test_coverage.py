"""The coverage matrix (issue 45 item 5): every family compress claims (tests/coverage_families.py), as a tiny random
model of its transformers 5.25 config class, through RTN (here) and GPTQ and AWQ (slow): the run completes, every
parameter is quantized or listed with a reason, replaying the blocks one by one equals the model's own forward, and
AWQ has scaling pairs to apply. What does not work today is asserted to fail the way KNOWN says (a refusal naming the
cause, or an expected failure for a raw error), so docs/coverage.md (bench/coverage_matrix.py) states facts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.coverage_families import FAMILIES, KNOWN, REPLAY_TOLERANCE, Row, known, run_method

DOC = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
_ROWS: dict[tuple[str, str], Row] = {}  # one run per (family, method) in this process, shared by the tests


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    from tests.tiny_tokenizer import word_text
    path = tmp_path_factory.mktemp("coverage") / "calib.txt"
    path.write_text(word_text(1024) + "\n")
    return path


def _row(family: str, method: str, calib_file) -> Row:
    if (family, method) not in _ROWS:
        _ROWS[family, method] = run_method(family, method, calib_file)
    return _ROWS[family, method]


def _families(method: str) -> list:
    """The families, those that fail with a raw error today (KNOWN: error) as strict expected failures."""
    out = []
    for family in FAMILIES:
        k = known(family, method)
        marks = [pytest.mark.xfail(strict=True, reason=f"today: {k[1]}")] if k and k[0] == "error" else []
        out.append(pytest.param(family, marks=marks, id=family))
    return out


def _check(row: Row) -> None:
    k = known(row.family, row.method)
    if k and k[0] == "refused":
        assert row.status == "refused" and k[1] in row.reason, (
            f"{row.family} {row.method}: KNOWN says it is refused ({k[1]!r}); now: {row.status} {row.reason!r}. "
            "Update KNOWN in tests/coverage_families.py and rerun bench/coverage_matrix.py")
    else:
        assert row.ok, f"{row.family} {row.method}: {row.status}: {row.reason}"
    if row.arch:  # the blocks were found: what is checked before a run is true of refused families too
        assert row.replay_error <= REPLAY_TOLERANCE, f"block replay is off by {row.replay_error:.2e}"
        assert row.quantized + row.listed == row.params and row.quantized > 0
        assert row.pairs > 0, f"{row.family}: AWQ has no scaling pair to apply"


@pytest.mark.parametrize("family", _families("rtn"))
def test_every_family_runs_rtn_replays_exactly_and_has_awq_pairs(family, calib_file):
    """RTN through the runner with 64-token calibration windows (32-token sliding windows where the family has
    them); the pairs counted are those AWQ could scale under this plan (grouped heads skip v -> o)."""
    _check(_row(family, "rtn", calib_file))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("family", _families("gptq"))
def test_every_family_runs_gptq_and_awq(family, method, calib_file):
    """GPTQ and AWQ (+ RTN) on every family; AWQ scales pairs in its run (the report's count)."""
    row = _row(family, method, calib_file)
    _check(row)
    if method == "awq" and row.ok:
        assert row.pairs > 0 and row.pairs <= row.pair_slots


def test_known_failures_name_families_of_the_matrix():
    assert set(KNOWN) <= set(FAMILIES)


def _doc_statuses() -> dict[str, str]:
    """model_type -> the RTN status docs/coverage.md states."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| [^|]+ \| `([\w.-]+)` \| [^|]+ \| (\w+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_the_docs_matrix_states_what_runs_today(calib_file):
    """docs/coverage.md lists every family of the matrix with the RTN status it has now: regenerate it with
    `python bench/coverage_matrix.py` when a family starts (or stops) running."""
    stated = _doc_statuses()
    assert set(stated) == set(FAMILIES), "docs/coverage.md is out of date: run python bench/coverage_matrix.py"
    now = {f: _row(f, "rtn", calib_file).status for f in FAMILIES}
    assert stated == now, "docs/coverage.md is out of date: run python bench/coverage_matrix.py"
