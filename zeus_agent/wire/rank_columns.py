"""`RegisterRankColumns`: a node's `RegisterRanks` laid out in columns (one array per field).

The common batch (one job's ranks, each with its GPU's description from the agent that relays
it) has its node-wide fields once (`job_id`, `join_token`, `uid`, the node) and an array per
field of the ranks, their bindings and their GPUs' descriptions. msgpack unpacks arrays of
numbers and short strings far faster than a map per rank, and pydantic validates a `list[int]`
in one go: the coordinator decodes a node's batch without validating four models per rank
(`requests()` builds them, their fields already checked).

Every column's items are checked as the rows' fields are (the same types and bounds, stopping
at the first bad item: a hostile value gets the same verdict in either layout,
`tests/wire/test_rank_columns.py`), the columns have one length (1 to `MAX_GPUS_PER_NODE`),
each description's limits are ordered as `GpuDescription` requires, and the clock lists the
ranks name hold no more clocks in all than a rows batch could (`MAX_CLOCK_ITEMS`). Versioned by
its own field `columns` (now 1): a payload with that key is this layout, one with `ranks` a
`RegisterRanks`, else a `RegisterRank` (`decode_registration`, one unpack). Any other batch
(ranks of several jobs, a rank without its GPU's description or described as another GPU, more
clocks than `MAX_CLOCK_ITEMS`) has no columns (`from_ranks` gives None) and goes as rows. An
agent sends columns first; a coordinator that predates them refuses them (`bad_request`), and
the agent then sends rows (`zeus_agent.agent.rank_relay`).

Kept apart from `messages` (at its size limit).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from zeus_agent.models import MAX_NAME_CHARS, MAX_SCHEDULE_LENGTH, PowerW, RankInfo
from zeus_agent.wire import codec
from zeus_agent.wire.messages import (
    MAX_ENERGY_PERIOD_MS,
    MAX_GPUS_PER_NODE,
    Clocks,
    GpuBinding,
    GpuDescription,
    GpuIndex,
    Id,
    JoinToken,
    Message,
    Name,
    Rank,
    RegisterRank,
    ScheduleVersion,
)
from zeus_agent.wire.rank_batch import RegisterRanks

__all__ = ["MAX_CLOCK_ITEMS", "RANK_COLUMNS_VERSION", "RegisterRankColumns",
           "decode_registration"]

RANK_COLUMNS_VERSION: Literal[1] = 1
"""The layout's version, in each batch's `columns` field."""

_Col = Field(fail_fast=True, max_length=MAX_GPUS_PER_NODE)
"""Every column: at most a node's GPUs, stopping at its first bad item."""
_Instructions = Annotated[list[Annotated[str, Field(max_length=MAX_NAME_CHARS)]],
                          Field(max_length=MAX_SCHEDULE_LENGTH)]
"""`RankInfo.instructions` (without its None)."""
_Period = Annotated[float, Field(ge=0, le=MAX_ENERGY_PERIOD_MS)]
_MAX_CLOCK_LISTS = 3 * MAX_GPUS_PER_NODE
MAX_CLOCK_ITEMS = 1 << 19
"""Most clocks a batch's ranks name in all (a list counted each time it is named): what the
largest rows batch an agent sends (`rank_relay.MAX_BATCH_BYTES`, 512 KiB) could hold at one
byte a clock. Interned lists would otherwise let 33 KB name 3.1 million clocks (1,024 ranks
naming one list of 1,024 three times), which each rank's record then keeps; a node's real
batch names far fewer (1,024 GPUs of 240 clocks a rank: 246,000)."""
_Index = Annotated[int, Field(ge=0, lt=_MAX_CLOCK_LISTS)]
_CLOCKS = ("available_frequencies", "supported_memory_clocks_mhz",
           "supported_graphics_clocks_mhz")
"""The columns of indexes in `clocks`."""
_INFO = ("rank", "dp_rank", "pp_rank", "tp_rank", "available_frequencies")
_DESCRIBED = ("uuid", "name", "architecture", "min_power_limit_w", "max_power_limit_w",
              "default_power_limit_w", "supported_memory_clocks_mhz",
              "supported_graphics_clocks_mhz", "has_energy_counter", "power_limit_w",
              "schedule_version", "controllable", "energy_period_ms")
"""`GpuDescription`'s fields with a column of the same name, in its order (`index` is
`gpu_index`, `job_id` the column `gpu_job_id`)."""
_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank", "available_frequencies", "gpu_index",
            "gpu_uuid", "gpu_job_id", *_DESCRIBED)


