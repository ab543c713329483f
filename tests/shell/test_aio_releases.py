"""`zeus_agent.aio.Releases`: what a service acquired, released in the reverse order.

A release that raises is logged and skips no other; a second `aclose` releases nothing more
(issue 35 item 5: both services shut down through one).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from zeus_agent.aio import Releases


async def test_releases_run_in_the_reverse_order_once() -> None:
    done: list[str] = []
    releases = Releases()

    async def slow(name: str) -> None:
        await asyncio.sleep(0)
        done.append(name)

    releases.push("a", lambda: done.append("a"))  # a plain callable
    releases.push("b", lambda: slow("b"))  # an awaitable
    releases.push("c", lambda: done.append("c"))
    assert releases.pending == ["c", "b", "a"]
    await releases.aclose()
    assert done == ["c", "b", "a"] and releases.pending == []
    await releases.aclose()  # idempotent
    assert done == ["c", "b", "a"]
    releases.push("d", lambda: done.append("d"))  # pushed after: released by the next aclose
    await releases.aclose()
    assert done == ["c", "b", "a", "d"]


async def test_a_release_that_raises_skips_no_other(caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []
    releases = Releases()

    def fails() -> None:
        raise RuntimeError("broken")

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise OSError("also broken")

    releases.push("first", lambda: done.append("first"))
    releases.push("the broken one", fails)
    releases.push("middle", lambda: done.append("middle"))
    releases.push("the async broken one", fails_later)
    releases.push("last", lambda: done.append("last"))
    with caplog.at_level(logging.ERROR):
        await releases.aclose()  # raises nothing
    assert done == ["last", "middle", "first"]
    assert "releasing the broken one failed" in caplog.text
    assert "releasing the async broken one failed" in caplog.text


async def test_a_cancelled_release_lets_the_others_run_then_raises() -> None:
    done: list[str] = []
    releases = Releases()

    def cancelled() -> None:
        raise asyncio.CancelledError

    releases.push("first", lambda: done.append("first"))
    releases.push("cancelled", cancelled)
    releases.push("last", lambda: done.append("last"))
    with pytest.raises(asyncio.CancelledError):
        await releases.aclose()
    assert done == ["last", "first"]
