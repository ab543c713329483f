"""Cores are pure: no asyncio, NATS, NVML, sockets, clocks, threads, files or environment.

Parses every checked module with `ast` (nothing is imported or executed) and refuses:

* imports of `FORBIDDEN_MODULES` (static, nested, or by `__import__` / `import_module` with a
  literal name);
* calls of the builtins that reach files or the terminal (`open`, `input`) and of a path's
  file methods (`read_text`, `write_bytes`, ...);
* any use of the environment: `environ`, `getenv`, `putenv`, `unsetenv` (as a name or an
  attribute, so `os.environ` and `from os import environ` are both caught).

Inside the core trees, the modules that do I/O on purpose are listed in `IO_EDGES` with what
they do; each says so in its docstring ("I/O edge"), and a pure module may import one only
where `EDGE_IMPORTS` says why. Add paths to `PURE_PATHS` as new cores appear; a path that does
not exist yet is skipped, except those in `REQUIRED_PATHS`, so the guard can never pass
vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PURE_PATHS: tuple[str, ...] = (
    "zeus_agent/agent/core",
    "zeus_agent/gpu/power_integrator.py",
    "zeus_agent/gpu/sim/physics.py",
    "zeus_agent/gpu/sim/state.py",
    "zeus_agent/gpu/sim/timing.py",
    "zeus_agent/gpu/sim/timing_h200.py",
    "zeus_agent/pipeline_order.py",
    "zeus_agent/selectors.py",
    "zeus_agent/wire",
    "coordinator/power_limit",
    "coordinator/pipeline",
    "coordinator/jobs",
    "coordinator/optimizer.py",
    "coordinator/state/records.py",
    "coordinator/state/ownership.py",
    "coordinator/budget/allocator.py",
    "coordinator/budget/budgets.py",
    "coordinator/budget/capped_profiles.py",
    "coordinator/budget/enforce.py",
    "coordinator/budget/frontier_options.py",
)
"""Files or directories (searched recursively) whose modules must stay pure."""

REQUIRED_PATHS: tuple[str, ...] = (
    "zeus_agent/agent/core",
    "zeus_agent/pipeline_order.py",
    "coordinator/power_limit",
    "coordinator/pipeline",
    "coordinator/jobs",
    "coordinator/optimizer.py",
    "coordinator/state/records.py",
    "coordinator/state/ownership.py",
)
"""Paths in `PURE_PATHS` that must exist."""

IO_EDGES: dict[str, str] = {
    "coordinator/pipeline/dumps.py": "writes a job's dumps and the files its scheduler produced",
    "coordinator/pipeline/schedulers/settings.py": "reads ZEUS_PFO_* (pydantic-settings)",
    "coordinator/pipeline/schedulers/plan_file.py": "reads PointSolution's plan files",
    "coordinator/pipeline/planner/profile_file.py": "reads instruction profile CSV files",
    "coordinator/pipeline/planner/lazy.py": "loads the compiled kernels (numba's cache files)",
}
"""Modules inside `PURE_PATHS` that do I/O on purpose, and what they do."""

EDGE_IMPORTS: dict[str, frozenset[str]] = {
    # Zeus 0.16's PointSolution takes its plan's path and reads it when built.
    "coordinator/pipeline/schedulers/point_solution.py": frozenset(
        {"coordinator.pipeline.schedulers.plan_file"}),
    # The sweep's compiled loops, loaded when a plan first needs them (numba's cache: files).
    **{f"coordinator/pipeline/planner/{name}.py": frozenset(
        {"coordinator.pipeline.planner.lazy"}) for name in ("cut", "frontier", "graph")},
}
"""Pure modules that may import an I/O edge, and which."""

FORBIDDEN_MODULES: frozenset[str] = frozenset({
    # Event loops, networking, hardware, clocks, concurrency.
    "asyncio", "nats", "pynvml", "socket", "ssl", "select", "selectors", "signal", "time",
    "threading", "multiprocessing", "subprocess", "http", "urllib",
    # Files and the environment.
    "os", "pathlib", "io", "csv", "codecs", "tempfile", "shutil", "glob", "fileinput", "mmap",
    "fcntl", "sqlite3", "pydantic_settings", "dotenv",
    # Loading code by name (what a registry would do as a side effect).
    "importlib",
})
"""Top-level packages a pure module may not import."""

FORBIDDEN_CALLS: frozenset[str] = frozenset({"open", "input"})
"""Builtins a pure module may not call."""

FORBIDDEN_METHODS: frozenset[str] = frozenset(
    {"read_text", "write_text", "read_bytes", "write_bytes"})
"""Methods (of a path handed in) a pure module may not call."""

ENVIRONMENT: frozenset[str] = frozenset({"environ", "environb", "getenv", "putenv", "unsetenv"})
"""Names that reach the environment, as a name or an attribute."""


def _imported(node: ast.AST) -> list[str]:
    """The modules `node` imports (none if it is not an import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name | ast.Attribute)
        and getattr(node.func, "id", getattr(node.func, "attr", None))
        in {"__import__", "import_module"}
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def impurities(source: str, filename: str = "<string>") -> list[str]:
    """Return "line N: what" for every forbidden import, call or environment access."""
    hits: list[str] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.stmt | ast.expr):
            continue
        hits.extend(f"line {node.lineno}: import {name}" for name in _imported(node)
                    if name.split(".")[0] in FORBIDDEN_MODULES)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                hits.append(f"line {node.lineno}: {node.func.id}()")
            elif isinstance(node.func, ast.Attribute) and node.func.attr in FORBIDDEN_METHODS:
                hits.append(f"line {node.lineno}: .{node.func.attr}()")
        if isinstance(node, ast.Name) and node.id in ENVIRONMENT:
            hits.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT:
            hits.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            hits.extend(f"line {node.lineno}: import {alias.name}" for alias in node.names
                        if alias.name in ENVIRONMENT)
    return hits


