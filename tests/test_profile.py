"""The run's profile: exclusive phase accounting (core/profile.py), the machine's measured peaks and the report's
profile section (measure/machine.py)."""
from __future__ import annotations

import threading

import pytest

from compress.core.profile import Profile, phase_of
from compress.measure.machine import machine_peaks, profile_lines, profile_section


class Clock:
    """A clock the test moves by hand: phase seconds are then exact."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_nested_phases_count_each_second_once_and_the_rest_is_unaccounted():
    clock = Clock()
    p = Profile(sync=lambda: None, clock=clock, startup=2.0)
    clock.t += 1  # before any phase: unaccounted
    with p.phase("compress"):
        clock.t += 3
        with p.phase("float forward", flop=6e9, dtype="bfloat16"):
            clock.t += 2
            with p.phase("statistics", flop=1e9):
                clock.t += 0.5
            clock.t += 0.5
        with p.phase("solves"):
            clock.t += 4
        clock.t += 1
    with p.phase("float forward", flop=2e9):  # a phase met again adds up
        clock.t += 1
    assert p.seconds == {"startup": 2.0, "compress": 4.0, "float forward": 3.5, "statistics": 0.5, "solves": 4.0}
    section = profile_section(p, {"matmul_gflop_per_s": {"float32": 4.0, "bfloat16": 8.0}, "read_gb_per_s": 1.0})
    assert section["wall_s"] == pytest.approx(2 + 1 + 11 + 1)
    assert section["unaccounted_s"] == pytest.approx(1.0)  # only the second outside every phase
    assert sum(r["seconds"] for r in section["phases"]) + section["unaccounted_s"] == pytest.approx(section["wall_s"])
    rows = {r["phase"]: r for r in section["phases"]}
    assert section["dominant"] in ("compress", "solves") and rows["solves"]["share"] == pytest.approx(4 / 15, abs=1e-4)
    forward = rows["float forward"]  # 8 GFLOP in 3.5 s, held against the bfloat16 peak (its last dtype)
    assert forward["rate"] == pytest.approx(8 / 3.5, rel=1e-2) and forward["of_peak"] == pytest.approx(8 / 3.5 / 8,
                                                                                                          rel=1e-2)
    assert rows["statistics"]["peak"] == 4.0  # float32 when no dtype is given
    text = "\n".join(profile_lines(section))
    assert "Profile: 15.0 s wall, 93.3% in the phases below" in text and "of a measured 8 bfloat16" in text


def test_work_on_a_helper_thread_is_overlapped_not_added_to_the_wall():
    clock = Clock()
    p = Profile(sync=lambda: None, clock=clock)
    with p.phase("solves"):
        def read():
            with p.phase("read", nbytes=4e9):
                clock.t += 2  # the helper's clock moves the shared clock too: still not the main thread's
        t = threading.Thread(target=read)
        t.start()
        t.join()
        clock.t += 1
    assert p.overlapped == {"read": 2.0} and p.seconds == {"solves": 3.0}
    section = profile_section(p, None)
    assert section["overlapped"] == {"read": 2.0} and [r["phase"] for r in section["phases"]] == ["solves"]


def test_phase_of_none_times_nothing():
    with phase_of(None, "read", nbytes=1):
        pass


def test_machine_peaks_are_probed_once_and_cached_per_thread_count(tmp_path):
    first = machine_peaks("cpu", 1, cache=tmp_path)
    assert not first["cached"] and first["matmul_gflop_per_s"]["float32"] > 1 and first["read_gb_per_s"] > 0
    again = machine_peaks("cpu", 1, cache=tmp_path)
    assert again["cached"] and again["matmul_gflop_per_s"] == first["matmul_gflop_per_s"]
    assert "1 threads" in again["key"] and not list(tmp_path.glob(".read-probe-*"))  # the probe file is gone
