"""Fuzz: random DAGs with random sizes through order, reuse and placement.

Every order is topological, every alias and offset is accepted by the judge, no two buffers
live at one step overlap, and each pass's reported figures are the memory model's own.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsched.memory import analyze_plan, buffers, check_placement, validate
from memsched.schedule import Plan
from memsched.passes.order import order_pass
from memsched.passes.placement import place_pass
from memsched.passes.reuse import reuse_pass

from .graphs import GraphBuilder

OP_TYPES = ["Relu", "Add", "Mul", "Sub", "MatMul", "Conv", "Concat", "Reshape"]


@st.composite
def dags(draw):
    """A DAG of 1-12 ops: each reads 1-3 earlier tensors (inputs, parameters, outputs of
    earlier ops) and writes 1-2; some ops are updates writing a parameter-sized output."""
    b = GraphBuilder("fuzz")
    pool = [b.input(f"in{i}", draw(st.integers(1, 4096))) for i in range(draw(st.integers(1, 2)))]
    params = [b.static(f"w{i}", draw(st.integers(1, 4096))) for i in range(draw(st.integers(0, 2)))]
    for k in range(draw(st.integers(1, 12))):
        readable = pool + params
        inputs = draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3, unique=True))
        update = bool(params) and draw(st.booleans()) and draw(st.booleans())
        if update:
            param = draw(st.sampled_from(params))
            inputs = [param] + [t for t in inputs if t != param]
            outputs = [(f"t{k}", b.tensors[param].nbytes)]
        else:
            same = draw(st.booleans())
            outputs = [(f"t{k}_{j}", b.tensors[inputs[0]].nbytes if same and j == 0 else draw(st.integers(1, 4096)))
                       for j in range(draw(st.integers(1, 2)))]
        op_type = "Sub" if update else draw(st.sampled_from(OP_TYPES))
        pool.extend(b.op(f"op{k}", op_type, inputs, outputs, phase="update" if update else "forward"))
    read = {t for op in b.ops for t in op.inputs}
    for t in pool:
        if t not in b.inputs and (t not in read or draw(st.booleans())):
            b.output(t)
    return b.graph()


def check(plan: Plan) -> None:
    graph = plan.graph
    order = [step.target for step in plan.schedule]
    assert sorted(order) == sorted(op.name for op in graph.ops)
    assert graph.is_topological(order)
    profile = validate(plan)          # aliases and offsets accepted by the judge
    placement = plan.notes["placement"]
    assert placement["arena_bytes"] == check_placement(profile, plan.offsets)
    assert placement["lower_bound_bytes"] == profile.peak_bytes <= placement["arena_bytes"]
    # overlap, checked here independently of check_placement
    spans = [(first, last, plan.offsets[key], plan.offsets[key] + nbytes)
             for key, first, last, nbytes in buffers(profile) if nbytes]
    for i, (f1, l1, lo1, hi1) in enumerate(spans):
        for f2, l2, lo2, hi2 in spans[i + 1:]:
            assert not (f1 <= l2 and f2 <= l1 and lo1 < hi2 and lo2 < hi1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.booleans())
def test_passes_on_random_dags(graph, reuse_first):
    base = Plan.initial(graph)
    base_peak = analyze_plan(base).peak_bytes
    plan = reuse_pass(base) if reuse_first else base
    ordered = order_pass(plan, time_limit=0.5)
    notes = ordered.notes["order"]
    assert notes["peak_bytes"] == analyze_plan(ordered).peak_bytes <= notes["input_peak_bytes"]
    assert notes["lower_bound_bytes"] <= notes["peak_bytes"]
    if not reuse_first:
        ordered = reuse_pass(ordered)
        assert ordered.notes["reuse"]["peak_bytes"] == analyze_plan(ordered).peak_bytes
    assert analyze_plan(ordered).peak_bytes <= base_peak
    placed = place_pass(ordered, time_limit=0.5)
    assert placed.schedule == ordered.schedule and placed.aliases == ordered.aliases
    check(placed)
