"""A rank's own state entry that comes before its handler here is done waits for the handler.

The watch brings the entry of a rank this replica is recording together with the write's
acknowledgement, and is served first: the rank was not known yet, so the entry was decoded in
full (as another replica's) instead of being recognised. `JobTable.defer` keeps it until the
handler is done (`registering_rank`), then it is applied, unless the job was forgotten meanwhile.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.jobs import JobRegistry
from coordinator.service.table import JobTable
from zeus_agent.models import JobInfo
from zeus_agent.wire.messages import PowerLimitOptions, RegisterJob


def table_with_a_job() -> tuple[JobTable, str]:
    table = JobTable(JobRegistry())
    request = RegisterJob(job=JobInfo(dp_degree=4, pp_degree=1, tp_degree=1, world_size=4),
                          power_limit=PowerLimitOptions())
    registry = JobRegistry()
    record = registry.register_job(request, 0.0, "node0", join_token="t" * 24)
    table.know(record)
    return table, record.job_id


def test_an_entry_of_a_rank_being_recorded_is_applied_once_its_handler_is_done() -> None:
    table, job_id = table_with_a_job()
    applied: list[Any] = []
    entry = SimpleNamespace(key="v.rank.h.1")
    assert not table.defer(job_id, 1, entry)  # No handler records rank 1: applied now.
    with table.registering_rank(job_id, 1, applied.append):
        assert table.defer(job_id, 1, entry)
        assert not table.defer(job_id, 2, entry)  # Another rank: not this handler's.
        assert applied == []
    assert applied == [entry]
    assert not table.defer(job_id, 1, entry)


def test_a_deferred_entry_is_applied_when_the_handler_fails_too() -> None:
    table, job_id = table_with_a_job()
    applied: list[Any] = []
    entry = SimpleNamespace(key="v.rank.h.3")
    with pytest.raises(TimeoutError), table.registering_rank(job_id, 3, applied.append):
        assert table.defer(job_id, 3, entry)
        raise TimeoutError  # (The acknowledgement lost: the write may still have landed.)
    assert applied == [entry]


def test_a_deferred_entry_of_a_job_forgotten_meanwhile_is_dropped() -> None:
    table, job_id = table_with_a_job()
    applied: list[Any] = []
    with table.registering_rank(job_id, 0, applied.append):
        assert table.defer(job_id, 0, SimpleNamespace(key="v.rank.h.0"))
        table.forget(job_id)  # Its removal came through the watch after the rank's entry.
    assert applied == []
    assert table.get(job_id) is None


def test_a_failing_apply_is_logged_not_raised_into_the_request(
        caplog: pytest.LogCaptureFixture) -> None:
    table, job_id = table_with_a_job()

    def apply(entry: Any) -> None:
        raise ValueError("unreadable")

    with table.registering_rank(job_id, 2, apply):
        table.defer(job_id, 2, SimpleNamespace(key="v.rank.h.2"))
    assert "could not apply state entry v.rank.h.2" in caplog.text
