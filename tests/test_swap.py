"""The swap planner on hand-sized graphs: exact bytes, exact simulated times (binary fractions)."""
from __future__ import annotations

import dataclasses

import pytest
from onnx import helper

from memsched.errors import BudgetError, UserError
from memsched.memory import analyze_plan, validate
from memsched.schedule import Plan
from memsched.simulate import simulate
from memsched.passes.swap.planner import swap_pass
from memsched.passes.swap.gaps import find_problem
from memsched.passes.swap.heuristic import heuristic, improve, select

from .simgraphs import hardware, lower
from .swapgraphs import relu_chain, toy_hardware, training_mlp, weight_chain, weights_only, with_tiers

FAST = 2.0     # CP-SAT seconds; these models are tiny


def planned(graph, budget, hw, **kw):
    plan = swap_pass(Plan.initial(graph, budget=budget, hardware=hw), time_limit=FAST, **kw)
    validate(plan)                                   # the memory model: budget at every step
    assert analyze_plan(plan).peak_bytes <= budget
    return plan, simulate(plan)                      # the simulator: host tier capacities


def steps(plan):
    return [str(s) for s in plan.schedule]


def test_unhidden_swap_stalls_by_the_transfer_left_over():
    # a (1024 B) must be off the device at E (step 4); it can be back before F (step 5).
    # Link 256 B/s + 0.5 s latency: 4.5 s per copy. Out: ready at 2 (A ends), 2..6.5, done
    # before E starts at 8. In: issued when E ends at 11, 11..15.5; F and G take 4 s, so H
    # (due at 15) waits 0.5 s.
    plan, sim = planned(relu_chain(), 3072, hardware(link=256.0, latency=0.5))
    assert steps(plan) == ["compute(A)", "compute(B)", "compute(C)", "compute(D)", "swap_out(a@dram)",
                           "compute(E)", "swap_in(a@dram)", "compute(F)", "compute(G)", "compute(H)"]
    assert sim.stall == 0.5 and sim.step_time == 18.5
    assert (sim.on("d2h")[0].start, sim.on("d2h")[0].end) == (2.0, 6.5)
    assert (sim.on("h2d")[0].start, sim.on("h2d")[0].end) == (11.0, 15.5)
    notes = plan.notes["swap"]
    assert notes["stall_s"] == 0.5 and notes["step_time_s"] == 18.5 and notes["infinite_memory_time_s"] == 18.0
    assert notes["overhead"] == 18.5 / 18.0 - 1
    assert notes["swapped_bytes"] == {"dram": 1024}
    assert notes["traffic_bytes"] == {"dram": {"out": 1024, "in": 1024}}
    assert notes["peak_bytes"] == 3072 and notes["budget_bytes"] == 3072
    assert [(m["tensor"], m["to"]) for m in notes["tensors"]] == [("a", "dram")]
    assert notes["solver"]["model_delay_s"] == 0.5   # the model's time agrees with the simulator
    assert notes["status"] in ("optimal", "feasible")


def test_prefetch_hides_a_fast_transfer():
    # 1 s per copy: in 11..12 under F (11..13); nothing waits
    plan, sim = planned(relu_chain(), 3072, hardware())
    assert sim.stall == 0.0 and sim.step_time == 18.0
    assert plan.notes["swap"]["overhead"] == 0.0 and plan.notes["swap"]["status"] == "optimal"


def test_nvdimm_when_dram_cannot_hold_the_tensor():
    # DRAM holds 512 bytes: a goes to NVDIMM, which writes at 512 B/s with 0.25 s latency
    # (2.25 s out: 2..4.25, so released before D, the first step after it is done) and reads at
    # the link rate (1.25 s in), issued where it just finishes before H (due at 15): after F.
    plan, sim = planned(relu_chain(), 3072, with_tiers(hardware(), dram=512))
    assert steps(plan)[3:] == ["swap_out(a@nvdimm)", "compute(D)", "compute(E)", "compute(F)",
                               "swap_in(a@nvdimm)", "compute(G)", "compute(H)"]
    assert (sim.on("d2h")[0].start, sim.on("d2h")[0].end) == (2.0, 4.25)
    assert (sim.on("h2d")[0].start, sim.on("h2d")[0].end) == (13.0, 14.25)
    assert sim.stall == 0.0 and sim.host_peak == {"nvdimm": 1024}
    assert plan.notes["swap"]["swapped_bytes"] == {"nvdimm": 1024}
    assert plan.notes["swap"]["tensors"][0]["to"] == "nvdimm"


def test_dram_first_while_it_lasts():
    plan, sim = planned(relu_chain(), 3072, hardware())
    assert sim.traffic == {"dram": {"out": 1024, "in": 1024}}


def test_recompute_where_cheaper_than_the_transfer():
    # 128 B/s + 0.5 s: 8.5 s per copy. Swapping `a` stalls H (due when E ends) by a whole copy
    # in; swapping `w` stalls E by 0.5 s (out 0..8.5) and I by 5.5 s (in from 11, due at 14);
    # replaying A before H costs 2 s.
    plan, sim = planned(weight_chain(), 4096, hardware(link=128.0, latency=0.5))
    assert steps(plan)[-3:] == ["recompute(A)", "compute(H)", "compute(I)"]
    assert sim.step_time == 17.0 + 2.0 and sim.stall == 0.0 and sim.traffic == {}
    assert plan.notes["swap"]["recomputed_ops"] == ["A"]
    assert plan.notes["swap"]["tensors"][0]["to"] == "recompute"


