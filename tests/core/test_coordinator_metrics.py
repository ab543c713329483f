"""`coordinator.metrics`: job snapshots from the optimisers, and snapshot -> metric families."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator import metrics
from coordinator.jobs import JobRecord
from coordinator.optimizer import JobSnapshot
from coordinator.pipeline.job import PipelineJob
from coordinator.power_limit import PowerLimitMeasurement
from coordinator.power_limit.job import PowerLimitJob
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.budget import BudgetShare, BudgetStatus
from zeus_agent.wire.messages import PowerLimitOptions

PROFILE = [
    PowerLimitMeasurement(power_limit=300, energy=1000.0, time=10.0),
    PowerLimitMeasurement(power_limit=250, energy=700.0, time=10.5),
    PowerLimitMeasurement(power_limit=200, energy=800.0, time=13.0),
]


def loaded_job() -> PowerLimitJob:
    """A 2-rank job started from a profile: done at once, 250 W (least energy) chosen."""
    job = PowerLimitJob("pl", PowerLimitOptions(selector="Energy"), ranks=[0, 1],
                        min_power_limit_w=200, max_power_limit_w=300, measurements=PROFILE)
    job.start()
    return job


def pipeline() -> PipelineJob:
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=[1410])
             for r in range(2)]
    return PipelineJob("pp", info, ranks, lambda ji, ri: None)  # type: ignore[arg-type,return-value]


def scrape(snap: metrics.CoordinatorSnapshot) -> dict[str, list[Any]]:
    """Exposition text of `families(snap)`, parsed back: family name -> samples."""
    text = generate_latest(metrics.make_registry(lambda: snap)).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list[Any], name: str, **labels: str) -> float:
    (found,) = [s.value for s in samples if s.name == name and s.labels.items() >= labels.items()]
    return float(found)


def test_a_loaded_power_limit_job_shows_its_limit_and_measured_saving() -> None:
    snap = loaded_job().snapshot()
    assert (snap.kind, snap.phase) == ("power_limit", "done")
    assert snap.optimal_power_limit_w == snap.power_limit_w == 250
    assert (snap.measured, snap.candidates) == (3, 5)  # 200..300 W in 25 W steps
    assert snap.energy_saving == pytest.approx(0.3)  # 700 J against 1000 J at 300 W
    assert snap.slowdown == pytest.approx(0.05)  # 10.5 s against 10 s


def test_a_power_limit_job_still_profiling_has_no_saving_yet() -> None:
    job = PowerLimitJob("pl", PowerLimitOptions(), ranks=[0], min_power_limit_w=200,
                        max_power_limit_w=300)
    job.start()
    snap = job.snapshot()
    assert snap.phase in {"ready", "warmup", "profiling"}
    assert snap.optimal_power_limit_w is None and snap.energy_saving is None
    assert snap.power_limit_w == 300 and snap.measured == 0


def test_a_pipeline_job_serving_a_frontier_point_shows_its_plan() -> None:
    job = pipeline()
    assert job.snapshot().plan_index is None  # Discovering: no plan yet.
    frontier = [SimpleNamespace(time=1.0, energy=100.0), SimpleNamespace(time=1.1, energy=80.0),
                SimpleNamespace(time=1.5, energy=70.0)]
    job.scheduler = SimpleNamespace(frontier=frontier, chosen=frontier[1])  # type: ignore[assignment]
    job.phase = "profiling"  # (The phases a job goes through: TRANSITIONS.)
    job.phase, job.version = "serving", 3
    snap = job.snapshot()
    assert (snap.kind, snap.phase, snap.schedule_version) == ("pipeline", "serving", 3)
    assert (snap.plan_index, snap.plan_points) == (1, 3)
    assert (snap.plan_time_s, snap.plan_energy_j) == (1.1, 80.0)
    assert snap.energy_saving == pytest.approx(0.2) and snap.slowdown == pytest.approx(0.1)


def test_families_expose_every_name_and_only_known_values() -> None:
    jobs = [
        loaded_job().snapshot(),
        JobSnapshot(job_id="reg", kind="pipeline", phase="registering"),
        JobSnapshot(job_id="nan", kind="pipeline", phase="serving", energy_saving=math.nan),
    ]
    snap = metrics.CoordinatorSnapshot(
        replica="r1", nats_state="connected", jobs=3, owned=2,
        dropped={"spoofed_node": 4, "malformed": 1}, fenced_commands=7, job_list=jobs)
    got = scrape(snap)
    samples = [s for family in got.values() for s in family]
    assert {s.name for s in samples} | {n for n in got} >= {
        n.removesuffix("_total") for n in metrics.METRIC_NAMES}
    assert {s.name for s in samples} >= {"zeus_coordinator_messages_dropped_total",
                                         "zeus_coordinator_commands_fenced_total"}
    assert value(samples, "zeus_coordinator_info", replica="r1") == 1
    assert value(samples, "zeus_coordinator_nats_connected") == 1
    assert (value(samples, "zeus_coordinator_jobs"), value(samples, "zeus_coordinator_jobs_owned")
            ) == (3, 2)
    assert value(samples, "zeus_coordinator_messages_dropped_total", reason="spoofed_node") == 4
    assert value(samples, "zeus_coordinator_commands_fenced_total") == 7
    assert value(samples, "zeus_job_phase", job_id="pl", kind="power_limit", phase="done") == 1
    assert value(samples, "zeus_job_phase", job_id="reg", phase="registering") == 1
    assert value(samples, "zeus_job_optimal_power_limit_watts", job_id="pl") == 250
    assert value(samples, "zeus_job_energy_saving_ratio", job_id="pl") == pytest.approx(0.3)
    # Unknown values are left out, not exported as 0 or NaN.
    assert [s.labels["job_id"] for s in got["zeus_job_energy_saving_ratio"]] == ["pl"]
    assert [s.labels["job_id"] for s in got["zeus_job_power_limit_watts"]] == ["pl"]
    assert got["zeus_job_plan_index"] == []


def test_disconnected_is_zero() -> None:
    snap = metrics.CoordinatorSnapshot(replica="r", nats_state="disconnected", jobs=0, owned=0)
    assert value(scrape(snap)["zeus_coordinator_nats_connected"],
                 "zeus_coordinator_nats_connected") == 0


def fake_service(**kw: Any) -> Any:
    info = JobInfo(dp_degree=2, pp_degree=1, tp_degree=1, world_size=2)
    records = {
        "pl": JobRecord("pl", info, "", PowerLimitOptions(), 0.0, 0.0),
        "waiting": JobRecord("waiting", info, "", None, 0.0, 0.0),
    }
    optimisers = {"pl": loaded_job(), "pp": pipeline()}
    jobs = SimpleNamespace(records=lambda: list(records.values()),
                           optimisers=lambda: dict(optimisers))
    base = dict(
        settings=SimpleNamespace(replica_name="r1"), jobs=jobs, dropped={"unknown_rank": 2},
        fenced_commands=1, bus_state=("connected", 0.0, ""),
        book=SimpleNamespace(mine=lambda now: ["h1"]),
        failures=SimpleNamespace(quarantined={"h2": {"reason": "x"}}, failed=1),
        budget_loop=SimpleNamespace(statuses={"grid": grid_status()}),
    )
    return SimpleNamespace(**{**base, **kw})


def grid_status() -> BudgetStatus:
    return BudgetStatus(budget_id="grid", replica="r1", cap_w=900, room_w=880, measured_w=870.5,
                        expected_w=860, floor_w=400, gpus=4, idle_gpus=1, shares=[
                            BudgetShare(job_id="pl", gpus=2, limit_w=200, expected_w=380,
                                        slowdown=0.05),
                            BudgetShare(job_id="new", gpus=1, limit_w=250, expected_w=250)])


def test_budgets_show_their_cap_draws_and_each_jobs_share() -> None:
    snap = metrics.CoordinatorSnapshot(replica="r1", nats_state="connected", jobs=0, owned=0,
                                       budgets=[grid_status()])
    got = scrape(snap)
    samples = [s for family in got.values() for s in family]
    assert value(samples, "zeus_budget_cap_watts", budget_id="grid") == 900
    assert value(samples, "zeus_budget_measured_watts", budget_id="grid") == 870.5
    assert value(samples, "zeus_budget_job_limit_watts", budget_id="grid", job_id="new") == 250
    assert value(samples, "zeus_budget_job_slowdown_ratio", job_id="pl") == pytest.approx(0.05)
    # A job without a profile has no expected slowdown: left out, not 0.
    assert [s.labels["job_id"] for s in got["zeus_budget_job_slowdown_ratio"]] == ["pl"]


def test_snapshot_reads_the_service() -> None:
    snap = metrics.snapshot(fake_service())
    assert (snap.replica, snap.nats_state, snap.jobs, snap.owned) == ("r1", "connected", 2, 1)
    assert (dict(snap.dropped), snap.fenced_commands) == ({"unknown_rank": 2}, 1)
    assert (snap.quarantined, snap.failed) == (1, 1)
    assert [b.budget_id for b in snap.budgets] == ["grid"]
    phases = {(j.job_id, j.kind, j.phase) for j in snap.job_list}
    assert phases == {("pl", "power_limit", "done"), ("pp", "pipeline", "discovering"),
                      ("waiting", "pipeline", "registering")}


def test_snapshot_reads_again_when_a_dict_changed_under_it() -> None:
    calls = []

    class Flaky(dict[str, str]):
        def mine(self, now: float) -> list[str]:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("dictionary changed size during iteration")
            return []

    snap = metrics.snapshot(fake_service(book=Flaky()))
    assert snap.owned == 0 and len(calls) == 2
