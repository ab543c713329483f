"""EnergyRing: interpolation, extrapolation horizon, wrap-around, bad samples, counter resets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_agent.agent.core.energy_ring import EnergyRing, WindowOutOfRange
from zeus_agent.errors import ZeusAgentError

S = 1_000_000_000  # ns per second


def ring_of(
    samples: list[tuple[int, float]], capacity: int = 16, horizon_ns: int = S
) -> EnergyRing:
    ring = EnergyRing(capacity, max_extrapolation_ns=horizon_ns)
    for t, e in samples:
        ring.append(t, e)
    return ring


# 100 W from t=0 to 2 s, then 200 W to 3 s.
BASE = [(0, 0.0), (1 * S, 100.0), (2 * S, 200.0), (3 * S, 400.0)]


@pytest.mark.parametrize(
    ("t_ns", "expected_j"),
    [
        (0, 0.0),  # exactly the oldest
        (S // 2, 50.0),  # interpolated in the first segment
        (1 * S, 100.0),  # exactly a sample
        (2 * S + S // 4, 250.0),  # interpolated in the 200 W segment
        (3 * S, 400.0),  # exactly the newest
        (3 * S + S // 2, 500.0),  # extrapolated at the last power (200 W)
        (4 * S, 600.0),  # extrapolated, exactly at the horizon
    ],
)
def test_energy_at(t_ns: int, expected_j: float) -> None:
    assert ring_of(BASE).energy_at(t_ns) == pytest.approx(expected_j)


@pytest.mark.parametrize(
    ("t0", "t1", "energy_j", "power_w"),
    [
        (0, 2 * S, 200.0, 100.0),
        (S // 2, 2 * S + S // 2, 250.0, 125.0),
        (2 * S, 3 * S, 200.0, 200.0),
        (3 * S, 3 * S + S // 2, 100.0, 200.0),
    ],
)
def test_energy_and_power_between(t0: int, t1: int, energy_j: float, power_w: float) -> None:
    ring = ring_of(BASE)
    assert ring.energy_between(t0, t1) == pytest.approx(energy_j)
    assert ring.power_between(t0, t1) == pytest.approx(power_w)


@pytest.mark.parametrize(
    ("samples", "t_ns", "horizon_ns", "fragment"),
    [
        ([], 0, S, "No energy sample yet"),
        (BASE, -1, S, "before the oldest energy sample"),
        (BASE, 4 * S + 1, S, "beyond the extrapolation horizon"),
        (BASE, 3 * S + 1, 0, "beyond the extrapolation horizon"),
        ([(5, 1.0)], 6, S, "after the only energy sample"),
    ],
)
def test_out_of_range(
    samples: list[tuple[int, float]], t_ns: int, horizon_ns: int, fragment: str
) -> None:
    ring = ring_of(samples, horizon_ns=horizon_ns)
    with pytest.raises(WindowOutOfRange, match=fragment) as info:
        ring.energy_at(t_ns)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ZeusAgentError)
    assert info.value.t_ns == t_ns
    assert info.value.span_ns == ring.span()
    if samples:
        assert str(t_ns) in str(info.value)
        span = ring.span()
        assert span is not None
        assert f"[{span[0]}, {span[1]}]" in str(info.value) or "only energy sample" in str(
            info.value
        )


def test_per_call_horizon_override() -> None:
    ring = ring_of(BASE, horizon_ns=0)
    assert ring.energy_at(3 * S + S // 2, max_extrapolation_ns=S) == pytest.approx(500.0)


def test_single_sample_answers_exactly_at_it() -> None:
    ring = ring_of([(5, 7.0)])
    assert ring.energy_at(5) == 7.0
    assert ring.last_power_w() is None


@pytest.mark.parametrize(
    ("t0", "t1", "method"),
    [(2, 1, "energy_between"), (2, 1, "power_between"), (1, 1, "power_between")],
)
def test_bad_window_order(t0: int, t1: int, method: str) -> None:
    ring = ring_of(BASE)
    with pytest.raises(ValueError, match="before its start|must be after its start"):
        getattr(ring, method)(t0, t1)


def test_empty_window_has_zero_energy() -> None:
    assert ring_of(BASE).energy_between(S, S) == 0.0


@pytest.mark.parametrize("capacity", [0, 1, -3])
def test_capacity_must_be_at_least_two(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        EnergyRing(capacity)


def test_wraparound_keeps_newest_and_forgets_oldest() -> None:
    ring = EnergyRing(4)
    for i in range(10):  # 10 W: 10 J per second
        ring.append(i * S, 10.0 * i)
    assert len(ring) == 4
    assert ring.span() == (6 * S, 9 * S)
    assert ring.latest() == (9 * S, 90.0)
    assert ring.energy_between(6 * S + S // 2, 8 * S + S // 4) == pytest.approx(17.5)
    with pytest.raises(WindowOutOfRange, match="before the oldest"):
        ring.energy_at(5 * S)


@pytest.mark.parametrize(
    ("samples", "accepted", "dropped_order", "dropped_invalid"),
    [
        ([(0, 0.0), (1, 1.0), (1, 2.0)], 2, 1, 0),  # duplicate time
        ([(0, 0.0), (2, 2.0), (1, 1.0)], 2, 1, 0),  # out of order
        ([(0, 0.0), (1, math.nan), (2, math.inf)], 1, 0, 2),  # non-finite energies
    ],
)
def test_bad_samples_are_ignored_and_counted(
    samples: list[tuple[int, float]], accepted: int, dropped_order: int, dropped_invalid: int
) -> None:
    ring = EnergyRing(8)
    results = [ring.append(t, e) for t, e in samples]
    assert sum(results) == accepted == len(ring)
    assert ring.dropped_out_of_order == dropped_order
    assert ring.dropped_invalid == dropped_invalid


def test_counter_reset_carries_offset_and_stays_monotone() -> None:
    ring = EnergyRing(8)
    raw = [(0, 1000.0), (1 * S, 1100.0), (2 * S, 5.0), (3 * S, 105.0), (4 * S, 3.0), (5 * S, 53.0)]
    for t, e in raw:
        assert ring.append(t, e)
    assert ring.counter_resets == 2
    stored = [ring.energy_at(t) for t, _ in raw]
    assert stored == pytest.approx([1000.0, 1100.0, 1100.0, 1200.0, 1200.0, 1250.0])
    assert ring.energy_between(0, 5 * S) == pytest.approx(250.0)  # the reset gaps count as zero


def test_clear_forgets_samples() -> None:
    ring = ring_of(BASE)
    ring.clear()
    assert len(ring) == 0
    assert ring.span() is None
    assert ring.latest() is None


# ---------------------------------------------------------------------------- properties

samples_strategy = st.lists(
    st.tuples(
        st.integers(min_value=1, max_value=10 * S),  # time increment (ns)
        st.floats(min_value=0.0, max_value=1e4, allow_nan=False),  # energy increment (J)
    ),
    min_size=2,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(
    increments=samples_strategy,
    capacity=st.integers(min_value=2, max_value=64),
    fractions=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=3, max_size=3),
)
def test_energy_between_is_additive_and_monotone(
    increments: list[tuple[int, float]], capacity: int, fractions: list[float]
) -> None:
    ring = EnergyRing(capacity, max_extrapolation_ns=S)
    t, e = 0, 0.0
    for dt, de in increments:
        t += dt
        e += de
        ring.append(t, e)
    span = ring.span()
    assert span is not None
    lo, hi = span[0], span[1] + S  # include the extrapolated stretch
    a, b, c = sorted(lo + int((hi - lo) * f) for f in fractions)
    e_ab = ring.energy_between(a, b)
    e_bc = ring.energy_between(b, c)
    e_ac = ring.energy_between(a, c)
    assert e_ab >= 0.0 and e_bc >= 0.0
    assert e_ab + e_bc == pytest.approx(e_ac, rel=1e-9, abs=1e-6)
    # Monotone: the cumulative energy never decreases with time.
    assert ring.energy_at(a) <= ring.energy_at(b) + 1e-9 * max(1.0, abs(ring.energy_at(b)))
    assert ring.energy_at(b) <= ring.energy_at(c) + 1e-9 * max(1.0, abs(ring.energy_at(c)))


@settings(max_examples=100, deadline=None)
@given(
    raw=st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=S),
            st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_series_is_monotone_whatever_the_raw_counter_does(raw: list[tuple[int, float]]) -> None:
    ring = EnergyRing(32)
    t = 0
    for dt, e in raw:
        t += dt
        ring.append(t, e)
    values = []
    tt = 0
    for dt, _ in raw:
        tt += dt
        values.append(ring.energy_at(tt))
    assert all(x <= y for x, y in zip(values, values[1:], strict=False))
