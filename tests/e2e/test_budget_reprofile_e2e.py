"""A Perseus job that profiled under a budget's caps profiles again once they lift (issue 37).

nats-server, `zeus-coordinator run --scheduler Perseus3D`, one agent on two simulated A40s and
the simulated 2-stage 1F1B pipeline trainer, as in test_budget_perseus_e2e.py; but the budget
is set before the job starts: its first profile runs under the caps (its fast clocks
throttled), so the budgets do not plan on the frontier it plans (`capped_profiles`), and
once the budget is lifted the coordinator asks the job to profile again: it does (status
`profiling` after `serving`), then serves a plan of its new frontier.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from tests.e2e.budget_kit import budget_cli, in_thread
from tests.repo_kit import REPO_ROOT
from zeus_demo.cluster import SimCluster

pytestmark = pytest.mark.timeout(420)

ARGS = {"profiler_args": {"clocks": 3, "warmup_iterations": 1, "min_profile_iterations": 2},
        "replan_threshold": 0.5, "max_reprofiles": 0}
"""No drift re-profile of its own (`max_reprofiles` 0): the one seen is the one asked."""
CAP_W = 360
"""Two A40s (300 W each): their fast clocks throttled, well over the 200 W floor."""


async def test_a_perseus_job_profiled_under_a_cap_profiles_again_after_the_lift() -> None:
    c = SimCluster(nodes=("node-a",), gpus_per_node=2, coordinator_args=[
        "--scheduler", "Perseus3D", "--scheduler-args", json.dumps(ARGS),
        "--profiling-iterations", "3"])
    try:
        await c.start()
        for _ in range(40):  # (Refused until the agent has announced its GPUs.)
            done = await in_thread(budget_cli, c, "set", "grid", "--cap-w", str(CAP_W))
            if done.returncode == 0 or "no agent announced" not in done.stderr:
                break
            await asyncio.sleep(0.5)
        assert done.returncode == 0, done.stderr
        node = f"node-a:{c.socket_path('node-a')}:{c.sim_dir('node-a')}:0-1"
        c.procs.spawn("trainer", [
            sys.executable, "-m", "zeus_agent.gpu.sim.trainers.pipeline",
            "--profile", "gpt3-175b+a40", "--stages", "2", "--microbatches", "4",
            "--seconds", "330", "--time-scale", "0.1", "--job-metadata", c.tag,
            "--timeout", "380", "--node", node], cwd=REPO_ROOT)
        profiled, _ = await c.wait_status(lambda s: s.state == "profiling", 120, "profiling")
        served, _ = await c.wait_status(lambda s: s.state == "serving", 150, "serving",
                                        after=profiled)
        lifted = await in_thread(budget_cli, c, "lift", "grid")
        assert lifted.returncode == 0, lifted
        again, _ = await c.wait_status(lambda s: s.state == "profiling", 30,
                                       "profiling again once the caps lifted", after=served)
        await c.wait_status(lambda s: s.state == "serving", 150, "serving its new plan",
                            after=again)
        assert "error" not in c.states(), c.messages()
    finally:
        await c.close()
