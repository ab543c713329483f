"""The test tree's layout: no test module imports another test module or a conftest.

Helpers shared between test modules live in kit modules (`*_kit.py`, beside the tests that use
them; tests/README.md); fixtures live in conftest.py files, where pytest finds them without an
import. A test module importing another runs that module's imports and module-level code in
every importer, and an imported autouse fixture silently applies there too.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def _is_test_module(dotted: str) -> bool:
    last = dotted.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def _dynamic_import(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def forbidden_imports(path: Path, root: Path = TESTS.parent) -> list[str]:
    """`file:line: module` for each import of a test module or conftest in `path` (its name
    relative to `root`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            modules = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            # importlib.import_module("..."), __import__("..."): the first argument, if literal.
            first = node.args[0] if node.args else None
            modules = [first.value] if isinstance(first, ast.Constant) and isinstance(
                first.value, str) else []
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets):
            modules = [c.value for c in ast.walk(node.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        else:
            continue
        found += [(node.lineno, m) for m in modules if _is_test_module(m)]
    return [f"{path.relative_to(root)}:{line}: {m}" for line, m in sorted(found)]


def test_no_test_module_imports_a_test_module_or_a_conftest() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100  # the whole tree was walked
    bad = [line for path in files for line in forbidden_imports(path)]
    assert bad == [], "move the shared helpers to a *_kit.py module:\n" + "\n".join(bad)


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import tests.shell.test_coordinator\n"
        "from tests.shell import test_coordinator as tc\n"
        "from tests.core.test_emit import FakeAgent\n"
        "from .conftest import x\n"
        "from tests.shell.coordinator_kit import start\n"
        "def f():\n"
        "    from tests.fuzz.conftest import Bus\n"
        "importlib.import_module('tests.core.test_emit')\n"
        "__import__('tests.shell.conftest')\n"
        "pytest_plugins = ['tests.shell.test_coordinator']\n"
    )
    assert forbidden_imports(sample, tmp_path) == [f"sample.py:{n}: {m}" for n, m in [
        (1, "tests.shell.test_coordinator"), (2, "tests.shell.test_coordinator"),
        (3, "tests.core.test_emit"), (4, ".conftest"), (7, "tests.fuzz.conftest"),
        (8, "tests.core.test_emit"), (9, "tests.shell.conftest"),
        (10, "tests.shell.test_coordinator")]]
