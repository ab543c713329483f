"""`zeus-coordinator`: the coordinator's command line.

* `zeus-coordinator run [flags]`: run the coordinator (every flag is also an environment
  variable with Zeus's `ZEUS_PFO_` prefix, e.g. `ZEUS_PFO_NATS_URL`, `ZEUS_PFO_LOG_LEVEL`).

Exit codes: 0 ok, 2 usage or configuration, 3 startup failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

STARTUP_FAILURE = 3

DESCRIPTION = """\
Coordinator of the zeus-bus energy optimiser. It registers jobs and their ranks, runs the
power-limit optimiser of data-parallel jobs (profiling every power limit, then pinning the
one the selector picks on every GPU of the job, on every node), renews the leases that keep
the agents' settings, and reports job status on <prefix>.job.<job>.status.

examples:
  zeus-coordinator run --embedded-nats
  zeus-coordinator run --nats-url nats://nats.cluster:4222 --state-dir /var/lib/zeus
"""


def _run(argv: Sequence[str]) -> int:
    from pydantic import ValidationError
    from pydantic_settings import CliApp

    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService
    from zeus_agent.cli import run_event_loop
    from zeus_agent.errors import ZeusAgentError

    try:
        settings = CliApp.run(
            CoordinatorSettings, cli_args=list(argv), cli_prog_name="zeus-coordinator run"
        )
    except ValidationError as e:
        print(f"zeus-coordinator run: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger(__name__).debug("settings: %s", settings.model_dump())
    service = CoordinatorService(settings)

    async def main() -> None:
        service.install_signal_handlers()
        await service.serve()

    try:
        run_event_loop(main())
    except ZeusAgentError as e:
        print(f"zeus-coordinator: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeus-coordinator`."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"run": _run}
    if not args or args[0] in ("-h", "--help") or args[0] not in commands:
        parser = argparse.ArgumentParser(prog="zeus-coordinator", description=DESCRIPTION,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument(
            "command", choices=sorted(commands), help="run: the coordinator service"
        )
        if not args or args[0] in ("-h", "--help"):
            parser.print_help()
            return 0 if args else 2
        parser.parse_args(args[:1])
    return commands[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
