"""The Perseus drop-in (`zeus_agent.integrations.perseus`): Zeus 0.16's errors and callbacks.

A fake publisher stands in for `zeus_agent.emit.Publisher` (its schedule API: `latest_schedule`,
`next_step`); `emit.init` is replaced to capture the registration arguments. One test runs the
drop-in against a real agent on simulated GPUs (no coordinator: the job cannot register, so the
drop-in warns and runs unoptimised, emitting real events).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from zeus_agent import emit
from zeus_agent.integrations import perseus
from zeus_agent.integrations.perseus import (
    PerseusOptimizer,
    PipelineFrequencyOptimizer,
    socket_path_from_url,
)
from zeus_agent.wire.trainer import ScheduleNotice


def Notice(  # noqa: N802 - reads like the model it builds
    job_id: str, rank: int, version: int, from_step: int, frequencies: Any
) -> ScheduleNotice:
    return ScheduleNotice(
        job_id=job_id, rank=rank, version=version, from_step=from_step, frequencies=frequencies
    )


@dataclass
class FakePublisher:
    job_id: str | None = "job-1"
    notices: list[ScheduleNotice] = field(default_factory=list)
    events: list[tuple[str, Any]] = field(default_factory=list)
    step: int = -1
    polls: int = 0

    @property
    def next_step(self) -> int:
        return self.step + 1

    def latest_schedule(self) -> ScheduleNotice | None:
        self.polls += 1
        return self.notices[-1] if self.notices else None

    def step_begin(self) -> None:
        self.step += 1
        self.events.append(("step_begin", self.step))

    def step_end(self) -> None:
        self.events.append(("step_end", self.step))

    def instruction_begin(self, name: str) -> None:
        self.events.append(("instruction_begin", name))

    def instruction_end(self, name: str) -> None:
        self.events.append(("instruction_end", name))

    def close(self) -> None:
        self.events.append(("close", None))


SCHEDULE = [("forward", 1740), ("forward", 1500), ("backward", 1740), ("backward", 1410)]
ORDER = [name for name, _ in SCHEDULE]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace `emit.init` with one returning a `FakePublisher`; record its arguments."""
    box: dict[str, Any] = {"publisher": FakePublisher()}

    def fake_init(**kwargs: Any) -> FakePublisher:
        box["kwargs"] = kwargs
        return box["publisher"]

    monkeypatch.setattr(emit, "init", fake_init)
    monkeypatch.setattr(perseus, "_warned_http", False)
    return box


def make(rank: int = 0, url: str = "unix:///tmp/agent.sock", **kw: Any) -> PerseusOptimizer:
    return PerseusOptimizer(
        rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, device_id=rank, dp_degree=1,
        pp_degree=2, tp_degree=1, world_size=2, server_url=url, **kw,
    )


def run_iteration(opt: PerseusOptimizer, names: list[str]) -> None:
    opt.on_step_begin()
    for name in names:
        opt.on_instruction_begin(name)
        opt.on_instruction_end(name)
    opt.on_step_end()


def activate(fake: dict[str, Any], opt: PerseusOptimizer, from_step: int = 0) -> None:
    fake["publisher"].notices.append(Notice("job-1", opt.rank, 1, from_step, SCHEDULE))


def test_registration_arguments(fake: dict[str, Any]) -> None:
    opt = make(rank=1, job_id="job-1", job_metadata="meta", sync_cuda=False)
    kw = fake["kwargs"]
    assert kw["job_id"] == "job-1"
    assert kw["rank"] == 1 and kw["pp_rank"] == 1 and kw["gpu_index"] == 1
    assert kw["socket_path"] == "/tmp/agent.sock"
    assert kw["sync_cuda"] is False
    assert "power_limit" not in kw  # a pipeline-frequency job
    info = kw["job_info"]
    assert (info.pp_degree, info.dp_degree, info.tp_degree, info.world_size) == (2, 1, 1, 2)
    assert info.job_metadata == "meta"
    assert opt.job_id == "job-1"
    assert PipelineFrequencyOptimizer is PerseusOptimizer


