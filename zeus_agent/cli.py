"""`zeus-agent`: the node agent's command line.

Subcommands:
* `zeus-agent run [flags]`: run the agent for this node's GPUs (see `zeus-agent run --help`;
  every flag is also an environment variable `ZEUS_AGENT_<FLAG>`).
* `zeus-agent broker [--port N]`: run an embedded nats-server in the foreground (development);
  a bad port is a one-line usage error (2), a port in use a one-line startup failure (3);
  SIGTERM, SIGINT and SIGHUP stop the server and remove its temporary store.

Only the command line turns errors into exit codes (`zeus_agent.cli_kit`): 0 ok, 2 usage or
configuration, 3 startup failure, 4 the NATS server closed the connection for good (the agent
restored its GPUs; its supervisor should restart it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from zeus_agent.cli_kit import CONFIG_ERROR, STARTUP_FAILURE, dispatch, run_service

DESCRIPTION = """\
GPU agent of the zeus-bus energy optimiser. Run one per node: it samples the node's GPUs,
publishes energy and time on NATS, obeys power-limit and clock commands from the coordinator
(restoring defaults when their lease lapses), and relays the node's trainers' events
(zeus_agent.emit) from a local Unix socket.

exit codes: 0 ok; 2 usage or configuration; 3 startup failure (NATS unreachable, socket or
metrics port unusable); 4 the NATS server closed the connection for good: GPU settings were
restored, restart the agent (systemd Restart=on-failure does).

examples:
  zeus-agent run --embedded-nats --backend sim --sim-count 2 --socket-path /tmp/zeus.sock
  zeus-agent run --nats-url nats://nats.cluster:4222 --gpus 0,1,2,3
  zeus-agent run --nats-url tls://nats:4222 --nats-tls-ca ca.pem --nats-tls-cert agent.pem
  zeus-agent broker --port 4222
"""


def _run(argv: Sequence[str]) -> int:
    from zeus_agent.agent.server import AgentServer
    from zeus_agent.config import AgentSettings, old_flags

    return run_service(AgentSettings, old_flags(argv), "zeus-agent run", AgentServer)


BROKER_DESCRIPTION = """\
Run a nats-server with JetStream on 127.0.0.1 in the foreground (development).
Its JetStream store is a temporary directory, removed when it stops. SIGTERM,
SIGINT (Ctrl-C) or SIGHUP stop it cleanly; if this process is killed (SIGKILL),
nats-server gets SIGTERM from the kernel (Linux) and stops too.

exit codes: 0 stopped by a signal; 1 nats-server ended on its own; 2 usage (a
port outside 0..65535); 3 nats-server could not start (the port is in use, no
nats-server binary).
"""


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(CONFIG_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a TCP port: give 1..65535, or 0 for any free port"
        )
    return port


def _checked(check: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type from a checker raising ValueError (its text becomes the error)."""
    def parse(text: str) -> str:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _broker(argv: Sequence[str]) -> int:
    import signal

    from zeus_agent.broker import EmbeddedNats, PortInUseError, check_jetstream_sync
    from zeus_agent.errors import BrokerError

    prog = "zeus-agent broker"
    parser = _OneLineParser(
        prog=prog, description=BROKER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--port", type=_port, default=4222,
        help="client port, 1..65535, or 0 for any free one (the ready line names it) "
        "(default: 4222)",
    )
    parser.add_argument(
        "--jetstream-sync", type=_checked(check_jetstream_sync), default="always",
        metavar="always|DURATION",
        help="JetStream's sync_interval: 'always' fsyncs each write before acknowledging it, "
        "so a power loss loses nothing acknowledged; a duration such as '2m' (nats-server's "
        "default) flushes periodically, faster but unsafe on power loss (default: always)",
    )
    args = parser.parse_args(argv)

    # A signal only asks to stop: the server is stopped and its directory removed below, once
    # whatever runs now (a start: at most its ready timeout) is done.
    stop: list[int] = []
    previous = {}

    def ask_to_stop(signum: int, _frame: object) -> None:
        stop.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[sig] = signal.signal(sig, ask_to_stop)
    server = EmbeddedNats(port=args.port, die_with_parent=True,
                          jetstream_sync=args.jetstream_sync)
    try:
        try:
            server.start()
        except PortInUseError as e:
            print(f"{prog}: port {e.port} is already in use (another nats-server or another "
                  f"program holds it): stop it, or choose another port with --port "
                  f"(0: any free one)", file=sys.stderr)
            return STARTUP_FAILURE
        except (BrokerError, OSError) as e:
            print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
            return STARTUP_FAILURE
        if not stop:
            print(f"nats-server ready at {server.url}; Ctrl-C to stop", flush=True)
        while not stop and server.running:
            time.sleep(0.1)
        if stop:
            return 0
        reason = server.exit_reason() or "no reason in its log"
        print(f"{prog}: nats-server ended on its own (code {server.returncode}): {reason}",
              file=sys.stderr)
        return 1
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeus-agent`."""
    return dispatch(
        argv,
        "zeus-agent",
        DESCRIPTION,
        {
            "run": (_run, "the agent (see zeus-agent run --help)"),
            "broker": (_broker, "a development nats-server"),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
