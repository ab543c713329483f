"""`JetStreamState.watch` returns only once the bucket's current entries were fed.

nats-py's KV watch queued its "current entries delivered" marker when the consumer reported
none pending and the client had handled none yet, which also happens when the server has
already pushed every entry and the client has not read them: the marker then came first, and a
view that believed it was complete was empty. The watch (`coordinator.state.watch.follow`) now
takes the view as complete at once only when the consumer delivered nothing and has nothing
pending, else once the entry with nothing pending after it was fed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from coordinator.state import watch
from coordinator.state.jetstream import JetStreamState


def reply(stream_seq: int, pending: int) -> str:
    """A push consumer's reply subject (`$JS.ACK.<stream>.<consumer>.1.<sseq>.<cseq>.<ts>.<n>`)."""
    return f"$JS.ACK.KV_b.c.1.{stream_seq}.{stream_seq}.1700000000000000000.{pending}"


class PushedBeforeRead:
    """A JetStream context whose consumer pushed `entries` before the client read any."""

    def __init__(self, entries: list[tuple[str, int]], delivered: int) -> None:
        self.entries = entries
        self.delivered = delivered
        self.unsubscribed = False

    async def subscribe(self, subject: str, **kwargs: Any) -> Any:
        assert subject == "$KV.b.v.>" and kwargs["ordered_consumer"]
        cb = kwargs["cb"]

        async def deliver() -> None:
            await asyncio.sleep(0.05)  # (After consumer_info: the race.)
            for seq, (key, pending) in enumerate(self.entries, 1):
                await cb(SimpleNamespace(subject=f"$KV.b.{key}", reply=reply(seq, pending),
                                         data=b"x", headers=None))

        self.task = asyncio.create_task(deliver())
        return SimpleNamespace(consumer_info=self._info, unsubscribe=self._unsubscribe)

    async def _info(self) -> Any:
        return SimpleNamespace(num_pending=0,
                               delivered=SimpleNamespace(consumer_seq=self.delivered))

    async def _unsubscribe(self) -> None:
        self.unsubscribed = True


async def test_entries_pushed_before_the_first_read_are_fed_before_the_watch_returns() -> None:
    js = PushedBeforeRead([("v.a", 1), ("v.b", 0)], delivered=2)
    seen: list[tuple[str, int]] = []

    async def fed(entry: Any) -> None:
        seen.append((entry.key, entry.revision))

    await asyncio.wait_for(watch.follow(js, "b", "v.>", fed), 5)
    assert seen == [("v.a", 1), ("v.b", 2)]  # Not empty, as the consumer's counts alone said.


async def test_an_empty_bucket_completes_the_view_at_once() -> None:
    js = PushedBeforeRead([], delivered=0)

    async def fed(entry: Any) -> None:
        raise AssertionError(f"no entry expected: {entry}")

    sub = await asyncio.wait_for(watch.follow(js, "b", "v.>", fed), 5)
    await sub.unsubscribe()
    assert js.unsubscribed


async def test_a_bad_entry_is_logged_and_the_view_goes_on() -> None:
    js = PushedBeforeRead([("v.bad", 1), ("v.good", 0)], delivered=2)
    seen: list[str] = []

    async def fed(entry: Any) -> None:
        if entry.key == "v.bad":
            raise ValueError("unreadable")
        seen.append(entry.key)

    await asyncio.wait_for(watch.follow(js, "b", "v.>", fed), 5)
    assert seen == ["v.good"]


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
