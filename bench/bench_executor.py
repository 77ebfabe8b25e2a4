"""The executor on real plans: memory as planned, time against ONNX Runtime and the simulator.

For each model (its SGD training step at a small size) and each strategy set that can be
planned here (order; order,reuse; + recompute at 60% and + swap at 40% of the baseline peak
where passes/recompute and passes/swap are installed), the plan from
`passes.pipeline.compile` (hardware `cpu`) is run by the executor with --check and reported:

- planned vs measured peak and arena bytes (they must be equal, exactly);
- the executor's step time (median over --steps) vs one plain ONNX Runtime session of the
  same graph, with the executor's options (memsched.ort.session_options, same threads) and with
  ONNX Runtime's default optimisations: ratios measured in this one process;
- the simulator's step time with the measured `cpu` profile vs the executor's measured one.

Prints one JSON object. Times are only compared as ratios within this run.

    python bench/bench_executor.py [--models mlp,resnet18] [--steps 5] [--threads 2] [--time-limit 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched import models  # noqa: E402
from memsched import frontend  # noqa: E402
from memsched.errors import MemschedError  # noqa: E402
from memsched.runtime import prepare_inputs, run_plan  # noqa: E402
from memsched.ort import session_options  # noqa: E402
from memsched.simulate import simulate  # noqa: E402
from memsched.passes.training import build_training_step  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402

SIZES = {
    "mlp": dict(batch=64),
    "vgg16": dict(batch=2, size=32, classes=10, hidden=256),
    "resnet18": dict(batch=4, size=64, classes=10),
    "resnet50": dict(batch=2, size=64, classes=10),
    "mobilenetv2": dict(batch=4, size=64, classes=10),
    "unet2d": dict(batch=1, size=64, width=16, depth=3),
    "unet3d": dict(batch=1, size=24, width=8, depth=2),
    "bert-base": dict(batch=2, seq=64, layers=2, hidden=256, heads=4, vocab=2000, max_positions=64),
    "gpt2": dict(batch=2, seq=64, layers=2, hidden=256, heads=4, vocab=2000, max_positions=64),
}
STRATEGY_SETS = [("order", None), ("order,reuse", None), ("order,reuse,recompute", "60%"),
                 ("order,reuse,recompute,swap", "40%")]


def plain_ort_seconds(graph, feeds: dict, steps: int, threads: int, optimized: bool) -> float:
    """Median seconds of one whole-graph ONNX Runtime run (weights embedded, as users run it)."""
    import onnxruntime as ort

    options = session_options(threads)
    if optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(graph.to_onnx().SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    session.run(None, feeds)   # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_plan(plan, steps: int, threads: int) -> dict:
    result = run_plan(plan, steps=steps + 1, check=True, threads=threads)
    measured = statistics.median(result.step_times[1:])       # the first step warms up
    predicted = simulate(plan, "cpu").step_time
    return {
        "planned": {"peak_bytes": result.planned_peak_bytes, "arena_bytes": result.planned_arena_bytes},
        "measured": {"peak_bytes": result.peak_bytes, "arena_bytes": result.arena_bytes, "step_time_s": measured},
        "memory_equal": (result.peak_bytes == result.planned_peak_bytes
                         and result.arena_bytes == result.planned_arena_bytes),
        "check": {"passed": result.check["passed"], "max_abs_diff": result.check["max_abs_diff"]},
        "ops": result.ops, "sessions": result.sessions, "provider": result.provider,
        "swapped_bytes": result.swapped_bytes,
        "recomputes": sum(s.kind == "recompute" for s in plan.schedule),
        "predicted_step_time_s": predicted,
        "predicted_over_measured": predicted / measured,
    }


def small_training_step(name: str, size: dict | None = None):
    """The SGD training step (cross-entropy) of bundled model `name` at `size` (default: its
    size in SIZES)."""
    return build_training_step(frontend.lower(models.build(name, **(SIZES[name] if size is None else size))),
                               loss="cross_entropy", optimizer="sgd")


def bench_model(name: str, steps: int, threads: int, time_limit: float) -> dict:
    graph = small_training_step(name)
    feeds = prepare_inputs(graph)
    entry = {"model": name, "size": SIZES[name], "graph": "training step (sgd)", "ops": len(graph.ops),
             "strategies": []}
    ort_plain = plain_ort_seconds(graph, feeds, steps, threads, optimized=False)
    ort_optimized = plain_ort_seconds(graph, feeds, steps, threads, optimized=True)
    entry["ort_step_time_s"] = {"no_optimisation": ort_plain, "default_optimisation": ort_optimized}
    for strategies, budget in STRATEGY_SETS:
        row = {"strategies": strategies, "budget": budget}
        try:
            compiled = compile_plan(graph, hardware="cpu", strategies=strategies, budget=budget,
                                    time_limit=time_limit)
        except MemschedError as exc:   # a strategy not installed, or a budget it cannot meet
            row["skipped"] = str(exc)
            entry["strategies"].append(row)
            continue
        plan = dataclasses.replace(compiled.plan, budget=None)
        row["baseline_peak_bytes"] = compiled.baseline_profile.peak_bytes
        row.update(bench_plan(plan, steps, threads))
        row["executor_over_ort"] = row["measured"]["step_time_s"] / ort_plain
        row["executor_over_ort_optimized"] = row["measured"]["step_time_s"] / ort_optimized
        entry["strategies"].append(row)
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES), help="comma-separated model names")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime intra-op threads of every session, the plain ones included (default 1: "
                             "timings comparable on a small shared machine; bench_footprint.py also times the "
                             "default, every core)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver seconds per pass")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    rows = [bench_model(name, args.steps, args.threads, args.time_limit) for name in names]
    done = [s for r in rows for s in r["strategies"] if "skipped" not in s]
    summary = {
        "plans": len(done),
        "all_checks_bit_identical": all(s["check"]["passed"] and s["check"]["max_abs_diff"] == 0.0 for s in done),
        "all_memory_equal": all(s["memory_equal"] for s in done),
        "executor_over_ort_median": statistics.median(s["executor_over_ort"] for s in done) if done else None,
        "predicted_over_measured_median": (statistics.median(s["predicted_over_measured"] for s in done)
                                           if done else None),
    }
    print(json.dumps({"machine": {"python": platform.python_version(), "cpu": platform.processor() or
                                  platform.machine(), "cores": os.cpu_count()},
                      "threads": args.threads, "steps": args.steps, "summary": summary, "models": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
