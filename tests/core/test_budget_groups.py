"""Budgets on the wire and against the cluster: validation, groups, cuts, floors, overlaps."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.budget.budgets import (
    BudgetRefused,
    Cluster,
    GpuInfo,
    governing,
    members,
    resolve,
)
from zeus_agent.wire.budget import Budget, BudgetGroup, BudgetRequest


def cluster() -> Cluster:
    c = Cluster()
    for node, rack in (("n1", "a"), ("n2", "a"), ("n3", "b")):
        c.announce(node, {"rack": rack}, {i: GpuInfo(100, 300) for i in range(2)})
        for i in range(2):
            c.sample(node, i, 250.0)
    return c


@pytest.mark.parametrize(
    "fields",
    [
        {"cap_w": -1.0},
        {"cap_w": float("nan")},
        {"cap_w": float("inf")},
        {"cap_w": 1e9},
        {"cut_pct": 100.0},
        {"cut_pct": 0.0},
        {"cap_w": 1e3, "cut_pct": 10.0},
        {},
        {"cap_w": 1e3, "start_s": 20.0, "end_s": 10.0},
        {"cap_w": 1e3, "group": {"kind": "label", "label": "no-equals"}},
        {"cap_w": 1e3, "group": {"kind": "nodes", "nodes": []}},
        {"cap_w": 1e3, "group": {"kind": "cluster", "nodes": ["n1"]}},
    ],
)
def test_bad_budgets_are_refused_on_the_wire(fields: dict) -> None:
    with pytest.raises(ValidationError):
        Budget.model_validate({"budget_id": "b", **fields})


def test_bad_ids_and_requests_are_refused() -> None:
    for bad in ("", "a.b", "a b", "x" * 65, "a>"):
        with pytest.raises(ValidationError):
            Budget(budget_id=bad, cap_w=1.0)
    with pytest.raises(ValidationError):
        BudgetRequest(action="set")
    with pytest.raises(ValidationError):
        BudgetRequest(action="lift")


def test_groups_cover_nodes_labels_or_everything() -> None:
    c = cluster()
    assert members(BudgetGroup(), c) == [(n, i) for n in ("n1", "n2", "n3") for i in (0, 1)]
    assert members(BudgetGroup(kind="label", label="rack=b"), c) == [("n3", 0), ("n3", 1)]
    assert members(BudgetGroup(kind="nodes", nodes=["n2"]), c) == [("n2", 0), ("n2", 1)]
    with pytest.raises(BudgetRefused, match="unknown node"):
        members(BudgetGroup(kind="nodes", nodes=["n9"]), c)
    with pytest.raises(BudgetRefused, match="no node is labelled rack=z"):
        members(BudgetGroup(kind="label", label="rack=z"), c)
    with pytest.raises(BudgetRefused, match="no agent announced a GPU"):
        members(BudgetGroup(), Cluster())


def test_a_cut_becomes_a_cap_of_the_measured_draw_and_the_floor_is_said() -> None:
    c = cluster()
    cut = resolve(Budget(budget_id="g", cut_pct=25.0), c)
    assert cut.cap_w == pytest.approx(0.75 * 6 * 250.0) and cut.cut_pct is None
    with pytest.raises(BudgetRefused, match="floor of the whole cluster: 600 W"):
        resolve(Budget(budget_id="g", cap_w=599.0), c)
    c.power_w.pop(("n3", 1))
    with pytest.raises(BudgetRefused, match="GPU 1 of node n3 has sent no sample"):
        resolve(Budget(budget_id="g", cut_pct=10.0), c)


def test_the_lower_cap_governs_shared_gpus_and_the_other_keeps_room_for_them() -> None:
    c = cluster()
    whole = Budget(budget_id="whole", cap_w=1200.0)
    rack = Budget(budget_id="rack", cap_w=400.0, group=BudgetGroup(kind="label", label="rack=a"))
    later = Budget(budget_id="later", cap_w=100.0, start_s=1e9)
    got = {g.budget_id: g for g in governing([whole, rack, later], c, now_s=10.0)}
    assert set(got) == {"whole", "rack"}
    assert got["rack"].gpus == (("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1))
    assert got["whole"].gpus == (("n3", 0), ("n3", 1))
    assert got["whole"].room_w == 800.0 and got["rack"].room_w == 400.0
    ended = Budget(budget_id="rack", cap_w=400.0, start_s=0.0, end_s=5.0,
                   group=BudgetGroup(kind="label", label="rack=a"))
    assert [g.budget_id for g in governing([whole, ended], c, now_s=10.0)] == ["whole"]


def test_a_hello_replaces_its_own_nodes_gpus_only() -> None:
    """A node announcing fewer GPUs loses the others (and their power); other nodes keep theirs.

    (The node's indices are kept beside the GPUs, so a hello costs its own GPUs, not a scan
    of the cluster's: at 100,000 GPUs a scan per hello saturated both replicas.)
    """
    c = cluster()
    c.announce("n1", {"rack": "c"}, {1: GpuInfo(150, 250), 2: GpuInfo(100, 300)})
    assert sorted(k for k in c.gpus if k[0] == "n1") == [("n1", 1), ("n1", 2)]
    assert c.gpus[("n1", 1)] == GpuInfo(150, 250)
    assert ("n1", 0) not in c.power_w and c.power_w[("n1", 1)] == 250.0
    assert c.labels["n1"] == {"rack": "c"}
    assert sorted(k for k in c.gpus if k[0] != "n1") == [
        ("n2", 0), ("n2", 1), ("n3", 0), ("n3", 1)]
    c.announce("n1", {}, {})
    assert not any(k[0] == "n1" for k in c.gpus) and "n1" in c.nodes()
    c.announce("n1", {}, {0: GpuInfo(100, 300)})
    assert [k for k in c.gpus if k[0] == "n1"] == [("n1", 0)]
