"""Group commit: registrations' KV creates sent as atomic JetStream batches (async shell).

With `sync_interval: always` (every server this project starts or ships a configuration for),
nats-server syncs each write to disk before acknowledging it, one write after another: a
registration of 16,384 ranks made 32,769 synced writes (two creates per rank) and 32,768
acknowledgements into the replicas. An atomic batch (nats-server 2.12+, ADR-50; the bucket's
stream must allow it, `allow_atomic`) is stored, synced and acknowledged as one: 16,384 ranks
became about 130 synced writes and as many acknowledgements (`bench/register_ranks.py`).

A unit (one rank's GPU key and rank key) goes whole into one batch, in order. At most
`max_in_flight` batches await their acknowledgement; whatever arrives meanwhile waits and goes
into the next batch (a group commit: no timer, and nothing waits when the bucket is idle).
Every create still carries "expected last subject sequence 0", and the server refuses the
whole batch if any of its keys is taken (or written twice in it): its callers are then told
False and create their keys one by one, which tells retries from conflicts as before. Nothing
is reported created before its batch's acknowledgement, so a registration is acknowledged only
once it is durable, as before. A batch not answered in time may still have landed: its callers
get its id (`Outcome.batch_id`), which the stored messages carry (`Nats-Batch-Id`), so keys
found taken afterwards are told apart: this batch's, or someone else's. When a batch gets no
answer (NATS or JetStream gone), the units still waiting are refused at once rather than each
waiting out a timeout in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator import bulk

LOG = logging.getLogger(__name__)

Unit = Sequence[tuple[str, bytes]]
"""Keys (within the bucket) and values created together, all or none."""

MAX_MESSAGES = 256
"""Messages per batch (the server takes up to 1,000): 128 ranks, about 60 KB."""
MAX_IN_FLIGHT = 4
"""Batches of one replica awaiting their acknowledgement (a stream takes 50 in flight)."""
ATOMIC_DISABLED = 10174
"""JetStream's error code: the stream does not allow atomic batches."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a unit's batch."""

    committed: bool
    """Stored whole (durable)."""
    batch_id: str | None = None
    """Set when the outcome is unknown (not answered in time, NATS gone): it may have landed,
    and then its messages carry this `Nats-Batch-Id`."""


REFUSED = Outcome(False)
COMMITTED = Outcome(True)


def committed(ack: bytes) -> bool:
    """Whether a batch's acknowledgement says it was stored (whole)."""
    return b'"error"' not in ack and b'"batch"' in ack


def disabled(ack: bytes) -> bool:
    """Whether a batch's acknowledgement says the stream takes no batches."""
    return b'"err_code":%d' % ATOMIC_DISABLED in ack


def take_batch(pending: deque[tuple[Unit, Any]], max_messages: int) -> list[tuple[Unit, Any]]:
    """The units of the next batch, taken from the front of `pending` in order (pure).

    Up to `max_messages` messages (a bigger unit alone), no key twice: a unit with a key already
    in the batch stays first in line for the next one (the server would refuse the whole batch).
    Only the units taken (and those put back) are looked at: thousands may be waiting.
    """
    batch: list[tuple[Unit, Any]] = []
    keys: set[str] = set()
    later: list[tuple[Unit, Any]] = []
    size = 0
    while pending:
        unit = pending[0]
        items = unit[0]
        if batch and size + len(items) > max_messages:
            break
        pending.popleft()
        if any(key in keys for key, _ in items):
            later.append(unit)
            continue
        batch.append(unit)
        keys.update(key for key, _ in items)
        size += len(items)
    pending.extendleft(reversed(later))
    return batch


