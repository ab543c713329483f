"""RankMeter (pairing by counters, reordering, gaps) and WindowStack (Zeus 0.16 push/pop)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from zeus_agent.agent.core.meter import (
    Gap,
    GapReason,
    Interval,
    MeterRecord,
    RankMeter,
    WindowStack,
)

# Events: ("sb"|"se", step, epoch, t) / ("eb"|"ee", epoch, t) / ("ib"|"ie", name, index, t)


def drive(events: list[tuple[Any, ...]], window: int = 1) -> list[MeterRecord]:
    m = RankMeter(reorder_window=window)
    ops: dict[str, Callable[..., list[MeterRecord]]] = {
        "sb": m.step_begin,
        "se": m.step_end,
        "eb": m.epoch_begin,
        "ee": m.epoch_end,
        "ib": m.instruction_begin,
        "ie": m.instruction_end,
    }
    out: list[MeterRecord] = []
    for op, *args in events:
        out.extend(ops[op](*args))
    return out


def summary(records: list[MeterRecord]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for r in records:
        if isinstance(r, Interval):
            key = {"step": (r.epoch, r.step), "epoch": (r.epoch,)}.get(
                r.kind, (r.name, r.epoch, r.step, r.index)
            )
            out.append(("I", r.kind, *key, r.t0_ns, r.t1_ns))
        else:
            assert r.message and r.message[0].isupper() and r.message.endswith(".")
            out.append(("G", r.kind, r.reason))
    return out


J, NE, NB, DUP, LATE, NM, EBB = (
    GapReason.COUNTER_JUMP,
    GapReason.NEVER_ENDED,
    GapReason.NO_BEGIN,
    GapReason.DUPLICATE,
    GapReason.LATE,
    GapReason.NAME_MISMATCH,
    GapReason.END_BEFORE_BEGIN,
)

CASES: list[tuple[str, list[tuple[Any, ...]], int, list[tuple[Any, ...]]]] = [
    (
        "in order",
        [
            ("eb", 0, 0),
            ("sb", 0, 0, 1),
            ("se", 0, 0, 5),
            ("sb", 1, 0, 6),
            ("se", 1, 0, 9),
            ("ee", 0, 10),
        ],
        1,
        [("I", "step", 0, 0, 1, 5), ("I", "step", 0, 1, 6, 9), ("I", "epoch", 0, 0, 10)],
    ),
    (
        "end before begin (reordered): the begin closes it",
        [("se", 0, 0, 5), ("sb", 0, 0, 1)],
        0,
        [("I", "step", 0, 0, 1, 5)],
    ),
    (
        "end of the previous step arrives after the next begin, within the window",
        [("sb", 0, 0, 1), ("sb", 1, 0, 6), ("se", 0, 0, 5), ("se", 1, 0, 9)],
        1,
        [("I", "step", 0, 0, 1, 5), ("I", "step", 0, 1, 6, 9)],
    ),
    (
        "begin while one is open, window 0: reported at once; the late end is late",
        [("sb", 0, 0, 1), ("se", 0, 0, 2), ("sb", 1, 0, 3), ("sb", 2, 0, 6), ("se", 1, 0, 5),
         ("se", 2, 0, 9)],
        0,
        [("I", "step", 0, 0, 1, 2), ("G", "step", NE), ("G", "step", LATE),
         ("I", "step", 0, 2, 6, 9)],
    ),
    (
        "window 0, no step end seen yet: the next begin closes the step; its late end is late",
        [("sb", 0, 0, 1), ("sb", 1, 0, 6), ("se", 0, 0, 5), ("se", 1, 0, 9)],
        0,
        [("I", "step", 0, 0, 1, 6), ("G", "step", LATE), ("I", "step", 0, 1, 6, 9)],
    ),
    (
        "Zeus's callbacks: steps delimited by their begins, epochs by their ends; no gap",
        [("sb", 0, 0, 1), ("sb", 1, 0, 5), ("sb", 2, 0, 9), ("ee", 0, 12), ("sb", 3, 1, 14),
         ("sb", 4, 1, 18), ("ee", 1, 20), ("sb", 5, 2, 22), ("sb", 6, 2, 26), ("ee", 2, 30),
         ("ee", 3, 40)],
        1,
        [("I", "step", 0, 0, 1, 5), ("I", "step", 0, 1, 5, 9), ("I", "step", 0, 2, 9, 12),
         ("I", "step", 1, 3, 14, 18), ("I", "step", 1, 4, 18, 20), ("I", "step", 2, 5, 22, 26),
         ("I", "step", 2, 6, 26, 30), ("I", "epoch", 1, 12, 20)],
    ),
    (
        "steps delimited by their begins, step counters restarting per epoch",
        [("sb", 0, 0, 1), ("sb", 1, 0, 5), ("ee", 0, 8), ("sb", 0, 1, 10), ("sb", 1, 1, 14),
         ("sb", 2, 1, 18)],
        1,
        [("I", "step", 0, 0, 1, 5), ("I", "step", 0, 1, 5, 8), ("I", "step", 1, 0, 10, 14)],
    ),
    (
        "steps delimited by their begins: a lost begin is a jump; the step before it is dropped",
        [("sb", 0, 0, 1), ("sb", 1, 0, 5), ("sb", 3, 0, 9), ("sb", 4, 0, 13), ("sb", 5, 0, 17)],
        1,
        [("G", "step", J), ("I", "step", 0, 0, 1, 5), ("I", "step", 0, 3, 9, 13)],
    ),
    (
        "a rank that ends its steps and skipped one end is reported",
        [("sb", 0, 0, 1), ("se", 0, 0, 2), ("sb", 1, 0, 3), ("sb", 2, 0, 5), ("se", 2, 0, 6),
         ("sb", 3, 0, 7)],
        1,
        [("I", "step", 0, 0, 1, 2), ("I", "step", 0, 2, 5, 6), ("G", "step", NE)],
    ),
    (
        "a rank that begins its epochs and lost one begin is reported",
        [("eb", 0, 0), ("ee", 0, 1), ("ee", 1, 2), ("eb", 2, 3), ("ee", 2, 4), ("eb", 3, 5),
         ("ee", 3, 6)],
        1,
        [("I", "epoch", 0, 0, 1), ("I", "epoch", 2, 3, 4), ("G", "epoch", NB),
         ("I", "epoch", 3, 5, 6)],
    ),
    (
        "lost end, window 1: given up when two newer steps were seen",
        [("sb", 0, 0, 1), ("sb", 1, 0, 6), ("se", 1, 0, 9), ("sb", 2, 0, 10)],
        1,
        [("I", "step", 0, 1, 6, 9), ("G", "step", NE)],
    ),
    (
        "end without begin",
        [("se", 0, 0, 5), ("sb", 1, 0, 6), ("se", 1, 0, 9), ("sb", 2, 0, 10)],
        1,
        [("I", "step", 0, 1, 6, 9), ("G", "step", NB)],
    ),
    (
        "counter jump within an epoch",
        [("sb", 0, 0, 1), ("se", 0, 0, 2), ("sb", 3, 0, 3), ("se", 3, 0, 4)],
        1,
        [("I", "step", 0, 0, 1, 2), ("G", "step", J), ("I", "step", 0, 3, 3, 4)],
    ),
    (
        "per-epoch step counters restart without a jump",
        [("sb", 7, 0, 1), ("se", 7, 0, 2), ("sb", 0, 1, 3), ("se", 0, 1, 4)],
        1,
        [("I", "step", 0, 7, 1, 2), ("I", "step", 1, 0, 3, 4)],
    ),
    (
        "duplicate begin and duplicate end",
        [("sb", 0, 0, 1), ("sb", 0, 0, 1), ("se", 0, 0, 2), ("se", 0, 0, 2)],
        1,
        [("G", "step", DUP), ("I", "step", 0, 0, 1, 2), ("G", "step", DUP)],
    ),
    (
        "end time before begin time",
        [("sb", 0, 0, 9), ("se", 0, 0, 2)],
        1,
        [("G", "step", EBB)],
    ),
    (
        "late begin outside the window",
        [("sb", 5, 0, 50), ("sb", 6, 0, 60), ("sb", 1, 0, 10)],
        1,
        [("G", "step", LATE)],
    ),
    (
        "epoch jump",
        [("eb", 0, 0), ("ee", 0, 1), ("eb", 2, 2)],
        1,
        [("I", "epoch", 0, 0, 1), ("G", "epoch", J)],
    ),
    (
        "instructions carry the current step",
        [
            ("sb", 4, 1, 0),
            ("ib", "forward", 0, 1),
            ("ie", "forward", 0, 2),
            ("ib", "backward", 1, 3),
            ("ie", "backward", 1, 4),
            ("se", 4, 1, 5),
        ],
        1,
        [
            ("I", "instruction", "forward", 1, 4, 0, 1, 2),
            ("I", "instruction", "backward", 1, 4, 1, 3, 4),
            ("I", "step", 1, 4, 0, 5),
        ],
    ),
    (
        "instruction before any step",
        [("ib", "forward", 0, 1), ("ie", "forward", 0, 2)],
        1,
        [("I", "instruction", "forward", None, None, 0, 1, 2)],
    ),
    (
        "instruction name mismatch",
        [("sb", 0, 0, 0), ("ib", "forward", 0, 1), ("ie", "backward", 0, 2)],
        1,
        [("G", "instruction", NM)],
    ),
    (
        "instruction index jump; the index restarts per step",
        [
            ("sb", 0, 0, 0),
            ("ib", "f", 0, 1),
            ("ie", "f", 0, 2),
            ("ib", "f", 2, 3),
            ("ie", "f", 2, 4),
            ("se", 0, 0, 5),
            ("sb", 1, 0, 6),
            ("ib", "f", 0, 7),
            ("ie", "f", 0, 8),
        ],
        1,
        [
            ("I", "instruction", "f", 0, 0, 0, 1, 2),
            ("G", "instruction", J),
            ("I", "instruction", "f", 0, 0, 2, 3, 4),
            ("I", "step", 0, 0, 0, 5),
            ("I", "instruction", "f", 0, 1, 0, 7, 8),
        ],
    ),
    (
        "instruction end reordered before its begin",
        [("sb", 0, 0, 0), ("ie", "f", 0, 2), ("ib", "f", 0, 1)],
        1,
        [("I", "instruction", "f", 0, 0, 0, 1, 2)],
    ),
]


@pytest.mark.parametrize(
    ("events", "window", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rank_meter(
    events: list[tuple[Any, ...]], window: int, expected: list[tuple[Any, ...]]
) -> None:
    assert summary(drive(events, window)) == expected


def test_gap_messages_name_counters_and_times() -> None:
    out = drive([("sb", 0, 0, 1), ("sb", 1, 0, 6), ("se", 1, 0, 6), ("sb", 2, 0, 7)], window=1)
    gaps = [r for r in out if isinstance(r, Gap)]
    assert len(gaps) == 1
    assert gaps[0].message == (
        "Step 0 of epoch 0 began at t=1 ns but its end never arrived (newer ones began); "
        "not measured."
    )
    assert gaps[0].t_ns == 7
    jump = drive([("sb", 0, 0, 1), ("sb", 4, 0, 2)])[0]
    assert isinstance(jump, Gap)
    assert jump.message == "Step counter jumped from 0 to 4 in epoch 0: 3 step(s) missing."


def test_interval_duration_and_current_step() -> None:
    m = RankMeter()
    assert m.current_step is None
    m.step_begin(2, 1, 1_000)
    assert m.current_step == (1, 2)
    (iv,) = m.step_end(2, 1, 1_500_001_000)
    assert isinstance(iv, Interval)
    assert iv.duration_s == pytest.approx(1.5)


@pytest.mark.parametrize("window", [-1, True, 1.5])
def test_reorder_window_validation(window: object) -> None:
    with pytest.raises(ValueError, match="reorder_window"):
        RankMeter(reorder_window=window)  # type: ignore[arg-type]


def test_pending_state_stays_bounded() -> None:
    m = RankMeter(reorder_window=2)
    for s in range(1000):  # every end lost
        m.step_begin(s, 0, s)
    assert len(m._steps.open) <= 3
    assert len(m._steps.retired) <= 256
    assert len(m._step_begins) <= 256
    for e in range(1000):  # epochs delimited by their ends
        m.epoch_end(e, 1000 + e)
    assert len(m._epochs.early) <= 3
    assert len(m._epoch_ends) <= 256


def test_learning_that_a_rank_ends_its_steps() -> None:
    m = RankMeter()
    assert m.steps_end_at_next_begin
    m.step_begin(0, 0, 1)
    assert m.steps_end_at_next_begin
    m.step_end(0, 0, 2)
    assert not m.steps_end_at_next_begin


# ---------------------------------------------------------------------------- WindowStack


def test_window_stack_nested() -> None:
    ws = WindowStack()
    ws.push(None, 10)
    ws.push("inner", 20)
    assert len(ws) == 2 and ws.names() == [None, "inner"] and ws.peek() == ("inner", 20)
    assert ws.pop("inner", 30) == (20, 30)
    assert ws.pop(None, 40) == (10, 40)
    assert len(ws) == 0 and ws.peek() is None


def test_window_stack_pop_none_closes_a_named_window() -> None:
    ws = WindowStack()
    ws.push("a", 1)
    assert ws.pop(None, 2) == (1, 2)


def test_window_stack_empty_pop_uses_seed_text() -> None:
    with pytest.raises(RuntimeError) as info:
        WindowStack().pop(None, 1)
    assert str(info.value) == "No profiling window active. Consider calling `push_window` first."


@pytest.mark.parametrize(
    ("pushed", "pop_name", "t", "fragment"),
    [
        (
            [("outer", 1), ("inner", 2)],
            "outer",
            5,
            "Cannot pop profiling window 'outer': the innermost open window is 'inner'",
        ),
        ([(None, 1)], "named", 5, "innermost open window is None"),
        ([("a", 10)], "a", 5, "cannot close at t=5 ns, before it opened at t=10 ns"),
    ],
)
def test_window_stack_bad_pop_leaves_stack_unchanged(
    pushed: list[tuple[str | None, int]], pop_name: str, t: int, fragment: str
) -> None:
    ws = WindowStack()
    for name, t0 in pushed:
        ws.push(name, t0)
    with pytest.raises(ValueError) as info:
        ws.pop(pop_name, t)
    assert fragment in str(info.value)
    assert ws.names() == [n for n, _ in pushed]


def test_window_stack_clear() -> None:
    ws = WindowStack()
    ws.push("a", 1)
    ws.clear()
    assert len(ws) == 0
