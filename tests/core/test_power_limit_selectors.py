"""Optimum selectors: seed semantics, tie rules, validation messages (table + property tests)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.power_limit import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
    zeus_cost,
)
from zeus_agent import models

PROFILES = Path(__file__).resolve().parents[2] / "data" / "reference-profiles"


def M(pl: int, energy: float, time: float) -> PowerLimitMeasurement:
    return PowerLimitMeasurement(power_limit=pl, energy=energy, time=time)


def test_measurement_is_the_models_class() -> None:
    assert PowerLimitMeasurement is models.PowerLimitMeasurement


# Zeus 0.16's selection code, verbatim in logic, as the oracle.
def seed_select(selector: OptimumSelector, ms: list[PowerLimitMeasurement]) -> int:
    if isinstance(selector, Energy):
        return min(ms, key=lambda x: x.energy).power_limit
    if isinstance(selector, Time):
        return min(ms, key=lambda x: x.time).power_limit
    if isinstance(selector, ZeusCost):
        max_power = max(m.power_limit for m in ms) * selector.world_size
        cmap = {
            m.power_limit: selector.eta_knob * m.energy
            + (1 - selector.eta_knob) * max_power * m.time
            for m in ms
        }
        return min(cmap, key=lambda x: cmap[x])
    assert isinstance(selector, MaxSlowdownConstraint)
    max_power = max(m.power_limit for m in ms)
    shortest = next(m.time for m in ms if m.power_limit == max_power)
    return min(m.power_limit for m in ms if m.time <= selector.factor * shortest)


TABLE = [
    # (selector, measurements highest first, expected)
    (Energy(), [M(300, 10, 1), M(250, 8, 2), M(200, 9, 3)], 250),
    (Energy(), [M(300, 8, 1), M(250, 8, 2), M(200, 9, 3)], 300),  # Tie -> higher.
    (Time(), [M(300, 10, 2), M(250, 8, 1), M(200, 9, 3)], 250),
    (Time(), [M(300, 10, 1), M(250, 8, 1), M(200, 9, 1)], 300),
    (ZeusCost(0.0), [M(300, 10, 2), M(250, 1, 2)], 300),  # eta 0: time only, tie -> higher.
    (ZeusCost(1.0), [M(300, 10, 2), M(250, 1, 2)], 250),  # eta 1: energy only.
    # eta 0.5, max_power 300: 300 -> 5+300=305, 250 -> 4+330=334.
    (ZeusCost(0.5), [M(300, 10, 1.0), M(250, 8, 1.1)], 300),
    # world_size 4 -> max_power 1200: 300 -> 50+1200, 250 -> 40+1200*1.001 = 1241.2 < 1250.
    (ZeusCost(0.5, world_size=4), [M(300, 100, 1.0), M(250, 80, 1.001)], 250),
    (MaxSlowdownConstraint(1.1), [M(300, 9, 1.0), M(250, 8, 1.1), M(200, 7, 1.2)], 250),
    (MaxSlowdownConstraint(1.0), [M(300, 9, 1.0), M(250, 8, 1.0), M(200, 7, 1.01)], 250),
    # Reference time is at the largest *measured* limit, wherever it sits in the list.
    (MaxSlowdownConstraint(1.5), [M(200, 7, 3.0), M(300, 9, 2.0)], 200),
    (MaxSlowdownConstraint(1.4), [M(200, 7, 3.0), M(300, 9, 2.0)], 300),
]


@pytest.mark.parametrize(("selector", "ms", "expected"), TABLE)
def test_table(selector: OptimumSelector, ms: list[PowerLimitMeasurement], expected: int) -> None:
    assert selector.select(ms) == expected
    assert seed_select(selector, ms) == expected


def _reference(path: Path) -> tuple[int, list[PowerLimitMeasurement]]:
    rows = list(csv.DictReader(path.open()))
    cols = [k for k in rows[0] if k.endswith("_energy")]
    return len(cols), [
        M(
            int(r["window_name"].rsplit("_", 1)[1]),
            sum(float(r[k]) for k in cols),
            float(r["elapsed_time"]),
        )
        for r in rows
    ]


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.csv")), ids=lambda p: p.stem)
def test_reference_profiles_match_seed(path: Path) -> None:
    n, ms = _reference(path)
    selectors: list[OptimumSelector] = [ZeusCost(e, n) for e in (0, 0.25, 0.5, 0.75, 1)]
    selectors += [Energy(), Time(), MaxSlowdownConstraint(1.1), MaxSlowdownConstraint(1.5)]
    for s in selectors:
        assert s.select(ms) == seed_select(s, ms)


def test_reference_known_picks() -> None:
    _, ms = _reference(PROFILES / "A40+resnet50+gpu0.csv")
    assert Energy().select(ms) == 175
    assert Time().select(ms) == 300
    _, ms = _reference(PROFILES / "V100+resnet18+gpu0,1.csv")
    assert Energy().select(ms) == 100


@pytest.mark.parametrize(
    "selector", [Energy(), Time(), ZeusCost(0.5), MaxSlowdownConstraint(1.2)],
    ids=["Energy", "Time", "ZeusCost", "MaxSlowdownConstraint"],
)
def test_empty_raises(selector: OptimumSelector) -> None:
    with pytest.raises(ValueError):
        selector.select([])


@pytest.mark.parametrize("eta", [-0.01, 1.01, -1, 2])
def test_zeus_cost_eta_validation(eta: float) -> None:
    with pytest.raises(ValueError) as e:
        ZeusCost(eta)
    assert str(e.value) == "eta_knob must be between 0 and 1, inclusive both sides."


@pytest.mark.parametrize("world_size", [0, -1])
def test_zeus_cost_world_size_validation(world_size: int) -> None:
    with pytest.raises(ValueError) as e:
        ZeusCost(0.5, world_size)
    assert str(e.value) == "world_size must be greater than or equal to 1."


@pytest.mark.parametrize("factor", [0.99, 0.0, -2.0])
def test_max_slowdown_validation(factor: float) -> None:
    with pytest.raises(ValueError) as e:
        MaxSlowdownConstraint(factor)
    assert (
        str(e.value) == f"max_slowdown_factor must be greater than or equal to 1.0. Got {factor}."
    )


def test_boundaries_accepted() -> None:
    ZeusCost(0.0)
    ZeusCost(1.0, world_size=1)
    MaxSlowdownConstraint(1.0)
    assert zeus_cost(energy=10, time=2, eta_knob=0.25, max_power=100) == 0.25 * 10 + 0.75 * 200


# Property tests --------------------------------------------------------------------------------

values = st.sampled_from([1.0, 2.0, 3.0, 5.0])  # Few values: many ties.


@st.composite
def measurement_lists(draw: st.DrawFn) -> list[PowerLimitMeasurement]:
    limits = draw(st.lists(st.integers(50, 700), min_size=1, max_size=12, unique=True))
    limits.sort(reverse=True)  # Stored highest first, as the machine and Zeus store them.
    return [M(pl, draw(values), draw(values)) for pl in limits]


selectors_st = st.one_of(
    st.just(Energy()),
    st.just(Time()),
    st.builds(ZeusCost, st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.integers(1, 8)),
)


def _cost(selector: OptimumSelector, ms: list[PowerLimitMeasurement]) -> dict[int, float]:
    if isinstance(selector, Energy):
        return {m.power_limit: m.energy for m in ms}
    if isinstance(selector, Time):
        return {m.power_limit: m.time for m in ms}
    assert isinstance(selector, ZeusCost)
    return selector.costs(ms)


@given(measurement_lists(), selectors_st)
def test_ties_go_to_the_higher_limit(
    ms: list[PowerLimitMeasurement], selector: OptimumSelector
) -> None:
    costs = _cost(selector, ms)
    lowest = min(costs.values())
    assert selector.select(ms) == max(pl for pl, c in costs.items() if c == lowest)
    assert selector.select(ms) == seed_select(selector, ms)


@given(measurement_lists(), st.sampled_from([1.0, 1.1, 2.0, 3.0]))
def test_max_slowdown_property(ms: list[PowerLimitMeasurement], factor: float) -> None:
    selector = MaxSlowdownConstraint(factor)
    pick = selector.select(ms)
    assert pick == seed_select(selector, ms)
    reference = next(m.time for m in ms if m.power_limit == max(x.power_limit for x in ms))
    assert next(m for m in ms if m.power_limit == pick).time <= factor * reference
    assert all(m.time > factor * reference for m in ms if m.power_limit < pick)
