"""Budgets in the coordinator's JetStream state bucket: one key per budget, `budget.<id>`.

Outside the `v.` keys the replicas follow for jobs (`coordinator.state.records`), so a replica
that predates budgets never reads them; every replica, restarted or taking over, reads them
here. Values are versioned JSON (`{"v": 1, "budget": {...}, "set_at": ...}`), readable with
`nats kv get`.

Beside each budget, its owner keeps how far it tightened the room and the caps it sent last
(`Backoffs`, key `budget_backoff.<id>`): a replica taking the budgets over starts from them
instead of from the profiles' expected draws, which the group measured over, and sends no cap
above its predecessor's for a few rounds (the cap holds through a takeover).

The owner also keeps what it measured of each Perseus job's options under the caps
(`TimingStore`, key `budget_timing.<h>` by the job's digest, a `BudgetTiming`): its successor
counts them at once (`coordinator.budget.timing`). The job's removal purges it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from coordinator.budget.remote import Recorded
from coordinator.state.records import job_hash, timing_key
from zeus_agent.models import MAX_POWER_W
from zeus_agent.wire.budget import Budget, BudgetTiming
from zeus_agent.wire.text import bounded

LOG = logging.getLogger(__name__)

PREFIX = "budget."
VERSION = 1


def budget_key(budget_id: str) -> str:
    """The key of one budget (ids are key-safe: `BudgetId`)."""
    return f"{PREFIX}{budget_id}"


def encode(budget: Budget, set_at: float) -> bytes:
    """A budget's value in the bucket."""
    return json.dumps({"v": VERSION, "budget": budget.model_dump(), "set_at": set_at}).encode()


def decode(raw: bytes) -> tuple[Budget, float]:
    """(budget, when it was set) from a value.

    Raises:
        ValueError: Not a budget this version wrote.
    """
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("v") != VERSION:
        raise ValueError("not a version-1 budget")
    try:
        return Budget.model_validate(data["budget"]), float(data.get("set_at", 0.0))
    except (KeyError, TypeError, ValidationError) as e:
        raise ValueError(f"unreadable budget: {e}") from e


