"""`JobFailures.contained`: an input's exception fails its job only; cancellations go through.

It wraps every input a job is fed (`ActionExecutor.act`, `act_all`): a class, not a generator.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.service.failures import JobFailures

pytestmark = pytest.mark.core


class _Failures:
    """What `contained` needs of `JobFailures`: `fail`, recorded."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    async def fail(self, job_id: str, why: str) -> None:
        self.failed.append((job_id, why))


def _contained(failures: _Failures) -> Any:
    return JobFailures.contained(failures, "j1", "driving the job")  # type: ignore[arg-type]


async def test_an_exception_fails_the_job_and_goes_no_further() -> None:
    failures = _Failures()
    async with _contained(failures):
        raise ValueError("bad input")
    assert failures.failed == [("j1", "driving the job failed (ValueError: bad input)")]


async def test_a_body_that_ends_fails_nothing() -> None:
    failures = _Failures()
    async with _contained(failures):
        pass
    assert failures.failed == []


@pytest.mark.parametrize("error", [asyncio.CancelledError(), KeyboardInterrupt()])
async def test_cancellations_and_other_base_exceptions_go_through(error: BaseException) -> None:
    failures = _Failures()
    with pytest.raises(type(error)):
        async with _contained(failures):
            raise error
    assert failures.failed == []