def test_sync_cuda_defaults_off_without_torch_cuda(fake: dict[str, Any]) -> None:
    make()
    import sys

    torch = sys.modules.get("torch")
    initialised = bool(torch and torch.cuda.is_available() and torch.cuda.is_initialized())
    assert fake["kwargs"]["sync_cuda"] is initialised


def test_bad_degrees_raise(fake: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="world_size"):
        PerseusOptimizer(0, 0, 0, 0, 0, 2, 2, 1, 3, "unix:///tmp/a.sock")


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("unix:///run/zeus-agent/agent.sock", "/run/zeus-agent/agent.sock"),
        ("UNIX:///tmp/a%20b.sock", "/tmp/a b.sock"),
        ("unix://agent.sock", "agent.sock"),
        ("http://127.0.0.1:7787", None),
        ("https://perseus.example:443/", None),
        ("localhost:7787", None),
    ],
)
def test_unix_url_parsing(url: str, path: str | None) -> None:
    assert socket_path_from_url(url) == path


def test_unix_url_without_path_is_refused() -> None:
    with pytest.raises(ValueError, match="names no socket path"):
        socket_path_from_url("unix://")


def test_conflicting_socket_path_and_url(fake: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="different"):
        make(socket_path="/tmp/other.sock")
    make(socket_path="/tmp/agent.sock")  # the same socket: fine
    assert fake["kwargs"]["socket_path"] == "/tmp/agent.sock"


def test_http_url_warns_once_and_uses_the_default_socket(
    fake: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="zeus_agent.integrations.perseus"):
        make(url="http://127.0.0.1:7787")
        make(url="http://127.0.0.1:7787")
        make(url="http://other:1")
    warnings = [r for r in caplog.records if "server_url" in r.getMessage()]
    assert len(warnings) == 1
    assert "http://127.0.0.1:7787" in warnings[0].getMessage()
    assert fake["kwargs"]["socket_path"] is None  # emit's default: env, else the default path
    make(url="http://x", socket_path="/tmp/explicit.sock")
    assert fake["kwargs"]["socket_path"] == "/tmp/explicit.sock"


def test_no_checks_before_a_schedule(fake: dict[str, Any]) -> None:
    opt = make()
    run_iteration(opt, ["forward", "backward", "anything"])
    run_iteration(opt, [])
    assert opt.schedule == [] and opt.schedule_version is None
    events = fake["publisher"].events
    assert events[:4] == [
        ("step_begin", 0), ("instruction_begin", "forward"), ("instruction_end", "forward"),
        ("instruction_begin", "backward"),
    ]
    assert events[-2:] == [("step_begin", 1), ("step_end", 1)]


def test_activation_at_from_step(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt, from_step=2)
    run_iteration(opt, ["other"])  # step 0: pending, not active
    assert opt.schedule_version is None
    run_iteration(opt, ["other", "names"])  # step 1
    assert opt.schedule_version is None
    run_iteration(opt, ORDER)  # step 2: active from its step_begin
    assert opt.schedule == SCHEDULE and opt.schedule_version == 1
    assert opt.frequency == 1410  # the last instruction's
    opt.on_step_begin()
    opt.on_instruction_begin("forward")
    assert opt.frequency == 1740
    opt.on_instruction_end("forward")
    opt.on_instruction_begin("forward")
    assert opt.frequency == 1500
    for name in ORDER[2:]:
        opt.on_instruction_begin(name)
    opt.on_step_end()
    run_iteration(opt, ORDER)
    with pytest.raises(RuntimeError):
        run_iteration(opt, ["other"])


def test_late_notice_activates_at_the_next_step(fake: dict[str, Any]) -> None:
    opt = make()
    run_iteration(opt, ["x"])
    run_iteration(opt, ["x"])
    activate(fake, opt, from_step=1)  # already past: the next step_begin activates it
    run_iteration(opt, ORDER)
    assert opt.schedule_version == 1