class BudgetStore:
    """Read and write budgets through a JetStream KV bucket (nats-py's `KeyValue`)."""

    def __init__(self, kv: Any, js: Any, bucket: str) -> None:
        self.kv = kv
        self.js = js
        self.bucket = bucket

    async def put(self, budget: Budget, set_at: float) -> None:
        """Write (or replace) a budget."""
        await self.kv.put(budget_key(budget.budget_id), encode(budget, set_at))

    async def delete(self, budget_id: str) -> bool:
        """Remove a budget; False if there was none."""
        if await self.get(budget_id) is None:
            return False
        await self.kv.purge(budget_key(budget_id))
        return True

    async def get(self, budget_id: str) -> tuple[Budget, float] | None:
        """(budget, when it was set), or None."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(budget_key(budget_id))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return decode(entry.value)

    async def all(self) -> dict[str, tuple[Budget, float]]:
        """Every readable budget, by id (an unreadable one is logged and left out).

        Read now, so an operator's request sees its own writes (the budgets loop reads a
        `BudgetView` instead): the budgets' keys from the stream's per-subject counts
        (`stream_info` filtered to `budget.>`: listing the bucket's keys would walk every
        job's and rank's record), then each key's value. Not a KV watch: nats-py ends a
        watch's current values when the consumer has nothing pending and the client has
        processed nothing yet, even if the server has already pushed them; under load a
        `show` right after two `set`s listed none.
        """
        from nats.js.errors import KeyNotFoundError

        pre = f"$KV.{self.bucket}."
        info = await self.js.stream_info(f"KV_{self.bucket}", subjects_filter=f"{pre}{PREFIX}>")
        view = BudgetView()
        for subject in sorted(info.state.subjects or {}):
            try:
                entry = await self.kv.get(subject[len(pre):])
            except KeyNotFoundError:  # Lifted (a purge marker) since.
                continue
            await view.on_entry(entry)
        return view.budgets


class BudgetView:
    """Every readable budget, by id, kept current by one watch of `budget.>` (`on_entry`).

    The budgets loop reads it every second without asking JetStream anything.
    """

    def __init__(self) -> None:
        self.budgets: dict[str, tuple[Budget, float]] = {}
        self.remote = Recorded()
        """The Perseus jobs' frontiers and points recorded for the budgets (`budget.remote`)."""
        self.lifted: dict[str, tuple[list[tuple[str, int]], float]] = {}
        """Lifted budget -> (its GPUs, until when their caps may hold): `LiftedCaps`."""
        self.changed = asyncio.Event()
        """Set by every entry applied: the budgets loop runs at once, not at its next tick
        (`zeus_agent.aio.every`'s `wake`): a cap set is a grid's signal, every second over it
        counts."""

    async def on_lifted(self, entry: Any) -> None:
        """Apply one entry of the watch of `budget_lifted.>` (`LiftedCaps`)."""
        self.changed.set()
        budget_id = str(entry.key)[len(LIFTED_PREFIX):]
        if getattr(entry, "operation", None) in ("DEL", "PURGE") or not entry.value:
            self.lifted.pop(budget_id, None)
            return
        try:
            self.lifted[budget_id] = decode_lifted(entry.value)
        except ValueError as e:
            LOG.warning("lifted budget %s in the state bucket: %s", entry.key, e)
            self.lifted.pop(budget_id, None)

    async def on_entry(self, entry: Any) -> None:
        """Apply one entry of the watch (a put, a delete or a purge)."""
        self.changed.set()
        budget_id = str(entry.key)[len(PREFIX):]
        if getattr(entry, "operation", None) in ("DEL", "PURGE") or not entry.value:
            self.budgets.pop(budget_id, None)
            return
        try:
            budget, set_at = decode(entry.value)
        except ValueError as e:
            LOG.warning("budget %s in the state bucket: %s", entry.key, e)
            self.budgets.pop(budget_id, None)
            return
        self.budgets[budget.budget_id] = (budget, set_at)



BACKOFF_PREFIX = "budget_backoff."
"""Keys of the tighteners' backoffs (outside `budget.>`: the budgets' watch never sees them)."""


class Backoffs:
    """Each budget's tightening in the state bucket, as its owner last wrote it.

    Its backoff (W) and the caps it sent last; a value names the budget's `set_at`, so a
    budget set again starts afresh.
    """

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    async def put(self, budget_id: str, set_at: float, backoff_w: float,
                  caps: Mapping[tuple[str, int], int], jitter_w: float = 0.0) -> None:
        """Keep a budget's backoff, the caps sent and the draw's jitter."""
        await self.kv.put(f"{BACKOFF_PREFIX}{budget_id}", json.dumps(
            {"v": VERSION, "set_at": set_at, "backoff_w": round(backoff_w, 1),
             "jitter_w": round(jitter_w, 1),
             "caps": [[n, i, w] for (n, i), w in sorted(caps.items())]}).encode())

    async def get(self, budget_id: str,
                  set_at: float) -> tuple[float, dict[tuple[str, int], int], float] | None:
        """(backoff, caps, jitter) kept for this setting of the budget; None if none."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(f"{BACKOFF_PREFIX}{budget_id}")
        except KeyNotFoundError:
            return None
        try:
            data = json.loads(entry.value or b"{}")
            if data.get("v") != VERSION or data.get("set_at") != set_at:
                return None
            caps = {(str(n), int(i)): int(w) for n, i, w in data.get("caps", [])}
            jitter = max(0.0, float(data.get("jitter_w", 0.0)))
            backoff = max(0.0, float(data["backoff_w"]))
            # (Infinity would pin the room at the floor, or make the band NaN, for good.)
            if not (math.isfinite(backoff) and math.isfinite(jitter)) or any(
                    i < 0 or not 1 <= w <= MAX_POWER_W for (_, i), w in caps.items()):
                raise ValueError("a backoff, jitter or cap out of range")
            return backoff, caps, jitter
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            LOG.warning("budget %s: its kept backoff is unreadable, starting afresh: %s",
                        budget_id, e)
            return None

    async def delete(self, budget_id: str) -> None:
        """Forget a budget's tightening (it was lifted or ended)."""
        from nats.js.errors import KeyNotFoundError

        try:
            await self.kv.purge(f"{BACKOFF_PREFIX}{budget_id}")
        except KeyNotFoundError:
            return


