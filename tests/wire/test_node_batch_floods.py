"""A node's batch full of bad items is refused at its first bad item, in either layout.

A coordinator decodes every node's batch of the jobs it drives on its event loop. Pydantic
collects an error per bad item of a list unless told to stop at the first: a 1 MB rows batch
of a million one-byte bad marks (`-1`) cost ~8 s of CPU to refuse (an error dict per item,
then `codec` describing them), during which the replica renews no lease and feeds no job; the
columns' bounded arrays, ~21,000 errors per ~40 KB batch. Every list of both layouts stops at
its first bad item, so the error count (what the refusal costs) no longer grows with the
payload. So do a rank's trainer events (in either layout), a GPU's samples and the per-GPU
view. (Counts, not
timings: tests/README.md.)
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from pydantic import BaseModel, ValidationError

from zeus_agent.errors import PayloadError
from zeus_agent.wire.event_columns import TrainerEventColumns, decode_events
from zeus_agent.wire.messages import (
    MAX_GPUS_PER_NODE,
    MeasurementBatch,
    SampleBatch,
    TrainerEventBatch,
)
from zeus_agent.wire.node_batch import MAX_ITEMS_PER_BATCH, NodeMeasurementBatch
from zeus_agent.wire.node_columns import NodeColumnBatch, decode_measurements

MANY = 100_000
BAD = -1  # (One byte in msgpack: no field takes it where these put it.)
N = MAX_ITEMS_PER_BATCH


def rows_flood() -> dict[str, Any]:
    """Rows: bad marks and measurements in every part, and parts of bad marks."""
    return {"v": 1, "node": "n1", "job_id": "j", "gpus": [
        {"gpu": 0, "rank": 0, "marks": [BAD] * MANY, "measurements": [BAD] * MANY},
        *({"gpu": g, "rank": g, "marks": [BAD] * 50} for g in range(1, MAX_GPUS_PER_NODE))]}


def columns_flood() -> dict[str, Any]:
    """Columns: every array at its length limit, every value bad."""
    parts = MAX_GPUS_PER_NODE
    return {"v": 1, "columns": 1, "node": "n1", "job_id": "j", "gpu": [BAD] * parts,
            "rank": [BAD] * parts, "join_digest": [BAD] * parts, "mark_count": [BAD] * parts,
            "measurement_count": [BAD] * parts, "names": [BAD] * N,
            "marks": {f: [BAD] * N for f in ("kind", "epoch", "step", "t_ns", "energy_j",
                                             "power_limit_w")},
            "measurements": {f: [BAD] * N for f in (
                "kind", "name", "epoch", "step", "index", "t0_ns", "t1_ns", "time_s",
                "energy_j", "schedule")}}


@pytest.mark.parametrize(("model", "flood"), [(NodeMeasurementBatch, rows_flood),
                                              (NodeColumnBatch, columns_flood)])
def test_a_flood_of_bad_items_is_refused_with_a_few_errors_not_one_per_item(
        model: type[BaseModel], flood: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(flood())
    assert caught.value.error_count() <= 30  # (A few per field: ~21,000 or ~200,000 before.)


@pytest.mark.parametrize("flood", [rows_flood, columns_flood])
def test_the_refusal_names_the_first_bad_item(flood: Any) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_measurements(msgpack.packb(flood()))
    assert caught.value.field in ("gpus.0.marks.0", "gpu.0")


def events_flood() -> dict[str, Any]:
    """A rank's trainer events: the coordinator's other per-job stream."""
    return {"v": 1, "job_id": "j", "rank": 0, "node": "n1", "gpu": 0, "events": [BAD] * MANY}


def event_columns_flood() -> dict[str, Any]:
    """A rank's trainer events in columns: every array as long, every value bad."""
    return {"v": 1, "columns": 1, "job_id": "j", "rank": 0, "node": "n1", "gpu": 0,
            **{f: [BAD] * MANY for f in ("names", "kind", "t_ns", "epoch", "step", "index",
                                         "name", "power_limit_w")}}


def samples_flood() -> dict[str, Any]:
    """A GPU's samples: every replica's budget service reads them."""
    return {"v": 1, "node": "n1", "gpu": 0, "uuid": "GPU-0", "samples": [BAD] * MANY}


def per_gpu_flood() -> dict[str, Any]:
    """The per-GPU view observers decode."""
    return {"v": 1, "node": "n1", "gpu": 0, "job_id": "j", "rank": 0, "marks": [BAD] * MANY,
            "measurements": [BAD] * MANY}


@pytest.mark.parametrize("flood", [events_flood, event_columns_flood, samples_flood,
                                   per_gpu_flood])
def test_the_other_streams_stop_at_their_first_bad_item_too(flood: Any) -> None:
    """Trainer events and samples had no cap either: a million bad items cost ~8 s to refuse."""
    model = {events_flood: TrainerEventBatch, event_columns_flood: TrainerEventColumns,
             samples_flood: SampleBatch, per_gpu_flood: MeasurementBatch}[flood]
    with pytest.raises(ValidationError) as caught:
        model.model_validate(flood())
    columns = 8 if flood is event_columns_flood else 1  # (At most one error per list.)
    assert caught.value.error_count() <= 2 * columns


@pytest.mark.parametrize(("flood", "field"), [(events_flood, "events.0"),
                                              (event_columns_flood, "names.0")])
def test_an_event_flood_is_refused_naming_its_first_bad_item_in_either_layout(
        flood: Any, field: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_events(msgpack.packb(flood()))
    assert caught.value.field == field
