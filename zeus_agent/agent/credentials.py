"""Who sent a datagram, in the kernel's words: `SO_PASSCRED` and `SCM_CREDENTIALS`.

Shared by the trainers' socket (`gateway.py`) and the GPUs' doorbells (`doorbell.py`): both
read with `recvmsg(RECV_BYTES, ANCILLARY_BYTES)` and hand `(data, ancillary, flags, addr)` to
`Gateway.received`.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from zeus_agent.wire.trainer import MAX_DATAGRAM_BYTES

__all__ = ["ANCILLARY_BYTES", "RECV_BYTES", "Received", "pass_credentials", "sender"]

Received = tuple[bytes, list[tuple[int, int, bytes]], int, Any]
"""What `socket.recvmsg` returns: data, ancillary data, flags, the sender's address."""

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
ANCILLARY_BYTES = socket.CMSG_SPACE(_CREDENTIALS.size)
"""Room for the credentials and nothing else: file descriptors a sender passes (SCM_RIGHTS)
do not fit, so the kernel never installs them in the agent."""
RECV_BYTES = max(65_536, MAX_DATAGRAM_BYTES + 1)
"""Longer datagrams arrive with `MSG_TRUNC` set and are dropped."""
_SOL_SOCKET = socket.SOL_SOCKET
_SCM_CREDENTIALS = socket.SCM_CREDENTIALS  # type: ignore[attr-defined,unused-ignore]
_SO_PASSCRED = socket.SO_PASSCRED  # type: ignore[attr-defined,unused-ignore]


def pass_credentials(sock: socket.socket) -> None:
    """Have the kernel attach each sender's credentials to the datagrams `sock` reads.

    Set it before `bind`: a datagram queued before then carries none.
    """
    sock.setsockopt(_SOL_SOCKET, _SO_PASSCRED, 1)


def sender(ancillary: list[tuple[int, int, bytes]]) -> tuple[int | None, int | None]:
    """The sender's (pid, uid) from `recvmsg`'s ancillary data; (None, None) without them."""
    for level, kind, cdata in ancillary:
        if kind == _SCM_CREDENTIALS and level == _SOL_SOCKET and len(cdata) >= 12:
            pid, uid, _gid = _CREDENTIALS.unpack_from(cdata)
            return pid, uid
    return None, None
