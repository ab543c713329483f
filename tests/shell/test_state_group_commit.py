"""Registrations' creates in atomic batches (`group_commit`) against a real nats-server.

A burst of ranks is written in far fewer batches than ranks, each rank's two keys stored; a
batch the server refuses (a rank's GPU taken, a retry) is sorted out one key at a time: the
conflicting rank is refused, the retry reported as such, and every other rank of that batch
still registered; a stream that takes no batches gets the creates one by one; without an
answer, the units waiting behind a batch are refused at once.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from coordinator.jobs import DuplicateError
from coordinator.state import records
from coordinator.state.group_commit import REFUSED, GroupCommit
from coordinator.state.jetstream import JetStreamState
from tests.shell.node_entries_kit import rank_record

JOB = "1765000000+dp64+pp1+tp1+PowerLimitOptimizer"


async def _state(nc: Any) -> JetStreamState:
    state = JetStreamState(nc, "zeus", bucket=f"gc-{uuid.uuid4().hex[:12]}")
    await state.open()
    return state


async def _stored(state: JetStreamState) -> int:
    return int((await state.nc.jsm().stream_info(f"KV_{state.bucket}")).state.messages)


async def test_a_burst_of_ranks_goes_in_few_batches(nc: Any) -> None:
    state = await _state(nc)
    try:
        assert state.batches is not None and state.batches.enabled
        created = await asyncio.gather(*(state.create_rank(JOB, rank_record(r), (100, 300), 1.0)
                                         for r in range(64)))
        assert created == [True] * 64
        assert await _stored(state) == 128  # every rank's GPU key and rank key
        assert 1 <= state.batches.batches < 16
        entry = await state.kv.get(records.rank_key(JOB, 63))
        assert records.decode(entry.key, entry.value, False, 0).rank == rank_record(63)
        gpu = await state.kv.get(records.gpu_key(JOB, "n7", 7))
        assert records.rank_of_gpu_value(gpu.value) == 63
    finally:
        await state.close()


async def test_a_refused_batch_is_sorted_out_one_key_at_a_time(nc: Any) -> None:
    state = await _state(nc)
    try:
        assert await state.create_rank(JOB, rank_record(0))
        before = state.batches.batches if state.batches else 0
        results = await asyncio.gather(
            state.create_rank(JOB, rank_record(0)),  # a retry: recorded identically
            state.create_rank(JOB, rank_record(1, node="n0", gpu=0)),  # GPU 0 of n0 is rank 0's
            *(state.create_rank(JOB, rank_record(r)) for r in range(2, 10)),
            return_exceptions=True)
        assert results[0] is False
        assert isinstance(results[1], DuplicateError)
        assert results[2:] == [True] * 8
        assert state.batches is not None and state.batches.batches == before  # refused
        assert await _stored(state) == 2 * 9  # ranks 0, 2..9; rank 1 left nothing
    finally:
        await state.close()


async def test_without_batches_the_keys_are_created_one_by_one(nc: Any) -> None:
    state = await _state(nc)
    try:
        assert state.batches is not None
        state.batches.enabled = False
        created = await asyncio.gather(*(state.create_rank(JOB, rank_record(r)) for r in range(8)))
        assert created == [True] * 8 and state.batches.batches == 0
        assert await _stored(state) == 16
        with pytest.raises(DuplicateError):
            await state.create_rank(JOB, rank_record(3, node="n0", gpu=4))
    finally:
        await state.close()


class _Silent:
    """A NATS connection that takes publishes and never acknowledges (JetStream gone)."""

    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        self.published.append(subject)


async def test_units_behind_an_unanswered_batch_are_refused_at_once() -> None:
    """Without an answer, the units waiting behind the batch in flight do not each wait out a
    timeout in turn: they are refused (never sent) and their callers go one key at a time."""
    silent = _Silent()
    commit = GroupCommit(silent, "b", timeout_s=0.05, max_messages=2, max_in_flight=1)
    commit.enabled, commit._inbox = True, "_INBOX.x"
    outcomes = await asyncio.wait_for(asyncio.gather(
        *(commit.create([(f"k{i}", b"v")]) for i in range(6))), 10)
    assert not outcomes[0].committed and outcomes[0].batch_id is not None  # sent: unknown
    assert outcomes[1].batch_id == outcomes[0].batch_id  # (two units to a batch)
    assert outcomes[2:] == [REFUSED] * 4  # never sent
    assert silent.published == ["$KV.b.k0", "$KV.b.k1"]
