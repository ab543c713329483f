"""The chaos soak: two jobs run while a seeded schedule of faults is applied; then the checker.

`python -m zeus_demo.chaos.soak --seconds S --seed N [--classes a,b] [--report FILE]` builds the
net and the cluster (`netns`, `cluster`), moves itself into the observer's namespace, starts a
power-limit job and a Perseus job, applies faults one at a time (each healed, and the NATS
cluster healthy again, before the next), reads the state bucket, runs `checker.check` and
prints the report; its last line is one JSON object (`faults`, `violations`,
`lost_acknowledged`, `takeover_s`, `heal_s`). Exit code 0 iff no violation. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeus_agent.children import sigterm_as_sigint
from zeus_demo.chaos.checker import Histories, check, parse
from zeus_demo.chaos.cluster import AGENTS, REPLICAS, SERVERS, ChaosCluster, tear_tails
from zeus_demo.chaos.netns import Net, enter

__all__ = ["CLASSES", "main", "run"]

CLASSES = ("replica_cut", "agent_isolated", "one_way", "lossy", "slow", "nats_kill",
           "replica_pause", "power_loss")
LEASE_S, OWNERSHIP_S = 6.0, 3.0


class Soak:
    """One run: the cluster, the jobs' progress, the faults applied."""

    def __init__(self, c: ChaosCluster, rng: random.Random) -> None:
        self.c, self.rng = c, rng
        self.progress: dict[str, list[float]] = defaultdict(list)
        self.faults: list[dict[str, Any]] = []

    def start_jobs(self, seconds: float) -> None:
        """The power-limit job on a1's GPUs, the pipeline on a2's.

        A job's ranks run in their node's namespace: a trainer and its agent meet on a Unix
        socket whose peer address is abstract, and abstract addresses belong to a namespace.
        """
        c, root = self.c, self.c.root
        dp = {"placements": [{"node": a, "socket_path": str(c.socket(a)),
                              "sim_state_dir": str(c.sim_dir(a)), "gpu_index": i}
                             for a in ("a1",) for i in range(4)],
              "options": {"workload": "A40+resnet50+gpu0", "steps_per_epoch": 100000,
                          "scale": 0.05, "job_metadata": "chaos-dp", "seed": 0,
                          "power_limit": {"selector": "Energy", "eta_knob": 0.5,
                                          "warmup_steps": 1, "profile_steps": 6,
                                          "pl_step_w": 50}},
              "timeout_s": seconds, "out": str(root / "dp.json")}
        pp = {"nodes": [{"name": a, "socket_path": str(c.socket(a)), "sim_dir": str(c.sim_dir(a)),
                         "gpus": [0, 1, 2, 3]} for a in ("a2",)],
              "options": {"profile": "gpt3-175b+a40", "stages": 4, "microbatches": 4,
                          "seconds": seconds, "time_scale": 0.1, "job_metadata": "chaos-pp",
                          "ipc_timeout_s": seconds, "registration_timeout_s": 30.0},
              "timeout_s": seconds + 60, "out": str(root / "pp.json")}
        for name, kind, spec, node in (("dp", "dp", dp, "a1"), ("pp", "pipeline", pp, "a2")):
            c.spawn(name, node, [sys.executable, "-m", "zeus_demo.chaos.trainer", kind,
                                 json.dumps(spec)], stdout=-1)
            threading.Thread(target=self._follow, args=(name,), daemon=True).start()

    def _follow(self, name: str) -> None:
        out = self.c.procs[name].stdout
        assert out is not None
        for line in out:
            if line.startswith(b"progress "):
                self.progress[f"trainer:{name}"].append(float(line.split()[1]))

    def owner(self) -> str:
        """The replica holding the latest lease (the one worth hurting), else a random one."""
        leases = [x for x in parse(self.c.histories()).leases if x["until"] > time.time()]
        return str(leases[-1]["owner"]) if leases else self.rng.choice(REPLICAS)

    def apply(self, kind: str) -> tuple[float, str]:
        """Start fault `kind`; returns how long to hold it and what it hit."""
        c, net, rng = self.c, self.c.net, self.rng
        if kind == "replica_cut":
            r = self.owner()
            rest = [n for n in (*SERVERS, *REPLICAS, *AGENTS) if n not in (r, "n3")]
            net.cut([r, "n3"], rest)
            return 8.0, f"{r}+n3 | rest"
        if kind == "agent_isolated":
            a = rng.choice(AGENTS)
            net.isolate(a)
            return LEASE_S + 4.0, a
        if kind == "one_way":
            src = rng.choice([self.owner(), *AGENTS])
            for s in SERVERS:
                net.one_way(src, s)
            return 6.0, f"{src} -> servers lost"
        if kind == "lossy":
            node = rng.choice([*SERVERS, *REPLICAS, *AGENTS])
            net.lossy(node, 0.3)
            return 8.0, f"{node} 30% loss"
        if kind == "slow":
            node = rng.choice([*SERVERS, *REPLICAS, *AGENTS])
            net.slow(node)
            return 8.0, f"{node} 256kbit"
        if kind == "replica_pause":
            r = self.owner()
            c.signal(r, signal.SIGSTOP)
            return 2 * OWNERSHIP_S, r
        s = rng.choice(SERVERS)
        t0 = time.time()
        c.signal(s, signal.SIGKILL)
        c.procs[s].wait(10)
        torn = tear_tails(c.store(s), t0 - 1.0, rng) if kind == "power_loss" else []
        return 2.0, f"{s}" + (f" torn {len(torn)} block(s)" if kind == "power_loss" else "")

    def undo(self, kind: str, what: str) -> None:
        """End fault `kind`."""
        if kind == "replica_pause":
            self.c.signal(what, signal.SIGCONT)
        elif kind in ("nats_kill", "power_loss"):
            self.c.start_server(what.split()[0])
        else:
            self.c.net.heal()

    def run_faults(self, seconds: float, classes: list[str]) -> None:
        """Apply faults from a seeded, shuffled cycle of `classes` for about `seconds`.

        The first cycle is always finished, however short `seconds` is: every class is applied
        at least once (one cycle of the short soak's four classes holds them ~26 s, ~34 s with
        the heals: a 30 s soak under load could stop before its last class began).
        """
        end = time.monotonic() + seconds
        queue: list[str] = []
        untried = set(classes)
        while time.monotonic() < end or untried:
            if not queue:
                queue = list(classes)
                self.rng.shuffle(queue)
            kind = queue.pop(0)
            untried.discard(kind)
            start = time.time()
            hold, what = self.apply(kind)
            time.sleep(hold)
            self.undo(kind, what)
            healed = time.time()
            self.c.wait_healthy(60)
            self.faults.append({"kind": kind, "what": what, "start": start, "healed": healed,
                                "healthy": time.time()})
            time.sleep(1.0)


