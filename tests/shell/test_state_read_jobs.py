"""`JetStreamState.read_jobs` against a real nats-server: a spurious empty `keys()` is retried.

nats-py's `KeyValue.keys()` once came back empty (`NoKeysError`) from a bucket that held
jobs, on a loaded machine; `read_jobs` then said "no jobs" and a fuzz test failed. It now asks
again while the bucket holds messages, and says "no jobs" at once for an empty bucket.
"""

from __future__ import annotations

from typing import Any

from coordinator.jobs import JobRecord
from coordinator.state.jetstream import JetStreamState
from zeus_agent.models import JobInfo
from zeus_agent.wire.messages import PowerLimitOptions


def _record(metadata: str) -> JobRecord:
    info = JobInfo(dp_degree=1, pp_degree=1, tp_degree=1, world_size=1, job_metadata=metadata)
    info.set_job_id("PowerLimitOptimizer")
    return JobRecord(job_id=info.job_id, job=info, scheduler="PowerLimitOptimizer",
                     power_limit=PowerLimitOptions(), created_s=0, last_active_s=0, node="n1",
                     uid=1000)


async def test_a_spurious_empty_key_listing_is_asked_again(nc: Any) -> None:
    from nats.js.errors import NoKeysError

    state = JetStreamState(nc, "readjobs", bucket="read-jobs-retry")
    await state.open()
    assert await state.read_jobs() == {}  # empty: no messages, no retry
    record = _record("one")
    assert await state.create_job(record)
    keys = state.kv.keys
    empty = [True, True]

    async def flaky_keys(*args: Any, **kwargs: Any) -> list[str]:
        if empty and empty.pop():
            raise NoKeysError
        return await keys(*args, **kwargs)

    state.kv.keys = flaky_keys
    assert list(await state.read_jobs()) == [record.job_id]
    assert not empty  # asked three times
