"""`ZeusMonitor` as Zeus 0.16's `zeus.monitor.ZeusMonitor` (zeus/monitor/energy.py at
zeus-v0.16.0): positional order, `begin_window(restart=)`, `reset_windows`, jax/cupy
synchronisation (fake frameworks), `Measurement.soc_energy`, the CSV log, `gpu_indices=[]`."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.core.emit_kit import FakeAgent, rapl_agent
from zeus_agent import emit
from zeus_agent.integrations import Measurement, ZeusMonitor
from zeus_agent.wire.codec import validate
from zeus_agent.wire.trainer import Kind, WindowRequest

pytestmark = pytest.mark.usefixtures("clean_emit")

LOGGER = "zeus_agent.integrations.monitor"


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAgent]:
    fake = FakeAgent(str(tmp_path / "agent.sock"))
    monkeypatch.setenv(emit.ENV_SOCKET, fake.path)
    yield fake
    fake.stop()


def windows(agent: FakeAgent) -> list[WindowRequest]:
    return [validate(WindowRequest, r.payload) for r in agent.requests if r.kind is Kind.WINDOW]


# ----------------------------------------------------------------------------- fake frameworks
class FakeJax(ModuleType):
    """What Zeus's JAX synchronisation touches: `devices`, `device_put`, `block_until_ready`."""

    def __init__(self, gpus: int = 2) -> None:
        super().__init__("jax")
        self.gpus = [f"gpu{i}" for i in range(gpus)]
        self.calls: list[tuple] = []

    def devices(self, backend: str) -> list[str]:
        return self.gpus if backend == "gpu" else ["cpu0", "cpu1"]

    def device_put(self, value: float, device: str) -> SimpleNamespace:
        self.calls.append(("put", value, device))
        return _Array(device)

    def block_until_ready(self, futures: list) -> list:
        self.calls.append(("block", [f.device for f in futures]))
        return futures


class _Array(SimpleNamespace):
    def __init__(self, device: str) -> None:
        super().__init__(device=device)

    def __add__(self, other: object) -> _Array:  # `device_put(0.0, ...) + 0`: queued after
        return self


class FakeCupy(ModuleType):
    def __init__(self) -> None:
        super().__init__("cupy")
        self.synced: list[int] = []
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def synchronize(self) -> None:
                fake.synced.append(self.index)

        self.cuda = SimpleNamespace(Device=Device)


# ----------------------------------------------------------------------------- constructor
def test_the_signature_is_zeus_016s() -> None:
    params = inspect.signature(ZeusMonitor).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["gpu_indices", "cpu_indices", "approx_instant_energy", "log_file",
                          "sync_execution_with"]
    assert [params[n].default for n in positional] == [None, None, False, None, "torch"]
    assert params["publisher"].kind is inspect.Parameter.KEYWORD_ONLY
    begin = inspect.signature(ZeusMonitor.begin_window).parameters
    assert list(begin) == ["self", "key", "sync_execution", "restart"]
    assert (begin["sync_execution"].default, begin["restart"].default) == (True, False)
    end = list(inspect.signature(ZeusMonitor.end_window).parameters)
    assert end[:4] == ["self", "key", "sync_execution", "cancel"]  # then ours: exact
    assert [f.name for f in dataclasses.fields(Measurement)] == [
        "time", "gpu_energy", "cpu_energy", "dram_energy", "soc_energy"]