class RegisterRankColumns(Message):
    """Ranks of one job on one node registered together, in columns.

    The node-wide fields once; each rank is the same index of every column.
    """

    columns: Literal[1] = Field(description="The columnar layout's version "
                                "(`RANK_COLUMNS_VERSION`)")
    job_id: Id
    join_token: JoinToken | None = Field(default=None, description="Every rank's (`RegisterRank`)")
    uid: int | None = Field(default=None, ge=0, le=2**32 - 1,
                            description="Every rank's trainer's user id (`RegisterRank`)")
    node: Name = Field(description="Every rank's GPU's node (`GpuBinding.node`)")
    rank: Annotated[list[Rank], _Col] = Field(min_length=1)
    dp_rank: Annotated[list[Rank], _Col]
    pp_rank: Annotated[list[Rank], _Col]
    tp_rank: Annotated[list[Rank], _Col]
    clocks: Annotated[list[Clocks], Field(fail_fast=True, max_length=_MAX_CLOCK_LISTS)] = Field(
        description="The ranks' and GPUs' clock lists, each once (at most 3,072); the ranks "
        "name at most 524,288 clocks in all, a list counted each time it is named "
        "(`MAX_CLOCK_ITEMS`)")
    available_frequencies: Annotated[list[_Index], _Col] = Field(
        description="Per rank, `RankInfo.available_frequencies`: its index in `clocks`")
    instructions: Annotated[list[_Instructions | None], _Col] | None = Field(
        default=None, description="Per rank, `RankInfo.instructions`; None: every rank's None")
    gpu_index: Annotated[list[GpuIndex], _Col] = Field(
        description="Per rank, `GpuBinding.gpu_index`, its description's `index`")
    gpu_uuid: Annotated[list[Name], _Col]
    gpu_job_id: Annotated[list[Id | None], _Col] = Field(
        description="Per rank, its GPU's description's `job_id`")
    uuid: Annotated[list[Name], _Col]
    name: Annotated[list[Name], _Col]
    architecture: Annotated[list[Name], _Col]
    min_power_limit_w: Annotated[list[PowerW], _Col]
    max_power_limit_w: Annotated[list[PowerW], _Col]
    default_power_limit_w: Annotated[list[PowerW], _Col]
    supported_memory_clocks_mhz: Annotated[list[_Index], _Col] = Field(
        description="Per rank, its GPU's: its index in `clocks`")
    supported_graphics_clocks_mhz: Annotated[list[_Index], _Col] = Field(
        description="Per rank, its GPU's: its index in `clocks`")
    has_energy_counter: Annotated[list[bool], _Col]
    power_limit_w: Annotated[list[PowerW], _Col]
    schedule_version: Annotated[list[ScheduleVersion | None], _Col]
    controllable: Annotated[list[bool], _Col]
    energy_period_ms: Annotated[list[_Period | None], _Col]

    @model_validator(mode="after")
    def _consistent(self) -> RegisterRankColumns:
        n = len(self.rank)
        for field in (*_COLUMNS, "instructions"):
            column = getattr(self, field)
            if column is not None and len(column) != n:
                raise ValueError(f"column '{field}' has {len(column)} items, 'rank' has {n}: "
                                 "every column has one length")
        for field in _CLOCKS:
            column = getattr(self, field)
            if column and max(column) >= len(self.clocks):
                i = next(i for i, x in enumerate(column) if x >= len(self.clocks))
                raise ValueError(f"{field}[{i}] is {column[i]}; the batch has "
                                 f"{len(self.clocks)} clock lists")
        lengths = [len(c) for c in self.clocks]
        named = sum(lengths[i] for field in _CLOCKS for i in getattr(self, field))
        if named > MAX_CLOCK_ITEMS:
            raise ValueError(f"the ranks name {named} clocks in all (a list each time it is "
                             f"named); at most {MAX_CLOCK_ITEMS}: send them as rows")
        for i, (lo, hi, default) in enumerate(zip(
                self.min_power_limit_w, self.max_power_limit_w, self.default_power_limit_w,
                strict=True)):
            if not lo <= default <= hi:  # (As `GpuDescription._limits_ordered`.)
                raise ValueError(f"rank {i}'s GPU: min_power_limit_w ({lo}), "
                                 f"default_power_limit_w ({default}), max_power_limit_w ({hi}) "
                                 "are not in order")
        return self

    def __len__(self) -> int:
        return len(self.rank)

    def requests(self) -> list[RegisterRank]:
        """The ranks as the rows' `RegisterRank`s (the same models and fields set; no checks)."""
        clocks, node, out = self.clocks, self.node, []
        head = {"v": self.v, "job_id": self.job_id}
        tail = {"uid": self.uid, "join_token": self.join_token}
        for (rank, dp, pp, tp, freqs, instructions, index, gpu_uuid, job, uuid, name, arch, lo,
             hi, default, memory, graphics, counter, limit, schedule, controllable, period) in zip(
                self.rank, self.dp_rank, self.pp_rank, self.tp_rank, self.available_frequencies,
                self.instructions or [None] * len(self.rank), self.gpu_index, self.gpu_uuid,
                self.gpu_job_id, *(getattr(self, f) for f in _DESCRIBED), strict=True):
            info = _built(RankInfo, _INFO_SET, {
                "rank": rank, "dp_rank": dp, "pp_rank": pp, "tp_rank": tp,
                "available_frequencies": list(clocks[freqs]), "instructions": instructions})
            binding = _built(GpuBinding, _BINDING_SET,
                             {"node": node, "gpu_index": index, "gpu_uuid": gpu_uuid})
            gpu = _built(GpuDescription, _description_set(controllable, period), {
                "index": index, "uuid": uuid, "name": name, "architecture": arch,
                "min_power_limit_w": lo, "max_power_limit_w": hi, "default_power_limit_w": default,
                "supported_memory_clocks_mhz": list(clocks[memory]),
                "supported_graphics_clocks_mhz": list(clocks[graphics]),
                "has_energy_counter": counter, "power_limit_w": limit, "job_id": job,
                "schedule_version": schedule, "controllable": controllable,
                "energy_period_ms": period})  # (A list of clocks each, as the rows': none shared.)
            out.append(_built(RegisterRank, _REQUEST_SET, {
                **head, "rank_info": info, "gpu": binding, **tail, "gpu_info": gpu}))
        return out

    @classmethod
    def from_ranks(cls, ranks: list[RegisterRank]) -> RegisterRankColumns | None:
        """The ranks (valid models) in columns; None if they have none (see the module)."""
        if not ranks or len(ranks) > MAX_GPUS_PER_NODE:
            return None
        first = ranks[0]
        shared = (first.job_id, first.join_token, first.uid, first.gpu.node)
        if any((r.job_id, r.join_token, r.uid, r.gpu.node) != shared or r.gpu_info is None
               or r.gpu_info.index != r.gpu.gpu_index for r in ranks):
            return None
        infos = [r.rank_info for r in ranks]
        gpus = [r.gpu_info for r in ranks]
        values: dict[str, Any] = {f: [getattr(i, f) for i in infos] for f in _INFO}
        values |= {f: [getattr(g, f) for g in gpus] for f in _DESCRIBED}
        if sum(len(c) for f in _CLOCKS for c in values[f]) > MAX_CLOCK_ITEMS:
            return None  # (A coordinator refuses it: rows, which it may not fit either.)
        clocks: dict[tuple[int, ...], int] = {}
        for field in _CLOCKS:
            values[field] = [clocks.setdefault(tuple(c), len(clocks)) for c in values[field]]
        instructions = [i.instructions for i in infos]
        return cls.model_construct(
            columns=RANK_COLUMNS_VERSION, job_id=first.job_id, join_token=first.join_token,
            uid=first.uid, node=first.gpu.node, clocks=[list(c) for c in clocks],
            instructions=None if all(i is None for i in instructions) else instructions,
            gpu_index=[r.gpu.gpu_index for r in ranks], gpu_uuid=[r.gpu.gpu_uuid for r in ranks],
            gpu_job_id=[g.job_id for g in gpus if g is not None], **values)


