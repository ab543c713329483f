"""The simulated pipeline trainer's pure parts: 1F1B order, dependencies, timeline, placement,
and its command line's argument checks (no process is started)."""

from __future__ import annotations

import pytest

from zeus_agent.gpu.sim.trainers.pipeline import (
    BACKWARD,
    FORWARD,
    NodeSpec,
    one_f_one_b,
    place_ranks,
    timeline,
    waits_for,
)
from zeus_agent.gpu.sim.trainers.pipeline.cli import _parser

F, B = FORWARD, BACKWARD


def test_known_orders() -> None:
    # Four stages, four microbatches (the textbook picture).
    assert one_f_one_b(0, 4, 4) == [(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (B, 1), (B, 2), (B, 3)]
    assert one_f_one_b(1, 4, 4) == [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)]
    assert one_f_one_b(2, 4, 4) == [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (F, 3), (B, 2), (B, 3)]
    assert one_f_one_b(3, 4, 4) == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]
    assert one_f_one_b(0, 1, 3) == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 8, 16])
def test_order_invariants(num_stages: int, microbatches: int) -> None:
    for stage in range(num_stages):
        order = one_f_one_b(stage, num_stages, microbatches)
        warmup = min(num_stages - stage - 1, microbatches)
        assert len(order) == 2 * microbatches
        assert [mb for name, mb in order if name == F] == list(range(microbatches))
        assert [mb for name, mb in order if name == B] == list(range(microbatches))
        assert order[:warmup] == [(F, mb) for mb in range(warmup)]
        assert order[warmup] == (F, warmup) if warmup < microbatches else order[warmup] == (B, 0)
        # At most warmup + 1 microbatches in flight (1F1B's memory bound).
        in_flight = peak = 0
        for name, _ in order:
            in_flight += 1 if name == F else -1
            peak = max(peak, in_flight)
        assert peak == min(warmup + 1, microbatches)


def test_bad_arguments() -> None:
    for args in [(0, 0, 1), (4, 4, 1), (-1, 4, 1), (0, 4, 0)]:
        with pytest.raises(ValueError):
            one_f_one_b(*args)
    with pytest.raises(ValueError):
        waits_for(0, 2, "optimizer")


def test_dependencies() -> None:
    assert waits_for(0, 4, F) is None
    assert waits_for(2, 4, F) == 1
    assert waits_for(3, 4, B) is None
    assert waits_for(1, 4, B) == 2
    assert waits_for(0, 1, F) is None and waits_for(0, 1, B) is None


@pytest.mark.parametrize(("num_stages", "microbatches"), [(1, 4), (2, 2), (4, 8), (8, 3), (5, 16)])
def test_timeline_makespan_and_causality(num_stages: int, microbatches: int) -> None:
    tf, tb = 1.0, 2.0
    lines = timeline(num_stages, microbatches, lambda s, name: tf if name == F else tb)
    end = {(s, name, mb): e for s, line in enumerate(lines) for name, mb, _, e in line}
    for s, line in enumerate(lines):
        assert [(n, mb) for n, mb, _, _ in line] == one_f_one_b(s, num_stages, microbatches)
        last = 0.0
        for name, mb, start, stop in line:
            assert start >= last - 1e-9  # one instruction at a time
            peer = waits_for(s, num_stages, name)
            if peer is not None:
                assert start >= end[(peer, name, mb)] - 1e-9
            last = stop
    makespan = max(e for line in lines for *_, e in line)
    # Equal stages: (M + S - 1) * (tf + tb), the classic 1F1B iteration time.
    assert makespan == pytest.approx((microbatches + num_stages - 1) * (tf + tb))


def test_timeline_slow_stage_dominates() -> None:
    lines = timeline(4, 8, lambda s, name: (2.0 if s == 2 else 1.0) * (1 if name == F else 2))
    makespan = max(e for line in lines for *_, e in line)
    assert makespan >= 8 * 3 * 2.0  # the slow stage runs 8 forwards and 8 backwards


def test_place_ranks_megatron_order_over_two_nodes() -> None:
    a = NodeSpec("a", "/tmp/a.sock", "/tmp/sim-a", (0, 1, 2, 3))
    b = NodeSpec("b", "/tmp/b.sock", "/tmp/sim-b", (2, 3, 4, 5))
    places = place_ranks([a, b], stages=4, dp=2)
    assert [(p.rank, p.pp_rank, p.dp_rank) for p in places[:4]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)
    ]
    assert [(p.node, p.gpu_index) for p in places] == [
        ("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 2), ("b", 3), ("b", 4), ("b", 5)
    ]
    assert places[5].socket_path == "/tmp/b.sock" and places[5].sim_dir == "/tmp/sim-b"
    assert (places[7].pp_rank, places[7].dp_rank) == (3, 1)


def test_place_ranks_refusals() -> None:
    a = NodeSpec("a", "/tmp/a.sock", "/tmp/sim-a", (0, 1))
    with pytest.raises(ValueError, match="need 4 GPUs"):
        place_ranks([a], stages=4, dp=1)
    with pytest.raises(ValueError, match="twice"):
        place_ranks([a, NodeSpec("a2", "/tmp/x.sock", "/tmp/sim-a", (1,))], stages=1, dp=1)
    with pytest.raises(ValueError):
        place_ranks([a], stages=0, dp=1)


def test_cli_parses_nodes_and_straggler() -> None:
    args = _parser().parse_args([
        "--profile", "synthetic", "--stages", "2", "--dp", "2", "--straggler", "1:1.5",
        "--node", "a:/tmp/a.sock:/tmp/sim-a:0-1", "--node", "b:/tmp/b.sock:/tmp/sim-b:0,3",
    ])
    assert args.straggler == (1, 1.5)
    assert [n.gpus for n in args.node] == [(0, 1), (0, 3)]
    for bad in (["--straggler", "x"], ["--straggler", "1:0"], ["--node", "a:/s:/d"],
                ["--node", "a:/s:/d:x"], ["--iterations", "3", "--seconds", "2"],
                ["--time-scale", "0"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(bad)


def test_cli_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for option in ("--profile", "--stages", "--microbatches", "--dp", "--iterations",
                   "--seconds", "--time-scale", "--straggler", "--job-metadata", "--node",
                   "--socket", "--sim-dir", "--gpus", "--clock-wait-ms", "--ipc-timeout",
                   "--timeout", "--output"):
        assert option in out
