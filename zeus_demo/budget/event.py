"""A grid event on a simulated cluster: processes up, jobs pinned, a cut, a lift, judged.

Played by `bench/power_budget.py` (the figures) and `zeus-demo --budget` (the picture).
`run_event(config)` starts a NATS server, coordinator replicas (`Replicas`), one sim agent
process per node and the jobs (`zeus_demo.budget.jobs`), every one in the cluster harness's
process registry (`Processes`: each a session leader with its log, none outliving the
benchmark); it follows the agents' samples and the jobs' status events on the bus, plays the
events and returns the figures (`zeus_demo.budget.analysis` judges them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.gpu.sim.presets import PRESETS
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetRequest, BudgetStatus
from zeus_agent.wire.messages import JobStatus, Reply, SampleBatch
from zeus_agent.wire.node_columns import as_rows, decode_measurements
from zeus_demo.budget import analysis as an
from zeus_demo.budget.jobs import (
    PERSEUS_ARGS,
    PERSEUS_PROFILE,
    PERSEUS_TIME_SCALE,
    REFERENCE_JOBS,
    JobSpec,
    Node,
    PerseusSpec,
    perseus_argv,
    perseus_job,
    plan,
    spec_json,
)
from zeus_demo.cluster import CODE_ROOT, Processes, Replicas, kill_group, wait_for_async

BIN_S = 0.5
"""Width of the bins the group's power is judged in (s)."""
BUDGET_ID = "grid"


@dataclass
class EventConfig:
    """The cluster, the jobs and the event's timing."""

    gpus_per_node: int = 8
    counts: dict[str, int] = field(default_factory=lambda: dict(REFERENCE_JOBS))
    step_s: float = 1.0
    cut_pct: float = 25.0
    hold_s: float = 20.0
    ownership_lease_s: float = 5.0
    sample_hz: float = 5.0
    pin_timeout_s: float = 300.0
    takeover: bool = True
    timeline: bool = False
    """Also return the first event's timeline (`timeline`: group power, each job's throughput)."""
    temp_root: str | None = "/dev/shm" if os.path.isdir("/dev/shm") else None
    """Where the run's state goes (in memory where there is /dev/shm)."""
    perseus: bool = False
    """Also a Perseus pipeline job on an A40 node of its own (`jobs.perseus_job`)."""
    log_dir: str | None = None
    """Where the replicas' and agents' logs and the run's bins are copied at the end
    (`keep_logs`; None: not kept)."""
    replica_log_level: str = "WARNING"
    """The replicas' `--log-level` (INFO: each budget's plan round by round)."""


STEPS_BEFORE_S = 10.0
"""The Perseus job's iterations before the signal that make its own point's time."""
MIN_STEPS = 5
"""Iterations on each side below which its slowdown is the planned one."""


