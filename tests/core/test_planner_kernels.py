"""The planner's compiled kernels against numpy and scipy on their own (no sweep).

The sweep's plans are only the plain version's bit for bit if a kernel's sum is numpy's to the
bit, and a max flow started from a rebalanced flow is a maximum one with the same least cut.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.pipeline.planner import kernels_flow, kernels_plans
from coordinator.pipeline.planner.cut import CutNetwork, _augment
from coordinator.pipeline.planner.dag import Synchronous1F1B, build_dag
from coordinator.pipeline.planner.graph import Graph

pytestmark = pytest.mark.core


def test_the_kernel_sum_is_numpys_to_the_bit() -> None:
    rng = np.random.default_rng(7)
    for size in [*range(0, 300), 1023, 1536, 2304, 3072, 4097]:
        values = rng.standard_normal(size) * 10.0 ** rng.uniform(-4, 4, size)
        assert kernels_plans._np_sum(values) == float(values.sum())
    assert str(kernels_plans._np_sum(np.array([-0.0]))) == str(float(np.array([-0.0]).sum()))


def _balanced(network: CutNetwork, flow: np.ndarray) -> bool:
    """Every node but the source and sink receives what it sends (antisymmetric flow)."""
    net = np.zeros(network.size, dtype=np.int64)
    np.add.at(net, network.row_of, flow)  # each node's outflow minus inflow
    return bool((net[: 2 * network.n] == 0).all())


@pytest.mark.parametrize("ratio", [1.0, 0.8, 1.25])
def test_a_rebalanced_flow_is_feasible_and_augments_to_scipys_cut(ratio: float) -> None:
    """Cut to smaller capacities, or scaled by `ratio` to new ones (a new capacity scale)."""
    network = CutNetwork(Graph(build_dag(Synchronous1F1B(4, 6))))
    rng = np.random.default_rng(3)
    forward = network._forward_arc
    for _ in range(20):
        caps = np.where(forward, rng.integers(0, 50, forward.size), 0).astype(np.int64)
        residual = caps.copy()
        kernels_flow.max_flow(network._indptr, network._heads, network.reverse, residual,
                         2 * network.n, 2 * network.n + 1)
        flow = caps - residual
        assert _balanced(network, flow)
        scaled = np.rint(caps * ratio).astype(np.int64)
        smaller = np.where(forward, scaled - rng.integers(0, 10, forward.size), 0).clip(0)
        start = kernels_flow.rebalance(flow, smaller, forward, network._order, network._indptr,
                                  network._heads, network.reverse, ratio)
        assert _balanced(network, start)
        assert (start <= smaller).all() and (start[forward] >= 0).all()
        residual = smaller - start
        side = kernels_flow.max_flow(network._indptr, network._heads, network.reverse, residual,
                                2 * network.n, 2 * network.n + 1)
        plain = smaller.copy()
        plain -= _augment(plain, network.key, network.size)
        assert (side == network._search(plain)).all()
        source = network.from_source
        assert (smaller - residual)[source].sum() == (smaller - plain)[source].sum()
