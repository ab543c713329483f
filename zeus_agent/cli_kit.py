"""What the `zeus-agent` and `zeus-coordinator` command lines share.

* `dispatch(argv, prog, description, commands)`: `prog <command> [flags]` with a help page.
* `run_service(settings_cls, argv, prog, make)`: parse flags and environment into a settings
  object (pydantic-settings), set up logging, run the service until a signal stops it, and map
  failures to exit codes with a one-line reason on stderr (no traceback):

  * 0: stopped by SIGTERM/SIGINT after a clean shutdown;
  * 2 (`CONFIG_ERROR`): a flag or environment variable is invalid;
  * 3 (`STARTUP_FAILURE`): NATS unreachable, the socket or port unusable, a file or directory
    that cannot be created or written;
  * 4 (`BUS_LOST`, the agent): the NATS server closed the connection for good; the GPU settings
    were restored; the supervisor should start a fresh process;
  * 130 (`INTERRUPTED`): interrupted before the service installed its signal handlers.

  A service reports an exit code other than 0 by setting its `exit_code` attribute.

Only command lines turn errors into exit codes.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pydantic_settings import BaseSettings

from zeus_agent.aio import run_event_loop

CONFIG_ERROR = 2
STARTUP_FAILURE = 3
BUS_LOST = 4
INTERRUPTED = 130
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
        The exit code (see the module docstring).
    """
    from pydantic import ValidationError
    from pydantic_settings import CliApp, CliSettingsSource, SettingsError

    from zeus_agent.errors import ZeusAgentError

    name = prog.split()[0]
    try:
        source: CliSettingsSource[Any] = CliSettingsSource(settings_cls, cli_prog_name=prog)
        settings = CliApp.run(settings_cls, cli_args=list(argv), cli_settings_source=source)
    except ValidationError as e:
        print(f"{prog}: invalid configuration: {describe_validation_error(e)}", file=sys.stderr)
        return CONFIG_ERROR
    except (SettingsError, ValueError) as e:
        print(f"{prog}: invalid configuration: {_one_line(str(e))}", file=sys.stderr)
        return CONFIG_ERROR
    level = getattr(settings, "log_level", "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(prog).debug("settings: %s", settings.model_dump())
    service = make(settings)

    async def main() -> None:
        service.install_signal_handlers()
        await service.serve()

    try:
        run_event_loop(main())
    except KeyboardInterrupt:
        return INTERRUPTED
    except BaseException as raised:  # noqa: BLE001 - mapped below, else raised again
        inner = _single(raised)
        if isinstance(inner, ZeusAgentError):
            print(f"{name}: {_one_line(str(inner))}", file=sys.stderr)
            return STARTUP_FAILURE
        if isinstance(inner, OSError):
            print(f"{name}: {describe_os_error(inner)}", file=sys.stderr)
            return STARTUP_FAILURE
        if isinstance(inner, KeyboardInterrupt):
            return INTERRUPTED
        raise
    return int(getattr(service, "exit_code", 0) or 0)


def _single(e: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one exception, else `e`."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe_validation_error(e: Any) -> str:
    """One line naming each bad flag and why: `--prefix: invalid subject prefix 'a b' ...`."""
    parts = []
    for err in e.errors():
        loc = [str(part) for part in err.get("loc", ()) if str(part)]
        flag = "--" + "-".join(loc[:1]).replace("_", "-") if loc else ""
        message = str(err.get("msg", "invalid"))
        message = message.removeprefix("Value error, ")
        parts.append(f"{flag}: {message}" if flag else message)
    return _one_line("; ".join(parts))


_OS_HINTS = {
    errno.EACCES: "check the permissions of that path for the user the service runs as",
    errno.EPERM: "check the permissions of that path for the user the service runs as",
    errno.EROFS: "the file system is read-only; choose a writable path",
    errno.EEXIST: "a file is in the way of a directory; remove it or choose another path",
    errno.ENOTDIR: "a file is in the way of a directory; remove it or choose another path",
    errno.EISDIR: "a directory is in the way of a file; choose another path",
    errno.ENOSPC: "the disk is full",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.EADDRINUSE: "the address is in use; choose another port or stop what holds it",
}


def describe_os_error(e: OSError) -> str:
    """One line: what failed, on which path, and what to do (for the common errnos)."""
    what = e.strerror or str(e) or type(e).__name__
    path = ""
    if e.filename is not None:
        path = f": {e.filename}"
        if e.filename2 is not None:
            path += f" -> {e.filename2}"
    hint = _OS_HINTS.get(e.errno or 0)
    return _one_line(f"{what}{path}" + (f" ({hint})" if hint else ""))


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
