"""Node entries (layout 3): a node's ranks in one followed entry, read as each rank's own entry.

A replica follows one entry per node's batch instead of one per rank; every rank of one reads
exactly as its `v.rank.` entry would (the form a job recorded by an older coordinator keeps),
and anything unusual in one is a bad record, as in a rank's entry.
"""

from __future__ import annotations

import json

import pytest

from coordinator.jobs import JobRecord, RankRecord
from coordinator.service.node_writes import distinct
from coordinator.state import records
from zeus_agent.wire.messages import GpuBinding, JobInfo, RankInfo

pytestmark = pytest.mark.core

JOB = "job+1:node"
H = records.job_hash(JOB)


def rank(r: int, node: str = "n1", gpu: int | None = None) -> RankRecord:
    return RankRecord(RankInfo(rank=r, dp_rank=r, pp_rank=0, tp_rank=0,
                               available_frequencies=[]),
                      GpuBinding(node=node, gpu_index=r % 8 if gpu is None else gpu))


def node_value(ranks: list[int], job_id: str = JOB) -> bytes:
    return records.encode_node(job_id, [records.encode_rank(job_id, rank(r), (100, 300), 2.0)
                                        for r in ranks])


def test_keys_and_filters_of_the_new_kinds() -> None:
    assert records.node_key(JOB, 8) == f"v.ranks.{H}.8"
    assert records.rank_claim_key(JOB, 8) == f"rank.{H}.8"
    assert records.hash_of_key(records.node_key(JOB, 8)) == H
    assert records.hash_of_key(records.rank_claim_key(JOB, 8)) == H
    filters = {records.hash_keys_filter(H, kind) for kind in records.MANY_KINDS}
    assert filters == {f"v.rank.{H}.>", f"v.ranks.{H}.>", f"rank.{H}.>", f"gpu.{H}.>"}
    assert records.node_key(JOB, 8).startswith(records.FOLLOWED[:-1])
    assert not records.rank_claim_key(JOB, 8).startswith(records.FOLLOWED[:-1])


def test_a_node_entry_reads_as_its_ranks_own_entries() -> None:
    change = records.decode(records.node_key(JOB, 8), node_value([8, 9, 15]), False, 0.0)
    assert (change.kind, change.job_hash, change.job_id) == ("ranks", H, JOB)
    alone = [records.decode(records.rank_key(JOB, r),
                            records.encode_rank(JOB, rank(r), (100, 300), 2.0), False, 0.0)
             for r in (8, 9, 15)]
    assert list(change.ranks) == alone
    assert change.ranks[0].limits == (100, 300) and change.ranks[0].period_recorded


def test_a_claim_holds_the_rank_as_its_entry_would() -> None:
    value = records.encode_rank(JOB, rank(3))
    claim = records.decode(records.rank_claim_key(JOB, 3), value, False, 0.0)
    assert claim.rank == rank(3)


@pytest.mark.parametrize(("key_rank", "ranks", "why"), [
    (9, [8, 9], "first rank"),
    (8, [8, 8], "distinct"),
    (9, [9, 8], "distinct"),
])
def test_a_node_entry_that_does_not_match_its_key_is_a_bad_record(
        key_rank: int, ranks: list[int], why: str) -> None:
    with pytest.raises(records.RecordError, match=why):
        records.decode(records.node_key(JOB, key_rank), node_value(ranks), False, 0.0)


@pytest.mark.parametrize("raw", [
    b"{", b"[]", b'{"v":3,"job_id":"job+1:node","ranks":[]}',
    b'{"v":3,"job_id":"job+1:node","ranks":[{"v":3}]}',
    b'{"v":3,"job_id":"other","ranks":[]}',
])
def test_a_malformed_node_entry_is_a_bad_record(raw: bytes) -> None:
    with pytest.raises(records.RecordError):
        records.decode(records.node_key(JOB, 0), raw, False, 0.0)


def test_a_node_entry_of_another_job_or_with_a_foreign_rank_is_refused() -> None:
    with pytest.raises(records.RecordError, match="another job"):
        records.decode(records.node_key(JOB, 0), node_value([0], "other"), False, 0.0)
    mixed = records.encode_node(JOB, [records.encode_rank("other", rank(0))])
    with pytest.raises(records.RecordError, match="another job"):
        records.decode(records.node_key(JOB, 0), mixed, False, 0.0)


def test_a_newer_layout_is_not_a_bad_record() -> None:
    data = json.loads(node_value([0]))
    data["v"] = records.READABLE[-1] + 1
    with pytest.raises(records.NewerRecordError):
        records.decode(records.node_key(JOB, 0), json.dumps(data).encode(), False, 0.0)


def test_a_deleted_node_entry_decodes_without_ranks() -> None:
    change = records.decode(records.node_key(JOB, 0), None, True, 0.0)
    assert change.kind == "ranks" and change.deleted and change.ranks == ()


def test_a_jobs_layout_follows_its_values_version() -> None:
    """A job recorded by a coordinator before layout 3 keeps one entry per rank."""
    info = JobInfo(dp_degree=8, pp_degree=1, tp_degree=1, world_size=8)
    info.job_id = JOB
    record = JobRecord(JOB, info, "s", None, 0.0, 0.0)
    assert record.node_ranks
    new = records.decode(records.job_key(JOB), records.encode_job(record), False, 0.0)
    assert new.job is not None and new.job.node_ranks
    old = json.loads(records.encode_job(record))
    old["v"] = 2
    change = records.decode(records.job_key(JOB), json.dumps(old).encode(), False, 0.0)
    assert change.job is not None and not change.job.node_ranks


def test_a_batch_with_a_rank_or_gpu_twice_is_not_written_together() -> None:
    item = (rank(0), None, None)
    assert distinct([item, (rank(1), None, None)])
    assert not distinct([item, (rank(0, gpu=5), None, None)])
    assert not distinct([item, (rank(1, gpu=0), None, None)])
    assert distinct([item, (rank(1, node="n2", gpu=0), None, None)])


def test_rank_and_gpu_values_stay_readable_by_a_replica_of_layout_2() -> None:
    """A job of layout 2 keeps a `v.rank.` entry per rank so that a replica of layout 2 still
    serving it sees each rank: the values must be of a layout it reads (it drops the others)."""
    layout_2 = (1, 2)
    assert json.loads(records.encode_rank(JOB, rank(1), (100, 300), 2.0))["v"] in layout_2
    assert json.loads(records.encode_gpu(JOB, 1))["v"] in layout_2
    # The job's own value and a node entry stay at 3: a replica of layout 2 knows neither.
    assert json.loads(node_value([0, 1]))["v"] == records.VERSION == 3


def test_a_jobs_progress_and_note_are_written_at_its_own_layout() -> None:
    """A job of layout 2 may be handed over to a replica of layout 2: its progress and its
    quarantine note must be of a layout that replica reads; a job of layout 3 keeps 3."""
    info = JobInfo(dp_degree=8, pp_degree=1, tp_degree=1, world_size=8)
    info.job_id = JOB
    record = JobRecord(JOB, info, "s", None, 0.0, 0.0)
    assert records.layout_of(record) == records.layout_of(None) == 3
    record.node_ranks = False
    assert records.layout_of(record) == 2
    progress = records.encode_progress(JOB, "windows", [1], records.layout_of(record))
    note = records.encode_quarantine(JOB, records.job_key(JOB), "why", "r1", 0.0, 2)
    assert json.loads(progress)["v"] == json.loads(note)["v"] == 2
    change = records.decode(records.progress_key(JOB), progress, False, 0.0)
    assert change.progress == {"kind": "windows", "state": [1]}
