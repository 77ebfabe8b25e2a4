"""Recompute on real training steps: ResNet-50, BERT-base and 3-D U-Net under half their
zero-overhead peak. Prints one JSON object on stdout (progress on stderr).

For each model, the SGD training step (passes.training) is planned the way `memsched compile
--strategies order,reuse,recompute` plans it: reuse (with the rewritten steps it may pick,
passes.rewrites.concat_split's), order (CP-SAT), then recompute_pass at
a budget of F x the zero-overhead peak (the judged peak after reuse and order, nothing
replayed). Reported per model and fraction: baseline peak (graph order, nothing reused), the
zero-overhead peak, the budget, the plan's judged peak, the predicted overhead (simulated
step time on v100-16gb with the replays / without - 1), the solver status and winning
method, the replays, seconds per pass; when the budget cannot be met, the smallest peak the
pass reached. Graphs are built shape-only (models.build(weights=False)): planning needs no
weights.

    python bench/bench_recompute.py [--quick] [--time-limit S] [--fractions 0.5,0.6] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched import models  # noqa: E402
from memsched.errors import BudgetError  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.ir import Graph  # noqa: E402
from memsched.memory import analyze_plan  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from memsched.passes.order import order_pass  # noqa: E402
from memsched.passes.pipeline import training_steps  # noqa: E402
from memsched.passes.recompute.planner import recompute_pass  # noqa: E402
from memsched.passes.reuse import reuse_pass  # noqa: E402

HARDWARE = "v100-16gb"
FULL = {
    "resnet50": dict(batch=32, size=224),
    "bert-base": dict(batch=8, seq=128),
    "unet3d": dict(batch=1, size=64),
}
QUICK = {   # the same kind of peak (activations), fewer bytes or layers
    "resnet50": dict(batch=16, size=112),
    "bert-base": dict(batch=8, seq=128, layers=4),
    "unet3d": dict(batch=1, size=32),
}
TARGET_OVERHEAD = 0.10


def training_graph(name: str, options: dict) -> tuple[Graph, dict[str, Graph]]:
    """The SGD training step of a shape-only build of bundled model `name`, and the rewritten
    steps reuse may pick instead (as `memsched compile` has them)."""
    return training_steps(lower(models.build(name, weights=False, **options)), loss="cross_entropy", optimizer="sgd")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_model(name: str, options: dict, fractions, time_limit: float, order_limit: float) -> list[dict]:
    started = time.perf_counter()
    graph, variants = training_graph(name, options)
    seconds = {"build": round(time.perf_counter() - started, 2)}
    baseline = Plan.initial(graph, hardware=HARDWARE)
    base_peak = analyze_plan(baseline).peak_bytes
    t = time.perf_counter()
    plan = reuse_pass(baseline, variants=variants)
    seconds["reuse"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    plan = order_pass(plan, order_limit)
    seconds["order"] = round(time.perf_counter() - t, 2)
    zero = analyze_plan(plan).peak_bytes
    say(f"{name} {options}: {len(graph.ops)} ops, baseline peak {base_peak:,} B, zero-overhead peak {zero:,} B")
    rows = []
    for fraction in fractions:
        budget = int(fraction * zero)
        row = {"model": name, "options": options, "ops": len(graph.ops), "planned_ops": len(plan.graph.ops),
               "reuse_variant": plan.notes["reuse"]["variant"], "fraction": fraction,
               "baseline_peak_bytes": base_peak, "zero_overhead_peak_bytes": zero, "budget_bytes": budget,
               "seconds": dict(seconds)}
        t = time.perf_counter()
        try:
            out = recompute_pass(dataclasses.replace(plan, budget=budget), time_limit)
        except BudgetError as err:
            reached = err.smallest_feasible_bytes
            row.update(fits=False, smallest_peak_bytes=reached,
                       smallest_peak_fraction=round(reached / zero, 4) if reached else None)
            row["seconds"]["recompute"] = round(time.perf_counter() - t, 2)
            say(f"  {fraction:.2f}: cannot fit; smallest peak {reached:,} B ({reached / zero:.1%})")
            rows.append(row)
            continue
        row["seconds"]["recompute"] = round(time.perf_counter() - t, 2)
        notes = out.notes["recompute"]
        profile = analyze_plan(out)
        before = analyze_plan(plan)
        row.update(
            fits=True, peak_bytes=profile.peak_bytes, peak_fraction=round(profile.peak_bytes / zero, 4),
            overhead=round(notes["overhead"], 5), status=notes["status"], method=notes["method"],
            base_order=notes["base_order"], recomputed_ops=len(notes["recomputed_ops"]),
            recomputations=notes["recomputations"], added_compute_s=notes["added_compute_s"],
            step_time_before_s=notes["step_time_before_s"], step_time_after_s=notes["step_time_after_s"],
            lower_bound_added_s=notes["lower_bound_added_s"], abstract_nodes=notes["abstract"]["nodes"],
            rounds=len(notes["rounds"]),
            activation_bytes_at_peak={"before": before.kinds_at(before.peak_step).get("activation", 0),
                                      "after": profile.kinds_at(profile.peak_step).get("activation", 0)},
            meets_target=notes["overhead"] <= TARGET_OVERHEAD)
        say(f"  {fraction:.2f}: peak {profile.peak_bytes:,} B ({row['peak_fraction']:.1%}), overhead "
            f"{notes['overhead']:+.2%}, {notes['status']} ({notes['method']}), {row['seconds']['recompute']} s")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, 10 s limits")
    parser.add_argument("--time-limit", type=float, default=None, help="recompute seconds per case (60; quick 10)")
    parser.add_argument("--order-limit", type=float, default=None, help="order pass seconds (30; quick 5)")
    parser.add_argument("--fractions", default=None,
                        help="budget fractions of the zero-overhead peak "
                             "(0.5; quick 0.65: parameters weigh more there)")
    parser.add_argument("--only", nargs="*", help="model names to run")
    args = parser.parse_args(argv)
    cases = QUICK if args.quick else FULL
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only}
    limit = args.time_limit or (10.0 if args.quick else 60.0)
    order_limit = args.order_limit or (5.0 if args.quick else 30.0)
    fractions = [float(f) for f in (args.fractions or ("0.65" if args.quick else "0.5")).split(",")]
    rows = []
    for name, options in cases.items():
        rows.extend(bench_model(name, options, fractions, limit, order_limit))
    fitted = [r for r in rows if r["fits"]]
    print(json.dumps({
        "benchmark": "recompute", "hardware": HARDWARE, "quick": args.quick, "time_limit_s": limit,
        "order_limit_s": order_limit, "cpu_count": os.cpu_count(), "target_overhead": TARGET_OVERHEAD,
        "rows": rows,
        "summary": {"cases": len(rows), "fit": len(fitted),
                    "meet_target": sum(1 for r in fitted if r["meets_target"]),
                    "max_overhead": max((r["overhead"] for r in fitted), default=None)},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
