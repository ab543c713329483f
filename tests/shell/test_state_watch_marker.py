"""`JetStreamState.watch` returns only once the bucket's current entries were fed.

nats-py queues its "current entries delivered" marker (None) when the consumer reports none
pending and the client has handled none yet, which also happens when the server has already
pushed every entry and the client has not read them: the marker then comes first, and a view
that believed it was complete was empty. The pump now trusts the marker only when the server
delivered nothing, else waits for the entry with nothing pending after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from coordinator.state.jetstream import JetStreamState


@dataclass
class FakeEntry:
    key: str
    delta: int


class EarlyMarkerWatch:
    """A watch whose marker comes before its entries, as nats-py's does under the race."""

    def __init__(self, entries: list[FakeEntry], delivered: int) -> None:
        self.items: list[Any] = [None, *entries]
        self._sub = SimpleNamespace(consumer_info=self._info)
        self.delivered = delivered
        self.gate = asyncio.Event()

    async def _info(self) -> Any:
        return SimpleNamespace(delivered=SimpleNamespace(consumer_seq=self.delivered))

    def __aiter__(self) -> EarlyMarkerWatch:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            await self.gate.wait()  # (Open: no more changes for now.)
            raise StopAsyncIteration
        item = self.items.pop(0)
        await asyncio.sleep(0.01)
        return item


async def test_a_marker_before_the_entries_waits_for_the_last_current_one() -> None:
    watch = EarlyMarkerWatch([FakeEntry("a", 1), FakeEntry("b", 0)], delivered=2)
    seen: list[str] = []

    async def fed(entry: Any) -> None:
        seen.append(entry.key)

    loaded = asyncio.Event()
    task = asyncio.create_task(JetStreamState._pump(watch, fed, loaded))
    await asyncio.wait_for(loaded.wait(), 5)
    assert seen == ["a", "b"]  # Not empty, as the marker alone said.
    watch.gate.set()
    await task


async def test_a_marker_of_an_empty_bucket_completes_the_view_at_once() -> None:
    watch = EarlyMarkerWatch([], delivered=0)
    loaded = asyncio.Event()

    async def fed(entry: Any) -> None:
        raise AssertionError(f"no entry expected: {entry}")

    task = asyncio.create_task(JetStreamState._pump(watch, fed, loaded))
    await asyncio.wait_for(loaded.wait(), 5)
    assert not task.done()  # Still following the bucket's changes.
    watch.gate.set()
    await task


async def test_watch_on_a_real_bucket_feeds_every_current_entry_before_returning(
        nc: Any) -> None:
    state = JetStreamState(nc, "watchmarker", bucket="watch-marker")
    await state.open()
    for i in range(200):
        await state.kv.put(f"budget.b{i}", b"x" * 64)
    for _ in range(5):  # (The race is the server's push against the client's first read.)
        seen: set[str] = set()

        async def fed(entry: Any, into: set[str] = seen) -> None:
            into.add(entry.key)

        await state.watch("budget.>", fed)
        assert len(seen) == 200
    await state.close()
