"""`RankRelay`: a node's rank registrations relayed to the coordinator together.

The ranks on one node's GPUs register at about the same time (a job's local ranks leave its
rendezvous together). Each used to be one request to the coordinator; now those that arrive
within `WINDOW_S` of the first go in one `RegisterRanks` request on the node's subject, and
each trainer gets its own rank's reply; in columns (`RegisterRankColumns`) when the ranks have
them and `columns()` allows (no coordinator heard that predates them). The window ends early
once every GPU of the node has a registration waiting (nothing more can come), so a node whose
GPUs all register waits no longer than its last rank. A lone registration goes as a plain
`RegisterRank`; a batch the coordinator does not take (`bad_request`: a coordinator that
predates batches) or that would be too big for one message goes rank by rank, as before; after
such a refusal the node's batches go rank by rank for `REFUSAL_MEMORY_S` (not refused again
each time), then batches are tried again (the coordinators may have been upgraded meanwhile).
A batch in columns that a coordinator refuses (`bad_request`: it predates them, or refuses a
rank) goes again in rows; if those are taken, the node's batches go in rows for
`REFUSAL_MEMORY_S`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from zeus_agent.errors import ZeusAgentError
from zeus_agent.wire import codec
from zeus_agent.wire.messages import RegisterRank, Reply
from zeus_agent.wire.rank_batch import RegisterRanks
from zeus_agent.wire.rank_columns import RegisterRankColumns

__all__ = ["MAX_BATCH_BYTES", "REFUSAL_MEMORY_S", "WINDOW_S", "RankRelay"]

LOG = logging.getLogger(__name__)

WINDOW_S = 0.01
"""How long a registration waits for the node's other ranks (unless all its GPUs register)."""
MAX_BATCH_BYTES = 512 * 1024
"""A bigger batch goes rank by rank (nats-server's default payload limit is 1 MiB)."""
REFUSAL_MEMORY_S = 300.0
"""How long a coordinator's refusal of a batch (`bad_request`) sends the node's ranks one each."""

Send = Callable[[str, bytes], Awaitable[Reply]]
"""Relay a payload on a subject; the coordinator's reply (raises if none came)."""


class RankRelay:
    """Registrations of one node's ranks, sent together when they arrive together."""

    def __init__(self, send: Send, subject: str, gpus: Callable[[], int],
                 window_s: float = WINDOW_S, columns: Callable[[], bool] = lambda: True) -> None:
        self.send = send
        self.subject = subject
        self.gpus = gpus
        """How many GPUs the node has (a registration each at most, at a time)."""
        self.window_s = window_s
        self._pending: list[tuple[RegisterRank, asyncio.Future[Reply]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        """Requests sent to the coordinator (batches and lone ranks), for tests."""
        self._refused_at: float | None = None
        """When (event-loop time) a coordinator last refused a batch; None: never."""
        self.columns = columns
        """Whether to try a batch in columns first (no coordinator heard that predates them)."""
        self._columns_refused_at: float | None = None
        """When a coordinator last refused a batch in columns and took it in rows; None: never."""

    async def relay(self, rank: RegisterRank) -> Reply:
        """The coordinator's reply to `rank`'s registration, sent with the node's others.

        Raises what `send` raises (no coordinator answered, an unreadable reply).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        self._pending.append((rank, future))
        if len(self._pending) >= self.gpus():
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await future

    def close(self) -> None:
        """Cancel what is being sent (the agent stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._tasks):
            task.cancel()
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        units, self._pending = self._pending, []
        if units:
            task = asyncio.get_running_loop().create_task(self._deliver(units))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(self, units: list[tuple[RegisterRank, asyncio.Future[Reply]]]) -> None:
        """Send the waiting registrations; hand each trainer its reply (or the error)."""
        units = [(rank, future) for rank, future in units if not future.done()]
        ranks = [rank for rank, _ in units]
        if not ranks:
            return
        try:
            replies = await (self._one(ranks[0]) if len(ranks) == 1 else self._batch(ranks))
        except Exception as e:  # noqa: BLE001 - each waiting trainer gets the error
            for _, future in units:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), reply in zip(units, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _one(self, rank: RegisterRank) -> list[Reply | BaseException]:
        self.requests += 1
        return [await self.send(self.subject, codec.encode(rank))]

    async def _batch(self, ranks: list[RegisterRank]) -> list[Reply | BaseException]:
        """One request for `ranks` (in columns if it may and they have them); replies in order."""
        now = asyncio.get_running_loop().time()
        if self._refused_at is not None and now - self._refused_at < REFUSAL_MEMORY_S:
            return await self._each(ranks)
        columns = None
        if self.columns() and (self._columns_refused_at is None
                               or now - self._columns_refused_at >= REFUSAL_MEMORY_S):
            columns = RegisterRankColumns.from_ranks(ranks)
        if columns is not None:
            payload = codec.encode(columns)
            if len(payload) <= MAX_BATCH_BYTES:
                self.requests += 1
                replies = self._answers(await self.send(self.subject, payload), len(ranks))
                if replies is not None:
                    return replies
                # Refused whole: a coordinator that predates columns, or a rank it refuses (the
                # rows say which). Rows it takes: it predates columns.
                replies, taken = await self._rows(ranks, now)
                if taken:
                    LOG.info("the coordinator did not take a node's ranks in columns: sending "
                             "rows for %.0f s", REFUSAL_MEMORY_S)
                    self._columns_refused_at = now
                return replies
        return (await self._rows(ranks, now))[0]

    async def _rows(self, ranks: list[RegisterRank],
                    now: float) -> tuple[list[Reply | BaseException], bool]:
        """One `RegisterRanks` for `ranks`, or each alone: the replies, and whether it was taken."""
        payload = codec.encode(RegisterRanks(ranks=ranks))
        if len(payload) > MAX_BATCH_BYTES:
            return await self._each(ranks), False
        self.requests += 1
        reply = await self.send(self.subject, payload)
        replies = self._answers(reply, len(ranks))
        if replies is not None:
            return replies, True
        LOG.info("the coordinator did not take a batch of %d ranks (%s): relaying ranks one by "
                 "one for %.0f s", len(ranks), reply.error, REFUSAL_MEMORY_S)
        self._refused_at = now
        return await self._each(ranks), False

    @staticmethod
    def _answers(reply: Reply, ranks: int) -> list[Reply | BaseException] | None:
        """Each rank's reply from a batch's; None: the batch was refused (`bad_request`)."""
        replies = reply.result.get("replies") if reply.ok else None
        if isinstance(replies, list) and len(replies) == ranks:
            try:
                return [Reply.model_validate(r) for r in replies]
            except ValidationError:
                pass
        elif not reply.ok and reply.code != "bad_request":
            return [reply] * ranks  # (Unavailable, internal: every rank's answer.)
        elif not reply.ok:
            return None
        raise ZeusAgentError("the coordinator's reply to a node's ranks has no reply per rank")

    async def _each(self, ranks: list[RegisterRank]) -> list[Reply | BaseException]:
        """Each rank on its own, side by side (one's failure is its own)."""
        answers = await asyncio.gather(*(self._one(rank) for rank in ranks),
                                       return_exceptions=True)
        return [a[0] if isinstance(a, list) else a for a in answers]
