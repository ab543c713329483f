"""Lease renewals heard only for the holders this node's GPUs hold, not for every job's.

A coordinator renews a job's leases on `<p>.lease.<holder>`. Were every agent subscribed to
`<p>.lease.*`, each renewal would reach every node of the cluster: deliveries would grow with
jobs x nodes (about 2.9 million a second at 100,000 GPUs). Each agent instead subscribes to the
subjects of the holders it holds a lease of (a job's power limit, clocks or schedule, a
budget's node cap), so a renewal reaches only its job's nodes.

The set is brought up to date after every command, before its reply goes out (a renewal sent
once the holder has its answer finds the subscription in place), and on every lease-expiry tick
(leases that lapsed, were released or restored). A renewal lost in between costs nothing: a
lease outlives two missed renewals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.wire import subjects

LOG = logging.getLogger(__name__)

__all__ = ["RenewalSubscriptions", "holders_of"]


def holders_of(agents: Iterable[GpuAgent]) -> set[str]:
    """Every holder of a lease on these GPUs: their settings' leases and their node caps'."""
    held: set[str] = set()
    for agent in agents:
        held.update(lease.holder for lease in agent.leases.held())
        cap = agent.cap.holder.cap
        if cap is not None:
            held.add(cap.holder)
    return held


class RenewalSubscriptions:
    """One subscription to `<p>.lease.<holder>` per holder of a lease on the node's GPUs."""

    def __init__(self, prefix: str, agents: Mapping[int, GpuAgent],
                 on_renewal: Callable[[Any], Awaitable[None]]) -> None:
        self.prefix, self.agents, self.on_renewal = prefix, agents, on_renewal
        self.nc: Any = None
        """The NATS connection, once the agent has one."""
        self.subs: dict[str, Any] = {}
        """Holder -> its subscription."""
        self._lock = asyncio.Lock()  # A command's sync and the tick's never interleave.

    async def sync(self) -> None:
        """Follow the holders that came, leave those that went (a failure: the next call)."""
        async with self._lock:
            await self._sync()

    async def _sync(self) -> None:
        held = holders_of(self.agents.values())
        try:
            for holder in sorted(held - self.subs.keys()):
                subject = subjects.lease_renewal(holder, self.prefix)
                self.subs[holder] = await self.nc.subscribe(subject, cb=self.on_renewal)
            for holder in sorted(self.subs.keys() - held):
                sub = self.subs.pop(holder)
                with contextlib.suppress(Exception):  # Closed or draining: it is gone anyway.
                    await sub.unsubscribe()
        except Exception as e:  # noqa: BLE001 - NATS away: the next tick tries again
            LOG.debug("lease renewal subscriptions not updated: %s", e)
