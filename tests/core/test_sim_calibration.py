"""The shipped simulator parameters meet the calibration target on the reference profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeus_agent.gpu.sim import PRESETS, WORKLOADS
from zeus_agent.gpu.sim.calibration import (
    DEFAULT_PROFILE_DIR,
    calibration_report,
    load_profiles,
    render_report,
)

PROFILE_DIR = Path("data/reference-profiles")


@pytest.fixture(scope="module")
def report() -> dict:
    repo_root = Path(__file__).resolve().parents[2]
    return calibration_report(load_profiles(repo_root / PROFILE_DIR))


def test_default_profile_dir_is_the_repos() -> None:
    assert DEFAULT_PROFILE_DIR.parts[-2:] == PROFILE_DIR.parts
    assert len(load_profiles()) == 12


def test_profiles_load() -> None:
    profiles = load_profiles()
    assert sum(len(p.rows) for p in profiles) == 96
    by_name = {p.name: p for p in profiles}
    p = by_name["A40+resnet50+gpu0,1,2,3"]
    assert p.gpu_type == "A40" and p.model == "resnet50" and p.num_gpus == 4
    assert [r.power_limit_w for r in p.rows] == list(range(300, 99, -25))
    assert p.rows[0].step_time_s == pytest.approx(8.226085375994444 / 40)


def test_every_profile_has_a_workload_and_hardware() -> None:
    for p in load_profiles():
        assert p.name in WORKLOADS
        assert p.gpu_type in PRESETS


def test_overall_error_target(report: dict) -> None:
    o = report["overall"]
    assert o["points"] == 96
    assert o["time_err_median"] <= 0.02
    assert o["energy_err_median"] <= 0.02
    assert o["time_err_p90"] <= 0.05
    assert o["energy_err_p90"] <= 0.05


def test_regret_target(report: dict) -> None:
    assert report["overall"]["num_profiles"] == 12
    assert report["overall"]["regret_within"] >= 11
    regrets = [r["regret"] for r in report["profiles"]]
    assert all(r >= 0 for r in regrets)


def test_report_renders(report: dict) -> None:
    text = render_report(report)
    assert "A40+bert-base-uncased+gpu0" in text
    assert "Overall over 96 points" in text
