"""Predicted vs measured step time on this machine, per model and per op class (one JSON object).

For each bundled model at each size (`small`: the calibration's reference sizes,
passes.calibration.REFERENCE_SIZES; `large`: LARGE_SIZES below, which the calibration never
saw), its training step (passes.training: forward, cross-entropy, backward, SGD) is
  - run whole in one ONNX Runtime session, inputs and outputs bound, median of --runs runs
    timed before and after the profiling (`measured_s`), as `memsched run --json` times a step,
  - simulated with the calibrated profile (--hardware, default `cpu`: `predicted_s`),
  - profiled op by op with ONNX Runtime (memsched.measure.profile_graph) and simulated with
    that measured cost table (`predicted_table_s`),
all in this one process, so the ratios compare like with like. Per op class, the model's
prediction is compared with the profiled ops' times (`classes`); `summary` pools the classes
over every model and size. Target: predicted / measured within 0.8-1.25.

    python bench/bench_predict.py [--models all] [--sizes small,large] [--runs 7] [--repeats 10]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched import hardware  # noqa: E402
from memsched.cost import op_cost, op_time  # noqa: E402
from memsched.measure import Timer, cpu_clock, make_session, np_dtype, profile_graph, random_inputs  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from memsched.simulate import simulate  # noqa: E402
from memsched.passes.calibration import REFERENCE_SIZES, reference_graph  # noqa: E402

LARGE_SIZES = {"mlp": dict(batch=256), "vgg16": dict(batch=4, size=64), "resnet18": dict(batch=8, size=64),
               "resnet50": dict(batch=4, size=64), "mobilenetv2": dict(batch=8, size=96),
               "unet2d": dict(batch=2, size=64), "unet3d": dict(batch=1, size=32, width=16),
               "bert-base": dict(batch=2, seq=64, layers=2), "gpt2": dict(batch=2, seq=64, layers=2),
               "dcgan-generator": dict(batch=16, size=64), "dcgan-discriminator": dict(batch=16, size=64)}
SIZES = {"small": REFERENCE_SIZES, "large": LARGE_SIZES}
LOW, HIGH = 0.8, 1.25


def whole_graph_seconds(graph, runs: int, threads: int) -> list[float]:
    """Times of `runs` runs of the whole graph in one session (after two warm-up runs)."""
    session = make_session(graph.to_onnx(), "cpu", threads)
    values = random_inputs(graph)
    outputs = [(n, graph.tensors[n].shape, np_dtype(graph, n)) for n in graph.outputs]
    timer = Timer.bind(session, {n: values[n] for n in graph.inputs}, outputs, "cpu", threads)
    for _ in range(2):
        timer.run()
    return [timer.run() for _ in range(runs)]


def class_times(graph, table, hw) -> dict[str, dict]:
    """Per op class: ops, predicted seconds on `hw`, profiled seconds (the table's)."""
    classes: dict[str, dict] = defaultdict(lambda: {"ops": 0, "predicted_s": 0.0, "profiled_s": 0.0})
    for op in graph.ops:
        cls = op_cost(op, graph).op_class
        if cls == "shape":
            continue
        row = classes[cls]
        row["ops"] += 1
        row["predicted_s"] += op_time(op, graph, hw)
        row["profiled_s"] += table.times[op.name]
    return {cls: {**row, "ratio": row["predicted_s"] / row["profiled_s"] if row["profiled_s"] else None}
            for cls, row in sorted(classes.items(), key=lambda kv: -kv[1]["profiled_s"])}


def bench(name: str, size: str, hw, runs: int, repeats: int, threads: int) -> dict:
    options = SIZES[size][name]
    graph = reference_graph(name, options)
    before = whole_graph_seconds(graph, runs, threads)
    start = time.perf_counter()
    table = profile_graph(graph, "cpu", repeats=repeats, threads=threads)
    profile_s = time.perf_counter() - start
    after = whole_graph_seconds(graph, runs, threads)
    measured = statistics.median(before + after)
    plan = Plan.initial(graph)
    predicted = simulate(plan, hw).step_time
    by_table = simulate(plan, hw, costs=table).step_time
    return {"model": name, "size": size, "options": options, "ops": len(graph.ops),
            "timed_ops": table.meta["timed_ops"], "measured_s": measured,
            "measured_before_s": statistics.median(before), "measured_after_s": statistics.median(after),
            "predicted_s": predicted, "predicted_table_s": by_table, "profiled_sum_s": table.total(),
            "ratio": predicted / measured, "ratio_table": by_table / measured,
            "within_target": LOW <= predicted / measured <= HIGH,
            "classes": class_times(graph, table, hw), "profile_seconds": profile_s}


def summary(results: list[dict]) -> dict:
    """Per op class over every result: summed predicted and profiled seconds, their ratio, and
    the spread of the per-model ratios."""
    pooled: dict[str, dict] = defaultdict(lambda: {"ops": 0, "predicted_s": 0.0, "profiled_s": 0.0, "ratios": []})
    for r in results:
        for cls, row in r["classes"].items():
            p = pooled[cls]
            p["ops"] += row["ops"]
            p["predicted_s"] += row["predicted_s"]
            p["profiled_s"] += row["profiled_s"]
            if row["ratio"] is not None:
                p["ratios"].append(row["ratio"])
    classes = {cls: {"ops": p["ops"], "predicted_s": p["predicted_s"], "profiled_s": p["profiled_s"],
                     "ratio": p["predicted_s"] / p["profiled_s"] if p["profiled_s"] else None,
                     "model_ratio_min": min(p["ratios"], default=None),
                     "model_ratio_median": statistics.median(p["ratios"]) if p["ratios"] else None,
                     "model_ratio_max": max(p["ratios"], default=None)}
               for cls, p in sorted(pooled.items(), key=lambda kv: -kv[1]["profiled_s"])}
    ratios = [r["ratio"] for r in results]
    return {"classes": classes, "within_target": sum(r["within_target"] for r in results), "results": len(results),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all", help="comma-separated bundled models (default: all)")
    parser.add_argument("--sizes", default="small,large", help="comma-separated: small, large")
    parser.add_argument("--hardware", default="cpu", help="the calibrated profile to predict with (default cpu)")
    parser.add_argument("--runs", type=int, default=7, help="whole-graph runs before and after profiling")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per op when profiling")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime intra-op threads (default 1: timed in thread CPU time, which other "
                             "processes on a shared machine do not inflate; 0: ORT's default, wall time)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    names = list(REFERENCE_SIZES) if args.models == "all" else args.models.split(",")
    sizes = args.sizes.split(",")
    for name in names:
        if name not in REFERENCE_SIZES:
            parser.error(f"unknown model '{name}'; choose from {', '.join(REFERENCE_SIZES)}")
    for size in sizes:
        if size not in SIZES:
            parser.error(f"unknown size '{size}'; choose from {', '.join(SIZES)}")
    hw = hardware.load(args.hardware)
    results = [bench(name, size, hw, args.runs, args.repeats, args.threads) for size in sizes for name in names]
    print(json.dumps({"machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "profile": hw.description, "onnxruntime": ort.__version__, "threads": args.threads,
                      "clock": cpu_clock("cpu", args.threads).__name__, "results": results,
                      "summary": summary(results)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
