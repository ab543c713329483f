"""ScheduleCursor: Zeus 0.16's semantics (fewer / more frequencies, name mismatch), validation."""

from __future__ import annotations

import pytest

from zeus_agent.agent.core.schedule import ScheduleCursor, ScheduleStep

SCHEDULE = [("forward", 1410), ("forward", 1200), ("backward", 1005)]


def cursor(freqs: list[tuple[str, int]] = SCHEDULE, rank: int = 3) -> ScheduleCursor:
    c = ScheduleCursor()
    c.install(rank, freqs)
    return c


def test_happy_iterations() -> None:
    c = cursor()
    for iteration in range(3):
        steps = [c.on_instruction_begin(n) for n in ("forward", "forward", "backward")]
        assert steps == [
            ScheduleStep(0, iteration, "forward", "forward", 1410, None),
            ScheduleStep(1, iteration, "forward", "forward", 1200, None),
            ScheduleStep(2, iteration, "backward", "backward", 1005, None),
        ]
        assert all(s.ok for s in steps)
        assert c.on_step_end() is None
    assert c.iteration == 3


# Table: instructions the trainer begins in one iteration -> (per-step (freq, error fragment),
# step_end error fragment or None).
CASES = [
    (
        ["forward", "forward", "backward", "backward"],
        [(1410, None), (1200, None), (1005, None), (None, "fewer frequencies than expected")],
        None,
    ),
    (
        ["forward"],
        [(1410, None)],
        "more frequencies than expected. Next expected instruction and frequency is "
        "('forward', 1200)",
    ),
    (
        ["forward", "backward", "backward"],
        # Mismatch: the pair is consumed and its frequency still returned.
        [(1410, None), (1200, "is 'forward' (index 1 of iteration 0"), (1005, None)],
        None,
    ),
    ([], [], "Next expected instruction and frequency is ('forward', 1410)"),
]


@pytest.mark.parametrize(("names", "expected", "end_error"), CASES)
def test_one_iteration(
    names: list[str], expected: list[tuple[int | None, str | None]], end_error: str | None
) -> None:
    c = cursor()
    for i, (name, (freq, fragment)) in enumerate(zip(names, expected, strict=True)):
        step = c.on_instruction_begin(name)
        assert step.index == i
        assert step.name == name
        assert step.frequency_mhz == freq
        if fragment is None:
            assert step.error is None
        else:
            assert step.error is not None and fragment in step.error
            assert "rank 3" in step.error
    err = c.on_step_end()
    if end_error is None:
        assert err is None
    else:
        assert err is not None and end_error in err
    # Either way the cursor rewinds for the next iteration.
    assert c.position == 0
    assert c.on_instruction_begin("forward") == ScheduleStep(0, 1, "forward", "forward", 1410)


def test_mismatch_names_expected_and_got() -> None:
    step = cursor().on_instruction_begin("backward")
    assert step.expected_name == "forward"
    assert step.error is not None
    assert "'forward'" in step.error and "got 'backward'" in step.error and "1410 MHz" in step.error


def test_exhausted_keeps_counting_index() -> None:
    c = cursor([("forward", 1000)])
    c.on_instruction_begin("forward")
    a = c.on_instruction_begin("forward")
    b = c.on_instruction_begin("backward")
    assert (a.index, b.index) == (1, 2)
    assert a.expected_name is None and a.frequency_mhz is None
    assert b.error is not None and "fewer frequencies than expected" in b.error


def test_no_schedule_installed() -> None:
    c = ScheduleCursor()
    assert not c.installed and c.rank is None and c.frequencies == ()
    step = c.on_instruction_begin("forward")
    assert step.frequency_mhz is None
    assert step.error is not None and "No frequency schedule installed" in step.error
    assert c.on_step_end() is None


def test_install_rewinds_and_clear_removes() -> None:
    c = cursor()
    c.on_instruction_begin("forward")
    c.on_step_end()
    c.on_instruction_begin("forward")
    c.install(5, [("backward", 900)])
    assert c.installed and c.rank == 5 and c.position == 0 and c.iteration == 0
    assert c.frequencies == (("backward", 900),)
    assert c.on_instruction_begin("backward").frequency_mhz == 900
    c.clear()
    assert not c.installed and c.position == 0
    assert c.on_instruction_begin("backward").frequency_mhz is None


@pytest.mark.parametrize(
    ("rank", "freqs", "supported", "fragment"),
    [
        (-1, SCHEDULE, None, "rank must be an integer >= 0"),
        (0, [], None, "is empty"),
        (0, [("forward", 1410), ("", 1200)], None, "instruction 1 has an empty"),
        (0, [("forward", 0)], None, "instruction 0 ('forward') has frequency 0"),
        (0, [("forward", 1410.0)], None, "must be a positive integer"),
        (0, [("forward", True)], None, "must be a positive integer"),
        (0, [("forward",)], None, "instruction 0 must be an (instruction, frequency_mhz) pair"),
        (0, ["forward"], None, "must be an (instruction, frequency_mhz) pair"),
        (
            0,
            [("forward", 1410), ("backward", 1111)],
            {1410, 1200},
            "instruction 1 ('backward') asks for 1111 MHz, which this GPU does not support "
            "(supported: 1410, 1200 MHz)",
        ),
    ],
)
def test_install_validation(
    rank: int, freqs: list, supported: set[int] | None, fragment: str
) -> None:
    c = cursor()
    with pytest.raises(ValueError) as info:
        c.install(rank, freqs, supported)
    assert fragment in str(info.value)
    # The previous schedule stays installed.
    assert c.rank == 3 and c.frequencies == tuple(SCHEDULE)


def test_install_accepts_lists_from_the_wire_and_supported_clocks() -> None:
    c = ScheduleCursor()
    c.install(0, [["forward", 1410], ["backward", 1200]], supported_clocks_mhz=[1410, 1200])  # type: ignore[list-item]
    assert c.frequencies == (("forward", 1410), ("backward", 1200))
