"""`zeus_agent.fileio`: whole-file writes (temporary file beside the target, then rename/link)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from zeus_agent.fileio import atomic_write, written_beside


def test_atomic_write_replaces_the_file_with_its_mode_and_leaves_no_temporary(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sub" / "secret.env"
    atomic_write(path, "A=1\n", 0o600)
    assert path.read_text() == "A=1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write(path, b"B=2\n")
    assert path.read_bytes() == b"B=2\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret.env"]


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.json"
    path.write_text("old")

    def fail(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_written_beside_is_removed_unless_renamed_away(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    with written_beside(target, "{}") as tmp:
        assert Path(tmp).parent == tmp_path and Path(tmp).name.startswith(".x.json.")
        assert Path(tmp).read_text() == "{}"
        os.link(tmp, target)
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert target.read_text() == "{}"
