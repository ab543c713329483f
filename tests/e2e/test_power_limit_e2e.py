"""The whole power-limit flow: embedded NATS, a coordinator, two agents on two node names with
simulated GPUs, and a simulated data-parallel trainer (4 rank processes using emit)."""

import asyncio
import json

from coordinator.config import CoordinatorSettings
from coordinator.power_limit import ZeusCost
from coordinator.service import CoordinatorService
from zeus_agent.agent.server import AgentServer
from zeus_agent.broker import confirm_subscriptions, connect
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.gpu.sim.trainers.data_parallel import (
    RankPlacement,
    TrainerOptions,
    run_data_parallel,
)
from zeus_agent.models import load_power_limit_profile
from zeus_agent.wire import codec
from zeus_agent.wire.messages import JobStatus, PowerLimitOptions

NODES = ("node-a", "node-b")


async def test_data_parallel_job_ends_pinned_at_the_chosen_limit(nats_server, tmp_path):
    agents = []
    for node in NODES:
        settings = AgentSettings(
            nats_url=nats_server.url,
            backend="sim",
            sim_count=2,
            sim_energy_update_ms=0,  # windows of a few 10 ms: an exact counter
            sim_preset="A40",
            sim_state_dir=str(tmp_path / node),
            socket_path=str(tmp_path / f"{node}.sock"),
            node=node,
            sample_hz=20,
        )
        server = AgentServer(settings)
        agents.append((server, asyncio.create_task(server.serve())))
    coord = CoordinatorService(
        CoordinatorSettings(nats_url=nats_server.url, state_dir=str(tmp_path / "coord"))
    )
    coord_task = asyncio.create_task(coord.serve())
    for server, _ in agents:
        await asyncio.wait_for(server.started.wait(), 10)
    await asyncio.wait_for(coord.started.wait(), 10)

    statuses: list[JobStatus] = []
    nc = await connect(nats_server.url, "observer")

    async def on_status(msg):
        statuses.append(codec.decode(msg.data, JobStatus))

    await nc.subscribe("zeus.job.*.status", cb=on_status)

    placements = [
        RankPlacement(node, str(tmp_path / f"{node}.sock"), str(tmp_path / node), i)
        for node in NODES
        for i in range(2)
    ]
    options = TrainerOptions(
        workload="A40+resnet50+gpu0,1,2,3",
        steps_per_epoch=100,  # (A loaded host lengthens windows: room for 5 pinned steps.)
        scale=0.05,
        power_limit=PowerLimitOptions(
            selector="ZeusCost", eta_knob=0.5, warmup_steps=1, profile_steps=4
        ),
    )
    try:
        result = await asyncio.to_thread(run_data_parallel, placements, options, None, 120)
        await confirm_subscriptions(nc)
        await asyncio.sleep(0.2)
    finally:
        for server, _ in agents:
            server.handle_exit()
        coord.should_exit.set()
        await asyncio.gather(coord_task, *(t for _, t in agents))
        await nc.drain()

    job_id = result.job_id
    assert job_id and job_id.endswith("+dp4+pp1+tp1+PowerLimitOptimizer+simulated")
    # The profile was saved in Zeus's format, one measurement per limit, highest first.
    profile_path = tmp_path / "coord" / "profiles" / f"{job_id}.json"
    raw = json.loads(profile_path.read_text())
    limits = [m["power_limit"] for m in raw["measurements"]]
    assert limits == list(range(300, 99, -25))
    measurements = load_power_limit_profile(profile_path)
    optimum = ZeusCost(0.5, world_size=4).select(measurements)
    # Every GPU, on both nodes, ran its last steps at the chosen limit.
    for rank in result.ranks:
        assert rank.step_power_limit_w[-5:] == [optimum] * 5, rank
        assert rank.dropped_events == 0
    # People could follow it: registration, profiling progress, the pin.
    states = [s.state for s in statuses if s.job_id == job_id]
    assert states[0] == "registered"
    assert "profiling" in states and "profile_saved" in states
    done = [s for s in statuses if s.state == "done"]
    assert done and done[-1].progress["optimal_power_limit_w"] == optimum
    # The window energy is the sum over the four GPUs: each window measured > 4 GPUs' idle power.
    for m in measurements:
        assert m.energy > 4 * 30 * m.time
    # When the trainers said goodbye, the agents restored the default limit.
    for node in NODES:
        for i in range(2):
            assert SimGPU.open(str(tmp_path / node), i).get_power_limit_w() == 300
