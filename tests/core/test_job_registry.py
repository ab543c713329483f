"""`JobRegistry`, the pure job/rank core: ids, range checks, duplicates, idle collection and
persistence round trips. Table-driven, no event loop."""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest

from coordinator.jobs import (
    DuplicateError,
    JobRegistry,
    RankRangeError,
    RegistryError,
    UnknownJobError,
)
from zeus_agent import models
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.messages import GpuBinding, PowerLimitOptions, RegisterJob, RegisterRank

ID_FORMAT = re.compile(r"^\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2}\+dp\d+\+pp\d+\+tp\d+\+\w+(\+.+)?$")


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return cls(2024, 5, 17, 9, 30, 12)


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job id is minted in the same second."""
    monkeypatch.setattr(models, "datetime", _FrozenDatetime)


def job(dp: int = 2, pp: int = 1, tp: int = 1, meta: str | None = None, **kw) -> RegisterJob:
    info = JobInfo(dp_degree=dp, pp_degree=pp, tp_degree=tp, world_size=dp * pp * tp,
                   job_metadata=meta)
    return RegisterJob(job=info, **kw)


def rank(job_id: str, r: int, node: str = "n0", gpu: int | None = None, dp: int | None = None,
         pp: int = 0, tp: int = 0, uuid: str = "") -> RegisterRank:
    return RegisterRank(
        job_id=job_id,
        rank_info=RankInfo(rank=r, dp_rank=r if dp is None else dp, pp_rank=pp, tp_rank=tp,
                           available_frequencies=[1410, 1200]),
        gpu=GpuBinding(node=node, gpu_index=r if gpu is None else gpu, gpu_uuid=uuid),
    )


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (job(dp=4), "2024-05-17-09-30-12+dp4+pp1+tp1+PowerLimitOptimizer"),
        (job(dp=2, pp=4, tp=2, scheduler="PointSolution"),
         "2024-05-17-09-30-12+dp2+pp4+tp2+PointSolution"),
        (job(dp=1, meta="bert"), "2024-05-17-09-30-12+dp1+pp1+tp1+PowerLimitOptimizer+bert"),
    ],
)
def test_job_id_follows_the_seed_format(frozen_clock, request_, expected):
    record = JobRegistry().register_job(request_, now_s=0.0)
    assert record.job_id == expected == record.job.job_id
    assert ID_FORMAT.match(record.job_id)


def test_identical_jobs_in_the_same_second_get_distinct_ids(frozen_clock):
    registry = JobRegistry()
    ids = [registry.register_job(job(dp=2), now_s=0.0).job_id for _ in range(3)]
    base = "2024-05-17-09-30-12+dp2+pp1+tp1+PowerLimitOptimizer"
    assert ids == [base, f"{base}+2", f"{base}+3"]
    assert sorted(registry.jobs) == sorted(ids)


def test_an_id_the_shared_state_refused_is_never_offered_again(frozen_clock):
    """Another replica took `base` and `+3` (its job not yet in this view): never offered."""
    registry = JobRegistry()
    base = "2024-05-17-09-30-12+dp2+pp1+tp1+PowerLimitOptimizer"
    first = registry.register_job(job(dp=2), now_s=0.0).job_id
    assert first == base
    registry.unregister_job(first)
    registry.refuse_id(first)
    registry.refuse_id(f"{base}+3")
    ids = [registry.register_job(job(dp=2), now_s=0.0).job_id for _ in range(3)]
    assert ids == [f"{base}+2", f"{base}+4", f"{base}+5"]
    # Other shapes, or the same shape with metadata, are other ids: unaffected.
    assert registry.register_job(job(dp=4), now_s=0.0).job_id.endswith("+dp4+pp1+tp1+"
                                                                       "PowerLimitOptimizer")


def test_refusals_are_kept_for_their_second_only():
    """Bounded: a refusal in a new second drops the older second's (never offered again but
    by a clock set back; the shared state would then refuse them once more)."""
    registry = JobRegistry()
    early, late = datetime(2024, 5, 17, 9, 30, 12), datetime(2024, 5, 17, 9, 30, 13)
    taken = registry.register_job(job(dp=2), 0.0, wall=early).job_id
    registry.unregister_job(taken)
    registry.refuse_id(taken)
    assert registry.register_job(job(dp=2), 0.0, wall=early).job_id == f"{taken}+2"
    moved_on = registry.register_job(job(dp=2), 0.0, wall=late).job_id
    registry.unregister_job(moved_on)
    registry.refuse_id(moved_on)
    assert registry.register_job(job(dp=2), 0.0, wall=late).job_id == f"{moved_on}+2"
    registry.unregister_job(f"{taken}+2")
    assert registry.register_job(job(dp=2), 0.0, wall=early).job_id == taken


def test_job_id_uses_the_real_clock():
    record = JobRegistry().register_job(job(dp=2), now_s=0.0)
    assert ID_FORMAT.match(record.job_id)


@pytest.mark.parametrize(
    ("dp", "pp", "tp", "kwargs", "error", "words"),
    [
        # rank coordinates beyond the job's degrees
        (2, 1, 1, {"r": 2}, RankRangeError, ["rank 2", "below 2"]),
        (2, 2, 1, {"r": 0, "dp": 2}, RankRangeError, ["dp_rank 2", "below 2"]),
        (2, 2, 1, {"r": 1, "dp": 0, "pp": 2}, RankRangeError, ["pp_rank 2", "below 2"]),
        (1, 1, 2, {"r": 1, "dp": 0, "tp": 5}, RankRangeError, ["tp_rank 5", "below 2"]),
    ],
)
def test_rank_must_fit_the_job(dp, pp, tp, kwargs, error, words):
    registry = JobRegistry()
    record = registry.register_job(job(dp=dp, pp=pp, tp=tp), 0.0)
    with pytest.raises(error) as e:
        registry.register_rank(rank(record.job_id, **kwargs), 0.0)
    assert e.value.code == "out_of_range"
    for word in words:
        assert word in str(e.value)
    assert record.ranks == {}


def test_a_rank_in_range_registers_and_completes_the_job():
    registry = JobRegistry()
    record = registry.register_job(job(dp=2), 0.0)
    for r, expect_complete in ((0, False), (1, True)):
        got, new = registry.register_rank(rank(record.job_id, r), float(r))
        assert got is record and new
        assert record.complete is expect_complete
    assert [g.gpu_index for g in record.gpus()] == [0, 1]
    assert record.last_active_s == 1.0


def test_reregistering_the_same_rank_is_idempotent():
    registry = JobRegistry()
    record = registry.register_job(job(dp=2), 0.0)
    req = rank(record.job_id, 0, uuid="GPU-a")
    assert registry.register_rank(req, 1.0) == (record, True)
    assert registry.check_rank(req) is True
    assert registry.register_rank(req, 5.0) == (record, False)
    assert len(record.ranks) == 1
    assert record.last_active_s == 5.0  # A retry is activity.


@pytest.mark.parametrize(
    ("second", "words"),
    [
        # the same rank again, on another GPU
        ({"r": 0, "gpu": 3}, ["rank 0", "already registered", "GPU 0 on n0"]),
        # the same rank again, other coordinates
        ({"r": 0, "dp": 1, "gpu": 0}, ["rank 0", "already registered"]),
        # the same rank again, another uuid
        ({"r": 0, "gpu": 0, "uuid": "GPU-x"}, ["rank 0", "already registered"]),
        # another rank on the same GPU
        ({"r": 1, "gpu": 0}, ["GPU 0 on n0", "already drives rank 0", "its own GPU"]),
    ],
)
def test_duplicates_are_refused(second, words):
    registry = JobRegistry()
    record = registry.register_job(job(dp=2), 0.0)
    registry.register_rank(rank(record.job_id, 0, gpu=0), 0.0)
    with pytest.raises(DuplicateError) as e:
        registry.register_rank(rank(record.job_id, **second), 0.0)
    assert e.value.code == "duplicate"
    for word in words:
        assert word in str(e.value)
    assert list(record.ranks) == [0]


def test_the_same_gpu_index_on_another_node_is_another_gpu():
    registry = JobRegistry()
    record = registry.register_job(job(dp=2), 0.0)
    registry.register_rank(rank(record.job_id, 0, node="a", gpu=0), 0.0)
    registry.register_rank(rank(record.job_id, 1, node="b", gpu=0), 0.0)
    assert record.complete
    assert record.gpu_ranks == {("a", 0): 0, ("b", 0): 1}


@pytest.mark.parametrize(
    "call",
    [
        lambda reg: reg.get("nope"),
        lambda reg: reg.register_rank(rank("nope", 0), 0.0),
        lambda reg: reg.check_rank(rank("nope", 0)),
    ],
)
def test_unknown_job_message_says_what_to_do(call):
    with pytest.raises(UnknownJobError) as e:
        call(JobRegistry())
    assert isinstance(e.value, RegistryError)
    assert e.value.code == "unknown_job"
    message = str(e.value)
    assert "unknown job 'nope'" in message
    assert "register it first" in message and "idle" in message


@pytest.mark.parametrize(
    ("now_s", "max_idle_s", "expected_removed"),
    [
        (100.0, 60.0, ["old"]),  # old idle 100 s, new idle 40 s
        (100.0, 100.0, []),  # exactly at the limit is not over it
        (200.0, 60.0, ["old", "new"]),
        (50.0, 60.0, []),
    ],
)
def test_collect_idle(frozen_clock, now_s, max_idle_s, expected_removed):
    registry = JobRegistry()
    old = registry.register_job(job(dp=1, meta="old"), now_s=0.0)
    new = registry.register_job(job(dp=1, meta="new"), now_s=0.0)
    registry.touch(new.job_id, 60.0)
    registry.touch("unknown", 60.0)  # Ignored.
    names = {old.job_id: "old", new.job_id: "new"}
    removed = registry.collect_idle(now_s, max_idle_s)
    assert [names[j] for j in removed] == expected_removed
    assert set(registry.jobs) == set(names) - set(removed)


def test_registering_a_rank_keeps_a_job_alive():
    registry = JobRegistry()
    record = registry.register_job(job(dp=2), now_s=0.0)
    registry.register_rank(rank(record.job_id, 0), 90.0)
    assert registry.collect_idle(100.0, 60.0) == []


def test_snapshot_restore_round_trip():
    registry = JobRegistry()
    pl = registry.register_job(
        job(dp=2, meta="m", power_limit=PowerLimitOptions(selector="Energy", warmup_steps=0,
                                                          save_profile=True)), 1.0, node="a")
    pipe = registry.register_job(job(dp=1, pp=2, scheduler="PointSolution"), 2.0)
    registry.register_rank(rank(pl.job_id, 0, node="a", gpu=1, uuid="GPU-1"), 3.0)
    registry.register_rank(rank(pl.job_id, 1, node="b", gpu=0), 3.0)
    registry.register_rank(rank(pipe.job_id, 1, dp=0, pp=1, gpu=7), 4.0)

    data = json.loads(json.dumps(registry.snapshot()))  # What the service writes.
    restored = JobRegistry.restore(data, now_s=500.0)

    assert sorted(restored.jobs) == sorted(registry.jobs)
    for job_id, before in registry.jobs.items():
        after = restored.jobs[job_id]
        assert after.job == before.job and after.job.job_id == job_id
        assert after.scheduler == before.scheduler
        assert after.power_limit == before.power_limit
        assert after.ranks == before.ranks
        assert after.gpu_ranks == before.gpu_ranks  # The index is rebuilt.
        assert after.last_active_s == 500.0  # Idle clocks restart at restore.
    assert restored.jobs[pl.job_id].complete
    assert restored.snapshot()["jobs"][0]["job"] == data["jobs"][0]["job"]
    # The restored registry still refuses duplicates and continues id numbering.
    with pytest.raises(DuplicateError):
        restored.register_rank(rank(pipe.job_id, 0, gpu=7), 0.0)


def test_restore_of_nothing_is_empty():
    assert JobRegistry.restore({}, 0.0).jobs == {}
    assert JobRegistry.restore({"jobs": []}, 0.0).jobs == {}


def test_quotas_per_node_and_in_all():
    """Defect: registrations were unbounded (10,000 jobs from one node)."""
    from coordinator.jobs import QuotaError

    registry = JobRegistry(max_jobs=5, max_jobs_per_node=2)
    for _ in range(2):
        registry.register_job(job(dp=1), 0.0, node="a")
    with pytest.raises(QuotaError, match="node 'a' has registered 2 jobs") as info:
        registry.register_job(job(dp=1), 0.0, node="a")
    assert info.value.code == "quota"
    for _ in range(2):
        registry.register_job(job(dp=1), 0.0, node="b")
    registry.register_job(job(dp=1), 0.0, node="c")
    with pytest.raises(QuotaError, match="max_jobs"):
        registry.register_job(job(dp=1), 0.0, node="d")
    # Collected jobs free their node's quota; a restored registry counts them again.
    assert len(registry.collect_idle(100.0, 10.0)) == 5
    registry.register_job(job(dp=1), 100.0, node="a")
    restored = JobRegistry.restore(registry.snapshot(), 0.0, max_jobs=5, max_jobs_per_node=1)
    with pytest.raises(QuotaError):
        restored.register_job(job(dp=1), 0.0, node="a")


def test_unregister_undoes_a_registration():
    registry = JobRegistry(max_jobs=1)
    record = registry.register_job(job(dp=2), 0.0, node="a")
    registry.register_rank(rank(record.job_id, 0), 1.0)
    registry.unregister_rank(record.job_id, 0)
    assert record.ranks == {} and record.gpu_ranks == {}
    registry.register_rank(rank(record.job_id, 0), 1.0)  # the GPU is free again
    registry.unregister_job(record.job_id)
    assert registry.jobs == {}
    registry.register_job(job(dp=1), 0.0, node="a")  # the quota is free again


def test_a_state_file_with_a_profile_path_still_restores():
    registry = JobRegistry()
    registry.register_job(job(dp=1, power_limit=PowerLimitOptions()), 0.0)
    data = registry.snapshot()
    data["jobs"][0]["power_limit"]["profile_path"] = "/etc/shadow"  # written by an older version
    restored = JobRegistry.restore(data, 0.0)
    assert next(iter(restored.jobs.values())).power_limit == PowerLimitOptions()


def test_a_jobs_ranks_must_come_from_the_user_who_registered_it():
    """Found by the adversarial review: a trainer of another user (on any node) took a rank of
    a job with nothing but its id. The agents stamp the kernel's uid on registrations."""
    from coordinator.jobs import ForbiddenError

    registry = JobRegistry()
    record = registry.register_job(job(dp=2).model_copy(update={"uid": 1000}), 0.0, node="b")
    intruder = rank(record.job_id, 1).model_copy(update={"uid": 1001})
    with pytest.raises(ForbiddenError, match="belongs to another user") as info:
        registry.register_rank(intruder, 1.0)
    assert info.value.code == "forbidden" and record.ranks == {}
    registry.register_rank(rank(record.job_id, 1).model_copy(update={"uid": 1000}), 1.0)
    restored = JobRegistry.restore(registry.snapshot(), 0.0)
    with pytest.raises(ForbiddenError):
        restored.check_rank(rank(record.job_id, 0).model_copy(update={"uid": 0}))


