"""A node's command batch: its bounds, its subject, and the per-GPU subject it replaces."""

from __future__ import annotations

import pytest

from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, InfoCmd, Reply, SetPowerLimitCmd
from zeus_agent.wire.node_command import (
    MAX_NODE_COMMANDS,
    NodeCommandBatch,
    NodeCommandReply,
)

LIMIT = CommandEnvelope(cmd=SetPowerLimitCmd(power_limit_w=200, holder="j", lease_s=30))


def item(gpu: object, envelope: object = None) -> dict:
    return {"gpu": gpu, "envelope": (envelope or LIMIT).model_dump()}  # type: ignore[attr-defined]


def test_a_batch_round_trips_and_keeps_its_items_order():
    batch = NodeCommandBatch.model_validate(
        {"items": [item(3), item(0, CommandEnvelope(cmd=InfoCmd()))]})
    again = codec.decode(codec.encode(batch), NodeCommandBatch)
    assert [i.gpu for i in again.items] == [3, 0]
    assert again.items[0].envelope == LIMIT and isinstance(again.items[1].envelope.cmd, InfoCmd)


@pytest.mark.parametrize("items", [
    [],  # nothing to run
    [item(1), item(1)],  # a GPU twice
    [item(i) for i in range(MAX_NODE_COMMANDS + 1)],  # too many
    [item(-1)],  # not a GPU index
    [{"gpu": 0, "envelope": {"v": 1, "cmd": {"op": "nope"}}}],  # not a command
    [{"gpu": 0, "envelope": LIMIT.model_dump(), "extra": 1}],  # an unknown field
])
def test_a_batch_out_of_bounds_is_a_bad_request(items):
    with pytest.raises(PayloadError):
        codec.decode(codec.encode({"v": 1, "items": items}), NodeCommandBatch)


def test_the_most_items_are_taken():
    batch = {"v": 1, "items": [item(i) for i in range(MAX_NODE_COMMANDS)]}
    assert len(codec.decode(codec.encode(batch), NodeCommandBatch).items) == MAX_NODE_COMMANDS


def test_a_reply_is_told_from_a_single_reply_by_its_key():
    node = codec.encode(NodeCommandReply(replies=[Reply.success(), Reply.failure("x", "y")]))
    one = codec.encode(Reply.failure("bad_request", "no"))
    assert isinstance(codec.decode_either(node, Reply, NodeCommandReply, "replies"),
                      NodeCommandReply)
    assert isinstance(codec.decode_either(one, Reply, NodeCommandReply, "replies"), Reply)


@pytest.mark.parametrize("node", ["gpu-a", "a b.c", "x" * 100, "*"])
def test_node_subject_of_a_gpus_subject_is_its_nodes(node):
    assert subjects.parse_node_command_of(subjects.gpu_command(node, 5, "t.p")) == (
        subjects.node_command(node, "t.p"), 5)
    assert subjects.node_command(node).startswith("zeus.agent.")
    assert subjects.node_command(node).endswith(".cmd")


@pytest.mark.parametrize("subject", [
    "zeus.gpu.n.0.sample", "zeus.gpu.n.x.cmd", "zeus.agent.n.cmd", "cmd", "zeus.gpu.n.².cmd",
])
def test_other_subjects_have_no_node_subject(subject):
    assert subjects.parse_node_command_of(subject) is None
