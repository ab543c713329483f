"""The energy counter's update period, as the agent learns it and announces it for a GPU.

The coordinator lengthens power-limit windows shorter than a few periods
(`coordinator.power_limit.window_length`): the agent says the period its reads learned
(`CounterReader.update_period_ms` -> `GpuDescription.energy_period_ms`), 0 for a counter that
changed at every read, nothing while it is still learning.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.core.counter_kit import MS, Counter, drive
from zeus_agent.agent.core.counter_phase import PhaseState, ReadPolicy
from zeus_agent.agent.core.energy_ring import EnergyRing
from zeus_agent.agent.counter_reader import CounterReader
from zeus_agent.errors import PayloadError
from zeus_agent.gpu.base import GPUInfo
from zeus_agent.wire import codec
from zeus_agent.wire.messages import GpuDescription


def reader(policy: ReadPolicy) -> CounterReader:
    caller: Any = SimpleNamespace(gpu=object())
    return CounterReader(caller, EnergyRing(64), 100 * MS, policy=policy)


def test_a_100_ms_counter_is_announced_once_its_grid_is_known() -> None:
    policy = ReadPolicy()
    announced = reader(policy)
    assert policy.period_bounds_ns is None and announced.update_period_ms is None
    drive(policy, Counter().value_at, 600 * MS)  # Learning: nothing said yet.
    assert policy.state is PhaseState.LEARNING and policy.period_bounds_ns is not None
    assert announced.update_period_ms is None
    drive(policy, Counter().value_at, 20_000 * MS)
    assert policy.locked
    lo, hi = policy.period_bounds_ns or (0, 0)
    assert 99 * MS < lo <= hi < 101 * MS
    assert announced.update_period_ms == pytest.approx(100.0, abs=0.5)


def test_a_counter_that_changes_at_every_read_is_announced_as_continuous() -> None:
    policy = ReadPolicy(fallback_interval_ns=50 * MS)
    announced = reader(policy)
    # While learning, its grid narrows against the shortest period the reads can see (40 ms):
    # no period of the counter's, and nothing is said (a job's windows would be lengthened).
    drive(policy, lambda t: 300.0 * t / 1e9, 250 * MS, seed=9)
    assert policy.state is PhaseState.LEARNING
    lo, hi = policy.period_bounds_ns or (0, 0)
    assert hi - lo < 0.1 * hi and announced.update_period_ms is None
    drive(policy, lambda t: 300.0 * t / 1e9, 5_000 * MS, seed=9)
    assert policy.state is PhaseState.PLAIN
    assert announced.update_period_ms == 0.0
    integrated = reader(ReadPolicy())
    integrated.use_integrator()  # (A GPU without a counter: its power integrated.)
    assert integrated.update_period_ms == 0.0


# A simulated continuous counter (`--sim-energy-update-ms 0`) read by a loaded agent: 20 ms
# apart, each read taking 2-18 ms, every value changed (recorded in tests/e2e's power-limit run).
SLOW_READS_OF_A_CONTINUOUS_COUNTER = [
    (3129325827768, 3129332708870, 0.94029363), (3129408979035, 3129413332172, 3.46968564),
    (3129444331300, 3129462543230, 4.72769223), (3129465618966, 3129471432439, 5.26550091),
    (3129495653753, 3129498150802, 6.03124908), (3129540050897, 3129543430958, 7.42518339),
    (3129563771123, 3129571359898, 8.12463462), (3129616054750, 3129620041837, 9.64471329),
    (3129654095053, 3129658624541, 10.82639037), (3129690809085, 3129698000326, 11.95682793),
]


def test_a_continuous_counter_read_slowly_is_not_locked_onto_the_shortest_visible_period() -> None:
    """Reads that all changed narrowed the grid against 40 ms (twice the learning interval, the
    shortest period they can see) and the policy locked there: the counter was announced as a
    40 ms one and a job's windows lengthened for nothing. Only a counter seen holding its value
    is locked onto; this one goes PLAIN after 8 changed reads."""
    policy = ReadPolicy(fallback_interval_ns=50 * MS)
    announced = reader(policy)
    states = []
    for read in SLOW_READS_OF_A_CONTINUOUS_COUNTER:
        policy.on_read(*read)
        states.append(policy.state)
    assert PhaseState.LOCKED not in states
    assert policy.state is PhaseState.PLAIN and announced.update_period_ms == 0.0


INFO = GPUInfo(index=0, name="NVIDIA A40", uuid="GPU-0", architecture="Ampere",
               min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
               supported_memory_clocks_mhz=(7251,), supported_graphics_clocks_mhz=(1740, 210),
               has_energy_counter=True)


def test_the_description_carries_the_period_only_when_known() -> None:
    unknown = GpuDescription.from_info(INFO, 300)
    assert "energy_period_ms" not in unknown.model_dump()  # (Not sent: older coordinators.)
    known = GpuDescription.from_info(INFO, 300, energy_period_ms=100.0)
    assert codec.decode(codec.encode(known), GpuDescription).energy_period_ms == 100.0
    continuous = GpuDescription.from_info(INFO, 300, energy_period_ms=0.0)
    assert codec.decode(codec.encode(continuous), GpuDescription).energy_period_ms == 0.0
    for bad in (-1.0, 1e9):
        with pytest.raises(PayloadError):
            codec.validate(GpuDescription, {**known.model_dump(), "energy_period_ms": bad})


def test_the_reader_logs_when_its_counter_locks_loses_and_regains_its_grid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A counter that skips 6 updates (it holds its value 700 ms, then goes on on its grid)
    loses the lock and regains it ~2 s later, and the reader says so: an operator (and the e2e
    test that bounds a window's error by it) can tell when a GPU's knots were placed between
    reads instead of on the grid. Before, the second miss's bound left the policy LOCKED with
    no grid: the next plan raised, and the agent's reader never read that GPU again."""
    policy = ReadPolicy()
    announced = reader(policy)
    announced.gpu = SimpleNamespace(index=3)
    counter = Counter()
    counter.updates = [u for u in counter.updates if not 5_000 * MS < u < 5_600 * MS]
    feeding = SimpleNamespace(next_read_at=policy.next_read_at, on_read=announced.feed,
                              locked=False)
    caplog.set_level("INFO", logger="zeus_agent.agent.counter_reader")
    drive(feeding, counter.value_at, 20_000 * MS)  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records]
    locked = [m for m in said if "locked on its" in m]
    lost = [m for m in said if "lost its update grid (now learning)" in m]
    assert len(lost) == 1 and len(locked) == 2, said
    assert all(m.startswith("GPU 3: energy counter") for m in said), said
    assert said.index(locked[0]) < said.index(lost[0]) < said.index(locked[1])
    assert announced.phase_changes == 3 and policy.locked
    assert announced.update_period_ms == pytest.approx(100.0, abs=1.0)
