"""Operator order: optimal on small graphs (checked against every topological order), valid
and within its time limit on large ones, reproducible."""
from __future__ import annotations

import dataclasses
import time

import networkx as nx
import pytest

from memsched.errors import ScheduleError
from memsched.memory import analyze, analyze_plan, validate
from memsched.schedule import Plan, compute, free, order_schedule
from memsched.passes.order import (WHOLE_FIRST_OPS, WHOLE_GRAPH_OPS, Judge, OrderProblem, OrderSearch, cut_bound, drain,
                                   hoist, order_pass, reachability, sink, structural_bound)
from memsched.passes.placement import place_pass
from memsched.passes.reuse import choose_aliases, reuse_pass

from .graphs import GraphBuilder, random_dag, training_chain


def brute_force_peak(graph, inplace: bool) -> int:
    """The lowest peak over every topological order (with greedy in-place aliases if asked)."""
    best = None
    for order in nx.all_topological_sorts(graph.nx):
        schedule = order_schedule(list(order))
        aliases = choose_aliases(graph, schedule) if inplace else {}
        peak = analyze(graph, schedule, aliases).peak_bytes
        best = peak if best is None else min(best, peak)
    return best


def two_branches():
    """x(8) feeds two chains a1(100)->a2(8) and b1(100)->b2(8), joined into y(8)."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("a1", "Conv", ["x"], [("a1", 100)])
    g.op("b1", "Conv", ["x"], [("b1", 100)])
    g.op("a2", "Conv", ["a1"], [("a2", 8)])
    g.op("b2", "Conv", ["b1"], [("b2", 8)])
    g.op("join", "Concat", ["a2", "b2"], [("y", 16)])
    g.output("y")
    return g.graph()


def test_finishes_a_branch_before_starting_the_next():
    graph = two_branches()
    base = Plan.initial(graph)
    # the given order holds x, a1 and b1 together: 8 + 100 + 100
    assert analyze_plan(base).peak_bytes == 208
    plan = order_pass(base, time_limit=5)
    # a1, a2, then b1: at most x 8 + one 100-byte tensor + a2 8 at any step
    assert validate(plan).peak_bytes == 116 == brute_force_peak(graph, inplace=False)
    notes = plan.notes["order"]
    assert notes["status"] == "optimal" and notes["lower_bound_bytes"] == 116
    assert notes["input_peak_bytes"] == 208
    assert [s.target for s in plan.schedule][:2] in (["a1", "a2"], ["b1", "b2"])


# seeds whose heuristics all miss the optimum (found by comparing with brute force)
@pytest.mark.parametrize("seed,inplace", [(12, True), (13, True), (35, True), (39, True), (40, True),
                                          (48, True), (53, True), (3, False), (21, False)])
def test_optimal_on_small_random_graphs(seed, inplace):
    graph = random_dag(seed, 7)
    plan = order_pass(Plan.initial(graph), time_limit=5, inplace=inplace)
    best = brute_force_peak(graph, inplace)
    notes = plan.notes["order"]
    assert validate(plan).peak_bytes == notes["peak_bytes"] == best
    assert notes["status"] == "optimal" and notes["lower_bound_bytes"] == best
    assert graph.is_topological([s.target for s in plan.schedule])
    if not inplace:
        assert plan.aliases == {}


def test_training_graph_in_place_meets_its_structural_bound():
    g = training_chain([(1000, 16), (200, 4000), (300, 50), (500, 500)], 1000)
    base = Plan.initial(g)
    assert analyze_plan(base).peak_bytes == 13140
    plan = order_pass(reuse_pass(base), time_limit=5)
    notes = plan.notes["order"]
    assert validate(plan).peak_bytes == 9774
    assert notes["lower_bound_bytes"] == 9774 and notes["lower_bound"] == "structural"
    assert notes["status"] == "optimal" and notes["inplace"]


def test_sink_runs_a_prologue_where_it_is_needed():
    g = GraphBuilder()
    g.input("x", 8)
    g.op("early", "Conv", ["x"], [("E", 100)])      # frees nothing: x is read again at the end
    g.op("mid", "Conv", ["x"], [("M", 200)])
    g.op("use_m", "Conv", ["M"], [("N", 8)])
    g.op("use_e", "Concat", ["E", "N", "x"], [("out", 8)])
    g.output("out")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    moved = sink(OrderProblem.build(graph, False), order)
    assert moved == ["mid", "use_m", "early", "use_e"]
    assert list(analyze(graph, order_schedule(order)).live_bytes) == [108, 308, 316, 124]
    assert list(analyze(graph, order_schedule(moved)).live_bytes) == [208, 216, 116, 124]


def test_sink_moves_an_op_that_only_passes_on_what_a_sunk_op_defined():
    """S = x - mean defines bytes; M = S * invstd frees S and defines as much: the two move
    together past the big temporary O (a norm's backward prologue run in the forward)."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("sub", "Conv", ["x"], [("S", 100)])
    g.op("mul", "Conv", ["S"], [("M", 100)])
    g.op("other", "Conv", ["x"], [("O", 200)])
    g.op("red", "ReduceSum", ["O"], [("R", 4)])
    g.op("use", "Concat", ["M", "R", "x"], [("out", 8)])
    g.output("out")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    moved = sink(OrderProblem.build(graph, False), order)
    assert moved == ["other", "red", "sub", "mul", "use"]
    assert analyze(graph, order_schedule(order)).peak_bytes == 312
    assert analyze(graph, order_schedule(moved)).peak_bytes == 212


def test_with_inplace_a_view_shares_storage_wherever_it_runs():
    """A Reshape run before another reader of its input shares the input's buffer (rule 4):
    no copy, nothing for `sink` to move; the model keeps one tensor for the buffer, read by
    the readers of both."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("a", "Relu", ["x"], [("A", 100)])
    g.op("view", "Reshape", ["A"], [("V", 100)])
    g.op("use_a", "Conv", ["A"], [("B", 100)])
    g.op("use_v", "Concat", ["V", "B"], [("out", 8)])
    g.output("out")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    problem = OrderProblem.build(graph, True)
    assert sink(problem, order) == order
    assert "V" not in problem.tensors and problem.buffer["V"] == problem.buffer["A"]
    assert problem.readers[problem.buffer["A"]] == [problem.index[n] for n in ("view", "use_a", "use_v")]
    plan = Plan.initial(graph)
    assert Judge(plan, False).peak(order) == 300
    assert Judge(plan, True).peak(order) == 208


def test_hoist_runs_a_reduction_as_soon_as_it_can():
    g = GraphBuilder()
    g.input("x", 8)
    g.op("big", "Conv", ["x"], [("B", 200)])
    g.op("other", "Conv", ["x"], [("O", 150)])
    g.op("red", "ReduceSum", ["B"], [("R", 4)])     # frees 200 bytes, defines 4
    g.op("final", "Concat", ["R", "O"], [("Y", 8)])
    g.output("Y")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    moved = hoist(OrderProblem.build(graph, False), order)
    assert moved == ["big", "red", "other", "final"]
    assert list(analyze(graph, order_schedule(order)).live_bytes) == [208, 358, 354, 162]
    assert list(analyze(graph, order_schedule(moved)).live_bytes) == [208, 212, 162, 162]


def test_drain_sums_two_parts_before_the_third_is_made():
    """A convolution split over its Concat (passes.rewrites.concat_split): the given order makes all
    three parts, then sums; drained, the first sum follows the second part, and the third part
    is made beside the first sum alone (the first sum's step holds all three parts given)."""
    g = GraphBuilder()
    g.input("x", 8)
    for i in range(3):
        g.op(f"part{i}", "Conv", ["x"], [(f"P{i}", 100)])
    g.op("sum1", "Add", ["P0", "P1"], [("S1", 100)])
    g.op("sum2", "Add", ["S1", "P2"], [("Y", 100)])
    g.output("Y")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    moved = drain(OrderProblem.build(graph, False), order)
    assert moved == ["part0", "part1", "sum1", "part2", "sum2"]
    assert list(analyze(graph, order_schedule(order)).live_bytes) == [108, 208, 308, 400, 300]
    assert list(analyze(graph, order_schedule(moved)).live_bytes) == [108, 208, 308, 208, 300]


def test_drain_runs_a_gradients_readers_with_what_they_wait_for():
    """A backward gradient G (100) read by a view and by dW (through the view) and dX: the
    given order runs another layer's big backward op first; drained, the view, the second
    view dW waits for, dW and dX follow G, and G is gone before the other op."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("fwd", "Conv", ["x"], [("A", 10)])
    g.op("grad", "Conv", ["A"], [("G", 100)], phase="backward", kind="gradient")
    g.op("other", "Conv", ["x"], [("O", 150)], phase="backward", kind="gradient")
    g.op("view_g", "Reshape", ["G"], [("V", 100)], phase="backward", kind="gradient")
    g.op("view_a", "Reshape", ["A"], [("VA", 10)], phase="backward", kind="gradient")
    g.op("dw", "Conv", ["V", "VA"], [("DW", 4)], phase="backward", kind="gradient")
    g.op("dx", "ConvTranspose", ["G"], [("DX", 10)], phase="backward", kind="gradient")
    g.op("join", "Concat", ["O", "DW", "DX"], [("out", 8)], phase="backward", kind="gradient")
    g.output("out")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    problem = OrderProblem.build(graph, True)
    moved = drain(problem, order)
    assert moved == ["fwd", "grad", "view_g", "view_a", "dw", "dx", "other", "join"]
    assert graph.is_topological(moved)
    before, after = (Judge(Plan.initial(graph), True).peak(o) for o in (order, moved))
    assert after < before


def test_drain_keeps_the_backward_out_of_the_forward():
    """A forward activation whose last reader is a backward op that frees it: draining it
    after the forward reader would pull that backward op into the forward (keeping its output
    from there on, as the checkpoint of a recompute plan would), so nothing moves."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("act", "Conv", ["x"], [("A", 100)])
    g.op("use", "Conv", ["A"], [("U", 8)])
    g.op("big", "Conv", ["U"], [("B", 200)])
    g.op("mask", "Greater", ["A"], [("M", 4)], phase="backward", kind="gradient")
    g.op("join", "Concat", ["B", "M"], [("out", 8)], phase="backward", kind="gradient")
    g.output("out")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    assert drain(OrderProblem.build(graph, False), order) == order


def test_drain_leaves_readers_that_keep_more_than_they_free():
    """The last reader of A (100) makes E (300): run early it would free 100 bytes and keep
    300 across the big op, so it stays where it is."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("act", "Conv", ["x"], [("A", 100)])
    g.op("use", "Conv", ["A"], [("U", 8)])
    g.op("big", "Conv", ["U"], [("B", 200)])
    g.op("expand", "Expand", ["A"], [("E", 300)])
    g.op("join", "Concat", ["B", "E"], [("out", 8)])
    g.output("out")
    graph = g.graph()
    order = [op.name for op in graph.ops]
    assert drain(OrderProblem.build(graph, False), order) == order


@pytest.mark.parametrize("seed", range(8))
def test_drain_gives_a_topological_order_of_every_op(seed):
    graph = random_dag(seed, 60)
    order = [op.name for op in graph.ops]
    for inplace in (False, True):
        moved = drain(OrderProblem.build(graph, inplace), order)
        assert sorted(moved) == sorted(order) and graph.is_topological(moved)


def test_min_cut_proves_what_the_structure_cannot():
    """A (100) feeds the forward and a backward prologue P = Neg(A) (100) that may run at any
    time: at the gradient seed one of A or P is resident, which only the cut sees."""
    g = GraphBuilder()
    g.input("x", 8)
    g.op("a", "Conv", ["x"], [("A", 100)])
    g.op("c", "Conv", ["A"], [("C", 100)])
    g.op("f", "Conv", ["C"], [("Y", 8)])
    g.op("p", "Neg", ["A"], [("P", 100)], phase="backward")
    g.op("g", "Expand", ["Y"], [("G", 50)], phase="backward")
    g.op("b1", "Mul", ["C", "G"], [("D", 8)], phase="backward")
    g.op("b2", "Mul", ["P", "D"], [("B", 8)], phase="backward")
    g.output("B")
    graph = g.graph()
    problem = OrderProblem.build(graph, False)
    reach = reachability(problem)
    structural, per_op = structural_bound(problem, reach)
    seed = problem.index["g"]
    # at g: C 100 + Y 8 + G 50 in any order; A or P (100) only by the cut
    assert (structural, int(per_op[seed])) == (200, 158)
    assert cut_bound(problem, seed, reach) == 258 == brute_force_peak(graph, inplace=False)
    notes = order_pass(Plan.initial(graph), time_limit=5).notes["order"]
    assert notes["lower_bound"] == "min-cut" and notes["lower_bound_bytes"] == 258
    assert notes["status"] == "optimal" and notes["peak_bytes"] == 258


@pytest.mark.slow
def test_a_large_graph_is_ordered_by_windows():
    """(How long it takes is bench/bench_time_limits.py's question, not a test's.)"""
    layers = [((i % 3 + 1) * 4096, (i % 5 + 1) * 1024) for i in range(700)]
    g = training_chain(layers, 4096)
    assert len(g.ops) == 4899
    limit = 6.0
    plan = order_pass(reuse_pass(Plan.initial(g)), time_limit=limit)
    notes = plan.notes["order"]
    assert notes["cpsat"]["mode"] == "windows"
    assert notes["lower_bound_bytes"] <= notes["peak_bytes"] <= notes["input_peak_bytes"]
    assert g.is_topological([s.target for s in plan.schedule])
    placed = place_pass(plan, time_limit=limit)
    assert placed.notes["placement"]["arena_bytes"] <= 1.02 * notes["peak_bytes"]
    validate(placed)


def test_a_short_limit_on_a_large_random_graph_still_orders_it():
    graph = random_dag(3, 2000, max_bytes=10**6)
    plan = order_pass(Plan.initial(graph), time_limit=1.0)
    notes = plan.notes["order"]
    assert notes["heuristic_peaks"]["given"] == notes["input_peak_bytes"]
    assert validate(plan).peak_bytes == notes["peak_bytes"] <= notes["input_peak_bytes"]


def test_a_mid_size_graph_gets_a_whole_graph_model_before_the_windows():
    graph = random_dag(3, 250, max_bytes=10**6)
    assert WHOLE_GRAPH_OPS < len(graph.ops) <= WHOLE_FIRST_OPS
    plan = order_pass(Plan.initial(graph), time_limit=4)
    notes = plan.notes["order"]
    cpsat = notes["cpsat"]
    assert cpsat["mode"] in ("whole graph", "whole graph, then windows")
    # the windows run only where the whole-graph model left the peak above what is proven
    assert (cpsat["mode"] == "whole graph") == (cpsat["solves"] == 1)
    if cpsat["mode"] == "whole graph":
        assert notes["status"] == "optimal"
    assert notes["lower_bound_bytes"] <= validate(plan).peak_bytes == notes["peak_bytes"] <= notes["input_peak_bytes"]


def test_window_search_stops_at_its_deadline():
    """The windows' limits add up to the search's seconds (a count: the same order each time);
    the clock only ends a search that the pass's own end has passed (then it is not called
    deterministic)."""
    graph = random_dag(5, 400)
    plan = Plan.initial(graph)
    problem = OrderProblem.build(graph, False)
    order = [op.name for op in graph.ops]
    search = OrderSearch(problem, Judge(plan, False), order, time.perf_counter())
    search.windows()
    assert search.ended.startswith("the clock") and search.solves == 0 and not search.deterministic
    counted = OrderSearch(problem, Judge(plan, False), order, time.perf_counter() + 3600, seconds=0.5)
    counted.windows()
    assert counted.ended == "time limit" and counted.solves == 0 and counted.deterministic


def test_same_inputs_same_order():
    layers = [((i % 3 + 1) * 512, (i % 4 + 1) * 256) for i in range(22)]
    plan = reuse_pass(Plan.initial(training_chain(layers, 512)))
    first = order_pass(plan, time_limit=20)
    second = order_pass(plan, time_limit=20)
    assert first.notes["order"]["deterministic"]
    assert first.schedule == second.schedule and first.aliases == second.aliases


def test_zero_time_still_returns_the_best_heuristic():
    graph = two_branches()
    plan = order_pass(Plan.initial(graph), time_limit=0)
    notes = plan.notes["order"]
    assert notes["cpsat"]["solves"] == 0
    assert validate(plan).peak_bytes == min(notes["heuristic_peaks"].values())


def test_refuses_schedules_with_other_steps():
    graph = two_branches()
    schedule = [compute("a1"), compute("a2"), free("a2"), compute("b1")]
    with pytest.raises(ScheduleError, match="compute steps only"):
        order_pass(dataclasses.replace(Plan.initial(graph), schedule=schedule))


def test_the_min_cut_value_agrees_with_networkx_on_random_networks():
    """`order._max_flow` (OR-Tools' max flow) against networkx's minimum cut on seeded random
    networks with uncuttable arcs, as `cut_bound` builds them."""
    import random

    from memsched.passes.order import _max_flow

    for seed in range(40):
        rng = random.Random(seed)
        nodes = ["source", "sink", *range(rng.randint(2, 25))]
        arcs = {}
        for _ in range(rng.randint(1, 80)):
            tail, head = rng.sample(nodes, 2)
            arcs[(tail, head)] = None if rng.random() < 0.3 else rng.randint(0, 10**9)
        reference = nx.DiGraph()
        reference.add_nodes_from(("source", "sink"))
        for (tail, head), capacity in arcs.items():
            reference.add_edge(tail, head, **({} if capacity is None else {"capacity": capacity}))
        try:
            expected = nx.minimum_cut_value(reference, "source", "sink")
        except nx.NetworkXUnbounded:
            continue            # an uncuttable path: cut_bound's networks never have one
        assert _max_flow(arcs, "source", "sink") == expected, seed
