"""A frontier planned under a budget's caps, said so in its record, over a real nats-server.

The replica driving a Perseus job saw it profile while a budget governed its GPUs; it records
its frontier with `planned_capped` (`BudgetFrontier`). The budgets' owner, another replica,
follows the record and caps the job proportionally instead of planning on the frontier; a
replica taking the job over, which saw none of its profile, records the flag again.
"""

from __future__ import annotations

import json
import uuid

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.job_views import job_views
from coordinator.state.jetstream import JetStreamState
from coordinator.state.records import FRONTIER_PREFIX, job_hash
from tests.shell.budget_remote_kit import replica, theirs, until
from zeus_agent.wire.budget import Budget

CAPPED = fo.FrontierView(times=(1.0, 1.3), powers=(140.0, 100.0), peaks=(None, None), chosen=0)
"""A 2-GPU job's frontier profiled under the caps: its fast clocks counted cool."""
GPUS = (("n", 0), ("n", 1))
GRID = Budget(budget_id="grid", cap_w=400.0)
KEY = FRONTIER_PREFIX + job_hash("perseus")



@pytest.mark.timeout(30)
async def test_the_owner_and_a_new_driver_heed_a_frontier_recorded_as_planned_under_caps(
        nc) -> None:
    state = JetStreamState(nc, "zeus", bucket=f"t-{uuid.uuid4().hex[:12]}")
    await state.open()
    mine = [enforce.JobView("perseus", GPUS, profiling=True)]
    driving = replica(state.kv, "driving", lambda: mine)
    owner = replica(state.kv, "owner", lambda: job_views([theirs()], owner.view.remote))
    await state.watch(f"{FRONTIER_PREFIX}>", owner.view.remote.on_frontier)

    driving.observe_profiles(mine, set(GPUS))  # Its first profile, under the caps.
    mine = [enforce.JobView("perseus", GPUS, frontier=CAPPED)]
    driving.observe_profiles(mine, set(GPUS))
    await driving.bucket.record_frontiers(mine, driving.profiles.planned_capped)
    assert json.loads((await state.kv.get(KEY)).value)["planned_capped"] is True
    await until(lambda: owner.view.remote.planned_capped("perseus", CAPPED), "the flag")

    owner.plan([GRID], True)
    (share,) = owner.plans["grid"].allocation.shares
    assert share.key is None and share.expected_w == 2 * share.limit_w  # At its cap.

    # A replica taking the job over replays it to the same frontier and saw none of its
    # profile: the record it writes keeps the flag.
    taken = [enforce.JobView("perseus", GPUS, frontier=CAPPED, planned_capped=owner.view
                             .remote.planned_capped("perseus", CAPPED))]
    new = replica(state.kv, "new", lambda: taken)
    new.observe_profiles(taken, set(GPUS))
    assert new.calibrate(taken)[0].frontier is None  # (Capped proportionally there too.)
    await new.bucket.record_frontiers(taken, new.profiles.planned_capped)
    assert json.loads((await state.kv.get(KEY)).value)["planned_capped"] is True
