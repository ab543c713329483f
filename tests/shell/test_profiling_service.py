"""`ZeusProfilingService` against a real agent on two simulated GPUs: nested windows measure
what the agent's counters say for each window's own span, per GPU, in the order given."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import pytest

from tests.shell.agent_kit import running_agent
from zeus_agent import emit
from zeus_agent.integrations import ProfilingResult, ZeusProfilingService


class RecordingPublisher(emit.Publisher):
    """A publisher that remembers each window it asks the agent about."""

    asked: list[tuple[int, int, list[int]]]

    def measure(
        self, t0_ns: int, t1_ns: int, gpu_indices: Sequence[int] | None = None, exact: bool = False
    ) -> list[float]:
        self.asked.append((t0_ns, t1_ns, list(gpu_indices or [])))
        return super().measure(t0_ns, t1_ns, gpu_indices, exact=exact)


async def test_nested_windows_measured_by_the_agent(nats_server) -> None:
    async with running_agent(nats_server.url, sim_count=2) as server:
        pub = RecordingPublisher(socket_path=server.settings.socket_path, gpu_index=0)
        pub.asked = []
        service = ZeusProfilingService([1, 0], publisher=pub)

        def train() -> tuple[ProfilingResult, ProfilingResult]:
            with pytest.raises(RuntimeError, match="No profiling window active"):
                service.pop_window()
            service.push_window()
            time.sleep(0.05)
            service.push_window()
            time.sleep(0.15)
            inner = service.pop_window(exact=True)
            time.sleep(0.05)
            return inner, service.pop_window(exact=True)

        try:
            inner, outer = await asyncio.to_thread(train)
        finally:
            pub.close()
        assert len(pub.asked) == 2  # the failed pop asked nothing
        (i0, i1, gpus_inner), (o0, o1, gpus_outer) = pub.asked
        assert o0 < i0 < i1 < o1 and gpus_inner == gpus_outer == [1, 0]
        assert inner.time == pytest.approx((i1 - i0) / 1e9) and 0.15 <= inner.time < outer.time
        assert outer.time == pytest.approx((o1 - o0) / 1e9)
        for result, (t0, t1) in ((inner, (i0, i1)), (outer, (o0, o1))):
            expected = [server.agents[g].energy_between(t0, t1) for g in (1, 0)]
            assert result.energy == pytest.approx(expected, rel=1e-6)
            assert all(e > 0 for e in result.energy)
        assert all(o > i for o, i in zip(outer.energy, inner.energy, strict=True))


async def test_a_gpu_the_node_lacks_measures_nan(nats_server) -> None:
    async with running_agent(nats_server.url, sim_count=1) as server:
        pub = emit.Publisher(socket_path=server.settings.socket_path, gpu_index=0)
        service = ZeusProfilingService([0, 3], publisher=pub)

        def window() -> ProfilingResult:
            service.push_window()
            return service.pop_window()

        try:
            result = await asyncio.to_thread(window)
        finally:
            pub.close()
        assert result.time >= 0 and len(result.energy) == 2
        assert all(math.isnan(e) for e in result.energy)
