"""`TrainerEventColumns`: a `TrainerEventBatch` laid out in columns (one array per field).

The same rank's events, on the same subject (`subjects.job_events`), but an array per
`TrainerEvent` field instead of a map per event: kinds as small integers (indexes into
`EVENT_KINDS`), counters, stamps and limits as integer arrays, names interned once per batch
(`names`). msgpack unpacks an array of numbers far faster than a map per item and pydantic
validates a `list[int]` in one go, so the owner decodes a rank's batch without a model per
event; its cores take the events as `EventRow` tuples (the rows' field names: `EventLike`).

Versioned by its own field `columns` (the layout's version, now 1): a payload with that key
is this layout, one without it a `TrainerEventBatch` (`decode_events` takes both, in one
unpack), so a coordinator keeps accepting the rows of older agents; agents send columns only
to coordinators that say they read them (`zeus_agent.wire.formats`). Every array is checked as
the rows' fields are (the same bounds, no more events than the rows may hold: none but the
payload's size), stops at its first bad item (`fail_fast`), the arrays have one length and
every name index names one. `rows()` gives the events as rows, `as_batch()` the rows' model
(observers, tests).

Kept apart from `messages` (at its size limit).
"""

from __future__ import annotations

from functools import partial
from itertools import compress
from typing import Annotated, Literal, NamedTuple

from pydantic import Field, model_validator

from zeus_agent.models import PowerW
from zeus_agent.wire.codec import decode_either
from zeus_agent.wire.messages import (
    Counter,
    GpuIndex,
    Id,
    JoinDigest,
    Message,
    Name,
    Nanos,
    Rank,
    TrainerEvent,
    TrainerEventBatch,
)

__all__ = ["EVENTS_COLUMNS_VERSION", "EVENT_KINDS", "EventLike", "EventRow",
           "TrainerEventColumns", "decode_events", "event_rows"]

EVENTS_COLUMNS_VERSION: Literal[1] = 1
"""The layout's version, in each batch's `columns` field."""
EVENT_KINDS: tuple[str, ...] = ("epoch_begin", "epoch_end", "step_begin", "step_end",
                                "instruction_begin", "instruction_end", "selection")
"""`TrainerEvent.kind` by its number in `TrainerEventColumns.kind`: the wire's numbers, so
spelled out, not the `Literal`'s order (which a reordering would renumber); a new kind goes at
the end (`test_event_columns` checks it names every kind of the model)."""
_KIND_NUMBERS = {kind: i for i, kind in enumerate(EVENT_KINDS)}

_Items = Field(fail_fast=True)  # (Stops at the first bad item: `test_node_batch_floods`.)
_EVENT_FIELDS = ("kind", "t_ns", "epoch", "step", "index", "name", "power_limit_w")


class EventRow(NamedTuple):
    """One trainer event as the cores take it from columns: `TrainerEvent`'s fields, no model."""

    kind: str
    t_ns: int
    epoch: int
    step: int
    index: int  # type: ignore[assignment]  # (TrainerEvent's name; shadows tuple.index.)
    name: str
    power_limit_w: int | None


_new_row = partial(tuple.__new__, EventRow)
"""An `EventRow` from a tuple of its fields, at C speed (`EventRow(*fields)` runs Python)."""

EventLike = TrainerEvent | EventRow
"""A trainer event as the cores take it: a `TrainerEvent` (rows) or an `EventRow` (columns)."""


