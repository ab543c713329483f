"""`RankRelay`: a node's rank registrations relayed together (a fake coordinator here).

Registrations arriving together go in one `RegisterRanks` request, each trainer getting its own
rank's reply; the batch leaves as soon as every GPU of the node has one waiting, else after the
window; a lone one goes as a plain `RegisterRank`; a coordinator that refuses batches gets each
rank on its own (remembered for a while); a failure of the whole request reaches every
waiting trainer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zeus_agent.agent import rank_relay
from zeus_agent.agent.rank_relay import RankRelay
from zeus_agent.errors import UnansweredError
from zeus_agent.models import RankInfo
from zeus_agent.wire import codec
from zeus_agent.wire.messages import GpuBinding, GpuDescription, RegisterRank, Reply
from zeus_agent.wire.rank_columns import decode_registration

SUBJECT = "zeus.coord.ranks.register.n1"


def _rank(rank: int) -> RegisterRank:
    return RegisterRank(job_id="j", rank_info=RankInfo(rank=rank, dp_rank=rank, pp_rank=0,
                                                       tp_rank=0, available_frequencies=[]),
                        gpu=GpuBinding(node="n1", gpu_index=rank))


def _described(rank: int) -> RegisterRank:
    """A rank as the agent relays it, with its GPU's description: it has columns."""
    return _rank(rank).model_copy(update={"gpu_info": GpuDescription(
        index=rank, uuid=f"GPU-{rank}", name="A40", architecture="Ampere",
        min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
        supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
        has_energy_counter=True, power_limit_w=300)})


def _layouts(requests: list[dict[str, Any]]) -> list[str]:
    return ["columns" if "columns" in r else "rows" if "ranks" in r else "one"
            for r in requests]


class Coordinator:
    """Answers each rank with its number; `batches` False: refuses batches as before them."""

    def __init__(self, batches: bool = True, fail: Exception | None = None,
                 whole: Reply | None = None, columns: bool = True) -> None:
        self.batches, self.fail, self.whole, self.columns = batches, fail, whole, columns
        self.requests: list[Any] = []

    async def send(self, subject: str, payload: bytes) -> Reply:
        assert subject == SUBJECT
        await asyncio.sleep(0)
        raw = codec.unpack(payload)
        self.requests.append(raw)
        if self.fail is not None:
            raise self.fail
        if "ranks" not in raw and "columns" not in raw:
            return Reply.success(rank=codec.validate(RegisterRank, raw).rank_info.rank)
        if not self.batches or ("columns" in raw and not self.columns):
            return Reply.failure("bad_request", "field 'job_id': Field required")
        if self.whole is not None:
            return self.whole
        batch = decode_registration(payload)
        assert isinstance(batch, list)
        return Reply.success(replies=[Reply.success(rank=r.rank_info.rank).model_dump()
                                      for r in batch])


async def test_a_nodes_ranks_go_in_one_request_once_every_gpu_has_one() -> None:
    coordinator = Coordinator()
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 4, window_s=60)  # never by the timer
    replies = await asyncio.wait_for(
        asyncio.gather(*(relay.relay(_rank(r)) for r in (2, 0, 3, 1))), 5)
    assert [r.result["rank"] for r in replies] == [2, 0, 3, 1]  # each trainer its own
    assert len(coordinator.requests) == 1 == relay.requests
    assert [r["rank_info"]["rank"] for r in coordinator.requests[0]["ranks"]] == [2, 0, 3, 1]


async def test_fewer_than_the_nodes_gpus_leave_after_the_window() -> None:
    coordinator = Coordinator()
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 8, window_s=0.01)
    replies = await asyncio.wait_for(asyncio.gather(relay.relay(_rank(0)), relay.relay(_rank(1))),
                                     5)
    assert [r.result["rank"] for r in replies] == [0, 1]
    assert len(coordinator.requests) == 1 and "ranks" in coordinator.requests[0]
    alone = await asyncio.wait_for(relay.relay(_rank(5)), 5)
    assert alone.result["rank"] == 5
    assert "ranks" not in coordinator.requests[1]  # a plain RegisterRank


async def test_a_coordinator_without_batches_gets_each_rank_on_its_own() -> None:
    coordinator = Coordinator(batches=False)
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 2)
    replies = await asyncio.wait_for(asyncio.gather(relay.relay(_rank(0)), relay.relay(_rank(1))),
                                     5)
    assert [(r.ok, r.result["rank"]) for r in replies] == [(True, 0), (True, 1)]
    assert ["ranks" in r for r in coordinator.requests] == [True, False, False]
    # The refusal is remembered: the node's next ranks go one each at once, not refused again.
    replies = await asyncio.wait_for(asyncio.gather(relay.relay(_rank(2)), relay.relay(_rank(3))),
                                     5)
    assert [r.result["rank"] for r in replies] == [2, 3]
    assert ["ranks" in r for r in coordinator.requests[3:]] == [False, False]


