"""The RAPL reader (`zeus_agent.agent.rapl`) on a fake powercap tree, as the NVML backend is
tested on a fake pynvml: counters that wrap, a missing DRAM domain, unreadable files."""

from __future__ import annotations

import builtins
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from zeus_agent.agent import rapl as rapl_module
from zeus_agent.agent.metrics import make_registry
from zeus_agent.agent.rapl import RaplReader, cpu_reply, find_packages
from zeus_agent.wire.trainer import WindowRequest

S = 1_000_000_000
MAX_PKG = 262_143_328_850
MAX_DRAM = 65_712_999_613


class FakePowercap:
    """A powercap tree as Linux lays it out, with counters a test sets and files it denies."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.denied: set[str] = set()

    def zone(self, name: str, label: str, energy: int = 0, max_range: int = MAX_PKG,
             parent: str | None = None) -> Path:
        path = (self.root / parent / name) if parent else self.root / name
        path.mkdir(parents=True)
        (path / "name").write_text(f"{label}\n")
        (path / "energy_uj").write_text(f"{energy}\n")
        (path / "max_energy_range_uj").write_text(f"{max_range}\n")
        return path

    def set(self, zone: str, energy: int) -> None:
        """Set a counter (`intel-rapl:0` or `intel-rapl:0/intel-rapl:0:1`)."""
        (self.root / zone / "energy_uj").write_text(f"{energy}\n")

    def deny(self, zone: str, file: str = "energy_uj") -> None:
        """Make a file unreadable (PermissionError), as energy_uj is to non-root users."""
        self.denied.add(str(self.root / zone / file))

    def open(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) in self.denied:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return builtins.open(path, *args, **kwargs)


class Clock:
    """The reader's `time`: a monotonic clock a test moves."""

    def __init__(self) -> None:
        self.now = 10 * S

    def monotonic_ns(self) -> int:
        return self.now


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePowercap:
    """Two packages (0 with a DRAM domain, 1 without, as on AMD), a psys zone, MMIO, links."""
    fake = FakePowercap(tmp_path / "powercap")
    fake.root.mkdir()
    fake.zone("intel-rapl:0", "package-0", energy=1_000_000)
    fake.zone("intel-rapl:0:0", "core", parent="intel-rapl:0")
    fake.zone("intel-rapl:0:1", "dram", energy=500_000, max_range=MAX_DRAM,
              parent="intel-rapl:0")
    fake.zone("intel-rapl:1", "package-1", energy=2_000_000)
    fake.zone("intel-rapl:2", "psys")
    fake.zone("intel-rapl-mmio:0", "package-0")
    # /sys/class/powercap also links every subzone at the top: they are not packages.
    (fake.root / "intel-rapl:0:1").symlink_to(fake.root / "intel-rapl:0" / "intel-rapl:0:1")
    monkeypatch.setattr(rapl_module, "open", fake.open, raising=False)
    return fake


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(rapl_module, "time", c)
    return c


def test_finds_packages_and_their_dram(tree: FakePowercap) -> None:
    files, problems = find_packages(str(tree.root))
    assert problems == []
    assert [f.index for f in files] == [0, 1]  # psys, MMIO and subzone links skipped
    assert files[0].dram_energy == str(tree.root / "intel-rapl:0/intel-rapl:0:1/energy_uj")
    assert (files[0].max_range_uj, files[0].dram_max_range_uj) == (MAX_PKG, MAX_DRAM)
    assert files[1].dram_energy is None and files[1].dram_max_range_uj is None


def test_the_control_type_directory_works_as_root_too(tree: FakePowercap) -> None:
    # /sys/class/powercap/intel-rapl holds the packages (and their subzones inside them).
    control = tree.root.parent / "intel-rapl"
    control.mkdir()
    (control / "intel-rapl:0").symlink_to(tree.root / "intel-rapl:0")
    files, _ = find_packages(str(control))
    assert [f.index for f in files] == [0] and files[0].dram_energy is not None


