"""The swap planner on random training-shaped graphs: whatever it returns holds the budget (the
memory model) and the host tiers (the simulator), or it says which budget it can reach."""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings, strategies as st

from memsched.errors import BudgetError
from memsched.memory import analyze_plan, validate
from memsched.schedule import Plan
from memsched.simulate import simulate
from memsched.passes.swap.planner import swap_pass

from .swapgraphs import toy_hardware, training_mlp

LIMIT = 0.3     # CP-SAT seconds per plan


def check(plan: Plan, original: Plan) -> None:
    """Valid under the budget and the tiers; every original op computed once, in order."""
    profile = validate(plan)
    assert profile.peak_bytes <= plan.budget
    sim = simulate(plan)
    for tier, held in sim.host_peak.items():
        assert held <= plan.hardware.tier(tier).capacity
    computed = [s.target for s in plan.schedule if s.kind == "compute"]
    assert computed == [s.target for s in original.schedule]
    assert plan.notes["swap"]["peak_bytes"] == profile.peak_bytes
    assert plan.notes["swap"]["step_time_s"] == sim.step_time
    assert plan.notes["swap"]["status"] in ("fits", "optimal", "feasible", "heuristic")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.sampled_from([4, 8, 16, 32, 64]), min_size=3, max_size=7),
       batch=st.integers(1, 8), fraction=st.floats(0.2, 1.0),
       dram=st.sampled_from([0, 256, 2048, 1 << 20]), nvdimm=st.sampled_from([0, 4096, 1 << 20]),
       inplace=st.booleans())
def test_random_training_chains_stay_within_budget_and_tiers(widths, batch, fraction, dram, nvdimm, inplace):
    graph = training_mlp(widths, batch)
    hw = toy_hardware(dram=dram, nvdimm=nvdimm)
    original = Plan.initial(graph, hardware=hw)
    if inplace:     # Relu over its MatMul output, SGD over its weight (both die there)
        aliases = {op.outputs[0]: op.inputs[0] for op in graph.ops if op.op_type in ("Relu", "Sub")}
        original = dataclasses.replace(original, aliases=aliases)
    budget = int(analyze_plan(original).peak_bytes * fraction)
    plan = dataclasses.replace(original, budget=budget)
    try:
        check(swap_pass(plan, time_limit=LIMIT), plan)
    except BudgetError as err:
        floor = err.smallest_feasible_bytes
        assert floor > budget
        check(swap_pass(dataclasses.replace(plan, budget=floor), time_limit=LIMIT),
              dataclasses.replace(plan, budget=floor))


def test_time_limit_is_honoured_and_the_answer_still_valid():
    graph = training_mlp([64, 32, 64, 32, 64, 32, 16], batch=8)
    plan = Plan.initial(graph, hardware=toy_hardware())
    plan = dataclasses.replace(plan, budget=int(analyze_plan(plan).peak_bytes * 0.5))
    out = swap_pass(plan, time_limit=0.001)
    check(out, plan)
    assert out.notes["swap"]["solver"]["seconds"] < 5.0
