"""Cost of one `zeus_agent.emit` event call on the caller's thread.

Budget (the design's): with the agent up, the p50 at most 1 us above a bare `socket.send` of
the same datagram measured in the same run (that send, which wakes the sleeping agent, is the
floor emit cannot go under: ~3 us on a quiet 2-core VM); with no agent, p50 <= 2 us.

Times `emit.step_begin()` (the module-level call a training loop makes) with
`time.perf_counter_ns()` around each call, after a warm-up:

* agent up: a receiver subprocess drains a bound datagram socket (or `--socket PATH` points at
  a running agent), calls paced `--gap-us` apart as in a training loop (the receiver sleeps in
  `recv` between events, so each send also pays the kernel's wake-up of the receiver);
* agent up, back to back: no pacing (the receiver's 10-deep queue overflows; the backlog path);
* agent absent: nothing at the socket (events dropped and counted).

Per pipeline action: a stage's compute call wrapped by
`zeus_agent.integrations.instrument_pipeline` (two events, `instruction_begin` and
`instruction_end`, and the action's name), against the same call bare, alternately, agent up.

Also reports the bare `socket.send` of the same datagram (kernel cost, no emit code; timed
alternately with emit's paced calls, so both see the same machine) and the timer's own
overhead, both included in nothing else. The last line is one JSON object.

Usage: python bench/emit_overhead.py [--calls 200000] [--gap-us 20] [--socket PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from _common import machine, now

from zeus_agent import children, emit
from zeus_agent.wire.trainer import Kind, encode_event

RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
print("ready", flush=True)
recv = s.recv
while True:
    recv(70000)
"""

BUDGET_P50_NS = 2000
"""p50 with no agent."""
BUDGET_ABOVE_SEND_NS = 1000
"""p50 with the agent up, above the bare send's p50 in the same run."""


def measure(call: Callable[[], None], calls: int, warmup: int, gap_ns: int) -> list[int]:
    pc = time.perf_counter_ns
    for _ in range(warmup):
        call()
    samples = [timed(call, gap_ns, pc) for _ in range(calls)]
    samples.sort()
    return samples


def timed(call: Callable[[], None], gap_ns: int, pc: Callable[[], int]) -> int:
    """ns one `call` takes, after spinning `gap_ns` (the pause of a training loop)."""
    if gap_ns:
        until = pc() + gap_ns
        while pc() < until:
            pass
    t0 = pc()
    call()
    return pc() - t0


def measure_pair(
    first: Callable[[], None], second: Callable[[], None], calls: int, warmup: int, gap_ns: int
) -> tuple[list[int], list[int]]:
    """Time `first` and `second` alternately (in alternating order), each after a `gap_ns`
    pause: the two see the same machine (a VM's wake-up cost drifts by 2-3x between runs, and
    would swamp the difference)."""
    for _ in range(warmup):
        first()
        second()
    pc = time.perf_counter_ns
    a, b = [0] * calls, [0] * calls
    orders = (((first, a), (second, b)), ((second, b), (first, a)))
    for i in range(calls):
        for call, samples in orders[i & 1]:  # A B, B A, ...: neither always follows the other
            samples[i] = timed(call, gap_ns, pc)
    a.sort()
    b.sort()
    return a, b


class _Stage:
    """A `torch.distributed.pipelining` stage's compute entry point, doing nothing."""

    stage_index = 3

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[()] = ()) -> None:
        return None

    def backward_one_chunk(self, bwd_chunk_id: int) -> None:
        return None

    def backward_weight_one_chunk(self, bwd_chunk_id: int) -> None:
        return None


class _Schedule:
    def __init__(self) -> None:
        self._stage = _Stage()

    def step(self) -> None:
        return None


def measure_action(calls: int, warmup: int, gap_ns: int) -> tuple[list[int], list[int]]:
    """Time a stage's compute call bare and instrumented (`instrument(schedule)`: an
    `instruction_begin`/`instruction_end` pair named `forward:3:17`), alternately, inside one
    reported step."""
    from zeus_agent.integrations import instrument_pipeline

    bare_stage = _Stage()
    schedule = _Schedule()
    handle = instrument_pipeline(schedule)
    wrapped_stage = schedule._stage
    box: list[tuple[list[int], list[int]]] = []
    handle.gate.run_step(True, lambda: box.append(measure_pair(
        lambda: bare_stage.forward_one_chunk(17), lambda: wrapped_stage.forward_one_chunk(17),
        calls, warmup, gap_ns)))
    handle.remove()
    return box[0]


def pct(samples: list[int], q: float) -> int:
    return samples[min(len(samples) - 1, int(len(samples) * q))]


Rows = list[tuple[str, list[int], str]]
"""Table rows: (name, sorted samples in ns, note)."""


