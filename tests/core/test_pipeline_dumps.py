"""Dump files of a pipeline job: safe directory names, and a dump is never overwritten."""

from __future__ import annotations

from pathlib import Path

from coordinator.pipeline.dumps import job_dir_name, keep_dump


def test_a_dump_is_written_whole_under_its_name(tmp_path: Path) -> None:
    path = tmp_path / "job" / "0.prof.json"
    assert keep_dump(path, '{"a": 1}') == path
    assert path.read_text() == '{"a": 1}'
    assert sorted(p.name for p in path.parent.iterdir()) == ["0.prof.json"]  # no temp file left


def test_the_same_dump_again_is_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "ranks.json"
    keep_dump(path, "same")
    assert keep_dump(path, "same") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranks.json"]


def test_a_schedule_profiled_again_after_a_restart_keeps_the_first_dump(tmp_path: Path) -> None:
    """The first run's `1.prof.json` stays; each different profile gets the next rerun name."""
    path = tmp_path / "1.prof.json"
    keep_dump(path, "first run")
    assert keep_dump(path, "after a restart") == tmp_path / "1.prof.rerun-1.json"
    assert keep_dump(path, "after another") == tmp_path / "1.prof.rerun-2.json"
    assert keep_dump(path, "after a restart") is None  # already kept as rerun-1
    assert path.read_text() == "first run"
    assert (tmp_path / "1.prof.rerun-1.json").read_text() == "after a restart"
    assert (tmp_path / "1.prof.rerun-2.json").read_text() == "after another"


def test_unsafe_job_ids_never_name_a_path_outside_the_dump_dir() -> None:
    assert job_dir_name("plain-job_1") == "plain-job_1"
    for bad in ("..", "a/../../etc", "/abs", "x" * 300):
        name = job_dir_name(bad)
        assert "/" not in name and name not in (".", "..") and len(name) <= 200


def test_an_unreadable_file_at_a_dump_name_counts_as_different(tmp_path: Path) -> None:
    """Review: a non-UTF-8 file at the dump's name raised UnicodeDecodeError through the
    coordinator's actions (the next schedule was never installed); a directory lost the dump."""
    (tmp_path / "1.prof.json").write_bytes(b"\x93NUMPY\xff\xfe binary")
    (tmp_path / "1.prof.rerun-1.json").mkdir()
    assert keep_dump(tmp_path / "1.prof.json", "[]") == tmp_path / "1.prof.rerun-2.json"
    assert (tmp_path / "1.prof.rerun-2.json").read_text() == "[]"


def test_two_writers_of_one_name_both_keep_their_dump(tmp_path: Path) -> None:
    """Review: exists() then replace() let a second writer overwrite the first (or tear it,
    with a shared temporary name); linking a unique temporary file to the name cannot."""
    import threading

    path = tmp_path / "2.prof.json"
    start = threading.Barrier(8)
    results: list[Path | None] = []

    def write(i: int) -> None:
        start.wait()
        results.append(keep_dump(path, f"writer {i}"))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = sorted(p.read_text() for p in tmp_path.iterdir())
    assert kept == sorted(f"writer {i}" for i in range(8))  # all eight, whole, none lost
    assert sorted(str(r) for r in results) == sorted(str(p) for p in tmp_path.iterdir())


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    import os

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "link", disk_full)
    try:
        keep_dump(tmp_path / "3.prof.json", "x" * 1000)
    except OSError as e:
        assert e.errno == 28
    else:
        raise AssertionError("the write should have failed")
    assert list(tmp_path.iterdir()) == []
