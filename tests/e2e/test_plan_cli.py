"""`zeus-coordinator plan` through a subprocess: frontier.csv and plans PointSolution runs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from coordinator.pipeline.planner import evaluate
from coordinator.pipeline.planner.profile_file import load_profile
from coordinator.pipeline.schedulers.plan_file import load_plan
from coordinator.pipeline.schedulers.point_solution import PointSolution, PointSolution3D
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.pipeline_order import one_f_one_b

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "data" / "perseus" / "stage_profiles" / "bloom+a100_sxm_bf16.csv"


def exe() -> list[str]:
    script = Path(sysconfig.get_path("scripts")) / "zeus-coordinator"
    return [str(script)] if script.exists() else [sys.executable, "-m", "coordinator.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*exe(), *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


def test_plan_writes_frontier_and_plans_point_solution_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    m = 4
    proc = run("plan", str(PROFILE), "--microbatches", str(m), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "planning: 100%" in proc.stderr and "frontier points written" in proc.stderr
    with (out / "frontier.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["index", "time", "energy"]
    times = [float(r["time"]) for r in rows]
    energies = [float(r["energy"]) for r in rows]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)
    files = sorted(out.glob("freqs_pipeline_*.py"))
    assert [f.name for f in files] == [f"freqs_pipeline_{i:05d}.py" for i in range(len(rows))]
    profile = load_profile(PROFILE)
    freqs = [f for f, _, _ in profile.entries[(0, "forward")]]
    for index in (0, len(rows) // 2, len(rows) - 1):
        path = out / f"freqs_pipeline_{index:05d}.py"
        assert path.read_text().startswith("[[('forward', ")
        plan = load_plan(path)
        assert len(plan) == 8
        t, e = evaluate(profile, plan, m, 83.64)
        assert t == pytest.approx(times[index], rel=1e-9)
        assert e == pytest.approx(energies[index], rel=1e-9)
        # One rank per stage, each with its 1F1B order and the profile's clocks.
        infos = [
            RankInfo(
                rank=s,
                dp_rank=0,
                pp_rank=s,
                tp_rank=0,
                available_frequencies=freqs,
                instructions=[name for name, _ in one_f_one_b(s, 8, m)],
            )
            for s in range(8)
        ]
        job = JobInfo(pp_degree=8, dp_degree=1, tp_degree=1, world_size=8)
        sched = PointSolution(job, infos, None, solution_path=str(path))
        assert [s.frequencies for s in sched.next_schedule()] == plan
        # Two data-parallel replicas of each stage run the same row.
        infos3d = [
            RankInfo(
                rank=2 * s + d,
                dp_rank=d,
                pp_rank=s,
                tp_rank=0,
                available_frequencies=freqs,
                instructions=[name for name, _ in one_f_one_b(s, 8, m)],
            )
            for s in range(8)
            for d in range(2)
        ]
        job3d = JobInfo(pp_degree=8, dp_degree=2, tp_degree=1, world_size=16)
        sched3d = PointSolution3D(job3d, infos3d, None, solution_path=str(path))
        schedules = sched3d.next_schedule()
        assert {s.rank: s.frequencies for s in schedules}[2 * 5 + 1] == plan[5]


def test_plan_options_and_errors(tmp_path: Path) -> None:
    out = tmp_path / "coarse"
    proc = run(
        "plan", str(PROFILE), "--microbatches", "3", "--stages", "8", "--p2p-power", "60",
        "--unit-time", "0.02", "--out", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    with (out / "frontier.csv").open() as f:
        times = [float(r["time"]) for r in csv.DictReader(f)]
    assert len(times) >= 2 and all(b - a > 0 for a, b in zip(times, times[1:], strict=False))
    missing = run("plan", str(tmp_path / "nope.csv"), "--microbatches", "3", "--out", str(out))
    assert missing.returncode == 2 and "cannot use the profile" in missing.stderr
    wrong = run("plan", str(PROFILE), "--microbatches", "3", "--stages", "4", "--out", str(out))
    assert wrong.returncode == 2 and "stages" in wrong.stderr
    usage = run("plan", str(PROFILE), "--out", str(out))
    assert usage.returncode == 2 and "--microbatches" in usage.stderr
    helped = run("--help")
    assert helped.returncode == 0 and "plan" in helped.stdout
