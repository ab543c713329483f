"""The simulated GPU's coarse energy counter: a staircase with the device's update period."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fakes.clock import FakeClock
from zeus_agent.errors import GPUValueError
from zeus_agent.gpu.sim import PRESETS, WORKLOADS, SimGPU, create_sim_gpus
from zeus_agent.gpu.sim.device import STATE_VERSION

MS = 1_000_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000_000 + 37 * MS)


def _exact(gpu: SimGPU) -> float:
    """The exact accrued energy underneath the counter (J)."""
    return gpu._read().energy_at(gpu._clock())  # noqa: SLF001 - white-box check


def test_presets_default_to_100_ms_and_create_can_override(tmp_path: Path) -> None:
    for hw in PRESETS.values():
        assert hw.energy_update_ms == 100.0
    assert SimGPU.create(tmp_path / "a", 0).energy_update_ms == 100.0
    assert SimGPU.create(tmp_path / "b", 0, energy_update_ms=20).energy_update_ms == 20.0
    assert SimGPU.create(tmp_path / "c", 0, energy_update_ms=0).energy_update_ms == 0.0
    gpus = create_sim_gpus(tmp_path / "d", 2, energy_update_ms=50)
    assert [g.energy_update_ms for g in gpus] == [50.0, 50.0]
    with pytest.raises(GPUValueError, match="energy_update_ms"):
        SimGPU.create(tmp_path / "e", 0, energy_update_ms=-1)


def test_period_is_persisted_in_the_device_file(tmp_path: Path) -> None:
    SimGPU.create(tmp_path, 0, energy_update_ms=250)
    data = json.loads((tmp_path / "gpu0.json").read_text())
    assert data["version"] == STATE_VERSION
    assert data["energy_update_ns"] == 250 * MS
    assert SimGPU.open(tmp_path, 0).energy_update_ms == 250.0


def test_counter_is_a_staircase_on_the_clock_grid(tmp_path: Path, clock: FakeClock) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40", clock=clock)
    idle_w = PRESETS["A40"].idle_power_w
    start = clock.ns
    seen: list[tuple[int, float]] = []
    for _ in range(400):  # 400 ms in 1 ms steps
        clock.advance(0.001)
        seen.append((clock.ns, gpu.get_total_energy_j()))
    for t, e in seen:
        instant = t - t % (100 * MS)
        assert e == pytest.approx(max(0, instant - start) / 1e9 * idle_w, abs=1e-9)
    values = [e for _, e in seen]
    assert values == sorted(values)
    steps = [i for i in range(1, len(seen)) if values[i] != values[i - 1]]
    assert len(steps) == 4  # one update every 100 ms
    for i in steps:
        assert seen[i][0] % (100 * MS) == 0
    # Between updates the reading is flat; telemetry shows the same counter.
    assert gpu.read_telemetry().energy_j == gpu.get_total_energy_j()


def test_busy_work_and_settings_changes_keep_the_staircase_exact(
    tmp_path: Path, clock: FakeClock
) -> None:
    coarse = SimGPU.create(tmp_path / "coarse", 0, "A40", clock=clock)
    exact = SimGPU.create(tmp_path / "exact", 0, "A40", energy_update_ms=0, clock=clock)
    wl = WORKLOADS["compute-bound"]
    start = clock.ns
    exact_by_ns = {start: 0.0}
    for i in range(1, 700):  # 700 ms in 1 ms steps, with work and limit changes
        clock.advance(0.001)
        for gpu in (coarse, exact):
            if i % 97 == 3:
                gpu.set_power_limit_w(150 + i % 100)
            if i % 61 == 0:
                gpu.run_work(wl, scale=0.37)
        exact_by_ns[clock.ns] = exact.get_total_energy_j()
        # Exact accounting underneath; the counter shows it at the last 100 ms instant.
        assert _exact(coarse) == pytest.approx(exact_by_ns[clock.ns], rel=1e-12)
        instant = clock.ns - clock.ns % (100 * MS)
        expected = exact_by_ns[instant] if instant >= start else 0.0
        assert coarse.get_total_energy_j() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert coarse.read_telemetry().energy_j == coarse.get_total_energy_j()


def test_long_windows_telescope_short_windows_are_mostly_zero(
    tmp_path: Path, clock: FakeClock
) -> None:
    coarse = SimGPU.create(tmp_path / "coarse", 0, "A40", clock=clock)
    exact = SimGPU.create(tmp_path / "exact", 0, "A40", energy_update_ms=0, clock=clock)
    wl = WORKLOADS["compute-bound"]
    zero_ms_windows = 0
    ms_windows = 0
    t0 = (coarse.get_total_energy_j(), exact.get_total_energy_j())
    for step in range(40):  # 40 steps of ~0.3 s of work, read every millisecond
        for gpu in (coarse, exact):
            gpu.run_work(wl, scale=1.0 + 0.1 * (step % 3))
        while coarse.is_busy():
            before = coarse.get_total_energy_j()
            clock.advance(0.001)
            ms_windows += 1
            zero_ms_windows += coarse.get_total_energy_j() == before
    t1 = (coarse.get_total_energy_j(), exact.get_total_energy_j())
    total_coarse = t1[0] - t0[0]
    total_exact = t1[1] - t0[1]
    assert total_exact > 1000  # J over ~12 s of work
    # Telescoping: the window's error is at most one update period of power at each end.
    max_w = PRESETS["A40"].max_power_limit_w
    assert abs(total_coarse - total_exact) <= 2 * 0.1 * max_w
    assert abs(total_coarse / total_exact - 1) < 0.05
    # Over one millisecond the counter mostly does not move (99 of 100 windows).
    assert zero_ms_windows / ms_windows > 0.95


def test_reads_do_not_change_the_counter(tmp_path: Path, clock: FakeClock) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40", clock=clock)
    other = SimGPU.open(tmp_path, 0, clock=clock)
    clock.advance(0.25)
    a = gpu.get_total_energy_j()
    other.set_power_limit_w(200)  # a fold from another handle
    b = gpu.get_total_energy_j()
    c = other.read_telemetry().energy_j
    assert a == b == c
    assert a == pytest.approx(
        ((clock.ns - clock.ns % (100 * MS)) - (clock.ns - 250 * MS))
        / 1e9
        * PRESETS["A40"].idle_power_w
    )


def test_version_1_files_read_as_continuous(tmp_path: Path, clock: FakeClock) -> None:
    SimGPU.create(tmp_path, 0, "A40", clock=clock)
    path = tmp_path / "gpu0.json"
    data = json.loads(path.read_text())
    for key in ("energy_update_ns", "counter_ns", "counter_j"):
        del data[key]
    data["version"] = 1
    path.write_text(json.dumps(data))
    gpu = SimGPU.open(tmp_path, 0, clock=clock)
    assert gpu.energy_update_ms == 0.0
    clock.advance(0.0123)
    assert gpu.get_total_energy_j() == pytest.approx(0.0123 * PRESETS["A40"].idle_power_w)