async def read_state(urls: str, buckets: set[str]) -> dict[str, int]:
    """Every key of the state buckets and its revision, as the cluster holds them now."""
    import nats

    from coordinator.state.buckets import bucket_keys

    nc = await nats.connect(servers=urls.split(","), connect_timeout=5)
    try:
        js = nc.jetstream(timeout=10)
        out: dict[str, int] = {}
        for bucket in buckets:
            kv = await js.key_value(bucket)
            for key in await bucket_keys(kv):  # (Not nats-py's keys(): a spurious empty.)
                entry = await kv.get(key)
                out[key] = int(entry.revision or 0)
        return out
    finally:
        await nc.close()


def summarise(soak: Soak, h: Histories, violations: list[Any], end_t: float) -> dict[str, Any]:
    """The report: faults, violations, takeover and heal times."""
    takeovers: list[float] = []
    last_by_job: dict[str, dict[str, Any]] = {}
    for lease in h.leases:
        job, prev = lease["job_id"], last_by_job.get(lease["job_id"])
        if prev is not None and prev["owner"] != lease["owner"] and prev["until"] > 0:
            takeovers.append(lease["t"] - prev["t"])
        last_by_job[job] = lease
    heal: dict[str, list[float]] = defaultdict(list)
    for f in soak.faults:
        moved = [min((t for t in ts if t > f["healed"]), default=end_t)
                 for ts in soak.progress.values()]
        heal[f["kind"]].append(max([f["healthy"], *moved]) - f["healed"])

    def pct(xs: list[float], q: float) -> float | None:
        return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    return {"faults": len(soak.faults), "fault_classes": sorted({f["kind"] for f in soak.faults}),
            "violations": len(violations),
            "lost_acknowledged": sum(v.kind == "lost_ack" for v in violations),
            "violation_kinds": sorted({v.kind for v in violations}),
            "takeovers": len(takeovers), "takeover_s_p50": pct(takeovers, 0.5),
            "takeover_s_p99": pct(takeovers, 0.99),
            "heal_s": {k: round(statistics.median(v), 3) for k, v in heal.items()},
            "commands": len(h.commands), "acks": len(h.acks),
            "jobs_registered": sum(str(a["key"]).startswith("v.job.") for a in h.acks),
            "progress": {k: len(v) for k, v in soak.progress.items()}}


