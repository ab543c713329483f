"""The pipeline part's run: the all-max job, then the Perseus job, with live progress.

`run_pipeline_demo(config, console)` runs both jobs on one `PipelineCluster` and measures the
all-max baseline and the served plan (`window_stats`): a `PipelineDemoRun`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from zeus_agent.wire import subjects
from zeus_agent.wire.messages import JobStatus
from zeus_demo.pipeline.cluster import JobRun, PipelineCluster
from zeus_demo.pipeline.config import (
    PipelineDemoConfig,
    PipelineDemoError,
    all_max_plan,
    resolve_scheduler,
    scheduler_args,
    write_plan,
)
from zeus_demo.pipeline.measure import JobObserver, Side, window_stats


@dataclass
class PipelineDemoRun:
    """What the pipeline part produced (the report's inputs)."""

    config: PipelineDemoConfig
    scheduler: str
    note: str | None
    all_max: JobRun
    perseus: JobRun
    baseline: Side
    optimised: Side
    served_version: int | None
    nats: str
    elapsed_s: float


class _Live:
    """Live progress: a rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, console: Console, enabled: bool) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = console
        self.rich = enabled and console.is_terminal
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("{task.fields[phase]}"), TimeElapsedColumn(),
            console=console, disable=not self.rich)
        self.task: Any = None
        self.label = ""
        self.total = 0
        self._last_phase = ""
        self._last_line = 0.0

    def __enter__(self) -> _Live:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def begin(self, label: str, total: int) -> None:
        self.label, self.total, self._last_phase = label, total, ""
        if self.rich:
            if self.task is not None:
                self.progress.update(self.task, visible=False)
            self.task = self.progress.add_task(label, total=total, phase="starting the ranks")
        else:
            self.console.print(f"[bold]{label}[/]: {total} iterations")

    def iteration(self, count: int, elapsed: float) -> None:
        if self.rich:
            self.progress.update(self.task, completed=min(count, self.total))
            return
        now = time.monotonic()
        if now - self._last_line >= 10.0 or count == self.total:
            self._last_line = now
            self.console.print(f"  {self.label}: iteration {count}/{self.total} "
                               f"({elapsed:.3f} s)")

    def status(self, ev: JobStatus) -> None:
        text = phase_text(ev)
        if text is None or (ev.state == "rank_registered" and self._last_phase):
            return  # (A late registration status after the job moved on.)
        if self.rich:
            self.progress.update(self.task, phase=text)
        elif text != self._last_phase:
            self.console.print(f"  {self.label}: {text}")
        self._last_phase = text


def phase_text(ev: JobStatus) -> str | None:
    """A short line for a pipeline job's status event (None: not worth showing)."""
    p = ev.progress or {}
    if ev.state in ("registered", "rank_registered"):
        return "registering the ranks"
    if ev.state == "discovering":
        return "discovering each stage's instructions"
    if ev.state == "profiling":
        rounds = p.get("rounds")
        if rounds:
            return f"profiling online: round {rounds[0] + 1}/{rounds[1]}"
        return f"schedule {p.get('schedule')}"
    if ev.state in ("serving", "straggler"):
        return f"{ev.state}: {ev.message.split(':')[0]} (schedule {p.get('schedule')})"
    if ev.state in ("error", "stopped"):
        return f"{ev.state}: {ev.message[:80]}"
    return None


PLANNING_ALLOWANCE = 3
"""The Perseus job runs until enough iterations ran under its served plan (`ServedLongEnough`),
up to this many times its budget: planning takes wall time, over which a slow host runs
iterations that the profiling budget does not count (a loaded 2-core host once ran none under
the plan within the budget)."""
LEAD_ITERATIONS = 12
"""Iterations the all-max job runs before its schedule counts: discovery and the install (a
loaded host took more than 5 of 0.1x-scaled iterations: 7 of 8 were measured)."""


class ServedLongEnough:
    """A job's `enough`: `iterations` ran since its newest served plan was first seen.

    Counted again from a newer plan (a re-plan after a straggler).
    """

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.version: int | None = None
        self.since = 0

    def __call__(self, count: int, observer: JobObserver) -> bool:
        """Whether the job has run enough after `count` iterations."""
        served = observer.versions("serving")
        if served and served[-1] != self.version:
            self.version, self.since = served[-1], count
        return self.version is not None and count - self.since >= self.iterations


async def run_pipeline_demo(
    config: PipelineDemoConfig,
    console: Console,
    *,
    progress: bool = True,
    nats_url: str | None = None,
    prefix: str = subjects.DEFAULT_PREFIX,
    log_level: str = "ERROR",
) -> PipelineDemoRun:
    """The all-max job, then the Perseus job; every process stopped and temporary file removed.

    Raises:
        PipelineDemoError: Something did not start, a job failed, or too few iterations ran
            under the served plan to measure it.
    """
    started = time.monotonic()
    scheduler, note = resolve_scheduler(config.scheduler, config.dp)
    cluster = PipelineCluster(config, nats_url=nats_url, prefix=prefix, log_level=log_level)
    try:
        with _Live(console, progress) as live:
            await cluster.start()
            if note:
                console.print(f"[yellow]note: {note}[/]")
            baseline_name = "PointSolution3D" if config.dp > 1 else "PointSolution"
            plan = write_plan(cluster.root / "all-max-plan.json",
                               all_max_plan(config.stages, config.microbatches,
                                            cluster.top_clock_mhz))
            total = LEAD_ITERATIONS + config.warmup_iterations + config.baseline_iterations
            live.begin(f"all-max clocks ({cluster.top_clock_mhz} MHz)", total)
            all_max = await cluster.run_job(
                baseline_name, {"solution_path": plan}, total, label="all-max",
                straggler=config.straggler, on_iteration=live.iteration,
                on_status=live.status)
            after_plan = LEAD_ITERATIONS + config.warmup_iterations + config.serve_iterations
            total = config.profiling_budget(cluster.available_clocks) + after_plan
            live.begin(scheduler, total)  # (what it takes when the plan comes in the budget)
            perseus = await cluster.run_job(
                scheduler, scheduler_args(scheduler, config), PLANNING_ALLOWANCE * total,
                label="perseus", straggler=config.straggler,
                detect_stragglers=config.straggler_detection, on_iteration=live.iteration,
                on_status=live.status, perseus_snapshot=True,
                enough=ServedLongEnough(after_plan))
    finally:
        await cluster.stop()
    baseline = window_stats(all_max.observer.steps, all_max.rank_pipeline,
                            sorted(all_max.schedules) or [0], skip=config.warmup_iterations,
                            limit=config.baseline_iterations)
    served = perseus.observer.versions("serving")
    version = served[-1] if served else None
    optimised = window_stats(perseus.observer.steps, perseus.rank_pipeline, [version],
                             skip=config.warmup_iterations) if version is not None else Side(
        0, None, None, math.nan, math.nan, {}, [])
    if baseline.iterations < 4:
        raise PipelineDemoError(
            f"only {baseline.iterations} all-max iteration(s) were measured on every rank")
    if optimised.iterations < 4:
        raise PipelineDemoError(
            f"only {optimised.iterations} iteration(s) ran under the served plan: it came too "
            f"late (the job runs at most {PLANNING_ALLOWANCE} times the iterations its "
            "profiling needs); raise --pipeline-iterations, or run on a less loaded host")
    return PipelineDemoRun(
        config=config, scheduler=scheduler, note=note, all_max=all_max, perseus=perseus,
        baseline=baseline, optimised=optimised, served_version=version,
        nats="embedded" if nats_url is None else nats_url,
        elapsed_s=time.monotonic() - started)
