"""passes.swap.planner: fit a plan into its device budget by swapping tensors to host tiers (DRAM,
NVDIMM) and recomputing them, with the transfers hidden behind compute where the link allows.

`swap_pass(plan)` is Plan -> Plan. The budget (`plan.budget`) and the hardware profile
(`plan.hardware`: device link, host tiers with capacities, bandwidths, latencies) are the whole
interface: no distances or thresholds to tune.

How: passes.swap.gaps finds every idle gap of every tensor that spans a step over the budget
(activations between their forward and backward uses, gradients waiting for their update,
outputs held to the end, and weights and optimizer state, which may start the step on the
host); passes.swap.heuristic picks a valid choice for each fast (TFLMS/Capuchin-style) and
passes.swap.model improves on it with CP-SAT under a time limit (where building the model is
priced within twice that limit, `passes.swap.model.build_seconds`). Both answers are emitted,
judged by the memory model (memsched.memory.validate) and timed by the event simulator
(memsched.simulate); the faster one is returned. The returned plan has no arena offsets (the
placement pass runs after this one).

Notes (plan.notes["swap"]): status (fits, optimal, feasible or heuristic), step times with
and without the budget, stall, overhead, bytes per host tier, traffic, where each tensor went
(tier or recompute, and between which steps), and the solver's figures.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

from memsched import hardware as hardware_mod
from memsched.cost import CostTable
from memsched.deadline import Deadline
from memsched.errors import BudgetError, ScheduleError, UserError
from memsched.memory import analyze_plan, validate
from memsched.schedule import Plan, free, recompute, swap_in, swap_out
from memsched.simulate import Simulation, simulate

from memsched.passes.swap.gaps import SwapProblem, find_problem
from memsched.passes.swap.heuristic import MOVING, Choice, heuristic, improve, reloads, select
from memsched.passes.swap.model import Solved, build_seconds, solve

DEFAULT_TIME_LIMIT = 10.0


def swap_pass(plan: Plan, time_limit: float = DEFAULT_TIME_LIMIT, costs: CostTable | None = None,
              deadline: Deadline | None = None) -> Plan:
    """Swap and recompute so that `plan` holds its budget at every step, predicted fastest.

    `time_limit` bounds the search (heuristic, then CP-SAT in what is left; never past the
    command's `deadline`, which also stops CP-SAT on Ctrl-C); judging and
    simulating the answers come on top. Op times come from `costs` if given, else the roofline
    on the plan's hardware. Raises UserError without a hardware profile, BudgetError (with the
    smallest budget this pass reaches) when the budget cannot be met."""
    if plan.hardware is None:
        raise UserError("swap planning needs a hardware profile (the plan has none)")
    started = time.perf_counter()
    hw = hardware_mod.load(plan.hardware)
    unlimited = simulate(plan, hw, costs)
    profile = unlimited.profile
    if plan.budget is None or profile.peak_bytes <= plan.budget:
        notes = _notes(plan, [], [], unlimited, unlimited, {"status": "fits", "chosen": None})
        return dataclasses.replace(plan, notes={**plan.notes, "swap": notes})

    source = costs if costs is not None else hw
    problem = find_problem(plan, profile, hw, source, plan.budget)
    found = heuristic(problem, deadline)
    if found is None:       # the greedy orders missed; the floor plan fits (or nothing does)
        problem, chosen = _floor(plan, profile, hw, source)
        found = heuristic(problem, deadline) or (*improve(problem, chosen, deadline=deadline), "floor")
    choices, _, order = found

    results = [("heuristic", choices)]
    if build_seconds(problem) <= 2 * time_limit:
        solved = solve(problem, choices, time_limit, started, deadline)
    else:      # a model too big to build in the time limit (thousands of steps): the heuristic's answer
        solved = Solved(None, "not built", None, None, 0.0)
    if solved.choices is not None:
        results.append(("cp-sat", solved.choices))
    best, rejected = None, None
    for name, picked in results:
        candidate = plan_with(problem, picked)
        try:
            validate(candidate)                     # the judges: memory model, then simulator
            sim = simulate(candidate, hw, costs)
        except ScheduleError as err:
            if name == "heuristic":
                raise
            rejected = str(err)                     # a solver answer the judges refuse is dropped
            continue
        if best is None or sim.step_time < best[2].step_time:
            best = (name, picked, sim, candidate)
    name, picked, sim, result = best
    accepted = solved.choices is not None and rejected is None
    status = solved.status if accepted and solved.status in ("optimal", "feasible") else "heuristic"
    solver = {"status": status, "chosen": name, "heuristic_order": order, "seconds": solved.seconds,
              "time_limit_s": time_limit, "model_delay_s": _seconds(problem, solved.delay),
              "lower_bound_delay_s": _seconds(problem, solved.bound), "solver_status": solved.status,
              "candidates": len(problem.gaps), "rejected": rejected}
    notes = _notes(result, problem.gaps, picked, sim, unlimited, solver)
    return dataclasses.replace(result, notes={**plan.notes, "swap": notes})


def _floor(plan: Plan, profile, hw, source) -> tuple[SwapProblem, list[Choice]]:
    """Every gap freed as far as the host tiers allow: the least memory this pass reaches.
    Raises BudgetError when even that is over the budget; else the problem and choices."""
    problem = find_problem(plan, profile, hw, source, 0)
    chosen = select(problem, require=False)
    peak = analyze_plan(plan_with(problem, chosen)).peak_bytes
    if peak > plan.budget:
        raise BudgetError(f"the budget of {plan.budget} bytes cannot be met by swapping and recomputing; "
                          f"the smallest this plan reaches is {peak} bytes", peak)
    return dataclasses.replace(problem, budget=plan.budget), chosen


def plan_with(problem: SwapProblem, choices: list[Choice]) -> Plan:
    """The plan with the choices' steps inserted before original steps: frees and swap-outs
    (link order), then swap-ins (link order), then replays (graph order)."""
    plan, n = problem.plan, problem.n
    before: dict[int, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
    hosts = set()
    for g, c in zip(problem.gaps, choices):
        if c.mode == "swap":
            before[c.j][0].append(((g.p, g.index), swap_out(g.tensor, c.tier)))
        elif c.mode == "evict":
            before[c.j][0].append(((g.p, g.index), free(g.tensor)))
        elif c.mode == "host":
            hosts.add(g.tensor)
        elif c.mode == "recompute":
            before[g.q][2].append(((g.producer_step, g.index), [recompute(op) for op in g.replay]))
        if reloads(g, c):
            before[c.k][1].append(((g.q, g.index), swap_in(g.tensor, c.tier)))
    schedule = []
    for s in range(n + 1):
        outs, ins, replays = before.get(s, ([], [], []))
        schedule += [step for _, step in sorted(outs, key=lambda e: e[0])]
        schedule += [step for _, step in sorted(ins, key=lambda e: e[0])]
        schedule += [step for _, chain in sorted(replays, key=lambda e: e[0]) for step in chain]
        if s < n:
            schedule.append(plan.schedule[s])
    changed = len(schedule) != n or hosts
    return dataclasses.replace(plan, schedule=schedule, on_host=plan.on_host | hosts,
                               offsets=None if changed else plan.offsets)


def _seconds(problem: SwapProblem, ticks: int | None) -> float | None:
    return None if ticks is None else ticks * problem.tick


def _notes(plan: Plan, gaps, choices: list[Choice], sim: Simulation, unlimited: Simulation, solver: dict) -> dict:
    """What the report shows: bytes per tier, where each tensor went, stall and overhead."""
    tiers: dict[str, dict[str, int]] = defaultdict(dict)
    moves, recomputed = [], []
    for g, c in zip(gaps, choices):
        if c.mode == "keep":
            continue
        where = "recompute" if c.mode == "recompute" else c.tier
        if c.mode in MOVING:
            tiers[c.tier][g.tensor] = g.nbytes
        if c.mode == "recompute":
            recomputed += g.replay
        moves.append({"tensor": g.tensor, "bytes": g.nbytes, "to": where, "how": c.mode,
                      "idle_steps": [g.p, g.q], "out_before_step": c.j if c.mode != "recompute" else None,
                      "back_before_step": c.k if reloads(g, c) or c.mode == "recompute" else None})
    profile = sim.profile
    base = unlimited.step_time
    return {
        "status": solver["status"],
        "budget_bytes": plan.budget,
        "peak_bytes": profile.peak_bytes,
        "step_time_s": sim.step_time,
        "infinite_memory_time_s": base,
        "overhead": sim.step_time / base - 1.0 if base > 0 else 0.0,
        "stall_s": sim.stall,
        "swapped_bytes": {tier: sum(ts.values()) for tier, ts in sorted(tiers.items())},
        "swapped_tensors": {tier: len(ts) for tier, ts in sorted(tiers.items())},
        "traffic_bytes": sim.traffic,
        "host_peak_bytes": sim.host_peak,
        "recomputed_ops": sorted(set(recomputed)),
        "tensors": moves,
        "solver": solver,
    }
