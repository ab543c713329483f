"""Cores are pure: no asyncio, NATS, NVML, sockets, clocks or threads.

Parses the imports of every checked module with `ast` (nothing is imported or executed).
Add paths to `PURE_PATHS` as new cores appear; a path that does not exist yet is skipped, except
those in `REQUIRED_PATHS`, so the guard can never pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PURE_PATHS: tuple[str, ...] = (
    "zeus_agent/agent/core",
    "zeus_agent/gpu/sim/physics.py",
    "zeus_agent/gpu/sim/state.py",
    "zeus_agent/gpu/sim/timing.py",
    "zeus_agent/gpu/sim/timing_h200.py",
    "zeus_agent/wire",
    "coordinator/power_limit",
    "coordinator/pipeline",
    "coordinator/jobs",
    "coordinator/optimizer.py",
)
"""Files or directories (searched recursively) whose modules must stay pure."""

REQUIRED_PATHS: tuple[str, ...] = (
    "zeus_agent/agent/core",
    "coordinator/power_limit",
    "coordinator/pipeline",
    "coordinator/jobs",
    "coordinator/optimizer.py",
)
"""Paths in `PURE_PATHS` that must exist."""

FORBIDDEN_MODULES: frozenset[str] = frozenset(
    {"asyncio", "nats", "pynvml", "socket", "time", "threading"}
)
"""Top-level packages a pure module may not import."""


def forbidden_imports(source: str, filename: str = "<string>") -> list[str]:
    """Return "line N: module" for every import of a forbidden module in `source`."""
    hits: list[str] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        names: list[str] = []
        if not isinstance(node, ast.stmt | ast.expr):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name | ast.Attribute)
            and getattr(node.func, "id", getattr(node.func, "attr", None))
            in {"__import__", "import_module"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        hits.extend(
            f"line {node.lineno}: {name}"
            for name in names
            if name.split(".")[0] in FORBIDDEN_MODULES
        )
    return hits


def pure_modules() -> list[Path]:
    files: list[Path] = []
    for rel in PURE_PATHS:
        path = ROOT / rel
        if path.is_dir():
            files.extend(sorted(path.rglob("*.py")))
        elif path.is_file():
            files.append(path)
    return files


@pytest.mark.parametrize("rel", REQUIRED_PATHS)
def test_required_paths_exist(rel: str) -> None:
    path = ROOT / rel
    assert path.exists(), f"{rel} is listed as pure but does not exist"
    assert not path.is_dir() or any(path.rglob("*.py"))


@pytest.mark.parametrize("path", pure_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_pure(path: Path) -> None:
    hits = forbidden_imports(path.read_text(encoding="utf-8"), str(path))
    assert not hits, f"{path.relative_to(ROOT)} imports impure modules: {', '.join(hits)}"


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("import asyncio", True),
        ("import nats.aio.client", True),
        ("from time import monotonic_ns", True),
        ("from threading import Lock", True),
        ("import os, socket", True),
        ("from pynvml import nvmlInit", True),
        ("def f():\n    import time\n", True),  # nested imports count too
        ("importlib.import_module('asyncio')", True),
        ("__import__('time')", True),
        ("import timeit", False),  # prefix of a forbidden name is fine
        ("from .time import x", False),  # relative: a sibling module, not the stdlib
        ("import math, bisect\nfrom dataclasses import dataclass", False),
        ("from zeus_agent.errors import ZeusAgentError", False),
    ],
)
def test_checker(source: str, bad: bool) -> None:
    assert bool(forbidden_imports(source)) is bad
