"""Many NATS messages handed to nats-py's outgoing buffer at once (pure builders, one async send).

A registration of 16,384 ranks publishes about 35,000 messages into the state bucket (a GPU and
a rank key each, in atomic batches) and the job's owner 16,384 first power limits. nats-py's
`publish` checks, encodes and queues each message on its own (its headers key by key, a flush
request each): a fifth of a replica's CPU. Here a batch's protocol commands (`PUB`, `HPUB`) are
built in one pass, byte for byte what `publish` writes, and queued as one buffer (`send`); where
that cannot be done safely, the caller publishes message by message, nats-py's way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name nats-py writes (it refuses others)."""
_HEADER_VALUE = frozenset(range(0x20, 0x7F))
"""Bytes of a header value nats-py writes unchanged (it strips spaces, replaces line breaks)."""


def header_block(headers: dict[str, str]) -> bytes:
    """A message's header block as nats-py writes it (`NATS/1.0`, `Name: value` lines; pure).

    Raises:
        ValueError: A name or value nats-py would change or refuse (spaces around it, a line
            break, an empty or odd name): such headers are not sent here.
    """
    lines = [b"NATS/1.0"]
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name) or value != value.strip() \
                or not value.isascii() or not _HEADER_VALUE.issuperset(value.encode()):
            raise ValueError(f"header {name!r} is not sent as is")
        lines.append(b"%s: %s" % (name.encode(), value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n"


def command(subject: str, reply: str, header: bytes | None, payload: bytes) -> bytes:
    """One message as nats-py's `publish` writes it: `PUB`, or `HPUB` with `header` (pure)."""
    if header is None:
        return b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply.encode(), len(payload),
                                            payload)
    size = len(header)
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject.encode(), reply.encode(), size,
                                              size + len(payload), header, payload)


def sendable(nc: Any, subjects: Iterable[str], payloads: Iterable[bytes]) -> bool:
    """Whether these messages may go through `send` (else: nats-py's `publish`, one by one).

    Not while nats-py is not connected (it buffers, or refuses, by rules of its own) or drains
    its publishers (it refuses: `is_connected` still says True then), nor with
    a payload over the server's limit (nats-py raises; the server would close the connection),
    a subject nats-py would refuse (the subjects sent here are printable ASCII without
    spaces; anything else goes nats-py's way), or a nats-py without the buffer `send` uses.
    """
    if not callable(getattr(nc, "_send_command", None)) \
            or not callable(getattr(nc, "_flush_pending", None)) \
            or getattr(nc, "is_connected", False) is not True \
            or getattr(nc, "is_draining_pubs", True) is not False:
        return False
    limit = getattr(nc, "max_payload", 0)
    if not all(len(p) <= limit for p in payloads):
        return False
    listed = list(subjects)
    joined = "".join(listed)  # (Checked at once: thousands of subjects.)
    return all(listed) and joined.isascii() and joined.isprintable() and " " not in joined


async def send(nc: Any, commands: bytes, messages: int, payload_bytes: int) -> None:
    """Queue `commands` (built by `command`; `sendable` said yes) as one buffer, then flush.

    nats-py's own statistics count the messages, as `publish` would.
    """
    stats = getattr(nc, "stats", None)
    if isinstance(stats, dict):
        stats["out_msgs"] = stats.get("out_msgs", 0) + messages
        stats["out_bytes"] = stats.get("out_bytes", 0) + payload_bytes
    await nc._send_command(commands)  # noqa: SLF001 - nats-py's outgoing buffer
    queue = getattr(nc, "_flush_queue", None)
    if queue is not None and queue.empty():
        await nc._flush_pending()  # noqa: SLF001 - as `publish` does after each message
