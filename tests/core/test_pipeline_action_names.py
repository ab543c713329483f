"""The `kind:stage:microbatch` instruction names both sides of a pipeline job share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeus_agent.pipeline_order import KINDS, Action, format_action, parse_action

pytestmark = pytest.mark.core


@given(st.sampled_from(KINDS), st.integers(0, 999_999), st.integers(0, 999_999))
def test_a_formatted_action_parses_back(kind: str, stage: int, microbatch: int) -> None:
    assert parse_action(format_action(kind, stage, microbatch)) == Action(kind, stage, microbatch)


def test_bare_names_keep_zeus_meaning() -> None:
    assert parse_action("forward") is None and parse_action("backward") is None


@pytest.mark.parametrize("name, says", [
    ("x:1:2", "unknown kind 'x'"),
    ("forward:1", "expected kind:stage:microbatch"),
    ("forward:1:2:3", "expected kind:stage:microbatch"),
    ("forward:a:1", "stage 'a' is not an index"),
    ("forward:1:-1", "microbatch '-1' is not an index"),
    ("forward:1:\u0661", "is not an index"),
    ("forward:1:1000000", "out of range"),
])
def test_malformed_names_are_named(name: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        parse_action(name)


@pytest.mark.parametrize("args", [("fwd", 0, 0), ("forward", -1, 0), ("forward", 0, True),
                                  ("forward", 0, 10**6)])
def test_format_refuses_what_parse_would(args: tuple) -> None:
    with pytest.raises(ValueError):
        format_action(*args)