async def test_batches_are_tried_again_once_the_refusal_is_old(
        monkeypatch: pytest.MonkeyPatch) -> None:
    coordinator = Coordinator(batches=False)
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 2)
    await asyncio.wait_for(asyncio.gather(relay.relay(_rank(0)), relay.relay(_rank(1))), 5)
    coordinator.batches = True  # (The coordinators were upgraded meanwhile.)
    monkeypatch.setattr(rank_relay, "REFUSAL_MEMORY_S", 0.0)
    await asyncio.wait_for(asyncio.gather(relay.relay(_rank(2)), relay.relay(_rank(3))), 5)
    assert ["ranks" in r for r in coordinator.requests[3:]] == [True]


async def test_a_failed_request_reaches_every_waiting_trainer() -> None:
    relay = RankRelay(Coordinator(fail=UnansweredError("nobody")).send, SUBJECT, lambda: 2)
    results = await asyncio.gather(relay.relay(_rank(0)), relay.relay(_rank(1)),
                                   return_exceptions=True)
    assert [type(r) for r in results] == [UnansweredError, UnansweredError]
    down = Reply.failure("unavailable", "JetStream is down")
    relay = RankRelay(Coordinator(whole=down).send, SUBJECT, lambda: 2)
    replies = await asyncio.gather(relay.relay(_rank(0)), relay.relay(_rank(1)))
    assert [(r.ok, r.code) for r in replies] == [(False, "unavailable")] * 2


async def test_a_trainer_that_gave_up_leaves_the_others_their_replies() -> None:
    coordinator = Coordinator()
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 3, window_s=0.01)
    gone = asyncio.ensure_future(relay.relay(_rank(0)))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    replies = await asyncio.wait_for(asyncio.gather(relay.relay(_rank(1)), relay.relay(_rank(2))),
                                     5)
    assert [r.result["rank"] for r in replies] == [1, 2]
    assert [r["rank_info"]["rank"] for r in coordinator.requests[0]["ranks"]] == [1, 2]


async def test_described_ranks_go_in_columns() -> None:
    coordinator = Coordinator()
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 2)
    replies = await asyncio.wait_for(
        asyncio.gather(relay.relay(_described(1)), relay.relay(_described(0))), 5)
    assert [r.result["rank"] for r in replies] == [1, 0]
    assert _layouts(coordinator.requests) == ["columns"] and coordinator.requests[0]["rank"] == [
        1, 0]
    # Without descriptions (or `columns()` False), rows.
    await asyncio.wait_for(asyncio.gather(relay.relay(_rank(2)), relay.relay(_rank(3))), 5)
    relay.columns = lambda: False
    await asyncio.wait_for(asyncio.gather(relay.relay(_described(4)),
                                          relay.relay(_described(5))), 5)
    assert _layouts(coordinator.requests) == ["columns", "rows", "rows"]


async def test_a_coordinator_without_columns_gets_rows_then_columns_again_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    coordinator = Coordinator(columns=False)
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 2)
    replies = await asyncio.wait_for(
        asyncio.gather(relay.relay(_described(0)), relay.relay(_described(1))), 5)
    assert [(r.ok, r.result["rank"]) for r in replies] == [(True, 0), (True, 1)]
    assert _layouts(coordinator.requests) == ["columns", "rows"]
    await asyncio.wait_for(asyncio.gather(relay.relay(_described(2)),
                                          relay.relay(_described(3))), 5)
    assert _layouts(coordinator.requests)[2:] == ["rows"]  # (Remembered: rows at once.)
    coordinator.columns = True  # (The coordinators were upgraded meanwhile.)
    monkeypatch.setattr(rank_relay, "REFUSAL_MEMORY_S", 0.0)
    await asyncio.wait_for(asyncio.gather(relay.relay(_described(4)),
                                          relay.relay(_described(5))), 5)
    assert _layouts(coordinator.requests)[3:] == ["columns"]


async def test_columns_refused_with_their_rows_go_rank_by_rank() -> None:
    coordinator = Coordinator(batches=False)  # (Refuses any batch, rows or columns.)
    relay = RankRelay(coordinator.send, SUBJECT, lambda: 2)
    replies = await asyncio.wait_for(
        asyncio.gather(relay.relay(_described(0)), relay.relay(_described(1))), 5)
    assert [(r.ok, r.result["rank"]) for r in replies] == [(True, 0), (True, 1)]
    assert _layouts(coordinator.requests) == ["columns", "rows", "one", "one"]
    await asyncio.wait_for(asyncio.gather(relay.relay(_described(2)),
                                          relay.relay(_described(3))), 5)
    assert _layouts(coordinator.requests)[4:] == ["one", "one"]
