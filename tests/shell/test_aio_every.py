"""`zeus_agent.aio.every`: the periodic loop both services run their timers on."""

from __future__ import annotations

import asyncio

from zeus_agent.aio import every


async def test_a_failing_tick_is_logged_and_the_loop_goes_on(caplog) -> None:
    calls = 0

    async def tick() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("one bad tick")

    task = asyncio.create_task(every(0.01, tick, "test ticks"))
    while calls < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    assert "test ticks failed; continuing" in caplog.text


async def test_a_cancellation_the_tick_swallowed_still_stops_the_loop() -> None:
    """Seen as a 10 s shutdown of the coordinator under load: one of its loops was cancelled
    while a tick's `wait_for` finished, the tick lost the cancellation (Python 3.11's
    `wait_for`), the loop went on, and the service's task group waited for it."""
    entered, swallowed = asyncio.Event(), []

    async def swallowing_tick() -> None:
        entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)  # The one lost cancellation.

    task = asyncio.create_task(every(0.01, swallowing_tick, "swallowing ticks"))
    await entered.wait()
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    assert swallowed and task.done() and task.cancelled()


async def test_a_wake_runs_the_tick_at_once_each_time_it_is_set() -> None:
    """A power budget set between ticks is planned at once, not up to a period later."""
    wake, runs = asyncio.Event(), []
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        runs.append(loop.time())

    start = loop.time()
    task = asyncio.create_task(every(10.0, tick, "woken ticks", first_now=False, wake=wake))
    try:
        await asyncio.sleep(0.05)
        assert runs == []  # The first tick is 10 s away.
        wake.set()
        while not runs:
            await asyncio.sleep(0.01)
        assert runs[0] - start < 5.0 and not wake.is_set()  # Run at once, the event cleared.
        wake.set()  # Again: one more run each time it is set.
        while len(runs) < 2:
            await asyncio.sleep(0.01)
        assert runs[1] - start < 5.0
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
