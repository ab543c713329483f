"""`NodeColumnBatch`: a `NodeMeasurementBatch` laid out in columns (one array per field).

The same marks and measurements, on the same subject (`subjects.job_measurements`), but in
arrays instead of one map per item: the parts as columns (`gpu`, `rank`, `join_digest`, how
many marks and measurements each has), every part's marks in one `MarkColumns` and its
measurements in one `MeasurementColumns`, part after part; kinds as small integers (indexes
into `MARK_KINDS`, `MEASUREMENT_KINDS`), counters and stamps as integer arrays, energies and
times as float arrays, names interned once per batch (`names`). msgpack packs and unpacks an
array of numbers far faster than a map per item, and pydantic validates a `list[int]` or
`list[float]` in one go (in Rust), so a coordinator decodes a node's batch for a fraction of
the rows' cost; its cores take the items as `MarkRow` and `MeasurementRow` tuples (the rows'
field names), never a model per item (`MarkLike`, `MeasurementLike`).

Versioned by its own field `columns` (the layout's version, now 1): a payload with that key
is this layout, one without it the rows of a `NodeMeasurementBatch` (`decode_measurements`
takes both, in one unpack), so a coordinator keeps accepting the rows of older agents. Every
array is checked as the rows' fields are (the same bounds; finite, non-negative floats;
`t1_ns >= t0_ns`), the arrays of a group must have one length, the parts' counts must add up
to the items and every name index must name one. `parts()` gives each part's rows; `rows()`
and `per_gpu()` the rows' models (observers).

Kept apart from `node_batch` and `messages` (at its size limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import compress
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeus_agent.models import PowerW
from zeus_agent.wire.codec import decode_either
from zeus_agent.wire.messages import (
    MAX_GPUS_PER_NODE,
    Counter,
    GpuIndex,
    Id,
    JoinDigest,
    Mark,
    Measurement,
    MeasurementBatch,
    Message,
    Name,
    Nanos,
    Rank,
    ScheduleVersion,
)
from zeus_agent.wire.node_batch import MAX_ITEMS_PER_BATCH, GpuMeasurements, NodeMeasurementBatch

__all__ = ["COLUMNS_VERSION", "MARK_KINDS", "MEASUREMENT_KINDS", "GpuRows", "MarkColumns",
           "MarkLike", "MarkRow", "MeasurementColumns", "MeasurementLike", "MeasurementRow",
           "NodeColumnBatch", "as_rows", "decode_measurements"]

COLUMNS_VERSION: Literal[1] = 1
"""The layout's version, in each batch's `columns` field."""
MARK_KINDS: tuple[str, ...] = ("step_begin", "step_end", "epoch_begin", "epoch_end")
"""`Mark.kind` by its number in `MarkColumns.kind`."""
MEASUREMENT_KINDS: tuple[str, ...] = ("step", "instruction")
"""`Measurement.kind` by its number in `MeasurementColumns.kind`."""

_Items = Field(max_length=MAX_ITEMS_PER_BATCH, fail_fast=True)  # (`FAIL_FAST`.)
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A finite, non-negative float: an energy (J) or a duration (s), bounded as in `Measurement`."""


class MarkRow(NamedTuple):
    """One mark as the cores take it from columns: `Mark`'s fields, no model."""

    kind: str
    epoch: int
    step: int
    t_ns: int
    energy_j: float
    power_limit_w: int | None


class MeasurementRow(NamedTuple):
    """One measurement as the cores take it from columns: `Measurement`'s fields, no model."""

    kind: str
    name: str
    epoch: int
    step: int
    index: int  # type: ignore[assignment]  # (Measurement's name; shadows tuple.index.)
    t0_ns: int
    t1_ns: int
    time_s: float
    energy_j: float
    schedule: int | None


_new_mark = partial(tuple.__new__, MarkRow)
"""A `MarkRow` from a tuple of its fields, at C speed (`MarkRow(*fields)` runs Python)."""
_new_measurement = partial(tuple.__new__, MeasurementRow)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def _same_lengths(self) -> int:
        """The arrays' one length (raises ValueError naming the first that differs)."""
        fields = type(self).model_fields
        lengths = {name: len(getattr(self, name)) for name in fields}
        first, n = next(iter(lengths.items()))
        for name, length in lengths.items():
            if length != n:
                raise ValueError(f"column '{name}' has {length} items, '{first}' has {n}: "
                                 "every column of a part has one length")
        return n