def test_positional_arguments_in_zeus_order(agent: FakeAgent, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    log = tmp_path / "m.csv"
    monitor = ZeusMonitor([0], [], True, log, "cupy")
    assert monitor.approx_instant_energy is True
    assert monitor.log_file == str(log) and monitor.sync_with == "cupy"
    monitor.begin_window("w")
    monitor.end_window("w")
    assert cupy.synced == [0, 0]
    assert len(log.read_text().splitlines()) == 2
    keyword = ZeusMonitor(gpu_indices=[0], sync_execution_with="torch", approx_instant_energy=False)
    assert (keyword.sync_with, keyword.approx_instant_energy, keyword.log_file) == (
        "torch", False, None)


# ----------------------------------------------------------------------------- windows
def test_begin_window_restart(agent: FakeAgent, caplog: pytest.LogCaptureFixture) -> None:
    monitor = ZeusMonitor(gpu_indices=[0])
    monitor.begin_window("cell")
    first = monitor._windows["cell"][0]
    with pytest.raises(ValueError, match="Measurement window 'cell' already exists"):
        monitor.begin_window("cell")
    assert monitor._windows["cell"][0] == first  # the refused begin changed nothing
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.begin_window("cell", restart=True)
        monitor.begin_window("fresh", restart=True)  # nothing to restart: just begins
    said = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert said == ["Measurement window 'cell' restarted."]
    m = monitor.end_window("cell")
    assert m.gpu_energy == {0: 10.0}
    (window,) = windows(agent)
    assert window.t0_ns > first  # measured from the restart
    monitor.end_window("fresh")
    with pytest.raises(ValueError, match="does not exist"):
        monitor.end_window("cell")


def test_reset_windows_drops_every_open_window(agent: FakeAgent, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    log = tmp_path / "m.csv"
    monitor = ZeusMonitor(gpu_indices=[0], log_file=log)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.reset_windows()
        monitor.begin_window("a")
        monitor.begin_window("b")
        monitor.reset_windows()
    messages = [r.getMessage() for r in caplog.records if "reset" in r.getMessage()]
    assert messages == ["ZeusMonitor reset with no active windows to drop.",
                        "ZeusMonitor reset dropped active windows: ['a', 'b']"]
    for key in ("a", "b"):
        with pytest.raises(ValueError, match=f"Measurement window '{key}' does not exist"):
            monitor.end_window(key)
    monitor.begin_window("a")  # the key is free again
    monitor.end_window("a")
    assert len(windows(agent)) == 1  # the dropped windows were never measured
    assert [line.split(",")[1] for line in log.read_text().splitlines()[1:]] == ["a"]


def test_soc_energy_is_none_as_in_zeus_without_an_soc(agent: FakeAgent) -> None:
    monitor = ZeusMonitor(gpu_indices=[0])
    monitor.begin_window("w")
    assert monitor.end_window("w").soc_energy is None
    monitor.begin_window("c")
    assert monitor.end_window("c", cancel=True).soc_energy is None
    assert Measurement(time=1.0, gpu_energy={0: 1.0}).soc_energy is None


def test_total_energy_is_cached_as_zeus() -> None:
    m = Measurement(time=1.0, gpu_energy={0: 1.0, 1: 2.0})
    assert m.total_energy == 3.0
    m.gpu_energy[2] = 4.0
    assert m.total_energy == 3.0  # Zeus's cached_property
    assert m == Measurement(time=1.0, gpu_energy={0: 1.0, 1: 2.0, 2: 4.0})


def test_no_gpus_measures_cpus_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = FakeAgent(str(tmp_path / "rapl.sock"), rapl_agent)
    monkeypatch.setenv(emit.ENV_SOCKET, agent.path)
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    try:
        log = tmp_path / "m.csv"
        monitor = ZeusMonitor(gpu_indices=[], sync_execution_with="cupy", log_file=log)
        monitor.begin_window("w")
        m = monitor.end_window("w")
        assert (m.gpu_energy, m.cpu_energy, m.total_energy) == ({}, {0: 30.0, 1: 20.0}, 0)
        assert cupy.synced == []  # as Zeus: no GPU, nothing to synchronise
        assert windows(agent)[-1].gpus == []
        header, line = log.read_text().splitlines()
        assert header == "start_time,window_name,elapsed_time,"  # Zeus's, trailing comma
        assert line.split(",")[1] == "w" and line.endswith(",")
    finally:
        agent.stop()


# ----------------------------------------------------------------------------- synchronisation
def test_jax_synchronises_each_gpu_and_the_cpu(agent: FakeAgent,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    jax = FakeJax(gpus=3)
    monkeypatch.setitem(sys.modules, "jax", jax)
    monitor = ZeusMonitor(gpu_indices=[0, 2], sync_execution_with="jax")
    assert jax.calls == []  # nothing at construction
    monitor.begin_window("w")
    assert jax.calls == [("put", 0.0, "gpu0"), ("put", 0.0, "gpu2"), ("put", 0.0, "cpu0"),
                         ("block", ["gpu0", "gpu2", "cpu0"])]
    jax.calls.clear()
    monitor.end_window("w", sync_execution=False)
    monitor.begin_window("x", sync_execution=False)
    assert jax.calls == []
    monitor.end_window("x", cancel=True)  # a cancelled window synchronises too, as Zeus
    assert jax.calls[-1] == ("block", ["gpu0", "gpu2", "cpu0"])


def test_cupy_synchronises_each_gpu(agent: FakeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monitor = ZeusMonitor(gpu_indices=[1, 0], sync_execution_with="cupy")
    monitor.begin_window("w")
    assert cupy.synced == [1, 0]
    monitor.end_window("w")
    assert cupy.synced == [1, 0, 1, 0]
    monitor.begin_window("c", sync_execution=False)
    monitor.end_window("c", cancel=True)
    assert cupy.synced == [1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize(("framework", "message"),
                         [("jax", "Failed to import JAX"), ("cupy", "Failed to import CuPy")])
def test_a_framework_that_cannot_be_imported_raises_as_zeus(
        agent: FakeAgent, monkeypatch: pytest.MonkeyPatch, framework: str, message: str) -> None:
    monkeypatch.setitem(sys.modules, framework, None)  # `import` raises ImportError
    monitor = ZeusMonitor(gpu_indices=[0], sync_execution_with=framework)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=message) as info:
        monitor.begin_window("w")
    assert isinstance(info.value.__cause__, ImportError)
    monitor.begin_window("w", sync_execution=False)  # without synchronising it measures
    assert monitor.end_window("w", sync_execution=False).gpu_energy == {0: 10.0}


def test_jax_without_gpus_raises_as_zeus(agent: FakeAgent,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", FakeJax(gpus=0))
    monitor = ZeusMonitor(gpu_indices=[0], sync_execution_with="jax")
    with pytest.raises(RuntimeError, match="JAX is available but does not have CUDA support"):
        monitor.begin_window("w")


def test_an_unknown_framework_raises_when_it_would_synchronise(agent: FakeAgent) -> None:
    monitor = ZeusMonitor(gpu_indices=[0], sync_execution_with="numpy")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="No framework is available."):
        monitor.begin_window("w")
    monitor.begin_window("w", sync_execution=False)
    with pytest.raises(RuntimeError, match="No framework is available."):
        monitor.end_window("w")
    with pytest.raises(ValueError, match="does not exist"):  # popped first, as Zeus
        monitor.end_window("w")


def test_torch_is_never_imported_to_synchronise(agent: FakeAgent,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monitor = ZeusMonitor(gpu_indices=[0])
    monitor.begin_window("w")
    monitor.end_window("w")
    assert "torch" not in sys.modules


# ----------------------------------------------------------------------------- log file
def test_log_file_is_truncated_and_its_directory_created(agent: FakeAgent,
                                                         tmp_path: Path) -> None:
    old = tmp_path / "old.csv"
    old.write_text("start_time,window_name,elapsed_time,gpu0_energy\n1.0,stale,2.0,3.0\n")
    monitor = ZeusMonitor(gpu_indices=[0], log_file=old)
    assert old.read_text() == "start_time,window_name,elapsed_time,gpu0_energy\n"
    monitor.begin_window("w")
    monitor.end_window("w")
    monitor.begin_window("gone")
    monitor.end_window("gone", cancel=True)  # never logged
    lines = old.read_text().splitlines()
    assert [line.split(",")[1] for line in lines[1:]] == ["w"]
    start, _, elapsed, energy = lines[1].split(",")
    assert float(start) > 1e9 and float(elapsed) >= 0 and float(energy) == 10.0

    nested = tmp_path / "a" / "b" / "log.csv"
    ZeusMonitor(gpu_indices=[0, 1], log_file=str(nested))
    assert nested.read_text() == "start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy\n"


def test_a_log_file_without_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ZeusMonitor(gpu_indices=[0], log_file="plain.csv")
    assert (tmp_path / "plain.csv").read_text().startswith("start_time,")


def test_a_log_file_that_cannot_be_created_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        ZeusMonitor(gpu_indices=[0], log_file=tmp_path)  # a directory
