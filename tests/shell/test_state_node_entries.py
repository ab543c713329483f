"""Node entries (layout 3) against a real nats-server: a node's ranks in one followed entry.

A node's ranks go in one atomic batch: a `gpu.` and a `rank.` key each (each created once, as
before) and one `v.ranks.` entry, the only one replicas follow. A batch refused (a GPU or rank
taken by another replica's registration) is sorted out rank by rank, which tells a retry from
a conflict; two replicas racing for one GPU bind it once; a job's removal purges both forms;
`read_jobs` (the CLI tools') reads both forms, a job of the old layout included.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.jobs import DuplicateError
from coordinator.state import records
from tests.shell.node_entries_kit import JOB
from tests.shell.node_entries_kit import items as _items
from tests.shell.node_entries_kit import job_record as _job
from tests.shell.node_entries_kit import keys as _keys
from tests.shell.node_entries_kit import rank_record as _rank
from tests.shell.node_entries_kit import states as _states


async def test_a_nodes_ranks_go_in_one_entry(nc: Any) -> None:
    (state,) = await _states(nc)
    try:
        assert await state.create_job(_job())
        outcome = await state.create_node_ranks(JOB, _items(range(8)))
        assert outcome.committed
        h = records.job_hash(JOB)
        keys = await _keys(state)
        assert [k for k in keys if k.startswith("v.")] == [f"v.job.{h}", f"v.ranks.{h}.0"]
        assert sum(k.startswith(f"rank.{h}.") for k in keys) == 8
        assert sum(k.startswith(f"gpu.{h}.") for k in keys) == 8
        entry = await state.kv.get(records.node_key(JOB, 0))
        change = records.decode(entry.key, entry.value, False, 0)
        assert [one.rank for one in change.ranks] == [_rank(r) for r in range(8)]
        assert state.own_entries[entry.key] == (JOB, [_rank(r) for r in range(8)])
        jobs = await state.read_jobs()
        assert sorted(jobs[JOB].ranks) == list(range(8))
    finally:
        await state.close()


async def test_a_refused_node_batch_is_sorted_out_rank_by_rank(nc: Any) -> None:
    """Another replica took rank 3 (on another GPU) and rank 5's GPU is this batch's rank
    5 already (a retry): the batch is refused whole; alone, rank 3 is refused, rank 5 is a
    retry, and every other rank is recorded, each in a node entry of its own."""
    mine, other = await _states(nc, 2)
    try:
        assert await other.create_rank(JOB, _rank(3, node="n9", gpu=0), node_ranks=True)
        assert await other.create_rank(JOB, _items(range(5, 6))[0][0], (100, 300), 1.0,
                                       node_ranks=True)
        outcome = await mine.create_node_ranks(JOB, _items(range(8)))
        assert not outcome.committed and not mine.own_entries
        results = await asyncio.gather(
            *(mine.create_rank(JOB, rank, limits, period, node_ranks=True,
                               landed=outcome.batch_id)
              for rank, limits, period in _items(range(8))), return_exceptions=True)
        assert isinstance(results[3], DuplicateError)
        assert results[5] is False
        assert [results[r] for r in (0, 1, 2, 4, 6, 7)] == [True] * 6
        h = records.job_hash(JOB)
        entries = [k for k in await _keys(mine) if k.startswith("v.ranks.")]
        assert entries == sorted(f"v.ranks.{h}.{r}" for r in range(8))
        assert await mine._read(records.gpu_key(JOB, "n0", 3)) is None  # rank 3's: undone
    finally:
        await mine.close()
        await other.close()


async def test_a_retry_of_a_committed_node_batch_is_reported_as_such(nc: Any) -> None:
    (state,) = await _states(nc)
    try:
        assert (await state.create_node_ranks(JOB, _items(range(8, 16)))).committed
        for rank, limits, period in _items(range(8, 16))[::3]:
            assert await state.create_rank(JOB, rank, limits, period, batch=False,
                                           node_ranks=True) is False
        # A retry the caller knows (`batch` False: a rank its replica follows already, as
        # when a restarted job registers again) adds no followed entry of its own.
        assert [k for k in await _keys(state) if k.startswith("v.")] == [
            records.node_key(JOB, 8)]
        with pytest.raises(DuplicateError):
            await state.create_rank(JOB, _rank(9, node="n1", gpu=7), node_ranks=True)
    finally:
        await state.close()


async def test_two_replicas_racing_for_one_gpu_bind_it_once(nc: Any) -> None:
    a, b = await _states(nc, 2)
    try:
        outcomes = await asyncio.gather(
            a.create_node_ranks(JOB, _items(range(8))),
            b.create_node_ranks(JOB, [(_rank(8 + r, node="n0", gpu=r), None, None)
                                      for r in range(8)]))
        assert sorted(o.committed for o in outcomes) == [False, True]
        assert len([k for k in await _keys(a) if k.startswith("v.ranks.")]) == 1
    finally:
        await a.close()
        await b.close()


async def test_both_forms_are_read_and_purged_together(nc: Any) -> None:
    """A job with ranks of the old layout (one entry each) and node entries: `read_jobs` has
    every rank, and the job's removal leaves none of its keys."""
    (state,) = await _states(nc)
    try:
        assert await state.create_job(_job())
        assert all(await asyncio.gather(*(state.create_rank(JOB, _rank(r))
                                          for r in range(8))))
        assert (await state.create_node_ranks(JOB, _items(range(8, 16)))).committed
        jobs = await state.read_jobs()
        assert sorted(jobs[JOB].ranks) == list(range(16))
        await state.delete_job(JOB)
        assert not [k for k in await _keys(state) if records.job_hash(JOB) in k]
    finally:
        await state.close()