_new = object.__new__
_set = object.__setattr__
_INFO_SET = frozenset(RankInfo.model_fields)
_BINDING_SET = frozenset(GpuBinding.model_fields)
_REQUEST_SET = frozenset(RegisterRank.model_fields)
_DESCRIPTION_SETS = {
    (controllable, known): frozenset(GpuDescription.model_fields) - {
        f for f, default in (("controllable", controllable), ("energy_period_ms", not known))
        if default}
    for controllable in (False, True) for known in (False, True)}
"""A description's fields set: all but its `ADDED` ones at their defaults (as the rows' own,
`AddedFields` sends them only then), by (controllable, energy period known)."""


def _built(cls: Any, fields_set: frozenset[str], values: dict[str, Any]) -> Any:
    """A model of `cls` holding `values` (every field, checked), as validation would build it.

    `model_construct` without its pass over the fields' defaults (it took longer than the
    validation it spares): `tests/wire/test_rank_columns.py` checks the result equals the rows'.
    """
    model = _new(cls)
    _set(model, "__dict__", values)
    _set(model, "__pydantic_fields_set__", set(fields_set))
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


def _description_set(controllable: bool, period: float | None) -> frozenset[str]:
    return _DESCRIPTION_SETS[controllable is not False, period is not None]


def decode_registration(data: bytes) -> RegisterRank | list[RegisterRank]:
    """A rank's registration, or a node's ranks (rows or columns), in one unpack.

    Raises `PayloadError` as `codec.decode` does.
    """
    request = codec.decode_keyed(data, RegisterRank,
                                 {"columns": RegisterRankColumns, "ranks": RegisterRanks})
    if isinstance(request, RegisterRankColumns):
        return request.requests()
    if isinstance(request, RegisterRanks):
        return request.ranks
    assert isinstance(request, RegisterRank)
    return request
