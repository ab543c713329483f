"""Code shape: no function over 80 lines and no module over 700 in the shipped code.

The trees: `zeus_agent/`, `coordinator/`, `zeus_demo/`, `tools/` and `bench/` (the tests are
not held to it: a parametrised table may be long).

A long function hides its steps; a long module, its parts. Both are measured with `ast` on the
source (nothing is imported): a function from its `def` line to its last line, docstring and
nested functions included; a module by its line count. The only exceptions are listed below,
each with its reason:

* `DATA_TABLES`: a long literal table (an argparse table, a transition table) is data, not
  logic; an entry that no longer exceeds a limit fails, so the list cannot rot.
* `PENDING`: code another change is reworking now; each entry is removed when that work lands
  (it is not checked for staleness, so the rework can land in any order).

Keys are `path` (a module) or `path::Qualified.name` (a function; nested ones as
`outer.inner`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("zeus_agent", "coordinator", "zeus_demo", "tools", "bench")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700

DATA_TABLES: dict[str, str] = {}
"""Long literal tables (key -> why it is one table); none today."""

PENDING: dict[str, str] = {}
"""Code another change is reworking now: remove each entry when that change lands."""


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function under `tree`, nested ones included."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            assert node.end_lineno is not None
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((name, node.end_lineno - start + 1))  # decorators count
            found += _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, f"{prefix}{node.name}.")
        else:
            found += _functions(node, prefix)
    return found


@functools.cache
def _measure() -> dict[str, tuple[int, int]]:
    """Every module and function of the trees: key -> (lines, limit)."""
    sizes: dict[str, tuple[int, int]] = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            source = path.read_text()
            module = path.relative_to(ROOT).as_posix()
            sizes.update(_sizes_of(source, module))
    return sizes


def _sizes_of(source: str, module: str) -> dict[str, tuple[int, int]]:
    """One module's sizes; of same-named functions (a setter, a redefinition), the longest."""
    sizes = {module: (len(source.splitlines()), MAX_MODULE_LINES)}
    for name, lines in _functions(ast.parse(source, filename=module)):
        key = f"{module}::{name}"
        sizes[key] = (max(lines, sizes.get(key, (0, 0))[0]), MAX_FUNCTION_LINES)
    return sizes


def test_no_function_or_module_is_over_its_limit() -> None:
    sizes = _measure()
    assert len(sizes) > 1000, "the walk found too little code: are the trees where expected?"
    over = [
        f"{key}: {lines} lines (limit {limit})"
        for key, (lines, limit) in sorted(sizes.items())
        if lines > limit and key not in DATA_TABLES and key not in PENDING
    ]
    assert not over, "split these into named parts:\n" + "\n".join(over)


def test_every_data_table_entry_is_still_needed() -> None:
    sizes = _measure()
    stale = [key for key in DATA_TABLES if key not in sizes or sizes[key][0] <= sizes[key][1]]
    assert not stale, f"remove from DATA_TABLES (gone, or within its limit now): {stale}"


def test_the_measure_sees_methods_and_nested_functions() -> None:
    tree = ast.parse(
        "class A:\n    def f(self):\n        def g():\n            pass\n        return g\n"
        "async def h():\n    pass\n"
    )
    assert _functions(tree) == [("A.f", 4), ("A.f.g", 2), ("h", 2)]


def test_the_measure_counts_decorators_and_keeps_the_longest_of_a_name() -> None:
    """A property's setter (same qualified name) must not hide a long getter."""
    source = ("class A:\n    @property\n    def p(self):\n" + "        x = 1\n" * 5
              + "        return x\n    @p.setter\n    def p(self, v):\n        pass\n")
    assert _functions(ast.parse(source)) == [("A.p", 8), ("A.p", 3)]
    assert _sizes_of(source, "m.py")["m.py::A.p"] == (8, MAX_FUNCTION_LINES)
