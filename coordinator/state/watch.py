"""Following a JetStream KV bucket: its entries straight from the consumer to a callback.

nats-py's `KeyValue.watch` hands each message through a `KeyWatcher`: it parses the message's
whole JetStream metadata (a `datetime` per entry), builds an entry, queues it, and the follower
takes it from the queue in another task. A registration of 16,384 ranks brings each replica
16,384 entries, and that layer was a tenth of a replica's CPU. Here the ordered push consumer's
callback (one at a time, in order, as nats-py's subscription runs it) reads what a follower
needs from the message (`kv_entry`: key, value, revision, operation, entries pending after it)
and awaits the follower's callback directly. The consumer is the one `KeyValue.watch` makes
(ordered, last value per key, deleted after 5 idle minutes); its flow control now waits for the
follower itself (nats-py answers it once the callback has had the messages before it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

LOG = logging.getLogger(__name__)

OnEntry = Callable[[Any], Awaitable[None]]

INACTIVE_THRESHOLD_S = 5 * 60
"""A watch's consumer outlives its subscription by this much (`KeyValue.watch`'s default)."""


def _fields(reply: str | None) -> list[str] | None:
    """A JetStream message's reply subject in tokens (None: not one).

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (9 tokens), or with
    a domain and account hash after `ACK` (11 or more), as nats-py reads it.
    """
    if not reply:
        return None
    tokens = reply.split(".")
    if (len(tokens) == 9 or len(tokens) >= 11) and tokens[0] == "$JS" and tokens[1] == "ACK":
        return tokens
    return None


def operation(headers: dict[str, str] | None) -> tuple[bool, str | None]:
    """(whether the message is an entry, its operation: None, "DEL" or "PURGE").

    As `KeyValue.watch` reads them: `KV-Operation`, else the server's expiry markers
    (`Nats-Marker-Reason`, nats-server 2.11+); a marker of an unknown reason is no entry.
    """
    if not headers:
        return True, None
    if KV_OP in headers:
        return True, headers[KV_OP]
    reason = headers.get(KV_MARKER_REASON)
    if reason is None:
        return True, None
    if reason in ("MaxAge", "Purge"):
        return True, KV_PURGE
    if reason == "Remove":
        return True, KV_DEL
    return False, None


def kv_entry(msg: Any, bucket: str, prefix: str) -> tuple[KeyValue.Entry | None, int | None]:
    """(the entry a watch's message carries or None, messages pending after it or None)."""
    fields = _fields(msg.reply)
    pending = None
    revision = 0
    if fields is not None:
        v1 = len(fields) == 9
        pending = int(fields[8] if v1 else fields[Msg.Ack.NumPending])
        revision = int(fields[5] if v1 else fields[Msg.Ack.StreamSeq])
    is_entry, op = operation(msg.headers)
    if not is_entry:
        return None, pending
    return KeyValue.Entry(bucket=bucket, key=msg.subject[len(prefix):], value=msg.data,
                          revision=revision, delta=pending, created=None,
                          operation=op), pending


async def follow(js: Any, bucket: str, keys: str, callback: OnEntry) -> Any:
    """Feed `bucket`'s entries under `keys` to `callback`: current ones, then changes.

    Returns the consumer's subscription (unsubscribe it to stop) once the current entries
    were all fed: the bucket had none (the consumer delivered nothing and has nothing
    pending), or an entry with nothing pending after it was fed. An exception of `callback`
    is logged: one bad entry must not stop the view.
    """
    prefix = f"$KV.{bucket}."
    loaded = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        entry, pending = kv_entry(msg, bucket, prefix)
        if entry is not None:
            try:
                await callback(entry)
            except Exception:  # noqa: BLE001 - one bad entry must not stop the view
                LOG.exception("could not apply state entry %s", entry.key)
        if pending == 0:
            loaded.set()

    sub = await js.subscribe(
        f"{prefix}{keys}", stream=f"KV_{bucket}", cb=on_msg, ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=INACTIVE_THRESHOLD_S)
    try:
        info = await sub.consumer_info()
    except BaseException:
        await sub.unsubscribe()
        raise
    delivered = getattr(info.delivered, "consumer_seq", None)  # (None: the server omitted it.)
    if not info.num_pending and not delivered:
        loaded.set()  # Nothing stored: the view is complete, empty.
    await loaded.wait()
    return sub
