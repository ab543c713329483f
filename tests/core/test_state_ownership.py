"""`OwnershipBook` and the state layout: one owner per job, fenced takeovers, readable values."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.jobs import JobRecord, RankRecord
from coordinator.state import OwnershipBook, RecordError, records
from coordinator.state.ownership import Lease
from tests.core.ownership_kit import Leases, step
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.messages import GpuBinding, PowerLimitOptions


def test_one_replica_takes_a_new_job_and_keeps_it_while_it_renews() -> None:
    bucket, jobs = Leases(), {"h1": "job-1"}
    a, b = OwnershipBook("a", 9.0), OwnershipBook("b", 9.0)
    step(a, bucket, jobs, 0.0)
    step(b, bucket, jobs, 0.0)
    assert a.owns("h1", 0.0) and not b.owns("h1", 0.0) and b.owner("h1", 0.0) == "a"
    for t in range(1, 60, 3):
        step(a, bucket, jobs, float(t))
        step(b, bucket, jobs, float(t))
        assert a.owns("h1", float(t)) and not b.owns("h1", float(t))


def test_a_dead_owner_is_replaced_after_its_lease_and_stops_acting_before_it_ends() -> None:
    bucket, jobs = Leases(), {"h1": "job-1"}
    a, b = OwnershipBook("a", 9.0), OwnershipBook("b", 9.0)
    step(a, bucket, jobs, 0.0)
    step(b, bucket, jobs, 0.0)
    # a dies at t=0 (no more renewals). It would act until until - fence = 6 s, b takes at 9 s.
    assert a.owns("h1", 5.9) and not a.owns("h1", 6.0)
    step(b, bucket, jobs, 8.9)
    assert b.owner("h1", 8.9) == "a" and not b.owns("h1", 8.9)
    step(b, bucket, jobs, 9.0)
    assert b.owns("h1", 9.0)
    step(a, bucket, jobs, 9.5)  # a wakes up: its renewal loses the compare-and-set.
    assert not a.owns("h1", 9.5) and a.owner("h1", 9.5) == "b"


def test_a_stopping_replica_gives_its_jobs_up_at_once() -> None:
    bucket, jobs = Leases(), {"h1": "job-1"}
    a, b = OwnershipBook("a", 9.0), OwnershipBook("b", 9.0)
    step(a, bucket, jobs, 0.0)
    (h, lease), = a.renewals()
    revision = bucket.take(h, a.value("job-1", 1.0, release=True), lease.revision)
    assert revision is not None
    step(b, bucket, jobs, 1.0)
    assert b.owns("h1", 1.0)


def test_stale_updates_and_unreadable_values_are_ignored() -> None:
    book = OwnershipBook("a", 9.0)
    assert book.observe("h", json.dumps({"owner": "b", "until": 5, "job_id": "j"}).encode(), 7)
    assert book.observe("h", json.dumps({"owner": "c", "until": 9, "job_id": "j"}).encode(),
                        3) is None
    assert book.observe("h", b"not json", 8) is None
    assert book.owner("h", 1.0) == "b"
    book.forget("h")
    assert book.claimable(["h"], 1.0) == [("h", 0)]
    with pytest.raises(ValueError, match="> 0"):
        OwnershipBook("a", 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0.0, 2.5)), min_size=1, max_size=60))
def test_never_two_replicas_act_on_a_job_at_once(schedule: list[tuple[str, float]]) -> None:
    """Replicas run their loops in any order, at any pace (a pause of one is a gap in its
    turns); whoever may act at a time is at most one replica."""
    bucket, jobs = Leases(), {"h1": "job-1"}
    books = {n: OwnershipBook(n, 3.0) for n in "abc"}
    now = 0.0
    for name, dt in schedule:
        now += dt
        step(books[name], bucket, jobs, now)
        for probe in (now, now + 0.5, now + 1.0):
            acting = [n for n, b in books.items() if b.owns("h1", probe)]
            assert len(acting) <= 1, (acting, probe)


def make_record() -> JobRecord:
    info = JobInfo(dp_degree=2, pp_degree=1, tp_degree=1, world_size=2, job_metadata="m")
    info.set_job_id("PowerLimitOptimizer")
    record = JobRecord(job_id=info.job_id, job=info, scheduler="PowerLimitOptimizer",
                       power_limit=PowerLimitOptions(), created_s=0, last_active_s=0,
                       node="n1", uid=1000)
    return record


def test_records_round_trip_and_keys_are_valid_kv_keys() -> None:
    import re

    record = make_record()
    rank = RankRecord(RankInfo(rank=1, dp_rank=1, pp_rank=0, tp_rank=0,
                               available_frequencies=[]), GpuBinding(node="n1:x", gpu_index=3))
    for key in (records.job_key(record.job_id), records.rank_key(record.job_id, 1),
                records.gpu_key(record.job_id, "n1:x", 3), records.progress_key(record.job_id)):
        assert re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key), key
    job = records.decode(records.job_key(record.job_id), records.encode_job(record), False, 5.0)
    assert job.job is not None and job.job.plain() == record.plain()
    r = records.decode(records.rank_key(record.job_id, 1),
                       records.encode_rank(record.job_id, rank), False, 0)
    assert (r.job_id, r.rank) == (record.job_id, rank)
    p = records.decode(records.progress_key(record.job_id),
                       records.encode_progress(record.job_id, "windows", [1]), False, 0)
    assert p.progress == {"kind": "windows", "state": [1]}
    assert records.decode(records.job_key(record.job_id), None, True, 0).deleted


def test_a_jobs_join_digest_is_stored_and_version_1_jobs_still_read() -> None:
    """Layout 2 keeps the job's join digest (a version-1 replica must not read it: it would
    accept ranks without the token); a version-1 job (before tokens) reads with none."""
    import json

    record = make_record()
    record.join_digest = "ab" * 32
    raw = records.encode_job(record)
    assert json.loads(raw)["v"] == records.VERSION == 3
    job = records.decode(records.job_key(record.job_id), raw, False, 0)
    assert job.job is not None and job.job.join_digest == "ab" * 32
    old = {**json.loads(raw), "v": 1}
    del old["join_digest"]
    job = records.decode(records.job_key(record.job_id), json.dumps(old).encode(), False, 0)
    assert job.job is not None and job.job.join_digest is None


@pytest.mark.parametrize("key,raw,words", [
    ("nope.x", b"{}", "unknown key"),
    ("job.x", b"[1]", "not a JSON object"),
    ("job.x", b'{"v": 4}', "layout version 4"),
    ("job.x", b'{"v": 1, "job": {}}', "job.x"),
    ("rank.x.1", b"\xff", "not JSON"),
])
def test_unreadable_entries_say_why(key: str, raw: bytes, words: str) -> None:
    with pytest.raises(RecordError, match=words):
        records.decode(key, raw, False, 0)


def test_mine_reads_a_copy_of_the_leases_the_loop_may_change_meanwhile() -> None:
    """`/healthz` and `/metrics` call `mine()` on the status server's thread: the event loop can
    take or forget a lease between two of its per-lease steps (simulated here by a lease whose
    owner check changes the dict), which raised "dictionary changed size during iteration"."""
    book = OwnershipBook("a", 9.0)

    class Meddling:
        revision, until, job_id, incarnation = 1, 1e9, "j", ""

        @property
        def owner(self) -> str:
            book.leases[f"new{len(book.leases)}"] = Lease("a", 1e9, 1, "k")  # the loop, meanwhile
            return "a"

    book.leases["h1"] = Meddling()  # type: ignore[assignment]
    book.leases["h2"] = Lease("a", 1e9, 2, "j2")
    assert book.mine(0.0) == ["h1", "h2"]