class Watcher:
    """What the bus says: GPUs' samples, jobs' optima, the Perseus job's statuses and shares."""

    def __init__(self, jobs: list[JobSpec], perseus: PerseusSpec | None = None) -> None:
        self.series = an.PowerSeries()
        self.jobs = jobs
        self.optimum: dict[str, int] = {}
        self.job_ids: dict[str, str] = {}
        self.perseus = perseus
        self.perseus_states: list[tuple[float, str, str]] = []
        """(monotonic s, state, message) of the Perseus job's statuses."""
        self.perseus_shares: list[tuple[float, int, float | None, float]] = []
        """(monotonic s, limit W, planned slowdown, expected W) of its budget shares."""
        self.owners: list[tuple[float, str]] = []
        """(monotonic s, replica) of each budget status: who applied the budgets when."""
        self.rounds: list[tuple[float, str, float, float | None, float, int]] = []
        """(monotonic s, replica, room W, measured W, expected W, jobs capped without a
        profile) of each budget status: how the owner planned, round by round."""
        self.driver: str | None = None
        """The replica driving the Perseus job as the event was judged (`job_driver`)."""
        self.perseus_steps: list[tuple[float, float]] = []
        """(monotonic s, iteration time s) of the Perseus job's steps, its first GPU's."""
        self.events: list[Event] = []
        """The events played (`grid_event`), for `keep_logs`."""

    async def note_driver(self, nc: Any) -> None:
        """Which replica drives the Perseus job now (`job_driver`; no Perseus job: none)."""
        if self.perseus is not None:
            self.driver = await job_driver(nc, self.job_ids.get(self.perseus.tag))

    def perseus_own(self) -> bool:
        """Whether the Perseus job serves its own chosen point (no Perseus job: True)."""
        if self.perseus is None:
            return True
        states = [(s, m) for _, s, m in self.perseus_states if s in ("serving", "straggler")]
        return bool(states) and states[-1][0] == "serving" and "power budget" not in states[-1][1]

    async def budget_status(self, msg: Any) -> None:
        """A budget's status: who applied it, the Perseus job's share."""
        status = codec.decode(msg.data, BudgetStatus)
        self.owners.append((time.monotonic(), status.replica))
        self.rounds.append((time.monotonic(), status.replica, status.room_w, status.measured_w,
                            status.expected_w, sum(s.slowdown is None for s in status.shares)))
        if self.perseus is None or self.perseus.tag not in self.job_ids:
            return
        for share in status.shares:
            if share.job_id == self.job_ids[self.perseus.tag]:
                self.perseus_shares.append((time.monotonic(), share.limit_w, share.slowdown,
                                            share.expected_w))

    async def measurement(self, msg: Any) -> None:
        """The Perseus job's first GPU's measurements: its iteration times."""
        batch = as_rows(decode_measurements(msg.data))
        now = time.monotonic()
        first = self.perseus.gpus[0][1] if self.perseus is not None else None
        self.perseus_steps += [(now, m.time_s) for part in batch.gpus if part.gpu == first
                               for m in part.measurements
                               if m.kind == "step" and m.time_s is not None and m.time_s > 0]

    async def sample(self, msg: Any) -> None:
        """An agent's samples: each GPU's energy and limit over time."""
        batch = codec.decode(msg.data, SampleBatch)
        for s in batch.samples:
            self.series.add((batch.node, batch.gpu), s.t_ns / 1e9, s.energy_j, s.power_limit_w)

    async def status(self, msg: Any) -> None:
        """A job's status: its id, and its optimum once pinned."""
        ev = codec.decode(msg.data, JobStatus)
        if self.perseus is not None and ev.job_id.endswith(self.perseus.tag):
            self.job_ids[self.perseus.tag] = ev.job_id
            self.perseus_states.append((time.monotonic(), ev.state, ev.message or ""))
        for job in self.jobs:
            if ev.job_id.endswith(job.tag):
                self.job_ids[job.tag] = ev.job_id
                limit = (ev.progress or {}).get("optimal_power_limit_w")
                if ev.state == "done" and limit is not None:
                    self.optimum[job.tag] = int(limit)

    def gpu_optimum(self) -> dict[an.GpuKey, int]:
        """Each busy GPU's job's optimum (W); the Perseus job's GPUs, their default limit."""
        out = {k: self.optimum[j.tag] for j in self.jobs for k in j.gpus}
        if self.perseus is not None:
            out.update(dict.fromkeys(self.perseus.gpus, PRESETS["A40"].max_power_limit_w))
        return out

    def at_optimum(self, t_s: float) -> bool:
        """Whether every job is pinned and its GPUs sampled at its optimum (Perseus: its own)."""
        if len(self.optimum) < len(self.jobs) or not self.perseus_own():
            return False
        return all(self.series.limit_at(k, t_s) == w for k, w in self.gpu_optimum().items())


async def _budget(nc: Any, **kw: Any) -> Reply:
    msg = await nc.request(subjects.coord_budget(), codec.encode(BudgetRequest(**kw)), timeout=10)
    reply = codec.decode(msg.data, Reply)
    if not reply.ok:
        raise RuntimeError(f"budget {kw.get('action')}: {reply.code}: {reply.error}")
    return reply


def start_agent(procs: Processes, root: Path, url: str, node: Node, sample_hz: float) -> None:
    """Start the sim agent of `node` (process `agent-<node>`)."""
    argv = [sys.executable, "-m", "zeus_agent.cli", "run", "--nats-url", url, "--backend", "sim",
            "--sim-count", str(node.gpus), "--sim-preset", node.preset,
            "--sim-state-dir", str(root / node.name), "--socket-path",
            str(root / f"{node.name}.sock"), "--node", node.name, "--sample-hz", f"{sample_hz:g}",
            "--sim-energy-update-ms", "0", "--labels", f"gpu={node.preset}",
            "--log-level", "WARNING"]
    procs.spawn(f"agent-{node.name}", argv, cwd=CODE_ROOT)


