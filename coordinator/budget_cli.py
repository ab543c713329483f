"""`zeus-coordinator budget set|show|lift`: power budgets, over the bus as an operator.

Exit codes: 0 done, 1 refused (the reason printed), 2 usage, 3 NATS unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from zeus_agent.broker import PermissionRefusedError, connect, redact_url, refuse_if_not_permitted
from zeus_agent.errors import ZeusAgentError, reply_for
from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.budget import Budget, BudgetGroup, BudgetRequest
from zeus_agent.wire.messages import Reply

PROG = "zeus-coordinator budget"

DESCRIPTION = """\
Set, show or lift a power budget: a cap for a group of GPUs (the whole cluster, some nodes, or
the nodes whose agents run with --labels KEY=VALUE). The coordinator shares the cap among the
group's jobs by what it measured of each (the least total slowdown), and the agents hold it as a
node cap even while no coordinator is reachable, until the budget ends or is lifted. Where two
budgets cover one GPU, the lower cap wins there.

With NATS permissions, connect as an operator user (`zeus-coordinator nats-auth --operator
NAME` writes one); any other user is refused (forbidden).

examples:
  zeus-coordinator budget set grid-event --cut-pct 25 --for 3h
  zeus-coordinator budget set rack-a7 --cap-w 24000 --label rack=a7
  zeus-coordinator budget set night --cap-w 80000 --nodes gpu-1,gpu-2 --start 2026-07-01T22:00
  zeus-coordinator budget show
  zeus-coordinator budget lift grid-event
"""

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("set", "show", "lift"))
    parser.add_argument("budget_id", nargs="?", metavar="ID",
                        help="the budget's name (letters, digits, '-', '_'); show: all if none")
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument("--cap-w", type=float, metavar="W", help="the group's cap (W)")
    cap.add_argument("--cut-pct", type=float, metavar="P",
                     help="cut the group's measured draw by P percent (0 < P < 100)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--nodes", metavar="A,B", help="the group: these nodes")
    group.add_argument("--label", metavar="KEY=VALUE",
                       help="the group: the nodes whose agent announced this label")
    parser.add_argument("--start", metavar="WHEN",
                        help="when it begins: ISO time (local) or Unix seconds (default: now)")
    end = parser.add_mutually_exclusive_group()
    end.add_argument("--end", metavar="WHEN", help="when it ends (default: when lifted)")
    end.add_argument("--for", dest="duration", metavar="DURATION",
                     help="how long it lasts from its start: 90s, 30m, 3h, 1d")
    parser.add_argument("--note", default="", help="why (shown by `show`)")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222",
                        help="NATS server URL, with an operator user's credentials")
    parser.add_argument("--prefix", default=subjects.DEFAULT_PREFIX, help="subject prefix")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the coordinator's answer (default 10)")
    return parser


def when(text: str) -> float:
    """Unix seconds from an ISO time (local) or a number."""
    try:
        return float(text)
    except ValueError:
        return dt.datetime.fromisoformat(text).timestamp()


def duration(text: str) -> float:
    """Seconds from `90`, `90s`, `30m`, `3h` or `1d`."""
    unit = _UNITS.get(text[-1:])
    return float(text[:-1]) * unit if unit else float(text)


def request_of(args: argparse.Namespace, now: float) -> BudgetRequest:
    """The request the arguments ask for (raises ValueError or ValidationError)."""
    if args.action != "set":
        return BudgetRequest(action=args.action, budget_id=args.budget_id)
    if args.cap_w is None and args.cut_pct is None:
        raise ValueError("set needs --cap-w or --cut-pct")
    if args.nodes:
        grp = BudgetGroup(kind="nodes", nodes=[n.strip() for n in args.nodes.split(",")])
    elif args.label:
        grp = BudgetGroup(kind="label", label=args.label)
    else:
        grp = BudgetGroup()
    start = when(args.start) if args.start else None
    end = when(args.end) if args.end else None
    if args.duration:
        end = (start if start is not None else now) + duration(args.duration)
    budget = Budget(budget_id=args.budget_id, group=grp, cap_w=args.cap_w, cut_pct=args.cut_pct,
                    start_s=start, end_s=end, note=args.note)
    return BudgetRequest(action="set", budget=budget)


NOT_AN_OPERATOR = ("this NATS user may not send budget requests: connect as an operator "
                   "(zeus-coordinator nats-auth --operator NAME)")
"""The reply's message when NATS refuses the request to this user."""


async def send(url: str, prefix: str, request: BudgetRequest, timeout_s: float) -> Reply:
    """Send `request`; a refusal by NATS's permissions comes back as a `forbidden` reply."""
    nc = await connect(url, "zeus-coordinator-budget",
                       inbox_prefix=permissions.inbox("operator", prefix=prefix))
    try:
        try:
            msg = await nc.request(subjects.coord_budget(prefix), codec.encode(request),
                                   timeout=timeout_s)
        except Exception:
            await asyncio.sleep(0.1)  # The server's -ERR may trail the request.
            try:
                refuse_if_not_permitted(nc, NOT_AN_OPERATOR)
            except PermissionRefusedError as e:
                return reply_for(e)
            raise
        return codec.decode(msg.data, Reply)
    finally:
        await nc.drain()


def show(reply: Reply) -> None:
    """The reply for people."""
    data: dict[str, Any] = reply.result
    for b in data.get("budgets", [data["budget"]] if "budget" in data else []):
        window = ""
        if b.get("start_s") or b.get("end_s"):
            fmt = lambda t: dt.datetime.fromtimestamp(t).isoformat(timespec="seconds")  # noqa: E731
            window = (f" from {fmt(b['start_s']) if b.get('start_s') else 'now'}"
                      f" to {fmt(b['end_s']) if b.get('end_s') else 'lifted'}")
        draw = f", drawing {b['draw_w']:.0f} W" if b.get("draw_w") is not None else ""
        floor = f", floor {b['floor_w']:.0f} W" if b.get("floor_w") is not None else ""
        print(f"{b['budget_id']}: {b['state']}, cap {b['cap_w']:.0f} W over {b['group_text']} "
              f"({b.get('gpus', 0)} GPUs{floor}{draw}){window}"
              + (f"  [{b['note']}]" if b.get("note") else ""))
        if b.get("problem"):
            print(f"    {b['problem']}")
    if data.get("overlaps"):
        print(f"overlaps {', '.join(data['overlaps'])}: the lower cap wins on shared GPUs")
    if "lifted" in data:
        print(f"lifted {data['lifted']}: its GPUs return to their jobs' optima")
    if data.get("budgets") == []:
        print("no budget")


def main(argv: Sequence[str]) -> int:
    """Entry point of `zeus-coordinator budget`."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        subjects.check_prefix(args.prefix)
        request = request_of(args, time.time())
    except (ValidationError, ValueError) as e:
        errors = getattr(e, "errors", None)
        parser.error("; ".join(str(err["msg"]) for err in errors()) if errors else str(e))
    try:
        reply = asyncio.run(send(args.nats_url, args.prefix, request, args.timeout))
    except ZeusAgentError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 3
    except Exception as e:  # noqa: BLE001 - NATS timeouts and no-responders, for people
        print(f"{PROG}: {type(e).__name__}: {e}; is a coordinator running on "
              f"{redact_url(args.nats_url)} with prefix {args.prefix!r}?", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"{PROG}: refused ({reply.code}): {reply.error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply.result, indent=2))
    else:
        show(reply)
    return 0
