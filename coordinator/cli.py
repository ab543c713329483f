"""`zeus-coordinator`: the coordinator's command line.

* `zeus-coordinator watch [JOB] [--once]`: follow job status events (or print a job's state).
* `zeus-coordinator quarantine list|drop|release`: the jobs set aside after a failure.
* `zeus-coordinator budget set|show|lift`: power budgets (`coordinator.budget_cli`).
* `zeus-coordinator run [flags]`: run the coordinator (every flag is also an environment
  variable with Zeus's `ZEUS_PFO_` prefix, e.g. `ZEUS_PFO_NATS_URL`, `ZEUS_PFO_LOG_LEVEL`).

Exit codes: 0 ok, 2 usage or configuration, 3 startup failure.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from zeus_agent.cli_kit import dispatch, run_service

DESCRIPTION = """\
Coordinator of the zeus-bus energy optimiser. It registers jobs and their ranks, runs the
power-limit optimiser of data-parallel jobs (profiling every power limit, then pinning the
one the selector picks on every GPU of the job, on every node), renews the leases that keep
the agents' settings, and reports job status on <prefix>.job.<job>.status.

examples:
  zeus-coordinator run --embedded-nats
  zeus-coordinator run --nats-url nats://nats.cluster:4222 --state-dir /var/lib/zeus
  zeus-coordinator watch --nats-url nats://nats.cluster:4222
"""


def _run(argv: Sequence[str]) -> int:
    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService

    return run_service(CoordinatorSettings, argv, "zeus-coordinator run", CoordinatorService)


def _watch(argv: Sequence[str]) -> int:
    from coordinator.watch import main as watch_main

    return watch_main(argv)


def _nats_auth(argv: Sequence[str]) -> int:
    from coordinator import nats_auth

    parser = nats_auth.build_parser("zeus-coordinator nats-auth")
    return nats_auth.main(parser.parse_args(list(argv)))


def _straggler(argv: Sequence[str]) -> int:
    from coordinator.straggler_cli import main as straggler_main

    return straggler_main(argv)


def _plan(argv: Sequence[str]) -> int:
    from coordinator.plan_cli import main as plan_main

    return plan_main(argv)


def _quarantine(argv: Sequence[str]) -> int:
    from coordinator.quarantine_cli import main as quarantine_main

    return quarantine_main(argv)


def _budget(argv: Sequence[str]) -> int:
    from coordinator.budget_cli import main as budget_main

    return budget_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeus-coordinator`."""
    return dispatch(
        argv, "zeus-coordinator", DESCRIPTION,
        {
            "run": (_run, "the coordinator service (see zeus-coordinator run --help)"),
            "watch": (_watch, "follow job status from a terminal"),
            "nats-auth": (_nats_auth, "write NATS users and permissions for a list of GPU nodes"),
            "plan": (_plan, "plan a pipeline's time-energy frontier from an instruction profile"),
            "straggler": (_straggler, "tell the coordinator a pipeline of a job is a straggler"),
            "budget": (_budget, "set, show or lift a power budget (operators)"),
            "quarantine": (_quarantine, "list, drop or release the jobs set aside after a "
                           "failure"),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
