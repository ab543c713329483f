"""A job still profiling when a budget caps its GPUs profiles only under the cap (issue 37).

`nats-server`, a coordinator, two sim agents (2 A40s each) and a 4-rank simulated job that
profiles every 50 W limit. Once its first window is measured, a budget caps the group: the
job is told its cap (the budget's plan, the agents' replies), measures no limit above it while
it holds, waits at the best limit under it, and once the budget lifts profiles the rest and
pins its optimum. Every window it measured is what its limit gives by the simulator's physics:
none ran clamped under a label above the cap.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.job_kit import LIMITS, SCALE, WORKLOAD, describe, inconsistent, options
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetRequest
from zeus_agent.wire.messages import Reply
from zeus_demo.cluster import SimCluster

pytestmark = pytest.mark.timeout(150)

PROFILE_STEPS = 40
CAP_W = 760.0
"""Four A40s at 300 W draw over 1 kW: a cap near 190 W a GPU, well over the 400 W floor."""


async def budget(c: SimCluster, **kw: object) -> Reply:
    msg = await c.nc.request(subjects.coord_budget(), codec.encode(BudgetRequest(**kw)),
                             timeout=10)
    return codec.decode(msg.data, Reply)


def cap_said(message: str) -> int | None:
    found = re.match(r"capped at (\d+) W by a power budget", message)
    return int(found.group(1)) if found else None


async def test_a_job_profiling_under_a_cap_measures_no_limit_above_it() -> None:
    c = SimCluster(nodes=("node-a", "node-b"), gpus_per_node=2)
    try:
        await c.start()
        c.start_trainer(workload=WORKLOAD, steps=4000, scale=SCALE,
                        power_limit=options(PROFILE_STEPS), timeout_s=140)
        await c.wait_status(lambda s: s.message.startswith("__GlobalPowerLimitOptimizer_300:"),
                            40, "the first window measured")
        assert (await budget(c, action="set", budget=Budget(budget_id="grid", cap_w=CAP_W))).ok
        first, _ = await c.wait_status(lambda s: cap_said(s.message) is not None, 15,
                                       "the job told its cap")
        _, parked = await c.wait_status(lambda s: bool((s.progress or {}).get("parked")), 60,
                                        "every limit under the cap measured")
        cap = parked.progress["cap_w"]
        assert not any(s.state == "done" for _, s in c.statuses), describe(c)
        # While capped: every window opened at or under the cap in force, none measured above.
        in_force: int | None = None
        for _, s in c.statuses[first:]:
            in_force = cap_said(s.message) or in_force
            opened = re.match(r"measuring (\d+) W", s.message)
            assert opened is None or int(opened.group(1)) <= (in_force or 0), describe(c)
        measured = [m["power_limit"] for m in parked.progress["measurements"]]
        assert max(LIMITS) in measured and all(w <= cap for w in measured if w != max(LIMITS))
        assert set(c.job_limits().values()) <= {w for w in measured if w <= cap}, c.job_limits()

        assert (await budget(c, action="lift", budget_id="grid")).ok
        _, done = await c.wait_status(lambda s: s.state == "done", 60, "the optimum pinned")
        profile = [PowerLimitMeasurement(**m) for m in done.progress["measurements"]]
        assert sorted(m.power_limit for m in profile) == sorted(LIMITS), describe(c)
        assert not inconsistent(profile, PROFILE_STEPS, check_energy=True), (
            inconsistent(profile, PROFILE_STEPS, check_energy=True), describe(c))
    finally:
        await c.close()
