"""The documentation site builds strictly and its reference pages are the code's.

* `tools/gen_docs.py --check`: the generated pages (command lines, settings, subjects) are what
  the code renders today, so they cannot drift;
* `mkdocs build --strict`: no broken link or anchor, no missing page, every mkdocstrings
  reference resolves;
* the subject catalogue is the builders' truth, and lists every builder;
* every reply code the code sends is documented;
* the README stays a front door (at most 1,500 words) and its links resolve.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zeus_agent.wire import subjects
from zeus_agent.wire.catalogue import SUBJECTS
from zeus_agent.wire.messages import REPLY_CODES

ROOT = Path(__file__).resolve().parents[2]


def test_generated_reference_pages_are_current() -> None:
    proc = subprocess.run([sys.executable, "tools/gen_docs.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.fail("mkdocs is not installed: `make install` installs the docs extra")
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in ("index.html", "reference/settings/index.html", "reference/api/emit/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    api = (tmp_path / "site" / "reference/api/emit/index.html").read_text()
    assert "step_begin" in api and "Publisher" in api  # mkdocstrings rendered the module


@pytest.mark.parametrize("spec", SUBJECTS, ids=lambda s: s.pattern)
def test_each_catalogued_pattern_is_what_its_builder_builds(spec) -> None:
    values = {name: f"v{i}" for i, name in enumerate(spec.placeholders)}
    built = spec.builder(*values.values(), prefix="p")
    assert built == spec.pattern.format(prefix="p", **values)


def test_every_subject_builder_is_catalogued() -> None:
    catalogued = {spec.builder.__name__ for spec in SUBJECTS}
    builders = {
        name for name, fn in inspect.getmembers(subjects, inspect.isfunction)
        if fn.__module__ == subjects.__name__ and not name.startswith(("_", "all_", "parse_"))
        and name not in {"token", "check_prefix", "last_token", "inbox_prefix", "state_buckets"}
    }
    assert builders - catalogued == set()


def _codes_sent() -> set[str]:
    """String codes passed to `Reply.failure(...)` or as `code=` anywhere in the packages."""
    found: set[str] = set()
    for path in [*ROOT.glob("zeus_agent/**/*.py"), *ROOT.glob("coordinator/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name == "failure" and node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
    return {c for c in found if isinstance(c, str)}


def _codes_raised() -> set[str]:
    """Codes errors carry: `code = "..."` in an exception class, `StragglerError("...", ...)`."""
    found: set[str] = set()
    for path in [*ROOT.glob("zeus_agent/**/*.py"), *ROOT.glob("coordinator/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
                    for b in node.bases):
                for stmt in node.body:
                    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(
                        stmt, "target", None)
                    value = getattr(stmt, "value", None)
                    if (isinstance(target, ast.Name) and target.id == "code"
                            and isinstance(value, ast.Constant)):
                        found.add(value.value)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "StragglerError"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                found.add(node.args[0].value)
    return found


def test_every_reply_code_sent_is_documented() -> None:
    codes = _codes_sent()
    assert codes, "the scan found no Reply.failure calls: it is broken"
    assert codes - set(REPLY_CODES) == set()
    raised = _codes_raised()  # (zeus_agent.errors.reply_for answers with these.)
    assert {"bad_request", "read_only", "unknown_job", "conflict"} <= raised, "the scan is broken"
    assert raised - set(REPLY_CODES) == set()



def test_the_readme_is_a_front_door() -> None:
    words = len((ROOT / "README.md").read_text().split())
    assert words <= 1500, f"README.md has {words} words; move detail into docs/"


def test_the_readmes_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links into docs/"
    assert [link for link in local if not (ROOT / link).exists()] == []


def _tree_block() -> str:
    page = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    blocks = re.findall(r"```\n(zeus_agent/.*?)```", page, flags=re.S)
    assert len(blocks) == 1, "the architecture page shows one source tree"
    return blocks[0]


def test_the_source_tree_shown_lists_every_package() -> None:
    tree = _tree_block()
    for top in ("zeus_agent", "coordinator", "zeus_demo"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / top).as_posix()
            if rel == ".":
                continue
            shown = rel + "/" in tree or rel.rsplit("/", 1)[-1] + "/" in tree
            assert shown, f"{top}/{rel}/ is not in the architecture page's tree"


def test_every_file_the_source_tree_names_exists() -> None:
    names = set(re.findall(r"\b([a-z_0-9]+\.py)\b", _tree_block()))
    assert len(names) > 30
    existing = {p.name for top in ("zeus_agent", "coordinator", "zeus_demo", "tools")
                for p in (ROOT / top).rglob("*.py")}
    assert sorted(names - existing) == []
