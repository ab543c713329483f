"""The simulated NVML's timing model against the H200 recordings, its driver lock and its flags.

Distribution checks compare a seeded model's drawn costs with `data/real-gpu/h200/` (never wall
time); the lock checks order calls with events, not durations.
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import statistics
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from zeus_agent.config import AgentSettings
from zeus_agent.errors import GPUValueError
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.gpu.sim.timing import (
    CallKind,
    DriverQueue,
    NvmlTiming,
    QuantileTable,
    timing_preset,
)
from zeus_agent.gpu.threaded import GPUCaller

DATA = Path(__file__).resolve().parents[2] / "data" / "real-gpu" / "h200"
RECORDED = json.loads((DATA / "nvml_calls.json").read_text())["alone"]
H200 = timing_preset("h200")
MS = 1_000_000
GETTERS = {
    CallKind.POWER: "power_usage",
    CallKind.POWER_INSTANT: "power_instant_field",
    CallKind.POWER_LIMIT: "power_limit",
    CallKind.SM_CLOCK: "sm_clock",
    CallKind.MEM_CLOCK: "mem_clock",
    CallKind.TEMPERATURE: "temperature",
    CallKind.UTILIZATION: "utilization",
}


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _draws(kind: CallKind, n: int = 20_000, seed: int = 5) -> list[float]:
    rng = random.Random(seed)
    return [H200.quantile_s(kind, rng.random()) for _ in range(n)]


def _trace() -> list[tuple[int, int, int]]:
    with gzip.open(DATA / "trace_counter.csv.gz", "rt") as fh:
        return [(int(r["t0_ns"]), int(r["t1_ns"]), int(r["energy_mj"])) for r in csv.DictReader(fh)]


def _observed_periods_ms(reads: list[tuple[float, int]]) -> list[float]:
    """Periods as a back-to-back reader sees them: between the midpoints of the brackets."""
    changes = [
        (reads[i - 1][0] + reads[i][0]) / 2
        for i in range(1, len(reads))
        if reads[i][1] != reads[i - 1][1]
    ]
    return [(b - a) / MS for a, b in zip(changes, changes[1:], strict=False)]


# The recorded distributions.
@pytest.mark.parametrize(("kind", "key"), GETTERS.items())
def test_getter_costs_match_the_recorded_medians(kind: CallKind, key: str) -> None:
    draws = _draws(kind)
    assert statistics.median(draws) == pytest.approx(RECORDED[key]["p50_us"] / 1e6, rel=0.10)
    assert _q(draws, 0.9) == pytest.approx(RECORDED[key]["p90_us"] / 1e6, rel=0.10)
    assert max(draws) <= RECORDED[key]["max_us"] / 1e6


def test_counter_read_cost_matches_the_recordings() -> None:
    draws = _draws(CallKind.ENERGY)
    costs = [(t1 - t0) / 1e9 for t0, t1, _ in _trace()]
    median = statistics.median(draws)
    assert median == pytest.approx(statistics.median(costs), rel=0.10)
    assert median == pytest.approx(RECORDED["total_energy"]["p50_us"] / 1e6, rel=0.10)
    assert _q(draws, 0.9) == pytest.approx(_q(costs, 0.9), rel=0.10)
    # Plausible beside the idle-GPU table: the trace ran mostly under load, slower at p90.
    assert RECORDED["total_energy"]["p90_us"] / 1e6 <= _q(draws, 0.9) <= 1.5 * (
        RECORDED["total_energy"]["p90_us"] / 1e6
    )
    assert H200.p99_s(CallKind.ENERGY) == pytest.approx(_q(costs, 0.99), rel=0.10)
    assert H200.median_s(CallKind.ENERGY) == pytest.approx(median, rel=0.02)


def test_setters_cost_the_parameter_and_none_costs_nothing() -> None:
    assert H200.quantile_s(CallKind.SET, 0.3) == pytest.approx(1e-3)
    assert timing_preset("h200", 0.15).p99_s(CallKind.SET) == pytest.approx(0.15e-3)
    assert timing_preset("h200", 3).median_s(CallKind.SET) == pytest.approx(3e-3)
    none = timing_preset("none", set_latency_ms=3)
    rng = random.Random(1)
    assert all(none.quantile_s(k, rng.random()) == 0.0 for k in CallKind for _ in range(50))
    assert not none.charges and none.counter is None
    assert H200.charges and H200.counter is not None


def test_unknown_presets_and_negative_costs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'h200', 'none'"):
        timing_preset("h100")
    with pytest.raises(ValueError, match=">= 0"):
        timing_preset("h200", -1)
    with pytest.raises(GPUValueError, match="unknown NVML timing model"):
        SimGPU.create(tmp_path, 0, timing="fast")


def test_only_the_counter_the_power_limit_and_setters_are_serialised() -> None:
    serialised = {k for k in CallKind if NvmlTiming.serialised(k)}
    assert serialised == {CallKind.ENERGY, CallKind.POWER_LIMIT, CallKind.SET}


# The counter's updates.
def test_update_periods_are_100_ms_with_the_recorded_jitter() -> None:
    jitter = H200.counter
    assert jitter is not None
    instants = [jitter.instant_ns("GPU-a", k, 100 * MS) for k in range(5000)]
    periods = [(b - a) / MS for a, b in zip(instants, instants[1:], strict=False)]
    assert statistics.median(periods) == pytest.approx(100.0, abs=0.1)
    # The recorded updates bracketed within 4 ms (the true jitter, not the reads'): 98-102 ms.
    rows = _trace()
    reads = [((t0 + t1) / 2, e) for t0, t1, e in rows]
    narrow = [
        (reads[i - 1][0] + reads[i][0]) / 2
        for i in range(1, len(reads))
        if reads[i][1] != reads[i - 1][1] and reads[i][0] - reads[i - 1][0] < 4 * MS
    ]
    recorded = [
        (b - a) / MS for a, b in zip(narrow, narrow[1:], strict=False) if (b - a) < 150 * MS
    ]
    for q in (0.05, 0.5, 0.95):
        assert _q(periods, q) == pytest.approx(_q(recorded, q), abs=0.5)
    assert 97.0 < _q(periods, 0.05) < 99.0 and 101.0 < _q(periods, 0.95) < 103.0


def test_read_back_to_back_the_model_shows_the_recorded_spread() -> None:
    """The recording's 93.6-106.2 ms is what slow reads make of the counter: replay them."""
    jitter = H200.counter
    assert jitter is not None
    rows = _trace()
    recorded = _observed_periods_ms([((t0 + t1) / 2, e) for t0, t1, e in rows])
    gaps = [b[0] - a[1] for a, b in zip(rows, rows[1:], strict=False)]
    rng = random.Random(11)
    now, reads = 0, []
    while now < 120_000 * MS:
        cost = round(H200.quantile_s(CallKind.ENERGY, rng.random()) * 1e9)
        mid = now + cost // 2
        reads.append((float(mid), jitter.last_update_ns("GPU-b", mid, 100 * MS)))
        now += cost + rng.choice(gaps)
    model = _observed_periods_ms(reads)
    assert _q(recorded, 0.05) == pytest.approx(93.6, abs=0.1)
    assert _q(recorded, 0.95) == pytest.approx(106.2, abs=0.2)
    assert statistics.median(model) == pytest.approx(100.0, abs=0.5)
    assert _q(model, 0.05) == pytest.approx(_q(recorded, 0.05), abs=1.5)
    assert _q(model, 0.95) == pytest.approx(_q(recorded, 0.95), abs=1.5)


