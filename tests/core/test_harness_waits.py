"""The harness's waits (`zeus_demo.cluster.wait_for`, `wait_for_async`): the first truthy value,
an awaitable predicate awaited at each poll, the message past the timeout, and the last value
instead with `fail=False`."""

from __future__ import annotations

import itertools

import pytest

from zeus_demo.cluster import wait_for, wait_for_async


def test_wait_for_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", 7, 8])
    assert wait_for(lambda: next(values), 1, interval_s=0) == 7


def test_wait_for_says_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="^timed out waiting for the moon$"):
        wait_for(lambda: False, 0.05, "the moon", interval_s=0.01)
    with pytest.raises(AssertionError, match="^built late$"):
        wait_for(lambda: False, 0.05, lambda: "built late", interval_s=0.01)


async def test_wait_for_async_takes_a_plain_predicate() -> None:
    polls = itertools.count()
    assert await wait_for_async(lambda: next(polls) >= 3 and "done", 1, interval_s=0) == "done"


async def test_wait_for_async_awaits_a_coroutine_predicate_at_each_poll() -> None:
    polls = itertools.count()

    async def ready() -> dict[str, int] | None:
        n = next(polls)
        return {"polls": n} if n >= 2 else None

    assert await wait_for_async(ready, 1, interval_s=0) == {"polls": 2}


async def test_wait_for_async_says_what_it_waited_for() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(AssertionError, match="^timed out waiting for the moon$"):
        await wait_for_async(never, 0.05, "the moon", interval_s=0.01)
    with pytest.raises(AssertionError, match="^built late$"):
        await wait_for_async(lambda: 0, 0.05, lambda: "built late", interval_s=0.01)


def test_wait_for_without_failing_returns_the_last_value() -> None:
    values = itertools.chain([None, 0], itertools.repeat([]))
    # (0.5 s: three polls at least, even when a loaded host sleeps 0.1 s for 0.005.)
    assert wait_for(lambda: next(values), 0.5, "never", interval_s=0.005, fail=False) == []
    assert wait_for(lambda: 3, 0.02, fail=False) == 3


async def test_wait_for_async_without_failing_returns_the_last_value() -> None:
    async def empty() -> dict[str, int]:
        return {}

    assert await wait_for_async(empty, 0.02, interval_s=0.005, fail=False) == {}
    assert await wait_for_async(lambda: 0, 0.02, interval_s=0.005, fail=False) == 0
