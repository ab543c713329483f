"""A real coordinator and a real agent agree on columns (real nats-server).

The coordinator says on every lease renewal that it reads columns (`Zeus-Reads: columns/1`);
the agent, once it holds a lease of the job (its first power limit), hears it and sends columns
(`--measurement-columns auto`), until a renewal without the header (an older replica) is heard.
The coordinator takes a job's trainer events and marks in columns as it takes rows: the job's
windows are measured from them alone.
"""

from __future__ import annotations

import time
from typing import Any

from tests.shell.coordinator_kit import (
    JOIN_TOKENS,
    NODE,
    ask,
    bind_trainers,
    feed_steps,
    rank_request,
    register_job,
    start,
    stop,
    wait_for,
    wait_for_async,
)
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.event_columns import TrainerEventColumns
from zeus_agent.wire.formats import reads_columns
from zeus_agent.wire.messages import (
    JobQuery,
    LeaseRenewal,
    PowerLimitOptions,
    TrainerEvent,
    TrainerEventBatch,
    join_token_digest,
)


async def test_the_agent_switches_to_columns_on_the_coordinators_word(nats_server, agent, nc,
                                                                      tmp_path) -> None:
    coord, task = await start(nats_server, tmp_path / "c", lease_s=0.6)
    try:
        headers: list[Any] = []

        async def on_renewal(msg: Any) -> None:
            headers.append(msg.headers)

        await nc.subscribe("zeus.lease.*", cb=on_renewal)
        await confirm_subscriptions(nc)
        options = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1,
                                    profile_steps=2)
        job_id = await register_job(nc, dp=2, power_limit=options)
        for r in (0, 1):
            assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
        await bind_trainers(nc, job_id)
        await wait_for(lambda: job_id in coord.optimisers)
        assert agent.settings.measurement_columns == "auto"
        assert not agent.formats.columns(time.monotonic())  # no coordinator heard yet

        async def measured() -> int:
            reply = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
            limit = reply.result["power_limit"]
            return limit["measured"] if limit else 0

        # Events and marks in columns only: the first limit (a lease of the job) reaches the
        # agent, which then hears the owner's renewals, and the windows are measured.
        await feed_steps(nc, job_id, range(7), columns=True)
        await wait_for(lambda: agent.formats.columns(time.monotonic()), 5)
        assert headers and all(reads_columns(h) for h in headers)

        async def both_measured() -> bool:
            return await measured() == 2

        await wait_for_async(both_measured, 5, interval_s=0.05, fail=False)
        assert await measured() == 2
        # An older replica renews the job's leases: no header. Rows until its lease ends.
        old = LeaseRenewal(holder=job_id, lease_s=30.0)
        await nc.publish(subjects.lease_renewal(job_id), codec.encode(old))
        await nc.flush()
        await wait_for(lambda: not agent.formats.columns(time.monotonic()), 3)
    finally:
        await stop(coord, task)


async def test_events_in_columns_are_checked_against_their_subject_as_rows_are(coord,
                                                                               nc) -> None:
    """The same batch, dropped for the same reason in either layout (the checks follow the
    decode, whichever layout it gave): another node's (named in the payload, or only in the
    subject), another GPU's, a trainer without the join token, another job's payload on this
    job's subject."""
    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions())
    other = await register_job(nc, dp=2, power_limit=PowerLimitOptions())
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: job_id in coord.optimisers)
    digest = join_token_digest(JOIN_TOKENS[job_id])
    steps = [TrainerEvent(kind="step_begin", t_ns=1, epoch=0, step=s) for s in range(50)]
    good = TrainerEventBatch(job_id=job_id, rank=0, node=NODE, gpu=0, join_digest=digest,
                             events=steps)
    here = subjects.job_events(job_id, 0, NODE)
    cases = [("wrong_node", subjects.job_events(job_id, 0, "evil"), {"node": "evil"}),
             ("wrong_node", subjects.job_events(job_id, 0, "evil"), {}),
             ("wrong_node", here, {"gpu": 1}),
             ("no_join_token", here, {"join_digest": None}),
             ("wrong_job", here, {"job_id": other})]
    for layout in ("rows", "columns"):
        for reason, subject, change in cases:
            batch = good.model_copy(update=change)
            payload = TrainerEventColumns.from_batch(batch) if layout == "columns" else batch
            before = coord.dropped[reason]
            await nc.publish(subject, codec.encode(payload))
            await nc.flush()
            await wait_for(lambda r=reason, b=before: coord.dropped[r] == b + 1)
    assert coord.optimisers[job_id].last_step is None  # nothing paced the machine
    await nc.publish(here, codec.encode(TrainerEventColumns.from_batch(good)))
    await wait_for(lambda: coord.optimisers[job_id].last_step is not None)  # the good one
