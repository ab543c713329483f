"""A grid event through the command line, every piece a process of its own.

`nats-server`, `zeus-coordinator run`, one `zeus-agent run --backend sim` (2 A40s) and a 2-rank
simulated data-parallel job that profiles and pins its ZeusCost optimum. Then an operator cuts
the group's draw by 25% with `zeus-coordinator budget set`: the coordinator shares the cap by
the job's measured profile, the agent holds it as a node cap, and the GPUs' own energy counters
(read here from the simulator, not from the coordinator) show the draw under the cap.
`zeus-coordinator budget show --json` reports it; `budget lift` brings the job's optimum back
while it still trains.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.budget_kit import budget_cli, draw_w, in_thread
from tests.e2e.job_kit import SCALE, WORKLOAD, describe, options
from zeus_demo.cluster import SimCluster

pytestmark = pytest.mark.timeout(150)

CUT = 0.25
OVER_CAP_TOLERANCE = 1.02
"""The measured draw may exceed the cap by this factor while the tightener settles: the
profile's powers are means over windows, the draw a one-second mean."""


async def test_a_cut_set_with_the_cli_holds_the_draw_under_the_cap_and_a_lift_restores():
    c = SimCluster(nodes=("node-a",), gpus_per_node=2)
    try:
        await c.start()
        c.start_trainer(workload=WORKLOAD, steps=1500, scale=SCALE, power_limit=options(6),
                        timeout_s=120)
        _, done = await c.wait_status(lambda s: s.state == "done", 40, "the optimum pinned")
        optimum = done.progress["optimal_power_limit_w"]
        await c.wait(lambda: set(c.job_limits().values()) == {optimum}, 5)
        before = await in_thread(draw_w, c, c.placements())
        cap = round(before * (1 - CUT))
        assert cap > 2 * 100, f"the cut {cap} W is under the floor: the test needs a heavier job"

        done_cli = await in_thread(budget_cli, c, "set", "grid", "--cap-w", str(cap),
                                   "--nodes", "node-a", "--note", "utility call")
        assert done_cli.returncode == 0, done_cli.stderr
        # One limit for every GPU of a data-parallel job, under its optimum.
        try:
            await c.wait(lambda: len(set(c.job_limits().values())) == 1
                         and max(c.job_limits().values()) < optimum, 10)
        except TimeoutError:
            raise AssertionError(f"limits {c.job_limits()} under a {cap} W cap (optimum "
                                 f"{optimum} W, drawing {before:.0f} W)\n{describe(c)}") from None
        draws = []
        for _ in range(15):
            draws.append(await in_thread(draw_w, c, c.placements()))
            if draws[-1] <= cap:
                break
        assert min(draws) <= cap * OVER_CAP_TOLERANCE, (
            f"drawing {draws} W against a {cap} W cap (was {before:.0f} W at {optimum} W); "
            f"limits {c.job_limits()}")

        shown = await in_thread(budget_cli, c, "show", "grid", "--json")
        assert shown.returncode == 0, shown.stderr
        data = json.loads(shown.stdout)
        (view,) = [b for b in data["budgets"] if b["budget_id"] == "grid"]
        assert view["cap_w"] == cap and view["gpus"] == 2 and view["note"] == "utility call"
        assert view["draw_w"] is not None and view["draw_w"] <= cap * OVER_CAP_TOLERANCE, view

        lifted = await in_thread(budget_cli, c, "lift", "grid")
        assert lifted.returncode == 0 and "lifted grid" in lifted.stdout, lifted
        try:
            await c.wait(lambda: set(c.job_limits().values()) == {optimum}, 10)
        except TimeoutError:
            raise AssertionError(f"limits {c.job_limits()} after the lift, optimum {optimum} W"
                                 f"\n{describe(c)}") from None
        assert c.procs.alive("trainer"), "the job ended before the lift: raise its steps"
    finally:
        await c.close()