LIFTED_PREFIX = "budget_lifted."
"""Keys of lifted budgets whose caps may still hold on an agent (outside `budget.>`)."""


class LiftedCaps:
    """A lifted budget's GPUs, kept until every one took the lift (or its caps lapsed).

    The lift request's replica lifts at once, but a lift an agent misses, or one the budgets'
    owner never saw (it died, or lost its lease, as the budget was lifted), would leave a
    GPU capped until the cap's lease ends (a budget with an end: up to an hour). Whoever owns
    the budgets sends these lifts every round and forgets a budget once all its GPUs took
    them (`BudgetLoop.tick`).
    """

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    async def put(self, budget_id: str, gpus: list[tuple[str, int]], until: float) -> None:
        """Keep a lifted budget's GPUs until `until` (when their caps lapse anyway)."""
        await self.kv.put(f"{LIFTED_PREFIX}{budget_id}", json.dumps(
            {"v": VERSION, "gpus": [[n, i] for n, i in sorted(gpus)],
             "until": until}).encode())

    async def forget(self, budget_id: str) -> None:
        """Every GPU took the lift (or its cap lapsed)."""
        await self.kv.purge(f"{LIFTED_PREFIX}{budget_id}")


def decode_lifted(raw: bytes) -> tuple[list[tuple[str, int]], float]:
    """(GPUs, until) of a `LiftedCaps` value.

    Raises:
        ValueError: Not one this version wrote.
    """
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != VERSION:
            raise ValueError("not a version-1 lifted budget")
        gpus = [(str(n), int(i)) for n, i in data["gpus"]]
        until = float(data["until"])
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"unreadable lifted budget: {e}") from e
    if not math.isfinite(until) or any(i < 0 for _, i in gpus):
        raise ValueError("a lifted budget's until or GPU out of range")
    return gpus, until


MAX_TIMING_BYTES = 65_536
"""Largest `BudgetTiming` value read (one at its `MAX_MEASURED` options is about 20 KB)."""


class TimingStore:
    """Each Perseus job's options as the budgets' owner measured them (`BudgetTiming`).

    JSON, as the bucket's other values (`nats kv get` shows them), validated on read.
    """

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    async def put(self, timing: BudgetTiming) -> None:
        """Keep a job's measures (replacing those kept)."""
        await self.kv.put(timing_key(job_hash(timing.job_id)), timing.model_dump_json().encode())

    async def get(self, job_id: str) -> BudgetTiming | None:
        """The measures kept of a job; None if none, or unreadable (logged: measured again)."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(timing_key(job_hash(job_id)))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            if len(entry.value) > MAX_TIMING_BYTES:
                raise ValueError(f"{len(entry.value)} bytes, at most {MAX_TIMING_BYTES} read")
            kept = BudgetTiming.model_validate_json(entry.value)
        except ValueError as e:  # (pydantic's ValidationError is one.)
            LOG.warning("job %s: its measures under the budgets are unreadable, measuring "
                        "again: %s", job_id, bounded(e, 300))
            return None
        if kept.job_id != job_id:  # (Another job's, under this one's key.)
            LOG.warning("job %s: the measures under its key are job %r's", job_id, kept.job_id)
            return None
        return kept

    async def delete(self, job_id: str) -> None:
        """Forget a job's measures (it ended, or planned another frontier)."""
        from nats.js.errors import KeyNotFoundError

        try:
            await self.kv.purge(timing_key(job_hash(job_id)))
        except KeyNotFoundError:
            return