class MarkColumns(_Part):
    """A GPU's marks, one array per `Mark` field (`kind`: numbers into `MARK_KINDS`)."""

    kind: Annotated[list[Annotated[int, Field(ge=0, lt=len(MARK_KINDS))]], _Items]
    epoch: Annotated[list[Counter], _Items]
    step: Annotated[list[Counter], _Items]
    t_ns: Annotated[list[Nanos], _Items]
    energy_j: Annotated[list[Amount], _Items]
    power_limit_w: Annotated[list[PowerW | None], _Items]

    @model_validator(mode="after")
    def _one_length(self) -> MarkColumns:
        self._same_lengths()
        return self

    def __len__(self) -> int:
        return len(self.kind)

    def rows(self) -> list[MarkRow]:
        """The marks as `MarkRow`s, in order."""
        return list(map(_new_mark, zip(map(MARK_KINDS.__getitem__, self.kind), self.epoch,
                                       self.step, self.t_ns, self.energy_j, self.power_limit_w,
                                       strict=True)))


class MeasurementColumns(_Part):
    """A GPU's measurements, one array per `Measurement` field.

    `kind`: numbers into `MEASUREMENT_KINDS`; `name`: indexes into the batch's `names`.
    """

    kind: Annotated[list[Annotated[int, Field(ge=0, lt=len(MEASUREMENT_KINDS))]], _Items]
    name: Annotated[list[Annotated[int, Field(ge=0, lt=MAX_ITEMS_PER_BATCH)]], _Items]
    epoch: Annotated[list[Counter], _Items]
    step: Annotated[list[Counter], _Items]
    index: Annotated[list[Counter], _Items]
    t0_ns: Annotated[list[Nanos], _Items]
    t1_ns: Annotated[list[Nanos], _Items]
    time_s: Annotated[list[Amount], _Items]
    energy_j: Annotated[list[Amount], _Items]
    schedule: Annotated[list[ScheduleVersion | None], _Items]

    @model_validator(mode="after")
    def _one_length_ordered(self) -> MeasurementColumns:
        self._same_lengths()
        if not all(map(int.__le__, self.t0_ns, self.t1_ns)):
            i = next(compress(range(len(self.t0_ns)), map(int.__gt__, self.t0_ns, self.t1_ns)))
            raise ValueError(f"t1_ns[{i}] ({self.t1_ns[i]}) precedes t0_ns[{i}] "
                             f"({self.t0_ns[i]})")
        return self

    def __len__(self) -> int:
        return len(self.kind)

    def rows(self, names: list[str]) -> list[MeasurementRow]:
        """The measurements as `MeasurementRow`s, in order (`names`: the batch's)."""
        return list(map(_new_measurement, zip(
            map(MEASUREMENT_KINDS.__getitem__, self.kind), map(names.__getitem__, self.name),
            self.epoch, self.step, self.index, self.t0_ns, self.t1_ns, self.time_s,
            self.energy_j, self.schedule, strict=True)))


def _empty_marks() -> MarkColumns:
    return MarkColumns(kind=[], epoch=[], step=[], t_ns=[], energy_j=[], power_limit_w=[])


def _empty_measurements() -> MeasurementColumns:
    return MeasurementColumns(kind=[], name=[], epoch=[], step=[], index=[], t0_ns=[], t1_ns=[],
                              time_s=[], energy_j=[], schedule=[])


@dataclass(frozen=True, slots=True)
class GpuRows:
    """One GPU's part of a columnar batch, its items as rows (what `GpuMeasurements` holds)."""

    gpu: int
    rank: int
    join_digest: str | None
    marks: list[MarkRow]
    measurements: list[MeasurementRow]

    @property
    def items(self) -> int:
        """Marks and measurements in this part."""
        return len(self.marks) + len(self.measurements)


Count = Annotated[int, Field(ge=0, le=MAX_ITEMS_PER_BATCH)]
_Gpus = Field(max_length=MAX_GPUS_PER_NODE, fail_fast=True)


