"""`GpuDirectory`: what the coordinator knows of the GPUs its jobs' ranks run on.

An agent describes a GPU (its power-limit range above all) when it relays a rank's
registration, or when asked (`info`); descriptions are trusted for `GPU_INFO_TTL_S`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator.config import CoordinatorSettings
from coordinator.service.link import Link
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, GpuDescription, InfoCmd, Reply
from zeus_agent.wire.text import bounded

__all__ = ["GPU_INFO_TTL_S", "GpuDirectory"]

LOG = logging.getLogger(__name__)

GPU_INFO_TTL_S = 30.0
"""How long an agent's answer to `info` is trusted before asking again (s)."""

INFO_COMMAND = codec.encode(CommandEnvelope(cmd=InfoCmd()))


class GpuDirectory:
    """GPU descriptions by (node, index), asked of their agents over `link`.

    Attributes:
        limits: (node, index) -> (min, max) power limit (W): from descriptions, and from the
            state bucket (the replica that registered the rank recorded them).
    """

    def __init__(self, settings: CoordinatorSettings, clock: Callable[[], float],
                 link: Link) -> None:
        self.settings = settings
        self.clock = clock
        self.link = link
        self.limits: dict[tuple[str, int], tuple[int, int]] = {}
        self.why_not: dict[tuple[str, int], str] = {}
        """(node, index) -> why the last `describe` of the GPU gave nothing."""
        self.refused: set[tuple[str, int]] = set()
        """GPUs whose agent answered with a refusal or an impossible description (asking
        again gives the same): their jobs fail instead of waiting for them."""
        self._cache: dict[tuple[str, int], tuple[float, GpuDescription]] = {}
        self.periods: dict[tuple[str, int], float | None] = {}
        """(node, index) -> how often its energy counter changes (ms, 0: continuous), as its
        description said (None: not said; absent: not described to this replica)."""

    def remember(self, key: tuple[str, int], limits: tuple[int, int],
                 period_ms: float | None, period_known: bool) -> None:
        """What a rank's record says of its GPU, kept unless known already.

        Its limits and, when recorded, its energy counter's period: the owner need not ask
        its agent.
        """
        self.limits.setdefault(key, limits)
        if period_known:
            self.periods.setdefault(key, period_ms)

    def energy_period_s(self, gpus: list[tuple[str, int]]) -> float | None:
        """The longest energy-counter period of `gpus` (s), None if none was announced."""
        known = [p for p in (self.periods.get(g) for g in gpus) if p is not None]
        return max(known) / 1000 if known else None

    def know(self, node: str, info: GpuDescription, now: float | None = None) -> None:
        """Remember a GPU's description (its power-limit range above all)."""
        key = (node, info.index)
        self._cache[key] = (self.clock() if now is None else now, info)
        self.limits[key] = (info.min_power_limit_w, info.max_power_limit_w)
        self.periods[key] = info.energy_period_ms

    async def describe(self, node: str, index: int) -> GpuDescription | None:
        """The agent's description of a GPU (cached for `GPU_INFO_TTL_S`), None if no answer."""
        s = self.settings
        key = (node, index)
        cached = self._cache.get(key)
        now = self.clock()
        if cached is not None and now - cached[0] < GPU_INFO_TTL_S:
            return cached[1]
        subject = subjects.gpu_command(node, index, s.prefix)
        try:
            raw = await self.link.nc.request(subject, INFO_COMMAND, timeout=s.command_timeout_s)
            reply = codec.decode(raw.data, Reply)
            if not reply.ok:
                LOG.warning("agent on %s refused info: %s", subject, bounded(reply.error, 300))
                self.why_not[key] = f"its agent refused info ({bounded(reply.error, 200)})"
                self.refused.add(key)
                return None
            info = codec.validate(GpuDescription, reply.result.get("gpu"))
        except PayloadError as e:  # A description out of bounds: not a GPU's.
            LOG.warning("unusable info from %s: %s", subject, e)
            self.why_not[key] = f"its agent's description was refused ({bounded(e, 300)})"
            self.refused.add(key)
            return None
        except Exception as e:  # noqa: BLE001 - timeout, no responders
            LOG.warning("no info from %s: %s", subject, bounded(e, 300))
            self.why_not[key] = f"its agent did not answer ({type(e).__name__})"
            self.refused.discard(key)
            return None
        self.why_not.pop(key, None)
        self.refused.discard(key)
        self.know(node, info, now)
        return info
