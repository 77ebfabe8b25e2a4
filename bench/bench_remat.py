"""Recompute planner benchmark: every method on training-shaped graphs at budget fractions
0.9 and 0.8 of the no-recomputation peak. Prints one JSON object on stdout (progress on
stderr). `--quick` runs a few small cases with a short limit. `--rlg` runs instead the
linearised graphs (`passes.recompute.graphs.linearized`, the shape of Moccasin's RLG graphs) of 250 and
1,000 nodes at 0.8 for the seeds given, each row saying how long `plan` took to its first
plan that fits and how cheap that plan was, against the end of the time limit.

    python bench/bench_remat.py [--quick | --rlg [--seeds 0 1 ...]] [--time-limit S] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from passes.recompute import dag as remat  # noqa: E402
from passes.recompute import graphs  # noqa: E402

FULL_CASES = {
    "chain-100": lambda: graphs.chain(100, seed=0),
    "unet-5": lambda: graphs.unet(depth=5, convs=2, seed=0),
    "resnet-50": lambda: graphs.resnet((3, 4, 6, 3), seed=0),
    "random-100": lambda: graphs.random_layered(100, seed=0),
    "random-300": lambda: graphs.random_layered(300, seed=0),
    "random-1000": lambda: graphs.random_layered(1000, seed=0),
}
QUICK_CASES = {
    "chain-30": lambda: graphs.chain(30, seed=0),
    "resnet-small": lambda: graphs.resnet((1, 2, 2, 1), seed=0),
    "random-100": lambda: graphs.random_layered(100, seed=0),
}
FRACTIONS = (0.9, 0.8)
RLG_NODES = (250, 1000)
RLG_FRACTION = 0.8


def method_summary(run: remat.Result | None, full_peak: int) -> dict:
    if run is None:
        return {"fits": False, "overhead": None, "peak_fraction": None, "status": None, "seconds": None}
    return {"fits": run.fits, "overhead": round(run.overhead, 6) if run.fits else None,
            "peak_fraction": round(run.peak_bytes / full_peak, 4), "status": run.status,
            "seconds": round(run.seconds, 3)}


def planned(name: str, problem: remat.RematProblem, fraction: float, time_limit: float):
    """(the row's common keys, remat.plan's result), or (the row saying why none, None)."""
    budget = remat.budget_from_fraction(problem, fraction)
    started = time.perf_counter()
    row = {"graph": name, "nodes": problem.n, "fraction": fraction, "budget_bytes": budget}
    try:
        return row, remat.plan(problem, budget, time_limit_s=time_limit)
    except remat.BudgetInfeasible as err:
        row.update(feasible=False, smallest_budget_bytes=err.smallest_budget,
                   seconds=round(time.perf_counter() - started, 2))
        return row, None


def bench_case(name: str, problem: remat.RematProblem, fraction: float, time_limit: float) -> dict:
    full_peak = remat.checkpoint_all_peak(problem)
    started = time.perf_counter()
    row, result = planned(name, problem, fraction, time_limit)
    if result is None:
        return row
    runs = result.runs
    methods = {m: method_summary(runs.get(m), full_peak) for m in remat.METHODS}
    cp = runs.get(remat.CPSAT)
    rivals = [runs[m].overhead for m in (remat.SQRT_N, remat.GREEDY) if m in runs and runs[m].fits]
    row.update(
        feasible=True, winner=result.method, status=result.status, overhead=round(result.overhead, 6),
        lower_bound_overhead=(round(result.lower_bound / problem.base_cost - 1, 6)
                              if result.lower_bound is not None else None),
        seconds=round(time.perf_counter() - started, 2), methods=methods,
        cpsat_feasible=cp is not None and cp.fits,
        cpsat_ahead=cp is not None and all(cp.overhead <= r + 1e-12 for r in rivals),
        cpsat_strictly_ahead=cp is not None and all(cp.overhead < r for r in rivals))
    return row


def anytime_row(name: str, problem: remat.RematProblem, fraction: float, time_limit: float) -> dict:
    """How `plan` gets there: the first fitting plan (seconds from the start, overhead) and the
    final one, with what each phase produced."""
    started = time.perf_counter()
    row, result = planned(name, problem, fraction, time_limit)
    if result is None:
        return row
    fitting = sorted((r for r in result.runs.values() if r.fits), key=lambda r: r.found_at)
    first = fitting[0]
    row.update(
        feasible=True, first_fit_method=first.method, first_fit_seconds=round(first.found_at, 2),
        first_fit_overhead=round(first.overhead, 6), winner=result.method, status=result.status,
        overhead=round(result.overhead, 6), seconds=round(time.perf_counter() - started, 2),
        lower_bound_overhead=(round(result.lower_bound / problem.base_cost - 1, 6)
                              if result.lower_bound is not None else None),
        runs={m: {"fits": r.fits, "overhead": round(r.overhead, 6), "found_at": round(r.found_at, 2),
                  "peak_fraction_of_budget": round(r.peak_bytes / row["budget_bytes"], 4)}
              for m, r in result.runs.items()})
    return row


def main_rlg(seeds, limit: float) -> int:
    rows = []
    for nodes in RLG_NODES:
        for seed in seeds:
            name = f"linearized-{nodes}-seed{seed}"
            row = anytime_row(name, graphs.linearized(nodes, seed=seed), RLG_FRACTION, limit)
            rows.append(row)
            print(f"{name} n={row['nodes']}: first fit {row.get('first_fit_overhead')} at "
                  f"{row.get('first_fit_seconds')} s, end {row.get('overhead')} at {row['seconds']} s",
                  file=sys.stderr, flush=True)
    print(json.dumps({
        "benchmark": "remat-rlg", "generator": "passes.recompute.graphs.linearized(nodes, seed, skips=4)",
        "fraction": RLG_FRACTION, "time_limit_s": limit, "cpu_count": os.cpu_count(), "cases": rows,
        "feasible_everywhere": all(r["feasible"] for r in rows),
    }, indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small cases, 5 s limit")
    parser.add_argument("--time-limit", type=float, default=None, help="CP-SAT seconds per case (60; quick: 5)")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--rlg", action="store_true", help="linearised graphs of 250 and 1,000 nodes at 0.8")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0], help="graph seeds for --rlg (0)")
    args = parser.parse_args(argv)
    if args.rlg:
        return main_rlg(args.seeds, args.time_limit or 60.0)
    cases = QUICK_CASES if args.quick else FULL_CASES
    limit = args.time_limit or (5.0 if args.quick else 60.0)
    if args.only:
        unknown = set(args.only) - set(cases)
        if unknown:
            parser.error(f"unknown case(s) {sorted(unknown)}; choose from {sorted(cases)}")
        cases = {k: v for k, v in cases.items() if k in args.only}
    rows = []
    for name, make in cases.items():
        problem = make()
        for fraction in FRACTIONS:
            row = bench_case(name, problem, fraction, limit)
            rows.append(row)
            print(f"{name} n={problem.n} F={fraction}: {row.get('status', 'infeasible')} "
                  f"overhead={row.get('overhead')} in {row['seconds']} s", file=sys.stderr, flush=True)
    feasible = [r for r in rows if r["feasible"]]
    print(json.dumps({
        "benchmark": "remat", "quick": args.quick, "time_limit_s": limit, "cpu_count": os.cpu_count(),
        "cases": rows,
        "cpsat_feasible_everywhere": all(r.get("cpsat_feasible") for r in rows),
        "cpsat_ahead_everywhere": bool(feasible) and all(r["cpsat_ahead"] for r in feasible),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
