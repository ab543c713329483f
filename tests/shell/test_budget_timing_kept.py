"""What the budgets' owner measured of a Perseus job it drove survives a takeover, over a
real nats-server.

The replica driving a job (here the budgets' owner) writes its measured options to the state
bucket when they move (`store.TimingStore`, `LoopBucket.keep_timing`); a replica taking the
job and the budgets over reads them once per job (`LoopBucket.resume_timing`) and plans on
them at once, as its predecessor did, where a replica starting afresh planned on the models
again (here they count the job's 125 W option at its cap, where it drew 105 W a GPU, and cut
it deeper) until it had measured every option anew. Measures of another frontier, an
unreadable value or another job's are not taken; a job gone has its measures purged (by its
driver, and with the job's other records when it is removed). A job another replica drives:
tests/shell/test_budget_remote.py.
"""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from nats.js.api import KeyValueConfig

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView, TimingStore
from coordinator.budget.timing import MIN_STEPS, frontier_digest
from coordinator.state.jetstream import JetStreamState
from coordinator.state.records import job_hash, timing_key
from zeus_agent.wire.budget import Budget

VIEW = fo.FrontierView(times=(1.0, 1.6), powers=(250.0, 160.0), peaks=(280.0, 170.0),
                       chosen=0)
"""One Perseus job on 2 A40s: its own point 1.0 s at 250 W per GPU, the slowest 1.6 s at
160 W; under 160 W, the slowest point throttled (modelled at its energy, at the cap)."""
JOB = enforce.JobView("perseus", (("n", 0), ("n", 1)), frontier=VIEW, own_step_s=1.0)
BUDGET = Budget(budget_id="grid", cap_w=250.0)
"""125 W per GPU: the job must run a throttled option."""


async def bucket(nc: Any) -> Any:
    js = nc.jetstream()
    return await js.create_key_value(KeyValueConfig(bucket=f"t-{uuid.uuid4().hex[:12]}"))


def replica(kv: Any, name: str) -> BudgetLoop:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for i in range(2):
        cluster.sample("n", i, 120.0)  # (Under the cap: the tightener leaves the room.)
    link: Any = SimpleNamespace(require_state=lambda: SimpleNamespace(kv=kv))
    book: Any = SimpleNamespace(me=name)
    return BudgetLoop(link=link, book=book, cluster=cluster, jobs=list, cap_lease_s=30.0,
                      view=BudgetView())


def slowdown(loop: BudgetLoop) -> float | None:
    """The job's slowdown in the loop's plan of the budget (its own point: 0)."""
    (share,) = loop.statuses["grid"].shares
    return share.slowdown


async def measure(old: BudgetLoop) -> None:
    """The owner holds the job at 125 W; it runs 2.4x its own step time there, 105 W a GPU."""
    old.points = {"perseus": (-125, 125.0)}
    history: list[tuple[int, float, float | None]] = []
    for n in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):
        history.append((n + 1, 2.4, 2.4 * 105.0))
        old.plan([BUDGET], True, [dataclasses.replace(JOB, step_times=tuple(history))])
        await old.bucket.keep_timing(old.views, old.timing)


@pytest.mark.timeout(30)
async def test_a_replica_taking_the_budgets_over_plans_on_the_measures_kept(nc) -> None:
    kv = await bucket(nc)
    old = replica(kv, "one")
    await old.bucket.resume_timing([JOB], old.timing)  # nothing kept yet
    assert old.timing.measured("perseus") == ()
    await measure(old)
    measured = old.timing.measured("perseus")
    assert [m.key for m in measured] == [-125]
    assert measured[0].relative_time == pytest.approx(2.4)
    kept = await TimingStore(kv).get("perseus")
    assert kept is not None and kept == old.timing.record("perseus")
    assert kept.frontier == frontier_digest(VIEW.chosen, VIEW.times)
    revision = (await kv.get(timing_key(job_hash("perseus")))).revision
    old.plan([BUDGET], True, [JOB])  # (A round with nothing new measured: nothing written.)
    await old.bucket.keep_timing(old.views, old.timing)
    assert (await kv.get(timing_key(job_hash("perseus")))).revision == revision
    planned = slowdown(old)
    assert planned == pytest.approx(1.4)  # 2.4 s where the own point takes 1.0 s

    new, fresh = replica(kv, "two"), replica(kv, "three")
    # (It took the budgets over: it reads what was kept.)
    await new.bucket.resume_timing([JOB], new.timing)
    new.plan([BUDGET], True, [JOB])
    fresh.plan([BUDGET], True, [JOB])  # (A replica that did not read them: the models.)
    assert new.timing.measured("perseus") == measured
    assert slowdown(new) == pytest.approx(planned)
    assert new.plans["grid"].caps == old.plans["grid"].caps
    # The models count the 125 W option at its cap (the job drew 105 W a GPU there): it
    # does not fit the room, and the job is cut to 100 W (2.56 s where it runs 2.4 s).
    assert new.plans["grid"].caps == {("n", 0): 125, ("n", 1): 125}
    assert fresh.plans["grid"].caps == {("n", 0): 100, ("n", 1): 100}
    assert slowdown(fresh) == pytest.approx(1.6 * 160 / 100 - 1)  # at its energy, at 100 W

    new.plan([BUDGET], True, [])  # The job ended: its measures are purged.
    await new.bucket.keep_timing(new.views, new.timing)
    assert await TimingStore(kv).get("perseus") is None and not new.bucket.timing_read


@pytest.mark.timeout(30)
async def test_measures_of_another_frontier_or_unreadable_ones_are_not_taken(nc) -> None:
    kv = await bucket(nc)
    old = replica(kv, "one")
    await measure(old)
    replanned = dataclasses.replace(JOB, frontier=dataclasses.replace(VIEW, times=(1.0, 1.7)))
    new = replica(kv, "two")
    await new.bucket.resume_timing([replanned], new.timing)
    assert new.timing.measured("perseus") == () and "perseus" in new.bucket.timing_read
    # (Read once per job while it owns the budgets.)
    await new.bucket.resume_timing([JOB], new.timing)
    assert new.timing.measured("perseus") == ()

    key = timing_key(job_hash("perseus"))
    kept = await TimingStore(kv).get("perseus")
    assert kept is not None
    for garbage in (b"not json", b'{"v": 1}', b"x" * 70_000,
                    kept.model_copy(update={"job_id": "other"}).model_dump_json().encode(),
                    kept.model_dump_json().replace("2.4", "-2.4").encode()):
        await kv.put(key, garbage)
        assert await TimingStore(kv).get("perseus") is None
        later = replica(kv, "three")
        await later.bucket.resume_timing([JOB], later.timing)  # (No error: measured again.)
        assert later.timing.measured("perseus") == ()
    await TimingStore(kv).delete("perseus")
    await TimingStore(kv).delete("perseus")  # (twice: nothing to forget)
    assert await TimingStore(kv).get("perseus") is None


@pytest.mark.timeout(30)
async def test_a_removed_job_has_its_measures_purged_with_its_records(nc) -> None:
    state = JetStreamState(nc, "zeus", bucket=f"t-{uuid.uuid4().hex[:12]}")
    await state.open()
    kept = replica(state.kv, "one")
    await measure(kept)
    assert await TimingStore(state.kv).get("perseus") is not None
    await state.delete_job("perseus")
    assert await TimingStore(state.kv).get("perseus") is None
