"""The steal counter `estream bench` and `bench_engine` report beside each run."""

from __future__ import annotations

import os
import sys

import pytest

from estream_cli.bench import cpu_steal_s, parse_steal_ticks

STAT = """cpu  4705 356 584 3699 23 23 0 1234 0 0
cpu0 1393 179 280 1826 10 12 0 600 0 0
cpu1 3312 177 304 1873 13 11 0 634 0 0
intr 114930548 113199788 3 0 5 263 0 4 [...]
"""


def test_steal_is_the_eighth_field_of_the_machine_line() -> None:
    assert parse_steal_ticks(STAT) == 1234
    # the per-CPU lines do not stand in for the machine line
    assert parse_steal_ticks(STAT.split("\n", 1)[1]) is None


def test_steal_missing_on_old_kernels() -> None:
    assert parse_steal_ticks("cpu  4705 356 584 3699 23 23 0\n") is None
    assert parse_steal_ticks("") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_live_counter_reads_and_never_runs_backwards() -> None:
    def ticks() -> int:
        with open("/proc/stat") as f:
            t = parse_steal_ticks(f.read())
        assert t is not None
        return t

    hz = os.sysconf("SC_CLK_TCK")
    t0 = ticks()
    a = cpu_steal_s()
    b = cpu_steal_s()
    t1 = ticks()
    assert a is not None and b is not None
    # seconds, not ticks, between the counter read before and after
    assert t0 / hz <= a <= b <= t1 / hz
