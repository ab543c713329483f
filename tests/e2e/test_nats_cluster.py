"""The system on a 3-server NATS cluster (routes, JetStream R3), every piece a real process.

`zeus_demo.cluster.NatsCluster` runs three routed `nats-server`s on loopback, each with its
own JetStream store; `SimCluster` runs two coordinator replicas (`--state-replicas 3`: their
KV buckets have a copy on every server), one agent per simulated node (two nodes, 2 A40s each)
and the simulated jobs. Each client is given ONE server's URL and finds the others from the
server's INFO (nats-py adds them to its pool), so it can fail over:

| server | clients |
|---|---|
| n1 | coordinator (replica 1), agent of node-a |
| n2 | coordinator-2 (replica 2), agent of node-b |
| n3 | the test's observer |

The two coordinators sit on different servers, and so do the two agents: whichever replica
owns a job, the commands to one node and its measurements cross a route. The trainers talk to
their node's agent over its Unix socket, not to NATS (there is no "trainer's server"): what
they emit reaches the coordinator through the agent's server and the cluster.

1. A power-limit job (4-rank data parallel) and then a pipeline job (4-stage 1F1B) complete:
   the optimum is pinned on every GPU and the profile matches the simulator's physics (as in
   `test_fault_recovery`); the pipeline job is profiled online and its plan served, the GPUs
   running the dumped schedules (as in `test_pipeline_e2e`).
2. The server of the job's owning replica (and of one agent) is restarted mid-profiling: both
   clients fail over to another server, the profile finishes with windows true to their steps
   and the optimum is pinned everywhere; the trainer's steps never stall (`emit` does not
   block on the bus, which the trainer does not even use: the trainer's process notes when
   rank 0 ends each step, `step_seen_at`, and no gap exceeds `STALL_S`). Twice: SIGTERM (a
   clean shutdown) and SIGKILL (a crash; the server recovers its store).
3. The server leading the state bucket's stream is SIGKILLed while the job's last window is
   measured, then the owning replica stops: the other must take the job over with its profile
   complete: writes are retried through the stream's leader election (~4 s), what is still
   unsaved is written on every ownership round and before a replica stops.

Times on a 2-core machine: about 35, 15 + 15 and 15-20 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import re
import signal
import sys
import time
from typing import Any

import pytest

from coordinator.pipeline.dumps import job_dir_name
from coordinator.power_limit import ZeusCost
from coordinator.state import records
from tests.e2e.job_kit import (
    LATE_CLOCKS_PER,
    LIMITS,
    MARK_TIMEOUT_S,
    SCALE,
    WORKLOAD,
    WORLD,
    clocks_checked,
    describe,
    inconsistent,
    measured,
    options,
    wait_optimum,
)
from tests.repo_kit import REPO_ROOT
from zeus_agent.models import load_prof, load_ranks, load_sched
from zeus_agent.wire import subjects
from zeus_demo.cluster import NatsCluster, SimCluster, processes_with_mark, wait_for_async

PLACES = {"coordinator": 0, "agent-node-a": 0, "coordinator-2": 1, "agent-node-b": 1,
          "observer": 2}
"""Process name -> the index of the only server it is given."""
PROFILER_ARGS = {"clocks": 3, "warmup_iterations": 1, "min_profile_iterations": 2}
RECONNECTED = re.compile(r"NATS connection of \S+ restored")
STALL_S = 1.0
"""The longest a step may take to be seen ending (its own time is 30-90 ms)."""
PIPELINE_ITERATIONS = 50
"""The pipeline job's length in iterations, as `test_pipeline_e2e`'s (same profiler, same
switch lead): its plan is served from iteration ~34 however slow the host is (profiling is
counted in iterations), so ~16 iterations run it. (It was `--seconds 20`, ~70 iterations at
0.1x, the last ~20 of them only waited for.)"""


@pytest.fixture
async def nats():
    """A started 3-server NATS cluster; its servers are killed and directories removed after."""
    cluster = NatsCluster()
    try:
        await asyncio.to_thread(cluster.start)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.close)
    assert processes_with_mark(cluster.procs.mark) == []
    assert not cluster.root.exists()


@pytest.fixture
async def clusters(nats):
    """Make `SimCluster`s on `nats`, two replicas, clients placed by `PLACES`; cleaned up."""
    made: list[SimCluster] = []

    async def make(**kwargs: Any) -> SimCluster:
        c = SimCluster(nats_urls=lambda name: nats.url(PLACES[name]), replicas=2, **kwargs)
        made.append(c)
        await c.start()
        return c

    try:
        yield make
    finally:
        for c in made:
            await c.close()
    for c in made:
        assert processes_with_mark(c.procs.mark) == []
        assert not c.root.exists()


async def kv_get(c: SimCluster, bucket: str, key: str, timeout_s: float = 10) -> Any:
    """An entry of a KV bucket, read by the observer (retried while JetStream recovers; past
    `timeout_s`, the failure names the last read's error)."""
    errors: list[Exception] = []

    async def read() -> Any:
        try:
            kv = await c.nc.jetstream(timeout=2).key_value(bucket)
            return await kv.get(key)
        except Exception as e:  # noqa: BLE001 - retried; the last one is reported
            errors[:] = [e]
            return None

    return await wait_for_async(
        read, timeout_s, lambda: f"{bucket}/{key} not read within {timeout_s:g} s; the last "
        f"read's error: {type(errors[-1]).__name__}: {errors[-1]}", interval_s=0.2)


async def owner_of(c: SimCluster, job_id: str) -> str:
    """The replica holding the job's ownership lease (read from its KV bucket)."""
    entry = await kv_get(c, subjects.state_buckets(subjects.DEFAULT_PREFIX)[1],
                         records.job_hash(job_id))
    return str(json.loads(entry.value)["owner"])


def longest_stall(seen: list[float], start: float, end: float) -> float:
    """The longest gap between two steps seen ending, over those ending in [start, end]."""
    times = [t for t in seen if start <= t <= end]
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


async def check_power_limit_job(c: SimCluster, job_id: str, profile_steps: int,
                                timeout_s: float) -> tuple[int, dict[str, Any]]:
    """The checks of `test_fault_recovery`: the profile, its physics, the pin on every GPU.

    Returns:
        (the optimum, the trainer's result).
    """
    progress = await wait_optimum(c, job_id, timeout_s)
    optimum = progress["optimal_power_limit_w"]
    trainer_running = c.procs.alive("trainer")
    profile = measured(progress)
    assert sorted((m.power_limit for m in profile), reverse=True) == LIMITS, describe(c)
    bad = inconsistent(profile, profile_steps, check_energy=True)
    assert not bad, (f"windows that are not {profile_steps} steps at their limit:\n"
                     + "\n".join(bad) + "\n" + describe(c))
    assert ZeusCost(0.5, world_size=WORLD).select(profile) == optimum
    assert trainer_running, "the job ended before profiling did: raise its steps"
    # Every GPU of the job, on both nodes, runs at the optimum while the job trains. A fault's
    # recovery on a loaded host can outlast the job (seen in CI: the ranks had said goodbye, so
    # their agents had put the GPUs back to the maximum, while the launcher was still exiting):
    # then each rank's record of the limit at its last steps (below) is what shows the pin.
    pinned = lambda: set(c.job_limits().values()) == {optimum}  # noqa: E731
    try:
        await c.wait(lambda: pinned() or not c.procs.alive("trainer"), 10)
    except TimeoutError:
        raise AssertionError(f"limits {c.job_limits()}, optimum {optimum}\n"
                             + describe(c, *(f"agent-{n}" for n in c.nodes))) from None
    assert (await c.query(job_id))["power_limit"]["optimal_power_limit_w"] == optimum
    result = await c.wait_trainer(60)
    assert result["job_id"] == job_id
    for rank in result["ranks"]:
        assert rank["step_power_limit_w"][-30:] == [optimum] * 30, (
            f"rank {rank['rank']}: {rank['step_power_limit_w'][-30:]}\n"
            + describe(c, *(f"agent-{n}" for n in c.nodes)))
    return optimum, result


# ------------------------------------------------------------------------------------ tests
@pytest.mark.timeout(75)
async def test_a_power_limit_job_and_a_pipeline_job_complete_on_a_3_server_cluster(
        nats, clusters):
    c = await clusters(coordinator_args=[
        "--state-replicas", "3", "--mark-timeout-s", str(MARK_TIMEOUT_S),
        "--scheduler", "InstructionProfiler", "--scheduler-args", json.dumps(PROFILER_ARGS),
        "--profiling-iterations", "3", "--switch-lead-steps", "2"])
    # Each client is on the server it was sent to (the replicas' connections are named alike;
    # /connz can lag a just-made connection by a moment on a loaded machine).
    # Every server syncs JetStream writes before acknowledging them (as the running servers say).
    for spec in nats.servers:
        varz = nats._http(spec, "/varz")  # noqa: SLF001
        assert varz and varz["jetstream"]["config"].get("sync_always") is True, varz
    placed = [["zeus-agent:node-a", "zeus-coordinator"],
              ["zeus-agent:node-b", "zeus-coordinator"], ["fault-test-observer"]]
    seen: list[list[str]] = []

    def placed_as_sent() -> bool:
        seen[:] = [sorted(nats.connections(i)) for i in range(3)]
        return seen == placed

    await wait_for_async(placed_as_sent, 5, lambda: repr(seen), interval_s=0.2)

    # ---- the power-limit job
    c.start_trainer(workload=WORKLOAD, steps=120, scale=SCALE, power_limit=options(6),
                    timeout_s=60)
    _, first = await c.wait_status(lambda s: True, 30, "any status of the job")
    job_id = first.job_id
    optimum, result = await check_power_limit_job(c, job_id, 6, 30)
    stall = longest_stall(result["step_seen_at"], 0, float("inf"))
    assert stall < STALL_S, f"a step took {stall:.2f} s to be seen ending"

    # ---- the pipeline job, on the same GPUs now that the first job has ended
    after = len(c.statuses)
    out = c.root / "pipeline.json"
    nodes = [f"{n}:{c.socket_path(n)}:{c.sim_dir(n)}:0-1" for n in c.nodes]
    c.procs.spawn("pipeline", [
        sys.executable, "-m", "zeus_agent.gpu.sim.trainers.pipeline",
        "--profile", "gpt3-175b+a40", "--stages", "4", "--microbatches", "4",
        "--iterations", str(PIPELINE_ITERATIONS), "--time-scale", "0.1",
        "--job-metadata", c.tag, "--output", str(out), "--timeout", "60",
        *[arg for node in nodes for arg in ("--node", node)],
    ], cwd=REPO_ROOT)
    _, discovering = await c.wait_status(lambda s: s.state == "discovering", 30, "discovering",
                                         after=after)
    pipeline_id = discovering.job_id
    assert pipeline_id.endswith(f"+dp1+pp4+tp1+InstructionProfiler+{c.tag}")
    await c.wait_status(lambda s: s.state == "profiling" and s.job_id == pipeline_id, 30,
                        "profiling", after=after)
    _, serving = await c.wait_status(lambda s: s.state == "serving" and s.job_id == pipeline_id,
                                     45, "serving", after=after)
    assert "error" not in c.states(), c.messages()
    served = serving.progress["schedule"]
    assert served >= 3  # Several profiling rounds, then the plan.

    dump = c.root / "dump" / job_dir_name(pipeline_id)
    ranks = load_ranks(str(dump))
    assert [r.rank for r in ranks] == list(range(4))
    assert ranks[0].instructions == ["forward"] * 4 + ["backward"] * 4  # Stage 0, 1F1B
    for n in range(served):
        assert len(load_prof(str(dump), n)) == 4
    schedules = {n: {s.rank: s for s in load_sched(str(dump), n)} for n in range(served + 1)}
    top = max(ranks[0].available_frequencies)
    assert all(f == top for s in schedules[served].values() for _, f in s.frequencies)
    with (dump / "instruction_profile.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["stage"], r["instruction"]) for r in rows} == {
        (str(s), i) for s in range(4) for i in ("forward", "backward")}

    proc = c.procs.procs["pipeline"]
    try:
        await c.wait(lambda: proc.poll() is not None, 40)
    except TimeoutError:
        raise AssertionError("the pipeline job did not end\n" + describe(c)) from None
    assert proc.returncode == 0, c.procs.log("pipeline")
    result = json.loads(out.read_text())
    assert result["job_id"] == pipeline_id
    checked, late, wrong = clocks_checked(result, schedules)
    assert checked >= 8 * 4 * (served + 1)
    assert wrong <= late <= checked // LATE_CLOCKS_PER, (wrong, late, checked)
    query = await c.query(pipeline_id)
    assert query["pipeline"]["phase"] == "serving"
    assert query["pipeline"]["schedule"] == served


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
async def test_restarting_the_owners_server_mid_profiling_fails_over_and_the_job_goes_on(
        nats, clusters, kill):
    """SIGTERM: the server shuts down cleanly; SIGKILL: it crashes, and recovers its store."""
    profile_steps = 10
    c = await clusters(coordinator_args=["--state-replicas", "3",
                                        "--mark-timeout-s", str(MARK_TIMEOUT_S)])
    c.start_trainer(workload=WORKLOAD, steps=240, scale=SCALE,
                    power_limit=options(profile_steps), timeout_s=60)
    await c.wait_status(lambda s: s.message.startswith("measuring 250 W"), 30,
                        "the 250 W window opened")
    job_id = c.statuses[0][1].job_id
    owner = await owner_of(c, job_id)
    server = PLACES[owner]
    agent = next(n for n, i in PLACES.items() if i == server and n.startswith("agent-"))
    assert agent in {f"agent-{n}" for n in c.nodes}

    # Down 2.5 s (the rest of the profile takes ~2.5 s), then back on its ports and store.
    # Longer than the coordinator's command timeout (2 s): a command to the down server's
    # agent that was in flight when it went down holds the job for that long (seen in a
    # fresh-clone run with a 1.5 s outage: the only status came after it), and a command is
    # likelier now that GPUs go back to the maximum between windows.
    t_down = time.monotonic()
    await asyncio.to_thread(nats.stop, server, kill)
    t_stopped = time.monotonic()
    await asyncio.sleep(2.5)
    during = len(c.statuses)
    await asyncio.to_thread(nats.start_server, server)  # Until the cluster is whole again.
    t_up = time.monotonic()
    assert c.procs.alive("trainer")
    for name in (owner, agent):  # Both clients of that server lost it and came back.
        try:
            await c.wait(lambda name=name: RECONNECTED.search(c.procs.log(name)), 10)
        except TimeoutError:
            raise AssertionError(f"{name} did not reconnect\n{c.procs.log(name)}") from None
    # ... on another server, at once: the owner drove the job while its server was down.
    assert any(t_stopped < at for at, _ in c.statuses[:during]), (
        "no status event while the server was down\n" + describe(c, agent))

    optimum, result = await check_power_limit_job(c, job_id, profile_steps, 45)
    assert await owner_of(c, job_id) in c.replicas
    # The trainer never waited on the bus: no step took long to end, before, during or after.
    seen = result["step_seen_at"]
    around = longest_stall(seen, t_down - 1, t_up + 3)
    assert around < STALL_S, (
        f"a step took {around:.2f} s to end while {nats.servers[server].name} restarted")
    assert longest_stall(seen, 0, float("inf")) < STALL_S
    assert sum(rank["dropped_events"] for rank in result["ranks"]) == 0



@pytest.mark.timeout(60)
async def test_a_profile_measured_while_the_state_streams_leader_is_down_survives_a_takeover(
        nats, clusters):
    """The job's last window ends while the server leading the state bucket's stream is dead.

    Its other two servers elect a new leader within seconds (R3), so nothing is lost as long as
    the coordinator's writes wait or retry that long. Then, when the owner replica stops, the
    other replica takes the job over from JetStream with its profile complete: it pins the
    optimum without measuring anything again. (Was: the write of the profile was dropped during
    the election, and the replica taking over measured the last window again.)
    """
    # The owner keeps its lease through the election (up to ~10 s on a loaded 2-core VM; with
    # the default 10 s lease the other replica may rightly take the job over meanwhile and
    # measure again the window whose profile was not yet written).
    c = await clusters(coordinator_args=["--state-replicas", "3", "--ownership-lease-s", "15",
                                        "--mark-timeout-s", str(MARK_TIMEOUT_S)])
    c.start_trainer(workload=WORKLOAD, steps=800, scale=SCALE, power_limit=options(10),
                    timeout_s=60)
    _, first = await c.wait_status(lambda s: True, 30, "any status of the job")
    job_id = first.job_id
    bucket = subjects.state_buckets(subjects.DEFAULT_PREFIX)[0]
    info = await c.nc.jsm().stream_info(f"KV_{bucket}")
    leader = [s.name for s in nats.servers].index(info.cluster.leader)
    # The last window opens; its result and the measured profile are written ~1 s later.
    await c.wait_status(lambda s: (s.progress or {}).get("measured") == len(LIMITS) - 1, 30,
                        "all windows but one measured")
    await asyncio.to_thread(nats.stop, leader, True)  # SIGKILL
    # The owner says `profile_saved` once JetStream took the profile, or once it gave up for
    # now and keeps it to write again (the query could tell the optimum before either).
    _, saved = await c.wait_status(lambda s: s.state == "profile_saved", 30, "profile saved")
    optimum = (saved.progress or {})["optimal_power_limit_w"]
    await asyncio.to_thread(nats.start_server, leader)

    owner = await owner_of(c, job_id)
    after = len(c.statuses)
    c.procs.kill(owner, signal.SIGTERM)  # It gives its leases up: the other takes at once.
    await c.wait_status(lambda s: s.state == "taken_over", 15, "taken over", after=after)
    with contextlib.suppress(TimeoutError):
        await c.wait(lambda: any(s.state == "done" for _, s in c.statuses[after:]), 5)
    assert c.procs.alive("trainer"), ("the job ended before the takeover: raise its steps\n"
                                      + c.procs.log("trainer") + describe(c))
    since = "\n".join(f"  {s.state}: {s.message}" for _, s in c.statuses[after:])
    entry = await kv_get(c, bucket, records.progress_key(job_id))
    recorded = records.decode(entry.key, entry.value, False, 0).progress or {}
    assert recorded.get("kind") == "profile" and len(recorded["state"]) == len(LIMITS), (
        f"JetStream holds {recorded.get('kind')} {json.dumps(recorded.get('state'))[:300]} "
        f"after the job was done; after the takeover:\n{since}")
    assert not any(s.message.startswith("measuring") for _, s in c.statuses[after:]), (
        since + "\n" + describe(c))
    assert set(c.job_limits().values()) == {optimum}, since
