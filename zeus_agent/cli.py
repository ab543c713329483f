"""`zeus-agent`: the node agent's command line.

Subcommands:
* `zeus-agent run [flags]`: run the agent for this node's GPUs (see `zeus-agent run --help`;
  every flag is also an environment variable `ZEUS_AGENT_<FLAG>`).
* `zeus-agent broker [--port N]`: run an embedded nats-server in the foreground (development).

Only the command line turns errors into exit codes (`zeus_agent.cli_kit`): 0 ok, 2 usage or
configuration, 3 startup failure, 4 the NATS server closed the connection for good (the agent
restored its GPUs; its supervisor should restart it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from zeus_agent.cli_kit import dispatch, run_service

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
    from zeus_agent.config import AgentSettings

    return run_service(AgentSettings, argv, "zeus-agent run", AgentServer)


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
