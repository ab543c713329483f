"""`node_groups`: a job's GPU commands grouped by node, and the replies split back (pure)."""

from __future__ import annotations

from coordinator import node_groups
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, InfoCmd, Reply, SetPowerLimitCmd
from zeus_agent.wire.node_command import MAX_NODE_COMMANDS, NodeCommandBatch, NodeCommandReply

LIMIT = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(power_limit_w=200, holder="j",
                                                          lease_s=30)))
INFO = codec.encode(CommandEnvelope(cmd=InfoCmd()))


def reqs(*pairs: tuple[str, int]) -> list[tuple[str, bytes]]:
    return [(subjects.gpu_command(node, gpu), LIMIT) for node, gpu in pairs]


def test_nodes_of_two_or_more_go_as_one_batch_and_the_others_alone():
    requests = reqs(("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("c", 1))
    plan = node_groups.plan(requests)
    assert [(b.subject, b.indices, b.gpus) for b in plan.batches] == [
        (subjects.node_command("a"), (0, 2, 4), (0, 1, 2)),
        (subjects.node_command("c"), (3, 5), (0, 1))]
    assert plan.singles == (1,)


def test_nodes_sent_per_gpu_duplicates_and_other_subjects_go_alone():
    requests = [*reqs(("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 1)), ("other.subject", b"")]
    plan = node_groups.plan(requests, per_gpu={subjects.node_command("a")})
    assert [(b.subject, b.indices) for b in plan.batches] == [(subjects.node_command("b"), (2, 3))]
    assert plan.singles == (0, 1, 4, 5)


def test_a_node_of_more_than_the_most_items_gets_several_batches():
    n = MAX_NODE_COMMANDS + 3
    plan = node_groups.plan(reqs(*(("a", g) for g in range(n))))
    assert [len(b.indices) for b in plan.batches] == [MAX_NODE_COMMANDS, 3]
    assert plan.singles == ()


def test_min_per_node_one_batches_every_node():
    plan = node_groups.plan(reqs(("a", 0), ("b", 0)), min_per_node=1)
    assert len(plan.batches) == 2 and plan.singles == ()


def test_the_payload_is_the_batch_of_the_requests_bytes_as_they_are():
    for n in (2, 15, 16, 200):
        requests = [(subjects.gpu_command("a", g), INFO if g % 2 else LIMIT) for g in range(n)]
        (batch,) = node_groups.plan(requests).batches
        decoded = codec.decode(node_groups.batch_payload(batch, requests), NodeCommandBatch)
        assert [i.gpu for i in decoded.items] == list(range(n))
        assert [codec.encode(i.envelope) for i in decoded.items] == [p for _, p in requests]


def test_split_puts_each_reply_in_its_requests_slot():
    batch = node_groups.Batch("s", (4, 1), (0, 1))
    results: list[Reply | str | None] = [None] * 5
    ok, no = Reply.success(), Reply.failure("stale_lease", "over")
    assert node_groups.split(batch, NodeCommandReply(replies=[ok, no]), results)
    assert results == [None, no, None, None, ok]


def test_split_says_per_gpu_when_the_batch_has_no_usable_answer():
    batch = node_groups.Batch("s", (0, 1), (0, 1))
    for reply in ("no agent answers", "no reply within 2 s",
                  Reply.failure("bad_request", "unknown"),
                  NodeCommandReply(replies=[Reply.success()])):
        results: list[Reply | str | None] = [None, None]
        assert not node_groups.split(batch, reply, results)
        assert results == [None, None]


def test_a_nodes_commands_beyond_the_most_bytes_go_in_several_batches():
    big = codec.encode({"v": 1, "cmd": {"op": "info", "pad": "x" * 200_000}})
    requests = [(subjects.gpu_command("a", g), big) for g in range(5)]
    plan = node_groups.plan(requests)
    assert [b.indices for b in plan.batches] == [(0, 1), (2, 3)]
    assert plan.singles == (4,)
    for b in plan.batches:
        assert len(node_groups.batch_payload(b, requests)) <= node_groups.MAX_BATCH_BYTES
