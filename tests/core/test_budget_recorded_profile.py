"""A power-limit job another replica drives takes part in a budget with the profile its owner
recorded in the state bucket (`recorded_profile`), not capped proportionally: the replica
holding the budgets drives only some of the jobs, and a proportional cap counted at the cap
left the room the others' jobs did not draw to no job (the 16 x 8 bench, jobs split over two
replicas: 13.2 kW drawn under a 17.1 kW cap)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coordinator.budget.job_views import job_views, recorded_profile
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.messages import PowerLimitOptions

ROWS = [PowerLimitMeasurement(power_limit=w, time=t, energy=e)
        for w, t, e in ((300, 1.0, 300.0), (250, 1.02, 250.0), (200, 1.3, 260.0))]


def driver(recorded: Any, options: PowerLimitOptions | None = None) -> Any:
    ranks = {r: SimpleNamespace(gpu=SimpleNamespace(node="n", gpu_index=r)) for r in (0, 1)}
    record = SimpleNamespace(ranks=ranks, power_limit=options or PowerLimitOptions(),
                             job=SimpleNamespace(world_size=2))
    return SimpleNamespace(record=record, optimiser=None, job_id="dp", recorded=recorded,
                           failed=None)


def profile() -> dict[str, Any]:
    return {"kind": "profile", "state": [m.model_dump() for m in ROWS]}


def test_a_recorded_profile_brings_its_measurements_and_its_selectors_optimum() -> None:
    (seen,) = job_views([driver(profile(), PowerLimitOptions(selector="Energy"))])
    assert seen.measurements == tuple(ROWS) and seen.optimum_w == 250  # Least energy.
    assert seen.gpus == (("n", 0), ("n", 1))
    (seen,) = job_views([driver(profile(), PowerLimitOptions(selector="Time"))])
    assert seen.optimum_w == 300


def test_a_users_own_choice_is_taken_as_recorded() -> None:
    chosen = {"kind": "chosen", "state": {"measurements": [m.model_dump() for m in ROWS],
                                          "power_limit": 200}}
    assert recorded_profile(driver(chosen)) == (tuple(ROWS), 200)


def test_no_profile_or_an_unreadable_one_leaves_the_job_capped_proportionally() -> None:
    for recorded in (None, {"kind": "windows", "state": [{"x": 1}]},
                     {"kind": "profile", "state": []}, {"kind": "profile", "state": [{"x": 1}]},
                     {"kind": "chosen", "state": {"measurements": [], "power_limit": 200}},
                     {"kind": "chosen", "state": "garbage"}):
        (seen,) = job_views([driver(recorded)])
        assert seen.measurements == () and seen.optimum_w is None, recorded
    no_options = driver(profile())
    no_options.record.power_limit = None  # A pipeline job's record.
    assert recorded_profile(no_options) is None
