"""Coordinator replicas with their state in JetStream, under faults, with real processes.

`SimCluster(replicas=2)`: nats-server (JetStream), two `zeus-coordinator run` replicas,
agents on two simulated nodes (2 A40s each) and a 4-rank simulated data-parallel job. The job's
owner is read from the ownership bucket (`<bucket>-owners`), as an operator would with
`nats kv get`.

1. SIGKILL the owning replica mid-profiling: the other takes the job over once the owner's
   lease lapses (`taken_over` status), resumes from the windows recorded in JetStream and ends
   with the optimum the physics of the simulated GPUs gives (what an undisturbed run picks:
   the same selector on the same windows; `Energy`, whose optimum noise cannot flip); no
   GPU's lease lapses meanwhile (no agent reports `lease_expired`), and every GPU ends at that
   optimum.
2. SIGKILL every replica mid-profiling, start one again: it resumes the job from JetStream.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from nats.js.errors import KeyNotFoundError

from coordinator.state import records
from tests.e2e.job_kit import (
    LIMITS,
    OWNERSHIP_LEASE_S,
    PROFILE_STEPS,
    SCALE,
    WORKLOAD,
    describe,
    inconsistent,
    job_options,
    measured,
    owner_of,
    undisturbed_optimum,
)
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import ErrorEvent
from zeus_demo.cluster import SimCluster, processes_with_mark, wait_for_async


@pytest.fixture
async def replicated():
    """A `SimCluster` with two replicas; its lease-expiry error events; cleaned up after."""
    c = SimCluster(replicas=2, coordinator_args=[
        "--ownership-lease-s", str(OWNERSHIP_LEASE_S), "--mark-timeout-s", "2"])
    expired: list[ErrorEvent] = []
    try:
        await c.start()

        async def on_error(msg: Any) -> None:
            event = codec.decode(msg.data, ErrorEvent)
            if event.code == "lease_expired":
                expired.append(event)

        await c.nc.subscribe(subjects.all_gpu_errors(), cb=on_error)
        yield c, expired
    finally:
        await c.close()
    assert processes_with_mark(c.procs.mark) == []


async def wait_recorded(c: SimCluster, job_id: str, predicate: Any,
                        timeout_s: float = 10) -> dict[str, Any]:
    """The job's progress in JetStream once `predicate` holds (written beside the job)."""
    bucket = subjects.state_buckets(subjects.DEFAULT_PREFIX)[0]
    kv = await c.nc.jetstream(timeout=2).key_value(bucket)
    last: dict[str, Any] = {}

    async def reached() -> dict[str, Any] | None:
        try:
            entry = await kv.get(records.progress_key(job_id))
            recorded = records.decode(entry.key, entry.value, False, 0).progress or {}
        except KeyNotFoundError:
            recorded = {}
        last.clear()
        last.update(recorded)
        return recorded if predicate(recorded) else None

    return await wait_for_async(reached, timeout_s, lambda: f"JetStream holds {last}",
                                interval_s=0.1)


async def wait_done(c: SimCluster, timeout_s: float, after: int = 0) -> Any:
    _, done = await c.wait_status(lambda s: s.state == "done", timeout_s, "done", after)
    return done


@pytest.mark.timeout(150)
async def test_killing_the_owner_mid_profiling_the_other_replica_finishes_the_job(replicated):
    c, expired = replicated
    c.start_trainer(workload=WORKLOAD, steps=300, scale=SCALE,
                    power_limit=job_options(), timeout_s=100)
    _, status = await c.wait_status(lambda s: s.message.startswith("measuring 200 W"), 40,
                                    "the 200 W window opened")
    job_id = status.job_id
    owner = await owner_of(c, job_id)
    other = next(n for n in c.replicas if n != owner)
    killed_at = time.monotonic()
    c.procs.kill(owner)
    _, taken = await c.wait_status(lambda s: s.state == "taken_over", 20, "taken_over")
    took_s = time.monotonic() - killed_at
    assert other in taken.message, taken.message
    assert await owner_of(c, job_id) == other
    # Fenced: not before the lease the dead owner held ran out (renewed every lease/3).
    assert took_s >= OWNERSHIP_LEASE_S * 2 / 3 - 0.5, took_s
    assert took_s <= OWNERSHIP_LEASE_S + 5, took_s

    done = await wait_done(c, 60)
    optimum = done.progress["optimal_power_limit_w"]
    profile = measured(done.progress)
    assert sorted((m.power_limit for m in profile), reverse=True) == LIMITS, describe(
        c, *c.replicas[1:])
    # Resumed, not started over: the windows measured before the kill were kept.
    assert any("resuming after" in s.message for _, s in c.statuses), describe(
        c, *c.replicas[1:])
    bad = inconsistent(profile, PROFILE_STEPS, check_energy=False)
    assert not bad, "\n".join(bad)
    assert optimum == undisturbed_optimum(), describe(c, *c.replicas[1:])
    assert c.job_limits() == dict.fromkeys(c.job_limits(), optimum), describe(c, *c.replicas[1:])
    assert expired == [], f"GPU leases lapsed during the takeover: {expired}"
    result = await c.wait_trainer(80)
    for rank in result["ranks"]:
        assert rank["step_power_limit_w"][-20:] == [optimum] * 20, rank["rank"]