def test_last_update_is_the_latest_instant_at_or_before_now() -> None:
    jitter = H200.counter
    assert jitter is not None
    rng = random.Random(3)
    for period in (100 * MS, 10 * MS):
        for _ in range(2000):
            now = rng.randrange(-10**12, 10**12)
            last = jitter.last_update_ns("GPU-c", now, period)
            k = round((last - jitter.phase_ns("GPU-c", period)) / period)
            assert jitter.instant_ns("GPU-c", k, period) == last <= now
            assert jitter.instant_ns("GPU-c", k + 1, period) > now
    assert jitter.phase_ns("GPU-c", 100 * MS) != jitter.phase_ns("GPU-d", 100 * MS)


class FakeTime:
    """A device clock that only a (fake) sleep advances."""

    def __init__(self) -> None:
        self.ns = 10**12 + 7 * MS
        self.slept: list[float] = []

    def clock(self) -> int:
        return self.ns

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.ns += round(seconds * 1e9)


def test_processes_agree_on_the_jittered_counter(tmp_path: Path) -> None:
    t = FakeTime()
    agent = SimGPU.create(tmp_path, 0, "H100", seed=4, timing="h200", clock=t.clock,
                          sleep=t.sleep)  # fmt: skip
    trainer = SimGPU.open(tmp_path, 0, clock=t.clock)  # the trainer's handle: no costs
    other = SimGPU.create(tmp_path, 1, "H100", seed=4, timing="h200", clock=t.clock)
    assert trainer.calls_block is False and trainer.timing.name == "none"
    jitter = H200.counter
    assert jitter is not None
    instants, last = [], trainer.get_total_energy_j()
    for _ in range(1500):  # 1.5 s in 1 ms steps
        t.ns += MS
        value = trainer.get_total_energy_j()
        if value != last:
            instants.append(t.ns)
            last = value
    uuid = trainer.get_uuid()
    expected = [jitter.last_update_ns(uuid, ns, 100 * MS) for ns in instants]
    assert all(0 <= ns - e < MS for ns, e in zip(instants, expected, strict=True))
    assert len({(b - a) // 100_000 for a, b in zip(instants, instants[1:], strict=False)}) > 1
    assert t.slept == []  # the trainer's reads cost nothing
    start = t.ns
    assert agent.get_total_energy_j() == trainer._read().counter_at(  # noqa: SLF001
        start + (t.ns - start) // 2
    )
    assert jitter.phase_ns(uuid, 100 * MS) != jitter.phase_ns(other.get_uuid(), 100 * MS)


def test_a_counter_read_takes_its_value_at_its_midpoint(tmp_path: Path) -> None:
    t = FakeTime()
    t.ns = 10**12 - 10 * MS  # 10 ms before an update of the exact 100 ms grid
    timing = NvmlTiming("test", {CallKind.ENERGY: QuantileTable.constant(0.040)})
    gpu = SimGPU.create(tmp_path, 0, timing=timing, clock=t.clock, sleep=t.sleep)
    free = SimGPU.open(tmp_path, 0, clock=t.clock)
    before = free.get_total_energy_j()
    value = gpu.get_total_energy_j()
    assert t.ns == 10**12 + 30 * MS  # the call lasted its 40 ms
    assert value == free.get_total_energy_j() > before  # read at +10 ms: after the update


def test_timed_gpus_are_called_through_the_executor(tmp_path: Path) -> None:
    timed = SimGPU.create(tmp_path, 0, timing="h200")
    untimed = SimGPU.create(tmp_path, 1)
    assert timed.calls_block is True and GPUCaller(timed).blocking is True
    assert untimed.calls_block is False and GPUCaller(untimed).blocking is False
    assert SimGPU.calls_block is False


def test_read_telemetry_costs_the_five_getters_and_run_work_costs_nothing(tmp_path: Path) -> None:
    t = FakeTime()
    gpu = SimGPU.create(tmp_path, 0, timing="h200", clock=t.clock, sleep=t.sleep)
    start = t.ns
    gpu.read_telemetry()
    kinds = {CallKind.ENERGY, CallKind.POWER, CallKind.POWER_LIMIT, CallKind.SM_CLOCK,
             CallKind.MEM_CLOCK}  # fmt: skip
    assert dict(gpu.call_counts) == dict.fromkeys(kinds, 1)
    assert t.ns - start >= H200.quantile_s(CallKind.ENERGY, 0.0) * 1e9
    slept = len(t.slept)
    from zeus_agent.gpu.sim import WORKLOADS

    gpu.run_work(WORKLOADS["compute-bound"])
    gpu.is_busy()
    gpu.get_locked_sm_clocks_mhz()
    assert len(t.slept) == slept


# The driver lock.
def test_driver_queue_runs_serialised_calls_one_at_a_time() -> None:
    q = DriverQueue()
    read = q.call(CallKind.ENERGY, 0, 3 * MS)
    setter = q.call(CallKind.SET, 1 * MS, 1 * MS)
    cheap = q.call(CallKind.POWER, 1 * MS + 500_000, 2_000)
    limit = q.call(CallKind.POWER_LIMIT, 2 * MS, 146_000)
    assert (read.start_ns, read.end_ns) == (0, 3 * MS)
    assert (setter.start_ns, setter.end_ns, setter.wait_ns) == (3 * MS, 4 * MS, 2 * MS)
    assert cheap.wait_ns == 0  # cheap getters do not take the lock
    assert (limit.start_ns, limit.end_ns) == (4 * MS, 4 * MS + 146_000)
    assert q.in_flight(3 * MS + 500_000) == [setter]
    with pytest.raises(ValueError, match="time order"):
        q.call(CallKind.SET, 0, MS)


def test_a_clock_change_issued_during_a_counter_read_waits_for_it(tmp_path: Path) -> None:
    """Real threads; the counter read is held in flight by its sleep until the test lets go."""
    in_flight, release = threading.Event(), threading.Event()
    order: list[str] = []

    def reader_sleep(seconds: float) -> None:
        in_flight.set()
        assert release.wait(30)

    def other_sleep(seconds: float) -> None:
        order.append(threading.current_thread().name)

    costs = {CallKind.ENERGY: QuantileTable.constant(0.003),
             CallKind.POWER: QuantileTable.constant(0.000_002)}  # fmt: skip
    timing = NvmlTiming("test", costs, set_latency_s=0.001)
    reader = SimGPU.create(tmp_path, 0, timing=timing, sleep=reader_sleep)
    setter = SimGPU.open(tmp_path, 0, timing=timing, sleep=other_sleep)

    def read() -> None:
        reader.get_total_energy_j()
        order.append("read done")

    def set_clocks() -> None:
        setter.lock_sm_clocks_mhz(1200, 1200)
        order.append("set done")

    a = threading.Thread(target=read, name="reader")
    a.start()
    assert in_flight.wait(30)
    b = threading.Thread(target=set_clocks, name="setter")
    b.start()
    cheap = threading.Thread(target=setter.get_power_w, name="cheap")
    cheap.start()
    cheap.join(30)  # a cheap getter does not wait for the read in flight
    assert not cheap.is_alive()
    b.join(0.2)
    assert b.is_alive() and "set done" not in order  # blocked behind the read
    release.set()
    a.join(30)
    b.join(30)
    # (Marked when the calls return: a setter's own sleep may be skipped on a loaded machine,
    # where the simulator's file work alone outlasts its 1 ms cost.)
    assert order.index("read done") < order.index("set done")
    assert reader.get_locked_sm_clocks_mhz() == (1200, 1200)


# Configuration.
def test_settings_default_to_h200_and_accept_only_the_presets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ZEUS_AGENT_SIM_NVML_TIMING", raising=False)
    settings = AgentSettings()
    assert settings.sim_nvml_timing == "h200" and settings.sim_set_latency_ms == 1.0
    assert AgentSettings(sim_nvml_timing="none").sim_nvml_timing == "none"
    with pytest.raises(ValidationError, match=r"'h200' or 'none'"):
        AgentSettings(sim_nvml_timing="fast")
    with pytest.raises(ValidationError):
        AgentSettings(sim_set_latency_ms=-1)
    monkeypatch.setenv("ZEUS_AGENT_SIM_NVML_TIMING", "none")
    monkeypatch.setenv("ZEUS_AGENT_SIM_SET_LATENCY_MS", "3")
    settings = AgentSettings()
    assert (settings.sim_nvml_timing, settings.sim_set_latency_ms) == ("none", 3.0)


def test_run_help_explains_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from zeus_agent.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--sim-nvml-timing {h200,none}" in out and "(default: h200)" in out
    assert "--sim-set-latency-ms" in out and "energy-counter read ~3 ms" in out


def test_a_bad_timing_flag_is_a_configuration_error(capsys: pytest.CaptureFixture[str]) -> None:
    from zeus_agent.cli import main

    assert main(["run", "--backend", "sim", "--sim-nvml-timing", "fast"]) == 2
    assert "--sim-nvml-timing: Input should be 'h200' or 'none'" in capsys.readouterr().err


def test_the_agent_opens_timed_gpus(tmp_path: Path) -> None:
    from zeus_agent.agent.server import open_gpus

    base: dict[str, Any] = {"backend": "sim", "sim_count": 2, "sim_state_dir": str(tmp_path)}
    timed = open_gpus(AgentSettings(**base, sim_set_latency_ms=3))
    assert all(isinstance(g, SimGPU) and g.calls_block for g in timed)
    assert isinstance(timed[0], SimGPU)
    assert timed[0].timing.name == "h200" and timed[0].timing.median_s(CallKind.SET) == 0.003
    assert timed[0]._read().counter_jitter == "h200"  # noqa: SLF001
    attached = open_gpus(AgentSettings(**base, sim_attach=True, sim_nvml_timing="none"))
    assert isinstance(attached[1], SimGPU) and attached[1].calls_block is False
    assert attached[1]._read().counter_jitter == "h200"  # noqa: SLF001 - the creator's counter
