"""Rows and columns refuse and accept alike: one bad value, in either layout, the same verdict.

`NodeColumnBatch` says every array is checked as the rows' fields are. A near-valid node's
batch is built as rows (plain data, as a peer packs it), one field of one mark, measurement or
part is given a hostile value (NaN, +-inf, negative, past a bound, bool, a string, bytes, None,
a name too long or with a control character, a bad digest), and the same content is packed in
columns: `decode_measurements` refuses both or neither, and what it accepts reads back as the
same rows (`as_rows`), floats and None included. Every hostile value in every field of a
fixed batch (its second part's second items: the columns' slicing), and random shapes.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_agent.errors import PayloadError
from zeus_agent.wire.messages import (
    MAX_COUNTER,
    MAX_NAME_CHARS,
    MAX_NS,
    MAX_RANK,
    join_token_digest,
)
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_agent.wire.node_columns import MARK_KINDS, MEASUREMENT_KINDS, as_rows, decode_measurements

DIGEST = join_token_digest("a-join-token-of-the-job")
MARK_FIELDS = ("epoch", "step", "t_ns", "energy_j", "power_limit_w")
MEASUREMENT_FIELDS = ("epoch", "step", "index", "t0_ns", "t1_ns", "time_s", "energy_j",
                      "schedule")
PART_FIELDS = ("gpu", "rank", "join_digest")
HOSTILE_VALUES: list[Any] = [
    math.nan, math.inf, -math.inf, -1, -0.0, 0, 1, 0.5, 1.0, True, False, None, "1", "x", b"1",
    [], {}, 2**63, 2**64 - 1, -(2**63), MAX_COUNTER, MAX_COUNTER + 1, MAX_NS, MAX_NS + 1,
    MAX_RANK + 1, 1e308, 5e-324, 3000, 10**6, DIGEST, DIGEST.upper(), DIGEST[:-1],
]  # fmt: skip
HOSTILE = st.sampled_from(HOSTILE_VALUES)
NAME_VALUES = ["", "forward", "é" * MAX_NAME_CHARS, "é" * (MAX_NAME_CHARS + 1), "a\nb", "x\0"]
NAMES = st.sampled_from(NAME_VALUES)

MARKS = st.lists(st.fixed_dictionaries({
    "kind": st.sampled_from(MARK_KINDS), "epoch": st.integers(0, 2), "step": st.integers(0, 9),
    "t_ns": st.integers(0, 10**12), "energy_j": st.floats(0, 1e9),
    "power_limit_w": st.sampled_from([None, 250, 300])}), max_size=3)  # fmt: skip
MEASUREMENTS = st.lists(st.builds(
    lambda kind, name, step, t0, dt, time_s, energy, schedule: {
        "kind": kind, "name": name, "epoch": 0, "step": step, "index": step, "t0_ns": t0,
        "t1_ns": t0 + dt, "time_s": time_s, "energy_j": energy, "schedule": schedule},
    st.sampled_from(MEASUREMENT_KINDS), st.sampled_from(["", "forward", "backward"]),
    st.integers(0, 9), st.integers(0, 10**12), st.integers(0, 10**9), st.floats(0, 1e3),
    st.floats(0, 1e9), st.sampled_from([None, 0, 7])), max_size=3)  # fmt: skip
PARTS = st.lists(st.builds(
    lambda gpu, rank, digest, marks, measurements: {
        "gpu": gpu, "rank": rank, "join_digest": digest, "marks": marks,
        "measurements": measurements},
    st.integers(0, 7), st.integers(0, 9), st.sampled_from([None, DIGEST]), MARKS,
    MEASUREMENTS), min_size=1, max_size=3)  # fmt: skip


def in_columns(rows: dict[str, Any]) -> dict[str, Any]:
    """The rows' content as a peer would pack it in columns (values carried as they are)."""
    parts = rows["gpus"]
    marks = [m for p in parts for m in p["marks"]]
    measurements = [m for p in parts for m in p["measurements"]]
    names: dict[str, int] = {}
    indexes = [names.setdefault(m["name"], len(names)) for m in measurements]
    return {
        "v": 1, "columns": 1, "node": rows["node"], "job_id": rows["job_id"],
        **{f: [p[f] for p in parts] for f in PART_FIELDS},
        "mark_count": [len(p["marks"]) for p in parts],
        "measurement_count": [len(p["measurements"]) for p in parts],
        "names": list(names),
        "marks": {**{f: [m[f] for m in marks] for f in MARK_FIELDS},
                  "kind": [MARK_KINDS.index(m["kind"]) for m in marks]},
        "measurements": {**{f: [m[f] for m in measurements] for f in MEASUREMENT_FIELDS},
                         "kind": [MEASUREMENT_KINDS.index(m["kind"]) for m in measurements],
                         "name": indexes},
    }


