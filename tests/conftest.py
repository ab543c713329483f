"""Shared fixtures: a real nats-server per test module, and a connected client."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from zeus_agent.broker import EmbeddedNats, connect

# Bytecode is written while the suite runs, whatever PYTHONDONTWRITEBYTECODE says (this host and
# its CI set it): without a cache every process the suite starts (agents, coordinators, replicas,
# trainers' ranks, CLIs: hundreds) compiled the package from source again, and each xdist worker
# rewrote every test module's asserts again. Cached, a process-level test file takes a third less
# CPU (tests/e2e/test_agent_cli.py + test_coordinator_cli.py: 16.1 -> 10.8 user-s). Set here, before
# the workers and the test modules' imports; children inherit the environment.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

TIERS = {"core": "core", "wire": "core", "fuzz": "fuzz", "shell": "shell", "e2e": "e2e",
         "deploy": "deploy", "docs": "deploy"}
"""Test folder -> its marker (`make test-fast` runs the `core` tier alone)."""


FIRST = ("e2e", "shell", "deploy", "fuzz", "docs", "core", "wire")
"""Folders in the order their files start: the long process-level tests first, so the many
short pure ones fill both `make test` workers' ends (with xdist's `--no-loadscope-reorder`;
its default starts the files with the most tests first, the long e2e files with a few last)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier, from the folder it lives in; long tiers first."""
    tests = Path(__file__).resolve().parent
    rank: dict[int, int] = {}
    for item in items:
        try:
            folder = Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        except (ValueError, IndexError):
            continue
        rank[id(item)] = FIRST.index(folder) if folder in FIRST else len(FIRST)
        tier = TIERS.get(folder)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=lambda item: rank.get(id(item), len(FIRST)))  # (Stable: files stay whole.)


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    """A real nats-server on a free loopback port, shared by one test module."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    """A client connection to the module's nats-server, drained after the test."""
    conn = await connect(nats_server.url, "test-client")
    yield conn
    await conn.drain()
