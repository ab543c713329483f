"""`CapLane`: a GPU's node cap (a power budget's) applied to the power limit (thin shell).

The decisions are `CapHolder`'s (`zeus_agent.agent.core.node_cap`): this lane remembers what
the power-limit lease's holder asked for and puts the GPU at that limit, or the default when
no one holds one, never above the cap while it holds. `GpuAgent` calls it with its settings
lock held: on a job's set (`capped`), a restore (`restore_call`), a new, lifted or lapsed cap
(`follow`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from zeus_agent.agent.core import LimitHistory
from zeus_agent.agent.core.node_cap import CapHolder
from zeus_agent.agent.counter_reader import CounterReader
from zeus_agent.gpu.base import GPU, GPUInfo
from zeus_agent.gpu.threaded import GPUCaller


class CapLane:
    """The cap of one GPU, what its job asked for, and the limit writes that follow them."""

    def __init__(self, caller: GPUCaller, gpu: Callable[[], GPU], limits: LimitHistory,
                 counter: CounterReader) -> None:
        self.caller = caller
        self.gpu = gpu
        self.limits = limits
        self.counter = counter
        self.holder = CapHolder(1, 1 << 30)
        self.default_w = 0
        self.job_limit_w: int | None = None
        """The limit the power-limit lease's holder asked for (None: the default)."""

    def job_asks(self, limit_w: int | None) -> None:
        """The power-limit lease's holder asked for `limit_w` (None: the default, or lapsed)."""
        self.job_limit_w = limit_w

    def start(self, info: GPUInfo) -> None:
        """The GPU's range and default are known."""
        self.holder = CapHolder(info.min_power_limit_w, info.max_power_limit_w)
        self.default_w = info.default_power_limit_w

    def capped(self, limit_w: int) -> int:
        """The limit applied for a wanted `limit_w`: at most the cap while it holds."""
        return self.holder.clamp(limit_w, time.monotonic_ns())

    def describe(self) -> dict[str, object] | None:
        """The cap for an `info` answer (None: no cap)."""
        cap = self.holder.cap
        if cap is None:
            return None
        return {"cap_w": cap.cap_w, "holder": cap.holder,
                "remaining_s": (cap.deadline_ns - time.monotonic_ns()) / 1e9}

    def restore_call(self, gpu: GPU) -> tuple[Callable[[], None], int]:
        """What restoring the limit calls, and the limit it leaves: the default, or the cap."""
        target = self.capped(self.default_w)
        if target == self.default_w:
            return gpu.reset_power_limit, target
        return (lambda: gpu.set_power_limit_w(target)), target

    async def follow(self, job_holds: bool) -> int:
        """Put the GPU at the limit wanted now under the cap; returns that limit.

        `job_holds`: whether the power-limit lease is held (else the job's wish is void).
        """
        wanted = self.job_limit_w if job_holds and self.job_limit_w is not None else None
        target = self.capped(self.default_w if wanted is None else wanted)
        gpu = self.gpu()
        current = await self.caller.call(gpu.get_power_limit_w)
        if current != target:
            t_ns = time.monotonic_ns()
            if target == self.default_w:
                await self.caller.call(gpu.reset_power_limit)
            else:
                await self.caller.call(gpu.set_power_limit_w, target)
            self.counter.refresh_limit()
            self.limits.record(t_ns, target)
        return target
