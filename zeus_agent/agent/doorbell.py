"""`ClockDoorbell`: a trainer's `instruction_begin` reaches its GPU's clock in one wake-up.

Through the trainers' socket, a clock change costs two wake-ups: the datagram wakes the event
loop, and the loop wakes the GPU's setters' thread. On a host whose idle CPUs halt (any VM,
or bare metal in a deep C-state) each costs 100-200 us (`bench/wake_floor.py`), so the pair
alone is over the 200 us budget of `instruction_begin` -> clock lock call.

So each GPU whose calls block (NVML) has a socket of its own beside the trainers' one,
`<socket>.gpu<index>`, read by a thread that sleeps in `recvmsg`. The HELLO reply names it
(`doorbell`), and the bound trainer then sends its events (and its goodbye) there instead:
one socket, so their order is kept. The thread hands everything it reads to the gateway on the
loop, in order (`Gateway.received_all`, which checks, attributes and handles them exactly as
datagrams of the trainers' socket); it only looks first for one thing.

The loop, having handled instruction k, *arms* the doorbell for instruction k + 1: the bound
trainer's pid, the instruction's index, name and clock. When the `instruction_begin` of k + 1
arrives from that pid (the kernel's credentials, never the payload's), the thread takes the
arm, hands the batch to the loop and applies the clock itself through the GPU's `ClockLane`
(`ring`), with every guarantee of the lane: coalescing, the epoch check (a restore, clear or
new schedule drops it), the lease check just before the call, restores never overtaken
(`ClockLane.exclusive`). The loop wakes while the call runs, with the GIL released.

Exactly one of the two applies a change: the arm is taken under a lock, by the thread or by
the loop (`claim`, when the event reached it first: no arm yet because the loop was behind).
The handshake (arm, take, accept, claim: which side applies, and the loop's veto of a change
taken but not yet accepted) is one state machine, `zeus_agent.agent.doorbell_handshake`: its
phases, transition table and invariants are written there; `ClockDoorbell` runs each of its
transitions under its lock.

A thread asleep in `recvmsg` still pays one wake-up (100-400 us on a VM, all of the budget).
So an arm carries the forecast of its instruction's begin (the last iterations' gaps, the
`RaiseAhead` forecast) and, from `spin_ns` before it to 2 x `spin_ns` after it, the reading
thread *spins*: it polls the socket without sleeping, so it holds its CPU awake and finds the
datagram within microseconds. Outside those windows it sleeps, so the cost is bounded: at most
3 x `spin_ns` of one core per scheduled instruction, and only for an instruction forecast at
least ten windows away, so at most a tenth of a core per GPU (`spin_ns` 0 turns it off). One
thread of the process spins at a time (`_SPIN_TOKEN`): spinning threads fight for the GIL. A
spinning thread holds the GIL most of its window, so the loop and the other GPUs' doorbell
threads may wait for it until the window ends (at most 1.5 ms at the default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import select
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgpack

from zeus_agent.agent.clock_lane import ClockLane
from zeus_agent.agent.credentials import (
    ANCILLARY_BYTES,
    RECV_BYTES,
    Received,
    pass_credentials,
    sender,
)
from zeus_agent.agent.doorbell_handshake import Arm, Handshake, Phase
from zeus_agent.wire.trainer import PROTOCOL_VERSION, Kind

__all__ = ["ClockDoorbell", "doorbell_path"]

LOG = logging.getLogger(__name__)

_INSTRUCTION_BEGIN = int(Kind.INSTRUCTION_BEGIN)
_MAX_PER_WAKEUP = 256
"""Datagrams read per wake-up and handed to the loop at once."""
HOLD_NS = 1_000_000
"""While armed, how long a batch without the armed instruction waits for it (`_read...`)."""
SPIN_LATE = 2
"""The spin goes on this many `spin_ns` past the forecast: a forecast is the shortest of the
last gaps, so the instruction comes later more often than earlier (a sleeping trainer's gaps
vary by a few hundred microseconds on a VM)."""
SPIN_AHEAD_NS = 60_000_000_000
"""A forecast further away than this is not spun for (a trainer's stamp is not checked)."""
SPIN_SHARE_INVERSE = 10
"""A change is spun for only if it is forecast at least this many windows away: the thread
spins at most a tenth of the time (instructions shorter than 15 ms at the default 500 us pay
the wake-up instead)."""
_SPIN_TOKEN = threading.Lock()
"""Held by the one doorbell thread of this process that spins (`ClockDoorbell._spin`)."""


def doorbell_path(socket_path: str, index: int) -> str:
    """Where GPU `index`'s doorbell is bound, beside the trainers' socket `socket_path`."""
    return f"{socket_path}.gpu{index}"


class ClockDoorbell:
    """One GPU's doorbell socket and the thread that answers it.

    Attributes:
        path: The socket's path.
        counters: `datagrams` (read), `taken` (armed changes the threads took: applied, found
            in already (a raise issued ahead) or `stale` (the loop asked for a newer change
            before it was applied)), `claimed` (by the loop: its event came first), `spins`
            (windows spun in), `spin_hits` (armed changes taken from a batch a spin found).
        spin_ns: How long before and after an armed instruction's forecast begin the reading
            thread spins (0: never).
        spun_ns: Time spent spinning so far (about the CPU time of one core: it includes any
            wait for the GIL).
    """

    def __init__(self, path: str, lane: ClockLane, index: int, spin_ns: int = 0) -> None:
        """Create it for `lane`; nothing is bound until `open`."""
        self.path = path
        self.index = index
        self.spin_ns = spin_ns
        self.spun_ns = 0
        self.counters: Counter[str] = Counter()
        self._lane = lane
        self._sock: socket.socket | None = None
        self._deliver: Callable[[list[Received]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._reading = threading.Lock()
        """Held by the thread that reads and delivers: one at a time, so batches stay in
        order; released while the holder applies a change, so the other reads meanwhile."""
        self._closed = False
        self._inode = -1
        self._take = threading.Lock()
        """Held around each transition of `_handshake` (the loop's and the threads')."""
        self._handshake = Handshake()
        """Which side applies an armed change (`zeus_agent.agent.doorbell_handshake`)."""
        self._handover: list[Received] = []
        """The batch that held a change taken, for the next reader to deliver first."""
        self._wake = -1
        """An eventfd: `arm` wakes the reading thread with it to start its spin on time."""
        self._delivering = False
        """True on the loop while it handles a batch this doorbell read (`_hand`): an arm made
        then follows an event that came this way, so the trainer uses its doorbell."""
        self._spun_for: Arm | None = None
        """The arm whose window the last spin was in (`spins` counts windows, not spins)."""
        self._found_spinning = False
        """Whether the last datagram `_first` returned was found by a spin."""

    @property
    def _arm(self) -> Arm | None:
        """The armed change, read without the lock (as the reading threads do)."""
        return self._handshake.arm

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def opened(cls, path: str, lane: ClockLane, index: int,
               deliver: Callable[[list[Received]], None], mode: int,
               gid: int | None = None, spin_ns: int = 0) -> ClockDoorbell | None:
        """A doorbell open at `path` (`open`), or None (logged): the GPU goes without one."""
        doorbell = cls(path, lane, index, spin_ns)
        try:
            doorbell.open(deliver, mode, gid)
        except OSError as e:
            LOG.warning("GPU %d: no doorbell at %s (%s): its clock changes go through the "
                        "event loop, one wake-up slower", index, path, e)
            return None
        lane.use_loop(asyncio.get_running_loop())
        return doorbell

    def open(self, deliver: Callable[[list[Received]], None], mode: int,
             gid: int | None = None) -> None:
        """Bind the socket (mode and group as the trainers' socket) and start the thread.

        On the loop; `deliver` is called there with each batch read (`Gateway.received_all`).

        Raises:
            OSError: The path cannot be bound (something that is not a socket is in the way,
                or the path is too long).
        """
        _make_way(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024 * 1024)
            pass_credentials(sock)
            sock.bind(self.path)
            self._inode = os.stat(self.path).st_ino
            os.chmod(self.path, mode)
            if gid is not None:
                os.chown(self.path, -1, gid)
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._deliver = self._hand(deliver)
        self._loop = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=self._serve, name=f"gpu{self.index}-doorbell-{n}",
                                          daemon=True) for n in (1, 2)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Wake the threads to end (a blocked `recvmsg` returns at once). Idempotent.

        Nothing is delivered from now on.
        """
        self._closed = True
        self.forget()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RD)

    def close(self, timeout_s: float = 1.0) -> None:
        """`stop`, wait for the threads, close and remove the socket. Idempotent.

        A change being applied may hold a thread: the wait is bounded by `timeout_s`.
        """
        self.stop()
        sock, self._sock = self._sock, None
        if sock is None:
            return
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        sock.close()
        # A thread still in a hung lock call may yet wait on it: then it is left open (one
        # descriptor, at a shutdown that already timed out).
        if not any(thread.is_alive() for thread in self._threads):
            with contextlib.suppress(OSError):
                os.close(self._wake)
            self._wake = -1  # (`arm` must not write to a number the process reuses)
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:  # not a newer agent's
                os.unlink(self.path)

    # ------------------------------------------------------------------ the loop's side
    def arm(self, pid: int, index: int, name: str, mhz: int, due_ns: int | None = None) -> None:
        """On the loop: the next ring for instruction `index` (`name`) of `pid` locks `mhz`.

        `due_ns`: when the instruction is forecast to begin (monotonic ns); the reading thread
        spins around it (`spin_ns`), woken now to sleep until then: only if the forecast is
        ten windows to `SPIN_AHEAD_NS` away, and only while the loop handles an event this
        doorbell read (a trainer that sends its events elsewhere is never spun for).
        """
        spin = None
        window = (1 + SPIN_LATE) * self.spin_ns
        if self.spin_ns > 0 and due_ns is not None and self._delivering:
            away = due_ns - time.monotonic_ns()
            if SPIN_SHARE_INVERSE * window <= away <= SPIN_AHEAD_NS:
                spin = (due_ns - self.spin_ns, due_ns + SPIN_LATE * self.spin_ns)
        with self._take:
            self._handshake.set_arm(
                Arm(pid, index, name, mhz, self._lane.epoch, self._lane.asked, spin))
        if spin is not None:
            with contextlib.suppress(OSError):  # (closed: nobody to wake)
                os.eventfd_write(self._wake, 1)

    def disarm(self) -> None:
        """On the loop: the next instruction's ring applies nothing."""
        with self._take:
            self._handshake.set_arm(None)

    def forget(self) -> None:
        """On the loop: another schedule, trainer or none: forget every arm and ring."""
        with self._take:
            self._handshake.forget()

    def claim(self, index: int) -> int | None:
        """On the loop, on instruction `index`'s event: the clock a thread took for it, if any.

        Else the arm (if for `index`) is taken: the loop applies the change. The loop applies
        its own clock anyway if it differs from the one taken (the arm is a forecast).
        """
        with self._take:
            found, mhz = self._handshake.claim(index)
            if found is Phase.ARMED:
                self.counters["claimed"] += 1
            return mhz

    def _hand(self, deliver: Callable[[list[Received]], None]) -> Callable[[list[Received]], None]:
        """`deliver`, marking (`_delivering`) that the loop handles this doorbell's events."""

        def hand(batch: list[Received]) -> None:
            self._delivering = True
            try:
                deliver(batch)
            finally:
                self._delivering = False

        return hand

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        """One of two threads: read and deliver while holding `_reading`; apply without it.

        While one applies a change (a lock call: ~1 ms, or hung), the other reads, so the
        trainer's events never wait behind the GPU.
        """
        sock, loop, deliver = self._sock, self._loop, self._deliver
        assert sock is not None and loop is not None and deliver is not None
        handshake = self._handshake
        while not self._closed:
            with self._reading:
                change = self._read_until_change(sock, loop, deliver)
            if change is None:
                return
            mhz, _epoch, _t_ns, _asked, instruction = change

            def accept(instruction: int = instruction, mhz: int = mhz) -> bool:
                with self._take:
                    return handshake.accept(instruction, mhz)

            if not self._lane.ring(*change, accept):
                with self._take:
                    self.counters["stale"] += 1  # (The loop applies what its event wants.)

    def _read_until_change(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[Received]], None],
    ) -> tuple[int, int, int, int, int] | None:
        """Deliver batches until one holds the armed instruction; None once closed.

        That batch is left in `_handover`, delivered first by whichever thread reads next.

        While armed, datagrams without the instruction are held up to `HOLD_NS` for it: a
        trainer sends an instruction's end and the next one's begin (or a step's begin and
        its first instruction's) microseconds apart, and a loop woken for the first would
        hold the GIL while this thread needs it for the second.
        """
        handover, self._handover = self._handover, []
        if handover and not self._closed:  # (the previous reader's, in order)
            try:
                loop.call_soon_threadsafe(deliver, handover)
            except RuntimeError:
                return None
        held: list[Received] = []
        deadline = 0
        while not self._closed:
            batch = self._read(sock, deadline if held else None)
            if self._closed:
                return None  # (Woken by `stop`: an empty read.)
            change = None
            if batch:
                try:
                    change = self._take_armed(batch)
                except Exception:  # noqa: BLE001 - delivered all the same; the loop applies
                    LOG.exception("GPU %d: checking a doorbell batch failed", self.index)
                self.counters["datagrams"] += len(batch)
                if not held:
                    deadline = time.monotonic_ns() + HOLD_NS
                held += batch
            if (change is None and held and self._handshake.arm is not None
                    and time.monotonic_ns() < deadline):
                continue
            if change is not None:
                if self._found_spinning:
                    self.counters["spin_hits"] += 1
                # The next reader (the other thread, woken as this one lets go) delivers it:
                # waking the loop from here would delay the clock change by one more wake-up.
                self._handover = held
                return change
            if held:
                try:
                    loop.call_soon_threadsafe(deliver, held)
                except RuntimeError:
                    return None  # The loop is closed: the agent is gone.
                held = []
        return None

    def _read(self, sock: socket.socket, until_ns: int | None) -> list[Received]:
        """What the socket holds (at most `_MAX_PER_WAKEUP`), once it holds anything.

        `until_ns`: None waits for ever; else [] once that (monotonic) instant has passed.
        """
        batch: list[Received] = []
        try:
            first = self._first(sock, until_ns)
            if first is None:
                return batch
            batch.append(first)
            data = first[0]
            if (self._handshake.arm is not None and len(data) > 2
                    and data[2] == _INSTRUCTION_BEGIN):
                return batch  # Maybe the armed one: no more syscalls before it is applied.
            while len(batch) < _MAX_PER_WAKEUP:
                batch.append(sock.recvmsg(RECV_BYTES, ANCILLARY_BYTES, socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            pass
        except (OSError, ValueError) as e:  # (ValueError: select on a closed socket)
            if not self._closed:
                LOG.warning("GPU %d: doorbell socket error: %s", self.index, e)
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the threads must outlive a bug: events still flow
            if not self._closed:
                LOG.exception("GPU %d: reading the doorbell failed", self.index)
                time.sleep(0.01)
        return batch

    def _first(self, sock: socket.socket, until_ns: int | None) -> Received | None:
        """The next datagram, or None once `until_ns` (monotonic; None: never) has passed.

        Asleep in `_wait` (the socket, and `_wake` for a new arm), except in the armed
        instruction's spin window: there it spins (`_spin`) if no other thread of the process
        does.
        """
        while not self._closed:
            now = time.monotonic_ns()
            if until_ns is not None and now >= until_ns:
                return None
            arm = self._handshake.arm
            spin = arm.spin if arm is not None else None
            wake_ns = until_ns
            if spin is not None and now < spin[1]:
                if now < spin[0]:
                    wake_ns = spin[0] if wake_ns is None else min(wake_ns, spin[0])
                elif _SPIN_TOKEN.acquire(blocking=False):
                    try:
                        end = spin[1] if until_ns is None else min(until_ns, spin[1])
                        got = self._spin(sock, arm, end)
                    finally:
                        _SPIN_TOKEN.release()
                    if got is not None:
                        self._found_spinning = True
                        return got
                    continue  # The window ended, the arm changed or `until_ns` passed.
            timeout = None if wake_ns is None else max(0.0, (wake_ns - now) / 1e9)
            readable, woken = _wait(sock.fileno(), self._wake, timeout)
            if woken:
                with contextlib.suppress(BlockingIOError):  # (the other thread read it)
                    os.eventfd_read(self._wake)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    got = sock.recvmsg(RECV_BYTES, ANCILLARY_BYTES, socket.MSG_DONTWAIT)
                    self._found_spinning = False
                    return got
        return None

    def _spin(self, sock: socket.socket, arm: Arm | None, end_ns: int) -> Received | None:
        """Poll `sock` without sleeping until a datagram, `end_ns`, another arm or `stop`."""
        recv, flags, clock = sock.recvmsg, socket.MSG_DONTWAIT, time.monotonic_ns
        handshake = self._handshake
        start = clock()
        if self._spun_for is not arm:
            self._spun_for = arm
            self.counters["spins"] += 1
        try:
            while handshake.arm is arm and not self._closed:
                try:
                    got = recv(RECV_BYTES, ANCILLARY_BYTES, flags)
                except BlockingIOError:
                    if clock() >= end_ns:
                        return None
                    continue
                return got
            return None
        finally:
            self.spun_ns += clock() - start

    def _take_armed(self, batch: list[Received]) -> tuple[int, int, int, int, int] | None:
        """In the thread: the armed change if `batch` holds its instruction (the arm taken).

        Only what the match needs is read (kind, index, name, stamp; the sender's pid from
        the kernel): the gateway checks every datagram in full when it gets the batch. On a
        vCPU that just woke, each microsecond of Python here costs several.
        """
        handshake = self._handshake
        arm = handshake.arm
        if arm is None:
            return None
        for data, ancillary, _flags, _addr in batch:
            if len(data) < 3 or data[2] != _INSTRUCTION_BEGIN:  # [1, kind, ...]: pre-check
                continue
            try:
                fields = msgpack.unpackb(data)
            except Exception:  # noqa: BLE001 - malformed: the gateway reports it
                continue
            if not (isinstance(fields, list) and len(fields) == 7
                    and fields[0] == PROTOCOL_VERSION and fields[4] == arm.instruction
                    and fields[6] == arm.name and type(fields[3]) is int):
                continue
            if sender(ancillary)[0] != arm.pid:
                continue
            with self._take:
                if not handshake.take(arm):
                    return None  # The loop claimed it (its event came first) or re-armed.
            self.counters["taken"] += 1
            return arm.mhz, arm.epoch, fields[3], arm.asked, arm.instruction
        return None


_FD_SETSIZE = 1024


def _wait(fd: int, wake: int, timeout_s: float | None) -> tuple[bool, bool]:
    """Wait until `fd` or `wake` is readable or `timeout_s` (None: for ever) has passed.

    `select` (microseconds) while both numbers fit in its sets; `poll` (whole milliseconds,
    rounded up) for an agent with over 1,024 descriptors open.
    """
    if fd < _FD_SETSIZE and wake < _FD_SETSIZE:
        ready = select.select([fd, wake], [], [], timeout_s)[0]
        return fd in ready, wake in ready
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if wake >= 0:
        poller.register(wake, select.POLLIN)
    events = dict(poller.poll(None if timeout_s is None else math.ceil(timeout_s * 1000)))
    return fd in events, wake in events


def _make_way(path: str) -> None:
    """Remove a stale doorbell socket at `path` (the trainers' socket beside it is ours)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; it is left alone")
    os.unlink(path)
