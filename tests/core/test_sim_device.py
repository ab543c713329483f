"""The simulated GPU device: shared state file, energy accrual, validation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fakes.clock import FakeClock
from zeus_agent.errors import GPUNotSupportedError, GPUValueError
from zeus_agent.gpu.base import GPU, GPUInfo
from zeus_agent.gpu.sim import PRESETS, WORKLOADS, SimGPU, create_sim_gpus


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_is_a_gpu_and_does_not_block(tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0)
    assert isinstance(gpu, GPU)
    assert SimGPU.calls_block is False


def test_two_handles_share_one_device(tmp_path: Path) -> None:
    agent = SimGPU.create(tmp_path, 0, "A40")
    trainer = SimGPU.open(tmp_path, 0)
    assert trainer.get_power_limit_w() == 300
    agent.set_power_limit_w(175)
    assert trainer.get_power_limit_w() == 175
    trainer.lock_sm_clocks_mhz(1200, 1200)
    assert agent.get_locked_sm_clocks_mhz() == (1200, 1200)
    agent.set_persistence_mode(True)
    assert trainer.get_persistence_mode() is True
    agent.reset_power_limit()
    agent.reset_sm_clocks()
    assert trainer.get_power_limit_w() == 300
    assert trainer.get_locked_sm_clocks_mhz() is None


def test_energy_idle_then_busy(tmp_path: Path, clock: FakeClock) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40", energy_update_ms=0, clock=clock)
    idle_w = PRESETS["A40"].idle_power_w
    assert gpu.get_total_energy_j() == 0.0
    clock.advance(2.0)
    assert gpu.get_total_energy_j() == pytest.approx(2.0 * idle_w)
    assert gpu.get_power_w() == pytest.approx(idle_w)

    trainer = SimGPU.open(tmp_path, 0, clock=clock)
    result = trainer.run_work(WORKLOADS["compute-bound"])
    assert result.duration_s > 0 and result.energy_j > idle_w * result.duration_s
    assert gpu.is_busy()
    assert gpu.get_sm_clock_mhz() == result.sm_clock_mhz
    assert gpu.get_power_w() == pytest.approx(result.energy_j / result.duration_s)
    clock.advance(result.duration_s / 2)
    assert gpu.get_total_energy_j() == pytest.approx(2.0 * idle_w + result.energy_j / 2)
    clock.advance(result.duration_s / 2 + 1.0)
    assert not gpu.is_busy()
    assert gpu.get_total_energy_j() == pytest.approx(3.0 * idle_w + result.energy_j)


def test_power_limit_change_applies_to_next_work(tmp_path: Path, clock: FakeClock) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40", energy_update_ms=0, clock=clock)
    wl = WORKLOADS["compute-bound"]
    fast = gpu.run_work(wl)
    clock.advance(fast.duration_s / 2)
    gpu.set_power_limit_w(100)  # folds energy mid-work; the work keeps its power
    clock.advance(fast.duration_s / 2)
    slow = gpu.run_work(wl)
    clock.advance(slow.duration_s)
    assert slow.duration_s > fast.duration_s
    assert slow.sm_clock_mhz < fast.sm_clock_mhz
    assert slow.energy_j / slow.duration_s < fast.energy_j / fast.duration_s
    assert gpu.get_total_energy_j() == pytest.approx(fast.energy_j + slow.energy_j)


def test_scale_and_queueing(tmp_path: Path, clock: FakeClock) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40", energy_update_ms=0, clock=clock)
    wl = WORKLOADS["compute-bound"]
    full = gpu.run_work(wl)
    half = gpu.run_work(wl, scale=0.5)  # queued behind the unfinished step
    assert half.duration_s == pytest.approx(full.duration_s / 2)
    assert half.energy_j == pytest.approx(full.energy_j / 2)
    clock.advance(full.duration_s * 1.25)
    assert gpu.is_busy()
    clock.advance(full.duration_s * 0.25 + 1e-6)
    assert not gpu.is_busy()
    assert gpu.get_total_energy_j() == pytest.approx(full.energy_j * 1.5, rel=1e-6)
    with pytest.raises(GPUValueError):
        gpu.run_work(wl, scale=0)


def test_locked_clock_runs_work_at_that_clock(tmp_path: Path, clock: FakeClock) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40", clock=clock)
    gpu.lock_sm_clocks_mhz(1005, 1005)
    assert gpu.run_work(WORKLOADS["compute-bound"]).sm_clock_mhz == 1005


def test_noise_is_seeded(tmp_path: Path, clock: FakeClock) -> None:
    wl = WORKLOADS["compute-bound"]
    a = SimGPU.create(tmp_path / "a", 0, seed=3, clock=clock)
    b = SimGPU.create(tmp_path / "b", 0, seed=3, clock=clock)
    assert a.get_uuid() == b.get_uuid()
    ra = [a.run_work(wl) for _ in range(5)]
    rb = [b.run_work(wl) for _ in range(5)]
    assert ra == rb
    assert len({r.duration_s for r in ra}) > 1
    quiet = SimGPU.create(tmp_path / "c", 0, clock=clock)
    assert len({quiet.run_work(wl).duration_s for _ in range(3)}) == 1
    r1 = quiet.run_work(wl, rng=random.Random(9))
    r2 = SimGPU.create(tmp_path / "d", 0, clock=clock).run_work(wl, rng=random.Random(9))
    assert r1 == r2


@pytest.mark.parametrize("bad", [99, 301, 0, -5])
def test_out_of_range_limit(tmp_path: Path, bad: int) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40")
    with pytest.raises(GPUValueError, match=rf"{bad} W .*100-300 W"):
        gpu.set_power_limit_w(bad)
    assert gpu.get_power_limit_w() == 300


def test_non_integer_limit(tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40")
    with pytest.raises(GPUValueError, match="integer"):
        gpu.set_power_limit_w(150.5)  # type: ignore[arg-type]


def test_unsupported_clocks(tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40")
    with pytest.raises(GPUValueError, match=r"1001 MHz .*210-1740 MHz"):
        gpu.lock_sm_clocks_mhz(210, 1001)
    with pytest.raises(GPUValueError, match="exceeds"):
        gpu.lock_sm_clocks_mhz(1740, 210)
    with pytest.raises(GPUValueError, match="memory clock"):
        gpu.get_supported_graphics_clocks_mhz(1234)
    assert gpu.get_locked_sm_clocks_mhz() is None


def test_no_energy_counter(tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0, "V100", has_energy_counter=False)
    assert not gpu.supports_energy_counter()
    with pytest.raises(GPUNotSupportedError, match="energy counter"):
        gpu.get_total_energy_j()
    assert gpu.get_power_w() > 0


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(GPUValueError, match="preset"):
        SimGPU.create(tmp_path, 0, "K80")


def test_info(tmp_path: Path) -> None:
    gpus = create_sim_gpus(tmp_path, 2, "V100")
    info = gpus[1].info()
    assert isinstance(info, GPUInfo)
    assert info.index == 1
    assert info.name == PRESETS["V100"].name
    assert info.architecture == "volta"
    assert (info.min_power_limit_w, info.max_power_limit_w) == (100, 250)
    assert info.default_power_limit_w == 250
    assert info.supported_graphics_clocks_mhz[0] == 1380
    assert info.supported_memory_clocks_mhz == (877,)
    assert info.has_energy_counter
    assert info.uuid.startswith("GPU-")
    assert gpus[0].get_uuid() != gpus[1].get_uuid()
    assert (tmp_path / "gpu0.json").exists() and (tmp_path / "gpu1.json").exists()
    assert gpus[0].get_memory_clock_mhz() == 877


def test_create_overwrites(tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40")
    gpu.set_power_limit_w(150)
    again = SimGPU.create(tmp_path, 0, "H100")
    assert again.get_power_limit_w() == 700
    assert SimGPU.open(tmp_path, 0).get_name() == PRESETS["H100"].name


def test_read_telemetry_agrees_with_the_getters(tmp_path):
    from zeus_agent.gpu.base import GPU

    now = [1_000_000_000]
    gpu = SimGPU.create(tmp_path, 0, "A40", clock=lambda: now[0])
    gpu.set_power_limit_w(200)
    gpu.lock_sm_clocks_mhz(900, 1200)
    now[0] += 2_000_000_000
    fast = gpu.read_telemetry()
    slow = GPU.read_telemetry(gpu)  # the generic, one-getter-per-field reading
    assert fast == slow
    assert fast.power_limit_w == 200 and fast.energy_j is not None and fast.energy_j > 0
    blind = SimGPU.create(tmp_path / "old", 0, "V100", has_energy_counter=False)
    assert blind.read_telemetry().energy_j is None
