"""Differential test: the selectors against Zeus 0.16's selection code, on random
measurement lists in any order, with duplicate limits and ties. Results must be identical."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.power_limit import (
    Energy,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
)


def seed_energy(ms):
    return min(ms, key=lambda x: x.energy).power_limit


def seed_time(ms):
    return min(ms, key=lambda x: x.time).power_limit


def seed_zeus_cost(ms, eta_knob, world_size):
    max_power = max(m.power_limit for m in ms) * world_size
    cost = {
        m.power_limit: eta_knob * m.energy + (1 - eta_knob) * max_power * m.time for m in ms
    }
    return min(cost, key=lambda x: cost[x])


def seed_max_slowdown(ms, factor):
    max_power = max(m.power_limit for m in ms)
    shortest = next(m.time for m in ms if m.power_limit == max_power)
    return min(m.power_limit for m in ms if m.time <= factor * shortest)


values = st.sampled_from([1.0, 1.5, 2.0, 2.5, 3.0, 10.0, 10.5, 11.0, 100.0])
measurement = st.builds(
    PowerLimitMeasurement,
    power_limit=st.sampled_from([100, 125, 150, 175, 200, 225, 250, 275, 300]),
    energy=values,
    time=values,
)
lists = st.lists(measurement, min_size=1, max_size=10)


@settings(max_examples=500, deadline=None)
@given(ms=lists, eta=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), world=st.integers(1, 8),
       factor=st.sampled_from([1.0, 1.05, 1.1, 1.5, 2.0]))
def test_selectors_match_zeus_016(ms, eta, world, factor):
    assert Energy().select(ms) == seed_energy(ms)
    assert Time().select(ms) == seed_time(ms)
    assert ZeusCost(eta, world_size=world).select(ms) == seed_zeus_cost(ms, eta, world)
    assert MaxSlowdownConstraint(factor).select(ms) == seed_max_slowdown(ms, factor)
