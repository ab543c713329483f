"""`JobTable.registering`: a job with a rank being recorded here is not idle (issue 39 item 4).

At 100,000 GPUs a job whose ranks waited in the registration burst longer than the idle limit
was collected under them (`unknown_job ... removed after being idle`): the idle collection now
skips a job while any of its ranks' handlers is recording it.
"""

from __future__ import annotations

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
