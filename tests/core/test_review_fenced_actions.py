"""An adversarial review of fenced actions caught up (`ActionExecutor.execute`/`catch_up`,
`JobDriver.fence`/`take_fenced`, `Replicas.catch_up_fenced`): each test reproduces a defect.

Actions fenced while this replica's own lease on a job was lapsing are kept on the job's
driver and, once the lease is this replica's again, carried out as the job stands: its current
limit and schedules (when a fenced action was one), then its statuses, files and questions.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from coordinator.optimizer import Action, ApplyPowerLimit, AskSelector, StatusUpdate
from coordinator.power_limit.job import PowerLimitJob
from coordinator.service.actions import ActionExecutor
from coordinator.service.driver import MAX_FENCED, JobDriver
from tests.core.power_limit_kit import ev, mark
from zeus_agent.wire.messages import PowerLimitOptions

JOB = "job-1"


def executor(driver: JobDriver, owns: list[bool]) -> tuple[ActionExecutor, list[Any]]:
    """An executor whose lease check says `owns[0]`, recording what it carries out."""
    done: list[Any] = []
    ex = ActionExecutor.__new__(ActionExecutor)

    async def owns_now(job_id: str) -> bool:
        return owns[0]

    async def status(job_id: str, state: str, message: str, progress: Any = None) -> None:
        done.append(("status", state))

    async def limit(record: Any, watts: int, gpus: Any = None) -> None:
        done.append(("limit", watts))

    async def ask(record: Any, action: AskSelector) -> None:
        done.append(("ask", action.request))

    ex.leases = SimpleNamespace(owns_now=owns_now)  # type: ignore[assignment]
    ex.jobs = SimpleNamespace(get=lambda job_id: driver)  # type: ignore[assignment]
    ex.link = SimpleNamespace(status=status)  # type: ignore[assignment]
    async def profile(record: Any, action: Any) -> None:
        done.append(("profile", action.optimal_power_limit))

    ex.apply_power_limit = limit  # type: ignore[method-assign]
    ex.ask_selector = ask  # type: ignore[method-assign]
    ex.save_profile = profile  # type: ignore[method-assign]
    ex.progress = SimpleNamespace(  # type: ignore[assignment]
        save_progress=lambda job_id, kind, state: done.append(("progress", kind)))
    return ex, done


def driven(watts: int = 250) -> JobDriver:
    driver = JobDriver(JOB, record=SimpleNamespace(job_id=JOB, ranks={}))  # type: ignore[arg-type]
    driver.drive(SimpleNamespace(desired_power_limit=watts,  # type: ignore[arg-type]
                                 desired_schedule=lambda rank: None))
    return driver


def test_a_fenced_limit_is_caught_up_however_many_statuses_followed_it() -> None:
    """`MAX_FENCED` keeps the latest actions: a limit fenced before 64 statuses (a burst of
    progress reports while the renewal is late) was dropped, and `catch_up` sends the job's
    current limit only if a fenced action was one, so the GPUs never got their limit (the
    very symptom the catch-up was made for: GPUs waiting for their first limit)."""
    driver = driven()
    owns = [False]
    ex, done = executor(driver, owns)
    fenced: list[Action] = [ApplyPowerLimit(250)]
    fenced += [StatusUpdate("profiling", f"window {i}") for i in range(MAX_FENCED)]
    asyncio.run(ex.execute(driver.record, fenced))  # type: ignore[arg-type]
    assert done == []
    owns[0] = True  # The lease is this replica's again.
    asyncio.run(ex.catch_up(driver))
    assert ("limit", 250) in done


def test_a_fenced_question_is_not_dropped_for_later_statuses() -> None:
    """A selector question fenced, then statuses: the question must still go out (else the
    job waits for an answer it never asked for, and falls back to the built-in selector)."""
    driver = driven()
    owns = [False]
    ex, done = executor(driver, owns)
    fenced: list[Action] = [AskSelector(0, 1, ())]
    fenced += [StatusUpdate("selecting", f"waiting {i}") for i in range(MAX_FENCED)]
    asyncio.run(ex.execute(driver.record, fenced))  # type: ignore[arg-type]
    owns[0] = True
    asyncio.run(ex.catch_up(driver))
    assert ("ask", 1) in done


def test_a_released_job_keeps_none_of_its_old_optimisers_fenced_actions() -> None:
    """Another replica took the job over (`release`) and this one took it back before its
    ownership round saw the other's lease: the fenced list survived the release, and the new
    optimiser's catch-up sent the old one's statuses and questions (stale, asked again with
    the old request number) as if they were its own."""
    driver = driven()
    owns = [False]
    ex, done = executor(driver, owns)
    asyncio.run(ex.execute(driver.record, [  # type: ignore[arg-type]
        AskSelector(0, 7, ()), StatusUpdate("selecting", "old optimiser")]))
    driver.release("another replica owns it")
    driver.drive(SimpleNamespace(desired_power_limit=250,  # type: ignore[arg-type]
                                 desired_schedule=lambda rank: None))  # Taken back: replayed.
    owns[0] = True
    asyncio.run(ex.catch_up(driver))
    assert done == []


def test_a_status_fenced_is_not_published_after_a_newer_one() -> None:
    """The lease is back and a new event's actions run before the catch-up task gets the job's
    lock (`Replicas.catch_up_fenced` spawns it): the job's newer status went out first, then
    the stale one, which watchers take for the job's state ("selecting" after "done")."""
    driver = driven()
    owns = [False]
    ex, done = executor(driver, owns)
    asyncio.run(ex.execute(driver.record, [StatusUpdate("selecting", "asking")]))  # type: ignore[arg-type]
    owns[0] = True
    asyncio.run(ex.execute(driver.record, [StatusUpdate("done", "chosen")]))  # type: ignore[arg-type]
    asyncio.run(ex.catch_up(driver))
    assert [s for kind, s in done if kind == "status"] == ["selecting", "done"]


