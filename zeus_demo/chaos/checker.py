"""The chaos checker (pure): histories in, violations out.

Inputs are the JSON-lines records of `zeus_agent.history` (agents: `command`, `renew`,
`restore`; coordinators: `ack`, `delete`, `lease`), the state bucket as read after recovery,
and when each job made progress and when each fault healed. `check` reports:

* `two_masters`: a GPU commanded by one replica while another's lease, as carried by that
  other replica's own earlier command to the GPU, had not ended (two owners at once);
* `stale_owner`: a command applied after the lease it carried had ended, or after another
  replica had taken the job (a newer lease revision acknowledged earlier);
* `unfenced`: a command that changed a GPU and carried no lease at all;
* `lost_ack`: a write JetStream acknowledged (a registration, a progress record) that the
  state bucket lacks after recovery (absent, or at an older revision), unless its job was
  deleted afterwards;
* `stuck_away`: a GPU whose settings stayed away from their defaults past its last lease;
* `never_resumed`: a job that made no progress within `resume_s` of a fault's heal.

Times are wall-clock seconds of one host (the soak runs on one machine); `tolerance_s` is the
slack allowed to the agents' lease-expiry loop and to the host's scheduling.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.state.records import job_hash

__all__ = ["Histories", "Violation", "check", "parse"]

MUTATING = frozenset({"set_power_limit", "reset_power_limit", "lock_clocks", "reset_clocks",
                      "install_schedule", "clear_schedule"})
"""Commands that change a GPU's settings (binding a rank changes no setting)."""


@dataclass(frozen=True)
class Violation:
    """One broken guarantee: which, when, and what the records say."""

    kind: str
    t: float
    detail: str


@dataclass
class Histories:
    """Every record of a run, by kind, each list in time order."""

    commands: list[dict[str, Any]] = field(default_factory=list)
    gpu_states: list[dict[str, Any]] = field(default_factory=list)
    """`command`, `renew` and `restore` records: a GPU's `away` and `deadline` after each."""
    acks: list[dict[str, Any]] = field(default_factory=list)
    deletes: list[dict[str, Any]] = field(default_factory=list)
    leases: list[dict[str, Any]] = field(default_factory=list)


def parse(lines: Iterable[str]) -> Histories:
    """Sort history lines by kind and time (a line that does not parse is skipped: a cut tail)."""
    out = Histories()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("t"), int | float):
            continue
        kind = rec.get("kind")
        if kind in ("command", "renew", "restore"):
            out.gpu_states.append(rec)
            if kind == "command":
                out.commands.append(rec)
        elif kind == "ack":
            out.acks.append(rec)
        elif kind == "delete":
            out.deletes.append(rec)
        elif kind == "lease":
            try:
                value = json.loads(rec["value"])
            except (KeyError, TypeError, ValueError):
                continue
            out.leases.append({**rec, "owner": value.get("owner"), "inc": value.get("inc", ""),
                               "until": float(value.get("until", 0.0)),
                               "job_id": value.get("job_id")})
    for records in (out.commands, out.gpu_states, out.acks, out.deletes, out.leases):
        records.sort(key=lambda r: r["t"])
    return out


def check(h: Histories, final_state: Mapping[str, int], progress: Mapping[str, list[float]],
          heals: list[float], end_t: float, *, resume_s: float = 60.0,
          tolerance_s: float = 2.0, finished: Mapping[str, float] | None = None,
          ) -> list[Violation]:
    """Every violation the histories show, in time order.

    Args:
        h: The parsed histories of every agent and coordinator of the run.
        final_state: The state bucket after recovery: key -> its revision.
        progress: Job id -> when it made progress (a step, a window, a schedule).
        heals: When each fault ended.
        end_t: When the run ended (a GPU still away then must have a live lease).
        resume_s: How soon after a heal every unfinished job must progress again.
        tolerance_s: Slack for the agents' expiry loop and a loaded host.
        finished: Job id -> when it finished (no progress is expected after that).
    """
    out = [*_masters(h), *_stale(h), *_lost(h, final_state), *_stuck(h, end_t, tolerance_s),
           *_resumed(progress, heals, end_t, resume_s, finished or {})]
    return sorted(out, key=lambda v: v.t)


def _sender(rec: Mapping[str, Any]) -> str:
    return f"{rec.get('owner')}/{rec.get('inc') or '-'}"


def _gpu(rec: Mapping[str, Any]) -> str:
    return f"{rec.get('node')}/gpu{rec.get('gpu')}"


def _applied(rec: Mapping[str, Any]) -> bool:
    return bool(rec.get("ok")) and rec.get("op") in MUTATING


