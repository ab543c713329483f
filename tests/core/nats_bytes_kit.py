"""What nats-py itself writes for messages: the reference `coordinator.bulk`'s bytes are held to."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

Message = tuple[str, str, bytes, dict[str, str] | None]
"""Subject, reply subject, payload, headers."""


def nats_py_bytes(messages: list[Message]) -> bytes:
    """What nats-py's own `_send_publish` queues for `messages`, in order."""
    written: list[bytes] = []
    client = Client()

    async def capture(cmd: bytes, priority: bool = False) -> None:
        written.append(cmd)

    client._send_command = capture  # type: ignore[method-assign]  # noqa: SLF001
    client._flush_queue = None  # noqa: SLF001

    async def publish_all() -> None:
        for subject, reply, payload, headers in messages:
            await client._send_publish(subject, reply, payload, len(payload),  # noqa: SLF001
                                       headers)

    asyncio.run(publish_all())
    return b"".join(written)
