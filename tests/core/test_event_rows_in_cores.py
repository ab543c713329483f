"""The cores take a columnar event batch's rows (`EventRow`) as they take `TrainerEvent`s.

A rank's `TrainerEventColumns` reaches the cores as tuples with the rows' field names, never a
pydantic model per event: fed the same events in batches, as models or as the rows a columnar
batch of them gives (encoded, decoded), the power-limit and the pipeline cores produce the
same actions and end in the same state. The power-limit job is also fed every rank's marks per
step (the same `Mark`s to both), so its windows are measured: steps that go on, repeat, jump,
restart in a new epoch, stale limits (`power_limit_w` other than the window's), epoch ends,
instruction events and selection answers (to a trainer's own selector, `Custom`), in batches
of any length.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler
from coordinator.power_limit.job import PowerLimitJob
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec
from zeus_agent.wire.event_columns import (
    EventRow,
    TrainerEventColumns,
    decode_events,
    event_rows,
)
from zeus_agent.wire.messages import Mark, PowerLimitOptions, TrainerEvent, TrainerEventBatch


def through_columns(rank: int, events: list[TrainerEvent]) -> list[EventRow]:
    """The events as a coordinator gets them from a columnar batch on the wire."""
    rows = TrainerEventBatch(job_id="j", rank=rank, node="n", gpu=rank, events=events)
    batch = decode_events(codec.encode(TrainerEventColumns.from_batch(rows)))
    assert isinstance(batch, TrainerEventColumns)
    out = event_rows(batch)
    assert all(type(e) is EventRow for e in out)
    return out  # type: ignore[return-value]


def test_rows_batches_still_decode_as_their_models() -> None:
    events = [TrainerEvent(kind="step_begin", t_ns=1, step=1)]
    rows = TrainerEventBatch(job_id="j", rank=0, node="n", gpu=0, events=events)
    batch = decode_events(codec.encode(rows))
    assert batch == rows and event_rows(batch) == events


STEP_EVENT = st.tuples(
    st.sampled_from(["on", "on", "on", "on", "same", "back", "jump", "epoch"]),
    st.sampled_from([None, None, 300, 275, 250]),  # the limit the event reports
    st.sampled_from(["", "step_end", "instruction_begin", "instruction_end", "selection"]),
    st.sampled_from(["", "forward", "x" * 40]),  # a name (instructions, selections)
    st.integers(0, 3),  # an index
)  # fmt: skip


def power_limit_job(selector: str = "Energy") -> PowerLimitJob:
    custom = {"custom_selector": "the trainer's"} if selector == "Custom" else {}
    options = PowerLimitOptions(selector=selector, wait_steps=0, warmup_steps=0,
                                profile_steps=2, pl_step_w=25, **custom)
    job = PowerLimitJob("j", options, ranks=[0, 1, 2], min_power_limit_w=250,
                        max_power_limit_w=300)
    job.start()
    return job


def events_of(state: list[int], drawn: tuple[Any, ...], t_ns: int) -> list[TrainerEvent]:
    """Rank 0's events for one drawn step (`state`: [epoch, step], updated)."""
    how, limit, extra, name, index = drawn
    epoch, step = state
    if how == "on":
        step += 1
    elif how == "back":
        step = max(0, step - 3)
    elif how == "jump":
        step += 7
    elif how == "epoch":
        epoch, step = epoch + 1, 0
    state[:] = [epoch, step]
    out = [TrainerEvent(kind="step_begin", t_ns=t_ns, epoch=epoch, step=step,
                        power_limit_w=limit)]
    if how == "epoch":
        out.insert(0, TrainerEvent(kind="epoch_end", t_ns=t_ns, epoch=epoch - 1))
    if extra:
        out.append(TrainerEvent(kind=extra, t_ns=t_ns + 1, epoch=epoch, step=step, index=index,
                                name=name, power_limit_w=limit))
    return out