def measure_agent_up(path: str, calls: int, warmup: int, gap_ns: int) -> Rows:
    """The timer alone, then the rows with something draining the agent's socket `path`."""
    rows: Rows = [("timer only (no call)", measure(lambda: None, calls, 1000, 0), "")]

    # Bare kernel send of the same datagram, paced.
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.setblocking(False)
    raw.bind("")
    raw.connect(path)
    data = encode_event(int(Kind.STEP_BEGIN), os.getpid(), time.monotonic_ns(), 1, 0, "")

    def raw_send() -> None:
        with contextlib.suppress(BlockingIOError):
            raw.send(data)

    # The bare send and emit alternate, paced: the budget is their difference.
    emit.init(socket_path=path)
    sent, up = measure_pair(raw_send, emit.step_begin, calls, warmup, gap_ns)
    s = emit.stats()
    rows.append(("socket.send only, paced", sent, "alternating with the next row"))
    rows.append(("emit, agent up, paced", up, f"dropped {s.dropped}/{s.events}"))
    emit.close()
    raw.close()

    emit.init(socket_path=path)
    b2b = measure(emit.step_begin, calls, warmup, 0)
    s = emit.stats()
    rows.append(("emit, agent up, back to back", b2b, f"dropped {s.dropped}/{s.events}"))
    emit.close()

    emit.init(socket_path=path)
    bare, wrapped = measure_action(calls // 4, warmup // 4, gap_ns)
    s = emit.stats()
    rows.append(("pipeline action, bare call", bare, "alternating with the next row"))
    rows.append(("pipeline action, instrumented", wrapped,
                 f"begin+end emitted; dropped {s.dropped}/{s.events}"))
    emit.close()
    return rows


def result_line(rows: Rows, calls: int) -> dict[str, object]:
    """The JSON line's figures, from the rows in the order `main` makes them."""
    timer, sent, up, b2b, bare, wrapped, absent = (samples for _, samples, _ in rows)
    p50_up, p50_absent, p50_send = pct(up, 0.5), pct(absent, 0.5), pct(sent, 0.5)
    return {
        "bench": "emit_overhead",
        "p50_ns_agent_up": p50_up,
        "p99_ns_agent_up": pct(up, 0.99),
        "p50_ns_agent_absent": p50_absent,
        "p99_ns_agent_absent": pct(absent, 0.99),
        "p50_ns_agent_up_back_to_back": pct(b2b, 0.5),
        "p50_ns_raw_send_agent_up": p50_send,
        "p50_ns_agent_up_above_send": p50_up - p50_send,
        "p50_ns_timer": pct(timer, 0.5),
        "p50_ns_per_action_bare": pct(bare, 0.5),
        "p50_ns_per_action_instrumented": pct(wrapped, 0.5),
        "p99_ns_per_action_instrumented": pct(wrapped, 0.99),
        "p50_ns_per_action_overhead": pct(wrapped, 0.5) - pct(bare, 0.5),
        "calls": calls,
        "budget_p50_ns_agent_absent": BUDGET_P50_NS,
        "budget_p50_ns_above_send": BUDGET_ABOVE_SEND_NS,
        "ok": p50_up - p50_send <= BUDGET_ABOVE_SEND_NS and p50_absent <= BUDGET_P50_NS,
        "machine": machine(),
        "date": now(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--warmup", type=int, default=20_000)
    parser.add_argument("--gap-us", type=float, default=20.0, help="pause between paced calls")
    parser.add_argument("--socket", default=None, help="a running agent's socket (no receiver)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # The absent case warns by design.
    gap_ns = int(args.gap_us * 1000)

    tmp = tempfile.mkdtemp(prefix="emit-bench-")
    receiver = None
    path = args.socket
    if path is None:
        path = os.path.join(tmp, "agent.sock")
        receiver = children.popen(
            [sys.executable, "-c", RECEIVER, path], stdout=subprocess.PIPE, text=True
        )
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
    try:
        rows = measure_agent_up(path, args.calls, args.warmup, gap_ns)
    finally:
        if receiver is not None:
            receiver.kill()
            receiver.wait()

    emit.init(socket_path=os.path.join(tmp, "absent.sock"))
    absent = measure(emit.step_begin, args.calls, args.warmup, gap_ns)
    s = emit.stats()
    rows.append(("emit, agent absent, paced", absent, f"dropped {s.dropped}/{s.events}"))
    emit.close()

    print(f"{'ns per call':34s} {'p50':>7s} {'p99':>8s} {'max':>9s}  note")
    for name, samples, note in rows:
        print(f"{name:34s} {pct(samples, 0.5):7d} {pct(samples, 0.99):8d} {samples[-1]:9d}  {note}")
    print(f"(paced: {args.gap_us} us between calls; receiver: {args.socket or 'subprocess'})")
    print(json.dumps(result_line(rows, args.calls)))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