def test_swap_where_cheaper_than_recomputing():
    # on the fast link (1 s per copy) w goes out 0..1 and comes back 11..12, before I at 14
    plan, sim = planned(weight_chain(), 4096, hardware())
    assert "swap_in(w@dram)" in steps(plan) and "recompute(A)" not in steps(plan)
    assert sim.step_time == 17.0 and sim.stall == 0.0


def test_replay_chain_through_a_dead_intermediate():
    # 8.5 s per copy: swapping `a` stalls E (out 4..12.5, E at 10) and H (a whole copy in),
    # swapping `w` stalls I by 5.5 s; replaying A0 then A before H costs 4 s. While they run
    # the device holds w, e, then m, then m and a: 4096 bytes, the budget.
    plan, sim = planned(weight_chain(deep=True), 4096, hardware(link=128.0, latency=0.5))
    assert steps(plan)[-4:] == ["recompute(A0)", "recompute(A)", "compute(H)", "compute(I)"]
    assert sim.step_time == 19.0 + 4.0 and sim.stall == 0.0 and sim.traffic == {}
    assert analyze_plan(plan).live_bytes.tolist()[-4:-2] == [3072, 4096]
    assert plan.notes["swap"]["recomputed_ops"] == ["A", "A0"]


def test_parameters_that_do_not_fit_start_on_the_host():
    # four 1024-byte weights, 3072 bytes of device: each weight is brought in before its op
    # and dropped after it
    # and dropped after it (w1, used at step 0, leaves after it)
    plan, sim = planned(weights_only(), 3072, hardware())
    assert {"w2", "w3", "w4"} <= plan.on_host <= {"w1", "w2", "w3", "w4"}
    for w in ("w2", "w3", "w4"):
        assert f"swap_in({w}@dram)" in steps(plan)
    outs = [s.target for s in plan.schedule if s.kind == "swap_out"]
    assert set(outs) <= {"w1"}                                 # the host already holds the others


def test_host_capacity_is_a_hard_limit():
    hw = with_tiers(hardware(), dram=1000, nvdimm=1000)       # neither tier holds 1024 bytes
    with pytest.raises(BudgetError) as err:
        swap_pass(Plan.initial(relu_chain(), budget=3072, hardware=hw), time_limit=FAST)
    assert err.value.smallest_feasible_bytes == 4096 and err.value.exit_code == 3


def test_infeasible_budget_names_the_smallest_reachable():
    # E reads c, d and writes e: 3072 bytes whatever is swapped
    with pytest.raises(BudgetError) as err:
        swap_pass(Plan.initial(relu_chain(), budget=3071, hardware=hardware()), time_limit=FAST)
    assert err.value.smallest_feasible_bytes == 3072
    assert "3072" in str(err.value)
    planned(relu_chain(), err.value.smallest_feasible_bytes, hardware())


def test_a_plan_that_fits_is_left_alone():
    plan = Plan.initial(relu_chain(), budget=4096, hardware=hardware())
    out = swap_pass(plan)
    assert out.schedule == plan.schedule and out.notes["swap"]["status"] == "fits"
    assert out.notes["swap"]["overhead"] == 0.0 and out.notes["swap"]["swapped_bytes"] == {}


def test_no_hardware_is_a_user_error():
    with pytest.raises(UserError, match="hardware profile"):
        swap_pass(Plan.initial(relu_chain(), budget=3072))


def test_recompute_keeps_the_producer_inputs():
    # a measured cost table prices the ops instead of the roofline: cheap replay, slow link
    from .simgraphs import costs

    # 4 s per copy: swapping w stalls I by 1 s (in 9.25..13.25, due 12.25), swapping a stalls H
    # by 4 s; replaying A costs 0.25 s
    table = costs(A=0.25, B=2.0, C=2.0, D=2.0, E=3.0, H=3.0, I=3.0)
    plan = swap_pass(Plan.initial(weight_chain(), budget=4096, hardware=hardware(link=256.0)),
                     time_limit=FAST, costs=table)
    sim = simulate(plan, costs=table)
    assert plan.notes["swap"]["recomputed_ops"] == ["A"] and sim.step_time == 15.25 + 0.25
    assert "w" not in plan.on_host and sim.traffic == {}


def test_offsets_are_dropped_when_the_schedule_changes():
    plan = Plan.initial(relu_chain(), budget=3072, hardware=hardware())
    apart = {r.key: 1024 * i for i, r in enumerate(analyze_plan(plan).residencies)}
    plan = dataclasses.replace(plan, offsets=apart)
    assert swap_pass(plan, time_limit=FAST).offsets is None


