"""Waiting for a condition: `wait_for` (a blocking poll) and `wait_for_async` (on a loop).

Both poll `predicate()` until it returns something truthy, and return that value. Past
`timeout_s` they raise `AssertionError` (what a test reports and a script prints): "timed out
waiting for <what>", or `what()` when `what` is a callable (a message built only then, such as
the tail of a log). `wait_for_async`'s predicate may also be a coroutine function (a condition
that takes a request to check): each poll awaits its result.

With `fail=False`, past the timeout they return the predicate's last (falsy) value instead of
raising: for a caller that reports a timeout itself (its own assertion on what it got, a count
of what is left, a problem in a list).
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
             what: str | Callable[[], str] = "the condition", interval_s: float = 0.05,
             fail: bool = True) -> T:
    """`predicate()`'s first truthy value, polled every `interval_s` (blocks the thread).

    Past `timeout_s` with `fail=False`: its last (falsy) value.

    Raises:
        AssertionError: Not within `timeout_s` (unless `fail=False`).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            if not fail:
                return value
            raise _failure(what)
        time.sleep(interval_s)


@overload
async def wait_for_async(predicate: Callable[[], Awaitable[T]], timeout_s: float,
                         what: str | Callable[[], str] = ...,
                         interval_s: float = ..., fail: bool = ...) -> T: ...


@overload
async def wait_for_async(predicate: Callable[[], T], timeout_s: float,
                         what: str | Callable[[], str] = ...,
                         interval_s: float = ..., fail: bool = ...) -> T: ...


async def wait_for_async(predicate: Callable[[], Any], timeout_s: float,
                         what: str | Callable[[], str] = "the condition",
                         interval_s: float = 0.05, fail: bool = True) -> Any:
    """`predicate()`'s first truthy value, polled every `interval_s` on the running loop.

    A `predicate()` that returns an awaitable (a coroutine function's) is awaited at each poll.
    Past `timeout_s` with `fail=False`: its last (falsy) value.

    Raises:
        AssertionError: Not within `timeout_s` (unless `fail=False`).
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
            if not fail:
                return value
            raise _failure(what)
        await asyncio.sleep(interval_s)


