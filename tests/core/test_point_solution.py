"""load_plan (safe parsing: JSON or literals only), PointSolution and PointSolution3D."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.pipeline.schedulers import SchedulerError, plan_file, point_solution
from coordinator.pipeline.schedulers.plan_file import load_plan
from coordinator.pipeline.schedulers.point_solution import PointSolution, PointSolution3D
from zeus_agent.models import JobInfo, ProfilingResult, RankInfo

FREQS = [1410, 1395, 1380, 1200, 1005]


def write(tmp_path: Path, text: str | bytes, name: str = "plan.py") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# --- load_plan: accepted formats ------------------------------------------------------------


def test_json_plan(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps([[["forward", 1410], ["backward", 1395]], [["forward", 1200]]]),
        "plan.json",
    )
    assert load_plan(path) == [[("forward", 1410), ("backward", 1395)], [("forward", 1200)]]


def test_python_literal_with_tuples(tmp_path: Path) -> None:
    path = write(tmp_path, '[[("forward", 1410), ("backward", 1395)], (("forward", 1200),)]')
    assert load_plan(str(path)) == [[("forward", 1410), ("backward", 1395)], [("forward", 1200)]]


def test_lowtime_style_file(tmp_path: Path) -> None:
    # What lowtime's script writes to freqs_pipeline_%05d.py: the repr of a list of per-stage
    # lists of (instruction, MHz) tuples in execution order; here over several lines, with a
    # comment and a trailing newline.
    stages = [
        [
            ("forward", 1410),
            ("forward", 1395),
            ("forward", 1380),
            ("backward", 1410),
            ("backward", 1410),
            ("backward", 1395),
        ],
        [("forward", 1200), ("backward", 1005), ("forward", 1200), ("backward", 1005)],
    ]
    text = "# lowtime schedule 00042\n" + repr(stages).replace("], [", "],\n [") + "\n"
    assert load_plan(write(tmp_path, text, "freqs_pipeline_00042.py")) == stages


def test_whole_floats_and_numeric_strings_are_clocks(tmp_path: Path) -> None:
    # pandas writes clocks as floats; Zeus's pydantic model reads 1410.0 and "1410" as 1410.
    plan = [[["forward", 1410.0], ["backward", "1410"], ["forward", " 1200 "],
             ["backward", "1.2e3"], ["forward", 1395]]]
    got = load_plan(write(tmp_path, json.dumps(plan), "plan.json"))
    assert got == [[("forward", 1410), ("backward", 1410), ("forward", 1200),
                    ("backward", 1200), ("forward", 1395)]]
    assert all(type(freq) is int for _, freq in got[0])
    # The same in a Python literal; a fraction of a MHz is kept until fitted to a GPU.
    assert load_plan(write(tmp_path, "[[('forward', 1410.0), ('backward', 1200.5)]]")) == [
        [("forward", 1410), ("backward", 1200.5)]]


@pytest.mark.parametrize(
    ("clock", "offered", "expected"),
    [
        (1400, [1200, 1410], 1410),  # Planned on another GPU model.
        (1210, [1200, 1410], 1200),
        (1305, [1200, 1410], 1410),  # A tie goes to the higher clock.
        (1304.9, [1200, 1410], 1200),
        (1305.0, [1200, 1410], 1410),
        (5000, [1200, 1410], 1410),  # Beyond the range: the nearest end.
        (1, [1200, 1410], 1200),
        (1410, [1200, 1410], 1410),
        (1200, [1200], 1200),
        (1410.4, [], 1410),  # The GPU lists no clocks: whole MHz, rounded half up.
        (1410.5, [], 1411),
        (0.2, [], 1),
        (1395, [], 1395),
    ],
)
def test_nearest_clock(clock: float, offered: list[int], expected: int) -> None:
    assert point_solution.nearest_clock(clock, offered) == expected


def test_utf8_bom_and_signed_positive_number(tmp_path: Path) -> None:
    path = write(tmp_path, '\ufeff[[("forward", +1410)]]'.encode())
    assert load_plan(path) == [[("forward", 1410)]]


# --- load_plan: code is refused, never run --------------------------------------------------


CODE = [
    ("__import__('os').system('x')", "a function call `__import__('os').system('x')`"),
    ("[x for x in ()]", "a list comprehension"),
    ("[[('forward', freq)]]", "a name `freq`"),
    ("[[(f'forward', 1410), (f'{1}', 1)]]", "an f-string"),
    ("().__class__.__bases__", "an attribute access"),
    ("(lambda: [[('forward', 1)]])()", "a function call"),
    ("[[('forward', 1400 + 10)]]", "an operator expression `1400 + 10`"),
    ("[[('forward', 1410)]][0:1]", "a subscript"),
    ("[[('forward', (y := 1))]]", "an assignment expression"),
    ("[*range(3)]", "an unpacking"),
    ("[[('forward', 1 if True else 2)]]", "a conditional expression"),
    ("[[('forward', 1 < 2)]]", "a comparison"),
    ("[[('forward', 1 or 2)]]", "a boolean expression"),
    ("[{k: 1 for k in 'ab'}]", "a dict comprehension"),
    ("[(i for i in ())]", "a generator expression"),
    ("[[('forward', -x)]]", "a UnaryOp expression"),
    ("[[('forward', not 1)]]", "a UnaryOp expression"),
    ("import os", "an import statement at line 1"),
    ("from os import system", "an import statement at line 1"),
    ("plan = [[('forward', 1)]]", "an assignment at line 1"),
    ("def f():\n    pass", "a function definition at line 1"),
    ("[[('forward', 1)]]\nimport os", "an import statement at line 2"),
    ("[[('forward', 1)]]\nprint(1)", "a function call `print(1)` at line 2"),
]


@pytest.mark.parametrize(("text", "found"), CODE)
def test_code_is_refused(tmp_path: Path, text: str, found: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SchedulerError) as info:
        load_plan(path)
    message = str(info.value)
    assert str(path) in message
    assert "holds code, not a literal plan" in message
    assert found in message


def test_code_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    text = f"[[('forward', __import__('pathlib').Path({str(marker)!r}).touch() or 1410)]]"
    with pytest.raises(SchedulerError, match="holds code"):
        load_plan(write(tmp_path, text))
    assert not marker.exists()


CODE_ATOMS = [
    "x",
    "f()",
    "os.system",
    "a[0]",
    "[i for i in ()]",
    "{i for i in ()}",
    "(i for i in ())",
    "lambda: 0",
    "f'{x}'",
    "1 + 1",
    "2 ** 8",
    "x if y else z",
    "1 < 2",
    "a and b",
    "(n := 1)",
    "-x",
    "not 0",
    "~1",
    "__import__('os')",
    "open('f').read()",
    "globals()",
    "...[0]",
]


@st.composite
def literal_plans(draw: st.DrawFn) -> list[list[tuple[str, int]]]:
    names = st.text(alphabet=string.printable + "éß→", min_size=1, max_size=20)
    entry = st.tuples(names, st.integers(1, plan_file.MAX_FREQUENCY_MHZ))
    return draw(st.lists(st.lists(entry, min_size=1, max_size=8), min_size=1, max_size=6))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plan=literal_plans(), as_json=st.booleans())
def test_any_literal_plan_round_trips(
    tmp_path: Path, plan: list[list[tuple[str, int]]], as_json: bool
) -> None:
    text = json.dumps(plan) if as_json else repr(plan)
    assert load_plan(write(tmp_path, text)) == plan


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plan=literal_plans(), atom=st.sampled_from(CODE_ATOMS), data=st.data())
def test_any_non_literal_expression_is_refused(
    tmp_path: Path, plan: list[list[tuple[str, int]]], atom: str, data: st.DataObject
) -> None:
    # Put the code where a name, a frequency, an entry or a row would be.
    row = data.draw(st.integers(0, len(plan) - 1))
    col = data.draw(st.integers(0, len(plan[row]) - 1))
    where = data.draw(st.sampled_from(["name", "freq", "entry", "row"]))
    rows: list[Any] = [[repr(e) for e in r] for r in plan]
    name, freq = plan[row][col]
    if where == "name":
        rows[row][col] = f"({atom}, {freq})"
    elif where == "freq":
        rows[row][col] = f"({name!r}, {atom})"
    elif where == "entry":
        rows[row][col] = atom
    else:
        rows[row] = None
    text = "[" + ", ".join(atom if r is None else "[" + ", ".join(r) + "]" for r in rows) + "]"
    with pytest.raises(SchedulerError, match="holds code, not a literal plan"):
        load_plan(write(tmp_path, text))


# --- load_plan: wrong shapes and unreadable files -------------------------------------------


SHAPES = [
    ("[]", "empty list: no rows"),
    ("[[]]", "row 0 is empty"),
    ("{'forward': 1410}", "must hold a list of rows"),
    ('"forward"', "must hold a list of rows"),
    ("[('forward', 1410)]", "row 0, entry 0: must be an (instruction, MHz) pair, got str"),
    ("[[('forward', 1410)], 5]", "row 1: must be a list of (instruction, MHz) pairs, got int"),
    ("[[('forward', 1410, 3)]]", "must be an (instruction, MHz) pair"),
    ("[[('forward',)]]", "must be an (instruction, MHz) pair"),
    ("[[(1410, 'forward')]]", "instruction name must be a non-empty string, got int 1410"),
    ("[[('', 1410)]]", "instruction name must be a non-empty string"),
    ("[[(b'forward', 1410)]]", "non-empty string, got bytes"),
    ("[[('forward', 0)]]", "positive number of MHz"),
    ("[[('forward', -1410)]]", "positive number of MHz (at most 2147483647), got -1410"),
    ("[[('forward', 2147483648)]]", "got 2147483648"),
    ("[[('forward', True)]]", "the frequency must be a number of MHz, got bool True"),
    ('[[["forward", true]]]', "the frequency must be a number of MHz, got bool True"),  # JSON
    ("[[('forward', None)]]", "got NoneType"),
    ("[[('forward', 1410)], [('backward', 'fast')]]",
     "row 1, entry 0 ('backward'): the frequency must be a number of MHz, got str 'fast'"),
    ("[[('forward', '1410 MHz')]]", "must be a number of MHz, got str '1410 MHz'"),
    ("[[('forward', [1410])]]", "must be a number of MHz, got list [1410]"),
    ('[[["forward", NaN]]]', "must be a number of MHz, got float nan"),  # JSON as Python writes
    ("[[('forward', 1e400)]]", "must be a number of MHz, got float inf"),
    ("[[('forward', 'inf')]]", "must be a number of MHz, got str 'inf'"),
    ("[[('forward', 0.0)]]", "positive number of MHz (at most 2147483647), got 0"),
    ("[[('forward', -0.5)]]", "positive number of MHz (at most 2147483647), got -0.5"),
    ("[[('forward', '-1410')]]", "positive number of MHz (at most 2147483647), got str '-1410'"),
    ("[[('forward', 1410)]]\n[[('forward', 1410)]]", "holds 2 expressions"),
    ("[[('forward', 1410)]", "neither JSON nor a Python literal (line 1"),
    ("[{[1]}]", "not a valid literal"),
    ("# nothing\n", "holds no plan"),
    ("  \n\n", "is empty"),
    ("[[('" + "f" * 256 + "', 1410)]]", "longer than 255 characters"),
]


@pytest.mark.parametrize(("text", "error"), SHAPES)
def test_wrong_shapes(tmp_path: Path, text: str, error: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SchedulerError) as info:
        load_plan(path)
    assert error in str(info.value)
    assert str(path) in str(info.value)


def test_deep_nesting_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SchedulerError, match="neither JSON nor a Python literal"):
        load_plan(write(tmp_path, "[" * 100_000 + "]" * 100_000))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SchedulerError, match=r"plan file .*nope\.py does not exist"):
        load_plan(tmp_path / "nope.py")


def test_directory_is_not_a_plan(tmp_path: Path) -> None:
    with pytest.raises(SchedulerError, match="is not a regular file"):
        load_plan(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(SchedulerError, match="is not UTF-8 text"):
        load_plan(write(tmp_path, b"[[('forward', 1410)]] \xff"))


def test_oversize_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = repr([[("forward", 1410)] * 100])
    monkeypatch.setattr(plan_file, "MAX_PLAN_BYTES", 1024 * 1024)
    path = write(tmp_path, text + " " * (1024 * 1024))
    with pytest.raises(SchedulerError, match="is larger than 1 MiB"):
        load_plan(path)
    assert load_plan(write(tmp_path, text, "small.py")) == [[("forward", 1410)] * 100]
    assert plan_file.MAX_PLAN_BYTES == 1024 * 1024
    monkeypatch.undo()
    assert plan_file.MAX_PLAN_BYTES == 64 * 1024 * 1024


# --- PointSolution --------------------------------------------------------------------------


def job(pp: int = 1, dp: int = 1, tp: int = 1) -> JobInfo:
    return JobInfo(pp_degree=pp, dp_degree=dp, tp_degree=tp, world_size=pp * dp * tp)


def rank(
    r: int,
    pp: int = 0,
    dp: int = 0,
    tp: int = 0,
    freqs: list[int] | None = None,
    instructions: list[str] | None = None,
) -> RankInfo:
    return RankInfo(
        rank=r,
        dp_rank=dp,
        pp_rank=pp,
        tp_rank=tp,
        available_frequencies=FREQS if freqs is None else freqs,
        instructions=instructions,
    )


STAGE0 = [("forward", 1410), ("forward", 1395), ("backward", 1410), ("backward", 1380)]
STAGE1 = [("forward", 1200), ("backward", 1005), ("forward", 1200), ("backward", 1005)]
ORDER0 = ["forward", "forward", "backward", "backward"]
ORDER1 = ["forward", "backward", "forward", "backward"]


@pytest.fixture
def plan_path(tmp_path: Path) -> str:
    return str(write(tmp_path, repr([STAGE0, STAGE1]), "freqs_pipeline_00000.py"))


def outcome(r: int) -> ProfilingResult:
    return ProfilingResult(rank=r, iter_time=[1.0], iter_energy=[100.0])


def test_point_solution_end_to_end(plan_path: str) -> None:
    infos = [rank(1, pp=1, instructions=ORDER1), rank(0, pp=0, instructions=ORDER0)]
    sched = PointSolution(job(pp=2), infos, None, solution_path=plan_path)
    first = sched.next_schedule()
    assert [(s.rank, s.frequencies) for s in first] == [(0, STAGE0), (1, STAGE1)]
    sched.observe([outcome(0), outcome(1)])
    assert sched.finished  # Yielded once ...
    for _ in range(3):  # ... and served from then on.
        assert sched.next_schedule() is first
        sched.observe([outcome(0), outcome(1)])


def test_point_solution_without_known_frequencies_or_order(plan_path: str) -> None:
    infos = [rank(0, freqs=[]), rank(1, pp=1, freqs=[])]
    sched = PointSolution(job(pp=2), infos, None, plan_path)  # Positional, as in Zeus.
    assert [s.frequencies for s in sched.next_schedule()] == [STAGE0, STAGE1]


def test_point_solution_errors_at_construction(tmp_path: Path) -> None:
    with pytest.raises(SchedulerError, match="does not exist"):
        PointSolution(job(), [rank(0)], None, solution_path=str(tmp_path / "missing.py"))
    with pytest.raises(SchedulerError, match="holds code"):
        PointSolution(job(), [rank(0)], None, str(write(tmp_path, "__import__('os')")))


def test_point_solution_row_count_must_match_world_size(plan_path: str) -> None:
    infos = [rank(r, pp=r) for r in range(3)]
    with pytest.raises(SchedulerError) as info:
        PointSolution(job(pp=3), infos, None, plan_path)
    assert str(info.value) == (
        f"PointSolution: plan file {plan_path} has 2 rows but 3 are needed, one per rank "
        "(world size)"
    )


def test_point_solution_needs_ranks_zero_to_n(plan_path: str) -> None:
    with pytest.raises(SchedulerError, match=r"numbered 0 to 1, got \[0, 5\]"):
        PointSolution(job(pp=2), [rank(0), rank(5, pp=1)], None, plan_path)


def test_point_solution_runs_the_nearest_offered_clock_a_tie_going_higher(
    plan_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 1's GPU lacks 1200 MHz: 1005 and 1395 are both 195 MHz away, the higher one runs.
    infos = [rank(0), rank(1, pp=1, freqs=[1410, 1395, 1005])]
    sched = PointSolution(job(pp=2), infos, None, plan_path)
    assert [s.frequencies for s in sched.next_schedule()] == [
        STAGE0, [("forward", 1395), ("backward", 1005), ("forward", 1395), ("backward", 1005)]]
    assert sched.substitutions == [(1, 1, 1200, 1395, 2)]
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        f"PointSolution (job ?): plan file {plan_path} asks for clocks the GPUs do not offer; "
        "running the nearest offered (a tie goes to the higher clock; rounded where a GPU "
        "lists none): rank 1: 1200 -> 1395 MHz (2 entries)")


@pytest.mark.parametrize(
    ("order", "fragment"),
    [
        (
            ["forward", "backward", "backward", "backward"],
            "entry 1 plans 'forward' where the rank runs 'backward'",
        ),
        (ORDER0 + ["forward"], "entry 4 plans 'nothing' where the rank runs 'forward'"),
        (ORDER0[:3], "entry 3 plans 'backward' where the rank runs 'nothing'"),
    ],
)
def test_point_solution_instruction_order_must_match(
    plan_path: str, order: list[str], fragment: str
) -> None:
    infos = [rank(0, instructions=order), rank(1, pp=1, instructions=ORDER1)]
    with pytest.raises(SchedulerError) as info:
        PointSolution(job(pp=2), infos, None, plan_path)
    assert "row 0 for rank 0: the instructions do not match" in str(info.value)
    assert fragment in str(info.value)


# --- PointSolution3D ------------------------------------------------------------------------


def grid(pp: int, dp: int, tp: int, **kw: Any) -> list[RankInfo]:
    infos, r = [], 0
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                infos.append(rank(r, pp=p, dp=d, tp=t, **kw))
                r += 1
    return infos


def test_point_solution_3d_end_to_end(plan_path: str) -> None:
    infos = grid(pp=2, dp=2, tp=2)
    for info in infos:
        info.instructions = ORDER0 if info.pp_rank == 0 else ORDER1
    sched = PointSolution3D(job(pp=2, dp=2, tp=2), infos, None, solution_path=plan_path)
    schedules = sched.next_schedule()
    assert [s.rank for s in schedules] == list(range(8))
    for info, s in zip(infos, schedules, strict=True):
        assert s.frequencies == (STAGE0 if info.pp_rank == 0 else STAGE1)
    sched.observe([outcome(r) for r in range(8)])
    assert sched.finished
    assert [s.frequencies for s in sched.next_schedule()] == [s.frequencies for s in schedules]


def test_point_solution_3d_needs_one_row_per_stage(tmp_path: Path, plan_path: str) -> None:
    with pytest.raises(SchedulerError) as info:
        PointSolution3D(job(pp=3, dp=2), grid(pp=3, dp=2, tp=1), None, solution_path=plan_path)
    assert "has 2 rows but 3 are needed, one per pipeline stage (pp_degree)" in str(info.value)
    assert str(info.value).startswith("PointSolution3D: ")
    # A per-rank plan (one row per rank) is refused by the 3D scheduler.
    per_rank = str(write(tmp_path, repr([STAGE0] * 4), "per_rank.py"))
    with pytest.raises(SchedulerError, match="has 4 rows but 2 are needed"):
        PointSolution3D(job(pp=2, dp=2), grid(pp=2, dp=2, tp=1), None, solution_path=per_rank)


def test_point_solution_3d_fits_every_rank_of_a_stage_to_its_own_gpu(
    plan_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    infos = grid(pp=2, dp=2, tp=1)
    # Rank 3 (dp 1, stage 1) has a GPU without 1005 MHz; the stage's dp0 rank (1) has it.
    infos[3] = rank(3, pp=1, dp=1, freqs=[1410, 1200])
    sched = PointSolution3D(job(pp=2, dp=2), infos, None, solution_path=plan_path)
    got = {s.rank: s.frequencies for s in sched.next_schedule()}
    assert got[0] == got[2] == STAGE0
    assert got[1] == STAGE1
    assert got[3] == [("forward", 1200), ("backward", 1200), ("forward", 1200),
                      ("backward", 1200)]
    sched.observe([outcome(r) for r in range(4)])
    assert {s.rank: s.frequencies for s in sched.next_schedule()} == got  # Served as fitted.
    (record,) = caplog.records
    assert record.getMessage().endswith("stage 1 (rank 3): 1005 -> 1200 MHz (2 entries)")
    assert record.getMessage().startswith("PointSolution3D (job ?): plan file ")


def test_point_solution_fits_a_plan_from_another_gpu_model_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A plan made on a GPU offering 1400/1300 MHz, as pandas writes it, run on 1410/1200.
    rows = [[["forward", 1400.0], ["backward", "1300"], ["forward", 1400], ["backward", 1410]],
            [["forward", 1305.5], ["backward", 1200]]]
    path = str(write(tmp_path, json.dumps(rows), "plan.json"))
    infos = [rank(0, freqs=[1410, 1200]), rank(1, pp=1, freqs=[1410, 1200])]
    info = job(pp=2)
    info.set_job_id("PointSolution")
    sched = PointSolution(info, infos, None, path)
    assert [s.frequencies for s in sched.next_schedule()] == [
        [("forward", 1410), ("backward", 1200), ("forward", 1410), ("backward", 1410)],
        [("forward", 1410), ("backward", 1200)],
    ]
    (record,) = caplog.records  # One warning for the plan, naming every substitution.
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        f"PointSolution (job {info.job_id}): plan file {path} asks for clocks the GPUs do not "
        "offer; running the nearest offered (a tie goes to the higher clock; rounded where a "
        "GPU lists none): rank 0: 1300 -> 1200 MHz (1 entry); rank 0: 1400 -> 1410 MHz "
        "(2 entries); rank 1: 1305.5 -> 1410 MHz (1 entry)")


def test_point_solution_3d_groups_a_stage_substitution_over_its_ranks(
    plan_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    infos = grid(pp=2, dp=2, tp=1, freqs=[1410, 1200, 1005])  # No 1395, no 1380.
    sched = PointSolution3D(job(pp=2, dp=2), infos, None, solution_path=plan_path)
    assert sched.next_schedule()[0].frequencies == [
        ("forward", 1410), ("forward", 1410), ("backward", 1410), ("backward", 1410)]
    (record,) = caplog.records
    assert record.getMessage().endswith(
        "stage 0 (ranks 0, 2): 1380 -> 1410 MHz (1 entry); "
        "stage 0 (ranks 0, 2): 1395 -> 1410 MHz (1 entry)")


def test_point_solution_offered_clocks_log_nothing(
    plan_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    sched = PointSolution(job(pp=2), [rank(0), rank(1, pp=1)], None, plan_path)
    assert [s.frequencies for s in sched.next_schedule()] == [STAGE0, STAGE1]
    assert sched.substitutions == []
    assert caplog.records == []