def run(seconds: float, seed: int, classes: list[str],
        say: Callable[[str], None]) -> dict[str, Any]:
    """One soak; returns the report (see `summarise`).

    Stopped by SIGTERM or Ctrl-C, it still removes its namespaces, links and processes.
    """
    tag = uuid.uuid4().hex[:5]
    root = Path(tempfile.mkdtemp(prefix=f"zc{tag}-", dir="/tmp"))
    net = Net(tag)
    c = None
    try:
        with sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
            c = ChaosCluster(net, root, tag, LEASE_S, OWNERSHIP_S)
            enter(net.ns("obs"))
            soak = Soak(c, random.Random(seed))
            for s in SERVERS:
                c.start_server(s)
            c.wait_healthy(60)
            for r in REPLICAS:
                c.start_replica(r)
            for a in AGENTS:
                c.start_agent(a)
            c.wait_agents(60)
            soak.start_jobs(seconds + 120)
            time.sleep(6.0)
            say(f"root {root}; jobs started; faults for {seconds:g} s")
            soak.run_faults(seconds, classes)
            time.sleep(OWNERSHIP_S * 3)  # Every job driven again, every lapsed GPU restored.
            end_t = time.time()
            h = parse(c.histories())
            state = asyncio.run(read_state(c.urls, {str(a["bucket"]) for a in h.acks}))
            jobs: dict[str, list[float]] = {str(x["job_id"]): [] for x in h.leases}
            for x in (*h.leases, *h.acks):
                jobs.setdefault(str(x.get("job_id")), []).append(float(x["t"]))
            progress = {**jobs, **soak.progress}
            violations = check(h, state, progress, [f["healed"] for f in soak.faults], end_t,
                               resume_s=30.0)
            for f in soak.faults:
                say(f"fault {f['kind']:15} {f['what']:32} held {f['healed'] - f['start']:.1f} s")
            for v in violations:
                say(f"VIOLATION {v.kind} at {v.t:.3f}: {v.detail}")
            report = summarise(soak, h, violations, end_t)
            report["root"] = str(root)
            return report
    finally:
        if c is not None:
            c.close()
        net.close()


def main(argv: list[str] | None = None) -> int:
    """Command line: run one soak, print the report, last line JSON."""
    p = argparse.ArgumentParser(prog="python -m zeus_demo.chaos.soak")
    p.add_argument("--seconds", type=float, default=60.0, help="How long faults are applied")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--classes", default=",".join(CLASSES), help="Fault classes, comma-separated")
    args = p.parse_args(argv)
    classes = [k for k in args.classes.split(",") if k]
    unknown = set(classes) - set(CLASSES)
    if unknown:
        p.error(f"unknown fault classes {sorted(unknown)}; known: {', '.join(CLASSES)}")
    try:
        report = run(args.seconds, args.seed, classes, lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print("stopped before the end: namespaces and processes removed", file=sys.stderr)
        return 130
    print(json.dumps(report), flush=True)
    return 0 if report["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
