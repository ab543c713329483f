import asyncio
import time

import pytest

from zeus_agent.broker import EmbeddedNats, connect
from zeus_agent.errors import BrokerError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, InfoCmd, Reply


async def test_publish_and_request_through_a_real_server():
    async with EmbeddedNats() as server:
        assert server.running
        nc = await connect(server.url, "test")
        got: asyncio.Queue = asyncio.Queue()

        async def on_cmd(msg):
            env = codec.decode(msg.data, CommandEnvelope)
            await msg.respond(codec.encode(Reply.success(op=env.cmd.op)))

        await nc.subscribe(subjects.gpu_command("n1", 0), cb=on_cmd)
        await nc.subscribe("zeus.gpu.*.*.sample", cb=got.put)
        await nc.publish(subjects.gpu_samples("n1", 0), codec.encode({"v": 1}))
        msg = await asyncio.wait_for(got.get(), 2)
        assert msg.subject == "zeus.gpu.n1.0.sample"
        raw = await nc.request(
            subjects.gpu_command("n1", 0), codec.encode(CommandEnvelope(cmd=InfoCmd())), timeout=2
        )
        assert codec.decode(raw.data, Reply).result == {"op": "info"}
        await nc.drain()
    assert not server.running


async def test_connect_fails_fast_with_a_clear_message():
    start = time.monotonic()
    with pytest.raises(BrokerError, match="could not connect to NATS"):
        await connect("nats://127.0.0.1:1", "nobody", timeout_s=0.5)
    assert time.monotonic() - start < 3


def test_url_before_start_is_an_error():
    with pytest.raises(BrokerError, match="start"):
        _ = EmbeddedNats().url


async def test_confirmed_subscriptions_see_the_very_next_publish(nats_server):
    """nats-py's flush() can return before the server has a SUB; confirm_subscriptions can't."""
    from zeus_agent.broker import confirm_subscriptions

    listener = await connect(nats_server.url, "listener")
    talker = await connect(nats_server.url, "talker")
    try:
        for i in range(50):
            sub = await listener.subscribe(f"zeus.test.confirm.{i}")
            await confirm_subscriptions(listener)
            await talker.publish(f"zeus.test.confirm.{i}", b"x")
            assert (await sub.next_msg(timeout=2)).data == b"x"
            await sub.unsubscribe()
    finally:
        await listener.drain()
        await talker.drain()
