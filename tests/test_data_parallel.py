"""Data parallel: gradient buckets, exact step times with and without overlap, the per-worker plan."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper

from memsched.data_parallel import (DEFAULT_BUCKET_BYTES, allreduce_time, data_parallel, gradient_buckets,
                                    plan_options, readers, weight_gradients)
from memsched.errors import UserError
from memsched.memory import validate
from memsched.schedule import Plan, order_schedule
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


def run(workers=2, bandwidth=1024.0, latency=0.0, bucket_bytes=1, order=None):
    plan = Plan.initial(two_layers())
    if order is not None:
        plan = dataclasses.replace(plan, schedule=order_schedule(order))
    sim = simulate(plan, hardware(), costs(**TIMES))
    return data_parallel(plan, sim, workers, bandwidth, latency, bucket_bytes)


def test_ring_allreduce_formula():
    assert allreduce_time(1024, 2, 1024.0, 0.0) == 1.0
    assert allreduce_time(1024, 4, 1024.0, 0.5) == 2 * 3 / 4 + 2 * 3 * 0.5
    assert allreduce_time(1024, 1, 1024.0, 0.5) == 0.0


def test_overlap_hides_all_but_the_last_bucket():
    dp = run()           # 1-byte buckets: each dW op closes its own
    assert [(b.op, b.nbytes, b.seconds) for b in dp.buckets] == [("B2", 1024, 1.0), ("B1", 1024, 1.0)]
    assert dp.compute_s == 6.0 and dp.allreduce_s == 2.0
    # no overlap: backward ends at 5, all-reduces 5..7, updates 7..8
    assert dp.step_no_overlap_s == 8.0
    # overlap: dW2's all-reduce (3..4) hides under B1x/B1; dW1's (5..6) does not; U2 runs in that gap
    # (5..5.5), U1 once it lands (6..6.5)
    assert dp.step_overlap_s == 6.5
    assert dp.exposed_comm_s == 0.5 and dp.overlap_fraction == 0.75


def test_fast_network_costs_nothing_and_slow_network_bounds_the_step():
    fast = run(bandwidth=1024.0 * 1024)     # 1/1024 s per all-reduce, hidden under U2
    assert fast.step_overlap_s == 6.0
    slow = run(bandwidth=128.0)             # 8 s per all-reduce
    assert slow.allreduce_s == 16.0 and slow.step_no_overlap_s == 6.0 + 16.0
    # dW2's all-reduce runs 3..11, dW1's queues behind it (11..19); U2 at 11, U1 at 19: 19.5 s
    assert slow.step_overlap_s == 19.5


def test_one_bucket_starts_when_its_last_gradient_is_made():
    dp = run(bucket_bytes=DEFAULT_BUCKET_BYTES)
    assert [(b.op, b.grads, b.nbytes) for b in dp.buckets] == [("B1", ("gW2", "gW1"), 2048)]
    # one 2 s all-reduce from 5: nothing to overlap it with, the same step either way
    assert dp.step_overlap_s == dp.step_no_overlap_s == 8.0 and dp.overlap_fraction == 0.0
    # a bucket fills at 2048 bytes: closed by dW1, as above; at 1024 each gradient is its own
    assert len(run(bucket_bytes=2048).buckets) == 1 and len(run(bucket_bytes=1024).buckets) == 2


def test_a_reader_closes_the_bucket_of_the_gradient_it_reads():
    """An update scheduled before its bucket would fill closes the bucket: its op waits for the
    all-reduce of what was made so far, never for a gradient not yet made."""
    order = ["F1", "F2", "B2", "U2", "B1x", "B1", "U1"]
    dp = run(bucket_bytes=DEFAULT_BUCKET_BYTES, order=order)
    assert [(b.op, b.step, b.grads) for b in dp.buckets] == [("B2", 2, ("gW2",)), ("B1", 5, ("gW1",))]
    plan = dataclasses.replace(Plan.initial(two_layers()), schedule=order_schedule(order))
    assert readers(plan, gradient_buckets(plan)) == {3: [0], 6: [1]}
    # U2 waits for dW2's all-reduce right after B2 (3..4), U1 for dW1's (6.5..7.5): nothing hides
    assert dp.step_overlap_s == dp.step_no_overlap_s == 8.0


def test_bucket_size_must_be_positive():
    with pytest.raises(UserError, match="at least 1 byte"):
        gradient_buckets(Plan.initial(two_layers()), 0)


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    from memsched import models

    path = tmp_path_factory.mktemp("dp") / "mlp.onnx"
    onnx.save(models.build("mlp", batch=8, hidden=[32]), str(path))
    return path


@pytest.fixture(scope="module")
def mlp_dp(mlp_path):
    from memsched.passes.pipeline import compile as compile_plan

    return compile_plan(mlp_path, train=True, data_parallel=2, time_limit=2, hardware="cpu", bucket_bytes=1024)


def test_compile_plans_one_workers_step(mlp_dp):
    """--data-parallel 2: the step at half the batch, updates after the backward (every gradient
    kept until its bucket is all-reduced), what the run needs recorded in the plan."""
    result = mlp_dp
    plan, graph = result.plan, result.plan.graph
    assert graph.tensors["input"].shape == (4, 1, 28, 28) and graph.tensors["labels"].shape == (4,)
    assert plan_options(graph) == {"workers": 2, "bucket_bytes": 1024, "batch_inputs": ["input", "labels"],
                                   "worker_batch": 4}
    phases = [graph.op_by_name[s.target].phase for s in plan.schedule if s.kind == "compute"]
    assert "update" not in phases[:phases.index("update")] and set(phases[phases.index("update"):]) == {"update"}
    # each gradient lives from its dW op to its update, which comes after its bucket closes
    buckets = gradient_buckets(plan, 1024)
    profile = validate(plan)
    steps = {s.target: i for i, s in enumerate(plan.schedule) if s.kind == "compute"}
    for bucket in buckets:
        for g in bucket.grads:
            (residency,) = [r for r in profile.residencies if r.tensor == g]
            update = min(steps[op.name] for op in graph.consumers[g])
            assert residency.start == steps[graph.producer[g].name] and residency.end == update > bucket.step
    assert sorted(g for b in buckets for g in b.grads) == sorted(weight_gradients(graph)) == sorted(
        f"{t.name}.grad" for t in graph.parameters())
    assert len(buckets) > 1
    report = result.report["data_parallel"]
    assert report["bucket_bytes"] == 1024 and report["step_overlap_s"] < report["step_no_overlap_s"]


def test_compile_refuses_a_batch_the_workers_do_not_divide(mlp_path):
    from memsched.passes.pipeline import compile as compile_plan

    with pytest.raises(UserError, match="batch 8 does not divide among 3 workers"):
        compile_plan(mlp_path, train=True, data_parallel=3, time_limit=1)
    with pytest.raises(UserError, match="at least 1 worker"):
        compile_plan(mlp_path, train=True, data_parallel=0, time_limit=1)


def test_executor_hooks_act_on_the_arena_between_ops(mlp_dp):
    """run_plan's hooks get the arena bytes of an op's outputs (after) and inputs (before): zeroing
    each weight gradient once made leaves SGD's weights as they were, and every update sees zeros."""
    from memsched.runtime import run_plan
    from memsched.ir import tensor_value

    plan = mlp_dp.plan
    grads = weight_gradients(plan.graph)
    makers = [i for i, s in enumerate(plan.schedule) if s.kind == "compute"
              and set(plan.graph.op_by_name[s.target].present_outputs) & grads]
    seen = []

    def zero(views):
        for name in grads & set(views):
            views[name][...] = 0

    def look(views):
        seen.extend(views[name].copy() for name in grads & set(views))

    needs = readers(plan, gradient_buckets(plan, 1024))
    result = run_plan(plan, steps=2, threads=1, after=dict.fromkeys(makers, zero), before=dict.fromkeys(needs, look))
    assert len(makers) == len(grads) == 4 and len(seen) == 2 * len(grads)
    assert all(not v.any() for v in seen)
    for t in plan.graph.parameters():
        assert np.array_equal(result.outputs[f"{t.name}.updated"], tensor_value(t, plan.graph.base_dir)), t.name
