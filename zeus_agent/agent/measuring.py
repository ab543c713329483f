"""`RankMeasurer`: one GPU's trainer events, turned into marks and measurements once reads allow.

The bound rank's events arrive on the loop (`GpuAgent.on_event` acts on them first: clocks).
Here they are measured later, off the clock path:

* `submit(ev, version, hold)`: queue an event; a scheduled rank's events on a GPU whose calls
  block are held `MEASURE_AFTER_CLOCK_S` first, so the setters' thread gets the GIL at once;
* `run()`: forever, measure what is queued: each event is forwarded to the coordinator (the
  rank's event stream) and fed to the rank's `RankMeter`; a step edge's mark and each closed
  step or instruction wait (`unread`) until counter reads bracket them, since on a real GPU a
  read costs milliseconds and is never made for an event;
* `release_measured()`: called when a read comes in (the reader's `on_knot`): emit what reads
  now bracket, in order, under the rank it was measured for;
* `flush()`: publish the pending events (at once, on the rank's subject; in columns,
  `TrainerEventColumns`, when the job's node batches are: `NodeMeasurements.in_columns`) and hand
  the pending marks and measurements to the node's publisher (`batches`,
  `NodeMeasurements.add`), which sends the node's GPUs' together.

It publishes through the agent's `publish(subject, bytes)` and never touches NATS itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeus_agent.agent.core import EnergyRing, LimitHistory, RankMeter
from zeus_agent.agent.core.meter import Gap, Interval
from zeus_agent.agent.counter_reader import CounterReader
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.event_columns import TrainerEventColumns
from zeus_agent.wire.messages import Mark, Measurement, TrainerEvent, TrainerEventBatch
from zeus_agent.wire.trainer import EventDatagram, Kind

__all__ = ["MAX_UNREAD", "MEASURE_AFTER_CLOCK_S", "Binding", "RankMeasurer"]

LOG = logging.getLogger(__name__)
Publish = Callable[[str, bytes], Awaitable[None]]
Emit = Callable[[], Mark | Measurement | None]
if TYPE_CHECKING:
    from zeus_agent.agent.node_batch import NodeMeasurements

MAX_UNREAD = 100_000
"""Marks and measurements held per GPU while no read brackets them (the oldest go first)."""
MEASURE_AFTER_CLOCK_S = 0.002
"""How long the measuring of a scheduled rank's events waits (a GPU whose calls block). The
loop goes idle at once and the GPU's setters' thread gets the GIL for a clock change: measuring
at once (this event or the `instruction_end` just before it) would hold it ~0.4 ms on a 2-core
VM, and the change would wait that long. A measurement goes out ~100 ms later anyway."""

_EVENT_NAMES = {
    Kind.EPOCH_BEGIN: "epoch_begin",
    Kind.EPOCH_END: "epoch_end",
    Kind.STEP_BEGIN: "step_begin",
    Kind.STEP_END: "step_end",
    Kind.INSTRUCTION_BEGIN: "instruction_begin",
    Kind.INSTRUCTION_END: "instruction_end",
}


@dataclass(frozen=True, slots=True)
class Binding:
    """The job rank (and trainer process) whose events this GPU measures.

    `pid` and `uid` are the trainer's as the kernel reported them on the socket (never what a
    payload claims); both None when the coordinator bound the rank (`BindRankCmd`).
    `join_digest`: digest of the join token the trainer's HELLO presented (None: none); sent
    with the rank's events and marks, which the coordinator counts only with the job's.
    """

    job_id: str
    rank: int
    pid: int | None = None
    uid: int | None = None
    join_digest: str | None = None


class RankMeasurer:
    """Measures the bound rank's events of one GPU and publishes what it measured.

    Attributes:
        meter: The bound rank's `RankMeter` (`reset` on a new binding).
        unread: Marks and measurements waiting for a read at or after their time:
            (t_ns, binding, emit).
    """

    def __init__(
        self,
        *,
        index: int,
        node: str,
        prefix: str,
        ring: EnergyRing,
        counter: CounterReader,
        limits: LimitHistory,
        publish: Publish,
        batches: NodeMeasurements,
        binding: Callable[[], Binding | None],
        report: Callable[[str, str, str, dict[str, object]], None],
        refused: Callable[[str, dict[str, str]], None],
        spawn: Callable[[Awaitable[None]], object],
        counters: dict[str, int],
    ) -> None:
        """Create the measurer of GPU `index` (its collaborators are the agent's).

        Args:
            index: The GPU's index (logs).
            node: The node's name (subjects).
            prefix: The subject prefix.
            ring: The GPU's energy series.
            counter: Its counter reader (`covers`, `newest_ns`).
            limits: When the power limit changed (a mark carries the limit at its event).
            publish: `publish(subject, payload)` (trainer events).
            batches: The node's publisher: takes the marks and measurements to publish (`add`),
                says whether to send a job's in columns (`in_columns`).
            binding: The rank bound now (None: none).
            report: The agent's throttled report of a flood-prone kind (gaps).
            refused: Say a closed step or instruction cannot be measured (its counters).
            spawn: Run a side task, keeping a reference until it ends.
            counters: The agent's counters (`unmeasured`, `refused` are counted here).
        """
        self.index = index
        self.node = node
        self.prefix = prefix
        self.ring = ring
        self.counter = counter
        self.limits = limits
        self._publish = publish
        self._batches = batches
        self._binding = binding
        self._report = report
        self._refused = refused
        self._spawn = spawn
        self.counters = counters
        self.meter = RankMeter()
        self.unread: deque[tuple[int, Binding, Emit]] = deque()
        self._queue: asyncio.Queue[tuple[EventDatagram, int | None]] = asyncio.Queue()
        self._held: deque[tuple[EventDatagram, int | None]] = deque()
        """Events held back from measuring, in order (`MEASURE_AFTER_CLOCK_S`)."""
        self._held_timer: asyncio.TimerHandle | None = None
        self._pending_marks: list[Mark] = []
        self._pending_measurements: list[Measurement] = []
        self._pending_events: list[TrainerEvent] = []

    # ------------------------------------------------------------------ queueing
    @property
    def idle(self) -> bool:
        """Whether no event waits to be measured."""
        return self._queue.empty() and not self._held

    def submit(self, ev: EventDatagram, version: int | None, hold: bool = False) -> None:
        """Queue `ev` (run under schedule `version`) for measuring; `hold`: a while later."""
        if hold or self._held:
            self._held.append((ev, version))
            if self._held_timer is None:
                self._held_timer = asyncio.get_running_loop().call_later(
                    MEASURE_AFTER_CLOCK_S, self.release_held)
        else:
            self._queue.put_nowait((ev, version))

    def release_held(self) -> None:
        """Hand the events held back (`MEASURE_AFTER_CLOCK_S`) to the measuring, in order."""
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        while self._held:
            self._queue.put_nowait(self._held.popleft())

    def reset(self) -> None:
        """A new rank is bound (or none): its steps start from nothing."""
        self.meter = RankMeter()

    async def run(self) -> None:
        """Forever: measure the queued events and publish what reads already bracket."""
        while True:
            ev, version = await self._queue.get()
            try:
                self.measure(ev, version)
                while not self._queue.empty():
                    self.measure(*self._queue.get_nowait())
                self.release_measured(flush=False)
                await self.flush()
            except Exception:  # noqa: BLE001 - one bad event never stops the measuring
                LOG.exception("GPU %d: measuring trainer events failed; continuing", self.index)

    # ------------------------------------------------------------------ measuring
    def energy_at(self, t_ns: int) -> float | None:
        """The counter's energy at `t_ns` (J), None where no reads cover it."""
        self.counter.newest_ns()  # (takes the reader thread's knots into the ring)
        try:
            return self.ring.energy_at(t_ns)
        except ValueError:
            return None

    def _when_read(self, t_ns: int, emit: Emit) -> None:
        """Call `emit` (it makes a mark or a measurement) once a read at or after `t_ns` is in."""
        binding = self._binding()
        assert binding is not None
        self.unread.append((t_ns, binding, emit))
        if len(self.unread) > MAX_UNREAD:
            self.unread.popleft()  # The counter is not being read: measure what comes next.
            self.counters["unmeasured"] = self.counters.get("unmeasured", 0) + 1

    def release_measured(self, flush: bool = True) -> None:
        """Emit the marks and measurements that reads now bracket, in their order.

        Those of a rank unbound meanwhile (its trainer said goodbye right after its last step)
        go out under that rank.
        """
        released = False
        bound = self._binding()
        gone: dict[int, tuple[Binding, list[Mark], list[Measurement]]] = {}
        while self.unread and self.counter.covers(self.unread[0][0]):
            if not self.unread:
                break  # `covers` took the reader's knots and released them (`on_knot`).
            _, binding, emit = self.unread.popleft()
            item = emit()
            if item is None:
                continue
            if binding is bound:
                marks, measurements = self._pending_marks, self._pending_measurements
                released = True
            else:
                _, marks, measurements = gone.setdefault(id(binding), (binding, [], []))
            if isinstance(item, Mark):
                marks.append(item)
            else:
                measurements.append(item)
        for binding, marks, measurements in gone.values():
            self._hand_over(binding, marks, measurements)
        if released and flush:
            self._spawn(self.flush())

    def measure(self, ev: EventDatagram, version: int | None = None) -> None:
        """Forward `ev` to the coordinator and feed it to the rank's meter."""
        kind = ev.kind
        name = _EVENT_NAMES[kind]
        if kind in (Kind.STEP_BEGIN, Kind.STEP_END):
            epoch, step, index = ev.b, ev.a, 0
        elif kind in (Kind.EPOCH_BEGIN, Kind.EPOCH_END):
            epoch, step, index = ev.a, 0, 0
        else:
            ctx = self.meter.current_step
            epoch, step, index = (ctx[0] if ctx else 0), ev.b, ev.a
        counted = kind in (Kind.STEP_BEGIN, Kind.STEP_END, Kind.EPOCH_BEGIN, Kind.EPOCH_END)
        limit = self.limits.at(ev.t_ns) if counted else None
        try:
            self._pending_events.append(
                TrainerEvent(kind=name, t_ns=ev.t_ns, epoch=epoch, step=step, index=index,
                             name=ev.name, power_limit_w=limit)
            )
        except ValueError as e:  # Counters the contract refuses (e.g. step 2**63).
            # Neither forwarded nor measured (its marks would carry the same counters).
            self._refuse(f"a {name} of step {step}", e, {"step": str(step), "index": str(index)})
            return
        if self._binding() is None:
            return
        if counted:
            self._when_read(ev.t_ns, functools.partial(self._mark, name, epoch, step, ev.t_ns,
                                                       limit))  # fmt: skip
        if kind is Kind.STEP_BEGIN:
            records = self.meter.step_begin(ev.a, ev.b, ev.t_ns)
        elif kind is Kind.STEP_END:
            records = self.meter.step_end(ev.a, ev.b, ev.t_ns)
        elif kind is Kind.EPOCH_BEGIN:
            records = self.meter.epoch_begin(ev.a, ev.t_ns)
        elif kind is Kind.EPOCH_END:
            records = self.meter.epoch_end(ev.a, ev.t_ns)
        elif kind is Kind.INSTRUCTION_BEGIN:
            records = self.meter.instruction_begin(ev.name, ev.a, ev.t_ns)
        else:
            records = self.meter.instruction_end(ev.name, ev.a, ev.t_ns)
        for rec in records:
            if isinstance(rec, Gap):
                self._report("gaps", f"gap_{rec.reason}", rec.message, {})
            elif isinstance(rec, Interval) and rec.kind in ("step", "instruction"):
                self._when_read(rec.t1_ns, functools.partial(self._measurement, rec, version))

    def _mark(self, kind: str, epoch: int, step: int, t_ns: int, limit: int | None) -> Mark | None:
        energy = self.energy_at(t_ns)
        if energy is None:
            return None
        return Mark(kind=kind, epoch=epoch, step=step, t_ns=t_ns, energy_j=energy,
                    power_limit_w=limit)  # fmt: skip

    def _measurement(self, rec: Interval, version: int | None) -> Measurement | None:
        """Measure a closed step or instruction (reads bracket both of its edges)."""
        try:
            energy_j = self.ring.energy_between(rec.t0_ns, rec.t1_ns)
        except ValueError:  # No reads cover it (it began before the oldest kept).
            return None
        try:
            return Measurement(
                kind=rec.kind,
                name=rec.name or "",
                epoch=rec.epoch or 0,
                step=rec.step or 0,
                index=rec.index or 0,
                t0_ns=rec.t0_ns,
                t1_ns=rec.t1_ns,
                time_s=rec.duration_s,
                energy_j=max(0.0, energy_j),  # A counter never runs backwards.
                schedule=version,
            )
        except ValueError as e:  # Counters no real trainer sends (e.g. step 2**63).
            self._refuse(f"a {rec.kind} of step {rec.step}", e,
                         {"step": str(rec.step), "index": str(rec.index)})
            return None

    def _refuse(self, what: str, error: ValueError, detail: dict[str, str]) -> None:
        """Count an event or measurement the contract refuses; tell the coordinator (throttled)."""
        self.counters["refused"] += 1
        if self.counters["refused"] == 1 or self.counters["refused"] % 1000 == 0:
            why = "; ".join(err["msg"] for err in getattr(error, "errors", list)())
            self._refused(f"{what} cannot be measured: {why[:300] or error}; fix the trainer's "
                          "counters", detail)

    def forward(self, event: TrainerEvent) -> None:
        """Forward an event that measures nothing (rank 0's `selection`) with the next flush."""
        self._pending_events.append(event)

    # ------------------------------------------------------------------ publishing
    async def flush(self) -> None:
        """Forward pending trainer events; hand pending marks/measurements to the node's."""
        b = self._binding()
        events, self._pending_events = self._pending_events, []
        marks, self._pending_marks = self._pending_marks, []
        meas, self._pending_measurements = self._pending_measurements, []
        if b is None:
            return
        self._hand_over(b, marks, meas)  # (Before any await: a flush meanwhile hands later ones.)
        if events:
            batch: TrainerEventBatch | TrainerEventColumns
            if self._batches.in_columns(b.job_id):
                batch = TrainerEventColumns.from_events(
                    job_id=b.job_id, rank=b.rank, node=self.node, gpu=self.index,
                    join_digest=b.join_digest, events=events)
            else:
                batch = TrainerEventBatch(job_id=b.job_id, rank=b.rank, node=self.node,
                                          gpu=self.index, events=events,
                                          join_digest=b.join_digest)
            await self._publish(
                subjects.job_events(b.job_id, b.rank, self.node, self.prefix), codec.encode(batch)
            )

    def _hand_over(self, b: Binding, marks: list[Mark], meas: list[Measurement]) -> None:
        """Hand marks and measurements of the rank bound as `b` to the node's publisher."""
        if marks or meas:
            self._batches.add(self.index, b.job_id, b.rank, b.join_digest, marks, meas)
