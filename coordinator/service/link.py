"""`Link`: the replica's NATS connection and state bucket as its helpers reach them.

The helpers are made before NATS is connected: the service's start-up hands the connection and
the state bucket over (`attach`, `use_state`) and its shutdown drains NATS here (`drain`). The
helpers read them here, publish the jobs' status events (`status`) and count the stream
messages they drop (`drop`), without holding the service.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from coordinator.state.jetstream import JetStreamState, StateUnavailableError
from zeus_agent import broker
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus
from zeus_agent.wire.text import bounded

__all__ = ["Link"]

LOG = logging.getLogger("coordinator.service")


class Link:
    """The NATS connection, the state bucket, status events and drop counts of one replica.

    Attributes:
        prefix: The subject prefix.
        dropped: Stream messages dropped, by reason (spoofed node, unknown rank...).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._nc: Any = None
        self._state: JetStreamState | None = None
        self.dropped: Counter[str] = Counter()

    @property
    def nc(self) -> Any:
        """The NATS connection (None before `attach` and once drained)."""
        return self._nc

    @property
    def state(self) -> JetStreamState | None:
        """The state bucket (None before `use_state`)."""
        return self._state

    def attach(self, nc: Any) -> None:
        """Start-up connected NATS: the helpers reach it here until `drain`."""
        self._nc = nc

    def use_state(self, state: JetStreamState) -> None:
        """Start-up made the state bucket (it opens it next): the helpers reach it here."""
        self._state = state

    async def drain(self) -> None:
        """Drain NATS and forget the connection (a shutdown step; nothing when not attached)."""
        if self._nc is not None:
            await broker.drain(self._nc)
            self._nc = None

    @property
    def connected(self) -> bool:
        """Whether NATS is connected now."""
        return self.nc is not None and self.nc.is_connected

    def require_state(self) -> JetStreamState:
        """The state bucket (raises `StateUnavailableError` before it is open)."""
        if self.state is None:
            raise StateUnavailableError("the coordinator is not connected to its state yet")
        return self.state

    def drop(self, reason: str, subject: str, detail: object) -> None:
        """Count a dropped stream message; log the first of each reason and then every 1000th."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n == 1 or n % 1000 == 0:
            LOG.warning("dropped a message on %s (%s, %d so far): %s", bounded(subject, 300),
                        reason, n, bounded(detail, 500))

    async def status(
        self, job_id: str, state: str, message: str, progress: dict[str, Any] | None = None
    ) -> None:
        """Publish a job status event (and log it)."""
        message = bounded(message)  # It often names what a peer sent.
        LOG.info("job %s: %s: %s", job_id, state, message)
        try:
            event = JobStatus(job_id=job_id, state=state, message=message,
                              progress=progress or {})
            await self.nc.publish(subjects.job_status(job_id, self.prefix), codec.encode(event))
        except Exception as e:  # noqa: BLE001 - a status that cannot go out stops nothing
            LOG.warning("job %s: status %s not published: %s", job_id, state, bounded(e, 300))
