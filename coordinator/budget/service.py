"""`BudgetService`: the coordinator's budget endpoint and its view of the cluster.

* `<p>.coord.budget` (`BudgetRequest` -> `Reply`): set, show and lift budgets, for the operator
  role (`zeus-coordinator nats-auth --operator NAME`; NATS refuses everybody else's requests).
  A budget is checked against the cluster (`coordinator.budget.budgets.resolve`: its group,
  its cap or cut, its floor) before it is written; a refused one changes nothing.
* It follows the agents' announcements (nodes, labels, GPUs' limit ranges) and each GPU's
  latest power: what groups, floors and cuts are computed from. The power comes from one
  `NodePower` per node and publish interval; a node whose agent sends none (older than it) by
  its second announcement has its per-GPU samples followed instead, until it does.

Budgets live in the state bucket (`coordinator.budget.store`), so any replica answers and a
replica that takes over finds them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from coordinator.budget import budgets as core
from coordinator.budget.store import BudgetStore, LiftedCaps
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetRequest
from zeus_agent.wire.messages import AgentHello, Reply, SampleBatch
from zeus_agent.wire.node_cap import MAX_CAP_LEASE_S
from zeus_agent.wire.node_power import NodePower
from zeus_agent.wire.permissions import ANY, pattern

if TYPE_CHECKING:  # (coordinator.service builds this service: no import cycle at run time)
    from coordinator.service.link import Link

LOG = logging.getLogger(__name__)

Callback = Callable[[Any], Awaitable[None]]

MAX_NODE_SUBSCRIPTIONS = 256
"""Older nodes followed by a subscription each; beyond, one to every GPU's samples.

