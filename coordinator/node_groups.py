"""Group a job's GPU commands into one request per node, and split the replies back (pure).

A job's first power limit is one command per GPU: 16,384 requests and replies for a job of
2,048 nodes x 8. `plan` groups the requests of each node that has at least `min_per_node` of
them into one `NodeCommandBatch` on the node's subject (`subjects.node_command`), leaving the
others (and the nodes in `per_gpu`, which did not take a batch lately) one request per GPU.
`batch_payload` writes the batch around each command's bytes as they are (msgpack values
concatenate), so nothing is decoded or encoded again. `split` puts each batch's replies back in
the slots of its requests, or says which requests must go one by one (the node's agent did not
answer the batch, or refused it as a whole: an agent older than the batches).

No I/O, no clock: the caller says which nodes go per GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgpack

from zeus_agent.wire import subjects
from zeus_agent.wire.messages import Reply
from zeus_agent.wire.node_command import MAX_NODE_COMMANDS, NodeCommandReply

__all__ = ["MAX_BATCH_BYTES", "Batch", "Plan", "batch_payload", "plan", "split"]

MAX_BATCH_BYTES = 512 * 1024
"""A node's commands beyond this many bytes go in another batch (nats-server's default payload
limit is 1 MiB; each command alone was within it, a node's 8 schedules need not be)."""
ITEM_OVERHEAD = 24
"""Bytes an item adds around its command (its map, `gpu`, its index, `envelope`)."""


@dataclass(frozen=True)
class Batch:
    """One node's batch: its subject, and the indices (in the job's requests) of its items."""

    subject: str
    indices: tuple[int, ...]
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """What to send: `batches`, and the indices of the requests sent one each (`singles`)."""

    batches: tuple[Batch, ...]
    singles: tuple[int, ...]


def plan(requests: Sequence[tuple[str, bytes]], per_gpu: Collection[str] = (),
         min_per_node: int = 2) -> Plan:
    """Group the requests by node (see the module); `per_gpu`: node subjects sent per GPU.

    A request whose subject is not a GPU's command subject, or a second command for the same
    GPU, goes alone; a node's batch holds at most `MAX_NODE_COMMANDS` items and
    `MAX_BATCH_BYTES` (more: several; a part of one item goes alone).
    """
    by_node: dict[str, list[tuple[int, int]]] = {}
    singles: list[int] = []
    for i, (subject, _) in enumerate(requests):
        parsed = subjects.parse_node_command_of(subject)
        if parsed is None or parsed[0] in per_gpu:
            singles.append(i)
            continue
        by_node.setdefault(parsed[0], []).append((i, parsed[1]))
    batches: list[Batch] = []
    for node_subject, items in by_node.items():
        seen: set[int] = set()
        unique: list[tuple[int, int]] = []
        for i, gpu in items:
            if gpu in seen:
                singles.append(i)
            else:
                unique.append((i, gpu))
                seen.add(gpu)
        if len(unique) < min_per_node:
            singles.extend(i for i, _ in unique)
            continue
        for part in _parts(unique, requests):
            if len(part) < min_per_node:
                singles.extend(i for i, _ in part)
            else:
                batches.append(Batch(node_subject, tuple(i for i, _ in part),
                                     tuple(g for _, g in part)))
    return Plan(tuple(batches), tuple(sorted(singles)))


def _parts(items: list[tuple[int, int]],
           requests: Sequence[tuple[str, bytes]]) -> list[list[tuple[int, int]]]:
    """A node's items cut into batches of <= `MAX_NODE_COMMANDS` items and `MAX_BATCH_BYTES`."""
    parts: list[list[tuple[int, int]]] = [[]]
    size = 0
    for i, gpu in items:
        n = len(requests[i][1]) + ITEM_OVERHEAD
        if parts[-1] and (len(parts[-1]) == MAX_NODE_COMMANDS or size + n > MAX_BATCH_BYTES):
            parts.append([])
            size = 0
        parts[-1].append((i, gpu))
        size += n
    return parts


def batch_payload(batch: Batch, requests: Sequence[tuple[str, bytes]]) -> bytes:
    """The `NodeCommandBatch` of `batch`: each item's `envelope` is its request's bytes as is."""
    pack = msgpack.packb
    head = b"".join((b"\x82", pack("v"), pack(1), pack("items"), _array(len(batch.indices))))
    item = b"\x82" + pack("gpu")
    envelope = pack("envelope")
    return head + b"".join(item + pack(gpu) + envelope + requests[i][1]
                           for i, gpu in zip(batch.indices, batch.gpus, strict=True))


def _array(n: int) -> bytes:
    """A msgpack array header of `n` items."""
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big")


def split(batch: Batch, reply: NodeCommandReply | Reply | str,
          results: list[Reply | str | None]) -> bool:
    """Put a batch's replies in `results` at its requests' indices; False: send them per GPU.

    Per GPU when the batch has no usable answer: none (a text: no responders, a timeout), one
    `Reply` for the whole batch (an agent that refused it, e.g. one that predates batches
    answering on a subject it does not know), or a count of replies that is not the items'.
    """
    if not isinstance(reply, NodeCommandReply) or len(reply.replies) != len(batch.indices):
        return False
    for i, one in zip(batch.indices, reply.replies, strict=True):
        results[i] = one
    return True