def verdict(obj: dict[str, Any]) -> NodeMeasurementBatch | None:
    """The batch as rows, or None if refused (as `PayloadError`, never anything else)."""
    try:
        return as_rows(decode_measurements(msgpack.packb(obj, use_bin_type=True)))
    except PayloadError:
        return None


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A node's batch as rows with one field of one item or part given a hostile value."""
    rows: dict[str, Any] = {"v": 1, "node": "n1", "job_id": "job-1", "gpus": draw(PARTS)}
    part = draw(st.sampled_from(rows["gpus"]))
    where = draw(st.sampled_from(["part", "mark", "measurement", "name"]))
    if where == "mark" and part["marks"]:
        draw(st.sampled_from(part["marks"]))[draw(st.sampled_from(MARK_FIELDS))] = draw(HOSTILE)
    elif where == "measurement" and part["measurements"]:
        item = draw(st.sampled_from(part["measurements"]))
        item[draw(st.sampled_from(MEASUREMENT_FIELDS))] = draw(HOSTILE)
    elif where == "name" and part["measurements"]:
        draw(st.sampled_from(part["measurements"]))["name"] = draw(NAMES)
    else:
        part[draw(st.sampled_from(PART_FIELDS))] = draw(HOSTILE)
    return rows


def base_rows() -> dict[str, Any]:
    """A valid batch as rows: 2 parts of 2 marks and 2 measurements each."""
    def mark(step: int) -> dict[str, Any]:
        return {"kind": "step_begin", "epoch": 1, "step": step, "t_ns": 10 * step,
                "energy_j": 1.5 * step, "power_limit_w": 300 if step % 2 else None}

    def measurement(step: int) -> dict[str, Any]:
        return {"kind": "instruction", "name": f"i{step % 2}", "epoch": 1, "step": step,
                "index": step, "t0_ns": 10 * step, "t1_ns": 10 * step + 5, "time_s": 5e-9,
                "energy_j": 0.25, "schedule": 3 if step % 2 else None}

    return {"v": 1, "node": "n1", "job_id": "job-1", "gpus": [
        {"gpu": g, "rank": g, "join_digest": [None, DIGEST][g], "marks": [mark(g), mark(g + 2)],
         "measurements": [measurement(g), measurement(g + 2)]} for g in (0, 1)]}


def test_every_hostile_value_in_every_field_gets_the_same_verdict_in_either_layout() -> None:
    """Each field of the second part's second mark and measurement, and of the part itself."""
    cases = [("marks", f, v) for f in MARK_FIELDS for v in HOSTILE_VALUES]
    cases += [("measurements", f, v) for f in MEASUREMENT_FIELDS for v in HOSTILE_VALUES]
    cases += [("measurements", "name", v) for v in NAME_VALUES]
    cases += [("part", f, v) for f in PART_FIELDS for v in HOSTILE_VALUES]
    differ, accepted = [], 0
    for where, field, value in cases:
        rows = base_rows()
        part = rows["gpus"][1]
        (part if where == "part" else part[where][1])[field] = value
        as_sent = verdict(rows)
        if verdict(in_columns(rows)) != as_sent:
            differ.append((where, field, value))
        accepted += as_sent is not None
    assert differ == []
    assert 0 < accepted < len(cases)  # (Some values pass: 0, 1, a bound itself...)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=near_valid())
def test_one_hostile_value_gets_the_same_verdict_in_rows_and_in_columns(
        rows: dict[str, Any]) -> None:
    as_sent = verdict(rows)
    assert verdict(in_columns(rows)) == as_sent
    if as_sent is not None:  # What is accepted reads back exactly (NaN never is).
        assert as_sent.model_dump() == NodeMeasurementBatch.model_validate(rows).model_dump()