def start_job(procs: Processes, root: Path, job: JobSpec, step_s: float, seed: int) -> None:
    """Start the simulated job `job` (process `job-<tag>`, its ranks its children)."""
    argv = [sys.executable, "-m", "zeus_demo.budget.jobs",
            spec_json(job, str(root), step_s, seed)]
    procs.spawn(f"job-{job.tag}", argv, cwd=CODE_ROOT)


def stop(procs: Processes, replicas: Replicas, log_dir: str | None = None,
         watch: Watcher | None = None) -> None:
    """SIGTERM the agents and the jobs (10 s to end), stop the replicas, kill what is left.

    `log_dir`: then keep the logs and the events' bins there (`keep_logs`).
    """
    others = [proc for name, proc in procs.procs.items() if name not in replicas.names]
    for proc in others:
        kill_group(proc, signal.SIGTERM, wait_s=0)
    for proc in others:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    replicas.close()
    if log_dir is not None:
        keep_logs(Path(log_dir), procs, watch)


async def lease_owner(nc: Any, key: str) -> str | None:
    """The replica holding the ownership bucket's lease `key` now, if any."""
    owners = await nc.jetstream().key_value(subjects.state_buckets()[1])
    try:
        entry = await owners.get(key)
    except Exception:  # noqa: BLE001 - no lease (yet)
        return None
    return str(json.loads(entry.value)["owner"]) if entry.value else None


async def budget_owner(nc: Any) -> str | None:
    """The replica holding the budgets' lease now (the ownership bucket's `budgets` key)."""
    return await lease_owner(nc, "budgets")


async def job_driver(nc: Any, job_id: str | None) -> str | None:
    """The replica driving a job now (its lease in the ownership bucket), if known."""
    if job_id is None:
        return None
    from coordinator.state.records import job_hash

    return await lease_owner(nc, job_hash(job_id))


@dataclass
class Event:
    """One cut and lift, as it happened."""

    cap_w: float
    signal_s: float
    lift_s: float
    kill_s: float | None = None
    killed: str | None = None
    applied: dict[str, int] = field(default_factory=dict)


async def grid_event(nc: Any, watch: Watcher, config: EventConfig,
                     replicas: Replicas | None) -> Event:
    """Cut, hold (killing the budgets' owner once under the cap), lift, wait for the optima."""
    keys = sorted(watch.series.samples)
    signal_s = time.monotonic()
    reply = await _budget(nc, action="set", budget=Budget(
        budget_id=BUDGET_ID, cut_pct=config.cut_pct, note="bench: grid event"))
    event = Event(float(reply.result["budget"]["cap_w"]), signal_s, 0.0)
    if replicas is not None:
        def under() -> bool:
            t = time.monotonic() - 1.5
            power = watch.series.group_power(keys, t - 2 * BIN_S, t, BIN_S)
            return bool(power) and all(p <= event.cap_w for _, p in power)

        with contextlib.suppress(AssertionError):
            await wait_for_async(under, 15, "under the cap", interval_s=0.5)
        owner = await budget_owner(nc)
        if owner is not None and replicas.alive(owner):
            event.kill_s, event.killed = time.monotonic(), owner
            replicas.kill(owner)
    await asyncio.sleep(config.hold_s)
    event.lift_s = time.monotonic()
    await _budget(nc, action="lift", budget_id=BUDGET_ID)
    with contextlib.suppress(AssertionError):
        await wait_for_async(lambda: watch.at_optimum(time.monotonic() - 1.2), 60,
                             "the optima restored", interval_s=0.5)
    await asyncio.sleep(2.5)  # the last samples arrive (published every second)
    for job in watch.jobs:
        event.applied[job.tag] = min(watch.series.limit_at(k, event.lift_s - 0.2) or 0
                                     for k in job.gpus)
    watch.events.append(event)
    return event


