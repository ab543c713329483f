"""Rank entries of both layouts, served by a coordinator against a real nats-server and agent.

A job recorded by a coordinator of layout 2 (one `v.rank.` entry per rank, values `"v": 2`)
is known, its remaining ranks are recorded in the same form (their keys are what makes them
unique to a replica of layout 2 still running), it starts, and a fresh replica loads it whole.
A job registered now has its node's ranks in one `v.ranks.` entry, with a `rank.` key each,
and a fresh replica loads it whole too; so does a job imported from a `jobs.json`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from coordinator.jobs import JobRegistry, RankRecord
from coordinator.state import records
from tests.shell.coordinator_kit import (
    JOIN_TOKENS,
    NODE,
    ask,
    job_request,
    rank_request,
    register_job,
    start,
    state_keys,
    stop,
    wait_for,
)
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import PowerLimitOptions, Reply
from zeus_agent.wire.rank_batch import RegisterRanks

OPTIONS = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1, profile_steps=2)


def _v2(value: bytes) -> bytes:
    return json.dumps({**json.loads(value), "v": 2}).encode()


async def _register(nc: Any, job_id: str, ranks: list[int]) -> None:
    reply = await ask(nc, subjects.coord_register_rank(NODE),
                      RegisterRanks(ranks=[rank_request(job_id, r) for r in ranks]))
    assert reply.ok, reply
    assert all(Reply.model_validate(r).ok for r in reply.result["replies"]), reply


def _their(keys: set[str], job_id: str) -> set[str]:
    h = records.job_hash(job_id)
    return {k for k in keys if h in k and k.startswith(("v.rank", "rank."))}


async def _loaded(nats_server: Any, state_dir: Path, job_id: str) -> tuple[list[int], bool]:
    """The ranks and layout of the job as a fresh replica on the same bucket loads it."""
    coord, task = await start(nats_server, state_dir)
    try:
        await wait_for(lambda: coord.jobs.record(job_id) is not None)
        record = coord.jobs.record(job_id)
        return sorted(record.ranks), record.node_ranks
    finally:
        await stop(coord, task)


async def test_a_job_of_the_old_layout_is_served_and_loaded(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "c")
    try:
        token = "token-old-layout-0123456789"
        record = JobRegistry().register_job(job_request(dp=2, power_limit=OPTIONS), 0.0, NODE,
                                            datetime(2026, 1, 1), join_token=token)
        job_id = record.job_id
        JOIN_TOKENS[job_id] = token
        rank0 = RankRecord(rank_request(job_id, 0).rank_info, rank_request(job_id, 0).gpu)
        kv = coord.link.state.kv
        await kv.create(records.job_key(job_id), _v2(records.encode_job(record)))
        await kv.create(records.gpu_key(job_id, NODE, 0), _v2(records.encode_gpu(job_id, 0)))
        await kv.create(records.rank_key(job_id, 0),
                        _v2(records.encode_rank(job_id, rank0, (100, 300), None)))
        await wait_for(lambda: (r := coord.jobs.record(job_id)) is not None and 0 in r.ranks)
        assert not coord.jobs.record(job_id).node_ranks

        await _register(nc, job_id, [1])
        assert _their(await state_keys(coord), job_id) == {
            records.rank_key(job_id, 0), records.rank_key(job_id, 1)}
        await wait_for(lambda: job_id in coord.optimisers)
        await coord.progress.record(job_id, "windows", [])
        await coord.failures.quarantine(records.job_key(job_id), "a test's", job_id)
        # A replica of layout 2 still serving the job reads what was recorded here (it drops
        # values of a layout it does not know: it would never see rank 1 nor start the job,
        # would start it afresh after a handover, would not see it set aside).
        h = records.job_hash(job_id)
        for key in (records.rank_key(job_id, 1), records.gpu_key(job_id, NODE, 1),
                    records.progress_key(job_id), records.quarantine_key(h)):
            assert json.loads((await kv.get(key)).value)["v"] in (1, 2), key
    finally:
        await stop(coord, task)
    assert await _loaded(nats_server, tmp_path / "c", job_id) == ([0, 1], False)


async def test_a_new_jobs_node_batch_is_one_entry_and_loads(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "c")
    try:
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
        await _register(nc, job_id, [0, 1])
        assert _their(await state_keys(coord), job_id) == {
            records.node_key(job_id, 0), records.rank_claim_key(job_id, 0),
            records.rank_claim_key(job_id, 1)}
        await wait_for(lambda: job_id in coord.optimisers)
        assert coord.link.state.own_entries == {}  # (its echo came back: bound, not decoded)
    finally:
        await stop(coord, task)
    assert await _loaded(nats_server, tmp_path / "c", job_id) == ([0, 1], True)


async def test_an_imported_jobs_ranks_are_node_entries(
        nats_server: Any, agent: Any, tmp_path: Path) -> None:
    """A `jobs.json` of the file store before JetStream: its job is recorded at layout 3."""
    registry = JobRegistry()
    record = registry.register_job(job_request(dp=2, power_limit=OPTIONS), 0.0, NODE,
                                   datetime(2026, 1, 1), join_token="token-imported-0123456")
    for r in (0, 1):
        record.add_rank(RankRecord(rank_request(record.job_id, r).rank_info,
                                   rank_request(record.job_id, r).gpu))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "jobs.json").write_text(json.dumps(registry.snapshot()))
    coord, task = await start(nats_server, tmp_path / "c")
    try:
        await wait_for(lambda: (r := coord.jobs.record(record.job_id)) is not None
                       and len(r.ranks) == 2)
        job_id = record.job_id
        assert _their(await state_keys(coord), job_id) == {
            records.node_key(job_id, 0), records.node_key(job_id, 1),
            records.rank_claim_key(job_id, 0), records.rank_claim_key(job_id, 1)}
    finally:
        await stop(coord, task)