def test_a_jobs_ranks_must_present_its_join_token():
    """Found by the adversarial review: a process of the job's own user, on any node, took a
    missing rank with nothing but the job id (made from the clock). A job registered with a
    join token accepts only ranks that present it; only its digest is kept and persisted."""
    from coordinator.jobs import ForbiddenError

    token = "s3cret-join-token-0123456789"
    registry = JobRegistry()
    record = registry.register_job(job(dp=2), 0.0, node="b", join_token=token)
    assert record.join_digest is not None and token not in json.dumps(registry.snapshot())
    for presented, words in ((None, "presented no join token"),
                             ("a-guessed-token-000000", "presented a wrong join token")):
        with pytest.raises(ForbiddenError, match=words) as info:
            registry.register_rank(rank(record.job_id, 1).model_copy(
                update={"join_token": presented}), 1.0)
        assert "join_token=" in str(info.value)  # says how to pass it
    assert record.ranks == {}
    registry.register_rank(rank(record.job_id, 1).model_copy(update={"join_token": token}), 1.0)
    restored = JobRegistry.restore(registry.snapshot(), 0.0)
    with pytest.raises(ForbiddenError):
        restored.check_rank(rank(record.job_id, 0))
    assert restored.check_rank(rank(record.job_id, 0).model_copy(
        update={"join_token": token})) is False
    # A retry of a registered rank presents the token too.
    assert restored.check_rank(rank(record.job_id, 1).model_copy(
        update={"join_token": token})) is True


