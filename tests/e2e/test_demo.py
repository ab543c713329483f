"""`zeus-demo` end to end: run the console script with small step counts, check the report.

The power-limit part and the pipeline part (`--skip-pipeline`, `--pipeline-only`) are run
separately, each with small counts; `make demo` runs both.

The demo runs as a subprocess with a marker in its environment, so every process it started
(nats-server, rank processes, multiprocessing helpers) can be found afterwards, wherever it
was reparented: none may be left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from coordinator.power_limit import ZeusCost
from zeus_agent.models import PowerLimitMeasurement
from zeus_demo.budget.demo import plot_timeline, render_budget_table

MARK = "ZEUS_DEMO_TEST_MARK"


def _demo_command() -> list[str]:
    script = Path(sys.executable).with_name("zeus-demo")
    if script.exists():
        return [str(script)]
    found = shutil.which("zeus-demo")
    if found:
        return [found]
    return [sys.executable, "-m", "zeus_demo"]


def _processes_with_mark(mark: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ.split(b"\0"):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {command}")
    return found


def _run_demo(*args: str, timeout_s: float = 150) -> tuple[subprocess.CompletedProcess[str], str]:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "COLUMNS": "120"}
    proc = subprocess.run(
        [*_demo_command(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    return proc, mark


@pytest.mark.timeout(180)
def test_demo_writes_a_report_from_the_agents_measurements(tmp_path: Path) -> None:
    report = tmp_path / "report"
    proc, mark = _run_demo(
        "--steps",
        "80",
        "--warmup-steps",
        "1",
        "--profile-steps",
        "4",
        "--scale",
        "0.05",
        "--report-dir",
        str(report),
        "--no-progress",
        "--skip-pipeline",
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert _processes_with_mark(mark) == []
    # The table was printed.
    assert "baseline (max limit)" in proc.stdout and "optimised" in proc.stdout
    assert "saving" in proc.stdout

    summary = json.loads((report / "summary.json").read_text())
    for key in (
        "config",
        "job_id",
        "chosen_power_limit_w",
        "max_power_limit_w",
        "baseline",
        "optimised",
        "savings",
        "profile",
        "per_power_limit",
        "elapsed_s",
    ):
        assert key in summary, key
    cfg = summary["config"]
    assert (cfg["nodes"], cfg["gpus_per_node"], cfg["job_gpus"]) == (2, 4, 4)
    assert (cfg["preset"], cfg["selector"], cfg["steps"]) == ("A40", "ZeusCost", 80)
    assert summary["job_id"].endswith(
        "+dp4+pp1+tp1+PowerLimitOptimizer+" + summary["job_id"].rsplit("+", 1)[-1]
    )
    assert {p["node"] for p in summary["placements"]} == {"node-a", "node-b"}
    assert 0 < summary["elapsed_s"] < 150
    assert summary["pipeline"] is None  # --skip-pipeline
    assert not (report / "pipeline_timeline.png").exists()

    base, opt = summary["baseline"], summary["optimised"]
    chosen = summary["chosen_power_limit_w"]
    assert base["power_limit_w"] == summary["max_power_limit_w"] == 300
    assert opt["power_limit_w"] == chosen
    assert base["steps"] >= 1 and opt["steps"] >= 1
    assert base["last_step"] < opt["first_step"]
    # Energy per step is over four GPUs: more than four idle A40s for that time.
    for side in (base, opt):
        assert side["energy_per_step_j"] > 4 * 30 * side["time_per_step_s"] > 0
    # Savings are exactly what the measured per-step numbers give.
    savings = summary["savings"]
    b_e, o_e = base["energy_per_step_j"], opt["energy_per_step_j"]
    b_t, o_t = base["time_per_step_s"], opt["time_per_step_s"]
    assert savings["energy_pct"] == pytest.approx((b_e - o_e) / b_e * 100)
    assert savings["time_change_pct"] == pytest.approx((o_t - b_t) / b_t * 100)
    # The per-limit table holds the same baseline numbers.
    by_limit = {s["power_limit_w"]: s for s in summary["per_power_limit"]}
    assert set(by_limit) >= {300, chosen}

    # The profile has every limit, and the chosen one is what ZeusCost picks from it.
    prof = summary["profile"]["measurements"]
    assert [m["power_limit"] for m in prof] == list(range(300, 99, -25))
    measurements = [PowerLimitMeasurement(**m) for m in prof]
    assert ZeusCost(0.5, world_size=4).select(measurements) == chosen
    zeus_profile = json.loads((report / "profile.json").read_text())
    assert [m["power_limit"] for m in zeus_profile["measurements"]] == list(range(300, 99, -25))

    png = report / "power_limits.png"
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_demo_help_documents_the_options() -> None:
    proc, _ = _run_demo("--help", timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--nodes",
        "--gpus-per-node",
        "--job-gpus",
        "--preset",
        "--workload",
        "--selector",
        "--eta-knob",
        "--max-slowdown",
        "--warmup-steps",
        "--profile-steps",
        "--steps",
        "--epochs",
        "--scale",
        "--search",
        "--nats-url",
        "--report-dir",
        "--seed",
        "--skip-pipeline",
        "--pipeline-only",
        "--budget",
        "--pipeline-stages",
        "--pipeline-dp",
        "--microbatches",
        "--pipeline-time-scale",
        "--pipeline-iterations",
        "--pipeline-clocks",
        "Perseus",
        "examples:",
    ):
        assert flag in proc.stdout, flag


def test_demo_rejects_inconsistent_options_with_a_clear_message(tmp_path: Path) -> None:
    proc, mark = _run_demo("--steps", "10", "--report-dir", str(tmp_path / "r"), timeout_s=60)
    assert proc.returncode == 2
    assert "raise --steps" in proc.stderr
    assert not (tmp_path / "r").exists()
    proc, _ = _run_demo("--job-gpus", "9", timeout_s=60)
    assert proc.returncode == 2 and "--job-gpus 9" in proc.stderr
    proc, _ = _run_demo("--pipeline-stages", "1", timeout_s=60)
    assert proc.returncode == 2 and "--pipeline-stages" in proc.stderr
    proc, _ = _run_demo("--skip-pipeline", "--pipeline-only", timeout_s=60)
    assert proc.returncode == 2
    proc, _ = _run_demo("--budget", "--pipeline-only", timeout_s=60)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
    assert _processes_with_mark(mark) == []


@pytest.mark.timeout(240)
def test_demo_pipeline_part_compares_all_max_and_perseus(tmp_path: Path) -> None:
    report = tmp_path / "report"
    proc, mark = _run_demo(
        "--pipeline-only",
        "--pipeline-iterations",
        "8",
        "--pipeline-clocks",
        "3",
        "--pipeline-time-scale",  # (1, the default, takes minutes: real instruction times)
        "0.1",
        "--report-dir",
        str(report),
        "--no-progress",
        timeout_s=220,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert _processes_with_mark(mark) == []
    assert "all-max clocks" in proc.stdout and "measured" in proc.stdout
    assert "predicted" in proc.stdout
    assert "profiling online" in proc.stdout  # live progress, plain lines without a terminal
    assert "scaled: instruction times and the energy counter x0.1" in proc.stdout

    summary = json.loads((report / "summary.json").read_text())
    assert "baseline" not in summary  # --pipeline-only: no power-limit part
    pipe = summary["pipeline"]
    cfg = pipe["config"]
    assert (cfg["stages"], cfg["dp"], cfg["microbatches"]) == (4, 1, 4)
    assert (cfg["profile"], cfg["preset"]) == ("gpt3-175b+a40", "A40")
    assert cfg["energy_update_ms"] == pytest.approx(100 * cfg["time_scale"])
    scheduler = pipe["scheduler"]
    assert scheduler in ("Perseus", "InstructionProfiler")
    assert pipe["jobs"]["all_max"].split("+")[1:5] == ["dp1", "pp4", "tp1", "PointSolution"]
    assert pipe["jobs"]["perseus"].split("+")[1:5] == ["dp1", "pp4", "tp1", scheduler]

    base, opt = pipe["all_max"], pipe["perseus"]
    assert base["iterations"] == 8 and opt["iterations"] >= 8
    assert base["schedule_versions"] == [0]
    assert opt["schedule_versions"] == [pipe["served_schedule"]]
    for side in (base, opt):
        # Four GPUs for the iteration: more than four idle A40s (30 W), less than four at 300 W.
        e, t = side["energy_per_iteration_j"], side["time_per_iteration_s"]
        assert 4 * 30 * t < e < 4 * 300 * t
        assert side["energy_per_iteration_by_pipeline_j"] == {"0": pytest.approx(e)}
    savings = pipe["savings"]
    b_e, o_e = base["energy_per_iteration_j"], opt["energy_per_iteration_j"]
    b_t, o_t = base["time_per_iteration_s"], opt["time_per_iteration_s"]
    assert savings["energy_pct"] == pytest.approx((b_e - o_e) / b_e * 100)
    assert savings["time_change_pct"] == pytest.approx((o_t - b_t) / b_t * 100)

    timeline = report / "pipeline_timeline.png"
    assert timeline.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    if scheduler == "InstructionProfiler":  # Perseus not installed: said so, no planner.
        assert pipe["scheduler_note"] and pipe["planner"] is None
        return
    plan = pipe["planner"]
    assert plan["frontier_points"] == len(plan["frontier"]) >= 2
    times = [p["time_s"] for p in plan["frontier"]]
    energies = [p["energy_j"] for p in plan["frontier"]]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)
    assert plan["chosen"]["energy_j"] < plan["all_max"]["energy_j"]
    assert plan["chosen"]["time_s"] <= plan["all_max"]["time_s"] * (1 + 1e-9)
    assert plan["predicted_energy_saving_pct"] > 0
    # The served plan: every stage's 1F1B order, clocks within the A40's range.
    from zeus_agent.gpu.sim.trainers.pipeline import one_f_one_b

    assert len(plan["chosen_plan"]) == 4
    for stage, row in enumerate(plan["chosen_plan"]):
        assert [n for n, _ in row] == [n for n, _ in one_f_one_b(stage, 4, 4)]
        assert all(210 <= f <= 1740 for _, f in row)
    # The saving is real: measured by the agents' energy counters.
    assert savings["energy_pct"] > 0
    assert (report / "pipeline_frontier.png").read_bytes().startswith(b"\x89PNG")
    assert pipe["images"] == ["pipeline_frontier.png", "pipeline_timeline.png"]


# ---------------------------------------------------------------- the pure arithmetic
def test_compare_uses_leading_max_and_trailing_chosen_steps() -> None:
    from zeus_demo.compare import compare

    # Two ranks: 3 steps at 300 W, 2 profiled at 200 W, back to 300, then 3 pinned at 200 W.
    limits = [300, 300, 300, 200, 200, 300, 200, 200, 200]
    step_limits = {0: limits, 1: limits}
    measured = {}
    for step, w in enumerate(limits):
        for rank in (0, 1):
            t = 1.0 if w == 300 else 1.1 + 0.1 * rank  # Time: max over ranks.
            e = 100.0 if w == 300 else 70.0  # Energy: summed over ranks.
            measured[(rank, step)] = (t, e)
    del measured[(1, 8)]  # One rank's measurement is lost: that step is left out.
    c = compare(step_limits, measured, max_power_limit_w=300, chosen_power_limit_w=200)
    assert (c.baseline.steps, c.baseline.first_step, c.baseline.last_step) == (3, 0, 2)
    assert (c.optimised.steps, c.optimised.first_step, c.optimised.last_step) == (2, 6, 7)
    assert c.baseline.energy_per_step_j == pytest.approx(200.0)
    assert c.optimised.energy_per_step_j == pytest.approx(140.0)
    assert c.optimised.time_per_step_s == pytest.approx(1.2)
    assert c.energy_saving_pct == pytest.approx(30.0)
    assert c.time_change_pct == pytest.approx(20.0)
    assert c.unmatched_steps == 1
    assert [s.power_limit_w for s in c.per_limit] == [300, 200]
    assert c.per_limit[0].steps == 4


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ([250, 300, 200], "did not start at the maximum"),
        ([300, 200, 300], "not at the chosen"),
        ([200, 200], "did not start at the maximum"),
    ],
)
def test_compare_refuses_runs_it_cannot_compare(limits: list[int], message: str) -> None:
    from zeus_demo.compare import compare
    from zeus_demo.config import DemoError

    measured = {(0, s): (1.0, 1.0) for s in range(len(limits))}
    with pytest.raises(DemoError, match=message):
        compare({0: limits}, measured, max_power_limit_w=300, chosen_power_limit_w=200)


def test_compare_refuses_a_job_that_never_left_one_limit() -> None:
    from zeus_demo.compare import compare
    from zeus_demo.config import DemoError

    with pytest.raises(DemoError, match="one power limit"):
        compare({0: [300, 300]}, {(0, 0): (1.0, 1.0), (0, 1): (1.0, 1.0)}, 300, 300)


def test_pipeline_window_stats_takes_steps_every_rank_ran_under_the_versions() -> None:
    from zeus_demo.pipeline import StepRecord, window_stats

    # Two pipelines of two stages: ranks 0, 1 (pipeline 0 and 1 of stage 0), 2, 3 (stage 1).
    pipelines = {0: 0, 1: 1, 2: 0, 3: 1}
    steps = {}
    for step in range(8):
        version = None if step < 2 else 5 if step < 6 else 6
        for rank in range(4):
            t = 1.0 + 0.1 * rank
            steps[(rank, step)] = StepRecord(0, 1, t, 10.0 * (rank + 1), version)
    del steps[(3, 4)]  # A lost measurement: that step is left out.
    side = window_stats(steps, pipelines, [5], skip=1)
    assert (side.iterations, side.first_step, side.last_step) == (2, 3, 5)
    assert side.time_s == pytest.approx(1.3)  # The slowest rank.
    assert side.energy_j == pytest.approx(100.0)  # Summed over the GPUs.
    assert side.pipeline_energy_j == {0: pytest.approx(40.0), 1: pytest.approx(60.0)}
    assert window_stats(steps, pipelines, [6]).iterations == 2
    assert window_stats(steps, pipelines, [6], limit=1).last_step == 6
    assert window_stats(steps, pipelines, [7]).iterations == 0


def test_pipeline_all_max_plan_follows_1f1b() -> None:
    from zeus_demo.pipeline import all_max_plan

    plan = all_max_plan(4, 3, 1740)
    assert [len(row) for row in plan] == [6, 6, 6, 6]
    assert [n[0] for n, _ in plan[3]] == list("fbfbfb")
    assert [n[0] for n, _ in plan[0]] == list("fffbbb")
    assert {f for row in plan for _, f in row} == {1740}


def test_the_budget_demo_draws_its_timeline_and_tables_its_figures(tmp_path: Path) -> None:
    """`zeus-demo --budget`'s picture and table from an event's output (the event itself is
    `tests/e2e/test_budget_event.py`'s and the bench's)."""
    timeline = {"cap_w": 900.0, "lift_s": 20.0,
                "power": [(t / 2, 1200.0 if t < 4 else 880.0) for t in range(-20, 60)],
                "throughput": {"a40-bert": [(t / 2, 1.0 if t < 4 or t > 40 else 0.9)
                                            for t in range(-20, 60)]}}
    plot_timeline(timeline, tmp_path / "budget_event.png")
    assert (tmp_path / "budget_event.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = {"jobs": 6, "gpus": 6, "event": {
        "cap_w": 900.0, "draw_before_w": 1200.0, "seconds_to_cap": 1.5,
        "over_cap_joules": 245.0, "draw_capped_w": 880.0, "loss_vs_uniform": 0.55,
        "gap_to_optimal_pct": 0.44, "seconds_to_restore": None}}
    console = Console(record=True, width=120)
    console.print(render_budget_table(out))
    text = console.export_text()
    assert "cap 900 W" in text and "1200 W" in text
    assert "seconds from the signal to under the cap" in text and "1.5 s" in text
    assert "0.55" in text and "<= 0.7" in text