def test_activation_checked_before_the_event(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt, from_step=1)
    opt.on_step_begin()  # carries step 0: not yet
    assert opt.schedule_version is None
    opt.on_step_end()
    opt.on_step_begin()  # carries step 1
    assert opt.schedule_version == 1
    assert fake["publisher"].events[-1] == ("step_begin", 1)


def test_newer_version_replaces_the_schedule(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    run_iteration(opt, ORDER)
    new = [("forward", 1200), ("backward", 1200)]
    fake["publisher"].notices.append(Notice("job-1", 0, 2, 3, new))
    run_iteration(opt, ORDER)  # step 1
    run_iteration(opt, ORDER)  # step 2
    run_iteration(opt, ["forward", "backward"])  # step 3: version 2
    assert opt.schedule == new and opt.schedule_version == 2
    # An older or equal version is ignored.
    fake["publisher"].notices.append(Notice("job-1", 0, 2, 0, SCHEDULE))
    run_iteration(opt, ["forward", "backward"])
    assert opt.schedule == new


def test_schedule_for_another_rank(fake: dict[str, Any]) -> None:
    opt = make(rank=1, job_id="job-1")
    fake["publisher"].notices.append(Notice("job-1", 0, 1, 0, SCHEDULE))
    with pytest.raises(RuntimeError, match="for rank 0 to rank 1"):
        opt.on_step_begin()


def test_fewer_frequencies_error_is_zeus(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    opt.on_step_begin()
    for name in ORDER:
        opt.on_instruction_begin(name)
        opt.on_instruction_end(name)
    with pytest.raises(RuntimeError) as info:
        opt.on_instruction_begin("forward")
    assert str(info.value) == "Perseus server returned fewer frequencies than expected"


def test_wrong_name_error_is_zeus(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    opt.on_step_begin()
    opt.on_instruction_begin("forward")
    with pytest.raises(RuntimeError) as info:
        opt.on_instruction_begin("backward")  # the schedule says forward
    assert str(info.value) == "The next expected instruction is not forward: forward"
    # Zeus's text says "forward" whatever the instruction; it names the expected one.
    opt2 = make()
    fake["publisher"].notices[-1] = Notice("job-1", 0, 5, 0, [("backward", 1000)])
    opt2.on_step_begin()
    with pytest.raises(RuntimeError) as info:
        opt2.on_instruction_begin("forward")
    assert str(info.value) == "The next expected instruction is not forward: backward"
    # A refused instruction is not emitted.
    assert fake["publisher"].events.count(("instruction_begin", "backward")) == 0


def test_more_frequencies_error_is_zeus(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    opt.on_step_begin()
    opt.on_instruction_begin("forward")
    opt.on_instruction_end("forward")
    with pytest.raises(RuntimeError) as info:
        opt.on_step_end()
    assert str(info.value) == (
        "Perseus server returned more frequencies than expected. "
        "Next expected instruction and frequency is ('forward', 1500)"
    )


def test_events_and_polls(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    run_iteration(opt, ORDER)
    pub = fake["publisher"]
    assert pub.polls == 1  # one non-blocking poll per step_begin, none on the hot path
    assert [e[0] for e in pub.events] == (
        ["step_begin"] + ["instruction_begin", "instruction_end"] * 4 + ["step_end"]
    )
    opt.close()
    assert pub.events[-1] == ("close", None)


def test_unreachable_coordinator_only_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(**kw: Any) -> Any:
        raise emit.RegistrationError("job", "unavailable", "no coordinator")

    monkeypatch.setattr(emit, "init", refuse)
    monkeypatch.setattr(emit, "get_publisher", lambda: FakePublisher(job_id=None))
    with caplog.at_level(logging.WARNING):
        opt = make()
    assert opt.job_id is None
    assert "unreachable" in caplog.text

    def forbid(**kw: Any) -> Any:
        raise emit.RegistrationError("job", "forbidden", "no")

    monkeypatch.setattr(emit, "init", forbid)
    with pytest.raises(emit.RegistrationError):
        make()
