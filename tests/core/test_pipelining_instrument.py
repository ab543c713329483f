"""`zeus_agent.integrations.pipelining` on fake stage and schedule objects (no torch)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.core.pipeline_events_kit import Recorder
from zeus_agent import emit
from zeus_agent.integrations import PerseusOptimizer, instrument_pipeline
from zeus_agent.integrations.pipeline_events import StepGate
from zeus_agent.wire.trainer import ScheduleNotice

pytestmark = pytest.mark.core


class FakeStage:
    """The compute entry points of torch's `_PipelineStageBase`, with its signatures."""

    def __init__(self, stage_index: int, log: list[str]) -> None:
        self.stage_index = stage_index
        self.log = log

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...],
                          kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> str:
        self.log.append(f"F{self.stage_index}.{fwd_chunk_id}")
        return "out"

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None,
                           full_backward: bool = True, last_backward: bool = False) -> None:
        self.log.append(f"{'B' if full_backward else 'I'}{self.stage_index}.{bwd_chunk_id}")

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self.log.append(f"W{self.stage_index}.{bwd_chunk_id}")


class FakeMultiSchedule:
    """Runs a fixed action list over its stages, the way torch's runtime calls them."""

    def __init__(self, stages: list[FakeStage], plan: list[tuple[str, int, int]]) -> None:
        self._stages = stages
        self._has_backward = True
        self.plan = plan

    def step(self, *args: Any, **kwargs: Any) -> str:
        by_index = {s.stage_index: s for s in self._stages}
        for kind, stage, mb in self.plan:
            s = by_index[stage]
            if kind == "F":
                s.forward_one_chunk(mb, (), {}, save_forward_output=True)
            elif kind == "B":
                s.backward_one_chunk(mb, loss=None, full_backward=True, last_backward=False)
            elif kind == "I":
                s.backward_one_chunk(mb, None, False)  # positional, as a user might
            elif kind == "W":
                s.backward_weight_one_chunk(mb, last_backward=False)
            elif self._has_backward:
                raise AssertionError(kind)
        return "merged"

    def eval(self) -> str:
        self._has_backward = False
        try:
            return self.step()
        finally:
            self._has_backward = True


class FakeSingleSchedule:
    def __init__(self, stage: FakeStage, microbatches: int) -> None:
        self._stage = stage
        self.n = microbatches

    def step(self) -> None:
        for mb in range(self.n):
            self._stage.forward_one_chunk(mb, ())
        for mb in range(self.n):
            self._stage.backward_one_chunk(mb, loss=None)


ZB_PLAN = [("F", 0, 0), ("F", 3, 0), ("F", 0, 1), ("I", 3, 0), ("F", 3, 1), ("W", 3, 0),
           ("I", 0, 0), ("I", 3, 1), ("W", 0, 0), ("W", 3, 1), ("B", 0, 1)]


def test_every_action_is_named_in_order_with_its_stage_and_microbatch() -> None:
    log: list[str] = []
    schedule = FakeMultiSchedule([FakeStage(0, log), FakeStage(3, log)], ZB_PLAN)
    rec = Recorder()
    handle = instrument_pipeline(schedule, rec)
    assert schedule.step() == "merged"
    kinds = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
    names = [f"{kinds[k]}:{s}:{m}" for k, s, m in ZB_PLAN]
    expected: list[tuple[str, ...]] = [("step_begin",)]
    for name in names:
        expected += [("begin", name), ("end", name)]
    expected.append(("step_end",))
    assert rec.events == expected
    assert len(log) == len(ZB_PLAN)  # each real method ran once
    assert handle.gate.steps == 1


def test_remove_restores_the_objects_own_methods() -> None:
    log: list[str] = []
    stages = [FakeStage(0, log), FakeStage(1, log)]
    schedule = FakeMultiSchedule(stages, [("F", 0, 0), ("B", 0, 0)])
    before = [dict(vars(s)) for s in stages], dict(vars(schedule))
    rec = Recorder()
    with instrument_pipeline(schedule, rec) as handle:
        assert handle.installed and "step" in vars(schedule)
    assert not handle.installed
    assert ([dict(vars(s)) for s in stages], dict(vars(schedule))) == before
    schedule.step()
    assert rec.events == [] and log == ["F0.0", "B0.0"]
    handle.remove()  # idempotent
    instrument_pipeline(schedule, rec).remove()  # can be instrumented again


def test_a_second_instrumentation_is_refused_and_leaves_the_first() -> None:
    schedule = FakeMultiSchedule([FakeStage(0, [])], [("F", 0, 0)])
    rec = Recorder()
    instrument_pipeline(schedule, rec)
    with pytest.raises(ValueError, match="instrumented already"):
        instrument_pipeline(schedule, Recorder())
    schedule.step()
    assert rec.events[1] == ("begin", "forward:0:0")