class GroupCommit:
    """Creates of one bucket's keys, many units to a batch (`create`)."""

    def __init__(self, nc: Any, bucket: str, timeout_s: float,
                 max_messages: int = MAX_MESSAGES, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.nc = nc
        self.prefix = f"$KV.{bucket}."
        self.timeout_s = timeout_s
        self.max_messages = max_messages
        self.max_in_flight = max_in_flight
        self.enabled = False
        """Set once the stream allows atomic batches (`enable`); False: `create` says False."""
        self._pending: deque[tuple[Unit, asyncio.Future[Outcome]]] = deque()
        self._in_flight = 0
        self._scheduled = False
        self._ids = itertools.count()
        self._tag = secrets.token_hex(4)  # Batch ids unique across replicas.
        self._acks: dict[int, asyncio.Future[bytes]] = {}
        self._inbox = ""
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0
        """Batches committed (for tests and benchmarks)."""

    async def enable(self, js_timeout_s: float) -> bool:
        """Let the bucket's stream take atomic batches (a stream update); False: it did not.

        The stream's configuration is read and written back as JSON with `allow_atomic` set,
        so fields this client does not know are kept. A server before 2.12, or one that
        refuses, leaves the creates one by one.
        """
        import json

        stream = f"KV_{self.prefix[4:-1]}"
        try:
            msg = await self.nc.request(f"$JS.API.STREAM.INFO.{stream}", b"",
                                        timeout=js_timeout_s)
            config = json.loads(msg.data)["config"]
            if not config.get("allow_atomic"):
                config["allow_atomic"] = True
                msg = await self.nc.request(f"$JS.API.STREAM.UPDATE.{stream}",
                                            json.dumps(config).encode(), timeout=js_timeout_s)
                reply = json.loads(msg.data)
                if "error" in reply or not reply.get("config", {}).get("allow_atomic"):
                    raise ValueError(reply.get("error") or "allow_atomic not kept")
            self._inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_ack)
        except Exception as e:  # noqa: BLE001 - an older server, a refusal: one by one
            LOG.info("registrations are written one key at a time: stream %s takes no atomic "
                     "batches (%s)", stream, e)
            return False
        self.enabled = True
        return True

    async def close(self) -> None:
        """Stop: nothing more is batched; batches in flight are abandoned (their units False)."""
        self.enabled = False
        for task in list(self._tasks):
            task.cancel()  # (One not started yet: `_answer_all` answers its units.)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for _, future in self._pending:
            if not future.done():
                future.set_result(REFUSED)
        self._pending.clear()

    async def create(self, unit: Unit) -> Outcome:
        """Create `unit`'s keys in a batch: committed, or not.

        Not committed: the stream takes no batches, the batch was refused (a key taken or
        written twice, here or in another unit of it), or it was not answered in time (it may
        have landed: `batch_id` says which). The caller then creates the keys one by one, which
        finds out.
        """
        if not self.enabled or not unit:
            return REFUSED
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending.append((unit, future))
        self._kick()
        return await future

    def _kick(self) -> None:
        """Start a batch soon (after the callbacks ready now: their units join it)."""
        if not self._scheduled and self._pending and self._in_flight < self.max_in_flight:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        if not self._pending or self._in_flight >= self.max_in_flight:
            return
        units = take_batch(self._pending, self.max_messages)
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._commit(units))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A task cancelled before it ran (`close`) never reaches its `finally`: answered here.
        task.add_done_callback(lambda _: _answer_all(units, REFUSED))
        self._kick()

    async def _commit(self, units: list[tuple[Unit, asyncio.Future[Outcome]]]) -> None:
        """Send one batch and hand its outcome to its units."""
        n = next(self._ids)
        outcome = REFUSED
        try:
            units = [(unit, f) for unit, f in units if not f.done()]  # (Callers gone: left out.)
            if units:
                outcome = Outcome(False, self._batch_id(n))  # Unknown until answered.
                outcome = await self._send(n, [item for unit, _ in units for item in unit])
        except Exception as e:  # noqa: BLE001 - NATS gone, a timeout: the callers decide
            LOG.debug("a batch of %d creates failed: %s", len(units), e)
            # JetStream is not answering: the units waiting behind this batch would each wait
            # out a timeout of their own in turn (minutes for thousands of ranks). Never sent,
            # they are refused now: their callers create their keys one by one, side by side,
            # within their own retry time.
            _answer_all(list(self._pending), REFUSED)
            self._pending.clear()
        finally:
            self._in_flight -= 1
            _answer_all(units, outcome)
            self._kick()

    def _batch_id(self, n: int) -> str:
        return f"{self._tag}.{n}"

    async def _send(self, n: int, items: list[tuple[str, bytes]]) -> Outcome:
        """Publish batch `n`; committed, or refused (a timeout raises: the outcome is unknown)."""
        batch_id = self._batch_id(n)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        self._acks[n] = future
        timer = loop.call_later(self.timeout_s, _expire, future)
        try:
            reply, nc = f"{self._inbox}.{n}", self.nc
            if bulk.sendable(nc, (self.prefix + key for key, _ in items),
                             (value for _, value in items)):
                await bulk.send(nc, batch_commands(self.prefix, batch_id, items, reply),
                                len(items), sum(len(value) for _, value in items))
            else:
                last = len(items)
                for seq, (key, value) in enumerate(items, 1):
                    headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(seq),
                               "Nats-Expected-Last-Subject-Sequence": "0"}
                    if seq == last:
                        headers["Nats-Batch-Commit"] = "1"
                    await self.nc.publish(self.prefix + key, value,
                                          reply=reply if seq == last else "", headers=headers)
            ack = await future
        finally:
            timer.cancel()
            self._acks.pop(n, None)
        if committed(ack):
            self.batches += 1
            return COMMITTED
        if disabled(ack):
            LOG.warning("stream %s no longer takes atomic batches: registrations are written "
                        "one key at a time", self.prefix)
            self.enabled = False
        return REFUSED

    async def _on_ack(self, msg: Any) -> None:
        answer_ack(self._acks, msg)


