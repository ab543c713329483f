"""`TrainerEventColumns`: a rank's trainer events in columns, decoded beside the rows.

Any valid `TrainerEventBatch` round-trips through columns (encoded, decoded by
`decode_events`) to the same batch; the rows still decode as rows. Rows and columns refuse and
accept alike: one hostile value in one field of one event, packed as a peer would in either
layout, gets the same verdict, and what is accepted reads back as the same events. Columns'
own faults (lengths that differ, a name index past `names`, a kind past `EVENT_KINDS`) are
refused naming the field.
"""

from __future__ import annotations

import math
from typing import Any, get_args

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec
from zeus_agent.wire.event_columns import (
    EVENT_KINDS,
    TrainerEventColumns,
    decode_events,
    event_rows,
)
from zeus_agent.wire.messages import (
    MAX_COUNTER,
    MAX_NAME_CHARS,
    MAX_NS,
    TrainerEvent,
    TrainerEventBatch,
    join_token_digest,
)

DIGEST = join_token_digest("a-join-token-of-the-job")
FIELDS = ("t_ns", "epoch", "step", "index", "power_limit_w")
HOSTILE_VALUES: list[Any] = [
    math.nan, math.inf, -math.inf, -1, -0.0, 0, 1, 0.5, 1.0, True, False, None, "1", "x", b"1",
    [], {}, 2**63, 2**64 - 1, -(2**63), MAX_COUNTER, MAX_COUNTER + 1, MAX_NS, MAX_NS + 1,
    1e308, 5e-324, 3000, 10**6,
]  # fmt: skip
NAME_VALUES = ["", "forward", "é" * MAX_NAME_CHARS, "é" * (MAX_NAME_CHARS + 1), "a\nb", "x\0",
               None, 5, b"x"]

EVENTS = st.lists(st.builds(
    lambda kind, t, epoch, step, index, name, limit: TrainerEvent(
        kind=kind, t_ns=t, epoch=epoch, step=step, index=index, name=name, power_limit_w=limit),
    st.sampled_from(EVENT_KINDS), st.integers(0, MAX_NS), st.integers(0, MAX_COUNTER),
    st.integers(0, 10**6), st.integers(0, 3), st.sampled_from(["", "forward", "backward"]),
    st.sampled_from([None, 100, 300])), max_size=20)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, digest=st.sampled_from([None, DIGEST]))
def test_any_event_batch_round_trips_through_columns(events: list[TrainerEvent],
                                                     digest: str | None) -> None:
    rows = TrainerEventBatch(job_id="j", rank=3, node="n", gpu=1, events=events,
                             join_digest=digest)
    columns = decode_events(codec.encode(TrainerEventColumns.from_batch(rows)))
    assert isinstance(columns, TrainerEventColumns)
    assert columns.as_batch() == rows
    assert [tuple(r) for r in event_rows(columns)] == [
        tuple(e.model_dump().values()) for e in events]
    assert len(set(columns.names)) == len(columns.names)  # (Each name once.)
    assert decode_events(codec.encode(rows)) == rows


def rows_payload(events: list[dict[str, Any]]) -> dict[str, Any]:
    return {"v": 1, "job_id": "j", "rank": 0, "node": "n", "gpu": 0, "join_digest": DIGEST,
            "events": events}


def in_columns(rows: dict[str, Any]) -> dict[str, Any]:
    """The rows' content as a peer would pack it in columns (values carried as they are)."""
    events = rows["events"]
    names: dict[Any, int] = {}
    header = {k: v for k, v in rows.items() if k != "events"}
    return {**header, "columns": 1, **{f: [e[f] for e in events] for f in FIELDS},
            "kind": [EVENT_KINDS.index(e["kind"]) for e in events],
            "name": [names.setdefault(e["name"], len(names)) for e in events],
            "names": list(names)}


def base_events() -> list[dict[str, Any]]:
    return [{"kind": kind, "t_ns": 10 + i, "epoch": 0, "step": i, "index": i,
             "name": "forward", "power_limit_w": 250}
            for i, kind in enumerate(("step_begin", "instruction_end", "selection"))]


def verdicts(rows: dict[str, Any]) -> tuple[Any, Any]:
    """What `decode_events` makes of the rows and of the same content in columns."""
    out = []
    for obj in (rows, in_columns(rows)):
        try:
            batch = decode_events(msgpack.packb(obj))
        except PayloadError:
            out.append("refused")
        else:
            out.append([tuple(e) if not isinstance(e, TrainerEvent) else tuple(
                e.model_dump().values()) for e in event_rows(batch)])
    return out[0], out[1]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", HOSTILE_VALUES, ids=repr)
def test_one_hostile_value_gets_the_same_verdict_in_either_layout(field: str,
                                                                  value: Any) -> None:
    events = base_events()
    events[1][field] = value
    as_rows, as_columns = verdicts(rows_payload(events))
    assert as_rows == as_columns, (field, value)


@pytest.mark.parametrize("name", NAME_VALUES, ids=repr)
def test_a_hostile_name_gets_the_same_verdict_in_either_layout(name: Any) -> None:
    events = base_events()
    events[2]["name"] = name
    as_rows, as_columns = verdicts(rows_payload(events))
    assert as_rows == as_columns


@pytest.mark.parametrize(("header", "value"), [("rank", -1), ("gpu", 10**9), ("node", "a\nb"),
                                               ("join_digest", DIGEST.upper()),
                                               ("job_id", None)])
def test_a_hostile_header_gets_the_same_verdict_in_either_layout(header: str,
                                                                 value: Any) -> None:
    rows = rows_payload(base_events())
    rows[header] = value
    assert verdicts(rows) == ("refused", "refused")


def valid_columns() -> dict[str, Any]:
    return in_columns(rows_payload(base_events()))


@pytest.mark.parametrize(("change", "field"), [
    ({"step": [0, 1]}, ""), ({"names": []}, ""), ({"name": [0, 0, 1]}, ""),
    ({"kind": [0, 1, len(EVENT_KINDS)]}, "kind.2"), ({"kind": [0, 1, -1]}, "kind.2"),
    ({"columns": 2}, "columns"), ({"name": [0, 0, -1]}, "name.2"),
    ({"power_limit_w": [None, None, 0]}, "power_limit_w.2"), ({"extra": []}, "extra"),
])  # fmt: skip
def test_bad_columns_are_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_events(msgpack.packb({**valid_columns(), **change}))
    assert (caught.value.field or "") == field


def test_an_empty_batch_decodes_in_either_layout() -> None:
    rows = rows_payload([])
    assert verdicts(rows) == ([], [])


def test_the_kind_numbers_are_the_wires_pinned_and_documented() -> None:
    """`kind` carries numbers: which kind each is must not move with the model's `Literal`.

    An older agent's columns are read by a newer coordinator: a `Literal` reordered (or a kind
    inserted) must not renumber them. A new kind goes at the end. The schema (subjects.md) says
    which number is which, as a peer needs to pack them.
    """
    assert EVENT_KINDS == ("epoch_begin", "epoch_end", "step_begin", "step_end",
                           "instruction_begin", "instruction_end", "selection")
    assert set(EVENT_KINDS) == set(get_args(TrainerEvent.model_fields["kind"].annotation))
    schema = TrainerEventColumns.model_json_schema()["properties"]["kind"]
    for number, kind in enumerate(EVENT_KINDS):
        assert f"{number} {kind}" in schema.get("description", ""), kind
