"""The pure physics of the simulated GPU: shape of the curves, limits, locks and noise."""

from __future__ import annotations

import ast
import random
from dataclasses import replace
from pathlib import Path

import pytest

from zeus_agent.gpu.sim import PRESETS, WORKLOADS
from zeus_agent.gpu.sim.physics import (
    NoiseModel,
    WorkloadParams,
    busy_power_w,
    dynamic_shape,
    operating_point,
    step_time_s,
    throttle_clock_mhz,
)

A40 = PRESETS["A40"]


def test_physics_is_pure() -> None:
    path = Path(__file__).resolve().parents[2] / "zeus_agent/gpu/sim/physics.py"
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "nats", "pynvml", "time", "os", "pathlib", "datetime"}


@pytest.mark.parametrize("name", ["A40", "V100", "A100", "H100"])
def test_presets_are_consistent(name: str) -> None:
    hw = PRESETS[name]
    clocks = hw.supported_sm_clocks_mhz
    assert list(clocks) == sorted(clocks, reverse=True)
    assert hw.min_power_limit_w < hw.max_power_limit_w == hw.default_power_limit_w
    assert hw.idle_power_w < hw.static_power_w < hw.min_power_limit_w
    assert hw.min_sm_clock_mhz < hw.throttle_floor_clock_mhz < hw.voltage_floor_clock_mhz
    assert 2.0 <= hw.voltage_exponent <= 2.5


@pytest.mark.parametrize(
    ("name", "lo", "hi", "f_min", "f_max", "count"),
    [
        ("A40", 100, 300, 210, 1740, 103),
        ("V100", 100, 250, 135, 1380, 167),
        ("A100", 100, 400, 210, 1410, 81),
        ("H100", 200, 700, 210, 1980, 119),
    ],
)
def test_preset_tables(name: str, lo: int, hi: int, f_min: int, f_max: int, count: int) -> None:
    hw = PRESETS[name]
    assert (hw.min_power_limit_w, hw.max_power_limit_w) == (lo, hi)
    assert (hw.min_sm_clock_mhz, hw.max_sm_clock_mhz) == (f_min, f_max)
    assert len(hw.supported_sm_clocks_mhz) == count


def test_v100_clocks_are_nvml_like() -> None:
    assert PRESETS["V100"].supported_sm_clocks_mhz[:4] == (1380, 1372, 1365, 1357)


def test_dynamic_shape_linear_below_voltage_floor_steep_above() -> None:
    f_v = A40.voltage_floor_clock_mhz
    lo1, lo2 = dynamic_shape(A40, 0.3 * f_v), dynamic_shape(A40, 0.6 * f_v)
    assert lo2 / lo1 == pytest.approx(2.0)
    assert dynamic_shape(A40, A40.max_sm_clock_mhz) == pytest.approx(1.0)
    hi_ratio = dynamic_shape(A40, 1740) / dynamic_shape(A40, 1740 / 1.2)
    assert hi_ratio == pytest.approx(1.2**A40.voltage_exponent)


def test_step_time_overlap() -> None:
    serial = WorkloadParams(compute_s=0.1, floor_s=0.2, overlap_exponent=1.0)
    overlapped = replace(serial, overlap_exponent=40.0)
    assert step_time_s(serial, 0.1) == pytest.approx(0.3)
    assert step_time_s(overlapped, 0.1) == pytest.approx(0.2, rel=1e-6)
    assert step_time_s(WorkloadParams(compute_s=0.1), 0.1) == 0.1


def test_compute_bound_monotone_over_a40_range() -> None:
    wl = WORKLOADS["compute-bound"]
    points = [operating_point(A40, wl, w) for w in range(300, 99, -5)]
    for hi, lo in zip(points, points[1:], strict=False):
        assert lo.avg_power_w <= hi.avg_power_w + 1e-9
        assert lo.step_time_s >= hi.step_time_s - 1e-12
        assert lo.sm_clock_mhz <= hi.sm_clock_mhz
    assert points[-1].avg_power_w < points[0].avg_power_w
    assert points[-1].step_time_s > 1.5 * points[0].step_time_s


