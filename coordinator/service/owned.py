"""`OwnedStreams`: this replica subscribes only to the streams of the jobs it drives.

A job's trainer events (`<p>.job.<job>.ev.*.*`) and its nodes' measurement batches
(`<p>.job.<job>.meas.*`) are its heavy streams. Subscribed by every
replica, each paid for every message of every job (NATS delivery, a callback, a lookup) and
dropped those of other replicas' jobs, so a second replica added failover but no capacity.
Subscribed per job by its owner only (a subject per job, from its lease: NATS routes each
message to the one replica that wants it), the replicas share the load as they share the jobs
(`coordinator.state.assignment`).

A job's subscriptions are made as soon as its lease is taken (`Leases.on_taken`) and
reconciled with the leases this replica holds every ownership round (`reconcile`): one this
replica no longer holds is dropped; messages sent while no replica holds the job are lost, as
they were dropped before (no optimiser runs for it meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from coordinator.service.link import Link

__all__ = ["OwnedStreams"]

LOG = logging.getLogger(__name__)

Subscriptions = Callable[[str], list[tuple[str, Any]]]
"""A job id -> the (subject, callback) pairs its owner follows."""


class OwnedStreams:
    """The subscriptions of the jobs this replica holds, by job id."""

    def __init__(self, link: Link, of_job: Subscriptions) -> None:
        self.link = link
        self.of_job = of_job
        self._subs: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._subs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._subs

    async def follow(self, job_id: str) -> None:
        """Subscribe to the job's streams (nothing if already done, or NATS is gone)."""
        nc = self.link.nc
        if job_id in self._subs or nc is None:
            return
        self._subs[job_id] = []  # (Claimed before awaiting: a second call adds nothing.)
        made = []
        try:
            for subject, callback in self.of_job(job_id):
                made.append(await nc.subscribe(subject, cb=callback))
        except Exception as e:  # noqa: BLE001 - the connection closed: reconciled next round
            LOG.warning("job %s: could not follow its streams (%s); trying again", job_id, e)
            self._subs.pop(job_id, None)
            await _unsubscribe(made)
            return
        if job_id in self._subs:
            self._subs[job_id] = made
        else:  # Dropped while subscribing.
            await _unsubscribe(made)

    async def drop(self, job_id: str) -> None:
        """Stop following the job's streams."""
        await _unsubscribe(self._subs.pop(job_id, []))

    async def reconcile(self, held: Iterable[str]) -> None:
        """Follow exactly the jobs of `held` (the ids of the jobs this replica holds)."""
        wanted = set(held)
        for job_id in [j for j in self._subs if j not in wanted]:
            await self.drop(job_id)
        for job_id in wanted:
            if job_id not in self._subs:
                await self.follow(job_id)

    async def close(self) -> None:
        """Drop every subscription (shutdown)."""
        for job_id in list(self._subs):
            await self.drop(job_id)


async def _unsubscribe(subs: list[Any]) -> None:
    for sub in subs:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
