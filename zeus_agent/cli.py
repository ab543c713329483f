"""`zeus-agent`: the node agent's command line.

Subcommands:
* `zeus-agent run [flags]`: run the agent for this node's GPUs (see `zeus-agent run --help`;
  every flag is also an environment variable `ZEUS_AGENT_<FLAG>`).
* `zeus-agent broker [--port N]`: run an embedded nats-server in the foreground (development).

Only this module turns errors into exit codes: 0 ok, 2 usage, 3 startup failure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence

STARTUP_FAILURE = 3

DESCRIPTION = """\
GPU agent of the zeus-bus energy optimiser. Run one per node: it samples the node's GPUs,
publishes energy and time on NATS, obeys power-limit and clock commands from the coordinator
(restoring defaults when their lease lapses), and relays the node's trainers' events
(zeus_agent.emit) from a local Unix socket.

examples:
  zeus-agent run --embedded-nats --backend sim --sim-count 2 --socket-path /tmp/zeus.sock
  zeus-agent run --nats-url nats://nats.cluster:4222 --gpus 0,1,2,3
  zeus-agent broker --port 4222
"""


def run_event_loop(main: object) -> None:
    """Run a coroutine on uvloop when available."""
    try:
        import uvloop

        uvloop.run(main)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(main)  # type: ignore[arg-type]


def _run(argv: Sequence[str]) -> int:
    from pydantic import ValidationError
    from pydantic_settings import CliApp

    from zeus_agent.agent.server import AgentServer
    from zeus_agent.config import AgentSettings
    from zeus_agent.errors import ZeusAgentError

    try:
        settings = CliApp.run(AgentSettings, cli_args=list(argv), cli_prog_name="zeus-agent run")
    except ValidationError as e:
        print(f"zeus-agent run: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = AgentServer(settings)

    async def main() -> None:
        server.install_signal_handlers()
        await server.serve()

    try:
        run_event_loop(main())
    except ZeusAgentError as e:
        print(f"zeus-agent: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    except KeyboardInterrupt:
        return 130
    return 0


def _broker(argv: Sequence[str]) -> int:
    from zeus_agent.broker import EmbeddedNats

    parser = argparse.ArgumentParser(
        prog="zeus-agent broker",
        description="Run a nats-server with JetStream on 127.0.0.1 in the foreground.",
    )
    parser.add_argument("--port", type=int, default=4222, help="client port (default: 4222)")
    args = parser.parse_args(argv)
    with EmbeddedNats(port=args.port) as server:
        print(f"nats-server ready at {server.url}; Ctrl-C to stop", flush=True)
        try:
            while server.running:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeus-agent`."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"run": _run, "broker": _broker}
    if not args or args[0] in ("-h", "--help") or args[0] not in commands:
        parser = argparse.ArgumentParser(
            prog="zeus-agent",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument(
            "command",
            choices=sorted(commands),
            help="run: the agent; broker: a development nats-server",
        )
        if not args or args[0] in ("-h", "--help"):
            parser.print_help()
            return 0 if args else 2
        parser.parse_args(args[:1])  # prints the usage error and exits 2
    return commands[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