class NodeColumnBatch(Message):
    """Marks and measurements of one job's ranks on one node's GPUs, in columns.

    A part per GPU, as in `NodeMeasurementBatch`, but the parts are columns too (`gpu`, `rank`,
    `join_digest`, and how many marks and measurements each has), and the items of every part
    are in one `marks` and one `measurements`, part after part: a batch of 8 GPUs of 2 items
    each costs two groups of arrays, not 16.
    """

    columns: Literal[1] = Field(description="The columnar layout's version (`COLUMNS_VERSION`)")
    node: Name
    job_id: Id
    gpu: Annotated[list[GpuIndex], _Gpus]
    rank: Annotated[list[Rank], _Gpus]
    join_digest: Annotated[list[JoinDigest | None], _Gpus] = Field(
        description="Per part, the digest of the join token its trainer presented (None: none)")
    mark_count: Annotated[list[Count], _Gpus]
    measurement_count: Annotated[list[Count], _Gpus]
    names: list[Name] = Field(default=[], max_length=MAX_ITEMS_PER_BATCH, fail_fast=True,
                              description="The measurements' names, each once")
    marks: MarkColumns = Field(default_factory=_empty_marks)
    measurements: MeasurementColumns = Field(default_factory=_empty_measurements)

    @model_validator(mode="after")
    def _consistent(self) -> NodeColumnBatch:
        parts = len(self.gpu)
        for name in ("rank", "join_digest", "mark_count", "measurement_count"):
            if len(getattr(self, name)) != parts:
                raise ValueError(f"column '{name}' has {len(getattr(self, name))} items, 'gpu' "
                                 f"has {parts}: one per part")
        if sum(self.mark_count) != len(self.marks):
            raise ValueError(f"the parts count {sum(self.mark_count)} marks; 'marks' holds "
                             f"{len(self.marks)}")
        if sum(self.measurement_count) != len(self.measurements):
            raise ValueError(f"the parts count {sum(self.measurement_count)} measurements; "
                             f"'measurements' holds {len(self.measurements)}")
        named = self.measurements.name
        if named and max(named) >= len(self.names):
            i = next(i for i, n in enumerate(named) if n >= len(self.names))
            raise ValueError(f"measurements.name[{i}] is {named[i]}; the batch has "
                             f"{len(self.names)} names")
        return self

    def parts(self) -> list[GpuRows]:
        """The parts, in order, their items as rows (no model per item)."""
        marks, measurements = self.marks.rows(), self.measurements.rows(self.names)
        parts, m, n = [], 0, 0
        for gpu, rank, digest, marked, measured in zip(
                self.gpu, self.rank, self.join_digest, self.mark_count, self.measurement_count,
                strict=True):
            parts.append(GpuRows(gpu, rank, digest, marks[m:m + marked],
                                 measurements[n:n + measured]))
            m, n = m + marked, n + measured
        return parts

    @classmethod
    def from_rows(cls, batch: NodeMeasurementBatch) -> NodeColumnBatch:
        """The same batch in columns (names interned in their first order)."""
        names: dict[str, int] = {}
        parts = batch.gpus
        return cls.model_construct(
            columns=COLUMNS_VERSION, node=batch.node, job_id=batch.job_id,
            gpu=[p.gpu for p in parts], rank=[p.rank for p in parts],
            join_digest=[p.join_digest for p in parts],
            mark_count=[len(p.marks) for p in parts],
            measurement_count=[len(p.measurements) for p in parts],
            marks=_mark_columns([m for p in parts for m in p.marks]),
            measurements=_measurement_columns([m for p in parts for m in p.measurements], names),
            names=list(names))

    def rows(self) -> NodeMeasurementBatch:
        """The same batch as rows (a model per item: for observers, not the hot path)."""
        return NodeMeasurementBatch(node=self.node, job_id=self.job_id, gpus=[
            GpuMeasurements(gpu=p.gpu, rank=p.rank, join_digest=p.join_digest,
                            marks=[Mark(**r._asdict()) for r in p.marks],
                            measurements=[Measurement(**r._asdict()) for r in p.measurements])
            for p in self.parts()])

    def per_gpu(self) -> list[MeasurementBatch]:
        """Each part as a per-GPU `MeasurementBatch` (`NodeMeasurementBatch.per_gpu`)."""
        return self.rows().per_gpu()


def _mark_columns(marks: list[Mark]) -> MarkColumns:
    kinds = {k: i for i, k in enumerate(MARK_KINDS)}
    return MarkColumns.model_construct(
        kind=[kinds[m.kind] for m in marks], epoch=[m.epoch for m in marks],
        step=[m.step for m in marks], t_ns=[m.t_ns for m in marks],
        energy_j=[m.energy_j for m in marks], power_limit_w=[m.power_limit_w for m in marks])


def _measurement_columns(measurements: list[Measurement],
                         names: dict[str, int]) -> MeasurementColumns:
    kinds = {k: i for i, k in enumerate(MEASUREMENT_KINDS)}
    ms = measurements
    return MeasurementColumns.model_construct(
        kind=[kinds[m.kind] for m in ms], name=[names.setdefault(m.name, len(names)) for m in ms],
        epoch=[m.epoch for m in ms], step=[m.step for m in ms], index=[m.index for m in ms],
        t0_ns=[m.t0_ns for m in ms], t1_ns=[m.t1_ns for m in ms],
        time_s=[m.time_s for m in ms], energy_j=[m.energy_j for m in ms],
        schedule=[m.schedule for m in ms])


def decode_measurements(data: bytes) -> NodeMeasurementBatch | NodeColumnBatch:
    """A node's batch in either layout (one unpack): columns if it has `columns`, else rows.

    Raises `PayloadError` as `codec.decode` does.
    """
    return decode_either(data, NodeMeasurementBatch, NodeColumnBatch, "columns")


def as_rows(batch: NodeMeasurementBatch | NodeColumnBatch) -> NodeMeasurementBatch:
    """A batch of either layout as rows (for observers)."""
    return batch.rows() if isinstance(batch, NodeColumnBatch) else batch



MarkLike = Mark | MarkRow
"""A mark as the cores take it: a `Mark` (rows) or a `MarkRow` (columns); the same fields."""
MeasurementLike = Measurement | MeasurementRow
"""A measurement as the cores take it: a `Measurement` or a `MeasurementRow`."""
