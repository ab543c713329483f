"""A reply's `capped_w` that is not a power limit is ignored, not fatal to the job.

`ActionExecutor.learn_cap` reads the cap an agent clamped a job's limit to from its reply
(`capped_w`). It ran inside the job's contained actions, so a reply whose `capped_w` is not a
whole number of watts (an agent of another version, a bug) raised there and ended the job,
quarantined. Such a value is now left out: the budgets' owner tells the job its cap anyway.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.power_limit.job import PowerLimitJob
from coordinator.service.actions import ActionExecutor
from zeus_agent.wire.messages import PowerLimitOptions, Reply


def executor(job: PowerLimitJob, ran: list[list[Any]]) -> ActionExecutor:
    ex = ActionExecutor.__new__(ActionExecutor)
    ex.jobs = SimpleNamespace(optimiser=lambda job_id: job)  # type: ignore[assignment]

    async def execute(record: Any, actions: list[Any]) -> None:
        ran.append(actions)

    ex.execute = execute  # type: ignore[method-assign]
    return ex


def profiling_job() -> PowerLimitJob:
    job = PowerLimitJob("j", PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1,
                                               profile_steps=2, pl_step_w=50), [0], 150, 300)
    job.start()
    return job


@pytest.mark.parametrize("value", [None, "abc", [200], {"w": 1}, 0, -5, 1e400])
def test_a_garbage_capped_w_is_left_out(value: Any) -> None:
    job, ran = profiling_job(), []
    ex = executor(job, ran)
    record = SimpleNamespace(job_id="j")
    replies: list[Reply | str] = [Reply(ok=True, result={"capped_w": value})]
    asyncio.run(ex.learn_cap(record, replies))  # type: ignore[arg-type]
    assert job.machine.cap_w is None and ran == []


def test_a_cap_in_a_reply_is_learnt() -> None:
    job, ran = profiling_job(), []
    ex = executor(job, ran)
    replies: list[Reply | str] = [Reply(ok=True, result={"capped_w": 250}), "timeout",
                                  Reply(ok=True, result={"capped_w": 200})]
    asyncio.run(ex.learn_cap(SimpleNamespace(job_id="j"), replies))  # type: ignore[arg-type]
    assert job.machine.cap_w == 200 and len(ran) == 1
