"""A window lost to an agent restart, with real processes (`zeus_demo.cluster.SimCluster`:
nats-server, `zeus-coordinator run`, two agents on simulated nodes, a 4-rank simulated job).

The defect: the agent of node-b restarted during the last window (100 W); its marks of that
window were lost, and the coordinator waited the whole mark timeout (30 s then) with every GPU
at 100 W: a 320-step job spent its last ~190 steps there and never chose. Now the restarted
agent's first marks prove the loss and the window is redone at the next step, and while it is
awaited the GPUs run at the maximum limit.

The coordinator runs with `--mark-timeout-s 60`, longer than the job: only the proof of the
loss, not the timeout, can finish the profile in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from coordinator.power_limit import ZeusCost
from zeus_agent.models import PowerLimitMeasurement
from zeus_demo.cluster import SimCluster, processes_with_mark

WORKLOAD = "A40+resnet50+gpu0"
"""Step time 30 ms at 300 W to 88 ms at 100 W (scaled); ZeusCost(0.5) picks 200 W."""
SCALE = 0.05
WORLD = 4
LIMITS = [300, 250, 200, 150, 100]
OPTIONS = {"selector": "ZeusCost", "eta_knob": 0.5, "warmup_steps": 1, "profile_steps": 6,
           "pl_step_w": 50}


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    """A `SimCluster` whose mark timeout outlasts the job; killed and removed after."""
    c = SimCluster(coordinator_args=["--mark-timeout-s", "60"])
    try:
        await c.start()
        yield c
    finally:
        await c.close()
    assert processes_with_mark(c.procs.mark) == []


def describe(c: SimCluster) -> str:
    logs = "\n".join(c.procs.log(name, 3000) for name in ("coordinator", "agent-node-b"))
    return f"status events:\n{c.messages()}\n{logs}"


async def within(c: SimCluster, what: str, timeout_s: float,
                 wait: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await asyncio.wait_for(wait(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what} not within {timeout_s} s; limits {c.job_limits()}; "
                             f"trainer {'running' if c.procs.alive('trainer') else 'ended'}\n"
                             + describe(c)) from None


@pytest.mark.timeout(120)
async def test_an_agent_restart_in_the_last_window_is_redone_and_the_job_chooses(cluster):
    c = cluster
    c.start_trainer(workload=WORKLOAD, steps=360, scale=SCALE, power_limit=OPTIONS,
                    timeout_s=90)
    await c.wait_status(lambda s: s.message.startswith("measuring 100 W"), 40,
                        "the 100 W window opened")
    job_id = c.statuses[0][1].job_id
    c.kill_agent("node-b")  # Its ranks train on; their marks of the window are lost.

    # The window closes without node-b's marks: nothing is measured while it is awaited, so
    # node-a's GPUs go back to the maximum (node-b's agent is down: its GPUs keep 100 W).
    node_a = [f"node-a/gpu{i}" for i in range(2)]
    await within(c, "node-a's GPUs back at 300 W while the window is awaited", 10,
                 lambda: c.wait(lambda: all(c.job_limits()[g] == 300 for g in node_a), 10))
    hello = await c.restart_agent("node-b")
    assert hello is not None

    def done() -> dict[str, Any] | None:
        found = [s for _, s in c.statuses if s.state == "done"]
        return found[-1].progress if found else None

    progress = await within(c, "an optimum", 30, lambda: c.wait(done, 30))
    assert c.procs.alive("trainer"), "the job ended before profiling did: raise its steps"
    assert progress["gave_up"] is None
    assert "100" in progress["redone"], describe(c)
    assert any("were lost" in s.message and "profiling that limit again" in s.message
               for _, s in c.statuses), describe(c)
    profile = [PowerLimitMeasurement(**m) for m in progress["measurements"]]
    assert sorted((m.power_limit for m in profile), reverse=True) == LIMITS, describe(c)
    optimum = progress["optimal_power_limit_w"]
    assert optimum != 100 and ZeusCost(0.5, world_size=WORLD).select(profile) == optimum
    query = await c.query(job_id)
    assert query["power_limit"]["optimal_power_limit_w"] == optimum

    result = await c.wait_trainer(60)
    for rank in result["ranks"]:
        limits = rank["step_power_limit_w"]
        assert limits[-30:] == [optimum] * 30, rank["rank"]
        if rank["rank"] < 2:  # node-a's (node-b's GPUs kept 100 W while their agent was down)
            # 100 W only for its window and its redo (each: warm-up, 6 steps, the closing
            # step), with slack for commands landing late (88 ms steps: 10 are under a second,
            # 22 were seen at load 11); not for the restart's duration (the defect: ~190).
            assert limits.count(100) <= 2 * 8 + 10, (rank["rank"], limits.count(100))
