"""CP-SAT settings shared by the planning passes (docs/design.md).

Every solve gets a wall-clock limit (never hang), `num_workers` from the cores present and a
fixed seed. `interleave_search` makes CP-SAT's parallel search reproducible, and a
deterministic-time limit below the wall limit usually ends the search first, so the same
inputs give the same plan; `run` says when the wall clock ended a search instead (the
result is still valid, only possibly different from run to run). Interleaved batches run
about one deterministic second whole, which a loaded 2-core machine can stretch past a
wall limit of two seconds: short limits are reproducible only where the model is easy.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memsched.deadline import Deadline

SEED = 20240607
# share of the wall limit given as deterministic time; CP-SAT's deterministic seconds run
# slower than wall seconds on a loaded machine, so this leaves room for the reproducible limit
DETERMINISTIC_SHARE = 0.5
# the wall limit is this many times the caller's limit, and at least WALL_FLOOR seconds: the
# deterministic limit ends the search first even on a loaded machine, where a short solve's
# start-up alone can take longer than its limit (the command's deadline still caps it)
WALL_SLACK = 2.0
WALL_FLOOR = 1.0


@dataclass
class SolveResult:
    """What a CP-SAT solve left behind: the solver (to read values) and what it proved."""

    solver: cp_model.CpSolver
    status: str          # "optimal", "feasible" or "unknown" (no solution, or model invalid)
    bound: float | None  # the proven objective bound, None when nothing was proven
    seconds: float
    deterministic: bool  # False when the wall clock, not the deterministic limit, stopped it

    @property
    def has_solution(self) -> bool:
        return self.status in ("optimal", "feasible")


def workers() -> int:
    return max(1, os.cpu_count() or 1)


def solve(model: cp_model.CpModel, time_limit: float, presolve: bool = True,
          started: float | None = None, min_seconds: float = 0.01, deadline: Deadline | None = None) -> SolveResult:
    """Solve `model` within `time_limit` wall seconds; never raises on a time-out.

    `started` (a `time.perf_counter()` reading) is when the caller's `time_limit` began: the
    wall limit is what is left of WALL_SLACK times it (never under `min_seconds` nor
    WALL_FLOOR), while the deterministic limit is a share of all of it, so the time spent
    before the solve (building the model, a heuristic) moves only the wall limit and a loaded
    machine still gets the same plan.
    `presolve=False` suits the scheduling models, whose presolve (probing a Cumulative over
    hundreds of variable intervals) can take the whole time limit before any search; it is
    safe only with a hint that is a solution: OR-Tools 9.12-9.15 abort the process ("Check
    failed: heuristics.fixed_search != nullptr") on an interleaved, unpresolved search of an
    infeasible model with a hint, which a model that may be infeasible (the recompute pass's)
    must leave to presolve to find.

    `deadline`, the command's one deadline, bounds the wall limit too and stops the search
    when it is stopped (Ctrl-C); CP-SAT's own SIGINT handler is off, so the command, not the
    solver, decides what a Ctrl-C does."""
    solver = cp_model.CpSolver()
    params = solver.parameters
    spent = 0.0 if started is None else time.perf_counter() - started
    wall = max(min_seconds, WALL_FLOOR, WALL_SLACK * float(time_limit) - spent)
    params.max_time_in_seconds = wall if deadline is None else max(0.001, deadline.cap(wall))
    params.max_deterministic_time = max(0.005, DETERMINISTIC_SHARE * float(time_limit))
    params.num_workers = workers()
    params.interleave_search = True
    params.random_seed = SEED
    params.log_search_progress = False
    params.cp_model_presolve = presolve
    params.catch_sigint_signal = False
    start = time.perf_counter()
    if deadline is None:
        code = solver.Solve(model)
    else:
        with deadline.stopping(solver.StopSearch):
            code = solver.Solve(model)
    seconds = time.perf_counter() - start
    status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible"}.get(code, "unknown")
    finished = code in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
    # an interleaved batch runs whole (about one deterministic second) and can overshoot the
    # deterministic limit, so a search that reached the wall limit was cut by the clock even
    # where its deterministic time is past the limit
    on_time = seconds < 0.98 * params.max_time_in_seconds
    deterministic = finished or (on_time and solver.deterministic_time >= 0.99 * params.max_deterministic_time)
    bound = solver.BestObjectiveBound() if status != "unknown" else None
    return SolveResult(solver, status, bound, seconds, deterministic)
