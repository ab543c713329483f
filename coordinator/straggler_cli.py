"""`zeus-coordinator straggler JOB --pipeline D --factor F | --clear`: a straggler notice.

Sends a `StragglerNotice` on `<prefix>.coord.jobs.straggler` and prints the coordinator's
answer. Exit codes: 0 accepted, 1 refused by the coordinator (its code and reason are printed)
or no answer, 2 usage, 3 NATS unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence

from pydantic import ValidationError

from zeus_agent.broker import connect
from zeus_agent.errors import ZeusAgentError
from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.messages import MAX_STRAGGLER_FACTOR, Reply, StragglerNotice

PROG = "zeus-coordinator straggler"

DESCRIPTION = f"""\
Tell the coordinator that one data-parallel pipeline of a pipeline job is a straggler: it runs
FACTOR times slower than planned (1.3: 30% slower), for a reason the coordinator may not see
or not see soon enough (a node that throttles, a slow link, a failing fan). While the coordinator
serves a Perseus plan, it then runs the job's other pipelines at the point of its time-energy
frontier with the least energy that is still no slower than the straggler: they would only wait
for it at the all-reduce anyway. The straggler keeps its plan. --clear withdraws the notice (the
coordinator's own measurements count again; it also detects stragglers by itself, see the
settings straggler_threshold and straggler_window).

The notice changes GPU clocks: with NATS permissions, connect as the coordinator user (the
observer may not send it), e.g. --nats-url nats://coordinator:PASSWORD@nats:4222.

FACTOR: from 1 to {MAX_STRAGGLER_FACTOR:g}. The pipeline index D is the data-parallel rank.

examples:
  zeus-coordinator straggler 2026-01-01-00-00-00+dp4+pp8+tp1+Perseus3D --pipeline 2 --factor 1.3
  zeus-coordinator straggler JOB_ID --pipeline 2 --clear
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job_id", metavar="JOB", help="the pipeline job's id")
    parser.add_argument("--pipeline", "-d", metavar="D", type=int, required=True,
                        help="the straggling pipeline: its data-parallel rank (0, 1, ...)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--factor", "-f", metavar="F", type=float,
                      help="how many times slower than planned it runs (e.g. 1.3)")
    what.add_argument("--clear", action="store_true",
                      help="it is not a straggler any more: withdraw the notice")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server URL")
    parser.add_argument("--prefix", default=subjects.DEFAULT_PREFIX, help="subject prefix")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the coordinator's answer (default 10)")
    return parser


async def send(url: str, prefix: str, notice: StragglerNotice, timeout_s: float) -> Reply:
    """Send `notice` and return the coordinator's reply."""
    nc = await connect(url, "zeus-coordinator-straggler",
                       inbox_prefix=permissions.inbox("coordinator", prefix=prefix))
    try:
        msg = await nc.request(subjects.coord_job_straggler(prefix), codec.encode(notice),
                               timeout=timeout_s)
        return codec.decode(msg.data, Reply)
    finally:
        await nc.drain()


def main(argv: Sequence[str]) -> int:
    """Entry point of `zeus-coordinator straggler`."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        subjects.check_prefix(args.prefix)
        notice = StragglerNotice(job_id=args.job_id, pipeline=args.pipeline,
                                 factor=None if args.clear else args.factor, clear=args.clear)
    except (ValidationError, ValueError) as e:
        errors = getattr(e, "errors", None)
        text = "; ".join(str(err["msg"]) for err in errors()) if errors else str(e)
        parser.error(text)  # Exits with 2.
    try:
        reply = asyncio.run(send(args.nats_url, args.prefix, notice, args.timeout))
    except ZeusAgentError as e:
        print(f"{PROG}: {e}")
        return 3
    except Exception as e:  # noqa: BLE001 - NATS timeouts and no-responders, for people
        print(f"{PROG}: {type(e).__name__}: {e}; is a coordinator running on {args.nats_url} "
              f"with prefix {args.prefix!r}? (with NATS permissions, only the coordinator user "
              "may send notices)")
        return 1
    if not reply.ok:
        print(f"{PROG}: refused ({reply.code}): {reply.error}")
        return 1
    print(reply.result.get("message") or "accepted")
    print(json.dumps({k: v for k, v in reply.result.items() if k != "message"}, sort_keys=True))
    return 0