@pytest.mark.slow
def test_compile_with_swap_through_the_cli(tmp_path):
    # LeNet-300-100 training step after reuse (fused updates, in place: 58% of the baseline,
    # whose updates run in place too): at 53% of the baseline the swap pass moves tensors to
    # DRAM; at 1% it says which budget it can reach (exit 3, one line)
    import json

    from memsched import models
    from memsched.onnx_utils import save_model_atomic

    from .conftest import run_cli

    path = save_model_atomic(models.build("mlp", batch=64), tmp_path / "mlp.onnx")
    done = run_cli("compile", path, "--train", "--strategies", "reuse,swap", "--budget", "53%",
                   "--time-limit", "30", "--json")     # its counted work ends it first: ~3 s even at load 5
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["plan"]["peak_bytes"] <= report["budget_bytes"] < report["baseline"]["peak_bytes"]
    assert report["plan"]["swapped_bytes"]["dram"] > 0
    assert report["passes"]["swap"]["status"] in ("optimal", "feasible", "heuristic")
    tried = report["passes"]["fit"]["tried"]
    assert [t["candidate"] for t in tried if t.get("chosen")] == ["swap"]
    printed = run_cli("compile", path, "--train", "--strategies", "reuse,swap", "--budget", "53%",
                      "--time-limit", "30")
    assert printed.returncode == 0 and "swap: +" in printed.stdout and "(chosen)" in printed.stdout
    failed = run_cli("compile", path, "--train", "--strategies", "reuse,swap", "--budget", "1%",
                     "--time-limit", "1")
    assert failed.returncode == 3
    assert "the smallest peak reached is" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    assert "add recompute to --strategies" in failed.stderr


def test_a_view_and_its_source_move_as_one_buffer():
    """v = Identity(a) shares a's storage (rule 4): while a is still read (by B) moving v frees
    nothing, so v's gap starts after B; v, idle across the peak at E, goes to the host then."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="A"), helper.make_node("Identity", ["a"], ["v"], name="V"),
             helper.make_node("Relu", ["a"], ["b"], name="B"), helper.make_node("Relu", ["b"], ["c"], name="C"),
             helper.make_node("Relu", ["c"], ["d"], name="D"), helper.make_node("Add", ["c", "d"], ["e"], name="E"),
             helper.make_node("Relu", ["e"], ["f"], name="F"), helper.make_node("Add", ["v", "f"], ["out"], name="H")]
    graph = lower(nodes, ["x"], ["out"])
    plan = Plan.initial(graph, budget=3072, hardware=hardware())
    plan = dataclasses.replace(plan, aliases={"v": "a"})
    assert analyze_plan(plan).peak_bytes == 4096          # a/v (one buffer), c, d, e at E
    problem = find_problem(plan, analyze_plan(plan), hardware(), hardware(), plan.budget)
    assert [(g.tensor, g.p, g.q) for g in problem.gaps if g.tensor in ("a", "v")] == [("v", 2, 7)]
    swapped = swap_pass(plan, time_limit=FAST)
    validate(swapped)
    assert analyze_plan(swapped).peak_bytes <= 3072
    assert [s.target for s in swapped.schedule if s.kind == "swap_out"] == ["v"]


def test_past_the_deadline_the_heuristic_answers_with_its_first_order_unimproved():
    """With the command's deadline passed, the first order that meets the budget is the
    answer, placed but with no exchange trial, and the deadline says it cut the search; the
    answer still holds the budget."""
    from memsched.deadline import Deadline, unlimited
    from memsched.passes.swap.heuristic import SELECT_ORDERS, consistent, place

    hw = toy_hardware()
    plan = Plan.initial(training_mlp([4, 16, 8], batch=7), budget=2400, hardware=hw)
    problem = find_problem(plan, analyze_plan(plan), hw, hw, plan.budget)
    late = Deadline(0.0)
    choices, timing, order = heuristic(problem, late)
    assert late.cut and order == next(iter(SELECT_ORDERS))
    first = select(problem, order=order)
    assert choices == (place(problem, first) or first) and consistent(problem, choices)
    assert heuristic(problem, unlimited())[1].delay <= timing.delay


def test_the_heuristic_keeps_the_order_of_tensors_with_the_least_delay():
    """An MLP step where TFLMS's order (idle time per byte) frees tensors whose copies the
    link cannot hide, and the longest idle time first hides them all: the heuristic runs
    each order and keeps the one the time model delays least."""
    hw = toy_hardware()
    plan = Plan.initial(training_mlp([4, 16, 8], batch=7), budget=2400, hardware=hw)
    problem = find_problem(plan, analyze_plan(plan), hw, hw, plan.budget)
    per_byte = improve(problem, select(problem, order="idle per transfer time"))[1].delay
    by_idle = improve(problem, select(problem, order="idle"))[1].delay
    assert per_byte > 0 and by_idle == 0
    choices, timing, order = heuristic(problem)
    assert (order, timing.delay) == ("idle", 0)
    swapped, sim = planned(plan.graph, 2400, hw)
    assert swapped.notes["swap"]["solver"]["heuristic_order"] == "idle"
    assert sim.stall == 0.0 and sim.step_time == simulate(dataclasses.replace(plan, budget=None)).step_time
