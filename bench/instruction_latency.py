"""`instruction_begin` on the trainer -> frequency applied by the agent (docs/benchmarks.md).

The agent (an in-process `AgentServer` on uvloop, as `zeus-agent run` runs it) drives one
simulated GPU whose `lock_sm_clocks_mhz` records `time.monotonic_ns()` when the agent calls it
("call": the agent has received, decoded and checked the datagram against the schedule and
issues the clock change) and when it returns ("done": the simulated device's state file is
rewritten). The trainer is a separate process using `zeus_agent.emit.Publisher`; it stamps
`time.monotonic_ns()` just before each `instruction_begin` call. Both clocks are the host's
CLOCK_MONOTONIC, so the differences are comparable. Each instruction of the installed schedule
changes the frequency, so every one is applied. Two trainer modes between instructions: sleeping
(`time.sleep`) and busy in Python (a spin loop holding the GIL).

Budget: p50 <= 200 us and p99 <= 2 ms in both modes ("call"). Prints a short table, then one
JSON object as the last line.

The trainer's events reach the GPU's doorbell (`zeus_agent.agent.doorbell`), whose thread
applies the change itself: one wake-up (`doorbell_taken` counts the changes it took; the rest
went through the event loop and the setters' thread), or none when the thread is spinning
around the change's forecast instant (the agent's `--doorbell-spin-us`, its default unless
`--doorbell-spin-us` is given here; 0 turns spinning off). `doorbell_spins` windows were spun,
`doorbell_spin_hits` datagrams found spinning, `spun_us_per_change` is the CPU time of a window
and `spun_cpu_share` the share of one core over the whole run. The machine's floor is measured
beside each mode (`bench/wake_floor.py`: the same one hop, a datagram -> a thread *sleeping* in
`recv`, with no agent code, same gap and mode): `floor_*` and `over_floor_*_p50_us` (negative
when spinning beats it). On a small VM whose vCPUs halt while idle the floor is 100-200 us.

The agent issues a schedule's clock *raises* ahead of their instructions (`EarlyRaises`: a lead
before the instruction is forecast to begin); an early change has no latency to measure, so the
two modes above run with raises ahead turned off (every change reacts to its event). A third
run (sleeping trainer, raises ahead on) reports them separately (`early_raises`): how many of
the raises were in before their instruction began, by how much (`lead_us`: the instruction's
stamp minus the change's return), and the latency of the changes left to their events.

Contention (`--contend N`): N CPU-bound processes (pure-Python spin loops, like data loaders
decoding samples) run beside the agent and the busy trainer, and the busy-trainer latency is
measured with the agent at normal priority and at raised priority, alternating for `--rounds`
rounds (fresh contenders each time). Raising the agent's priority needs a privilege
(CAP_SYS_NICE, root, or an RLIMIT_NICE/RLIMIT_RTPRIO allowing it); the methods
(`--raise-method`, repeatable):

* `nice`: every thread of the agent's process at nice -10 (`setpriority` per thread: Linux
  nice values are per thread), as systemd's `Nice=-10`;
* `rr`: every thread of the agent's process in the real-time class SCHED_RR at priority 1,
  as systemd's `CPUSchedulingPolicy=rr` and `CPUSchedulingPriority=1`: a waking real-time
  thread preempts any normal one at once, whatever the normal ones' time slices;
* `others`: the agent stays at nice 0 and the contenders and the trainer run at nice +10: the
  same difference of 10 nice levels as `nice` (the fair scheduler weighs runnable tasks by
  the difference), and it needs no privilege;
* `auto` (default): `nice` and `rr` when permitted, else `others`.

The trainer and the contenders always start in the normal class (a child inherits the
scheduling attributes of the thread that forks it).

The JSON line says which methods ran (`priority_methods`) and gives the latencies of each
(`contended_busy_call`: `normal` and one entry per method).

The simulated GPU charges NVML's costs (`--nvml-timing h200`, the default: a counter read
~3 ms, serialised with setters; setters `--set-latency-ms`, 1 ms), so the agent calls it
through its per-GPU executor as it calls NVML; `--nvml-timing none` is the untimed simulator.

    python bench/instruction_latency.py [--steps 150] [--gap-us 1000] [--contend 2 --rounds 3]
        [--nvml-timing h200|none] [--set-latency-ms 1.0] [--doorbell-spin-us 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from _common import SHM_ROOT, machine, now, pct
from _instruction_priority import (
    OTHERS_NICE,
    RAISE_METHODS,
    child_priority,
    contenders,
    raise_methods,
    set_agent_priority,
)
from wake_floor import WAIT
from wake_floor import measure as measure_floor

from zeus_agent import children
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, InstallScheduleCmd, Reply
from zeus_demo.cluster import wait_for_async

DEFAULT_SPIN_US: float = AgentSettings.model_fields["doorbell_spin_us"].default
BUDGET_P50_US = 200.0
BUDGET_P99_US = 2000.0
NODE = "bench-instr"
FREQS = [1740, 1500, 1200, 900, 1605, 1005, 1305, 705]
PLAN = [("forward" if i % 2 == 0 else "backward", f) for i, f in enumerate(FREQS)]

TRAINER = textwrap.dedent(
    """
    import json, sys, time
    from zeus_agent.emit import Publisher
    from zeus_agent.wire.trainer import TrainerHello
    sock, mode, steps, gap_ns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    names = json.loads(sys.argv[5])
    pub = Publisher(socket_path=sock, gpu_index=0)
    reply = pub.hello(TrainerHello(job_id="bench", rank=0, gpu_index=0))
    assert reply is not None and reply.ok, reply
    """
) + WAIT + textwrap.dedent(
    """
    stamps = []
    for _ in range(steps):
        pub.step_begin()
        for name in names:
            t = time.monotonic_ns()
            pub.instruction_begin(name)
            stamps.append(t)
            wait()
            pub.instruction_end(name)
        pub.step_end()
        wait()
    # Events still in the publisher's backlog (the agent's socket queue was full: a slow
    # agent) are sent before leaving, or the last instructions would never be applied.
    deadline = time.monotonic() + 10
    while pub.stats().queued and time.monotonic() < deadline:
        pub.flush()
        time.sleep(0.001)
    stats = str(pub.stats())
    pub.close()
    print(json.dumps({"stamps": stamps, "stats": stats}), flush=True)
    """
)


class StampedSimGPU(SimGPU):
    """A simulated GPU that records when each clock lock is issued and when it is done."""

    applied: list[tuple[int, int, int]]

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:  # noqa: D102
        t_call = time.monotonic_ns()
        super().lock_sm_clocks_mhz(min_clock_mhz, max_clock_mhz)
        self.applied.append((min_clock_mhz, t_call, time.monotonic_ns()))


def read_per_event(server: AgentServer) -> None:
    """Make the agent read the energy counter once per burst of trainer events, as it did
    before the phase-locked reads (for comparison: `--compare-read-per-event`)."""
    for agent in server.agents.values():
        busy = [False]

        async def read(agent: Any = agent, busy: list[bool] = busy) -> None:
            try:
                await agent.counter.read_once()
            finally:
                busy[0] = False

        def on_event(ev: Any, real: Any = agent.on_event, agent: Any = agent,
                     busy: list[bool] = busy) -> None:
            real(ev)
            if not busy[0]:
                busy[0] = True
                agent._spawn(read())

        agent.on_event = on_event  # type: ignore[method-assign]


def attribute(
    stamps: list[int], expected: list[int], applied: list[tuple[int, int, int]]
) -> tuple[dict[str, list[float]], int]:
    """Each instruction's latency to the first clock change that applies it or a newer one.

    The agent applies the latest clock wanted when its GPU thread is free: a change that waited
    (behind a counter read) may be overtaken by the next instruction's, and is never applied on
    its own. Applied change k is the latest instruction begun before its call whose clock it
    sets; an instruction's latency runs to the first change applying it or a later one. The
    first step is warm-up and left out.

    Returns:
        ({"call": [...], "done": [...]} in us, sorted; how many instructions were overtaken).

    Raises:
        ValueError: A change matches no instruction, or the last instruction was never applied.
    """
    applied_for: list[int] = []
    j = 0
    for freq, t_call, _ in applied:
        while j + 1 < len(stamps) and stamps[j + 1] <= t_call:
            j += 1
        i = j
        while i >= 0 and expected[i] != freq:
            i -= 1
        if i < 0 or (applied_for and i < applied_for[-1]):
            raise ValueError(f"a change to {freq} MHz matches no instruction in order")
        applied_for.append(i)
    if not applied_for or applied_for[-1] != len(stamps) - 1:
        raise ValueError(f"{len(stamps)} instructions, the last never applied")
    call: list[float] = []
    done: list[float] = []
    k = 0
    for i, t in enumerate(stamps):
        while applied_for[k] < i:
            k += 1
        if i >= len(PLAN):
            call.append((applied[k][1] - t) / 1000)
            done.append((applied[k][2] - t) / 1000)
    return {"call": sorted(call), "done": sorted(done)}, len(stamps) - len(set(applied_for))


class Bench:
    """One agent (in this process) and its simulated GPU; trainers run as child processes."""

    def __init__(self, agent: AgentServer, gpu: StampedSimGPU, nc: Any, steps: int, gap_us: int):
        self.agent, self.gpu, self.nc = agent, gpu, nc
        self.steps, self.gap_us = steps, gap_us
        self.runs = 0
        self.overtaken: dict[str, int] = {}

    async def trainer(self, mode: str, nice: int = 0, label: str = "") -> dict[str, list[float]]:
        """Install the schedule, run one trainer process, return its latencies (us)."""
        stamps = await self._run_trainer(mode, nice)
        expected = [f for _, f in PLAN] * self.steps
        try:
            series, overtaken = attribute(stamps, expected, self.gpu.applied)
        except ValueError as e:
            raise RuntimeError(f"{mode}: {e}; {self.agent.agents[0].counters}") from None
        self.overtaken[label or mode] = self.overtaken.get(label or mode, 0) + overtaken
        return series

    async def early(self) -> dict[str, Any]:
        """A sleeping trainer with raises issued ahead: early raises and reactive changes."""
        agent = self.agent.agents[0]
        agent.raises.enabled = True
        issued = agent.raises.issued
        try:
            stamps = await self._run_trainer("sleep", 0)
        finally:
            agent.raises.enabled = False
        expected = [f for _, f in PLAN] * self.steps
        # The last instruction's successor never comes, but its raise may have gone out.
        applied = self.gpu.applied[: len(expected)]
        if [f for f, _, _ in applied] != expected:
            raise RuntimeError(f"early raises: {len(applied)} changes for {len(stamps)} "
                               "instructions, not one each in order")
        leads: list[float] = []
        reactive: list[float] = []
        raises = late = 0
        for i in range(len(PLAN), len(stamps)):
            _, call, done = applied[i]
            if expected[i] > expected[i - 1]:
                raises += 1
                late += done > stamps[i]
                leads.append((stamps[i] - done) / 1000)
            else:
                reactive.append((call - stamps[i]) / 1000)
        leads.sort()
        reactive.sort()
        return {
            "raises": raises,
            "issued_ahead": agent.raises.issued - issued,
            "raises_late": late,
            "lead_us": _summary_low(leads),
            "planned_lead_us": round(agent.raises.ahead.lead_ns / 1000, 1),
            "reactive_call_us": _summary(reactive),
        }

    async def _run_trainer(self, mode: str, nice: int) -> list[int]:
        """Install the schedule, run one trainer process, return its instruction stamps."""
        self.runs += 1
        schedule = FrequencySchedule(rank=0, frequencies=PLAN)
        # One holder per run: the agent refuses a holder whose trainer left the GPU.
        cmd = InstallScheduleCmd(
            job_id="bench", schedule=schedule, holder=f"bench-{mode}-{self.runs}"
        )
        msg = await self.nc.request(
            subjects.gpu_command(NODE, 0), codec.encode(CommandEnvelope(cmd=cmd)), 2
        )
        assert codec.decode(msg.data, Reply).ok
        self.gpu.applied = []
        proc = await children.create_subprocess_exec(
            sys.executable, "-c", TRAINER, self.agent.settings.socket_path, mode,
            str(self.steps), str(self.gap_us * 1000), json.dumps([n for n, _ in PLAN]),
            stdout=asyncio.subprocess.PIPE, preexec_fn=child_priority(nice),
        )  # fmt: skip
        out, _ = await proc.communicate()
        stamps: list[int] = json.loads(out)["stamps"]
        # The trainer has exited: wait until the agent has noticed and restored the GPU,
        # so that the next run's schedule is not cleared by that restore.
        await wait_for_async(lambda: self.agent.agents[0].binding is None, 5, interval_s=0.05,
                             fail=False)
        if len(stamps) != len(PLAN) * self.steps:
            raise RuntimeError(f"{mode}: the trainer ran {len(stamps)} instructions "
                               f"({json.loads(out)['stats']})")
        return stamps

    async def contended(
        self, count: int, rounds: int, methods: list[str]
    ) -> dict[str, dict[str, list[float]]]:
        """Busy-trainer latencies beside `count` contenders, agent at normal and raised priority.

        Args:
            count: CPU-bound processes running beside the agent and the trainer.
            rounds: Alternations of the levels (samples of all rounds pooled).
            methods: Raised levels measured after "normal" each round (`RAISE_METHODS`).
        """
        levels = ["normal", *methods]
        pooled: dict[str, dict[str, list[float]]] = {
            level: {"call": [], "done": []} for level in levels
        }
        for _ in range(rounds):
            for level in levels:
                others = OTHERS_NICE if level == "others" else 0
                set_agent_priority(level)
                try:
                    with contenders(count, others):
                        series = await self.trainer("busy", nice=others)
                finally:
                    set_agent_priority("normal")
                for what, values in series.items():
                    pooled[level][what].extend(values)
        for by_what in pooled.values():
            for values in by_what.values():
                values.sort()
        return pooled


async def run(
    steps: int,
    gap_us: int,
    contend: int = 0,
    rounds: int = 3,
    methods: tuple[str, ...] = (),
    timing: str = "h200",
    set_latency_ms: float = 1.0,
    compare: bool = False,
    spin_us: float | None = None,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[float]]],
           dict[str, dict[str, list[float]]], dict[str, int], dict[str, Any],
           dict[str, list[float]]]:
    """Run the agent here and trainer processes.

    Returns:
        (quiet, contended, read-per-event, overtaken, early, floor) latencies (us):
        read-per-event is empty unless `compare`; overtaken counts the instructions whose change
        was overtaken; early: the run with raises issued ahead (`Bench.early`); floor: the
        machine's (`wake_floor.measure`) just before each quiet mode.
    """
    from zeus_agent.broker import EmbeddedNats, connect

    tmp = Path(tempfile.mkdtemp(prefix="zai-", dir=SHM_ROOT))
    quiet: dict[str, dict[str, list[float]]] = {}
    floor: dict[str, list[float]] = {}
    contended: dict[str, dict[str, list[float]]] = {}
    legacy: dict[str, dict[str, list[float]]] = {}
    async with EmbeddedNats() as server:
        settings = AgentSettings(
            nats_url=server.url,
            backend="sim",
            node=NODE,
            sim_state_dir=str(tmp / "sim"),
            socket_path=str(tmp / "agent.sock"),
            log_level="WARNING",
            sim_nvml_timing=timing,
            sim_set_latency_ms=set_latency_ms,
            **({} if spin_us is None else {"doorbell_spin_us": spin_us}),
        )
        gpu = StampedSimGPU.create(
            settings.sim_state_dir, 0, timing=timing, set_latency_ms=set_latency_ms
        )
        assert isinstance(gpu, StampedSimGPU)
        gpu.applied = []
        agent = AgentServer(settings, gpus=[gpu])
        serve = asyncio.create_task(agent.serve())
        await asyncio.wait_for(agent.started.wait(), 20)
        nc = await connect(server.url, "bench")
        bench = Bench(agent, gpu, nc, steps, gap_us)
        agent.agents[0].raises.enabled = False  # The reactive path: every change on its event.
        doorbell = agent.agents[0].doorbell  # (closed, and forgotten, at shutdown)
        try:
            for mode in ("sleep", "busy"):
                # The machine's own wake-up cost, just before the agent's run it underlies.
                floor[mode] = await measure_floor(mode, steps * len(PLAN), gap_us)
                quiet[mode] = await bench.trainer(mode)
            early = await bench.early()
            if contend:
                contended = await bench.contended(contend, rounds, list(methods))
            if compare:
                read_per_event(agent)
                for mode in ("sleep", "busy"):
                    legacy[mode] = await bench.trainer(mode, label=f"read_per_event_{mode}")
        finally:
            await nc.close()
            agent.handle_exit()
            await serve
            shutil.rmtree(tmp, ignore_errors=True)
    counter = agent.agents[0].counter
    rung = {} if doorbell is None else doorbell.counters
    bench.overtaken["doorbell_datagrams"] = rung.get("datagrams", 0)
    bench.overtaken["doorbell_taken"] = rung.get("taken", 0)
    bench.overtaken["doorbell_spins"] = rung.get("spins", 0)
    bench.overtaken["doorbell_spin_hits"] = rung.get("spin_hits", 0)
    bench.overtaken["doorbell_spun_us"] = 0 if doorbell is None else doorbell.spun_ns // 1000
    bench.overtaken["counter_reads"] = counter.reads
    bench.overtaken["counter_reads_collided"] = counter.policy.collisions
    return quiet, contended, legacy, bench.overtaken, early, floor


def _summary_low(values: list[float]) -> dict[str, float]:
    """Percentiles of a series where low is bad (a lead: p1 is the worst but 1%)."""
    return {
        "min_us": round(values[0], 1),
        "p1_us": round(pct(values, 0.01), 1),
        "p50_us": round(pct(values, 0.5), 1),
    }


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_us": round(pct(values, 0.5), 1),
        "p99_us": round(pct(values, 0.99), 1),
        "max_us": round(values[-1], 1),
    }


def _parser() -> argparse.ArgumentParser:
    """The command line (what each option measures: the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--gap-us", type=int, default=50_000,
        help="trainer time between events (default: %(default)s: a real forward or backward "
        "instruction lasts tens of ms; at 1 ms apart, 1 ms clock changes saturate the GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--compare-read-per-event", action="store_true",
        help="also measure, in the same run, the agent reading the counter once per burst of "
        "trainer events (the design before phase-locked reads)",
    )  # fmt: skip
    parser.add_argument(
        "--contend", type=int, default=0, metavar="N",
        help="also measure the busy trainer beside N CPU-bound processes, with the agent at "
        "normal and at raised priority (default: 0, no contention)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="with --contend: normal/raised alternations, pooled (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--raise-method", action="append", choices=["auto", *RAISE_METHODS],
        help="how the agent's priority is raised, repeatable (default: auto: nice and rr when "
        "permitted, else others; see the module docstring)",
    )  # fmt: skip
    parser.add_argument(
        "--nvml-timing", choices=["h200", "none"], default="h200",
        help="what the simulated GPU's NVML calls cost (default: %(default)s, the recorded "
        "H200; none: the untimed simulator)",
    )  # fmt: skip
    parser.add_argument(
        "--set-latency-ms", type=float, default=1.0,
        help="cost of a clock or power-limit change under h200 (ms; default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--doorbell-spin-us", type=float, default=None,
        help="the agent's --doorbell-spin-us (default: the agent's default, "
        f"{DEFAULT_SPIN_US:g}; 0: its thread never spins)",
    )
    return parser


def _row(label: str, values: list[float]) -> tuple[float, float]:
    """Print a table row of sorted latencies (us); return their p50 and p99."""
    p50, p99 = pct(values, 0.5), pct(values, 0.99)
    print(f"{label:36s} {p50:7.0f} {p99:7.0f} {values[-1]:8.0f}")
    return p50, p99


def _latency_rows(
    results: dict[str, dict[str, list[float]]], legacy: dict[str, dict[str, list[float]]],
    floor: dict[str, list[float]],
) -> tuple[dict[str, float], bool]:
    """Print the quiet runs' rows; return their figures and whether "call" is within budget."""
    out: dict[str, float] = {}
    ok = True
    for mode, series in results.items():
        for what, values in series.items():
            p50, p99 = _row(mode + " trainer, " + what, values)
            out[f"{mode}_{what}_p50_us"] = round(p50, 1)
            out[f"{mode}_{what}_p99_us"] = round(p99, 1)
            if what == "call":
                ok = ok and p50 <= BUDGET_P50_US and p99 <= BUDGET_P99_US
    for mode, series in legacy.items():
        p50, p99 = _row(mode + ", read per event, call", series["call"])
        out[f"read_per_event_{mode}_call_p50_us"] = round(p50, 1)
        out[f"read_per_event_{mode}_call_p99_us"] = round(p99, 1)
    for mode, values in floor.items():
        p50, p99 = _row(mode + " sender, floor (no agent)", values)
        out[f"floor_{mode}_p50_us"] = round(p50, 1)
        out[f"floor_{mode}_p99_us"] = round(p99, 1)
        out[f"over_floor_{mode}_p50_us"] = round(out[f"{mode}_call_p50_us"] - p50, 1)
    return out, ok


def _print_notes(early: dict[str, Any], n: int, gap_us: int) -> None:
    """Print the early raises' line and what the table's columns mean."""
    print(
        f"raises ahead (sleeping trainer): {early['raises_late']} of {early['raises']} raises "
        f"late; lead p1 {early['lead_us']['p1_us']:.0f} us, p50 {early['lead_us']['p50_us']:.0f} "
        f"us (planned {early['planned_lead_us']:.0f} us); the changes left to their events: "
        f"call p50 {early['reactive_call_us']['p50_us']:.0f} us, "
        f"p99 {early['reactive_call_us']['p99_us']:.0f} us"
    )
    print(
        f"(call: agent issues the clock change; done: the simulated GPU's file is rewritten; "
        f"{n} instructions per mode, {gap_us} us apart; floor: bench/wake_floor.py just "
        "before each mode, a bare datagram -> a thread sleeping in recv, no agent code: "
        "what this machine charges for waking a thread after the gap)"
    )


def _doorbell(overtaken: dict[str, int], spin_us: float, total_s: float) -> dict[str, Any]:
    """Print the doorbell's spinning; return its figures (taken out of `overtaken`)."""
    spins, spun_us = overtaken.pop("doorbell_spins"), overtaken.pop("doorbell_spun_us")
    print(f"doorbell spin {spin_us:g} us: {spins} windows, {spun_us / max(1, spins):.0f} us "
          f"spun per window, {100 * spun_us / (total_s * 1e6):.2f}% of a core over the run")
    return {
        "doorbell_datagrams": overtaken.pop("doorbell_datagrams"),
        "doorbell_taken": overtaken.pop("doorbell_taken"),
        "doorbell_spin_us": spin_us,
        "doorbell_spins": spins,
        "doorbell_spin_hits": overtaken.pop("doorbell_spin_hits"),
        "spun_us_per_change": round(spun_us / max(1, spins), 1),
        "spun_cpu_share": round(spun_us / (total_s * 1e6), 4),
    }


def _contention(
    contended: dict[str, dict[str, list[float]]], args: argparse.Namespace, methods: list[str]
) -> dict[str, Any]:
    """Print the contended runs' rows (if any); return their figures per priority level."""
    contention: dict[str, Any] = {}
    if not contended:
        return contention
    print(f"busy trainer beside {args.contend} CPU-bound processes ({args.rounds} rounds), call:")
    for level, series in contended.items():
        values = series["call"]
        _row("  agent, normal priority" if level == "normal" else f"  agent raised: {level}",
             values)
        contention[level] = {
            **_summary(values),
            "done": _summary(series["done"]),
            "instructions": len(values),
        }
    for m in methods:
        print(f"({m}: {RAISE_METHODS[m]})")
    return contention


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = _parser()
    args = parser.parse_args()
    if args.contend < 0 or args.rounds < 1:
        parser.error("--contend must be >= 0 and --rounds >= 1")
    methods = raise_methods(parser, args)
    import uvloop

    load_before = os.getloadavg()
    started = time.monotonic()
    results, contended, legacy, overtaken, early, floor = uvloop.run(
        run(
            args.steps, args.gap_us, args.contend, args.rounds, tuple(methods),
            args.nvml_timing, args.set_latency_ms, args.compare_read_per_event,
            args.doorbell_spin_us,
        )
    )  # fmt: skip
    print(f"{'instruction_begin -> applied (us)':36s} {'p50':>7s} {'p99':>7s} {'max':>8s}")
    out, ok = _latency_rows(results, legacy, floor)
    n = len(results["sleep"]["call"])
    _print_notes(early, n, args.gap_us)
    spin_us = DEFAULT_SPIN_US if args.doorbell_spin_us is None else args.doorbell_spin_us
    doorbell = _doorbell(overtaken, spin_us, time.monotonic() - started)
    contention = _contention(contended, args, methods)
    result = {
        "bench": "instruction_latency",
        "nvml_timing": args.nvml_timing,
        "set_latency_ms": args.set_latency_ms,
        "p50_us": max(out["sleep_call_p50_us"], out["busy_call_p50_us"]),
        "p99_us": max(out["sleep_call_p99_us"], out["busy_call_p99_us"]),
        **out,
        "instructions_per_mode": n,
        "early_raises": early,
        "gap_us": args.gap_us,
        "overtaken": overtaken,
        "counter_reads": overtaken.pop("counter_reads"),
        "counter_reads_collided": overtaken.pop("counter_reads_collided"),
        **doorbell,
        "budget_p50_us": BUDGET_P50_US,
        "budget_p99_us": BUDGET_P99_US,
        "ok": ok,
    }
    if contended:
        result.update(
            contend=args.contend,
            rounds=args.rounds,
            priority_methods={m: RAISE_METHODS[m] for m in methods},
            contended_busy_call=contention,
        )
    # The machine may be shared: its load average (1, 5, 15 min) around the run.
    result.update(
        loadavg_before=[round(x, 2) for x in load_before],
        loadavg_after=[round(x, 2) for x in os.getloadavg()],
        machine=machine(),
        date=now(),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
