"""Waiting for a condition: `wait_for` (a blocking poll) and `wait_for_async` (on a loop).

Both poll `predicate()` until it returns something truthy, and return that value. Past
`timeout_s` they raise `AssertionError` (what a test reports and a script prints): "timed out
waiting for <what>", or `what()` when `what` is a callable (a message built only then, such as
the tail of a log). `wait_for_async`'s predicate may also be a coroutine function (a condition
that takes a request to check): each poll awaits its result.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

__all__ = ["wait_for", "wait_for_async"]

T = TypeVar("T")


def _failure(what: str | Callable[[], str]) -> AssertionError:
    return AssertionError(what() if callable(what) else f"timed out waiting for {what}")


def wait_for(predicate: Callable[[], T], timeout_s: float,
             what: str | Callable[[], str] = "the condition", interval_s: float = 0.05) -> T:
    """`predicate()`'s first truthy value, polled every `interval_s` (blocks the thread).

    Raises:
        AssertionError: Not within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(what)
        time.sleep(interval_s)


@overload
async def wait_for_async(predicate: Callable[[], Awaitable[T]], timeout_s: float,
                         what: str | Callable[[], str] = ...,
                         interval_s: float = ...) -> T: ...


@overload
async def wait_for_async(predicate: Callable[[], T], timeout_s: float,
                         what: str | Callable[[], str] = ...,
                         interval_s: float = ...) -> T: ...


async def wait_for_async(predicate: Callable[[], Any], timeout_s: float,
                         what: str | Callable[[], str] = "the condition",
                         interval_s: float = 0.05) -> Any:
    """`predicate()`'s first truthy value, polled every `interval_s` on the running loop.

    A `predicate()` that returns an awaitable (a coroutine function's) is awaited at each poll.

    Raises:
        AssertionError: Not within `timeout_s`.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise _failure(what)
        await asyncio.sleep(interval_s)


