"""`GpuCommands`: the one way a job's GPUs are commanded.

Commands go to the agents of the job's GPUs over one reply inbox (`request_all`), and only while
this replica drives the job (`command`: ownership is checked before the send, and again right
before the messages are handed to NATS, all at once or each, so a replica paused while another
took its job over never sets a GPU again). Each carries this replica's lease as its fencing
token (the `Zeus-Lease` header): an agent refuses it once the lease is over (`stale_lease`),
which also covers a message already handed to NATS when the replica was paused, or held in a TCP
connection through a partition. A GPU that did not take a command is said in the job's status
(`report_failures`).

A node with two or more of a job's commands gets them in one `NodeCommandBatch` on its node's
subject (`request_grouped`, `coordinator.node_groups`), under the same lease header and fence;
the replies are split back per GPU, and a node whose agent does not take batches goes per GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from coordinator import bulk, node_groups
from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRecord
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.state import records
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec
from zeus_agent.wire.fencing import LEASE_HEADER, SenderLease
from zeus_agent.wire.messages import GpuBinding, Reply
from zeus_agent.wire.node_command import NodeCommandReply

__all__ = ["GpuCommands"]

LOG = logging.getLogger(__name__)

PER_GPU_S = 300.0
"""How long a node whose batch was not taken gets its commands one per GPU (an older agent)."""
SEEN_REPLIES = 16
"""Distinct replies one `request_all` keeps decoded, by their bytes (the first 16 seen)."""


class GpuCommands:
    """Sends the jobs' commands to their GPUs' agents, fenced by this replica's leases.

    Attributes:
        fenced: GPU commands not sent (the job was no longer this replica's) or refused by
            their agent as sent under a lease that is over (`stale_lease`).
    """

    def __init__(self, settings: CoordinatorSettings, link: Link, leases: Leases) -> None:
        self.settings = settings
        self.link = link
        self.leases = leases
        self.fenced = 0
        self.batch_fallbacks = 0
        self.per_gpu_until: dict[str, float] = {}
        """Node subjects sent one request per GPU until this time (`time.monotonic`)."""

    async def command(self, record: JobRecord, what: str,
                      requests: list[tuple[str, bytes]]) -> list[Reply | str] | None:
        """Send a job's commands to its GPUs if this replica drives the job now (else None).

        The one way a job's GPUs are commanded: ownership is checked just before the send, so
        a replica that was paused (SIGSTOP, a stalled event loop) while another took its job
        over never sets a GPU again, whatever path led here (events after a quiet spell, a
        heartbeat, a lapse, a plan that finished meanwhile).
        """
        if not requests:
            return []
        replies = None
        if await self.leases.owns_now(record.job_id):
            replies = await self.request_grouped(requests, self.fencing_headers(record.job_id),
                                                 fence=lambda: self.leases.owns(record.job_id))
        if replies is None:
            self.fenced += len(requests)
            LOG.warning("job %s: %s not sent to %d GPU(s): this replica no longer drives the job",
                        record.job_id, what, len(requests))
        return replies

    async def request_grouped(self, requests: list[tuple[str, bytes]],
                              headers: dict[str, str] | None = None,
                              fence: Callable[[], bool] | None = None) -> list[Reply | str] | None:
        """`request_all`, with one request per node of >= 2 requests (`node_groups`).

        A node whose batch got no usable answer (no responders, a timeout, one refusal for the
        whole batch: an agent older than the batches) gets its requests one per GPU at once,
        and one per GPU for `PER_GPU_S` after. The same `fence` guards every send, the
        fallback's too; None as `request_all`'s. The replies are in the requests' order.
        """
        now = time.monotonic()
        for subject in [k for k, until in self.per_gpu_until.items() if until <= now]:
            del self.per_gpu_until[subject]
        grouped = node_groups.plan(requests, self.per_gpu_until)
        sent = [(b.subject, node_groups.batch_payload(b, requests)) for b in grouped.batches]
        sent += [requests[i] for i in grouped.singles]
        got = await self.request_all(sent, headers, fence)
        if got is None:
            return None
        results: list[Reply | str | None] = [None] * len(requests)
        for at, i in enumerate(grouped.singles, start=len(grouped.batches)):
            results[i] = _one(got[at])
        again: list[int] = []
        for batch, reply in zip(grouped.batches, got, strict=False):
            if not node_groups.split(batch, reply, results):
                self.per_gpu_until[batch.subject] = now + PER_GPU_S
                self.batch_fallbacks += 1
                LOG.info("%s: batch of %d command(s) not taken (%s); per GPU for %g s",
                         batch.subject, len(batch.indices),
                         reply if isinstance(reply, str) else getattr(reply, "code", "count"),
                         PER_GPU_S)
                again.extend(batch.indices)
        if again:
            retried = await self.request_all([requests[i] for i in again], headers, fence)
            if retried is None:
                return None
            for i, reply in zip(again, retried, strict=True):
                results[i] = _one(reply)
        return [r if r is not None else "no reply" for r in results]

    def fencing_headers(self, job_id: str) -> dict[str, str] | None:
        """The `LEASE_HEADER` of the job's commands: this replica's lease, their fencing token."""
        job_hash = records.job_hash(job_id)
        lease = self.leases.book.leases.get(job_hash)
        if lease is None:
            return None
        token = SenderLease(lease.owner, lease.incarnation, lease.revision, lease.until, job_hash)
        return {LEASE_HEADER: token.header()}

    async def report_failures(self, record: JobRecord, what: str, gpus: list[GpuBinding],
                              replies: list[Reply | str], state: str = "error") -> None:
        """Say which GPUs did not take a command.

        A GPU whose trainer left (`trainer_left`) is no failure of the job: a command may cross
        the trainer's goodbye, and a trainer that died is reported by its agent (`trainer_gone`).
        Nor is one that refused this replica's lease as over (`stale_lease`): the job is
        another replica's now, and its status is that replica's to say.
        """
        stale = sum(1 for r in replies if isinstance(r, Reply) and r.code == "stale_lease")
        if stale:
            self.fenced += stale
            LOG.warning("job %s: %s refused by %d GPU(s): this replica's lease is over there",
                        record.job_id, what, stale)
        errors = [
            f"{g.node}/gpu{g.gpu_index}: {r if isinstance(r, str) else r.error}"
            for g, r in zip(gpus, replies, strict=True)
            if isinstance(r, str) or not (r.ok or r.code in ("trainer_left", "stale_lease"))
        ]
        if errors:
            more = f"; ... ({len(errors)} in all)" if len(errors) > 8 else ""
            await self.link.status(record.job_id, state,
                                   f"{what} failed on " + "; ".join(errors[:8]) + more)

    async def request_all(self, requests: list[tuple[str, bytes]],
                          headers: dict[str, str] | None = None,
                          fence: Callable[[], bool] | None = None,
                          ) -> list[Reply | NodeCommandReply | str] | None:
        """Send many requests at once over one reply inbox, within `command_timeout_s`.

        Cheaper than one `nc.request` per GPU (no future, timer and task each), which matters
        when a job has thousands of GPUs; most GPUs answer alike (`{ok: true}`), and a reply's
        bytes seen before are not decoded again (the same `Reply` object, read-only).

        `fence` is asked right before the requests are handed to NATS (nothing awaited between
        the two; all at once through `coordinator.bulk`, else before each): once it says False,
        the rest are not sent and None is returned. The awaits before (the inbox's
        subscription, earlier sends) are where a paused process resumes.

        Returns:
            Per request, in order: the `Reply`, or a text saying why there is none; None when
            `fence` stopped the sending.
        """
        if not requests:
            return []
        nc, timeout_s = self.link.nc, self.settings.command_timeout_s
        inbox = nc.new_inbox()
        results: list[Reply | NodeCommandReply | str | None] = [None] * len(requests)
        seen: dict[bytes, Reply | NodeCommandReply | str] = {}  # By their bytes (`SEEN_REPLIES`).
        left = len(requests)
        all_in = asyncio.Event()

        async def on_reply(msg: Any) -> None:
            nonlocal left
            try:
                i = int(msg.subject.rsplit(".", 1)[1])
                if results[i] is not None:
                    return
            except (ValueError, IndexError):
                return
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                results[i] = "no agent answers (is zeus-agent running there?)"
            elif (same := seen.get(msg.data)) is not None:
                results[i] = same
            else:
                reply: Reply | NodeCommandReply | str
                try:
                    reply = codec.decode_either(msg.data, Reply, NodeCommandReply, "replies")
                except PayloadError as e:
                    reply = f"bad reply: {e}"
                results[i] = reply
                if len(seen) < SEEN_REPLIES:
                    seen[msg.data] = reply
            left -= 1
            if left == 0:
                all_in.set()

        sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
        try:
            if not await _send_all(nc, requests, inbox, headers, fence):
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), timeout_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        timeout = f"no reply within {timeout_s:g} s"
        return [timeout if r is None else r for r in results]


def _one(reply: Reply | NodeCommandReply | str) -> Reply | str:
    """A GPU's reply; a node's replies where one GPU's was due is a bad reply."""
    if isinstance(reply, NodeCommandReply):
        return "bad reply: a node's batch of replies to one GPU's command"
    return reply


async def _send_all(nc: Any, requests: list[tuple[str, bytes]], inbox: str,
                    headers: dict[str, str] | None, fence: Callable[[], bool] | None) -> bool:
    """Send `request_all`'s requests (replies to `<inbox>.<i>`); False: `fence` stopped them.

    All at once in one buffer where `coordinator.bulk` can (the fence asked once, right before
    it is handed over: thousands of first limits, each a `publish` before), else one by one.
    """
    header = None
    try:
        header = bulk.header_block(headers) if headers else None
        fast = bulk.sendable(nc, (s for s, _ in requests), (p for _, p in requests))
    except ValueError:
        fast = False
    if fast:
        commands = b"".join(bulk.command(subject, f"{inbox}.{i}", header, payload)
                            for i, (subject, payload) in enumerate(requests))
        if fence is not None and not fence():
            return False
        await bulk.send(nc, commands, len(requests), sum(len(p) for _, p in requests))
        return True
    for i, (subject, payload) in enumerate(requests):
        if fence is not None and not fence():
            return False
        await nc.publish(subject, payload, reply=f"{inbox}.{i}", headers=headers)
    return True