@pytest.mark.parametrize("limit", range(100, 301, 25))
def test_busy_power_respects_limit_above_clock_floor(limit: int) -> None:
    wl = WORKLOADS["compute-bound"]
    op = operating_point(A40, wl, limit)
    if op.sm_clock_mhz > A40.throttle_floor_clock_mhz:
        assert op.busy_power_w <= limit
        assert op.limit_held
    assert op.sm_clock_mhz in A40.supported_sm_clocks_mhz


def test_a40_resnet50_cannot_hold_100w() -> None:
    op = operating_point(A40, WORKLOADS["A40+resnet50+gpu0"], 100)
    assert op.avg_power_w > 100
    assert op.avg_power_w == pytest.approx(116, abs=6)
    assert not op.limit_held


def test_input_bound_job_keeps_time_and_saves_energy() -> None:
    wl = WORKLOADS["V100+resnet18+gpu0,1"]
    hi = operating_point(PRESETS["V100"], wl, 250)
    lo = operating_point(PRESETS["V100"], wl, 100)
    assert lo.step_time_s == pytest.approx(hi.step_time_s, rel=0.03)
    assert lo.energy_j < 0.8 * hi.energy_j


def test_clock_locks() -> None:
    wl = WORKLOADS["compute-bound"]
    free = operating_point(A40, wl, 300)
    capped = operating_point(A40, wl, 300, max_sm_clock_mhz=1200)
    assert capped.sm_clock_mhz == 1200
    assert capped.step_time_s > free.step_time_s
    pinned = operating_point(A40, wl, 100, max_sm_clock_mhz=210, min_sm_clock_mhz=210)
    assert pinned.sm_clock_mhz == 210
    # The power cap wins over locks, as on real GPUs: a locked minimum (or a pinned clock)
    # above what the limit allows is throttled down to the limit's clock.
    limited = operating_point(A40, wl, 100)
    raised = operating_point(A40, wl, 100, min_sm_clock_mhz=1200)
    assert raised.sm_clock_mhz == limited.sm_clock_mhz < 1200
    pinned_high = operating_point(A40, wl, 150, max_sm_clock_mhz=1740, min_sm_clock_mhz=1740)
    assert pinned_high.sm_clock_mhz == operating_point(A40, wl, 150).sm_clock_mhz < 1740
    assert pinned_high.busy_power_w <= 150


def test_continuous_clock_is_close_to_quantized() -> None:
    wl = WORKLOADS["A40+bert-base-uncased+gpu0"]
    for w in (125, 175, 225):
        c = throttle_clock_mhz(A40, wl, w, quantize=False)
        q = throttle_clock_mhz(A40, wl, w)
        assert 0 <= c - q < 15
        assert busy_power_w(A40, wl, c) == pytest.approx(w)


def test_noise_reproducible_and_off() -> None:
    op = operating_point(A40, WORKLOADS["compute-bound"], 200)
    noise = NoiseModel()
    a = [noise.perturb(op, r) for r in [random.Random(7)] for _ in range(50)]
    b = [noise.perturb(op, r) for r in [random.Random(7)] for _ in range(50)]
    assert a == b
    ratios = [p.step_time_s / op.step_time_s for p in a]
    assert min(ratios) > 0.94 and max(ratios) < 1.16
    assert any(abs(x - 1) > 1e-6 for x in ratios)
    assert NoiseModel.off().perturb(op, random.Random(1)) == op
    assert not NoiseModel.off().enabled


def test_noise_stalls_and_spread() -> None:
    op = operating_point(A40, WORKLOADS["compute-bound"], 200)
    stally = NoiseModel(jitter_rel=0.0, stall_probability=1.0, gpu_spread_rel=0.0)
    p = stally.perturb(op, random.Random(3))
    assert 1.05 <= p.step_time_s / op.step_time_s <= 1.10
    assert p.energy_j > op.energy_j
    factors = [NoiseModel().device_energy_factor(random.Random(i)) for i in range(200)]
    assert min(factors) >= 0.91 and max(factors) <= 1.09


def test_workload_validation() -> None:
    with pytest.raises(ValueError):
        WorkloadParams(compute_s=0.0, memory_s=0.0)
    with pytest.raises(ValueError):
        WorkloadParams(compute_s=0.1, overlap_exponent=0.5)
    with pytest.raises(ValueError):
        replace(A40, min_power_limit_w=400)