def batch_commands(prefix: str, batch_id: str, items: Sequence[tuple[str, bytes]],
                   reply: str) -> bytes:
    """The protocol commands of one atomic batch, as one buffer (pure; `coordinator.bulk`).

    Each message with the batch's headers (`Nats-Batch-Id`, `Nats-Batch-Sequence`, "expected
    last subject sequence 0"; the last one `Nats-Batch-Commit` and the reply inbox), byte for
    byte what nats-py's `publish` writes: it encoded and checked each message's headers on its
    own, a fifth of a replica's CPU while 16,384 ranks registered (two messages a rank).
    """
    parts: list[bytes] = []
    head = b"NATS/1.0\r\nNats-Batch-Id: %s\r\nNats-Batch-Sequence: " % batch_id.encode()
    last = len(items)
    for seq, (key, value) in enumerate(items, 1):
        header = b"%s%d%s" % (head, seq, _COMMIT_TAIL if seq == last else _TAIL)
        parts.append(bulk.command(prefix + key, reply if seq == last else "", header, value))
    return b"".join(parts)


_TAIL = b"\r\nNats-Expected-Last-Subject-Sequence: 0\r\n\r\n"
_COMMIT_TAIL = b"\r\nNats-Expected-Last-Subject-Sequence: 0\r\nNats-Batch-Commit: 1\r\n\r\n"


def answer_ack(acks: dict[int, asyncio.Future[bytes]], msg: Any) -> None:
    """Hand an acknowledgement on `<inbox>.<n>` to the writer waiting for `n`, if any."""
    try:
        future = acks.get(int(msg.subject.rsplit(".", 1)[1]))
    except ValueError:
        return
    if future is not None and not future.done():
        future.set_result(msg.data)  # No responders: empty data, left to nats-py.


def _answer_all(units: list[tuple[Unit, asyncio.Future[Outcome]]], outcome: Outcome) -> None:
    """Hand `outcome` to every unit not answered yet."""
    for _, future in units:
        if not future.done():
            future.set_result(outcome)


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
