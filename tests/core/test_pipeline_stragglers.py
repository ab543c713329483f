"""`PipelineJob` stragglers: detection from the pipelines' own iteration times, explicit notices,
the other pipelines slowed to a frontier point never slower than the straggler, recovery, and a
scheduler that keeps watching while it serves (installed only when its plan changes)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.config import CoordinatorSettings
from coordinator.optimizer import InstallSchedules, SaveProgress, StatusUpdate
from coordinator.pipeline.job import PipelineJob, StragglerError
from tests.core.straggler_kit import FRONTIER, NoFrontier, Trainer, Watching, make_job


@pytest.fixture(autouse=True)
def exact_pace(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection rule at exactly the straggler's pace (the margin has its own test)."""
    if "margin" not in request.node.name:
        monkeypatch.setattr("coordinator.pipeline.stragglers.STRAGGLER_MARGIN", 0.0)


def serving(dp: int = 2, **kw: Any) -> tuple[PipelineJob, Trainer]:
    job = make_job(dp, **kw)
    trainer = Trainer(job)
    trainer.iterate(n=2)  # Discovery: schedule 0 (profiling).
    assert job.phase == "profiling"
    actions = trainer.iterate()  # One window: the scheduler serves its plan.
    assert job.phase == "serving" and not job.done
    assert [a.state for a in actions if isinstance(a, StatusUpdate)] == ["serving"]
    assert clocks_by_pipeline(job) == dict.fromkeys(range(dp), 1500)
    return job, trainer


def clocks_by_pipeline(job: PipelineJob) -> dict[int, int]:
    out: dict[int, set[int]] = {}
    for rank, schedule in job.schedules.items():
        out.setdefault(job.rank_infos[rank].dp_rank, set()).update(
            f for _, f in schedule.frequencies)
    assert all(len(v) == 1 for v in out.values()), out
    return {d: v.pop() for d, v in sorted(out.items())}


def installs(actions: list) -> list[InstallSchedules]:
    return [a for a in actions if isinstance(a, InstallSchedules)]


# ------------------------------------------------------------------ detection


def test_a_persistently_slower_pipeline_slows_the_others_down() -> None:
    job, trainer = serving()
    version = job.version
    assert installs(trainer.iterate({1: 1.3}, n=2)) == []  # Not yet: the window is 3 iterations.
    actions = trainer.iterate({1: 1.3})
    (install,) = installs(actions)
    assert install.version == version + 1
    assert clocks_by_pipeline(job) == {0: 1200, 1: 1500}  # 1.2 s <= 1.3 s; the straggler keeps.
    status = [a for a in actions if isinstance(a, StatusUpdate)][-1]
    assert status.state == "straggler" and "pipeline 1 is a straggler (1.300x, measured)" in (
        status.message)
    assert job.progress()["stragglers"] == {"1": 1.3}
    assert job.progress()["slowed"] == {"0": 1.2}
    assert job.desired_schedule(0) == (job.schedules[0], install.version, install.from_step)


def test_slower_within_the_threshold_or_not_for_long_enough_is_no_straggler() -> None:
    job, trainer = serving()
    assert installs(trainer.iterate({1: 1.04}, n=6)) == []
    assert installs(trainer.iterate({1: 1.3}, n=2) + trainer.iterate(n=1)
                    + trainer.iterate({1: 1.3}, n=2)) == []
    assert job.detected == {}


def test_the_step_time_with_the_all_reduce_wait_would_hide_it() -> None:
    """Every step lasts as long as the slowest pipeline's: the pipeline's own span is used."""
    job, trainer = serving()
    trainer.iterate({1: 1.3}, n=3)
    assert job.detected == {1: pytest.approx(1.3)}


def test_a_mitigated_straggler_stays_and_then_recovers() -> None:
    job, trainer = serving()
    trainer.iterate({1: 1.3}, n=3)
    # Pipeline 0 now runs the 1.2 s point: its own span is 1.2 s, as planned; no churn.
    assert installs(trainer.iterate({0: 1.2, 1: 1.3}, n=6)) == []
    assert job.detected == {1: pytest.approx(1.3)}
    # A bigger slowdown is measured again (beyond the threshold): a slower point.
    actions = trainer.iterate({0: 1.2, 1: 1.6}, n=3)
    assert len(installs(actions)) == 1 and clocks_by_pipeline(job) == {0: 1000, 1: 1500}
    # It recovers: back to the chosen plan everywhere.
    actions = trainer.iterate({0: 1.5, 1: 1.0}, n=3)
    assert len(installs(actions)) == 1 and clocks_by_pipeline(job) == {0: 1500, 1: 1500}
    status = [a for a in actions if isinstance(a, StatusUpdate)][-1]
    assert status.state == "serving" and job.progress()["stragglers"] == {}


def test_the_scheduler_gets_no_results_while_a_straggler_is_known() -> None:
    job, trainer = serving()
    scheduler = job.scheduler
    assert isinstance(scheduler, Watching)
    trainer.iterate(n=2)
    seen = scheduler.seen
    assert seen >= 2  # Served and watched: results keep coming, no new schedule version...
    trainer.iterate({1: 1.3}, n=3)
    seen = scheduler.seen
    trainer.iterate({0: 1.2, 1: 1.3}, n=4)
    assert scheduler.seen == seen  # ...but not while a straggler is known.


