"""Data parallel on a hand-built two-layer training step: exact step times with and without overlap."""
from __future__ import annotations

from onnx import helper

from memsched.data_parallel import allreduce_time, data_parallel
from memsched.schedule import Plan
from memsched.simulate import simulate
from .simgraphs import costs, hardware, lower

TIMES = dict(F1=1.0, F2=1.0, B2=1.0, B1x=1.0, B1=1.0, U2=0.5, U1=0.5)


def two_layers():
    """forward F1, F2; backward B2 (dW2), B1x (dX), B1 (dW1); update U2, U1 (SGD, one op each)."""
    nodes = [helper.make_node("Mul", ["x", "W1"], ["h"], name="F1"),
             helper.make_node("Mul", ["h", "W2"], ["y"], name="F2"),
             helper.make_node("Mul", ["h", "y"], ["gW2"], name="B2"),
             helper.make_node("Mul", ["y", "W2"], ["gh"], name="B1x"),
             helper.make_node("Mul", ["x", "gh"], ["gW1"], name="B1"),
             helper.make_node("Sub", ["W2", "gW2"], ["W2n"], name="U2"),
             helper.make_node("Sub", ["W1", "gW1"], ["W1n"], name="U1")]
    g = lower(nodes, ["x"], ["W1n", "W2n"], initializers=["W1", "W2"])
    for name, phase in (("B2", "backward"), ("B1x", "backward"), ("B1", "backward"), ("U2", "update"),
                        ("U1", "update")):
        g.op_by_name[name].phase = phase
    for name, kind in (("gW1", "param_grad"), ("gW2", "param_grad"), ("gh", "gradient")):
        g.tensors[name].kind = kind
    return g


def run(workers=2, bandwidth=1024.0, latency=0.0):
    plan = Plan.initial(two_layers())
    sim = simulate(plan, hardware(), costs(**TIMES))
    return data_parallel(plan, sim, workers, bandwidth, latency)


def test_ring_allreduce_formula():
    assert allreduce_time(1024, 2, 1024.0, 0.0) == 1.0
    assert allreduce_time(1024, 4, 1024.0, 0.5) == 2 * 3 / 4 + 2 * 3 * 0.5
    assert allreduce_time(1024, 1, 1024.0, 0.5) == 0.0


def test_overlap_hides_all_but_the_last_bucket():
    dp = run()
    assert [(b.op, b.nbytes, b.seconds) for b in dp.buckets] == [("B2", 1024, 1.0), ("B1", 1024, 1.0)]
    assert dp.compute_s == 6.0 and dp.allreduce_s == 2.0
    # no overlap: backward ends at 5, all-reduces 5..7, updates 7..8
    assert dp.step_no_overlap_s == 8.0
    # overlap: dW2's all-reduce (3..4) hides under B1x/B1; dW1's (5..6) does not; U2 runs in that gap
    # (5..5.5), U1 once it lands (6..6.5), then the next forward: a period of 6.5
    assert dp.step_overlap_s == 6.5 and dp.first_step_s == 6.5
    assert dp.exposed_comm_s == 0.5


def test_fast_network_costs_nothing_and_slow_network_bounds_the_step():
    fast = run(bandwidth=1024.0 * 1024)     # 1/1024 s per all-reduce, hidden under U2
    assert fast.step_overlap_s == 6.0
    slow = run(bandwidth=128.0)             # 8 s per all-reduce
    assert slow.allreduce_s == 16.0 and slow.step_no_overlap_s == 6.0 + 16.0
    # the next F1 needs W1, whose all-reduce queues behind W2's: F1..B2 (3 s), both all-reduces
    # (16 s), U1 (0.5 s) -- 19.5 s, the rest hidden
    assert slow.step_overlap_s == 19.5