class TrainerEventColumns(Message):
    """Events of one rank, oldest first, as forwarded by its node's agent, in columns.

    The header fields are `TrainerEventBatch`'s; each event is the same index of every array.
    """

    columns: Literal[1] = Field(description="The columnar layout's version "
                                "(`EVENTS_COLUMNS_VERSION`)")
    job_id: Id
    rank: Rank
    node: Name
    gpu: GpuIndex
    join_digest: JoinDigest | None = Field(
        default=None, description="Digest of the join token the bound trainer presented in its "
        "HELLO (None: none), as in `TrainerEventBatch`")
    names: Annotated[list[Name], _Items] = Field(default=[],
                                                 description="The events' names, each once")
    kind: Annotated[list[Annotated[int, Field(ge=0, lt=len(EVENT_KINDS))]], _Items] = Field(
        description="Per event, its kind's number (`EVENT_KINDS`): "
        + ", ".join(f"{i} {kind}" for i, kind in enumerate(EVENT_KINDS)))
    t_ns: Annotated[list[Nanos], _Items]
    epoch: Annotated[list[Counter], _Items]
    step: Annotated[list[Counter], _Items]
    index: Annotated[list[Counter], _Items]
    name: Annotated[list[Annotated[int, Field(ge=0)]], _Items] = Field(
        description="Per event, its name's index in `names`")
    power_limit_w: Annotated[list[PowerW | None], _Items]

    @model_validator(mode="after")
    def _consistent(self) -> TrainerEventColumns:
        n = len(self.kind)
        for field in _EVENT_FIELDS[1:]:
            if len(getattr(self, field)) != n:
                raise ValueError(f"column '{field}' has {len(getattr(self, field))} items, "
                                 f"'kind' has {n}: every column has one length")
        named = self.name
        if named and max(named) >= len(self.names):
            i = next(compress(range(n), map(len(self.names).__le__, named)))
            raise ValueError(f"name[{i}] is {named[i]}; the batch has {len(self.names)} names")
        return self

    def __len__(self) -> int:
        return len(self.kind)

    def rows(self) -> list[EventRow]:
        """The events as `EventRow`s, oldest first (no model per event)."""
        return list(map(_new_row, zip(
            map(EVENT_KINDS.__getitem__, self.kind), self.t_ns, self.epoch, self.step,
            self.index, map(self.names.__getitem__, self.name), self.power_limit_w,
            strict=True)))

    @classmethod
    def from_events(cls, *, job_id: str, rank: int, node: str, gpu: int,
                    join_digest: str | None, events: list[TrainerEvent]) -> TrainerEventColumns:
        """The events (valid models) in columns, names interned in their first order."""
        names: dict[str, int] = {}
        es = events
        return cls.model_construct(
            columns=EVENTS_COLUMNS_VERSION, job_id=job_id, rank=rank, node=node, gpu=gpu,
            join_digest=join_digest, kind=[_KIND_NUMBERS[e.kind] for e in es],
            t_ns=[e.t_ns for e in es], epoch=[e.epoch for e in es], step=[e.step for e in es],
            index=[e.index for e in es],
            name=[names.setdefault(e.name, len(names)) for e in es],
            power_limit_w=[e.power_limit_w for e in es], names=list(names))

    @classmethod
    def from_batch(cls, batch: TrainerEventBatch) -> TrainerEventColumns:
        """The same batch in columns."""
        return cls.from_events(job_id=batch.job_id, rank=batch.rank, node=batch.node,
                               gpu=batch.gpu, join_digest=batch.join_digest,
                               events=batch.events)

    def as_batch(self) -> TrainerEventBatch:
        """The same batch as rows (a model per event: for observers, not the hot path)."""
        return TrainerEventBatch(
            job_id=self.job_id, rank=self.rank, node=self.node, gpu=self.gpu,
            join_digest=self.join_digest,
            events=[TrainerEvent(**row._asdict()) for row in self.rows()])


def decode_events(data: bytes) -> TrainerEventBatch | TrainerEventColumns:
    """A rank's events in either layout (one unpack): columns if it has `columns`, else rows.

    Raises `PayloadError` as `codec.decode` does.
    """
    return decode_either(data, TrainerEventBatch, TrainerEventColumns, "columns")


def event_rows(batch: TrainerEventBatch | TrainerEventColumns) -> list[EventLike]:
    """The events the cores take: the models of rows, the `EventRow`s of columns."""
    if isinstance(batch, TrainerEventColumns):
        return list(batch.rows())
    return list(batch.events)