def test_a_recorded_job_is_checked_field_by_field_when_it_is_read_back():
    """The state bucket is read at every start: a field of the wrong type is a bad record
    (ValueError, which quarantines the job), never an exception later in the registry."""
    from coordinator.jobs import JobRecord

    record = JobRegistry().register_job(job(dp=1), 0.0, node="n" * 1000)  # a long token
    plain = record.plain(with_ranks=False)
    assert JobRecord.from_plain(plain, 0.0).node == "n" * 1000
    for field, value in (("node", []), ("scheduler", 2**64), ("uid", -1), ("uid", "0"),
                         ("join_digest", "xyz"), ("job_id", 5)):
        with pytest.raises(ValueError, match=field):
            JobRecord.from_plain({**plain, field: value}, 0.0)
    # The job's own info keeps the id it was given: never a value of another type, which
    # pydantic would have refused and warns about when the record is written again.
    for value in (1e308, 5, [], None, "x" * 10_000):
        with pytest.raises(ValueError, match="job.job_id"):
            JobRecord.from_plain({**plain, "job": {**plain["job"], "job_id": value}}, 0.0)


def test_one_nodes_gpus_hold_at_most_max_ranks_per_node_over_all_jobs():
    """What one node's agent can make every replica keep is bounded (issue 33 review): ranks
    on one node's GPUs count over every job; removing a job or undoing a rank frees room."""
    from coordinator.jobs import QuotaError

    registry = JobRegistry(max_ranks_per_node=3)
    first = registry.register_job(job(dp=2), 0.0)
    second = registry.register_job(job(dp=2), 0.0)
    for r in (0, 1):
        registry.register_rank(rank(first.job_id, r), 0.0)
    registry.register_rank(rank(second.job_id, 0, gpu=5), 0.0)
    with pytest.raises(QuotaError, match="max_ranks_per_node"):
        registry.register_rank(rank(second.job_id, 1, gpu=6), 0.0)
    registry.register_rank(rank(second.job_id, 1, node="n1"), 0.0)  # another node: room
    registry.unregister_rank(second.job_id, 0)
    registry.register_rank(rank(second.job_id, 0, gpu=7), 0.0)  # the undone rank's room
    registry.unregister_job(first.job_id)
    assert registry.register_rank(rank(second.job_id, 0, gpu=7), 0.0)[1] is False  # a retry


