"""`instruction_begin` on the trainer -> frequency applied by the agent (the README's budget).

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

    python bench/instruction_latency.py [--steps 150] [--gap-us 1000]
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

from _common import machine, now

from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, InstallScheduleCmd, Reply

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
    def wait():
        if mode == "sleep":
            time.sleep(gap_ns / 1e9)
        else:
            end = time.perf_counter_ns() + gap_ns
            x = 0
            while time.perf_counter_ns() < end:
                x += sum(range(50))
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
    print(json.dumps({"stamps": stamps, "stats": str(pub.stats())}), flush=True)
    """
)


class StampedSimGPU(SimGPU):
    """A simulated GPU that records when each clock lock is issued and when it is done."""

    applied: list[tuple[int, int, int]]

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:  # noqa: D102
        t_call = time.monotonic_ns()
        super().lock_sm_clocks_mhz(min_clock_mhz, max_clock_mhz)
        self.applied.append((min_clock_mhz, t_call, time.monotonic_ns()))


def pct(sorted_values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of sorted values."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run(steps: int, gap_us: int) -> dict[str, dict[str, list[float]]]:
    """Run the agent here and one trainer process per mode; return latencies (us)."""
    from zeus_agent.broker import EmbeddedNats, connect

    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = Path(tempfile.mkdtemp(prefix="zai-", dir=root))
    results: dict[str, dict[str, list[float]]] = {}
    async with EmbeddedNats() as server:
        settings = AgentSettings(
            nats_url=server.url,
            backend="sim",
            node=NODE,
            sim_state_dir=str(tmp / "sim"),
            socket_path=str(tmp / "agent.sock"),
            log_level="WARNING",
        )
        gpu = StampedSimGPU.create(settings.sim_state_dir, 0)
        gpu.applied = []
        agent = AgentServer(settings, gpus=[gpu])
        serve = asyncio.create_task(agent.serve())
        await asyncio.wait_for(agent.started.wait(), 20)
        nc = await connect(server.url, "bench")
        try:
            for mode in ("sleep", "busy"):
                schedule = FrequencySchedule(rank=0, frequencies=PLAN)
                # One holder per mode: the agent refuses a holder whose trainer left the GPU.
                cmd = InstallScheduleCmd(job_id="bench", schedule=schedule, holder=f"bench-{mode}")
                msg = await nc.request(
                    subjects.gpu_command(NODE, 0), codec.encode(CommandEnvelope(cmd=cmd)), 2
                )
                assert codec.decode(msg.data, Reply).ok
                gpu.applied = []
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", TRAINER, settings.socket_path, mode, str(steps),
                    str(gap_us * 1000), json.dumps([n for n, _ in PLAN]),
                    stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, _ = await proc.communicate()
                stamps = json.loads(out)["stamps"]
                # The trainer has exited: wait until the agent has noticed and restored the GPU,
                # so that the next mode's schedule is not cleared by that restore.
                for _ in range(100):
                    if agent.agents[0].binding is None:
                        break
                    await asyncio.sleep(0.05)
                applied = gpu.applied
                if len(applied) != len(stamps):
                    raise RuntimeError(
                        f"{mode}: {len(stamps)} instructions, {len(applied)} applied; "
                        f"trainer {json.loads(out)['stats']}; {agent.agents[0].counters}"
                    )
                expected = [f for _, f in PLAN] * steps
                if [f for f, _, _ in applied] != expected:
                    raise RuntimeError(f"{mode}: frequencies applied out of order")
                warm = len(PLAN)  # skip the first step
                results[mode] = {
                    "call": sorted(
                        (c - t) / 1000
                        for t, (_, c, _) in list(zip(stamps, applied, strict=True))[warm:]
                    ),
                    "done": sorted(
                        (d - t) / 1000
                        for t, (_, _, d) in list(zip(stamps, applied, strict=True))[warm:]
                    ),
                }
        finally:
            await nc.close()
            agent.handle_exit()
            await serve
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--gap-us", type=int, default=1000, help="trainer time between events")
    args = parser.parse_args()
    import uvloop

    results = uvloop.run(run(args.steps, args.gap_us))
    print(f"{'instruction_begin -> applied (us)':36s} {'p50':>7s} {'p99':>7s} {'max':>8s}")
    out: dict[str, float] = {}
    ok = True
    for mode, series in results.items():
        for what, values in series.items():
            p50, p99 = pct(values, 0.5), pct(values, 0.99)
            print(f"{mode + ' trainer, ' + what:36s} {p50:7.0f} {p99:7.0f} {values[-1]:8.0f}")
            out[f"{mode}_{what}_p50_us"] = round(p50, 1)
            out[f"{mode}_{what}_p99_us"] = round(p99, 1)
            if what == "call":
                ok = ok and p50 <= BUDGET_P50_US and p99 <= BUDGET_P99_US
    n = len(results["sleep"]["call"])
    print(
        f"(call: agent issues the clock change; done: the simulated GPU's file is rewritten; "
        f"{n} instructions per mode, {args.gap_us} us apart)"
    )
    result = {
        "bench": "instruction_latency",
        "p50_us": max(out["sleep_call_p50_us"], out["busy_call_p50_us"]),
        "p99_us": max(out["sleep_call_p99_us"], out["busy_call_p99_us"]),
        **out,
        "instructions_per_mode": n,
        "budget_p50_us": BUDGET_P50_US,
        "budget_p99_us": BUDGET_P99_US,
        "ok": ok,
        "machine": machine(),
        "date": now(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