def test_a_limit_fenced_at_the_send_is_caught_up_too() -> None:
    """`execute` checks the lease once, before its first action; each command checks it again
    right before its send (`GpuCommands.command`). A lease that lapsed in between (the first
    action waited for its replies) fenced the limit there: not sent, and not kept either, so
    the lease back, nothing sent it (the catch-up only covers `execute`'s own check)."""
    driver = driven()
    owns = [True]
    ex, done = executor(driver, owns)
    sends: list[str] = []

    async def command(record: Any, what: str, requests: list[Any]) -> Any:
        sends.append(what)
        return None if len(sends) == 1 else []  # Fenced at the first send only.

    async def nothing(*args: Any) -> None:
        return None

    del ex.apply_power_limit  # (The real one, over `command`.)
    ex.learn_cap = nothing  # type: ignore[method-assign]
    ex.settings = SimpleNamespace(lease_s=30.0, prefix="zeus")  # type: ignore[assignment]
    ex.commands = SimpleNamespace(command=command,  # type: ignore[assignment]
                                  report_failures=nothing)
    driver.record = SimpleNamespace(job_id=JOB, ranks={}, gpus=list)  # type: ignore[assignment]
    asyncio.run(ex.execute(driver.record, [ApplyPowerLimit(250)]))  # type: ignore[arg-type]
    assert sends == ["setting 250 W"]  # ...not sent: the lease lapsed just before the send.
    asyncio.run(ex.catch_up(driver))  # The lease is this replica's again (its next round).
    assert sends == ["setting 250 W", "setting 250 W"]


def test_a_question_the_job_no_longer_awaits_is_not_asked_on_catching_up() -> None:
    """A user's selector asked (fenced), then the lease stayed late past the selector's
    timeout: the job fell back to its built-in selector and pinned a limit. Caught up, the
    stale question still went to rank 0's process, which ran the user's selector for an
    answer the job ignores (`TrainerChoice.answers`: no question awaits)."""
    options = PowerLimitOptions(selector="Custom", custom_selector="Cheapest()", wait_steps=0,
                                warmup_steps=0, profile_steps=2, pl_step_w=50,
                                selector_timeout_s=30.0)
    job = PowerLimitJob(JOB, options, ranks=[0, 1], min_power_limit_w=100,
                        max_power_limit_w=300, mark_timeout_s=1e9)
    driver = JobDriver(JOB, record=SimpleNamespace(job_id=JOB, ranks={}))  # type: ignore[arg-type]
    driver.drive(job)
    owns = [False]
    ex, done = executor(driver, owns)
    actions = job.start()
    clocks = {r: (0.0, 0.0) for r in job.ranks}
    for step in range(11):  # Both ranks through every window (2 steps each), 1 s a step.
        actions += job.on_event(0, ev(step), now_s=float(step))
        limit = job.desired_power_limit
        assert limit is not None
        for r in job.ranks:
            t, e = clocks[r]
            actions += job.on_mark(r, mark(step, t, e))
            clocks[r] = (t + 1.0, e + 0.8 * limit)
    assert any(isinstance(a, AskSelector) for a in actions)
    asyncio.run(ex.execute(driver.record, actions))  # type: ignore[arg-type]
    asyncio.run(ex.execute(driver.record, job.tick(100.0)))  # type: ignore[arg-type]
    assert job.optimal_power_limit is not None  # Fallen back (fenced too).
    owns[0] = True
    asyncio.run(ex.catch_up(driver))
    assert ("limit", job.optimal_power_limit) in done
    assert [d for d in done if d[0] == "ask"] == []
