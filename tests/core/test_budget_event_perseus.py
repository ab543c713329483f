"""The grid event's Perseus job, judged: its statuses and budget shares as the watcher keeps
them, whether it serves its own point, and its figures (draw, planned and measured slowdown,
seconds until its own point is back after the lift)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.budget import allocator as alloc
from zeus_agent.wire import codec
from zeus_agent.wire.budget import BudgetShare, BudgetStatus
from zeus_agent.wire.messages import JobStatus
from zeus_demo.budget import analysis as an
from zeus_demo.budget.event import Event, Watcher, perseus_figures
from zeus_demo.budget.jobs import Node, perseus_argv, perseus_job

JOB_ID = "abc+dp1+pp2+tp1+Perseus3D+bjps"


def watcher() -> Watcher:
    _, spec = perseus_job([Node("n00", "A40", 2)], 2)
    return Watcher([], spec)


def test_the_perseus_job_gets_a_node_of_its_own_and_the_trainer_its_gpus() -> None:
    node, spec = perseus_job([Node("n00", "A40", 8), Node("n01", "V100", 8)], 8)
    assert node == Node("n02", "A40", 8)
    assert (spec.stages, spec.dp, spec.microbatches) == (4, 2, 8)
    assert spec.gpus == tuple(("n02", g) for g in range(8))
    argv = perseus_argv(spec, "/r", 100)
    assert argv[argv.index("--node") + 1] == "n02:/r/n02.sock:/r/n02:0-7"
    assert argv[argv.index("--job-metadata") + 1] == "bjps"


def test_its_statuses_and_shares_are_kept_and_its_own_point_recognised() -> None:
    watch = watcher()
    assert not watch.perseus_own()  # Nothing served yet.

    def status(state: str, message: str) -> None:
        msg = SimpleNamespace(data=codec.encode(JobStatus(job_id=JOB_ID, state=state,
                                                          message=message)))
        asyncio.run(watch.status(msg))

    status("profiling", "profiling 1/3")
    assert not watch.perseus_own() and watch.job_ids["bjps"] == JOB_ID
    status("serving", "serving the plan of 0.2 s, 95 J per iteration: schedule 3 from step 9")
    assert watch.perseus_own()
    status("serving", "serving the frontier point of 0.26 s, 74 J per iteration under a power "
           "budget (the plan of 0.2 s, 95 J per iteration when it lifts): schedule 4")
    assert not watch.perseus_own()
    share = BudgetShare(job_id=JOB_ID, gpus=2, limit_w=100, expected_w=200.0, slowdown=0.76)
    other = BudgetShare(job_id="someone-else", gpus=2, limit_w=150, expected_w=300.0)
    budget = BudgetStatus(budget_id="grid", replica="r1", cap_w=900, room_w=900,
                          expected_w=880, floor_w=800, gpus=8, idle_gpus=0,
                          shares=[share, other])
    asyncio.run(watch.budget_status(SimpleNamespace(data=codec.encode(budget))))
    assert [(w, s, e) for _, w, s, e in watch.perseus_shares] == [(100, 0.76, 200.0)]


def test_its_figures_from_the_samples_the_shares_and_the_statuses() -> None:
    watch = watcher()
    assert watch.perseus is not None
    for t in range(21):  # 400 W until t = 10 s, then 200 W (two GPUs, each half).
        for key in watch.perseus.gpus:
            energy = 200.0 * min(t, 10) + 100.0 * max(0, t - 10)
            watch.series.add(key, float(t), energy, 300)
    watch.perseus_states = [
        (9.0, "serving", "serving the plan of 0.2 s"),
        (11.0, "serving", "serving the frontier point ... under a power budget (...)"),
        (20.5, "serving", "serving the plan of 0.2 s")]
    watch.perseus_shares = [(10.5, 150, 0.2, 300.0), (12.0, 100, 0.76, 200.0)]
    figures = perseus_figures(watch, Event(cap_w=900, signal_s=10.0, lift_s=20.0))
    assert figures["draw_before_w"] == 400.0 and figures["draw_capped_w"] == 200.0
    assert (figures["share_limit_w"], figures["planned_slowdown"]) == (100, 0.76)
    assert figures["budget_points_served"] == 1 and "power budget" in figures[
        "last_budget_status"]
    assert figures["seconds_to_own_point"] == 0.5
    assert figures["measured_slowdown"] is None  # No iterations measured: the plan's judged.
    # Its first GPU's iterations: 0.2 s before the signal, 0.3 s in the hold's second half.
    ran = [(1.0 + 0.5 * i, 0.2) for i in range(18)]
    held = [(15.2 + 0.5 * i, 0.3) for i in range(8)]
    watch.perseus_steps = [*ran, (12.0, 9.9), *held]  # (The switch, in the first half.)
    figures = perseus_figures(watch, Event(cap_w=900, signal_s=10.0, lift_s=20.0))
    assert figures["measured_slowdown"] == pytest.approx(0.5)
    assert figures["steps_measured"] == [18, 8]


def test_the_pipeline_on_the_simulators_instructions_and_the_losses_with_it() -> None:
    moved, stays = an.pipeline_truth(an.SimPipeline("bjps", "gpt3-175b+a40", 2, 1, 4, 0.1))
    assert moved.optimum >= 0 and moved.gpus == stays.gpus == 2
    assert [o.limit_w for o in stays.options] == list(range(300, 99, -25))
    times = [o.time_s for o in stays.options]
    assert times == sorted(times) and times[0] < times[-1]  # Lower caps, slower.
    points = [o for o in moved.options if o.key >= 0]
    assert [o.power_w for o in points] == sorted((o.power_w for o in points), reverse=True)
    assert all(o.key < 0 and o.power_w < points[-1].power_w
               for o in moved.options[len(points):])

    dp = an.SimJob("bj00", "A40+resnet50+gpu0", "A40", (("n00", 0), ("n00", 1)), 300)
    group = an.true_group([dp], 600.0, 0.0)
    best = alloc.allocate(alloc.Group(600.0, (*group.jobs, moved)))
    applied = {"bj00": best.by_job["bj00"].limit_w}
    ideal = an.compare_with_pipeline(group, applied, (moved, stays),
                                     best.by_job["bjps"].slowdown)
    assert ideal["loss"] == ideal["optimal_loss"] and ideal["gap_to_optimal_pct"] == 0
    assert ideal["uniform_loss"] >= ideal["optimal_loss"]
    worse = an.compare_with_pipeline(group, applied, (moved, stays), 1.0)  # Twice as slow.
    assert worse["loss"] > ideal["loss"] and worse["gap_to_optimal_pct"] > 0
