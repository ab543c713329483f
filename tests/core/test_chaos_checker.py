"""The chaos checker on hand-made histories: one per violation kind, and a clean run."""

from __future__ import annotations

import json
from typing import Any

from coordinator.state.records import job_hash
from zeus_demo.chaos.checker import Histories, check, parse

JOB = "job-a"


def cmd(t: float, owner: str, until: float, revision: int = 1, gpu: int = 0, ok: bool = True,
        op: str = "set_power_limit", away: bool = True, deadline: float | None = None,
        inc: str = "i1") -> dict[str, Any]:
    return {"kind": "command", "t": t, "node": "n1", "gpu": gpu, "op": op, "holder": JOB,
            "ok": ok, "owner": owner, "inc": inc, "revision": revision, "until": until,
            "away": away, "deadline": t + 30 if deadline is None else deadline}


def lease(t: float, owner: str, until: float, revision: int) -> dict[str, Any]:
    value = json.dumps({"v": 1, "owner": owner, "inc": "i1", "until": until, "job_id": JOB})
    return {"kind": "lease", "t": t, "job_hash": job_hash(JOB), "value": value,
            "revision": revision}


def run(records: list[dict[str, Any]], final: dict[str, int] | None = None,
        progress: dict[str, list[float]] | None = None, heals: list[float] | None = None,
        end_t: float = 100.0) -> list[str]:
    h = parse(json.dumps(r) for r in records)
    return [v.kind for v in check(h, final or {}, progress or {}, heals or [], end_t)]


def test_a_clean_takeover_is_no_violation() -> None:
    records = [lease(0, "r1", 10, 1), cmd(1, "r1", 10, deadline=31),
               lease(11, "r2", 21, 2), cmd(12, "r2", 21, revision=2, deadline=42)]
    assert run(records, end_t=40) == []


def test_two_replicas_commanding_one_gpu_in_an_overlapping_period() -> None:
    records = [cmd(1, "r1", 10), cmd(5, "r2", 15, revision=2)]
    assert "two_masters" in run(records, end_t=20)


def test_a_command_applied_after_its_lease_ended() -> None:
    assert run([cmd(12, "r1", 10)], end_t=20) == ["stale_owner"]


def test_a_command_after_another_replica_took_the_job() -> None:
    records = [lease(0, "r1", 30, 1), lease(5, "r2", 35, 2), cmd(6, "r1", 30, revision=1)]
    assert run(records, end_t=20) == ["stale_owner"]


def test_a_command_with_no_lease_is_unfenced() -> None:
    rec = cmd(1, "r1", 10)
    rec.update(owner=None, inc=None, revision=None, until=None)
    assert run([rec], end_t=20) == ["unfenced"]


def test_refused_commands_and_reads_change_nothing() -> None:
    records = [cmd(1, "r1", 10), cmd(5, "r2", 15, ok=False), cmd(6, "r2", 15, op="bind")]
    assert run(records, end_t=20) == []


def test_an_acknowledged_record_missing_after_recovery() -> None:
    acks = [{"kind": "ack", "t": 1, "key": "v.job.x", "job_id": JOB},
            {"kind": "ack", "t": 2, "key": "v.prog.x", "job_id": JOB, "revision": 7}]
    assert run(acks, final={"v.job.x": 1, "v.prog.x": 9}) == []
    assert run(acks, final={"v.prog.x": 9}) == ["lost_ack"]
    assert run(acks, final={"v.job.x": 1, "v.prog.x": 6}) == ["lost_ack"]


def test_records_of_a_job_deleted_later_are_not_lost() -> None:
    records = [{"kind": "ack", "t": 1, "key": "v.job.x", "job_id": JOB},
               {"kind": "delete", "t": 5, "job_hash": job_hash(JOB)}]
    assert run(records) == []


def test_a_gpu_away_from_its_defaults_past_its_lease() -> None:
    set_at_1 = cmd(1, "r1", 10, deadline=31)
    restored_in_time = {"kind": "restore", "t": 31.5, "node": "n1", "gpu": 0, "away": False,
                        "deadline": None}
    restored_late = {**restored_in_time, "t": 40.0}
    assert run([set_at_1, restored_in_time]) == []
    assert run([set_at_1, restored_late]) == ["stuck_away"]
    assert run([set_at_1], end_t=60) == ["stuck_away"]
    renewed = {"kind": "renew", "t": 20, "node": "n1", "gpu": 0, "away": True, "deadline": 50}
    assert run([set_at_1, renewed], end_t=45) == []


def test_a_job_that_never_resumes_after_a_heal() -> None:
    progress = {JOB: [1.0, 2.0, 50.0]}
    assert run([], progress=progress, heals=[10.0], end_t=100) == []
    assert run([], progress=progress, heals=[60.0], end_t=200) == ["never_resumed"]
    assert run([], progress=progress, heals=[60.0], end_t=90) == ["never_resumed"]


def test_a_finished_job_need_not_resume() -> None:
    h = Histories()
    violations = check(h, {}, {JOB: [1.0]}, [60.0], 200.0, finished={JOB: 5.0})
    assert violations == []


def test_a_cut_last_line_is_skipped() -> None:
    h = parse([json.dumps(cmd(1, "r1", 10)), '{"kind": "comm'])
    assert len(h.commands) == 1


def test_the_lease_header_round_trips() -> None:
    from zeus_agent.wire.fencing import SenderLease, parse_lease_header

    lease_ = SenderLease("replica-a", "3f2a", 17, 1234.5)
    assert parse_lease_header(lease_.header()) == lease_
    assert parse_lease_header(SenderLease("r", "", 1, 2.0).header()) == SenderLease("r", "", 1, 2.0)
    assert parse_lease_header("garbage") is None
    assert parse_lease_header(None) is None


def test_the_agent_recorder_reads_the_op_of_a_wire_envelope() -> None:
    from zeus_agent.agent.recording import decoded
    from zeus_agent.wire import codec
    from zeus_agent.wire.messages import CommandEnvelope, SetPowerLimitCmd

    raw = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(power_limit_w=200, holder=JOB)))
    cmd = decoded(raw)
    assert cmd is not None and cmd["op"] == "set_power_limit" and cmd["holder"] == JOB
    assert decoded(b"\xff not msgpack") is None
