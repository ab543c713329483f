"""`zeus-coordinator plan --schedule`: the named schedule's frontier and plans, or a clear no."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from coordinator.plan_cli import main

pytestmark = pytest.mark.core


def write_profile(path: Path, kinds: tuple[str, ...] = ("forward", "backward")) -> Path:
    lines = ["stage,instruction,frequency,time,energy"]
    for stage in range(2):
        for kind in kinds:
            for f in (1500, 1200, 900):
                t = (0.02 if kind == "forward" else 0.03) * (1 + 0.2 * stage) * 1500 / f
                lines.append(f"{stage},{kind},{f},{t},{(100 + 0.1 * f) * t}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_interleaved_plan_names_each_action(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    profile = write_profile(tmp_path / "p.csv")
    out = tmp_path / "out"
    assert main([str(profile), "--microbatches", "4", "--schedule", "interleaved-1f1b",
                 "--out", str(out)]) == 0
    plan = ast.literal_eval((out / "freqs_pipeline_00000.py").read_text())
    assert [name for name, _ in plan[1]][:3] == ["forward:1:0", "forward:1:1", "forward:3:0"]
    assert len(plan[0]) == 2 * 2 * 4  # Two virtual stages, a forward and a backward each.
    assert (out / "frontier.csv").read_text().startswith("index,time,energy\n")


def test_the_default_is_1f1b_with_bare_names(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([str(write_profile(tmp_path / "p.csv")), "--microbatches", "3",
                 "--out", str(out)]) == 0
    plan = ast.literal_eval((out / "freqs_pipeline_00000.py").read_text())
    assert [name for name, _ in plan[0]] == ["forward", "forward", "backward", "forward",
                                             "backward", "backward"]


@pytest.mark.parametrize(("args", "says"), [
    (["--schedule", "zero-bubble"], "no backward_input rows for stage 0"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], "1f1b runs one stage per rank"),
    (["--schedule", "interleaved-1f1b", "--microbatches", "5"], "multiple of their rounds"),
])
def test_a_schedule_that_cannot_be_planned_is_a_clear_no(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    argv = [str(write_profile(tmp_path / "p.csv")), "--out", str(tmp_path / "out"), *args]
    if "--microbatches" not in args:
        argv += ["--microbatches", "4"]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
