"""An agent sends columns only while the coordinators it hears read them (real nats-server).

With `--measurement-columns auto` (the default) the agent hears the coordinators that own its
jobs through their lease renewals (`<p>.lease.<holder>`, followed once it holds a lease of the
holder): rows before any is heard; columns (`TrainerEventColumns`, `NodeColumnBatch`) once a
renewal says `Zeus-Reads: columns/1`; rows again as soon as a renewal without it (an older
replica) is heard, for that renewal's lease; columns once it has run out. `on` and `off` ignore
the renewals.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.shell.agent_kit import Inbox, RawTrainer, command, running_agent, wait_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.event_columns import TrainerEventColumns, decode_events
from zeus_agent.wire.formats import reads_headers
from zeus_agent.wire.messages import LeaseRenewal, SetPowerLimitCmd
from zeus_agent.wire.node_columns import NodeColumnBatch, decode_measurements

JOB = "jobCols"
OLD_LEASE_S = 1.0
"""The lease of the older replica's renewal: rows for that long after it."""


async def _layouts(trainer: RawTrainer, events: Inbox, meas: Inbox, step: int) -> set[str]:
    """One step of the trainer: the layouts its event batch and the node's batch came in."""
    trainer.event(dg.Kind.STEP_BEGIN, step, 0)
    await asyncio.sleep(0.02)
    trainer.event(dg.Kind.STEP_END, step, 0)
    layouts = set()
    msg = await events.sub.next_msg(timeout=3.0)
    layouts.add("columns" if isinstance(decode_events(msg.data), TrainerEventColumns)
                else "rows")
    msg = await meas.sub.next_msg(timeout=3.0)
    layouts.add("columns" if isinstance(decode_measurements(msg.data), NodeColumnBatch)
                else "rows")
    return layouts


async def _drain(*inboxes: Inbox) -> None:
    """Forget what earlier steps sent (a late flush): the next step's batches come next."""
    await asyncio.sleep(0.3)
    for inbox in inboxes:
        while inbox.sub.pending_msgs:
            await inbox.sub.next_msg(timeout=0.1)


async def _renew(nc: Any, reads: bool, lease_s: float) -> None:
    renewal = codec.encode(LeaseRenewal(holder=JOB, lease_s=lease_s))
    await nc.publish(subjects.lease_renewal(JOB), renewal,
                     headers=reads_headers() if reads else None)
    await nc.flush()


async def _bound_agent(nc: Any, agent: Any) -> tuple[RawTrainer, Inbox, Inbox]:
    """A trainer bound to GPU 0 for JOB, a lease of JOB held there, both streams followed."""
    node = agent.settings.node
    events = await Inbox.open(nc, subjects.job_events(JOB, 0, node))
    meas = await Inbox.open(nc, subjects.job_measurements(JOB, node))
    trainer = RawTrainer(agent.settings.socket_path)
    assert (await trainer.hello(JOB, rank=0, gpu_index=0)).ok
    cmd = SetPowerLimitCmd(power_limit_w=250, holder=JOB, lease_s=60)
    assert (await command(nc, node, 0, cmd)).ok  # (The agent now follows JOB's renewals.)
    await wait_for(lambda: JOB in agent.renewals.subs, 3.0, "the renewals followed")
    return trainer, events, meas


async def test_auto_sends_columns_while_every_coordinator_heard_reads_them(nats_server,
                                                                          nc) -> None:
    async with running_agent(nats_server.url, sim_count=1, measurement_flush_s=0) as agent:
        assert agent.settings.measurement_columns == "auto"
        trainer, events, meas = await _bound_agent(nc, agent)
        try:
            assert await _layouts(trainer, events, meas, 0) == {"rows"}  # none heard yet
            await _renew(nc, reads=True, lease_s=60)
            await wait_for(lambda: agent.formats.columns(time.monotonic()), 2.0, "heard")
            await _drain(events, meas)
            assert await _layouts(trainer, events, meas, 1) == {"columns"}
            assert agent.health()[1]["layout"] == "columns"  # (`/healthz` says it too.)
            await _renew(nc, reads=False, lease_s=OLD_LEASE_S)  # an older replica renews
            await _drain(events, meas)
            assert await _layouts(trainer, events, meas, 2) == {"rows"}
            assert agent.health()[1]["layout"] == "rows"
            await _renew(nc, reads=True, lease_s=60)  # (still within the older one's lease)
            await _drain(events, meas)
            assert await _layouts(trainer, events, meas, 3) == {"rows"}
            await asyncio.sleep(OLD_LEASE_S)  # the older replica is not heard again
            await _drain(events, meas)
            assert await _layouts(trainer, events, meas, 4) == {"columns"}
        finally:
            trainer.close()


async def test_on_and_off_ignore_the_renewals(nats_server, nc) -> None:
    for mode, renewal_reads, expected in (("on", False, "columns"), ("off", True, "rows")):
        async with running_agent(nats_server.url, sim_count=1, measurement_flush_s=0,
                                 measurement_columns=mode) as agent:
            trainer, events, meas = await _bound_agent(nc, agent)
            try:
                assert await _layouts(trainer, events, meas, 0) == {expected}
                await _renew(nc, reads=renewal_reads, lease_s=60)
                await _drain(events, meas)
                assert await _layouts(trainer, events, meas, 1) == {expected}
            finally:
                trainer.close()
            await Inbox.close_all()


async def test_a_job_whose_owner_is_not_heard_gets_rows_while_another_jobs_gets_columns(
        nats_server, nc) -> None:
    """The agent hears only the owners of the jobs it holds a lease of.

    A job whose rank is bound here but holds no lease on the node (a pipeline job observing
    its first iteration, a job before its first limit) has an owner the agent never hears: an
    older replica for all the agent knows. Its batches stay rows while another job's owner,
    heard, gets columns.
    """
    other = "jobOtherOwner"
    async with running_agent(nats_server.url, sim_count=2, measurement_flush_s=0) as agent:
        node = agent.settings.node
        events = await Inbox.open(nc, subjects.job_events(JOB, 0, node))
        meas = await Inbox.open(nc, subjects.job_measurements(JOB, node))
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello(JOB, rank=0, gpu_index=0)).ok  # no lease of JOB
            cmd = SetPowerLimitCmd(power_limit_w=250, holder=other, lease_s=60)
            assert (await command(nc, node, 1, cmd)).ok  # GPU 1: a lease of the other job
            await wait_for(lambda: other in agent.renewals.subs, 3.0, "the renewals followed")
            renewal = codec.encode(LeaseRenewal(holder=other, lease_s=60))
            await nc.publish(subjects.lease_renewal(other), renewal, headers=reads_headers())
            await nc.flush()
            await wait_for(lambda: agent.formats.columns(time.monotonic(), other), 2.0, "heard")
            assert not agent.formats.columns(time.monotonic(), JOB)
            assert agent.health()[1]["layout"] == "columns"  # (Some job's go in columns.)
            await _drain(events, meas)
            assert await _layouts(trainer, events, meas, 0) == {"rows"}
        finally:
            trainer.close()
