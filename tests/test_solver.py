"""The shared CP-SAT settings: one worker that ends at a deterministic limit, a share of the
caller's whole limit whenever the solve starts, and a search the wall clock cut is never
called reproducible."""
from __future__ import annotations

import random
import time

from ortools.sat.python import cp_model

from memsched.passes.solver import DETERMINISTIC_SHARE, WALL_FLOOR, WALL_SLACK, solve


def weighted_completion(n: int = 60) -> cp_model.CpModel:
    """One machine, n jobs, least weighted completion time: no proof within a fraction of a second."""
    rng = random.Random(3)
    model = cp_model.CpModel()
    horizon = 100 * n
    ends, intervals, weights = [], [], []
    for i in range(n):
        start = model.NewIntVar(0, horizon, f"s{i}")
        end = model.NewIntVar(0, horizon, f"e{i}")
        intervals.append(model.NewIntervalVar(start, rng.randint(1, 99), end, f"i{i}"))
        ends.append(end)
        weights.append(rng.randint(1, 20))
    model.AddNoOverlap(intervals)
    model.Minimize(sum(w * e for w, e in zip(weights, ends)))
    return model


def test_time_spent_before_the_solve_shortens_the_wall_limit_only():
    tiny = cp_model.CpModel()
    tiny.NewBoolVar("x")
    result = solve(tiny, 4.0, started=time.perf_counter() - 1.0)
    params = result.solver.parameters
    assert params.max_deterministic_time == DETERMINISTIC_SHARE * 4.0
    assert WALL_SLACK * 4.0 - 1.1 < params.max_time_in_seconds <= WALL_SLACK * 4.0 - 1.0
    assert result.status == "optimal" and result.deterministic


def test_a_search_the_wall_clock_ends_is_not_reproducible():
    result = solve(weighted_completion(), 10.0, started=time.perf_counter() - (WALL_SLACK * 10.0 - 0.1))
    assert result.status in ("feasible", "unknown") and not result.deterministic


def test_the_deadline_is_marked_cut_only_where_its_clock_ends_the_search():
    """A wall limit longer than what is left of the command's deadline is capped silently: a
    search its deterministic limit ends is reproducible. One the deadline ends is marked."""
    from memsched.deadline import Deadline

    roomy = Deadline(WALL_FLOOR - 1.0)        # less than the 4 s safety net asks for
    result = solve(weighted_completion(), 0.2, deadline=roomy)
    assert result.solver.parameters.max_time_in_seconds < WALL_FLOOR
    assert result.deterministic and not roomy.cut
    short = Deadline(0.2)
    result = solve(weighted_completion(), 10.0, deadline=short)
    assert not result.deterministic and short.cut


def test_a_caller_past_its_limit_still_gets_its_least_wall_time_and_the_same_deterministic_limit():
    tiny = cp_model.CpModel()
    tiny.NewBoolVar("x")
    params = solve(tiny, 1.0, started=time.perf_counter() - 5.0 * WALL_SLACK, min_seconds=0.1).solver.parameters
    assert params.max_time_in_seconds == WALL_FLOOR and params.max_deterministic_time == DETERMINISTIC_SHARE * 1.0
    late = time.perf_counter() - 5.0 * WALL_SLACK
    params = solve(tiny, 1.0, started=late, min_seconds=WALL_FLOOR + 1).solver.parameters
    assert params.max_time_in_seconds == WALL_FLOOR + 1


def test_one_worker_ends_at_its_deterministic_limit_and_finds_the_same_answer_again():
    first = solve(weighted_completion(), 0.4)
    second = solve(weighted_completion(), 0.4, started=time.perf_counter() - 2.0)   # less wall time left
    assert first.solver.parameters.num_workers == 1
    assert first.deterministic and second.deterministic
    assert first.solver.deterministic_time <= 1.01 * DETERMINISTIC_SHARE * 0.4
    assert first.solver.ObjectiveValue() == second.solver.ObjectiveValue()


def test_a_model_with_slower_deterministic_seconds_takes_a_smaller_share():
    result = solve(weighted_completion(), 2.0, share=0.1)
    assert result.solver.parameters.max_deterministic_time == 0.1 * 2.0
