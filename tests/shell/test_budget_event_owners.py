"""The grid event's view of the ownership bucket (a real nats-server): who holds the budgets'
lease and who drives a job, or None where no lease is held."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from coordinator.state.records import job_hash
from zeus_agent.wire import subjects
from zeus_demo.budget.event import budget_owner, job_driver

JOB = "1765000000+dp8+pp1+tp1+Perseus3D+bjps"


async def test_the_budgets_owner_and_a_jobs_driver_are_read_from_their_leases(nc: Any) -> None:
    js = nc.jetstream()
    bucket = subjects.state_buckets()[1]
    with contextlib.suppress(Exception):
        await js.delete_key_value(bucket)
    owners = await js.create_key_value(bucket=bucket)
    try:
        assert await budget_owner(nc) is None and await job_driver(nc, JOB) is None
        await owners.put("budgets", json.dumps({"owner": "r2"}).encode())
        await owners.put(job_hash(JOB), json.dumps({"owner": "r1"}).encode())
        assert await budget_owner(nc) == "r2"
        assert await job_driver(nc, JOB) == "r1"
        assert await job_driver(nc, None) is None
    finally:
        await js.delete_key_value(bucket)
