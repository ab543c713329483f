"""`JobTable.registering`: a job with a rank being recorded here is not idle (issue 39 item 4).

At 100,000 GPUs a job whose ranks waited in the registration burst longer than the idle limit
was collected under them (`unknown_job ... removed after being idle`): the idle collection now
skips a job while any of its ranks' handlers is recording it.
"""

from __future__ import annotations

import asyncio

from coordinator.jobs.registry import JobRegistry
from coordinator.service.table import JobTable


def test_a_job_is_registering_while_any_rank_handler_records_it() -> None:
    table = JobTable(JobRegistry())
    applied: list[object] = []
    assert not table.registering("job")
    with table.registering_rank("job", 0, applied.append):
        assert table.registering("job") and not table.registering("other")
        with table.registering_rank("job", 1, applied.append):
            assert table.registering("job")
        assert table.registering("job")  # Rank 0 still being recorded.
    assert not table.registering("job")


def test_a_failed_registration_ends_too() -> None:
    table = JobTable(JobRegistry())
    try:
        with table.registering_rank("job", 0, lambda entry: None):
            raise RuntimeError("JetStream refused the write")
    except RuntimeError:
        pass
    assert not table.registering("job")


def test_a_cancelled_handler_and_a_retry_side_by_side_end_too() -> None:
    """A handler cancelled mid-write (its request gone, the service stopping) ends its part;
    a retry of the same rank in flight with the first counts as a second handler (review31).
    """
    table = JobTable(JobRegistry())

    async def main() -> None:
        stuck = asyncio.Event()

        async def handler() -> None:
            with table.registering_rank("job", 0, lambda entry: None):
                await stuck.wait()  # A write never answered.

        first, retry = asyncio.create_task(handler()), asyncio.create_task(handler())
        await asyncio.sleep(0)
        assert table.registering("job")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert table.registering("job")  # The retry still records it.
        retry.cancel()
        await asyncio.gather(retry, return_exceptions=True)
        assert not table.registering("job")

    asyncio.run(main())
