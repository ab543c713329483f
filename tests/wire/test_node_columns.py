"""`NodeColumnBatch`: a node's marks and measurements in columns, and its checks.

Any row batch round-trips through columns (encoded, decoded: the same rows, the same per-GPU
view); `decode_measurements` takes either layout from the same subject; every column is checked
as the rows' fields are, and what rows cannot express (columns of different lengths, counts
that do not add up, a name index past the names, another layout version) is refused with a
`PayloadError` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec
from zeus_agent.wire.messages import MAX_COUNTER, MAX_NS, Mark, Measurement, join_token_digest
from zeus_agent.wire.node_batch import MAX_ITEMS_PER_BATCH, GpuMeasurements, NodeMeasurementBatch
from zeus_agent.wire.node_columns import (
    MarkRow,
    MeasurementRow,
    NodeColumnBatch,
    as_rows,
    decode_measurements,
)

DIGEST = join_token_digest("a-join-token-of-the-job")
COUNTERS = st.integers(0, MAX_COUNTER)
STAMPS = st.integers(0, MAX_NS)
FLOATS = st.floats(0, 1e12, allow_nan=False, allow_infinity=False)
MARKS = st.builds(Mark, kind=st.sampled_from(["step_begin", "step_end", "epoch_begin",
                                              "epoch_end"]),
                  epoch=COUNTERS, step=COUNTERS, t_ns=STAMPS, energy_j=FLOATS,
                  power_limit_w=st.one_of(st.none(), st.integers(1, 5000)))
MEASUREMENTS = st.builds(
    lambda kind, name, counters, t0, dt, time_s, energy, schedule: Measurement(
        kind=kind, name=name, epoch=counters[0], step=counters[1], index=counters[2], t0_ns=t0,
        t1_ns=min(MAX_NS, t0 + dt), time_s=time_s, energy_j=energy, schedule=schedule),
    st.sampled_from(["step", "instruction"]), st.sampled_from(["", "forward", "backward", "é"]),
    st.tuples(COUNTERS, COUNTERS, COUNTERS), STAMPS, st.integers(0, 10**12), FLOATS, FLOATS,
    st.one_of(st.none(), st.integers(0, 2**31 - 1)),
)  # fmt: skip
PARTS = st.builds(GpuMeasurements, gpu=st.integers(0, 7), rank=st.integers(0, 1000),
                  marks=st.lists(MARKS, max_size=4), measurements=st.lists(MEASUREMENTS,
                                                                           max_size=4),
                  join_digest=st.sampled_from([None, DIGEST]))
BATCHES = st.builds(NodeMeasurementBatch, node=st.just("n1"), job_id=st.just("job-1"),
                    gpus=st.lists(PARTS, max_size=5))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=BATCHES)
def test_any_row_batch_round_trips_through_columns(batch: NodeMeasurementBatch) -> None:
    data = codec.encode(NodeColumnBatch.from_rows(batch))
    back = decode_measurements(data)
    assert isinstance(back, NodeColumnBatch)
    assert back.rows() == batch
    assert back.per_gpu() == batch.per_gpu()
    parts = back.parts()
    assert [(p.gpu, p.rank, p.join_digest) for p in parts] == [
        (p.gpu, p.rank, p.join_digest) for p in batch.gpus]
    for got, sent in zip(parts, batch.gpus, strict=True):
        assert got.marks == [MarkRow(**m.model_dump()) for m in sent.marks]
        assert got.measurements == [MeasurementRow(**m.model_dump()) for m in sent.measurements]
        assert got.items == sent.items


def test_either_layout_decodes_from_the_same_bytes_of_its_own() -> None:
    rows = NodeMeasurementBatch(node="n1", job_id="j", gpus=[GpuMeasurements(
        gpu=0, rank=0, marks=[Mark(kind="step_begin", epoch=0, step=1, t_ns=5, energy_j=1.0)])])
    assert decode_measurements(codec.encode(rows)) == rows  # An older agent's rows.
    assert as_rows(decode_measurements(codec.encode(rows))) == rows
    assert as_rows(decode_measurements(codec.encode(NodeColumnBatch.from_rows(rows)))) == rows


def columns(**change: Any) -> dict[str, Any]:
    """A valid columnar batch of 2 GPUs (2 marks, 1 measurement) as plain data, changed."""
    marks = {"kind": [0, 0], "epoch": [0, 0], "step": [1, 2], "t_ns": [10, 20],
             "energy_j": [1.0, 2.0], "power_limit_w": [None, 300]}
    meas = {"kind": [1], "name": [0], "epoch": [0], "step": [1], "index": [3], "t0_ns": [10],
            "t1_ns": [19], "time_s": [9e-9], "energy_j": [1.0], "schedule": [None]}
    data: dict[str, Any] = {
        "v": 1, "columns": 1, "node": "n1", "job_id": "j", "gpu": [0, 1], "rank": [0, 1],
        "join_digest": [DIGEST, None], "mark_count": [2, 0], "measurement_count": [0, 1],
        "names": ["forward"], "marks": marks, "measurements": meas}
    for path, value in change.items():
        *where, last = path.split("__")
        target = data
        for key in where:
            target = target[key]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return data


def test_the_valid_base_decodes() -> None:
    batch = decode_measurements(msgpack.packb(columns()))
    assert isinstance(batch, NodeColumnBatch)
    a, b = batch.parts()
    assert (a.marks[1].power_limit_w, a.measurements, b.marks) == (300, [], [])
    assert b.measurements[0].name == "forward" and b.measurements[0].kind == "instruction"


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"columns": 2}, "columns", "1"),
    ({"columns": ...}, "gpu", "Extra"),  # (Read as rows: a row batch has no `gpu`.)
    ({"v": 2}, "v", "schema version"),
    ({"marks__t1_ns": [1, 2]}, "marks.t1_ns", "Extra"),
    ({"marks__step": [1]}, "marks", "one length"),
    ({"rank": [0]}, "payload", "one per part"),
    ({"mark_count": [1, 0]}, "payload", "count 1 marks"),
    ({"measurement_count": [0, 2]}, "payload", "measurements"),
    ({"measurements__name": [1]}, "payload", "names"),
    ({"measurements__t1_ns": [9]}, "measurements", "precedes"),
    ({"marks__energy_j": [1.0, math.inf]}, "marks.energy_j.1", "finite"),
    ({"marks__energy_j": [1.0, math.nan]}, "marks.energy_j.1", "finite"),
    ({"marks__energy_j": [1.0, -1.0]}, "marks.energy_j.1", "greater"),
    ({"measurements__time_s": [-1e-9]}, "measurements.time_s.0", "greater"),
    ({"marks__kind": [0, 4]}, "marks.kind.1", "less"),
    ({"measurements__kind": [2]}, "measurements.kind.0", "less"),
    ({"marks__step": [1, MAX_COUNTER + 1]}, "marks.step.1", "less"),
    ({"marks__t_ns": [1, -1]}, "marks.t_ns.1", "greater"),
    ({"marks__power_limit_w": [0, None]}, "marks.power_limit_w.0", ""),
    ({"marks__epoch": [0, 0.5]}, "marks.epoch.1", "integer"),
    ({"marks__epoch": 5}, "marks.epoch", "list"),
    ({"join_digest": ["not-a-digest", None]}, "join_digest.0", "pattern"),
    ({"names": ["a\nb"]}, "names.0", "pattern"),
    ({"names": ["x" * 10_000]}, "names.0", "at most"),
    ({"gpu": [-1, 1]}, "gpu.0", "greater"),
    ({"marks__kind": [0] * (MAX_ITEMS_PER_BATCH + 1)}, "marks.kind", "at most"),
])  # fmt: skip
def test_bad_columns_are_refused_naming_the_field(change: dict[str, Any], field: str,
                                                  words: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_measurements(msgpack.packb(columns(**change)))
    assert caught.value.field == ("" if field == "payload" else field)
    assert words in str(caught.value)
    assert len(str(caught.value)) < 2000  # (What the peer sent is echoed short.)


def test_a_part_with_no_items_is_kept_as_an_empty_part() -> None:
    batch = decode_measurements(msgpack.packb(columns(mark_count=[0, 0], marks__kind=[],
                                                      marks__epoch=[], marks__step=[],
                                                      marks__t_ns=[], marks__energy_j=[],
                                                      marks__power_limit_w=[])))
    assert isinstance(batch, NodeColumnBatch)
    assert [p.items for p in batch.parts()] == [0, 1]
