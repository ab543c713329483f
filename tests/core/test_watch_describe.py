"""`zeus-coordinator watch` lines: power-limit progress and pipeline phases."""

from __future__ import annotations

from coordinator.watch import BudgetLines, describe, describe_budget
from zeus_agent.wire.budget import BudgetShare, BudgetStatus
from zeus_agent.wire.messages import JobStatus


def line(progress: dict) -> str:
    return describe(JobStatus(job_id="j", state="s", message="m", progress=progress))


def test_pipeline_phases_are_shown() -> None:
    assert line({"phase": "discovering"}).endswith("(discovering)")
    assert line({"phase": "profiling", "rounds": [2, 7], "schedule": 3}).endswith(
        "(profiling 2/7, schedule 3)")
    assert line({"phase": "serving", "schedule": 8}).endswith("(serving plan 8)")


def test_power_limit_progress_is_shown() -> None:
    text = line({"candidates": 9, "measured": 3, "power_limit_w": 250})
    assert text.endswith("(3/9 limits measured, now 250 W)")


def budget_status(limit_w: int = 200, measured_w: float | None = 870.0) -> BudgetStatus:
    return BudgetStatus(budget_id="grid", replica="r1", cap_w=900, room_w=880,
                        measured_w=measured_w, expected_w=860, floor_w=400, gpus=4, idle_gpus=1,
                        shares=[BudgetShare(job_id="pl", gpus=2, limit_w=limit_w, expected_w=380,
                                            slowdown=0.05),
                                BudgetShare(job_id="new", gpus=1, limit_w=250, expected_w=250)])


def test_a_budget_shows_its_cap_draw_and_each_jobs_share() -> None:
    text = describe_budget(budget_status())
    assert "budget grid [under cap] cap 900 W, measured 870 W" in text
    assert "pl: 2 GPU(s) at 200 W, 380 W, slowdown 5.0%" in text
    assert "new: 1 GPU(s) at 250 W, 250 W, proportional: no profile yet" in text
    assert "[OVER cap]" in describe_budget(budget_status(measured_w=950))
    assert "measured ? W" in describe_budget(budget_status(measured_w=None))


def test_budget_lines_show_a_change_at_once_and_the_rest_now_and_then() -> None:
    lines = BudgetLines(every_s=10)
    assert lines.show(budget_status(), 0.0)
    assert not lines.show(budget_status(), 1.0)
    assert lines.show(budget_status(limit_w=175), 2.0)  # a share changed
    assert not lines.show(budget_status(limit_w=175), 5.0)
    assert lines.show(budget_status(limit_w=175), 12.5)
