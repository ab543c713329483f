"""Short steps on a coarse energy counter: windows are lengthened until they mean something.

A real agent (two simulated A40s whose energy counters update every 100 ms, as NVML's do), a
coordinator and a simulated data-parallel trainer (2 rank processes using emit) whose steps last
~13 ms, with `profile_steps=3`: a window of 3 steps lasts ~40 ms, under one counter period, and
the energy it measures is mostly interpolated from its neighbours' steps (other limits). The
agent announces the counter's period in the GPU's description; the coordinator finds the first
window too short, says so, and profiles every limit for enough steps to span five periods: the
limit it pins is the workload's optimum, run after run.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from coordinator.power_limit import Energy
from tests.shell.coordinator_kit import start, stop
from zeus_agent.agent.server import AgentServer
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.sim.physics import operating_point
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS
from zeus_agent.gpu.sim.trainers.data_parallel import (
    RankPlacement,
    TrainerOptions,
    run_data_parallel,
)
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire import codec
from zeus_agent.wire.messages import JobStatus, PowerLimitOptions
from zeus_demo.cluster import wait_for_async

NODE = "short-steps"
WORKLOAD = "input-bound"
SCALE = 0.05  # ~12.6 ms of GPU step at 300 W: a 3-step window lasts ~40 ms


def true_optimum() -> int:
    """The limit the Energy selector picks from the workload's noise-free profile (W)."""
    hw, wl = PRESETS["A40"], WORKLOADS[WORKLOAD]
    profile = []
    for limit in range(300, 99, -25):
        op = operating_point(hw, wl, limit)
        profile.append(PowerLimitMeasurement(power_limit=limit, time=op.step_time_s,
                                             energy=op.energy_j))
    return Energy().select(profile)


async def test_short_windows_are_lengthened_and_the_optimum_is_pinned_every_time(
        nats_server, nc, tmp_path: Path) -> None:
    optimum = true_optimum()
    assert optimum == 150  # (4.5% less energy per step than 175 W, 13% less than 125 W)
    agent = AgentServer(AgentSettings(
        nats_url=nats_server.url, backend="sim", sim_count=2, sim_preset="A40",
        sim_energy_update_ms=100, sim_state_dir=str(tmp_path / "gpus"),
        socket_path=str(tmp_path / "agent.sock"), node=NODE, sample_hz=10))
    agent_task = asyncio.create_task(agent.serve())
    await asyncio.wait_for(agent.started.wait(), 10)
    coord, coord_task = await start(nats_server, tmp_path / "coord")
    statuses: list[JobStatus] = []

    async def on_status(msg) -> None:
        statuses.append(codec.decode(msg.data, JobStatus))

    await nc.subscribe("zeus.job.*.status", cb=on_status)
    await confirm_subscriptions(nc)
    # (Locking needs reads close to the counter's updates: a loaded host's jitter delays it.)
    await wait_for_async(lambda: all(a.counter.policy.locked for a in agent.agents.values()), 30,
                         lambda: "the agent never locked onto the 100 ms counter", interval_s=0.1)
    placements = [RankPlacement(NODE, str(tmp_path / "agent.sock"), str(tmp_path / "gpus"), i)
                  for i in range(2)]
    runs = []
    try:
        for run in range(2):
            options = TrainerOptions(
                workload=WORKLOAD, steps_per_epoch=800, scale=SCALE, seed=run,
                job_metadata=f"run{run}",
                power_limit=PowerLimitOptions(selector="Energy", warmup_steps=2, profile_steps=3))
            result = await asyncio.to_thread(run_data_parallel, placements, options, None, 120)
            await asyncio.sleep(0.3)
            runs.append([s for s in statuses if s.job_id == result.job_id])
        periods = {g: coord.gpus.periods.get((NODE, g)) for g in (0, 1)}
    finally:
        await stop(coord, coord_task)
        agent.handle_exit()
        await agent_task
    # The agent announced its GPUs' counter period (learned from its reads).
    assert all(p is not None and abs(p - 100) < 2 for p in periods.values()), periods
    for mine in runs:
        said = [s.message for s in mine]
        first = next(m for m in said if m.startswith("profiling 9 power limits"))
        # (The period as learned: 100 ms, or 99-101 ms on a loaded host, as asserted above.)
        assert re.search(r"windows of at least 0\.(49|5\d?) s \(5 periods of the GPUs' "
                         r"(99|100|101) ms energy counters\)", first), said
        raised = [m for m in said if "profile_steps is a minimum" in m]
        assert len(raised) == 1 and raised[0].startswith("windows of 3 steps lasted "), said
        assert re.search(r"under 5 energy-counter periods \((99|100|101) ms\): profiling ",
                         raised[0]), raised[0]
        done = [s for s in mine if s.state == "done"]
        assert done, said[-5:]
        assert done[-1].progress["optimal_power_limit_w"] == optimum, done[-1].progress
        # The profile has the physics' shape: less energy per step from 225 W down to the
        # optimum, more below (3-step windows measured 250 W above 300 W, 200 W below 175 W).
        energy = {m["power_limit"]: m["energy"] for m in done[-1].progress["measurements"]}
        assert energy[225] > energy[200] > energy[175] > energy[150] < energy[125] < energy[100]
