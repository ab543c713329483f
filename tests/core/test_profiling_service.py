"""`ZeusProfilingService` (Zeus's `zeus.profiling`) on a fake agent: nested windows, result
shapes, Zeus's constructor, GPU indices and handles, and its error cases."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.core.emit_kit import FakeAgent
from zeus_agent import emit
from zeus_agent.integrations import ProfilingResult, ZeusProfilingService
from zeus_agent.wire.codec import validate
from zeus_agent.wire.trainer import Kind, WindowRequest

pytestmark = pytest.mark.usefixtures("clean_emit")


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = FakeAgent(str(tmp_path / "agent.sock"))  # GPU g measures 10 * (g + 1) J
    monkeypatch.setenv(emit.ENV_SOCKET, fake.path)
    yield fake
    fake.stop()


def windows(agent: FakeAgent) -> list[WindowRequest]:
    return [validate(WindowRequest, r.payload) for r in agent.wait_requests(Kind.WINDOW)]


def test_zeus_constructor_and_result_shape() -> None:
    params = list(inspect.signature(ZeusProfilingService).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [
        ("gpu_indices", None),
        ("monitor_path", "zeus_monitor"),
        ("monitor_log_dir", ""),
        ("monitor_log_prefix", ""),
    ]
    assert [f.name for f in dataclasses.fields(ProfilingResult)] == ["time", "energy"]
    assert ProfilingResult is emit.ProfilingResult


def test_nested_windows_pop_the_innermost_first(agent: FakeAgent) -> None:
    service = ZeusProfilingService(gpu_indices=[0, 1])
    service.push_window()
    service.push_window()
    inner = service.pop_window()
    outer = service.pop_window()
    assert isinstance(inner, ProfilingResult) and isinstance(outer, ProfilingResult)
    assert inner.energy == outer.energy == [10.0, 20.0]  # a list, one per GPU, in order
    assert 0 <= inner.time <= outer.time
    w_inner, w_outer = windows(agent)
    assert w_outer.t0_ns < w_inner.t0_ns <= w_inner.t1_ns < w_outer.t1_ns  # nested
    assert w_inner.gpus == w_outer.gpus == [0, 1]
    assert w_outer.exact is False


def test_energy_follows_the_order_given(agent: FakeAgent) -> None:
    service = ZeusProfilingService([1, 0])
    service.push_window()
    assert service.pop_window().energy == [20.0, 10.0]


def test_pop_without_push_raises_and_changes_nothing(agent: FakeAgent) -> None:
    service = ZeusProfilingService(gpu_indices=[0])
    message = "No profiling window active. Consider calling `push_window` first."
    with pytest.raises(RuntimeError, match=message):
        service.pop_window()
    service.push_window()
    service.pop_window()
    with pytest.raises(RuntimeError, match=message):  # every window already popped
        service.pop_window()
    assert len(windows(agent)) == 1


def test_windows_of_two_services_are_separate_stacks(agent: FakeAgent) -> None:
    a, b = ZeusProfilingService([0]), ZeusProfilingService([1])
    a.push_window()
    with pytest.raises(RuntimeError):
        b.pop_window()
    assert a.pop_window().energy == [10.0]


def test_repeated_gpus_are_measured_once_and_an_empty_list_measures_nothing(
    agent: FakeAgent,
) -> None:
    service = ZeusProfilingService([0, 0])
    service.push_window()
    assert service.pop_window().energy == [10.0, 10.0]  # as Zeus: one entry per index given
    assert [w.gpus for w in windows(agent)] == [[0]]  # the agent is asked about distinct GPUs
    empty = ZeusProfilingService([])
    empty.push_window()
    result = empty.pop_window()
    assert result.energy == [] and result.time >= 0
    assert len(windows(agent)) == 1


def test_exact_is_passed_to_the_agent(agent: FakeAgent) -> None:
    service = ZeusProfilingService([0])
    service.push_window()
    service.pop_window(exact=True)
    assert windows(agent)[0].exact is True


def test_default_gpus_follow_cuda_visible_devices(agent: FakeAgent, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    service = ZeusProfilingService()
    assert service.gpu_indices == [0, 1]
    service.push_window()
    assert service.pop_window().energy == [50.0, 70.0]  # the node's GPUs 4 and 6


class FakePynvml:
    """pynvml as far as handles go: `nvmlDeviceGetIndex` and `nvmlDeviceGetUUID`."""

    @staticmethod
    def nvmlDeviceGetIndex(handle: SimpleNamespace) -> int:
        return handle.index

    @staticmethod
    def nvmlDeviceGetUUID(handle: SimpleNamespace) -> bytes:
        return f"GPU-{handle.index}abc-0000".encode()


def handle(index: int) -> SimpleNamespace:
    return SimpleNamespace(index=index)


def test_pynvml_handles_map_to_this_process_cuda_indices(agent: FakeAgent, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml)
    # Zeus's first form: `ZeusProfilingService(gpu_handles, monitor_path, power_log_prefix)`.
    service = ZeusProfilingService([handle(2), handle(0)], "/usr/bin/zeus_monitor", "run1")
    assert service.gpu_indices == [2, 0]
    service.push_window()
    assert service.pop_window().energy == [30.0, 10.0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert ZeusProfilingService([handle(5), 1]).gpu_indices == [1, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-7a,GPU-5abc")
    assert ZeusProfilingService([handle(5)]).gpu_indices == [1]
    with pytest.raises(ValueError, match="GPU 4 .* is not visible"):
        ZeusProfilingService([handle(4)])


def test_bad_gpu_entries_are_refused(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with pytest.raises(TypeError, match="CUDA device indices"):
        ZeusProfilingService([handle(0)])
    with pytest.raises(ValueError, match="non-negative"):
        ZeusProfilingService([0, -1])


def test_monitor_arguments_are_accepted_and_nothing_is_written(agent: FakeAgent, tmp_path) -> None:
    logs = tmp_path / "logs"
    service = ZeusProfilingService(
        [0], monitor_path=str(tmp_path / "missing"), monitor_log_dir=str(logs),
        monitor_log_prefix="p", power_log_prefix="q",
    )  # fmt: skip
    assert (service.monitor_path, service.monitor_log_dir) == (str(tmp_path / "missing"), str(logs))
    service.push_window()
    service.pop_window()
    assert not logs.exists()


def test_without_an_agent_energies_are_nan(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(emit.ENV_SOCKET, str(tmp_path / "nobody.sock"))
    service = ZeusProfilingService([0, 1])
    service.push_window()
    result = service.pop_window()
    assert result.time >= 0 and len(result.energy) == 2 and all(map(math.isnan, result.energy))


def test_logs_as_zeus_does(agent: FakeAgent, caplog) -> None:
    service = ZeusProfilingService([0, 1])
    with caplog.at_level(logging.INFO, logger="zeus_agent.integrations.profiling"):
        service.push_window()
        service.pop_window()
    assert caplog.messages == [
        "[ZeusProfilingService] [GPU_0,1] Profiling window pushed.",
        "[ZeusProfilingService] [GPU_0,1] Profiling window popped.",
    ]
