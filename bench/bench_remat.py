"""Recompute planner benchmark: every method on training-shaped graphs at budget fractions
0.9 and 0.8 of the no-recomputation peak. Prints one JSON object on stdout (progress on
stderr). `--quick` runs a few small cases with a short limit. `--rlg` runs instead the
linearised graphs (`passes.recompute.graphs.linearized`, the shape of Moccasin's RLG graphs) of 250 and
1,000 nodes at 0.8 and 0.9 (`--fractions`) for the seeds given, and the node-link files given
with `--graphs` (Moccasin's own RLG files from its repository's data/, read as they are; not
bundled), through the `memsched remat` command, each row saying how long the whole command
took (from outside), when its first fitting plan came and how cheap its answer was, beside
Moccasin's published overhead for the same size and fraction.

    python bench/bench_remat.py [--quick | --rlg [--seeds 0 1 ...] [--fractions 0.8 0.9] [--graphs FILE ...]]
        [--time-limit S] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched.passes.recompute import dag as remat  # noqa: E402
from memsched.passes.recompute import graphs  # noqa: E402

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
RLG_FRACTIONS = (0.8, 0.9)
# Moccasin's published overhead on its RLG graphs (Bartan et al., ICML 2023), (nodes, fraction) -> ratio
MOCCASIN_PUBLISHED = {(250, 0.8): 0.049, (250, 0.9): 0.009, (1000, 0.8): 0.034, (1000, 0.9): 0.007}


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


def command_row(name: str, path: Path, fraction: float, limit: float) -> dict:
    """`memsched remat GRAPH.json --budget-fraction F --time-limit LIMIT --json` as a user runs it
    on the node-link graph at `path`: the whole command's wall time from outside, and its answer
    (the first fitting plan's time and overhead from the methods' `found_at`; the schedule's
    SHA-1, to compare runs: the same command gives the same plan under any load)."""
    problem = remat.load_node_link(path)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memsched", "remat", str(path), "--budget-fraction", str(fraction),
                           "--time-limit", str(limit), "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - started
    row = {"graph": name, "nodes": problem.n, "fraction": fraction, "command_wall_s": round(wall, 2),
           "wall_over_limit": round(wall / limit, 3), "exit": proc.returncode}
    if proc.returncode != 0:
        row.update(feasible=False, error=proc.stderr.strip().splitlines()[-1:])
        return row
    out = json.loads(proc.stdout)
    fitting = sorted((m for m in out["methods"].values() if m["fits"]), key=lambda m: m["found_at"])
    row.update(feasible=True, budget_bytes=out["budget_bytes"], peak_bytes=out["peak_bytes"], winner=out["method"],
               status=out["status"], overhead=round(out["overhead"], 6),
               schedule_sha1=hashlib.sha1(json.dumps(out["schedule"]).encode()).hexdigest(),
               lower_bound_overhead=(round(out["lower_bound"] / out["base_cost"] - 1, 6)
                                     if out["lower_bound"] is not None else None),
               first_fit_seconds=round(fitting[0]["found_at"], 2), first_fit_overhead=round(fitting[0]["overhead"], 6),
               methods={k: {"fits": m["fits"], "overhead": round(m["overhead"], 6), "found_at": round(m["found_at"], 2)}
                        for k, m in out["methods"].items()})
    return row


def rlg_graphs(seeds, files, folder: Path) -> list[tuple[str, Path, int | None]]:
    """(name, node-link file, its size in RLG_NODES) of each graph to run: the linearised
    graphs of RLG_NODES nodes for every seed (one node fewer: a forward chain and its
    backward), written to `folder`, then the `files` given (Moccasin's own RLG files, which
    memsched remat reads as they are; they are not bundled), sized by their node count."""
    cases = []
    for nodes in RLG_NODES:
        for seed in seeds:
            path = folder / f"linearized-{nodes}-seed{seed}.json"
            path.write_text(json.dumps(remat.to_node_link(graphs.linearized(nodes, seed=seed))))
            cases.append((path.stem, path, nodes))
    return cases + [(Path(f).stem, Path(f), None) for f in files]


def main_rlg(seeds, fractions, limit: float, files=()) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, path, nodes in rlg_graphs(seeds, files, Path(folder)):
            for fraction in fractions:
                row = command_row(name, path, fraction, limit)
                published = MOCCASIN_PUBLISHED.get((nodes or row["nodes"], fraction))
                row.update(moccasin_published_overhead=published,
                           at_or_below_moccasin=(published is not None and row.get("overhead") is not None
                                                 and row["overhead"] <= published))
                rows.append(row)
                print(f"{name} n={row['nodes']} F={fraction}: first fit {row.get('first_fit_overhead')} at "
                      f"{row.get('first_fit_seconds')} s, end {row.get('overhead')}, "
                      f"command {row['command_wall_s']} s (Moccasin {published})", file=sys.stderr, flush=True)
    print(json.dumps({
        "benchmark": "remat-rlg", "generator": "passes.recompute.graphs.linearized(nodes, seed, skips=4)",
        "files": [str(f) for f in files],
        "command": "memsched remat GRAPH.json --budget-fraction F --time-limit S --json",
        "fractions": list(fractions), "time_limit_s": limit, "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2), "cases": rows,
        "feasible_everywhere": all(r["feasible"] for r in rows),
        "at_or_below_moccasin_everywhere": all(r["at_or_below_moccasin"] for r in rows),
        "worst_wall_over_limit": max(r["wall_over_limit"] for r in rows),
    }, indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small cases, 5 s limit")
    parser.add_argument("--time-limit", type=float, default=None, help="CP-SAT seconds per case (60; quick: 5)")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--rlg", action="store_true", help="linearised graphs of 250 and 1,000 nodes")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0], help="graph seeds for --rlg (0)")
    parser.add_argument("--fractions", nargs="*", type=float, default=list(RLG_FRACTIONS),
                        help="budget fractions for --rlg (0.8 0.9)")
    parser.add_argument("--graphs", nargs="*", default=[],
                        help="node-link graph files for --rlg besides the generated ones (Moccasin's data/ files)")
    args = parser.parse_args(argv)
    if args.rlg:
        return main_rlg(args.seeds, args.fractions, args.time_limit or 60.0, args.graphs)
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