def test_a_serving_scheduler_is_installed_only_when_its_plan_changes() -> None:
    job, trainer = serving()
    version = job.version
    assert installs(trainer.iterate(n=4)) == []
    assert job.version == version
    scheduler = job.scheduler
    assert isinstance(scheduler, Watching)
    scheduler.new_plan = FRONTIER[1]  # The scheduler re-planned.
    actions = trainer.iterate(n=1)
    assert len(installs(actions)) == 1 and clocks_by_pipeline(job) == {0: 1200, 1: 1200}
    assert [a.state for a in actions if isinstance(a, StatusUpdate)] == ["serving"]


# ------------------------------------------------------------------ notices


def test_a_notice_applies_and_clears() -> None:
    job, trainer = serving()
    actions = job.set_straggler(1, 1.5)
    assert len(installs(actions)) == 1 and clocks_by_pipeline(job) == {0: 1000, 1: 1500}
    assert "(1.500x, notice)" in [a for a in actions if isinstance(a, StatusUpdate)][-1].message
    # The notice is progress a replica taking the job over must resume with.
    saved = [a for a in actions if isinstance(a, SaveProgress)]
    assert len(saved) == 1 and saved[0].state["notices"] == {"1": 1.5}
    # What is measured does not override the notice.
    assert installs(trainer.iterate({0: 1.5, 1: 1.0}, n=4)) == []
    actions = job.set_straggler(1, None)
    assert len(installs(actions)) == 1 and clocks_by_pipeline(job) == {0: 1500, 1: 1500}


def test_several_stragglers_each_pipeline_waits_for_the_slowest() -> None:
    job, _ = serving(dp=3)
    job.set_straggler(1, 1.5)
    job.set_straggler(2, 1.25)
    # Pipeline 0: <= 1.5 s: 1000 MHz; pipeline 2 (1.25x itself): <= 1.5 / 1.25 = 1.2 s.
    assert clocks_by_pipeline(job) == {0: 1000, 1: 1500, 2: 1200}


def test_never_slower_than_the_straggler() -> None:
    job, _ = serving()
    job.set_straggler(0, 1.1)  # No frontier point between 1.0 and 1.1 s: nothing changes.
    assert clocks_by_pipeline(job) == {0: 1500, 1: 1500}
    job.set_straggler(0, 1.99)
    assert clocks_by_pipeline(job) == {0: 1500, 1: 1000}


@pytest.mark.parametrize(("pipeline", "factor", "code"), [
    (2, 1.3, "out_of_range"), (-1, 1.3, "out_of_range"), (0, 0.5, "bad_request"),
    (0, float("nan"), "bad_request"), (0, 1e6, "bad_request")])
def test_bad_notices_are_refused_with_a_code(pipeline: int, factor: float, code: str) -> None:
    job, _ = serving()
    with pytest.raises(StragglerError) as e:
        job.set_straggler(pipeline, factor)
    assert e.value.code == code
    assert job.notices == {}


def last_status(actions: list[Any]) -> StatusUpdate:
    """The last status of `actions` (a notice's actions end with the progress it records)."""
    return [a for a in actions if isinstance(a, StatusUpdate)][-1]


def test_a_notice_before_serving_waits_for_the_plan() -> None:
    job = make_job()
    trainer = Trainer(job)
    trainer.iterate(n=2)
    actions = job.set_straggler(1, 1.3)
    assert installs(actions) == []
    assert "applied once a plan is served" in last_status(actions).message
    actions = trainer.iterate()
    assert [a.state for a in actions if isinstance(a, StatusUpdate)] == ["straggler"]
    assert clocks_by_pipeline(job) == {0: 1200, 1: 1500}


def test_a_scheduler_without_frontier_says_so() -> None:
    job = make_job(scheduler=NoFrontier)
    Trainer(job).iterate(n=3)
    assert job.phase == "serving" and job.done  # A finished scheduler, nothing to watch.
    actions = job.set_straggler(1, 1.3)
    assert installs(actions) == [] and "has no time-energy frontier" in last_status(actions).message


def test_one_pipeline_has_nothing_to_slow_down() -> None:
    job, trainer = serving(dp=1)
    actions = job.set_straggler(0, 1.3)
    assert installs(actions) == [] and "no other pipeline" in last_status(actions).message
    with pytest.raises(StragglerError):
        job.set_straggler(1, 1.3)


def test_a_stopped_job_refuses_notices() -> None:
    job, _ = serving()
    job.abort("test")
    with pytest.raises(StragglerError) as e:
        job.set_straggler(0, 1.3)
    assert e.value.code == "conflict"


# ------------------------------------------------------------------ settings


def test_settings_reach_the_job_and_are_checked() -> None:
    settings = CoordinatorSettings(straggler_threshold=0.1, straggler_window=7)
    assert (settings.straggler_threshold, settings.straggler_window) == (0.1, 7)
    defaults = CoordinatorSettings()
    assert (defaults.straggler_threshold, defaults.straggler_window) == (0.05, 5)
    for bad in ({"straggler_threshold": 0}, {"straggler_window": 0}):
        with pytest.raises(ValueError):
            CoordinatorSettings(**bad)
    with pytest.raises(ValueError, match="straggler_window"):
        make_job(straggler_window=0)


def test_the_other_pipelines_keep_a_margin_under_the_stragglers_pace() -> None:
    """With the default 2% margin, a frontier point at exactly the straggler's pace is too slow:
    the next faster one is taken (1.2 s, not 1.5 s, for a 1.5x straggler)."""
    job, _ = serving()
    job.set_straggler(1, 1.5)
    assert clocks_by_pipeline(job) == {0: 1200, 1: 1500}
    job.set_straggler(1, 1.54)  # 1.5 s is within 2% under 1.54 s.
    assert clocks_by_pipeline(job) == {0: 1000, 1: 1500}
