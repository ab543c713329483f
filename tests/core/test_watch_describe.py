"""`zeus-coordinator watch` lines: power-limit progress and pipeline phases."""

from __future__ import annotations

from coordinator.watch import describe
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