def marks_of(step: int, epoch: int, n: int) -> list[tuple[int, Mark]]:
    """Every rank's step_begin mark of the step (energy grows with the rank)."""
    return [(rank, Mark(kind="step_begin", epoch=epoch, step=step, t_ns=n * 10**9,
                        energy_j=100.0 * n * (rank + 1), power_limit_w=None))
            for rank in range(3)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP_EVENT, min_size=4, max_size=40), batch=st.integers(1, 6),
       selector=st.sampled_from(["Energy", "Time", "Custom"]))
def test_the_power_limit_core_takes_event_rows_as_events(steps: list[tuple[Any, ...]],
                                                         batch: int, selector: str) -> None:
    models, rows = power_limit_job(selector), power_limit_job(selector)
    state, pending = [0, 0], []
    for n, drawn in enumerate(steps):
        pending += events_of(state, drawn, n * 10**9)
        if len(pending) >= batch or n == len(steps) - 1:
            now = float(n)
            assert (models.on_events(0, pending, now)
                    == rows.on_events(0, through_columns(0, pending), now))
            pending = []
        for rank, mark in marks_of(state[1], state[0], n):
            assert models.on_mark(rank, mark) == rows.on_mark(rank, mark)
        assert models.tick(float(n)) == rows.tick(float(n))
    assert models.progress() == rows.progress()
    assert models.persisted() == rows.persisted()


def test_event_rows_measure_every_window_of_a_power_limit_job() -> None:
    """Nothing lost: 3 limits measured from events that came in columns, as from models."""
    models, rows = power_limit_job(), power_limit_job()
    for n in range(1, 40):
        events = [TrainerEvent(kind="step_end", t_ns=n * 10**9 - 1, step=n - 1),
                  TrainerEvent(kind="step_begin", t_ns=n * 10**9, step=n)]
        assert models.on_events(0, events, float(n)) == rows.on_events(
            0, through_columns(0, events), float(n))
        for rank, mark in marks_of(n, 0, n):
            assert models.on_mark(rank, mark) == rows.on_mark(rank, mark)
    assert rows.progress()["phase"] == "Done" and rows.progress()["measured"] == 3
    assert rows.progress() == models.progress()


def test_a_selection_in_columns_settles_the_job_as_the_model_does() -> None:
    """A trainer's answer (a limit, or None and why) pins alike from rows and columns."""
    for limit, why in ((275, ""), (None, "its selector raised")):
        models, rows = power_limit_job("Custom"), power_limit_job("Custom")
        asked = []
        for n in range(1, 30):
            event = [TrainerEvent(kind="step_begin", t_ns=n * 10**9, step=n)]
            asked += models.on_events(0, event, float(n))
            rows.on_events(0, through_columns(0, event), float(n))
            for rank, mark in marks_of(n, 0, n):
                asked += models.on_mark(rank, mark)
                rows.on_mark(rank, mark)
        (request,) = [a.request for a in asked if type(a).__name__ == "AskSelector"]
        answer = [TrainerEvent(kind="selection", t_ns=1, index=request, power_limit_w=limit,
                               name=why)]
        settled = models.on_events(0, answer, 20.0)
        assert settled == rows.on_events(0, through_columns(0, answer), 20.0) and settled
        assert rows.progress()["phase"] == "Done" and rows.progress() == models.progress()


class OneRound(FrequencyScheduler):
    """Runs nothing in particular: a pipeline job to feed events to."""

    def _run(self) -> Any:
        yield []


def test_the_pipeline_core_takes_event_rows_as_events() -> None:
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=[1410])
             for r in range(2)]
    jobs = [PipelineJob("job", info, ranks, lambda ji, ri: OneRound(ji, ri, None),
                        scheduler_name="OneRound", profiling_iterations=1) for _ in range(2)]
    assert jobs[0].start() == jobs[1].start()
    events = [TrainerEvent(kind="step_begin", t_ns=1, step=1),
              TrainerEvent(kind="instruction_end", t_ns=2, step=1, index=3, name="forward")]
    assert jobs[0].on_events(1, events, 1.0) == jobs[1].on_events(
        1, through_columns(1, events), 1.0)
    assert jobs[0].progress() == jobs[1].progress()
