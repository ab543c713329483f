"""The power-limit part's run: services up, the data-parallel job, measurements, services down.

One asyncio loop runs an embedded `nats-server` (or uses `--nats-url`), one `AgentServer` per
simulated node (simulated GPUs, `backend="sim"`) and a `CoordinatorService`: the cluster
harness's `LocalCluster`. A simulated
data-parallel job (`zeus_agent.gpu.sim.trainers.data_parallel`: one process per rank, real
`zeus_agent.emit` calls) then runs under the power-limit optimizer, while `_Observer` follows
the job's status events (live progress) and records the agents' per-step measurements.

`run_demo(config, console)` returns a `DemoRun`, the report's inputs; every process it started
is stopped and its temporary state removed, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from zeus_agent.errors import BrokerError
from zeus_agent.gpu.sim.presets import PRESETS
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus
from zeus_agent.wire.node_columns import as_rows, decode_measurements
from zeus_demo.cluster import LocalCluster
from zeus_demo.config import DemoConfig, DemoError, DemoStartupError

LOG = logging.getLogger(__name__)

@dataclass
class DemoRun:
    """What a demo run produced (the report's inputs).

    Attributes:
        config: The options.
        job_id: The job's id.
        nats_url: The NATS used ("embedded" servers are noted in `embedded_nats`).
        embedded_nats: Whether the demo started its own nats-server.
        chosen_power_limit_w: The limit the coordinator pinned (from its "done" status).
        max_power_limit_w: The GPUs' maximum limit.
        profile: The profile's measurements (Zeus format: power_limit W, energy J, time s of a
            `profile_steps`-step window over the job's GPUs).
        profile_json: The saved profile file's text (Zeus JSON), when it was found.
        step_limits_w: Rank -> power limit of each step, as the trainer ran them.
        measured: (rank, step) -> (time_s, energy_j) from the agents' measurement batches.
        statuses: (state, message) of every status event of the job, in order.
        elapsed_s: Wall time of the whole run (s).
    """

    config: DemoConfig
    job_id: str
    nats_url: str
    embedded_nats: bool
    chosen_power_limit_w: int
    max_power_limit_w: int
    profile: list[dict[str, Any]]
    profile_json: str | None
    step_limits_w: dict[int, list[int]]
    measured: dict[tuple[int, int], tuple[float, float]]
    statuses: list[tuple[str, str]] = field(default_factory=list)
    elapsed_s: float = 0.0


class _Observer:
    """Follows the job's status events and the agents' step measurements on NATS."""

    def __init__(self, job_tag: str, on_status: Any) -> None:
        self.job_tag = job_tag
        self.on_status = on_status
        self.statuses: list[Any] = []
        self.measured: dict[tuple[int, int], tuple[float, float]] = {}
        self.done = asyncio.Event()
        self.complete = asyncio.Event()
        self.disconnects = 0
        self._expected: set[tuple[int, int]] | None = None

    def expect(self, keys: set[tuple[int, int]]) -> asyncio.Event:
        """The returned event is set once every (rank, step) in `keys` has a measurement."""
        self._expected = keys
        self._check_complete()
        return self.complete

    def _check_complete(self) -> None:
        if self._expected is not None and self._expected <= self.measured.keys():
            self.complete.set()

    def _ours(self, job_id: str) -> bool:
        return job_id.endswith(self.job_tag)

    async def status(self, msg: Any) -> None:
        try:
            ev = codec.decode(msg.data, JobStatus)
        except Exception as e:  # noqa: BLE001 - a foreign message on a shared bus
            LOG.debug("ignoring an undecodable status event: %s", e)
            return
        if not self._ours(ev.job_id):
            return
        self.statuses.append(ev)
        if ev.state == "done" and ev.progress.get("optimal_power_limit_w") is not None:
            self.done.set()
        self.on_status(ev)

    async def measurement(self, msg: Any) -> None:
        try:
            batch = as_rows(decode_measurements(msg.data))
        except Exception as e:  # noqa: BLE001
            LOG.debug("ignoring an undecodable measurement batch: %s", e)
            return
        if not self._ours(batch.job_id):
            return
        for part in batch.gpus:
            for m in part.measurements:
                if m.kind == "step":
                    self.measured[(part.rank, m.step)] = (m.time_s, m.energy_j)
        self._check_complete()


def _phase_text(ev: Any) -> str:
    p = ev.progress or {}
    phase = p.get("phase", ev.state)
    limit = p.get("power_limit_w")
    text = f"{ev.state}: {phase}"
    if limit is not None:
        text += f" @ {limit} W"
    if p.get("candidates"):
        text += f" ({p.get('measured', 0)}/{p['candidates']} limits measured)"
    if p.get("optimal_power_limit_w") is not None:
        text = f"done: pinned {p['optimal_power_limit_w']} W"
    return text


def _progress(config: DemoConfig, console: Console) -> tuple[Progress, Any]:
    """The live progress bar (off with `--no-progress`) and its one task."""
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not config.progress,
    )
    return progress, progress.add_task("starting", total=config.total_steps, phase="")


async def _start_services(config: DemoConfig, cluster: LocalCluster, root: Path,
                          observer: _Observer) -> tuple[str, Any]:
    """NATS (embedded unless `--nats-url`), the observer's subscriptions, agents, coordinator.

    Returns the NATS URL and the demo's own connection (the caller drains it).
    """
    from zeus_agent.broker import confirm_subscriptions, connect

    url = await cluster.start_broker()

    async def on_disconnect() -> None:
        observer.disconnects += 1

    try:
        nc = await connect(url, "zeus-demo", on_disconnect=on_disconnect)
    except BrokerError as e:
        hint = " (with zeus-demo: omit --nats-url)" if config.nats_url else ""
        raise DemoStartupError(f"{e}{hint}") from e
    p = config.prefix
    await nc.subscribe(subjects.all_job_status(p), cb=observer.status)
    await nc.subscribe(subjects.all_job_measurements(p), cb=observer.measurement)
    await confirm_subscriptions(nc)
    for node in config.node_names:
        cluster.add_agent(node, {
            "sim_count": config.gpus_per_node, "sim_preset": config.preset,
            "sim_state_dir": str(root / node), "socket_path": str(root / f"{node}.sock"),
            "sample_hz": 20,
            # The job runs `scale` times faster than the real one: so does the GPU's
            # energy counter (100 ms on real GPUs).
            "sim_energy_update_ms": 100.0 * config.scale,
        })
    coord, coord_task = cluster.add_coordinator({
        "state_dir": str(root / "coordinator"), "dump_dir": str(root / "dump"),
    })
    await cluster.wait_agents()
    await cluster.wait_coordinator(coord, coord_task)
    return url, nc


async def _train(config: DemoConfig, root: Path, job_tag: str,
                 on_step: Callable[[int], None]) -> Any:
    """Run the simulated data-parallel job (one process per rank) to its end."""
    from zeus_agent.gpu.sim.trainers.data_parallel import (
        RankPlacement,
        TrainerOptions,
        run_data_parallel,
    )

    placements = [
        RankPlacement(node, str(root / f"{node}.sock"), str(root / node), gpu)
        for node, gpu in config.placements()
    ]
    options = TrainerOptions(
        workload=config.workload_name, epochs=config.epochs,
        steps_per_epoch=config.steps, scale=config.scale,
        power_limit=config.power_limit_options, job_metadata=job_tag, seed=config.seed,
    )
    try:
        result = await asyncio.to_thread(
            run_data_parallel, placements, options, on_step, config.timeout_s
        )
    except RuntimeError as e:
        raise DemoError(f"the simulated job failed: {e}") from e
    if not result.job_id:
        raise DemoError("the job was not registered: no job id came back")
    return result


async def _await_measurements(observer: _Observer, result: Any) -> None:
    """Give the last measurements and the "done" status a moment to arrive.

    Steps still missing after this are left out of the comparison and counted
    (`unmatched_steps`).
    """
    expected = {(r.rank, s) for r in result.ranks for s in range(len(r.step_time_s))}
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(observer.expect(expected).wait(), 5.0)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(observer.done.wait(), 2.0)


async def run_demo(config: DemoConfig, console: Console) -> DemoRun:
    """Start the services, run the job, collect what the agents measured, stop everything.

    Every process started here (nats-server, rank processes) is stopped and the temporary
    state (simulated GPUs, sockets, coordinator state) is removed, whatever happens.

    Raises:
        DemoStartupError: NATS, an agent or the coordinator did not start.
        DemoError: The job failed or the optimizer did not pin a limit.
    """
    started_at = time.monotonic()
    job_tag = f"zeus-demo-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.TemporaryDirectory(prefix="zeus-demo-")
    root = Path(tmp.name)
    cluster = LocalCluster(nats_url=config.nats_url, prefix=config.prefix,
                           log_level=config.log_level, error=DemoStartupError,
                           hint="; rerun with --log-level INFO")
    nc: Any = None
    job_id: str | None = None
    url = config.nats_url or "the embedded nats-server"
    progress, task_id = _progress(config, console)
    observer = _Observer(job_tag, lambda ev: progress.update(task_id, phase=_phase_text(ev)))
    try:
        with progress:
            if not config.nats_url:
                progress.update(task_id, description="starting nats-server")
            url, nc = await _start_services(config, cluster, root, observer)
            progress.update(task_id, description="training", phase="registering the job")
            result = await _train(config, root, job_tag,
                                  lambda step: progress.update(task_id, completed=step))
            job_id = result.job_id
            lost_nats_during_job = observer.disconnects > 0
            await _await_measurements(observer, result)
            progress.update(task_id, description="done", completed=config.total_steps)
    finally:
        try:
            await cluster.stop_services()
            if nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.drain(), 5)
        finally:
            await cluster.stop_broker()
        profile_json = _read_profile(root, job_id)
        tmp.cleanup()
    return _outcome(config, observer, result, url, lost_nats_during_job, profile_json,
                    time.monotonic() - started_at)


def _outcome(config: DemoConfig, observer: _Observer, result: Any, url: str, lost_nats: bool,
             profile_json: str | None, elapsed_s: float) -> DemoRun:
    """The run's report inputs, or why the optimizer did not pin a limit."""
    done = [s for s in observer.statuses if s.state == "done"]
    if not done and lost_nats:
        raise DemoError(
            f"the connection to NATS at {url} was lost during the job, so the optimizer could "
            "not finish (was the nats-server stopped?); run the demo again"
        )
    if not done:
        states = ", ".join(dict.fromkeys(s.state for s in observer.statuses)) or "none"
        raise DemoError(
            f"the optimizer did not pin a power limit (status events seen: {states}); raise "
            "--steps or run with --log-level INFO"
        )
    final = done[-1].progress
    hw = PRESETS[config.preset]
    return DemoRun(
        config=config,
        job_id=result.job_id,
        nats_url=url,
        embedded_nats=not config.nats_url,
        chosen_power_limit_w=int(final["optimal_power_limit_w"]),
        max_power_limit_w=hw.max_power_limit_w,
        profile=list(final.get("measurements", [])),
        profile_json=profile_json,
        step_limits_w={r.rank: list(r.step_power_limit_w) for r in result.ranks},
        measured=dict(observer.measured),
        statuses=[(s.state, s.message) for s in observer.statuses],
        elapsed_s=elapsed_s,
    )


def _read_profile(root: Path, job_id: str | None) -> str | None:
    if job_id is None:
        return None
    path = root / "coordinator" / "profiles" / f"{subjects.token(job_id)}.json"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None