A subscription costs a replica an asyncio task and ~5 kB (10,000 took 48 MB), and a departed
node's was never dropped: a fleet of older agents (coordinators upgraded first) grew them
without bound."""


class BudgetService:
    """Answers budget requests; knows the cluster from announcements and samples."""

    def __init__(self, prefix: str, link: Link, cluster: core.Cluster | None = None, *,
                 on_lift: Callable[[Budget], Awaitable[None]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.prefix = prefix
        self.link = link
        self.wall = wall
        self.cluster = cluster if cluster is not None else core.Cluster()
        """The GPUs, labels and samples learnt here (shared with the loop that plans on them)."""
        self.on_lift = on_lift
        self.power_seen: dict[str, float] = {}
        """Node token -> when its last `NodePower` came (wall clock)."""
        self.power_gap: dict[str, float] = {}
        """Node token -> the time between its last two `NodePower`s (its publish interval)."""
        self.agent_ids: dict[str, str] = {}
        """Node token -> its agent's id in its last announcement (a new one: a restarted agent)."""
        self.hellos: dict[str, int] = {}
        """Node token -> announcements heard from it while it sent no `NodePower`."""
        self.sample_subs: dict[str, Any] = {}
        """Node token -> the subscription to its per-GPU samples (an agent without NodePower)."""
        self.followed: set[str] = set()
        """Node tokens whose per-GPU samples are read (`sample_subs`' or through `all_samples`)."""
        self.all_samples: Any = None
        """One subscription to every GPU's samples, once more nodes are followed than
        `MAX_NODE_SUBSCRIPTIONS` (until none is)."""
        """Lifts a budget's caps at once (`BudgetLoop.lift`; the owner lifts them too)."""

    def subscriptions(self) -> list[tuple[str, Callback]]:
        """(subject, callback) of what the service follows."""
        p = self.prefix
        return [
            (subjects.all_agent_hellos(p), self.on_hello),
            (subjects.all_agent_power(p), self.on_power),
        ]

    async def on_hello(self, msg: Any) -> None:
        """An agent's announcement: its node's labels and GPUs."""
        try:
            hello = codec.decode(msg.data, AgentHello)
        except PayloadError:
            return  # Counted by the coordinator's own hello handler.
        if subjects.token(hello.node) != subjects.parse_agent_hello(msg.subject):
            return
        gpus = {g.index: core.GpuInfo(g.min_power_limit_w, g.max_power_limit_w)
                for g in hello.gpus}
        self.cluster.announce(hello.node, hello.labels, gpus)
        await self._follow_samples_if_needed(subjects.token(hello.node), hello)

    async def _follow_samples_if_needed(self, node: str, hello: AgentHello) -> None:
        """Follow a node's per-GPU samples when its agent sends no `NodePower` (older).

        Decided at its second announcement: the first may come before its first publish.
        A restarted agent (a new id: perhaps downgraded) is judged afresh, from its first.
        A node whose `NodePower` stopped for three heartbeats and three of its publish intervals
        is followed again too (an interval longer than the heartbeats is no stop: following
        and leaving its samples every interval made the subscriptions flap).
        """
        if self.agent_ids.get(node, hello.agent_id) != hello.agent_id:
            self.power_seen.pop(node, None)
            self.power_gap.pop(node, None)
            self.hellos.pop(node, None)
        self.agent_ids[node] = hello.agent_id
        seen = self.power_seen.get(node)
        patience = max(3 * hello.heartbeat_s, 3 * self.power_gap.get(node, 0.0), 10.0)
        if seen is not None and self.wall() - seen <= patience:
            return
        self.hellos[node] = heard = self.hellos.get(node, 0) + 1
        if heard < 2 or node in self.followed or self.link.nc is None:
            return
        self.followed.add(node)
        if self.all_samples is None and len(self.followed) > MAX_NODE_SUBSCRIPTIONS:
            self.all_samples = await self.link.nc.subscribe(
                pattern(subjects.gpu_samples, ANY, ANY, prefix=self.prefix), cb=self.on_samples)
            for sub in self.sample_subs.values():
                await sub.unsubscribe()
            self.sample_subs.clear()
        if self.all_samples is None:
            subject = pattern(subjects.gpu_samples, node, ANY, prefix=self.prefix)
            self.sample_subs[node] = await self.link.nc.subscribe(subject, cb=self.on_samples)
        LOG.info("node %s sends no power readings (an older agent?): following its GPUs' "
                 "samples", hello.node)

    async def on_power(self, msg: Any) -> None:
        """A node's GPUs' latest power draws."""
        try:
            power = codec.decode(msg.data, NodePower)
        except PayloadError as e:
            self.link.drop("malformed", msg.subject, e)
            return
        node = subjects.token(power.node)
        if node != subjects.parse_agent_power(msg.subject):
            self.link.drop("wrong_node", msg.subject,
                           f"power readings of node {power.node!r} on another node's subject")
            return
        announced = self.cluster.indices.get(power.node, ())
        for index, watts in power.readings():
            if index in announced:  # (Any other index would be kept forever: a leak.)
                self.cluster.sample(power.node, index, watts)
        now = self.wall()
        if (last := self.power_seen.get(node)) is not None:
            self.power_gap[node] = now - last
        self.power_seen[node] = now
        self.hellos.pop(node, None)
        self.followed.discard(node)
        sub = self.sample_subs.pop(node, None)
        if sub is not None:
            await sub.unsubscribe()
        if self.all_samples is not None and not self.followed:
            sub, self.all_samples = self.all_samples, None
            await sub.unsubscribe()

    async def on_samples(self, msg: Any) -> None:
        """A GPU's samples: its latest power."""
        try:
            batch = codec.decode(msg.data, SampleBatch)
        except PayloadError:
            return
        parsed = subjects.parse_gpu_subject(msg.subject)
        if parsed is None or parsed.node not in self.followed \
                or parsed.node != subjects.token(batch.node) or not batch.samples \
                or batch.gpu not in self.cluster.indices.get(batch.node, ()):
            return
        self.cluster.sample(batch.node, batch.gpu, batch.samples[-1].power_w)

    def store(self) -> BudgetStore:
        """The budgets in the state bucket (opened at start-up)."""
        state = self.link.require_state()
        return BudgetStore(state.kv, state.js, state.bucket)

    async def handle(self, data: bytes, subject: str = "") -> Reply:
        """One operator request (`BudgetRequest`).

        Raises:
            BudgetRefused: A budget the cluster cannot take (the endpoint answers `bad_request`
                through `reply_for`).
        """
        request = codec.decode(data, BudgetRequest)
        store = self.store()
        if request.action == "show":
            found = await store.all()
            if request.budget_id is not None:
                found = {k: v for k, v in found.items() if k == request.budget_id}
                if not found:
                    return Reply.failure("bad_request", f"no budget {request.budget_id!r}")
            return Reply.success(budgets=[self.describe(b, at) for b, at in
                                          (found[k] for k in sorted(found))])
        if request.action == "lift":
            assert request.budget_id is not None
            held = await store.get(request.budget_id)
            if held is not None:  # Its caps are lifted until every GPU took the lift.
                await self.keep_lifted(held[0])
            if not await store.delete(request.budget_id):
                return Reply.failure("bad_request", f"no budget {request.budget_id!r} to lift "
                                     "(see `zeus-coordinator budget show`)")
            LOG.info("budget %s lifted", request.budget_id)
            if held is not None and self.on_lift is not None:
                await self.on_lift(held[0])
            return Reply.success(lifted=request.budget_id)
        assert request.budget is not None
        budget = core.resolve(request.budget, self.cluster)  # BudgetRefused: bad_request
        now = self.wall()
        if budget.end_s is not None and budget.end_s <= now:
            return Reply.failure("bad_request", f"end_s {budget.end_s} has already passed")
        await store.put(budget, now)
        LOG.info("budget %s set: %.0f W over %s", budget.budget_id, budget.cap_w or 0,
                 budget.group.describe())
        others = (b for b, _ in (await store.all()).values() if b.budget_id != budget.budget_id)
        overlaps = self.overlaps(budget, list(others))
        return Reply.success(budget=self.describe(budget, now), overlaps=overlaps)

    async def keep_lifted(self, budget: Budget) -> None:
        """Record a budget being lifted (`LiftedCaps`): its GPUs, until its caps lapse."""
        try:
            gpus = core.members(budget.group, self.cluster)
        except core.BudgetRefused:
            gpus = []
        now = self.wall()
        end = budget.end_s if budget.end_s is not None else math.inf
        until = min(end, now + MAX_CAP_LEASE_S)
        await LiftedCaps(self.link.require_state().kv).put(budget.budget_id, list(gpus), until)

    def overlaps(self, budget: Budget, others: list[Budget]) -> list[str]:
        """Ids of the budgets sharing a GPU with `budget` (the lower cap wins there)."""
        try:
            mine = set(core.members(budget.group, self.cluster))
        except core.BudgetRefused:
            return []
        out = []
        for other in others:
            try:
                if mine & set(core.members(other.group, self.cluster)):
                    out.append(other.budget_id)
            except core.BudgetRefused:
                continue
        return sorted(out)

    def describe(self, budget: Budget, set_at: float) -> dict[str, Any]:
        """A budget for people and tools: the budget, its state, its GPUs, floor and draw."""
        now = self.wall()
        state = ("active" if budget.active(now) else
                 "ended" if budget.end_s is not None and now >= budget.end_s else "pending")
        out: dict[str, Any] = {**budget.model_dump(), "set_at": set_at, "state": state,
                               "group_text": budget.group.describe()}
        try:
            gpus = core.members(budget.group, self.cluster)
        except core.BudgetRefused as e:
            out.update(gpus=0, problem=str(e))
            return out
        out.update(gpus=len(gpus), floor_w=core.floor_w(gpus, self.cluster))
        sampled = [k for k in gpus if k in self.cluster.power_w]
        out["draw_w"] = (round(sum(self.cluster.power_w[k] for k in sampled), 1)
                         if sampled else None)
        return out
