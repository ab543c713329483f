"""`zeus-coordinator quarantine list|drop|release`: the jobs the coordinator set aside.

A job is quarantined when a record of it in the state bucket cannot be loaded, or when its
optimiser failed while starting, resuming or driving it (`coordinator.service.failures`): no
replica starts it again, so one bad record or one hostile description never crash-loops them.

* `list`: every quarantined job: its key token, job id (when known), the record and the reason;
* `drop KEY`: remove the job's records and its note (the job is gone: its trainers register
  again);
* `release KEY`: remove only the note: the replicas try the job again (once the cause is fixed,
  e.g. after an upgrade that reads its records).

`KEY` is the key token `list` prints (32 hex digits) or the job id. The state bucket is the
coordinator's alone: connect as the coordinator user (`zeus-coordinator nats-auth`).
Exit codes: 0 done, 1 nothing to drop or release, 3 NATS or JetStream unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from coordinator.state import records
from coordinator.state.jetstream import JetStreamState
from zeus_agent.broker import connect, redact_url
from zeus_agent.wire import subjects

_HASH = re.compile(r"^[0-9a-f]{32}$")


def build_parser() -> argparse.ArgumentParser:
    """The command line of `zeus-coordinator quarantine`."""
    parser = argparse.ArgumentParser(
        prog="zeus-coordinator quarantine",
        description="List, drop or release the jobs the coordinator set aside because a record "
        "of theirs could not be loaded or their optimiser failed (no replica starts them "
        "again until released).",
        epilog="examples:\n  zeus-coordinator quarantine list --nats-url nats://coord:pw@nats:4222"
        "\n  zeus-coordinator quarantine drop 3f2a...  (the key list prints, or the job id)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("list", "drop", "release"),
                        help="list the quarantined jobs; drop one (its records too); release "
                        "one (its replicas try it again)")
    parser.add_argument("key", nargs="?", metavar="KEY",
                        help="with drop and release: the key `list` prints, or the job id")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222",
                        help="NATS server URL, with the coordinator user's credentials")
    parser.add_argument("--prefix", default=subjects.DEFAULT_PREFIX, help="subject prefix")
    parser.add_argument("--state-bucket", default=None,
                        help="the coordinators' state bucket (default: the prefix's)")
    parser.add_argument("--json", action="store_true", help="list as JSON")
    return parser


def job_key_token(key: str) -> str:
    """The key token of `key`: itself if it is one, else the digest of a job id."""
    return key if _HASH.match(key) else records.job_hash(key)


def describe(job_hash: str, note: dict[str, Any]) -> str:
    """One line per quarantined job, for people."""
    at = note.get("at")
    when = (dt.datetime.fromtimestamp(at).isoformat(timespec="seconds")
            if isinstance(at, int | float) else "?")
    job = note.get("job_id") or "(job id unknown)"
    return (f"{job_hash}  {job}  since {when} by {note.get('replica', '?')}\n"
            f"    record {note.get('key', '?')}: {note.get('reason', '?')}")


async def run(args: argparse.Namespace) -> int:
    """Carry out the action; the exit code."""
    nc = await connect(args.nats_url, "zeus-coordinator-quarantine",
                       inbox_prefix=subjects.inbox_prefix("coord", "", args.prefix))
    try:
        state = JetStreamState(nc, args.prefix, bucket=args.state_bucket)
        await state.open()
        if args.action == "list":
            notes = await state.list_quarantine()
            if args.json:
                print(json.dumps(notes, indent=2, default=str))
            elif not notes:
                print("no job is quarantined")
            else:
                for job_hash, note in sorted(notes.items()):
                    print(describe(job_hash, note))
            return 0
        job_hash = job_key_token(args.key)
        if await state.get_quarantine(job_hash) is None:
            print(f"zeus-coordinator quarantine: no quarantined job {args.key!r} (see "
                  "`zeus-coordinator quarantine list`)", file=sys.stderr)
            return 1
        if args.action == "release":
            await state.release_quarantine(job_hash)
            print(f"released {job_hash}: its replicas try the job again")
        else:
            await state.delete_hash(job_hash, f"quarantined job {job_hash}")
            print(f"dropped {job_hash} and its records")
        return 0
    finally:
        await nc.drain()


def main(argv: Sequence[str]) -> int:
    """Entry point of `zeus-coordinator quarantine`."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.action != "list" and not args.key:
        parser.error(f"{args.action} needs the KEY that `list` prints (or the job id)")
    try:
        return asyncio.run(run(args))
    except Exception as e:  # noqa: BLE001 - NATS and JetStream errors, for people
        print(f"zeus-coordinator quarantine: cannot reach the state at "
              f"{redact_url(args.nats_url)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