def edge_imports(source: str) -> set[str]:
    """The I/O edges (`IO_EDGES`, as module names) that `source` imports."""
    edges = {path.removesuffix(".py").replace("/", ".") for path in IO_EDGES}
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        for name in _imported(node):
            found |= {e for e in edges if name == e or name.startswith(e + ".")}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {e for e in edges for alias in node.names
                      if f"{node.module}.{alias.name}" == e}
    return found


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def pure_modules() -> list[Path]:
    files: list[Path] = []
    for rel in PURE_PATHS:
        path = ROOT / rel
        if path.is_dir():
            files.extend(sorted(path.rglob("*.py")))
        elif path.is_file():
            files.append(path)
    return [f for f in files if _rel(f) not in IO_EDGES]


@pytest.mark.parametrize("rel", REQUIRED_PATHS)
def test_required_paths_exist(rel: str) -> None:
    path = ROOT / rel
    assert path.exists(), f"{rel} is listed as pure but does not exist"
    assert not path.is_dir() or any(path.rglob("*.py"))


@pytest.mark.parametrize("path", pure_modules(), ids=_rel)
def test_module_is_pure(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    hits = impurities(source, str(path))
    assert not hits, f"{_rel(path)} is not pure: {', '.join(hits)}"
    edges = edge_imports(source) - EDGE_IMPORTS.get(_rel(path), frozenset())
    assert not edges, f"{_rel(path)} imports I/O edges {sorted(edges)}: move the I/O out"


@pytest.mark.parametrize("rel", sorted(IO_EDGES))
def test_io_edges_say_so_and_are_needed(rel: str) -> None:
    """An edge is in a core tree, says it does I/O, and does (else it belongs to the core)."""
    path = ROOT / rel
    assert any(path.is_relative_to(ROOT / p) for p in PURE_PATHS), rel
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source)) or ""
    assert "I/O edge" in doc, f"{rel}'s docstring does not say it does I/O"
    assert impurities(source, rel), f"{rel} does no I/O: remove it from IO_EDGES"
    loops = {"asyncio", "nats", "pynvml", "socket", "time", "threading"}
    used = {n.split(".")[0] for node in ast.walk(ast.parse(source)) for n in _imported(node)}
    assert not used & loops, f"{rel} imports {sorted(used & loops)}: an edge does files only"


def test_every_edge_import_allowed_is_made() -> None:
    for rel, edges in EDGE_IMPORTS.items():
        assert edge_imports((ROOT / rel).read_text(encoding="utf-8")) == edges, rel


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
        ("import importlib", True),  # no loading modules by name
        # Files and the environment.
        ("import os.path", True),
        ("from pathlib import Path", True),
        ("import csv", True),
        ("import io", True),
        ("import tempfile", True),
        ("from pydantic_settings import BaseSettings", True),
        ("import pydantic_settings", True),
        ("open('plan.json')", True),
        ("def f(p):\n    with open(p, 'w') as f:\n        f.write('x')\n", True),
        ("def f(p):\n    return p.read_text()\n", True),
        ("def f(p, s):\n    p.write_bytes(s)\n", True),
        ("x = environ['ZEUS_PFO_SCHEDULER']", True),
        ("def f(o):\n    return o.environ.get('HOME')\n", True),
        ("def f(o):\n    return o.getenv('HOME')\n", True),
        ("from os import environ", True),
        ("input('?')", True),
        # Fine.
        ("import timeit", False),  # prefix of a forbidden name is fine
        ("from .time import x", False),  # relative: a sibling module, not the stdlib
        ("import math, bisect\nfrom dataclasses import dataclass", False),
        ("from zeus_agent.errors import ZeusAgentError", False),
        ("def f(join):\n    join.open('w', 1)\n", False),  # a method named open, not the builtin
        ("def reopen(): pass\nopened = reopen()", False),
        ("environment = {'a': 1}", False),
        ("import logging, json, hashlib, re", False),
    ],
)
def test_checker(source: str, bad: bool) -> None:
    assert bool(impurities(source)) is bad


@pytest.mark.parametrize(
    ("source", "edges"),
    [
        ("from coordinator.pipeline.dumps import keep_dump", {"coordinator.pipeline.dumps"}),
        ("from coordinator.pipeline import dumps", {"coordinator.pipeline.dumps"}),
        ("import coordinator.pipeline.schedulers.settings",
         {"coordinator.pipeline.schedulers.settings"}),
        ("from coordinator.pipeline.paths import job_dir_name", set()),
        ("from coordinator.pipeline.schedulers.base import FileOut", set()),
    ],
)
def test_edge_import_checker(source: str, edges: set[str]) -> None:
    assert edge_imports(source) == edges