def _masters(h: Histories) -> list[Violation]:
    """A command while another sender's lease, as its own command carried it, was live."""
    out = []
    until_by: dict[str, dict[str, float]] = defaultdict(dict)
    for rec in h.commands:
        if not _applied(rec):
            continue
        gpu, t = _gpu(rec), float(rec["t"])
        if rec.get("owner") is None:
            out.append(Violation("unfenced", t, f"{gpu}: {rec.get('op')} carried no lease"))
            continue
        me = _sender(rec)
        for other, until in until_by[gpu].items():
            if other != me and until > t:
                out.append(Violation("two_masters", t, f"{gpu}: {rec.get('op')} from {me} while "
                                     f"{other}'s lease ran until {until:.3f} (+{until - t:.3f} s)"))
        until = float(rec.get("until") or 0.0)
        until_by[gpu][me] = max(until, until_by[gpu].get(me, 0.0))
    return out


def _stale(h: Histories) -> list[Violation]:
    """A command applied past its own lease, or after another replica took its job."""
    out = []
    taken: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for lease in h.leases:
        taken[str(lease.get("job_id"))].append(lease)
    for rec in h.commands:
        if not _applied(rec) or rec.get("owner") is None:
            continue
        t, until, me = float(rec["t"]), float(rec.get("until") or 0.0), _sender(rec)
        if until <= t:
            out.append(Violation("stale_owner", t, f"{_gpu(rec)}: {rec.get('op')} from {me} "
                                 f"applied {t - until:.3f} s after its lease ended"))
            continue
        for lease in taken.get(str(rec.get("holder")), []):
            newer = int(lease.get("revision") or 0) > int(rec.get("revision") or 0)
            if (lease["t"] <= t and newer and _sender(lease) != me
                    and float(lease["until"]) > 0):
                out.append(Violation("stale_owner", t, f"{_gpu(rec)}: {rec.get('op')} from {me} "
                                     f"after {_sender(lease)} took job {rec.get('holder')} at "
                                     f"{lease['t']:.3f}"))
                break
    return out


def _lost(h: Histories, final_state: Mapping[str, int]) -> list[Violation]:
    """An acknowledged write the bucket lacks after recovery (its job not deleted since)."""
    deleted: dict[str, float] = {}
    for rec in h.deletes:
        deleted[str(rec.get("job_hash"))] = max(float(rec["t"]), deleted.get(rec["job_hash"], 0))
    out = []
    for rec in h.acks:
        job = str(rec.get("job_id"))
        if deleted.get(job_hash(job), -1.0) >= float(rec["t"]):
            continue
        key, revision = str(rec.get("key")), rec.get("revision")
        have = final_state.get(key)
        if have is None or (revision is not None and have < int(revision)):
            now = "absent" if have is None else f"at revision {have}"
            out.append(Violation("lost_ack", float(rec["t"]), f"{key} acknowledged at revision "
                                 f"{revision} is {now} after recovery"))
    return out


def _stuck(h: Histories, end_t: float, tolerance_s: float) -> list[Violation]:
    """A GPU away from its defaults past its last lease (next record late, or none by the end)."""
    by_gpu: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in h.gpu_states:
        by_gpu[_gpu(rec)].append(rec)
    out = []
    for gpu, recs in by_gpu.items():
        for rec, nxt in zip(recs, [*recs[1:], None], strict=True):
            if not rec.get("away"):
                continue
            deadline = rec.get("deadline")
            limit = (float(rec["t"]) if deadline is None else float(deadline)) + tolerance_s
            seen = end_t if nxt is None else float(nxt["t"])
            if seen > limit:
                how = "still away at the end" if nxt is None else f"next record {nxt['kind']}"
                out.append(Violation("stuck_away", limit, f"{gpu}: away from its defaults "
                                     f"{seen - limit + tolerance_s:.3f} s past its lease ({how})"))
    return out


def _resumed(progress: Mapping[str, list[float]], heals: list[float], end_t: float,
             resume_s: float, finished: Mapping[str, float]) -> list[Violation]:
    """A job that did not progress within `resume_s` of a heal (unless it had finished)."""
    out = []
    for job, times in progress.items():
        done = finished.get(job)
        for heal in heals:
            if done is not None and done <= heal + resume_s:
                continue
            if heal + resume_s > end_t:
                if done is None and not any(t > heal for t in times):
                    out.append(Violation("never_resumed", heal, f"job {job}: no progress from "
                                         f"the heal at {heal:.3f} to the end"))
                continue
            if not any(heal < t <= heal + resume_s for t in times):
                out.append(Violation("never_resumed", heal, f"job {job}: no progress within "
                                     f"{resume_s:g} s of the heal at {heal:.3f}"))
    return out
