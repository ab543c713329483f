"""Write every NATS credential file of a zeus-bus deployment, for servers and clients.

`zeus-coordinator nats-auth` writes nats-server's side: the users (`auth.conf`) and their
passwords (`nats.env`, kept from one run to the next). This script runs it, then writes each
client's side from those passwords, so nobody copies a password by hand:

    auth.conf             nats-server's users and permissions (no secret; include it)
    nats.env              every user's password, for nats-server's environment (secret)
    coordinator.env       ZEUS_PFO_NATS_URL=nats://coordinator:<password>@<servers>
    observer.env          ZEUS_OBSERVER_NATS_URL=nats://observer:<password>@<servers>
                          (for `zeus-coordinator watch --nats-url "$ZEUS_OBSERVER_NATS_URL"`)
    agent-<node>.env      ZEUS_AGENT_NATS_USER and ZEUS_AGENT_NATS_PASSWORD of that node's
                          agent: copy it to that node only (/etc/zeus/agent-nats.env)

Every file is rewritten from `nats.env`, so running it again after adding a node keeps the
other users' passwords (and their client files unchanged); the files of nodes no longer
listed are removed. Secret files get mode 0600, or 0640 with --group-readable (the compose
file shares them with its services' group).

    python deploy/credentials.py --node gpu01 --node gpu02 --dir /etc/zeus/credentials

It needs the zeus-bus package (it runs in the image too: deploy/docker/compose.yaml).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from coordinator import nats_auth
from zeus_agent.fileio import atomic_write
from zeus_agent.wire import permissions, subjects

_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` (comma-separated servers too) with `user:password@` in every server's address.

    Raises:
        ValueError: A server address without a scheme, or one that already has credentials.
    """
    servers = []
    for server in (s.strip() for s in url.split(",")):
        scheme, sep, rest = server.partition("://")
        if not sep or not rest:
            raise ValueError(f"{server!r}: give NATS servers as nats://host:port or tls://...")
        if "@" in rest:
            raise ValueError(f"{server!r} already has credentials; give the address only")
        servers.append(f"{scheme}://{user}:{password}@{rest}")
    return ",".join(servers)


def read_env(text: str) -> dict[str, str]:
    """`NAME=value` lines of an environment file."""
    values = {}
    for line in text.splitlines():
        m = _ENV_LINE.match(line)
        if m:
            values[m.group(1)] = m.group(2)
    return values


def agent_file_name(node: str) -> str:
    """`agent-<token>.env`: the node's NATS user name is a safe file name."""
    return f"{permissions.agent_user(node)}.env"


def client_files(
    nodes: Sequence[str], passwords: dict[str, str], url: str, prefix: str
) -> dict[str, str]:
    """File name -> content of every client's environment file.

    Raises:
        KeyError: A user's password is missing from `passwords`.
    """
    files: dict[str, str] = {}
    header = "# NATS credentials of zeus-bus (deploy/credentials.py); keep secret.\n"
    for u in permissions.users(nodes, prefix):
        password = passwords[u.password_variable]
        if u.role == "agent":
            assert u.node is not None
            files[agent_file_name(u.node)] = (
                f"{header}# the agent of node {u.node!r} only (its --node must be that name)\n"
                f"ZEUS_AGENT_NATS_USER={u.name}\nZEUS_AGENT_NATS_PASSWORD={password}\n"
            )
        elif u.role == "coordinator":
            files["coordinator.env"] = (
                f"{header}ZEUS_PFO_NATS_URL={with_credentials(url, u.name, password)}\n"
            )
        else:
            files["observer.env"] = (
                f"{header}ZEUS_OBSERVER_NATS_URL={with_credentials(url, u.name, password)}\n"
            )
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0, or 2 for bad arguments)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="See the module's docstring and deploy/README.md.",
    )
    parser.add_argument(
        "--node", action="append", default=[], metavar="NAME", required=True,
        help="a GPU node's name, as its agent's --node; repeat for every node",
    )  # fmt: skip
    parser.add_argument(
        "--dir", type=Path, required=True, help="directory of the files (created if missing)"
    )
    parser.add_argument(
        "--nats-url", default="nats://nats:4222",
        help="the servers' address(es) the clients use, comma separated (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix", default=subjects.DEFAULT_PREFIX, help="subject prefix (default: %(default)s)"
    )
    parser.add_argument(
        "--group-readable", action="store_true",
        help="secret files mode 0640 instead of 0600 (readers share the files' group)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    mode = 0o640 if args.group_readable else 0o600
    directory: Path = args.dir
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with_credentials(args.nats_url, "u", "p")  # check the URL before writing anything
    except (OSError, ValueError) as e:
        print(f"credentials: {e}", file=sys.stderr)
        return 2
    env_path = directory / "nats.env"
    auth_args = [f"--node={n}" for n in args.node]
    auth_args += ["--prefix", args.prefix, "--out", str(directory / "auth.conf")]
    auth_args += ["--env-file", str(env_path)]
    code = nats_auth.main(nats_auth.build_parser().parse_args(auth_args))
    if code:
        return code
    os.chmod(env_path, mode)
    passwords = read_env(env_path.read_text())
    files = client_files(args.node, passwords, args.nats_url, args.prefix)
    for name, text in files.items():
        atomic_write(directory / name, text, mode)
        print(f"credentials: wrote {directory / name}", file=sys.stderr)
    for stale in directory.glob(f"{permissions.AGENT_USER_PREFIX}*.env"):
        if stale.name not in files:
            stale.unlink()
            print(f"credentials: removed {stale} (node no longer listed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