@pytest.mark.timeout(150)
async def test_every_replica_killed_one_restarted_resumes_the_job_from_jetstream(replicated):
    c, _ = replicated
    # Steps to spare: the job goes on while no replica lives, and a replica's start took 8 s on
    # a loaded host (CI: the trainer ended in the last window, which was never measured).
    c.start_trainer(workload=WORKLOAD, steps=1200, scale=SCALE,
                    power_limit=job_options(), timeout_s=100)
    _, status = await c.wait_status(lambda s: s.message.startswith("measuring 200 W"), 40,
                                    "the 200 W window opened")
    job_id = status.job_id
    # 300 and 250 W measured (the 250 W window's marks may still be on their way when 200 W
    # opens; a closed window whose marks are not all in is profiled again after a restart) and
    # in JetStream (progress is written beside the job, a moment later).
    await wait_recorded(c, job_id, lambda p: p.get("kind") == "windows" and {300, 250} <= {
        w["power_limit"] for w in p["state"]["windows"]})
    for name in c.replicas:
        c.procs.kill(name)
    await asyncio.sleep(1.0)
    seen = len(c.statuses)
    c.start_coordinator("coordinator-3")
    c.replicas.append("coordinator-3")
    await c.wait_coordinator()
    _, taken = await c.wait_status(lambda s: s.state == "taken_over", 20, "taken_over", seen)
    assert "coordinator-3" in taken.message
    done = await wait_done(c, 60, seen)
    profile = measured(done.progress)
    assert sorted((m.power_limit for m in profile), reverse=True) == LIMITS
    assert done.progress["optimal_power_limit_w"] == undisturbed_optimum(), describe(
        c, "coordinator-3")
    # The windows measured before the kill were not measured again.
    opened = [s.message for _, s in c.statuses[seen:] if s.message.startswith("measuring")]
    assert not any(m.startswith(("measuring 300 W", "measuring 250 W")) for m in opened), opened
    assert c.job_limits() == dict.fromkeys(c.job_limits(), done.progress[
        "optimal_power_limit_w"])


PROFILER_ARGS = {"clocks": 3, "warmup_iterations": 1, "min_profile_iterations": 2}


@pytest.mark.timeout(180)
async def test_a_pipeline_job_survives_its_owner_and_is_served_by_the_other_replica() -> None:
    """A 4-stage pipeline job (InstructionProfiler): its owner is SIGKILLed after a round of
    profiling; the other replica replays the recorded rounds, reinstalls the schedule reached
    (same version: not profiled again from schedule 0) and takes the job on to its plan."""
    c = SimCluster(replicas=2, coordinator_args=[
        "--scheduler", "InstructionProfiler", "--scheduler-args", json.dumps(PROFILER_ARGS),
        "--profiling-iterations", "3", "--switch-lead-steps", "2",
        "--ownership-lease-s", str(OWNERSHIP_LEASE_S)])
    try:
        await c.start()
        c.start_pipeline_trainer(timeout_s=150)
        _, second = await c.wait_status(
            lambda s: s.state == "profiling" and (s.progress.get("schedule") or 0) >= 1, 60,
            "schedule 1 installed (one round observed)")
        job_id = second.job_id
        owner = await owner_of(c, job_id)
        reached = second.progress["schedule"]
        await wait_recorded(c, job_id, lambda p: p.get("kind") == "pipeline"
                            and len(p["state"]["rounds"]) >= reached)
        c.procs.kill(owner)
        seen = len(c.statuses)
        _, taken = await c.wait_status(lambda s: s.state == "taken_over", 20, "taken_over",
                                       seen)
        _, resumed = await c.wait_status(lambda s: "resumed from the recorded progress"
                                         in s.message, 60, "resumed", seen)
        # Replayed, not rediscovered: the schedule reached (or the next, if the owner got one
        # more round recorded before it died), never schedule 0 again.
        assert resumed.progress["schedule"] >= reached, (resumed.progress, c.messages())
        _, serving = await c.wait_status(lambda s: s.state == "serving", 90, "serving", seen)
        assert "error" not in c.states(), c.messages()
        assert not any(s.state == "discovering" for _, s in c.statuses[seen:]), c.messages()
        assert serving.progress["schedule"] > reached
    finally:
        await c.close()
    assert processes_with_mark(c.procs.mark) == []
