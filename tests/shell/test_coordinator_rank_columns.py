"""A node's ranks in columns (`RegisterRankColumns`), against a real nats-server.

The coordinator answers a batch in columns exactly as the same batch in rows: the same reply
per rank (a retry, a GPU taken by another rank, a rank through another node's subject) and the
same keys in the state bucket. An agent's `RankRelay` sends columns to a coordinator that reads
them (one request), and to one that predates them (here: the coordinator's decoding of rows
only, as before columns) sends the batch again in rows, then rows only for a while. Columns
whose shared clock lists would expand past what rows could carry are refused, nothing recorded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from coordinator.service import endpoints
from coordinator.state import records
from tests.shell.coordinator_kit import (
    NODE,
    ask,
    rank_request,
    register_job,
    state_keys,
)
from tests.shell.node_batch_kit import described
from zeus_agent.agent.rank_relay import RankRelay
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import RegisterRank, Reply
from zeus_agent.wire.rank_batch import RegisterRanks
from zeus_agent.wire.rank_columns import RegisterRankColumns


def _columns(requests: list[RegisterRank]) -> RegisterRankColumns:
    columns = RegisterRankColumns.from_ranks(requests)
    assert columns is not None
    return columns


def _seen(reply: Reply, job_id: str) -> list[tuple[bool, str, dict[str, Any]]]:
    """Each rank's reply, the job's id left out (two jobs are compared)."""
    assert reply.ok, reply
    out = []
    for each in reply.result["replies"]:
        one = Reply.model_validate(each)
        result = {k: v for k, v in one.result.items() if k != "job_id"}
        assert one.result.get("job_id", job_id) == job_id
        out.append((one.ok, one.code, result))
    return out


async def test_columns_are_answered_as_the_same_rows(coord: Any, nc: Any) -> None:
    subject = subjects.coord_register_rank(NODE)
    seen = []
    for layout in ("rows", "columns"):
        job_id = await register_job(nc, dp=4, job_metadata=layout)
        pack: Any = RegisterRanks if layout == "rows" else None

        def batch(requests: list[RegisterRank], pack: Any = pack) -> Any:
            return pack(ranks=requests) if pack else _columns(requests)

        first = await ask(nc, subject, batch([described(rank_request(job_id, 0))]))
        second = await ask(nc, subject, batch([
            described(rank_request(job_id, 1)),  # GPU 1 of NODE
            described(rank_request(job_id, 0)),  # a retry of rank 0: the same GPU
            described(rank_request(job_id, 3, gpu=0)),  # rank 0's GPU
        ]))
        elsewhere = await ask(nc, subject, batch([
            described(rank_request(job_id, 2, node="elsewhere", gpu=0))]))
        h = records.job_hash(job_id)
        keys = sorted(k.replace(h, "<h>") for k in await state_keys(coord) if h in k)
        seen.append((_seen(first, job_id), _seen(second, job_id), _seen(elsewhere, job_id),
                     sorted(coord.jobs.record(job_id).ranks), keys))
    rows, columns = seen
    assert rows == columns
    assert [(ok, code) for ok, code, _ in rows[1]] == [(True, ""), (True, ""),
                                                       (False, "duplicate")]
    assert [(ok, code) for ok, code, _ in rows[2]] == [(False, "forbidden")]
    assert rows[3] == [0, 1] and sum(k.startswith("rank.") for k in rows[4]) == 2


def _relay(nc: Any, sent: list[dict[str, Any]], gpus: int = 2) -> RankRelay:
    async def send(subject: str, payload: bytes) -> Reply:
        sent.append(codec.unpack(payload))
        msg = await nc.request(subject, payload, timeout=8)
        return codec.decode(msg.data, Reply)

    return RankRelay(send, subjects.coord_register_rank(NODE), lambda: gpus, window_s=60)


async def test_an_agent_sends_columns_to_a_coordinator_that_reads_them(coord: Any,
                                                                        nc: Any) -> None:
    job_id = await register_job(nc, dp=2, job_metadata="relayed")
    sent: list[dict[str, Any]] = []
    relay = _relay(nc, sent)
    replies = await asyncio.wait_for(asyncio.gather(
        *(relay.relay(described(rank_request(job_id, r))) for r in (1, 0))), 10)
    assert [(r.ok, r.result["rank"]) for r in replies] == [(True, 1), (True, 0)]
    assert len(sent) == 1 == relay.requests and sent[0]["columns"] == 1
    assert sorted(coord.jobs.record(job_id).ranks) == [0, 1]


def _rows_only(data: bytes) -> RegisterRank | list[RegisterRank]:
    """The coordinator's decoding before columns (a `RegisterRank` or `RegisterRanks`)."""
    request = codec.decode_either(data, RegisterRank, RegisterRanks, "ranks")
    return request.ranks if isinstance(request, RegisterRanks) else request


async def test_an_agent_sends_rows_to_a_coordinator_that_predates_columns(
        coord: Any, nc: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(endpoints, "decode_registration", _rows_only)
    sent: list[dict[str, Any]] = []
    relay = _relay(nc, sent)
    for dp, metadata in ((2, "older-coordinator"), (2, "again")):
        job_id = await register_job(nc, dp=dp, job_metadata=metadata)
        replies = await asyncio.wait_for(asyncio.gather(
            *(relay.relay(described(rank_request(job_id, r))) for r in (0, 1))), 10)
        assert [(r.ok, r.result["rank"]) for r in replies] == [(True, 0), (True, 1)]
        assert sorted(coord.jobs.record(job_id).ranks) == [0, 1]
    # The first batch: columns (refused), then rows (taken); the next: rows at once.
    assert ["columns" in s for s in sent] == [True, False, False]
    assert all("ranks" in s for s in sent[1:]) and relay.requests == 3


async def test_interned_clocks_that_would_expand_past_rows_are_refused_unrecorded(
        coord: Any, nc: Any) -> None:
    """200 ranks naming one list of 1,024 clocks three times each: 10 KB, 614,400 clocks.

    Every rank's record would keep its 1,024 (as rows, 1.9 MB: more than one message). The
    coordinator refuses the batch (`bad_request`) before anything is recorded.
    """
    job_id = await register_job(nc, dp=200, job_metadata="interned")
    columns = _columns([described(rank_request(job_id, r, gpu=r)) for r in range(200)])
    columns.clocks = [list(range(1000, 2024))]
    for field in ("available_frequencies", "supported_memory_clocks_mhz",
                  "supported_graphics_clocks_mhz"):
        setattr(columns, field, [0] * 200)
    payload = codec.encode(columns)
    assert len(payload) < 20_000
    before = await state_keys(coord)
    reply = await ask(nc, subjects.coord_register_rank(NODE), payload)
    assert (reply.ok, reply.code) == (False, "bad_request") and "clocks" in reply.error
    assert not coord.jobs.record(job_id).ranks
    assert await state_keys(coord) == before