def judge(watch: Watcher, nodes: list[Node], event: Event) -> dict[str, Any]:
    """The event's figures (see `zeus_demo.budget.analysis`)."""
    keys = sorted(watch.series.samples)
    power = watch.series.group_power(keys, event.signal_s - 5, event.lift_s + 5, BIN_S)
    before = [p for t, p in power if t <= event.signal_s]
    during = [p for t, p in power if event.signal_s < t <= event.lift_s]
    busy = {k for j in watch.jobs for k in j.gpus}
    presets = {n.name: n.preset for n in nodes}
    perseus = perseus_figures(watch, event) if watch.perseus is not None else None
    idle_w = sum(PRESETS[presets[k[0]]].idle_power_w for k in keys
                 if k not in busy and (watch.perseus is None or k not in watch.perseus.gpus))
    sim_jobs = [an.SimJob(j.tag, j.workload, j.preset, j.gpus, watch.optimum[j.tag])
                for j in watch.jobs]
    group = an.true_group(sim_jobs, event.cap_w, idle_w)
    ratios, idle_measured = measured_ratios(watch, group, keys, busy, event.signal_s)
    measured = an.scaled_group(group, ratios, idle_measured)
    if watch.perseus is None or perseus is None:
        noiseless = an.compare_losses(group, event.applied)
        losses = an.compare_losses(measured, event.applied)
    else:
        noiseless = pipeline_losses(watch.perseus, group, event, perseus)
        losses = pipeline_losses(watch.perseus, measured, event, perseus,
                                 perseus["draw_before_w"])
    losses["draw_ratios"] = {k: round(v, 4) for k, v in sorted(ratios.items())}
    losses["noiseless_judge"] = {k: v for k, v in noiseless.items() if k in NOISELESS_KEYS}
    out: dict[str, Any] = {
        "cap_w": round(event.cap_w, 1),
        "draw_before_w": round(_mean(before), 1),
        "draw_capped_w": round(_mean(during[len(during) // 2:]), 1),
        "capped_bins_sd_w": round(statistics.pstdev(during[len(during) // 2:]), 1)
        if len(during) > 3 else None,
        "seconds_to_cap": an.seconds_to_cap(
            [(t, p) for t, p in power if t <= event.lift_s], event.cap_w, event.signal_s),
        **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in an.first_under(
            [(t, p) for t, p in power if t <= event.lift_s], event.cap_w,
            event.signal_s).items()},
        **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in an.sustained(
            power, event.cap_w, event.signal_s, event.lift_s, bin_s=BIN_S).items()},
        "sustained_window_s": an.SUSTAINED_S,
        "over_cap_joules": round(an.over_cap_joules(power, event.cap_w, event.signal_s,
                                                    event.lift_s, BIN_S), 1),
        "max_over_cap_w": round(max((p - event.cap_w for p in during), default=0.0), 1),
        "seconds_to_restore": an.seconds_to_restore(watch.series, watch.gpu_optimum(),
                                                    event.lift_s),
        "applied_w": event.applied,
        **losses,
    }
    if perseus is not None:
        out["perseus"] = perseus
    out.update(held_back(watch, event, measured, perseus, losses["gap_to_optimal_pct"]))
    out["rounds"] = rounds(watch, event)
    out["limits"] = limit_changes(watch, event)
    if event.kill_s is not None:
        out["kill_s"] = round(event.kill_s - event.signal_s, 2)
        out["killed"] = event.killed
        out["over_cap_joules_during_takeover"] = round(an.over_cap_joules(
            power, event.cap_w, event.kill_s, event.lift_s, BIN_S), 1)
        out["max_over_cap_w_after_kill"] = round(max(
            (p - event.cap_w for t, p in power if event.kill_s < t <= event.lift_s),
            default=0.0), 1)
    return out


NOISELESS_KEYS = ("loss", "uniform_loss", "optimal_loss", "loss_vs_uniform",
                  "optimal_vs_uniform", "gap_to_optimal_pct", "uniform_limit_w",
                  "uniform_true_draw_w", "optimal_true_draw_w", "true_draw_w",
                  "pipeline_optimal_slowdown")
"""The old judge's figures (the simulator's noiseless curves), kept next to the new one's."""
RATIO_WINDOW_S = 5.0
"""The window before the signal in which each job's draw at its optimum is measured (s)."""


def measured_ratios(watch: Watcher, group: Any, keys: list[an.GpuKey], busy: set[an.GpuKey],
                    signal_s: float) -> tuple[dict[str, float], float | None]:
    """Each job's measured over curve draw at its optimum before the signal; idle GPUs' draw.

    The judge on the curves measured in the run (`analysis.draw_ratio`): the `RATIO_WINDOW_S`
    before the signal, every job pinned at its optimum.
    """
    def drawn(gpus: Any) -> float | None:
        bins = watch.series.group_power(list(gpus), signal_s - RATIO_WINDOW_S, signal_s,
                                        RATIO_WINDOW_S)
        return bins[0][1] if bins else None

    by_tag = {j.tag: j for j in watch.jobs}
    ratios = {job.job_id: an.draw_ratio(drawn(by_tag[job.job_id].gpus), an.curve_draw(job))
              for job in group.jobs}
    pipeline = set(watch.perseus.gpus) if watch.perseus is not None else set()
    idle = [k for k in keys if k not in busy and k not in pipeline]
    return ratios, (drawn(idle) if idle else None)


def pipeline_losses(spec: PerseusSpec, group: Any, event: Event,
                    figures: dict[str, Any], draw_w: float | None = None) -> dict[str, Any]:
    """The losses with the Perseus job in the group (`analysis.compare_with_pipeline`).

    Its own: its measured slowdown (`perseus_figures`), else its share's planned one, or (a
    job the budget capped proportionally, no slowdown planned) its chosen plan under that cap
    on the simulator's instructions. `draw_w`: its GPUs' measured draw at its own point
    before the signal (its powers scaled to it: `analysis.scaled`); None: the noiseless ones.
    """
    truth = an.pipeline_truth(an.SimPipeline(spec.tag, PERSEUS_PROFILE, spec.stages, spec.dp,
                                             spec.microbatches, PERSEUS_TIME_SCALE))
    ratio = an.draw_ratio(draw_w, an.curve_draw(truth[0]))
    truth = (an.scaled(truth[0], ratio), an.scaled(truth[1], ratio))
    slowdown = figures["measured_slowdown"]  # (Its iterations, as the agent timed them.)
    if slowdown is None:
        slowdown = figures["planned_slowdown"]
    if slowdown is None:
        stays = truth[1]
        limit = figures["share_limit_w"] or max(o.limit_w for o in stays.options)
        under = [o for o in stays.options if o.limit_w <= limit] or [stays.options[-1]]
        top = stays.options[0]
        slowdown = max(under, key=lambda o: o.limit_w).time_s / top.time_s - 1.0
    return {**an.compare_with_pipeline(group, event.applied, truth, slowdown),
            "perseus_slowdown_judged": round(slowdown, 4), "perseus_draw_ratio": round(ratio, 4)}


def perseus_figures(watch: Watcher, event: Event) -> dict[str, Any]:
    """The Perseus job in the event: its GPUs' draw, its budget shares, its points served.

    Its throughput loss is its measured slowdown: the median iteration time over the
    hold's second half against the median of the `STEPS_BEFORE_S` before the signal (the
    share's planned slowdown where too few were measured), judged with the others' by
    `pipeline_losses`.
    """
    assert watch.perseus is not None
    keys = list(watch.perseus.gpus)
    power = watch.series.group_power(keys, event.signal_s - 5, event.lift_s, BIN_S)
    before = [p for t, p in power if t <= event.signal_s]
    during = [p for t, p in power if event.signal_s < t <= event.lift_s]
    shares = [(t, w, s, e) for t, w, s, e in watch.perseus_shares
              if event.signal_s < t <= event.lift_s]
    own_s = next((t - event.lift_s for t, state, m in watch.perseus_states
                  if t > event.lift_s and state == "serving" and "power budget" not in m), None)
    budget = [m for t, state, m in watch.perseus_states
              if event.signal_s < t <= event.lift_s and "power budget" in m]
    last = shares[-1] if shares else None
    half = (event.signal_s + event.lift_s) / 2
    ran = [t for at, t in watch.perseus_steps if event.signal_s - STEPS_BEFORE_S < at
           <= event.signal_s]
    held = [t for at, t in watch.perseus_steps if half < at <= event.lift_s]
    measured = (statistics.median(held) / statistics.median(ran) - 1.0
                if len(ran) >= MIN_STEPS and len(held) >= MIN_STEPS else None)
    return {
        "gpus": len(keys), "stages": watch.perseus.stages, "pipelines": watch.perseus.dp,
        "draw_before_w": round(_mean(before), 1),
        "draw_capped_w": round(_mean(during[len(during) // 2:]), 1) if during else None,
        "share_limit_w": None if last is None else last[1],
        "planned_slowdown": None if last is None or last[2] is None else round(last[2], 4),
        "measured_slowdown": None if measured is None else round(measured, 4),
        "steps_measured": [len(ran), len(held)],
        "expected_w": None if last is None else last[3],
        "budget_points_served": len(budget),
        "last_budget_status": budget[-1] if budget else None,
        "seconds_to_own_point": None if own_s is None else round(own_s, 2),
        "shares": [(round(t - event.signal_s, 1), w, s) for t, w, s, _ in shares],
        "caps_held": caps_held(watch, keys, event),
        "owners": owners(watch, event),
        "schedule_versions": schedule_versions(watch, event),
        "driver": watch.driver,
    }


def schedule_versions(watch: Watcher, event: Event) -> list[tuple[float, int]]:
    """The Perseus job's schedule versions its statuses named, from 30 s before the signal.

    Its drop-in takes only a version above the one it runs: a version going down (a new
    driver numbering from its own) is one the trainer ignores while its agent applies it.
    """
    out: list[tuple[float, int]] = []
    for t, _, message in watch.perseus_states:
        found = re.search(r"schedule (\d+)", message)
        if (found and event.signal_s - 30 < t <= event.lift_s + 5
                and (not out or out[-1][1] != int(found.group(1)))):
            out.append((round(t - event.signal_s, 1), int(found.group(1))))
    return out


def held_back(watch: Watcher, event: Event, measured: Any, perseus: dict[str, Any] | None,
              gap_pct: Any) -> dict[str, Any]:
    """What the tightener held back when the limits were judged (just before the lift).

    `unused_room_pct`: the cap less the room the owner planned under (its backoff), in
    percent of the cap; `owner_s_at_lift`: how long that owner had been planning;
    `gap_at_room_pct`: the gap against the optimum at that room instead of the cap (the
    allocation's own gap, the backoff's share of `gap_to_optimal_pct` taken out).
    """
    found = an.room_at([(t, r, room) for t, r, room, *_ in watch.rounds], event.lift_s)
    if found is None:
        return {}
    room, owner, since = found
    at_room = replace(measured, cap_w=room)
    gap: Any
    if watch.perseus is None or perseus is None:
        gap = an.compare_losses(at_room, event.applied)["gap_to_optimal_pct"]
    else:
        gap = pipeline_losses(watch.perseus, at_room, event, perseus,
                              perseus["draw_before_w"])["gap_to_optimal_pct"]
    return {"room_at_lift_w": round(room, 1),
            "unused_room_pct": round((event.cap_w - room) / event.cap_w * 100, 2),
            "owner_at_lift": owner, "owner_s_at_lift": round(event.lift_s - since, 1),
            "gap_at_room_pct": gap, "backoff_gap_pct": round(float(gap_pct) - float(gap), 3)}


def rounds(watch: Watcher, event: Event) -> list[list[Any]]:
    """The owner's rounds during the event, how it planned (the takeover's, next to the first's).

    Each: [s from the signal, replica, room W, measured W, expected W, jobs capped without a
    profile].
    """
    return [[round(t - event.signal_s, 1), r, room, measured, expected, unprofiled]
            for t, r, room, measured, expected, unprofiled in watch.rounds
            if event.signal_s < t <= event.lift_s]


def limit_changes(watch: Watcher, event: Event) -> dict[str, list[tuple[float, int]]]:
    """Each job's least limit on its GPUs when it changed, every half second of the event."""
    out: dict[str, list[tuple[float, int]]] = {}
    for job in watch.jobs:
        series = out[job.tag] = []
        t = event.signal_s - 1.0
        while t <= event.lift_s:
            limits = [w for w in (watch.series.limit_at(k, t) for k in job.gpus) if w is not None]
            if limits and (not series or series[-1][1] != min(limits)):
                series.append((round(t - event.signal_s, 1), min(limits)))
            t += BIN_S
    return out


def owners(watch: Watcher, event: Event) -> list[tuple[float, str]]:
    """Who applied the budgets during the event (s from the signal), when it changed."""
    out: list[tuple[float, str]] = []
    for t, replica in watch.owners:
        if event.signal_s < t <= event.lift_s and (not out or out[-1][1] != replica):
            out.append((round(t - event.signal_s, 1), replica))
    return out


def caps_held(watch: Watcher, keys: list[an.GpuKey], event: Event) -> list[tuple[float, int]]:
    """The least limit on the Perseus job's GPUs each second of the hold, when it changed."""
    out: list[tuple[float, int]] = []
    t = event.signal_s
    while t <= event.lift_s:
        limits = [w for w in (watch.series.limit_at(k, t) for k in keys) if w is not None]
        if limits and (not out or out[-1][1] != min(limits)):
            out.append((round(t - event.signal_s, 1), min(limits)))
        t += 1.0
    return out


def timeline(watch: Watcher, event: Event, before_s: float = 10.0) -> dict[str, Any]:
    """The event over time, in seconds from the signal.

    The group's measured power (W, in `BIN_S` bins), and each job's throughput relative to
    its optimum's: from the limit its GPUs ran at and the simulator's step time there
    (`analysis.true_options`).
    """
    keys = sorted(watch.series.samples)
    last = max(rows[-1][0] for rows in watch.series.samples.values())
    power = watch.series.group_power(keys, event.signal_s - before_s, last, BIN_S)
    jobs: dict[str, list[tuple[float, float]]] = {}
    for job in watch.jobs:
        steps = {o.limit_w: o.time_s for o in an.true_options(
            an.SimJob(job.tag, job.workload, job.preset, job.gpus, watch.optimum[job.tag]))}
        best = steps[an.on_grid(watch.optimum[job.tag], steps)]
        series = []
        for t, _ in power:
            limits = [watch.series.limit_at(k, t) for k in job.gpus]
            if all(w is not None for w in limits):
                limit = min(w for w in limits if w is not None)
                series.append((round(t - event.signal_s, 2),
                               round(best / steps[an.on_grid(limit, steps)], 4)))
        jobs[f"{job.tag} {job.workload.removesuffix('+gpu0')}"] = series
    return {"cap_w": round(event.cap_w, 1), "lift_s": round(event.lift_s - event.signal_s, 2),
            "power": [(round(t - event.signal_s, 2), round(p, 1)) for t, p in power],
            "throughput": jobs}


def keep_logs(to: Path, procs: Processes, watch: Watcher | None) -> None:
    """Copy the run's logs to `to`, and the events' bins (`bins.json`), to explain a run.

    Per event, every `BIN_S` from 5 s before the signal to 5 s after the lift (s from the
    signal): the group's power, each job's power and least limit; the owner's rounds; the
    clocks' offset (wall - monotonic s) to place the replicas' log lines.
    """
    to.mkdir(parents=True, exist_ok=True)
    for path in procs.logs_dir.glob("*.log"):
        shutil.copy(path, to / path.name)
    if watch is None:
        return
    keys = sorted(watch.series.samples)
    jobs = {j.tag: list(j.gpus) for j in watch.jobs}
    if watch.perseus is not None:
        jobs[watch.perseus.tag] = list(watch.perseus.gpus)
    events = []
    for ev in watch.events:
        def bins(gpus: list[an.GpuKey], e: Event = ev) -> list[list[float]]:
            return [[round(t - e.signal_s, 2), round(p, 1)] for t, p in
                    watch.series.group_power(gpus, e.signal_s - 5, e.lift_s + 5, BIN_S)]

        limits = {tag: [[round(t - ev.signal_s, 2), min(
            (w for w in (watch.series.limit_at(k, t) for k in gpus) if w is not None),
            default=None)] for t, _ in watch.series.group_power(
                keys, ev.signal_s - 5, ev.lift_s + 5, BIN_S)] for tag, gpus in jobs.items()}
        events.append({"cap_w": ev.cap_w, "kill_s": None if ev.kill_s is None
                       else round(ev.kill_s - ev.signal_s, 2), "killed": ev.killed,
                       "lift_s": round(ev.lift_s - ev.signal_s, 2),
                       "signal_wall": ev.signal_s + time.time() - time.monotonic(),
                       "group": bins(keys), "jobs": {t: bins(g) for t, g in jobs.items()},
                       "limits": limits,
                       "rounds": [[round(t - ev.signal_s, 2), *rest] for t, *rest in watch.rounds
                                  if ev.signal_s - 2 < t <= ev.lift_s + 2]})
    (to / "bins.json").write_text(json.dumps({"job_ids": watch.job_ids, "events": events}))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


async def run_event(config: EventConfig) -> dict[str, Any]:
    """Start everything, pin the jobs, play the event (and the takeover event), judge them."""
    nodes, jobs = plan(config.gpus_per_node, config.counts)
    perseus: PerseusSpec | None = None
    if config.perseus:
        node, perseus = perseus_job(nodes, config.gpus_per_node)
        nodes.append(node)
    with tempfile.TemporaryDirectory(prefix="budget-event-", dir=config.temp_root) as tmp:
        root = Path(tmp)
        server = EmbeddedNats(store_dir=str(root / "js")).start()
        procs = Processes(root)
        replicas = Replicas(server.url, root, ["r1", "r2"],
                            args=["--ownership-lease-s", f"{config.ownership_lease_s:g}",
                                  *(PERSEUS_ARGS if perseus is not None else [])],
                            procs=procs, log_level=config.replica_log_level)
        nc: Any = None
        watch = Watcher(jobs, perseus)
        try:
            replicas.start("r1")
            for n in nodes:
                start_agent(procs, root, server.url, n, config.sample_hz)
            replicas.wait_healthy(60, names=["r1"])
            nc = await connect(server.url, "budget-event")
            samples = subjects.all_gpu_errors().rsplit(".", 1)[0] + ".sample"
            await nc.subscribe(samples, cb=watch.sample)
            await nc.subscribe(subjects.all_job_status(), cb=watch.status)
            await nc.subscribe(subjects.all_budget_status(), cb=watch.budget_status)
            if perseus is not None:
                await nc.subscribe(subjects.all_node_measurements(perseus.gpus[0][0]),
                                   cb=watch.measurement)
            await confirm_subscriptions(nc)
            gpus = sum(n.gpus for n in nodes)
            await wait_for_async(lambda: len(watch.series.samples) >= gpus, 120,
                                 "every GPU sampled", interval_s=0.5)
            if perseus is not None:  # First: it profiles while the others register.
                procs.spawn(f"job-{perseus.tag}", perseus_argv(perseus, str(root), 24 * 3600),
                            cwd=CODE_ROOT)
                await wait_for_async(functools.partial(watch.job_ids.__contains__, perseus.tag),
                                     120, "the Perseus job to be seen", interval_s=0.5)
            for i, job in enumerate(jobs):  # one at a time: 100+ rank processes at once
                start_job(procs, root, job, config.step_s, i)  # starve registrations
                await wait_for_async(functools.partial(watch.job_ids.__contains__, job.tag),
                                     120, f"job {job.tag} to be seen", interval_s=0.5)
            t0 = time.monotonic()
            await wait_for_async(lambda: watch.at_optimum(time.monotonic() - 1.2),
                                 config.pin_timeout_s, "every job pinned at its optimum",
                                 interval_s=0.5)
            pinned_s = time.monotonic() - t0
            replicas.start("r2")  # after the registrations: r1 drives every job
            replicas.wait_healthy(60, names=["r2"])
            await asyncio.sleep(7)  # r2 hears every agent's heartbeat (5 s): it may answer
            played = await grid_event(nc, watch, config, None)
            await watch.note_driver(nc)
            out: dict[str, Any] = {"nodes": len(nodes), "gpus": gpus,
                                   "busy_gpus": sum(len(j.gpus) for j in jobs)
                                   + (len(perseus.gpus) if perseus is not None else 0),
                                   "jobs": len(jobs) + (perseus is not None),
                                   "perseus_jobs": int(perseus is not None),
                                   "seconds_to_pin": round(pinned_s, 1),
                                   "optimum_w": dict(watch.optimum),
                                   "event": judge(watch, nodes, played)}
            if config.timeline:
                out["timeline"] = timeline(watch, played)
            if config.takeover:
                await asyncio.sleep(3)
                second = await grid_event(nc, watch, config, replicas)
                await watch.note_driver(nc)
                out["takeover"] = judge(watch, nodes, second)
            return out
        except Exception:
            replicas.print_logs(1500)
            for name in sorted(set(procs.logs) - set(replicas.names))[:6]:
                print(f"== {name}:\n{procs.text(name)[-1500:]}", file=sys.stderr)
            raise
        finally:
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
            stop(procs, replicas, config.log_dir, watch)
            server.stop()
