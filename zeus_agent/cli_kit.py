"""What the `zeus-agent` and `zeus-coordinator` command lines share.

* `dispatch(argv, prog, description, commands)`: `prog <command> [flags]` with a help page.
* `run_service(settings_cls, argv, prog, make)`: parse flags and environment into a settings
  object (pydantic-settings), set up logging, run the service until a signal stops it, and map
  failures to exit codes (0 ok, 2 configuration, 3 startup failure, 130 interrupted).

Only command lines turn errors into exit codes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pydantic_settings import BaseSettings

from zeus_agent.aio import run_event_loop

STARTUP_FAILURE = 3
S = TypeVar("S", bound=BaseSettings)


class Service(Protocol):
    """A long-running service: signal handlers set its exit event; `serve` runs it."""

    def install_signal_handlers(self) -> None:
        """Make SIGINT/SIGTERM stop the service gracefully."""

    async def serve(self) -> None:
        """Start, run until asked to exit, shut down."""


def run_service(
    settings_cls: type[S], argv: Sequence[str], prog: str, make: Callable[[S], Service]
) -> int:
    """Build the settings from flags and environment, then run the service.

    Returns:
        The exit code.
    """
    from pydantic import ValidationError
    from pydantic_settings import CliApp, CliSettingsSource

    from zeus_agent.errors import ZeusAgentError

    try:
        source: CliSettingsSource[Any] = CliSettingsSource(settings_cls, cli_prog_name=prog)
        settings = CliApp.run(settings_cls, cli_args=list(argv), cli_settings_source=source)
    except ValidationError as e:
        print(f"{prog}: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    level = getattr(settings, "log_level", "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(prog).debug("settings: %s", settings.model_dump())
    service = make(settings)

    async def main() -> None:
        service.install_signal_handlers()
        await service.serve()

    try:
        run_event_loop(main())
    except ZeusAgentError as e:
        print(f"{prog.split()[0]}: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    except KeyboardInterrupt:
        return 130
    return 0


def dispatch(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    commands: dict[str, tuple[Callable[[list[str]], int], str]],
) -> int:
    """Run `prog <command> [args]`; without a known command print the help page.

    Args:
        argv: Arguments after the program name (default `sys.argv[1:]`).
        prog: Program name.
        description: The help page's text.
        commands: name -> (function taking the remaining arguments, one-line help).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in commands:
        return commands[args[0]][0](args[1:])
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command",
        choices=sorted(commands),
        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(commands.items())),
    )
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    parser.parse_args(args[:1])  # prints the usage error and exits 2
    return 2
