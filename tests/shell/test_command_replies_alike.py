"""`GpuCommands.request_all` decodes a reply's bytes once: GPUs that answer alike share one
`Reply`, and each GPU still gets its own answer (a bad one, a refusal, no answer)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coordinator.service.commands import GpuCommands
from zeus_agent.wire import codec
from zeus_agent.wire.messages import Reply

OK = codec.encode(Reply.success())
ANSWERS = {"g.0": OK, "g.1": OK, "g.2": b"\xc1", "g.3": codec.encode(
    Reply.failure("stale_lease", "over")), "g.4": OK, "g.5": codec.encode(
    Reply.success(capped_w=200))}


async def test_alike_replies_are_decoded_once_and_each_gpu_gets_its_own(nc: Any) -> None:
    async def answer(msg: Any) -> None:
        await msg.respond(ANSWERS[msg.subject])

    sub = await nc.subscribe("g.*", cb=answer)
    await nc.flush()
    try:
        commands = GpuCommands(SimpleNamespace(command_timeout_s=2.0),  # type: ignore[arg-type]
                               SimpleNamespace(nc=nc), None)  # type: ignore[arg-type]
        subjects = [*ANSWERS, "nobody.listens"]
        replies = await commands.request_all([(s, b"cmd") for s in subjects])
    finally:
        await sub.unsubscribe()
    assert replies is not None and len(replies) == len(subjects)
    ok = [r for r in replies if isinstance(r, Reply) and r.ok and not r.result]
    assert len(ok) == 3 and all(r is ok[0] for r in ok)  # One `Reply` for the alike bytes.
    assert isinstance(replies[2], str) and replies[2].startswith("bad reply")
    assert isinstance(replies[3], Reply) and replies[3].code == "stale_lease"
    assert isinstance(replies[5], Reply) and replies[5].result == {"capped_w": 200}
    assert isinstance(replies[6], str) and "no agent answers" in replies[6]