def test_register_checked_checks_again_only_what_a_wait_can_change():
    """A node's batch checks each rank once, then writes, then registers it (`register_checked`):
    against the record it was checked with, a rank or GPU taken meanwhile, or the node's quota
    filled, is still refused, a retry is still a retry; a record forgotten or replaced meanwhile
    is checked in full (`register_rank`)."""
    from coordinator.jobs import QuotaError

    registry = JobRegistry(max_ranks_per_node=3)
    record = registry.register_job(job(dp=4), 0.0)
    checked = [rank(record.job_id, r) for r in range(4)]
    assert [registry.check_rank(c) for c in checked] == [False] * 4
    registry.register_rank(rank(record.job_id, 0), 0.0)  # meanwhile: rank 0, the same
    registry.register_rank(rank(record.job_id, 1, gpu=9), 0.0)  # rank 1, another GPU
    assert registry.register_checked(checked[0], 2.0, record) == (record, False)  # a retry
    assert record.last_active_s == 2.0
    with pytest.raises(DuplicateError, match="rank 1 .* already registered"):
        registry.register_checked(checked[1], 2.0, record)
    assert registry.register_checked(checked[2], 2.0, record) == (record, True)
    with pytest.raises(QuotaError, match="max_ranks_per_node"):  # 0, 1 and 2 on n0
        registry.register_checked(checked[3], 2.0, record)
    assert sorted(record.ranks) == [0, 1, 2]
    # Forgotten meanwhile: refused as unknown; a job of that id again: all checked again.
    registry.unregister_job(record.job_id)
    with pytest.raises(UnknownJobError):
        registry.register_checked(checked[3], 3.0, record)
    again = registry.register_job(job(dp=4), 0.0)
    stranger = rank(again.job_id, 3).model_copy(update={"uid": 1234})
    again.uid = 99  # (Not the rank's user: only a full check says so.)
    with pytest.raises(RegistryError, match="another user"):
        registry.register_checked(stranger, 3.0, record)
