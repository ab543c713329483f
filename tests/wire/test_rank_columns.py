"""`RegisterRankColumns`: a node's rank registrations in columns, decoded beside the rows.

Any valid batch of one job's described ranks round-trips through columns (`from_ranks`,
encoded, `decode_registration`) to the very models the rows decode to: equal, with the same
fields set (what `AddedFields` omits included), encoding to the same bytes. Rows and columns
refuse and accept alike: one hostile value in one field of one rank (or in a node-wide field of
every rank), packed as a peer would in either layout, gets the same verdict, and what is
accepted reads back as the same requests. Columns' own faults (lengths that differ, a clock
index past `clocks`, limits out of order) are refused naming the field; batches that have no
columns (several jobs, an undescribed rank) give None.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_agent.agent.rank_relay import MAX_BATCH_BYTES
from zeus_agent.errors import PayloadError
from zeus_agent.models import MAX_CLOCK_MHZ, MAX_POWER_W, MAX_RANK, RankInfo
from zeus_agent.wire import codec
from zeus_agent.wire.messages import (
    MAX_ENERGY_PERIOD_MS,
    MAX_GPUS_PER_NODE,
    GpuBinding,
    GpuDescription,
    RegisterRank,
)
from zeus_agent.wire.rank_batch import RegisterRanks
from zeus_agent.wire.rank_columns import MAX_CLOCK_ITEMS, RegisterRankColumns, decode_registration

JOB = "2026-12-07-23-00-00+dp16+pp1+tp1+PowerLimitOptimizer"
TOKEN = "a-join-token-of-the-job-0123"
CLOCKS = st.lists(st.integers(0, MAX_CLOCK_MHZ), max_size=6)


@st.composite
def described_ranks(draw: Any) -> list[RegisterRank]:
    """One job's ranks on one node, each with its GPU's description (valid models)."""
    n = draw(st.integers(1, 9))
    job, token = draw(st.sampled_from([(JOB, TOKEN), ("j", None)]))
    uid = draw(st.none() | st.integers(0, 2**32 - 1))
    ranks = draw(st.lists(st.integers(0, MAX_RANK), min_size=n, max_size=n, unique=True))
    out = []
    for i, rank in enumerate(ranks):
        lo = draw(st.integers(1, MAX_POWER_W))
        hi = draw(st.integers(lo, MAX_POWER_W))
        gpu = draw(st.integers(0, MAX_RANK))
        description = GpuDescription(
            index=gpu, uuid=f"GPU-{i}", name=draw(st.sampled_from(["NVIDIA A40", "é" * 3])),
            architecture="Ampere", min_power_limit_w=lo, max_power_limit_w=hi,
            default_power_limit_w=draw(st.integers(lo, hi)),
            supported_memory_clocks_mhz=draw(CLOCKS), supported_graphics_clocks_mhz=draw(CLOCKS),
            has_energy_counter=draw(st.booleans()), power_limit_w=draw(st.integers(lo, hi)),
            job_id=draw(st.none() | st.just(job)),
            schedule_version=draw(st.none() | st.integers(0, 2**31 - 1)),
            controllable=draw(st.booleans()),
            energy_period_ms=draw(st.none() | st.floats(0, MAX_ENERGY_PERIOD_MS)))
        out.append(RegisterRank(
            job_id=job, join_token=token, uid=uid,
            rank_info=RankInfo(rank=rank, dp_rank=draw(st.integers(0, MAX_RANK)), pp_rank=0,
                               tp_rank=draw(st.integers(0, 3)),
                               available_frequencies=draw(CLOCKS),
                               instructions=draw(st.none() | st.lists(st.sampled_from(
                                   ["forward", "backward", ""]), max_size=3))),
            gpu=GpuBinding(node="node0007", gpu_index=gpu,
                           gpu_uuid=draw(st.sampled_from(["", f"GPU-{i}"]))),
            gpu_info=description))
    return out


def assert_same_requests(got: list[RegisterRank], expected: list[RegisterRank],
                         fields_set: bool = True) -> None:
    """The same models, fields set and bytes (what each rank's handling can see).

    `fields_set` False: a description's `ADDED` fields may differ there (rows sent at their
    default, which no agent does: columns cannot say a value was sent, only what it is).
    """
    assert got == expected
    for a, b in zip(got, expected, strict=True):
        for x, y in ((a, b), (a.rank_info, b.rank_info), (a.gpu, b.gpu),
                     (a.gpu_info, b.gpu_info)):
            assert type(x) is type(y)
            if fields_set or x is not a.gpu_info:
                assert x.model_fields_set == y.model_fields_set  # type: ignore[union-attr]
            assert x.model_dump() == y.model_dump()  # type: ignore[union-attr]
        assert codec.encode(a) == codec.encode(b)
        assert a.rank_info.available_frequencies is not b.rank_info.available_frequencies
    clocks = [id(c) for r in got for c in (r.rank_info.available_frequencies,
                                           r.gpu_info.supported_memory_clocks_mhz,  # type: ignore[union-attr]
                                           r.gpu_info.supported_graphics_clocks_mhz)]  # type: ignore[union-attr]
    assert len(set(clocks)) == len(clocks)  # (Each its own list, as the rows'.)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ranks=described_ranks())
def test_any_described_batch_round_trips_through_columns(ranks: list[RegisterRank]) -> None:
    rows = decode_registration(codec.encode(RegisterRanks(ranks=ranks)))
    columns = RegisterRankColumns.from_ranks(ranks)
    assert columns is not None and len(columns) == len(ranks)
    payload = codec.encode(columns)
    decoded = decode_registration(payload)
    assert isinstance(rows, list) and isinstance(decoded, list)
    assert_same_requests(decoded, rows)
    assert len(set(map(tuple, columns.clocks))) == len(columns.clocks)  # (Each list once.)


def test_batches_without_columns_give_none() -> None:
    base = [rank_model(0), rank_model(1)]
    assert RegisterRankColumns.from_ranks(base) is not None
    assert RegisterRankColumns.from_ranks([]) is None
    for change in ({"job_id": "other"}, {"join_token": None}, {"uid": 7}, {"gpu_info": None},
                   {"gpu": GpuBinding(node="node0008", gpu_index=1)},
                   {"gpu": GpuBinding(node="node0007", gpu_index=5)}):
        assert RegisterRankColumns.from_ranks([base[0], base[1].model_copy(update=change)]) \
            is None, change


def rank_model(i: int) -> RegisterRank:
    return codec.validate(RegisterRank, rank_row(i))


def rank_row(i: int) -> dict[str, Any]:
    """A described rank as an agent packs it in rows (`model_dump`, what `encode` sends)."""
    return RegisterRank(
        job_id=JOB, join_token=TOKEN,
        rank_info=RankInfo(rank=i, dp_rank=i, pp_rank=0, tp_rank=0,
                           available_frequencies=[1740, 210]),
        gpu=GpuBinding(node="node0007", gpu_index=i, gpu_uuid=f"GPU-{i}"),
        gpu_info=GpuDescription(
            index=i, uuid=f"GPU-{i}", name="NVIDIA A40", architecture="Ampere",
            min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
            supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
            has_energy_counter=True, power_limit_w=300, energy_period_ms=100.0),
    ).model_dump()


INFO = ("rank", "dp_rank", "pp_rank", "tp_rank")
DESCRIBED = ("uuid", "name", "architecture", "min_power_limit_w", "max_power_limit_w",
             "default_power_limit_w", "has_energy_counter", "power_limit_w",
             "schedule_version", "controllable", "energy_period_ms")
CLOCK_FIELDS = (("rank_info", "available_frequencies"), ("gpu_info", "supported_memory_clocks_mhz"),
                ("gpu_info", "supported_graphics_clocks_mhz"))


def in_columns(rows: dict[str, Any]) -> dict[str, Any]:
    """The rows' content as a peer would pack it in columns (values carried as they are).

    Node-wide fields from the first rank; each rank's clock lists their own entries.
    """
    ranks = rows["ranks"]
    first = ranks[0]
    clocks: list[Any] = []
    out: dict[str, Any] = {
        "v": rows["v"], "columns": 1, "job_id": first["job_id"],
        "join_token": first["join_token"], "uid": first["uid"], "node": first["gpu"]["node"],
        **{f: [r["rank_info"][f] for r in ranks] for f in INFO},
        "instructions": [r["rank_info"]["instructions"] for r in ranks],
        "gpu_index": [r["gpu"]["gpu_index"] for r in ranks],
        "gpu_uuid": [r["gpu"]["gpu_uuid"] for r in ranks],
        "gpu_job_id": [r["gpu_info"]["job_id"] for r in ranks],
        **{f: [r["gpu_info"].get(f, GpuDescription.model_fields[f].default) for r in ranks]
           for f in DESCRIBED}}
    for part, field in CLOCK_FIELDS:
        out[field] = []
        for r in ranks:
            out[field].append(len(clocks))
            clocks.append(r[part][field])
    out["clocks"] = clocks
    return out


def rows_payload(n: int = 3) -> dict[str, Any]:
    return {"v": 1, "ranks": [rank_row(i) for i in range(n)]}


def verdicts(rows: dict[str, Any]) -> tuple[Any, Any]:
    """What `decode_registration` makes of the rows and of the same content in columns."""
    out: list[Any] = []
    for obj in (rows, in_columns(rows)):
        try:
            out.append(decode_registration(msgpack.packb(obj)))
        except PayloadError:
            out.append("refused")
    return out[0], out[1]


HOSTILE_INTS: list[Any] = [
    math.nan, math.inf, -1, -0.0, 0, 1, 0.5, 1.0, 299.0, True, False, None, "1", "x", b"1", [],
    {}, 2**63, 2**64 - 1, MAX_RANK, MAX_RANK + 1, MAX_POWER_W, MAX_POWER_W + 1, 2**31, 250,
]  # fmt: skip
HOSTILE_TEXT: list[Any] = ["", "GPU-x", "é" * 255, "é" * 256, "a\nb", "x\0", None, 5, b"x"]
HOSTILE_CLOCKS: list[Any] = [[], [0], [-1], [MAX_CLOCK_MHZ + 1], [1.5], [1.0], [True], "x",
                             None, [None], [[1]], list(range(1025)), {"a": 1}]


@pytest.mark.parametrize("field", [f"rank_info.{f}" for f in INFO] + [
    f"gpu_info.{f}" for f in DESCRIBED if f not in ("uuid", "name", "architecture")])
@pytest.mark.parametrize("value", HOSTILE_INTS, ids=repr)
def test_one_hostile_value_gets_the_same_verdict_in_either_layout(field: str,
                                                                  value: Any) -> None:
    rows = rows_payload()
    part, name = field.split(".")
    rows["ranks"][1][part][name] = value
    as_rows, as_columns = verdicts(rows)
    assert as_rows == as_columns, (field, value)
    if as_rows != "refused":
        assert_same_requests(as_columns, as_rows, fields_set=False)


@pytest.mark.parametrize("value", HOSTILE_INTS, ids=repr)
def test_a_hostile_gpu_index_gets_the_same_verdict_in_either_layout(value: Any) -> None:
    rows = rows_payload()
    rows["ranks"][2]["gpu"]["gpu_index"] = rows["ranks"][2]["gpu_info"]["index"] = value
    assert verdicts(rows)[0] == verdicts(rows)[1]


@pytest.mark.parametrize("field", ["gpu.gpu_uuid", "gpu_info.uuid", "gpu_info.name",
                                   "gpu_info.architecture", "gpu_info.job_id"])
@pytest.mark.parametrize("value", HOSTILE_TEXT, ids=repr)
def test_a_hostile_text_gets_the_same_verdict_in_either_layout(field: str, value: Any) -> None:
    rows = rows_payload()
    part, name = field.split(".")
    rows["ranks"][0][part][name] = value
    as_rows, as_columns = verdicts(rows)
    assert as_rows == as_columns, (field, value)


@pytest.mark.parametrize("field", [".".join(f) for f in CLOCK_FIELDS])
@pytest.mark.parametrize("value", HOSTILE_CLOCKS, ids=repr)
def test_a_hostile_clock_list_gets_the_same_verdict_in_either_layout(field: str,
                                                                     value: Any) -> None:
    rows = rows_payload()
    part, name = field.split(".")
    rows["ranks"][2][part][name] = value
    as_rows, as_columns = verdicts(rows)
    assert as_rows == as_columns, (field, value)


@pytest.mark.parametrize("value", [None, [], ["forward"], ["é" * 255], ["é" * 256], [5], "x",
                                   [None], ["a\nb"]], ids=repr)
def test_hostile_instructions_get_the_same_verdict_in_either_layout(value: Any) -> None:
    rows = rows_payload()
    rows["ranks"][1]["rank_info"]["instructions"] = value
    as_rows, as_columns = verdicts(rows)
    assert as_rows == as_columns, value


@pytest.mark.parametrize(("field", "value"), [
    ("job_id", None), ("job_id", "a\nb"), ("job_id", 5), ("join_token", "short"),
    ("join_token", "x" * 65), ("join_token", "has space-in-it-0123"), ("uid", -1),
    ("uid", 2**32), ("uid", "1"), ("node", "a\nb"), ("node", None), ("node", "é" * 256),
])  # fmt: skip
def test_a_hostile_node_wide_field_gets_the_same_verdict_in_either_layout(field: str,
                                                                          value: Any) -> None:
    rows = rows_payload()
    for rank in rows["ranks"]:
        if field == "node":
            rank["gpu"]["node"] = value
        else:
            rank[field] = value
    as_rows, as_columns = verdicts(rows)
    if value == "1":  # (Lax: the number, in either layout.)
        assert_same_requests(as_columns, as_rows)
    else:
        assert (as_rows, as_columns) == ("refused", "refused")


def test_limits_out_of_order_are_refused_in_either_layout() -> None:
    for lo, default, hi in ((300, 300, 100), (100, 50, 300), (100, 301, 300)):
        rows = rows_payload()
        rows["ranks"][1]["gpu_info"].update(min_power_limit_w=lo, default_power_limit_w=default,
                                            max_power_limit_w=hi)
        assert verdicts(rows) == ("refused", "refused")


def valid_columns() -> dict[str, Any]:
    return in_columns(rows_payload())


@pytest.mark.parametrize(("change", "field"), [
    ({"rank": [0, 1]}, ""), ({"clocks": []}, ""), ({"available_frequencies": [0, 1, 9]}, ""),
    ({"instructions": [None]}, ""), ({"energy_period_ms": [1.0] * 4}, ""),
    ({"supported_memory_clocks_mhz": [0, 1, -1]}, "supported_memory_clocks_mhz.2"),
    ({"columns": 2}, "columns"), ({"v": 2}, "v"), ({"extra": []}, "extra"),
    ({"rank": []}, "rank"), ({"gpu_uuid": ["a", "b", 5]}, "gpu_uuid.2"),
    ({"rank": list(range(MAX_GPUS_PER_NODE + 1))}, "rank"),
])  # fmt: skip
def test_bad_columns_are_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_registration(msgpack.packb({**valid_columns(), **change}))
    assert (caught.value.field or "") == field


def test_rows_and_single_ranks_still_decode() -> None:
    rows = rows_payload()
    decoded = decode_registration(msgpack.packb(rows))
    assert isinstance(decoded, list) and [r.rank_info.rank for r in decoded] == [0, 1, 2]
    one = decode_registration(msgpack.packb(rank_row(4)))
    assert isinstance(one, RegisterRank) and one.rank_info.rank == 4
    wrapped = copy.deepcopy(rows)
    wrapped["columns"] = 1  # (A key decides the layout: columns, then refused as such.)
    with pytest.raises(PayloadError):
        decode_registration(msgpack.packb(wrapped))


def test_columns_cover_every_field_of_the_rows_models() -> None:
    """A field added to a rank's models must get its column (else columns would drop it), and
    the models built without validation must have nothing else to set (`_built`)."""
    columns = set(RegisterRankColumns.model_fields)
    covered = {
        RegisterRank: {"v": "v", "job_id": "job_id", "join_token": "join_token", "uid": "uid",
                       "rank_info": None, "gpu": None, "gpu_info": None},
        RankInfo: {f: f for f in ("rank", "dp_rank", "pp_rank", "tp_rank",
                                  "available_frequencies", "instructions")},
        GpuBinding: {"node": "node", "gpu_index": "gpu_index", "gpu_uuid": "gpu_uuid"},
        GpuDescription: {**{f: f for f in (*DESCRIBED, "supported_memory_clocks_mhz",
                                           "supported_graphics_clocks_mhz")},
                         "index": "gpu_index", "job_id": "gpu_job_id"},
    }
    for cls, fields in covered.items():
        assert set(cls.model_fields) == set(fields), cls
        assert {c for c in fields.values() if c is not None} <= columns
        assert cls.__pydantic_post_init__ is None and not cls.__private_attributes__
        assert not cls.__pydantic_root_model__
    assert GpuDescription.ADDED == ("controllable", "energy_period_ms")  # (`_DESCRIPTION_SETS`)


def test_the_largest_batch_has_columns_whatever_its_clocks() -> None:
    """`MAX_GPUS_PER_NODE` ranks, each with 3 clock lists of its own, decode as their rows."""
    ranks = []
    for i in range(MAX_GPUS_PER_NODE):
        row = rank_row(i)
        row["rank_info"]["available_frequencies"] = [i]
        row["gpu_info"]["supported_memory_clocks_mhz"] = [i, 1]
        row["gpu_info"]["supported_graphics_clocks_mhz"] = [i, 2]
        ranks.append(codec.validate(RegisterRank, row))
    columns = RegisterRankColumns.from_ranks(ranks)
    assert columns is not None and len(columns.clocks) == 3 * MAX_GPUS_PER_NODE
    decoded = decode_registration(codec.encode(columns))
    assert isinstance(decoded, list)
    assert_same_requests(decoded, ranks)


def hostile_interned(ranks: int, clocks: int) -> dict[str, Any]:
    """Columns whose every rank names one clock list of `clocks` items, three times over."""
    out = valid_columns()
    n = len(out["rank"])
    for field, column in out.items():  # (Every column stretched to `ranks` from its last.)
        if isinstance(column, list) and len(column) == n and field != "clocks":
            out[field] = [column[i % n] for i in range(ranks)]
    out.update(rank=list(range(ranks)), gpu_index=list(range(ranks)),
               uuid=[f"GPU-{i}" for i in range(ranks)],
               gpu_uuid=[f"GPU-{i}" for i in range(ranks)],
               clocks=[list(range(1000, 1000 + clocks))])
    for field in ("available_frequencies", "supported_memory_clocks_mhz",
                  "supported_graphics_clocks_mhz"):
        out[field] = [0] * ranks
    return out


def test_interned_clocks_expand_no_further_than_rows_could_carry() -> None:
    """One clock list named by every rank must not make a small payload a huge one.

    1,024 ranks naming one list of 1,024 clocks 3 times each: 33-75 KB in columns, 3.1 million
    clocks once built (9.8 MB as rows; each rank's record keeps its 1,024: 6.5 MB of records in
    the bucket and in every replica). Refused: no more clocks than `MAX_CLOCK_ITEMS`, what the
    largest rows batch an agent sends could hold; a batch that would expand further has no
    columns.
    """
    payload = msgpack.packb(hostile_interned(MAX_GPUS_PER_NODE, 1024))
    assert len(payload) < 100_000
    with pytest.raises(PayloadError, match="clock"):
        decode_registration(payload)
    per_rank = MAX_CLOCK_ITEMS // (3 * MAX_GPUS_PER_NODE)  # (Just within: taken.)
    decoded = decode_registration(msgpack.packb(hostile_interned(MAX_GPUS_PER_NODE, per_rank)))
    assert isinstance(decoded, list) and len(decoded) == MAX_GPUS_PER_NODE
    ranks = [codec.validate(RegisterRank, row) for row in (rank_row(0), rank_row(1))]
    assert RegisterRankColumns.from_ranks(ranks) is not None
    big = list(range(1000, 2024))
    ranks = []
    for i in range(MAX_GPUS_PER_NODE):
        row = rank_row(i)
        row["rank_info"]["available_frequencies"] = big
        row["gpu_info"]["supported_graphics_clocks_mhz"] = big
        ranks.append(codec.validate(RegisterRank, row))
    assert RegisterRankColumns.from_ranks(ranks) is None  # (Rows, rank by rank: too big.)
    assert RegisterRankColumns.from_ranks(ranks[:200]) is not None
    assert MAX_CLOCK_ITEMS == 524_288 <= MAX_BATCH_BYTES  # (The figure `clocks` says.)
