"""Fault recovery with real processes: an agent SIGKILLed mid-profiling or after the pin, and
a nats-server restart mid-profiling.

Every piece is a process of its own (`zeus_demo.cluster.SimCluster`): `nats-server`,
`zeus-coordinator run`, `zeus-agent run --backend sim` on two simulated nodes (2 A40s each)
and a 4-rank simulated data-parallel job (`zeus_agent.gpu.sim.trainers.data_parallel`, one
process per rank, real `emit` calls). The job is followed as a user would: `JobStatus` events,
`<p>.coord.jobs.query` and the simulated GPUs' shared files.

Each test reproduces a defect seen before the coordinator's hardening and asserts the fixed
behaviour:

1. SIGKILL an agent mid-profiling and restart it. Was: 4 windows never completed, no limit was
   ever chosen, the job trained on at the lowest limit. Now: the windows whose marks were lost
   are redone after `--mark-timeout-s`, profiling ends (`done`, an optimum chosen from
   measurements consistent with the simulator) and every GPU of the job runs at that optimum.
2. SIGKILL the agent after the limit is pinned and restart it (it resets its GPUs at start).
   Was: that node ran at the default limit for the rest of the job. Now: the coordinator
   re-applies the pinned limit on the agent's hello within a few seconds (`reconciled`) while
   the job still trains.
3. Restart nats-server (same port, same JetStream directory) mid-profiling. Was: a 10-step
   window spanned 46 steps and was accepted. Now: every window of the profile measures what
   the simulator says `profile_steps` steps take at its limit (time and energy), so no window
   covers more steps, or other steps, than its own. Which side reconnects first is a race in
   real life; the coordinator and the agents reach NATS through relays
   (`zeus_demo.cluster.Relay`) so both orders are run, each every time.

And a guard on the reconciliation itself (4): once a job has ended and its agents restored
the default limit (trainers said goodbye), their heartbeats must not bring the job's limit
back on idle GPUs.

Timing: simulated steps of 30-90 ms (A40 resnet50 at scale 0.05), 5 limits (300..100 W by
50 W), 1 warm-up step; each test runs in about 7-20 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from coordinator.power_limit import ZeusCost
from tests.e2e.job_kit import (
    LIMITS,
    MARK_TIMEOUT_S,
    SCALE,
    WORKLOAD,
    WORLD,
    describe,
    inconsistent,
    measured,
    options,
    wait_optimum,
)
from zeus_agent.gpu.sim.presets import PRESETS
from zeus_demo.cluster import SimCluster, processes_with_mark

DEFAULT_LIMIT = PRESETS["A40"].default_power_limit_w


@pytest.fixture
async def clusters():
    """Make `SimCluster`s; all their processes are killed and directories removed after."""
    made: list[SimCluster] = []

    async def make(**kwargs: Any) -> SimCluster:
        cluster = SimCluster(**kwargs)
        made.append(cluster)
        await cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            await cluster.close()
    for cluster in made:
        assert processes_with_mark(cluster.procs.mark) == []
        assert not cluster.root.exists()


# ------------------------------------------------------------------------------------ tests
@pytest.mark.timeout(120)
async def test_agent_killed_mid_profiling_the_profile_still_finishes(clusters):
    c = await clusters(coordinator_args=["--mark-timeout-s", str(MARK_TIMEOUT_S)])
    c.start_trainer(workload=WORKLOAD, steps=260, scale=SCALE, power_limit=options(6),
                    timeout_s=80)
    await c.wait_status(lambda s: s.message.startswith("measuring 250 W"), 30,
                        "the 250 W window opened")
    c.kill_agent("node-b")  # Its ranks train on; their marks go nowhere.
    await asyncio.sleep(0.5)
    hello = await c.restart_agent("node-b")
    t_hello = time.monotonic()
    assert [g.power_limit_w for g in hello.gpus] == [DEFAULT_LIMIT] * 2  # reset at start
    # Its ranks re-introduce themselves (emit reconnects within a second): their GPUs are
    # measured again, else no window can ever complete.
    try:
        await c.wait(lambda: {2, 3} <= c.ranks_with_marks_since(t_hello), 5)
    except TimeoutError:
        raise AssertionError(
            "the ranks of node-b are not measured by its restarted agent: marks since its "
            f"hello from ranks {sorted(c.ranks_with_marks_since(t_hello))}\n"
            + describe(c, "agent-node-b", "trainer")) from None

    progress = await wait_optimum(c, c.statuses[0][1].job_id, 45)
    optimum = progress["optimal_power_limit_w"]
    trainer_running = c.procs.alive("trainer")
    # The kill did cost windows (else this test proves nothing): they were redone.
    assert progress["redone"], "no window was redone\n" + describe(c, "agent-node-b")
    assert any("profiling that limit again" in s.message for _, s in c.statuses)
    assert progress["gave_up"] is None
    profile = measured(progress)
    assert sorted((m.power_limit for m in profile), reverse=True) == LIMITS, (
        describe(c, "agent-node-b"))
    assert ZeusCost(0.5, world_size=WORLD).select(profile) == optimum
    bad = inconsistent(profile, 6, check_energy=False)
    assert not bad, "windows that are not 6 steps at their limit:\n" + "\n".join(bad)
    # Every GPU of the job, on both nodes, runs at the optimum while the job trains.
    assert trainer_running, "the job ended before profiling did: raise its steps"
    # The pins go out once the optimum is known; on a loaded host an agent may apply its
    # own a moment after the query or `done` says so.
    try:
        await c.wait(lambda: set(c.job_limits().values()) == {optimum}, 5)
    except TimeoutError:
        raise AssertionError(f"limits {c.job_limits()}, pinned {optimum}\n{describe(c)}") from None
    query = await c.query(c.statuses[0][1].job_id)
    assert query["power_limit"]["optimal_power_limit_w"] == optimum

    result = await c.wait_trainer(60)
    for rank in result["ranks"]:
        assert rank["step_power_limit_w"][-30:] == [optimum] * 30, rank["rank"]


@pytest.mark.timeout(120)
async def test_agent_killed_after_the_pin_gets_the_limit_back(clusters):
    c = await clusters()
    # Energy: its optimum is far below the default on this workload, even when a loaded
    # machine stretches a window's steps (ZeusCost(0.5) then picked the default once).
    c.start_trainer(workload=WORKLOAD, steps=220, scale=SCALE,
                    power_limit={**options(6), "selector": "Energy"}, timeout_s=80)
    _, done = await c.wait_status(lambda s: s.state == "done", 40, "done")
    optimum = done.progress["optimal_power_limit_w"]
    # Else an agent's reset to the default would look like the pinned limit.
    assert optimum != DEFAULT_LIMIT, describe(c)
    assert c.job_limits() == dict.fromkeys(c.job_limits(), optimum)

    after = len(c.statuses)
    c.kill_agent("node-b")
    await asyncio.sleep(0.5)
    assert [c.gpu_limit("node-b", i) for i in (0, 1)] == [optimum] * 2  # nobody restored
    hello = await c.restart_agent("node-b")
    t_hello = time.monotonic()
    # The new agent reset its GPUs at start: the situation that used to last the whole job.
    assert [g.power_limit_w for g in hello.gpus] == [DEFAULT_LIMIT] * 2

    for gpu in (0, 1):
        await c.wait_status(
            lambda s, gpu=gpu: s.state == "reconciled"
            and s.message.startswith(f"node-b/gpu{gpu} "), 5, f"reconciled node-b/gpu{gpu}",
            after=after)
    try:
        await c.wait(lambda: set(c.job_limits().values()) == {optimum}, 5)
    except TimeoutError:
        raise AssertionError(f"limits {c.job_limits()}, pinned {optimum}\n{describe(c)}") from None
    assert time.monotonic() - t_hello < 5
    assert c.procs.alive("trainer"), "the job ended before the limit came back: raise its steps"

    result = await c.wait_trainer(60)
    for rank in result["ranks"]:
        assert rank["step_power_limit_w"][-30:] == [optimum] * 30, rank["rank"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["agents", "coordinator"],
                         ids=["agents-reconnect-first", "coordinator-reconnect-first"])
async def test_nats_restart_mid_profiling_keeps_windows_true_to_their_steps(clusters, first):
    """Who reconnects first is a race; both orders are forced through relays.

    Agents first: what they buffered while NATS was down reaches nobody (the coordinator is not
    subscribed yet), so the coordinator misses steps (the original defect: a window counted by
    delivered events spanned 46 steps). Coordinator first: the agents' buffered events and marks
    reach it late, in a burst (was: about 1 run in 6, windows opened and closed on those late
    steps, all run at the outage's limit, were redone until their limits were left out; events
    now carry the limit their step began at, and such steps count toward no window).
    """
    profile_steps = 10
    c = await clusters(coordinator_args=["--mark-timeout-s", str(MARK_TIMEOUT_S)], relays=True)
    c.start_trainer(workload=WORKLOAD, steps=260, scale=SCALE,
                    power_limit=options(profile_steps), timeout_s=80)
    await c.wait_status(lambda s: s.message.startswith("measuring 250 W"), 30,
                        "the 250 W window opened")
    job_id = c.statuses[0][1].job_id
    # ~45 steps without a bus, from inside the 250 W window; then everyone reconnects (the
    # agents announce themselves again, the coordinator answers queries), `first` first.
    await c.restart_nats(down_s=1.5, first=first)
    assert c.procs.alive("trainer")

    progress = await wait_optimum(c, job_id, 45)
    profile = measured(progress)
    assert sorted((m.power_limit for m in profile), reverse=True) == LIMITS, describe(c)
    bad = inconsistent(profile, profile_steps, check_energy=True)
    assert not bad, (
        f"windows that are not {profile_steps} steps at their limit (the optimum pinned: "
        f"{progress['optimal_power_limit_w']} W):\n" + "\n".join(bad) + "\n" + describe(c))
    optimum = progress["optimal_power_limit_w"]
    assert ZeusCost(0.5, world_size=WORLD).select(profile) == optimum

    result = await c.wait_trainer(60)
    for rank in result["ranks"]:
        assert rank["step_power_limit_w"][-30:] == [optimum] * 30, rank["rank"]


@pytest.mark.timeout(120)
async def test_reconcile_leaves_the_gpus_of_a_finished_job_at_their_default(clusters):
    """Reconciling must not undo the restore of a job that ended (a guard on fix 1 and 2).

    When the trainers say goodbye their agents restore the default limit; the agents' next
    heartbeats (every second here) must not bring the job's limit back on idle GPUs.
    """
    c = await clusters(agent_args=["--heartbeat-s", "1"])
    # Energy: its optimum is far below the default on this workload, even on a loaded machine.
    c.start_trainer(workload=WORKLOAD, steps=70, scale=SCALE,
                    power_limit={**options(6), "selector": "Energy"}, timeout_s=60)
    result = await c.wait_trainer(60)
    optimum = next(s for _, s in c.statuses if s.state == "done").progress[
        "optimal_power_limit_w"]
    assert optimum != DEFAULT_LIMIT
    assert result["ranks"][0]["step_power_limit_w"][-1] == optimum
    ended = len(c.statuses)
    await asyncio.sleep(3.5)  # three heartbeats of each agent
    after = [f"{s.state}: {s.message}" for _, s in c.statuses[ended:]]
    assert set(c.job_limits().values()) == {DEFAULT_LIMIT}, (
        f"limits {c.job_limits()} after the job ended; status events since:\n"
        + "\n".join(after))
