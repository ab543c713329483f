"""Budgets against the cluster: which GPUs a group covers, its floor, its cap, who governs a GPU.

Pure: the service feeds it the agents' announcements and samples (`Cluster`), and asks.

* A group covers the GPUs of the nodes it names (`nodes`), of the nodes whose agent announced
  its label (`label`), or of every announced node (`cluster`). A group that covers no announced
  GPU, or names a node no agent announced, is refused: a budget nobody can hold is a typo.
* A cut (`cut_pct`) becomes a cap when the budget is set: the group's measured draw (the last
  sample of each of its GPUs) less the cut. Every GPU of the group must have been sampled.
* The floor of a group is the sum of its GPUs' minimum power limits: the least power limits can
  hold it to. A cap below it is refused, saying the floor.
* Overlaps: a GPU covered by several active budgets is governed by the one with the lowest cap
  (equal caps: the lower budget id). A budget's room for the GPUs it governs is its cap less,
  for every other budget governing GPUs of its group, that budget's cap times the share of that
  budget's GPUs inside the group (they may draw up to it). So the lower cap wins on every GPU,
  and no budget is exceeded by GPUs another one governs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from zeus_agent.errors import ReplyError
from zeus_agent.wire.budget import Budget, BudgetGroup

GpuKey = tuple[str, int]
"""(node, GPU index)."""


class BudgetRefused(ReplyError, ValueError):
    """A budget the cluster cannot take; the message says why and what to do."""

    code = "bad_request"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """What the coordinator knows of one GPU from its agent's announcement."""

    min_limit_w: int
    max_limit_w: int


@dataclass
class Cluster:
    """The announced nodes, their labels and GPUs, and each GPU's last measured power."""

    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    gpus: dict[GpuKey, GpuInfo] = field(default_factory=dict)
    power_w: dict[GpuKey, float] = field(default_factory=dict)
    indices: dict[str, set[int]] = field(default_factory=dict)
    """Each node's announced GPU indices: a hello replaces its own node's GPUs without a scan
    of every GPU (a scan per hello saturated both replicas at 100,000 GPUs)."""

    def announce(self, node: str, labels: Mapping[str, str], gpus: Mapping[int, GpuInfo]) -> None:
        """An agent's announcement: its labels and GPUs replace what was known of the node."""
        self.labels[node] = dict(labels)
        for index in self.indices.get(node, set()).difference(gpus):
            del self.gpus[(node, index)]
            self.power_w.pop((node, index), None)
        for index, info in gpus.items():
            self.gpus[(node, index)] = info
        self.indices[node] = set(gpus)

    def sample(self, node: str, index: int, power_w: float) -> None:
        """A GPU's latest measured power (W)."""
        self.power_w[(node, index)] = power_w

    def nodes(self) -> list[str]:
        """The announced nodes, sorted."""
        return sorted(self.labels)


def members(group: BudgetGroup, cluster: Cluster) -> list[GpuKey]:
    """The GPUs `group` covers, sorted.

    Raises:
        BudgetRefused: The group covers no announced GPU, or names an unknown node.
    """
    if group.kind == "nodes":
        unknown = [n for n in group.nodes if n not in cluster.labels]
        if unknown:
            raise BudgetRefused(
                f"unknown node(s) {', '.join(unknown[:5])}: no agent announced them (known: "
                f"{', '.join(cluster.nodes()[:10]) or 'none'})"
            )
        nodes = set(group.nodes)
    elif group.kind == "label":
        assert group.label is not None
        key, value = group.label.split("=", 1)
        nodes = {n for n, labels in cluster.labels.items() if labels.get(key) == value}
        if not nodes:
            raise BudgetRefused(
                f"no node is labelled {group.label}: start its agents with "
                f"`zeus-agent run --labels {group.label}`"
            )
    else:
        nodes = set(cluster.labels)
    covered = sorted(k for k in cluster.gpus if k[0] in nodes)
    if not covered:
        raise BudgetRefused(f"{group.describe()}: no agent announced a GPU there")
    return covered


def floor_w(gpus: Iterable[GpuKey], cluster: Cluster) -> float:
    """The least the GPUs can be held to: each at its minimum power limit."""
    return float(sum(cluster.gpus[k].min_limit_w for k in gpus))


def draw_w(gpus: Iterable[GpuKey], cluster: Cluster) -> float:
    """The GPUs' measured draw now (their last samples).

    Raises:
        BudgetRefused: A GPU has not been sampled yet.
    """
    total = 0.0
    for key in gpus:
        if key not in cluster.power_w:
            raise BudgetRefused(
                f"GPU {key[1]} of node {key[0]} has sent no sample yet: give a cap in watts, "
                "or retry in a few seconds"
            )
        total += cluster.power_w[key]
    return total


def resolve(budget: Budget, cluster: Cluster) -> Budget:
    """The budget with its cap in watts, checked against its group's floor.

    Raises:
        BudgetRefused: Unknown group, unsampled GPUs (for a cut), or a cap below the floor.
    """
    gpus = members(budget.group, cluster)
    cap = budget.cap_w
    if cap is None:
        assert budget.cut_pct is not None
        cap = draw_w(gpus, cluster) * (1 - budget.cut_pct / 100)
    floor = floor_w(gpus, cluster)
    if cap < floor:
        raise BudgetRefused(
            f"cap {cap:.0f} W is below the floor of {budget.group.describe()}: {floor:.0f} W "
            f"(its {len(gpus)} GPUs at their minimum power limits); no power limit holds less"
        )
    return budget.model_copy(update={"cap_w": round(cap, 3), "cut_pct": None})


@dataclass(frozen=True, slots=True)
class Governed:
    """The GPUs one budget governs, and the room it has for them."""

    budget_id: str
    cap_w: float
    room_w: float
    gpus: tuple[GpuKey, ...]


def governing(budgets: Iterable[Budget], cluster: Cluster, now_s: float) -> list[Governed]:
    """Who governs each GPU among the active budgets (see the module), by budget id.

    Budgets whose group no longer covers an announced GPU govern nothing.
    """
    groups: dict[str, tuple[float, set[GpuKey]]] = {}
    for b in budgets:
        if not b.active(now_s) or b.cap_w is None:
            continue
        try:
            groups[b.budget_id] = (b.cap_w, set(members(b.group, cluster)))
        except BudgetRefused:
            continue
    owner: dict[GpuKey, str] = {}
    for bid, (_, gpus) in sorted(groups.items(), key=lambda kv: (kv[1][0], kv[0])):
        for key in gpus:
            owner.setdefault(key, bid)
    out = []
    for bid, (cap, gpus) in sorted(groups.items()):
        mine = tuple(sorted(k for k in gpus if owner[k] == bid))
        room = cap
        for other, (other_cap, other_gpus) in groups.items():
            governed = {k for k in other_gpus if owner[k] == other}
            inside = len(governed & gpus)
            if other != bid and inside:
                room -= other_cap * inside / len(governed)
        out.append(Governed(bid, cap, max(0.0, room), mine))
    return out
