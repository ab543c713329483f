"""`GpuReports`: one GPU's error events, and its flood-prone ones counted exactly, throttled.

`error_event` publishes an `ErrorEvent` on the GPU's error subject (its bound rank named).
`report` is for the kinds that can flood: a changed pipeline shape mismatches every
instruction (20,000 warnings and events in 1.5 s unthrottled). Each kind (`FLOODS`: schedule
mismatches, measurement gaps, failed clock changes) goes through a token bucket per bound rank
(`Throttle`): the first `FLOOD_BURST` are reported, then `FLOOD_REPORTS_PER_S`; a report
carries how many were held back before it, and those held back after the last one go out in
one summary once the bucket allows. The counters stay exact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from zeus_agent.agent.core import Throttle
from zeus_agent.agent.measuring import Binding
from zeus_agent.models import MAX_NAME_CHARS
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import ErrorEvent
from zeus_agent.wire.text import bounded

__all__ = ["FLOODS", "FLOOD_BURST", "FLOOD_REPORTS_PER_S", "GpuReports"]

LOG = logging.getLogger("zeus_agent.agent.gpu_agent")  # (its log lines keep their logger)

FLOOD_REPORTS_PER_S = 2.0
"""Reports (logged and published) per second of one kind after the first `FLOOD_BURST`."""
FLOOD_BURST = 3
FLOODS = {"mismatches": "schedule mismatch(es)", "gaps": "measurement gap(s)",
          "clock_failures": "failed clock change(s)"}
"""Counter -> what its reports call the events."""


class GpuReports:
    """Publishes one GPU's error events; throttles the flood-prone kinds per kind and rank."""

    def __init__(
        self,
        index: int,
        node: str,
        prefix: str,
        publish: Callable[[str, bytes], Awaitable[None]],
        counters: dict[str, int],
        binding: Callable[[], Binding | None],
        spawn: Callable[[Awaitable[None]], asyncio.Future[None]],
    ) -> None:
        """Publish through the agent's `publish`, counting into its `counters`."""
        self.index = index
        self.node = node
        self.prefix = prefix
        self._publish = publish
        self.counters = counters
        self._binding = binding
        self._spawn = spawn
        self._throttles: dict[str, Throttle] = {}
        """Counter -> the throttle of its reports (per bound rank: `rebound` starts afresh)."""
        self._summaries: dict[Throttle, asyncio.Future[None]] = {}
        """The summary task of each throttle (per throttle: a rebind starts new throttles while
        the old ones' summaries still wait to report what they held back)."""

    async def error_event(
        self, code: str, message: str, detail: dict | None = None, binding: Binding | None = None,
        log_level: int = logging.WARNING,
    ) -> None:
        """Publish an error event about this GPU (and its bound rank, or `binding`'s)."""
        b = binding or self._binding()
        event = ErrorEvent(
            source=f"agent:{self.node}/gpu{self.index}"[-MAX_NAME_CHARS:],
            code=code,
            message=bounded(message),  # It may name what a trainer sent.
            job_id=b.job_id if b else None,
            rank=b.rank if b else None,
            detail=detail or {},
        )
        LOG.log(log_level, "GPU %d: %s: %s", self.index, code, message)
        await self._publish(
            subjects.gpu_errors(self.node, self.index, self.prefix), codec.encode(event)
        )

    def refused(self, message: str, detail: dict[str, str]) -> None:
        """A closed step or instruction that cannot be measured (its counters): say so."""
        self._spawn(self.error_event("measurement_refused", message, detail=dict(detail)))

    def rebound(self) -> None:
        """Another rank is bound: its reports start with a full burst."""
        self._throttles = {}

    def report(self, counter: str, code: str, message: str, detail: dict[str, Any]) -> None:
        """Count one of a flood-prone kind (`FLOODS`); report it unless throttled."""
        self.counters[counter] += 1
        throttle = self._throttles.setdefault(counter, Throttle(FLOOD_REPORTS_PER_S, FLOOD_BURST))
        held = throttle.hit(time.monotonic())
        if held is None:
            summary = self._summaries.get(throttle)
            if summary is None or summary.done():
                self._summaries = {t: f for t, f in self._summaries.items() if not f.done()}
                self._summaries[throttle] = self._spawn(
                    self._summarise(counter, code, throttle, self._binding()))
            return
        if held:
            message = f"{message} ({held} more {FLOODS[counter]} not reported before it)"
            detail = {**detail, "suppressed": held}
        self._spawn(self.error_event(code, message, detail=detail))

    async def _summarise(
        self, counter: str, code: str, throttle: Throttle, binding: Binding | None
    ) -> None:
        """Report what a throttle held back once it allows (a flood may just have ended)."""
        while throttle.held:
            await asyncio.sleep(throttle.wait_s(time.monotonic()) + 0.01)
            held = throttle.flush(time.monotonic())
            if held:
                await self.error_event(
                    code,
                    f"{held} more {FLOODS[counter]} since the last one reported "
                    f"({throttle.seen} in all for this rank on GPU {self.index})",
                    detail={"suppressed": held},
                    binding=binding,
                )
