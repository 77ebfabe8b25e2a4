"""CP-SAT settings shared by the planning passes (docs/design.md).

Every solve runs one worker with a fixed seed and ends at a deterministic-time limit, so the
same inputs give the same plan on a quiet or a loaded machine, and on a machine with more
cores. Its wall-clock limit is several times longer and only a machine far slower than
expected reaches it (never hang); `solve` says when the wall clock ended a search instead
(the result is still valid, only possibly different from run to run). A parallel portfolio
would not keep this: interleaved batches of `num_workers` tasks run whole and overshoot the
deterministic limit up to four times, and batches of one task still overshoot it; on the
planning passes' models one worker found orders, swaps and placements as good as two
(docs/benchmarks.md, 2026-11-29).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memsched.deadline import Deadline

SEED = 20240607
# share of the caller's limit given as deterministic time: CP-SAT's deterministic seconds
# run slower than wall seconds (0.1-0.35 a wall second on the 2-core development machine's
# order, swap and placement models, half that beside two busy processes)
DETERMINISTIC_SHARE = 0.5
# the least deterministic time a solve gets: a small model's swaps or placement at a limit of
# a tenth of a second still get CP-SAT's first improvements
DETERMINISTIC_FLOOR = 0.05
# the wall limit is this many times the caller's limit, and at least WALL_FLOOR seconds, so
# the deterministic limit ends the search first on a loaded machine too (beside two busy
# processes and a third, a swap model's deterministic seconds ran four times slower than
# alone: 0.085 in 5.3 s); the command's deadline still caps it
WALL_SLACK = 10.0
WALL_FLOOR = 4.0


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


def solve(model: cp_model.CpModel, time_limit: float, presolve: bool = True,
          started: float | None = None, min_seconds: float = 0.01, deadline: Deadline | None = None,
          share: float = DETERMINISTIC_SHARE) -> SolveResult:
    """Solve `model` in `share` x `time_limit` deterministic seconds (1-2x `time_limit` in wall
    seconds on the development machine, at the shares its models use); never raises on a time-out.

    `started` (a `time.perf_counter()` reading) is when the caller's `time_limit` began: the
    wall limit is what is left of WALL_SLACK times it (never under `min_seconds` nor
    WALL_FLOOR), while the deterministic limit is a share of all of it, so the time spent
    before the solve (building the model, a heuristic) moves only the wall limit and a loaded
    machine still gets the same plan.
    `presolve=False` suits the scheduling models, whose presolve (probing a Cumulative over
    hundreds of variable intervals) can take the whole time limit before any search; it is
    safe only with a hint that is a solution: OR-Tools 9.12-9.15 abort the process ("Check
    failed: heuristics.fixed_search != nullptr") on an interleaved, unpresolved search of an
    infeasible model with a hint, and a model that may be infeasible (the recompute pass's)
    leaves it to presolve to find.

    `deadline`, the command's one deadline, bounds the wall limit too and stops the search
    when it is stopped (Ctrl-C); CP-SAT's own SIGINT handler is off, so the command, not the
    solver, decides what a Ctrl-C does."""
    spent = 0.0 if started is None else time.perf_counter() - started
    wall = max(min_seconds, WALL_FLOOR, WALL_SLACK * float(time_limit) - spent)
    return run(model, max(DETERMINISTIC_FLOOR, share * float(time_limit)), wall, presolve, deadline)


def safety_wall(deterministic_seconds: float, at_least: float = 0.0) -> float:
    """The wall limit of a solve of `deterministic_seconds`: WALL_SLACK times it, at least
    WALL_FLOOR (and `at_least`), so that its deterministic limit ends it on a loaded machine too."""
    return max(at_least, WALL_FLOOR, WALL_SLACK * float(deterministic_seconds))


def run(model: cp_model.CpModel, deterministic_seconds: float, wall: float, presolve: bool = True,
        deadline: Deadline | None = None, interleave: bool = False, probing: bool = True) -> SolveResult:
    """Solve `model` on one worker for `deterministic_seconds` (it stops there), with `wall`
    seconds and the command's `deadline` as the safety net (`solve` derives both from a
    caller's limit; `safety_wall` gives the net for a deterministic limit). A search the
    clock ends marks the deadline cut: only then may the answer differ from run to run.
    `interleave` runs CP-SAT's portfolio, its large-neighbourhood searches included, in turns
    on that worker; `probing=False` skips presolve's probing, whose seconds the deterministic
    time hardly counts."""
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(0.001, wall if deadline is None else min(wall, deadline.left()))
    params.max_deterministic_time = max(0.001, deterministic_seconds)
    params.num_workers = 1
    params.interleave_search = interleave
    params.random_seed = SEED
    params.log_search_progress = False
    params.cp_model_presolve = presolve
    params.catch_sigint_signal = False
    if not probing:
        params.cp_model_probing_level = 0
    start = time.perf_counter()
    if deadline is None:
        code = solver.Solve(model)
    else:
        with deadline.stopping(solver.StopSearch):
            code = solver.Solve(model)
    seconds = time.perf_counter() - start
    status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible"}.get(code, "unknown")
    finished = code in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
    # a search that reached the wall limit was cut by the clock even where its deterministic
    # time is past the limit
    on_time = seconds < 0.98 * params.max_time_in_seconds
    deterministic = finished or (on_time and solver.deterministic_time >= 0.99 * params.max_deterministic_time)
    if not deterministic and deadline is not None:
        deadline.cut = True     # the clock ended it: the answer may differ from run to run
    bound = solver.BestObjectiveBound() if status != "unknown" else None
    return SolveResult(solver, status, bound, seconds, deterministic)