def test_eval_reports_nothing() -> None:
    schedule = FakeMultiSchedule([FakeStage(0, [])], [("F", 0, 0), ("F", 0, 1)])
    rec = Recorder()
    instrument_pipeline(schedule, rec)
    schedule.eval()
    assert rec.events == []


def test_a_failing_step_is_not_ended_and_its_action_is_closed() -> None:
    stage = FakeStage(2, [])

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("oom")

    stage.backward_one_chunk = boom  # type: ignore[method-assign]
    schedule = FakeMultiSchedule([stage], [("F", 2, 0), ("B", 2, 0)])
    rec = Recorder()
    handle = instrument_pipeline(schedule, rec)
    with pytest.raises(RuntimeError, match="oom"):
        schedule.step()
    assert rec.events[-2:] == [("begin", "backward:2:0"), ("end", "backward:2:0")]
    assert ("step_end",) not in rec.events and not handle.gate.active
    handle.remove()
    assert stage.backward_one_chunk is boom  # an instance attribute is put back


def test_bare_names_on_a_single_stage_schedule() -> None:
    schedule = FakeSingleSchedule(FakeStage(1, []), 2)
    rec = Recorder()
    instrument_pipeline(schedule, rec, bare_names=True)
    schedule.step()
    assert [e[1] for e in rec.events if e[0] == "begin"] == ["forward"] * 2 + ["backward"] * 2
    multi = FakeMultiSchedule([FakeStage(0, []), FakeStage(2, [])], [])
    with pytest.raises(ValueError, match="one stage per rank"):
        instrument_pipeline(multi, rec, bare_names=True)
    with pytest.raises(ValueError, match="no bare Zeus 0.16 name"):
        StepGate(rec, bare_names=True).name("backward_weight", 0, 0)


def test_not_a_schedule() -> None:
    with pytest.raises(TypeError, match="not a torch.distributed.pipelining schedule"):
        instrument_pipeline(object())


def test_default_events_go_through_emit(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(emit, "step_begin", lambda: seen.append(("step_begin",)))
    monkeypatch.setattr(emit, "step_end", lambda: seen.append(("step_end",)))
    monkeypatch.setattr(emit, "instruction_begin", lambda n: seen.append(("begin", n)))
    monkeypatch.setattr(emit, "instruction_end", lambda n: seen.append(("end", n)))
    schedule = FakeSingleSchedule(FakeStage(0, []), 1)
    instrument_pipeline(schedule)
    schedule.step()
    assert seen == [("step_begin",), ("begin", "forward:0:0"), ("end", "forward:0:0"),
                    ("begin", "backward:0:0"), ("end", "backward:0:0"), ("step_end",)]


def _perseus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             frequencies: list[tuple[str, int]]) -> PerseusOptimizer:
    """A rank-1 drop-in with no agent, whose agent 'pushed' this schedule."""
    # Quiet (no agent: it warns) for this test only: a level set on the logger would outlive it
    # (caplog's at_level sets the root's, not zeus_agent's).
    monkeypatch.setattr(logging.getLogger("zeus_agent"), "disabled", True)
    opt = PerseusOptimizer(1, 0, 1, 0, 0, 1, 2, 1, 2, "http://unused",
                           job_id="j", join_token="t" * 16,
                           socket_path=str(tmp_path / "absent.sock"), timeout_s=0.1)
    notice = ScheduleNotice(job_id="j", rank=1, version=1, from_step=0, frequencies=frequencies)
    monkeypatch.setattr(opt.publisher, "latest_schedule", lambda: notice)
    return opt


def test_perseus_checks_action_names_in_order(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    plan = [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]
    schedule = FakeMultiSchedule([FakeStage(1, [])], plan)
    frequencies = [("forward:1:0", 1410), ("forward:1:1", 1200), ("backward:1:0", 1410),
                   ("backward:1:1", 990)]
    opt = _perseus(tmp_path, monkeypatch, frequencies)
    instrument_pipeline(schedule, opt)
    schedule.step()
    schedule.step()
    assert opt.schedule == frequencies and opt.frequency == 990
    schedule.plan = [("F", 1, 1), ("F", 1, 0), ("B", 1, 0), ("B", 1, 1)]
    with pytest.raises(RuntimeError, match="forward:1:0"):
        schedule.step()
    opt.close()


def test_the_module_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import zeus_agent.integrations.pipelining, zeus_agent.integrations.deepspeed\n"
            "import zeus_agent.integrations.megatron\n"
            "from zeus_agent.integrations import instrument_pipeline\n"
            "assert 'torch.distributed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
