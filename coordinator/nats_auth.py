"""`zeus-coordinator nats-auth`: write the NATS users and permissions of a deployment.

Writes the nats-server `authorization { users = [...] }` block (`zeus_agent.wire.permissions`)
for a list of GPU nodes: one user per node's agent, allowed only its own node's subjects, a
coordinator and a read-only observer. nats-server reads each password from an environment
variable; `--env-file` writes random ones (keeping those already in the file).

Run as `python -m coordinator.nats_auth --node gpu-a --node gpu-b --out auth.conf`.
"""

from __future__ import annotations

import argparse
import re
import secrets
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from zeus_agent.fileio import atomic_write
from zeus_agent.wire import permissions, subjects

PROG = "zeus-coordinator nats-auth"

DESCRIPTION = """\
Write the NATS users and subject permissions of a zeus-bus deployment: the nats-server
`authorization { users = [...] }` block, for `include` from the server's configuration
(deploy/nats/nats-server.conf includes ./auth.conf).

Users:
  agent-<node>   one per GPU node, for that node's zeus-agent: publishes only its own node's
                 subjects, serves only its own GPUs' commands, reads only its own replies
  coordinator    zeus-coordinator: commands every GPU, serves registrations and queries
  observer       zeus-coordinator watch, dashboards: read-only
  operator-<name>  one per --operator: sets, shows and lifts power budgets
                 (zeus-coordinator budget); nobody else may

Passwords are not in the file: nats-server reads each from an environment variable,
ZEUS_NATS_AGENT_<NODE>_PASSWORD (NODE: the node name in capitals, every character other than
A-Z and 0-9 replaced by '_'), ZEUS_NATS_COORDINATOR_PASSWORD and ZEUS_NATS_OBSERVER_PASSWORD.
They must be set wherever nats-server reads the configuration, `nats-server -t -c` included.
Use passwords of letters and digits that start with a letter (nats-server parses a value such
as 123456 or true as a number or a boolean and refuses it); --env-file writes such passwords.

Clients connect as nats://USER:PASSWORD@HOST:4222 and must use their role's reply inbox
prefix (_INBOX.<prefix>.node.<node>, _INBOX.<prefix>.coord, _INBOX.<prefix>.observer).
"""

EPILOG = """\
examples:
  zeus-coordinator nats-auth --node gpu-a --node gpu-b --out /etc/nats/auth.conf
  zeus-coordinator nats-auth --nodes-file nodes.txt --out auth.conf --env-file nats.env
  zeus-coordinator nats-auth --node gpu-a --prefix zeus-prod     # prints to stdout
"""

_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the command's options to `parser`."""
    parser.add_argument(
        "--node", action="append", default=[], metavar="NAME",
        help="a GPU node's name, as its agent's --node (default: its host name); repeat for "
        "every node",
    )  # fmt: skip
    parser.add_argument(
        "--nodes-file", type=Path, metavar="FILE",
        help="a file with more node names, one a line ('#' starts a comment; '-': stdin)",
    )  # fmt: skip
    parser.add_argument(
        "--operator", action="append", default=[], metavar="NAME",
        help="an operator allowed to set power budgets (user operator-NAME, password in "
        "ZEUS_NATS_OPERATOR_<NAME>_PASSWORD); repeat for each",
    )  # fmt: skip
    parser.add_argument(
        "--prefix", default=subjects.DEFAULT_PREFIX,
        help="subject prefix of the deployment, as the services' --prefix (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, metavar="FILE",
        help="write the authorization block to FILE (default: standard output)",
    )  # fmt: skip
    parser.add_argument(
        "--env-file", type=Path, metavar="FILE",
        help="also write NAME=password lines for every user to FILE (mode 0600), keeping the "
        "passwords already there; give it to nats-server's environment (EnvironmentFile=)",
    )  # fmt: skip


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command's parser, with `add_arguments`."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def _nodes(args: argparse.Namespace) -> list[str]:
    nodes = [n.strip() for n in args.node]
    if args.nodes_file is not None:
        from_stdin = str(args.nodes_file) == "-"
        text = sys.stdin.read() if from_stdin else args.nodes_file.read_text()
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                nodes.append(line)
    if any(not n for n in nodes):
        raise ValueError("an empty node name was given")
    return nodes


def new_password() -> str:
    """A random password nats-server reads as a string from the environment: `z` + 48 hex."""
    return "z" + secrets.token_hex(24)


def env_file_text(variables: Sequence[str], existing: str = "") -> str:
    """`NAME=password` lines for `variables`, keeping any value already in `existing`."""
    known: dict[str, str] = {}
    for line in existing.splitlines():
        m = _ENV_LINE.match(line)
        if m:
            known[m.group(1)] = m.group(2)
    lines = ["# NATS passwords of zeus-bus (zeus-coordinator nats-auth); keep secret."]
    lines += [f"{v}={known.get(v) or new_password()}" for v in variables]
    extra = [v for v in known if v not in variables]
    lines += [f"{v}={known[v]}" for v in extra]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run the command on parsed `args`; 0 on success, 2 on a usage error."""
    try:
        nodes = _nodes(args)
        words = ["zeus-coordinator", "nats-auth"]
        if args.prefix != subjects.DEFAULT_PREFIX:
            words += ["--prefix", args.prefix]
        for node in dict.fromkeys(nodes):
            words += ["--node", node]
        operators = [o.strip() for o in args.operator]
        if any(not o for o in operators):
            raise ValueError("an empty operator name was given")
        for name in dict.fromkeys(operators):
            words += ["--operator", name]
        command = shlex.join(words)
        text = permissions.render_authorization(nodes, args.prefix, command=command,
                                                operators=operators)
        users = permissions.users(nodes, args.prefix, operators)
    except (ValueError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
    else:
        atomic_write(args.out, text, 0o644)
        print(f"{PROG}: wrote {len(users)} users to {args.out}", file=sys.stderr)
    if args.env_file is not None:
        existing = args.env_file.read_text() if args.env_file.exists() else ""
        variables = [u.password_variable for u in users]
        atomic_write(args.env_file, env_file_text(variables, existing), 0o600)
        print(f"{PROG}: passwords in {args.env_file} (mode 0600)", file=sys.stderr)
    width = max(len(u.name) for u in users)
    print("users, and the variable nats-server reads each password from:", file=sys.stderr)
    for u in users:
        print(f"  {u.name:<{width}}  ${u.password_variable}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser("python -m coordinator.nats_auth").parse_args()))