def test_windows_from_readings(tree: FakePowercap, clock: Clock) -> None:
    reader = RaplReader(str(tree.root), period_s=0.1)
    assert reader.open() and reader.available
    for step in range(1, 11):  # 100 W on package 0, 20 W on its DRAM, 50 W on package 1
        clock.now += S // 10
        tree.set("intel-rapl:0", 1_000_000 + step * 10_000_000)
        tree.set("intel-rapl:0/intel-rapl:0:1", 500_000 + step * 2_000_000)
        tree.set("intel-rapl:1", 2_000_000 + step * 5_000_000)
        reader.poll()
    w = reader.window(10 * S, 11 * S, None)
    assert w.cpus == (0, 1) and w.problem == ""
    assert w.cpu_j == pytest.approx((100.0, 50.0))
    assert w.dram_j[0] == pytest.approx(20.0) and w.dram_j[1] is None
    cpu, dram = w.as_dicts()
    assert set(cpu or {}) == {0, 1} and set(dram or {}) == {0}  # the missing DRAM: left out
    half = reader.window(10 * S + S // 4, 10 * S + 3 * S // 4, [1])
    assert half.cpus == (1,) and half.cpu_j == pytest.approx((25.0,))


def test_counters_that_wrap(tree: FakePowercap, clock: Clock) -> None:
    small = 10_000_000  # a counter that wraps at 10 J
    tree.set("intel-rapl:1", small - 2_000_000)
    (tree.root / "intel-rapl:1" / "max_energy_range_uj").write_text(f"{small}\n")
    reader = RaplReader(str(tree.root), period_s=0.1)
    reader.open()
    raw = small - 2_000_000
    for _ in range(30):  # 3 J per 0.1 s: wraps 9 times in 3 s
        clock.now += S // 10
        raw = (raw + 3_000_000) % small
        tree.set("intel-rapl:1", raw)
        reader.poll()
    assert reader.packages[1].cpu.counter.wraps == 9
    assert reader.window(10 * S, 13 * S, [1]).cpu_j == pytest.approx((90.0,))
    page = generate_latest(make_registry({}, dict, rapl=reader, node="n1")).decode()
    assert 'zeus_rapl_wraps_total{Hostname="n1",cpu="1",domain="package"} 9.0' in page
    assert 'zeus_rapl_energy_joules_total{Hostname="n1",cpu="1",domain="package"} 90.0' in page


def test_window_end_past_the_newest_reading_is_read_when_answered(
    tree: FakePowercap, clock: Clock
) -> None:
    reader = RaplReader(str(tree.root), period_s=0.1)
    reader.open()
    clock.now += S // 10
    tree.set("intel-rapl:0", 11_000_000)  # 100 W
    reader.poll()
    reads = reader.reads
    clock.now += S // 10
    tree.set("intel-rapl:0", 41_000_000)  # then 300 W, not yet polled
    t1 = clock.now - S // 20
    w = reader.window(clock.now - S // 5, t1, [0])
    assert w.cpu_j == pytest.approx((10.0 + 15.0,))
    assert reader.reads == reads + 1  # one reading, kept out of the ring
    assert len(reader.packages[0].cpu.ring) == 2
    reader.window(clock.now - S // 5, t1, [0])
    assert reader.reads == reads + 1  # the same end: that reading is used again


def test_a_node_without_rapl_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reader = RaplReader(str(tmp_path / "nothing"))
    with caplog.at_level(logging.INFO, logger="zeus_agent.agent.rapl"):
        assert not reader.open()
        for _ in range(3):
            w = reader.window(0, S, None)
    assert w.cpus == () and w.as_dicts() == (None, None)
    assert "no RAPL counters on this node" in w.problem
    said = [r for r in caplog.records if "not measured" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    reply = cpu_reply(reader, WindowRequest(t0_ns=0, t1_ns=S, gpus=[], cpus="all"))
    assert reply["cpus"] == [] and "no RAPL counters" in reply["cpu_error"]
    assert cpu_reply(reader, WindowRequest(t0_ns=0, t1_ns=S, gpus=[])) == {}


def test_rapl_can_be_turned_off(tree: FakePowercap) -> None:
    reader = RaplReader("none")
    assert not reader.open() and "turned off" in reader.why_none


def test_unreadable_counters_say_why_once(
    tree: FakePowercap, caplog: pytest.LogCaptureFixture
) -> None:
    tree.deny("intel-rapl:0")
    tree.deny("intel-rapl:1")
    reader = RaplReader(str(tree.root))
    with caplog.at_level(logging.INFO, logger="zeus_agent.agent.rapl"):
        assert not reader.open()
        reader.window(0, S, [0])
    assert "permission denied" in reader.why_none and "run the agent as root" in reader.why_none
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("as root" in r.getMessage() for r in warnings)
    assert sum("not measured" in r.getMessage() for r in caplog.records) == 1
    assert reader.window(0, S, [0]).as_dicts() == (None, None)


def test_an_unreadable_dram_domain_leaves_only_dram_none(
    tree: FakePowercap, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    tree.deny("intel-rapl:0/intel-rapl:0:1")
    reader = RaplReader(str(tree.root))
    with caplog.at_level(logging.WARNING, logger="zeus_agent.agent.rapl"):
        assert reader.open()
    assert reader.files[0].dram_energy is None and reader.packages[0].dram is None
    assert any("DRAM of CPU 0" in r.getMessage() for r in caplog.records)
    clock.now += S
    tree.set("intel-rapl:0", 2_000_000)
    reader.poll()
    assert reader.window(10 * S, 11 * S, None).as_dicts() == (
        {0: pytest.approx(1.0), 1: 0.0}, None)


def test_a_missing_max_range_or_a_garbage_name_skips_the_zone(tree: FakePowercap) -> None:
    (tree.root / "intel-rapl:1" / "max_energy_range_uj").unlink()
    (tree.root / "intel-rapl:0" / "intel-rapl:0:1" / "energy_uj").write_text("garbage\n")
    files, problems = find_packages(str(tree.root))
    assert [f.index for f in files] == [0] and files[0].dram_energy is None
    assert len(problems) == 2
    assert any("intel-rapl:1" in p and "No such file" in p for p in problems)
    assert any(p.startswith("DRAM of CPU 0") for p in problems)


def test_readings_that_fail_later_are_counted_and_logged_sparingly(
    tree: FakePowercap, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    reader = RaplReader(str(tree.root))
    reader.open()
    clock.now += S
    tree.set("intel-rapl:1", 3_000_000)
    reader.poll()
    tree.deny("intel-rapl:1")
    with caplog.at_level(logging.WARNING, logger="zeus_agent.agent.rapl"):
        for _ in range(1000):
            clock.now += 2 * S // 1000
            reader.poll()
    assert reader.read_errors[(1, "package")] == 1000
    assert sum("reading" in r.getMessage() for r in caplog.records) == 2  # 1st and 1000th
    # Package 0 goes on; package 1's readings stopped 2 s ago: a window since cannot be
    # answered for it (past the 1 s it may be extrapolated).
    w = reader.window(clock.now - S // 2, clock.now, None)
    assert 0 in w.cpus and 1 not in w.cpus and "CPU 1:" in w.problem
    page = generate_latest(make_registry({}, dict, rapl=reader, node="n")).decode()
    # (and the reading the window tried)
    assert 'zeus_rapl_read_errors_total{Hostname="n",cpu="1",domain="package"} 1001.0' in page
    assert "zeus_rapl_packages 2.0" in page


def test_garbage_in_a_counter_is_a_failed_reading(tree: FakePowercap, clock: Clock) -> None:
    reader = RaplReader(str(tree.root))
    reader.open()
    (tree.root / "intel-rapl:0" / "energy_uj").write_text("not a number\n")
    reader.poll()
    assert reader.read_errors[(0, "package")] == 1
    assert reader.packages[0].cpu.counter.wraps == 0  # never taken as a wrap


def test_metrics_without_rapl(tmp_path: Path) -> None:
    reader = RaplReader(str(tmp_path))
    reader.open()
    page = generate_latest(make_registry({}, dict, rapl=reader)).decode()
    assert "zeus_rapl_packages 0.0" in page
