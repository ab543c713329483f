"""RAPL arithmetic (`zeus_agent.agent.core.rapl`): wrap-around, cumulative energy, windows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_agent.agent.core.rapl import (
    CpuWindow,
    PackageReading,
    RaplDomain,
    RaplPackage,
    WrapCounter,
    answer_window,
    max_safe_power_w,
    wrapped_delta,
)

MAX = 262_143_328_850  # a common server package's max_energy_range_uj
S = 1_000_000_000


def test_delta_without_and_across_a_wrap() -> None:
    assert wrapped_delta(100, 250, 1000) == 150
    assert wrapped_delta(900, 50, 1000) == 150  # 900 -> 1000, then 0 -> 50
    assert wrapped_delta(500, 500, 1000) == 0


def test_counter_counts_wraps_as_zeus_does() -> None:
    c = WrapCounter(1000)
    assert c.add(800) == 0  # the first reading is where counting starts
    assert c.add(950) == 150
    assert c.add(20) == 220  # wrapped: 950 -> 1000 -> 20
    assert c.wraps == 1
    assert c.add(20) == 220
    assert (c.total_uj, c.last_raw_uj) == (220, 20)


def test_invalid_readings_are_ignored_never_taken_as_wraps() -> None:
    c = WrapCounter(1000)
    c.add(500)
    for bad in (-1, 1001, 10**12, True):
        assert c.add(bad) is None
    assert c.invalid == 4
    assert c.wraps == 0
    assert c.add(600) == 100


def test_peek_changes_nothing() -> None:
    c = WrapCounter(1000)
    assert c.peek(10) is None  # nothing to count from
    c.add(900)
    assert c.peek(100) == 200
    assert c.peek(2000) is None
    assert (c.total_uj, c.wraps, c.last_raw_uj) == (0, 0, 900)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, None])
def test_counter_needs_a_positive_integer_range(bad: object) -> None:
    with pytest.raises(ValueError, match="max_range_uj"):
        WrapCounter(bad)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    max_range=st.integers(10, 10**12),
    start=st.integers(0, 10**12),
    steps=st.lists(st.integers(0, 10**12), min_size=1, max_size=50),
)
def test_counter_recovers_the_true_energy_of_any_wrapping_series(
    max_range: int, start: int, steps: list[int]
) -> None:
    """Whatever the energy between readings (less than one wrap), the total is exact."""
    start %= max_range + 1
    steps = [s % max_range for s in steps]  # below one full wrap between two readings
    c = WrapCounter(max_range)
    c.add(start)
    true = wraps = 0
    raw = start
    for step in steps:
        true += step
        new = (raw + step) % max_range  # wraps at max_range, as Zeus's arithmetic takes it
        wraps += new < raw
        raw = new
        assert c.add(raw) == true
    assert c.wraps == wraps


def test_safe_power() -> None:
    assert max_safe_power_w(2**32, 0.1) == pytest.approx(42_949.67296)
    assert max_safe_power_w(MAX, 1.0) == pytest.approx(262_143.32885)


def domain(max_range: int = MAX) -> RaplDomain:
    return RaplDomain(max_range, capacity=64, max_extrapolation_ns=S)


def test_domain_interpolates_between_readings_across_a_wrap() -> None:
    d = domain(1_000_000_000)  # wraps at 1000 J
    d.record(0, 900_000_000)
    d.record(S, 100_000_000)  # 200 J in a second, across the wrap
    d.record(2 * S, 300_000_000)
    assert d.energy_j == pytest.approx(400.0)
    assert d.energy_between(0, S) == pytest.approx(200.0)
    assert d.energy_between(S // 2, 3 * S // 2) == pytest.approx(200.0)
    assert d.energy_between(S // 4, S // 2) == pytest.approx(50.0)
    assert d.counter.wraps == 1


def test_domain_fresh_reading_brackets_the_end_and_is_not_kept() -> None:
    d = domain(1_000_000_000)
    d.record(0, 990_000_000)
    d.record(S, 999_000_000)  # 9 W
    # A fresh reading 1 s later has wrapped: 100 J since the newest kept one.
    fresh = (2 * S, 99_000_000)
    assert d.energy_between(S, 3 * S // 2, fresh) == pytest.approx(50.0)
    assert d.energy_between(0, 2 * S, fresh) == pytest.approx(109.0)
    assert d.counter.wraps == 0 and len(d.ring) == 2  # nothing kept
    # Without it, the end is extrapolated with the last power (9 W).
    assert d.energy_between(S, 3 * S // 2) == pytest.approx(4.5)


def test_domain_never_gives_negative_energy() -> None:
    d = domain()
    d.record(0, 1000)
    d.record(S, 5000)
    with pytest.raises(ValueError):
        d.energy_between(S, 0)
    assert d.energy_between(S // 2, S // 2) == 0.0


def package(dram: bool = True) -> RaplPackage:
    return RaplPackage(0, 1_000_000_000, 500_000_000 if dram else None, 64, S)


def test_package_records_both_domains_and_skips_what_was_not_read() -> None:
    p = package()
    p.record(PackageReading(0, 0, 0))
    p.record(PackageReading(S, 100_000_000, 10_000_000))
    p.record(PackageReading(2 * S, 200_000_000, None))  # DRAM read failed
    assert p.cpu.energy_j == pytest.approx(200.0)
    assert p.dram is not None and p.dram.energy_j == pytest.approx(10.0)
    assert package(dram=False).dram is None


def packages() -> dict[int, RaplPackage]:
    p0, p1 = package(), RaplPackage(1, 1_000_000_000, None, 64, S)  # 1 has no DRAM (AMD)
    for t, raw in ((0, 0), (S, 100_000_000), (2 * S, 300_000_000)):
        p0.record(PackageReading(t, raw, raw // 10))
        p1.record(PackageReading(t, raw // 2, None))
    return {0: p0, 1: p1}


def test_window_of_every_package() -> None:
    w = answer_window(packages(), None, 0, 2 * S)
    assert w.cpus == (0, 1)
    assert w.cpu_j == pytest.approx((300.0, 150.0))
    assert w.dram_j[0] == pytest.approx(30.0) and w.dram_j[1] is None
    assert w.problem == ""
    cpu, dram = w.as_dicts()
    assert cpu == {0: pytest.approx(300.0), 1: pytest.approx(150.0)}
    assert dram == {0: pytest.approx(30.0)}  # only packages with a DRAM domain, as Zeus


def test_window_of_the_packages_asked_in_their_order() -> None:
    w = answer_window(packages(), [1, 0], S, 2 * S)
    assert w.cpus == (1, 0) and w.cpu_j == pytest.approx((100.0, 200.0))
    w = answer_window(packages(), [1], 0, S)
    assert w.as_dicts() == ({1: pytest.approx(50.0)}, None)  # no DRAM: None, as Zeus


def test_window_says_why_a_package_is_missing() -> None:
    w = answer_window(packages(), [0, 7], 0, S)
    assert w.cpus == (0,)
    assert "CPU indices [7] are not on this node" in w.problem and "[0, 1]" in w.problem
    w = answer_window(packages(), None, -5 * S, S)  # before the oldest reading kept
    assert w.cpus == () and "CPU 0:" in w.problem and "CPU 1:" in w.problem
    assert w.as_dicts() == (None, None)


def test_window_uses_fresh_readings() -> None:
    fresh = {0: PackageReading(3 * S, 400_000_000, 40_000_000)}
    w = answer_window(packages(), [0], 2 * S, 3 * S, fresh)
    assert w.cpu_j == pytest.approx((100.0,)) and w.dram_j == pytest.approx((10.0,))


def test_empty_window_and_reversed_window() -> None:
    assert answer_window({}, None, 0, 1) == CpuWindow()
    with pytest.raises(ValueError):
        answer_window(packages(), None, 2, 1)
