"""Predicted vs measured step time on this machine (prints one JSON object).

For each model, its training step (passes.autodiff: forward, cross-entropy, backward, SGD) is
  - profiled op by op with ONNX Runtime (memsched.measure.profile_graph) and simulated with
    that measured cost table (`predicted_table_s`),
  - simulated with the calibrated `cpu` roofline profile (`predicted_roofline_s`),
  - run whole in one ONNX Runtime session, inputs and outputs bound, median of --runs runs,
    timed before and after the profiling (`measured_s`),
all in this one process, so the ratios compare like with like. Target: within 25%.

    python bench/bench_predict.py [--models resnet18,mobilenetv2] [--runs 15] [--repeats 10]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched import frontend, hardware  # noqa: E402
from memsched.measure import Timer, cpu_clock, make_session, np_dtype, profile_graph, random_inputs  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from memsched.simulate import simulate  # noqa: E402
from passes.pipeline import load_graph  # noqa: E402

SIZES = {"resnet18": dict(batch=4, size=64), "mobilenetv2": dict(batch=4, size=64), "mlp": dict(batch=256),
         "vgg16": dict(batch=2, size=32), "bert-base": dict(batch=1, seq=32), "gpt2": dict(batch=1, seq=32)}


def whole_graph_seconds(graph, runs: int, threads: int) -> list[float]:
    """Times of `runs` runs of the whole graph in one session (after two warm-up runs)."""
    session = make_session(graph.to_onnx(), "cpu", threads)
    values = random_inputs(graph)
    outputs = [(n, graph.tensors[n].shape, np_dtype(graph, n)) for n in graph.outputs]
    timer = Timer.bind(session, {n: values[n] for n in graph.inputs}, outputs, "cpu", threads)
    for _ in range(2):
        timer.run()
    return [timer.run() for _ in range(runs)]


def bench(name: str, runs: int, repeats: int, threads: int) -> dict:
    import models

    options = SIZES.get(name, {})
    graph = load_graph(frontend.lower(models.build(name, **options)), train=True, optimizer="sgd")
    before = whole_graph_seconds(graph, runs, threads)
    start = time.perf_counter()
    table = profile_graph(graph, "cpu", repeats=repeats, threads=threads)
    profile_s = time.perf_counter() - start
    after = whole_graph_seconds(graph, runs, threads)
    measured = statistics.median(before + after)
    plan = Plan.initial(graph)
    by_table = simulate(plan, "cpu", costs=table).step_time
    by_roofline = simulate(plan, "cpu").step_time
    return {"model": name, "options": options, "graph": "training step (cross-entropy, SGD)", "ops": len(graph.ops),
            "timed_ops": table.meta["timed_ops"], "measured_s": measured,
            "measured_before_s": statistics.median(before), "measured_after_s": statistics.median(after),
            "predicted_table_s": by_table, "predicted_roofline_s": by_roofline,
            "ratio_table": by_table / measured, "ratio_roofline": by_roofline / measured,
            "within_25pct_table": abs(by_table / measured - 1) <= 0.25,
            "within_25pct_roofline": abs(by_roofline / measured - 1) <= 0.25,
            "profile_seconds": profile_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mobilenetv2")
    parser.add_argument("--runs", type=int, default=15, help="whole-graph runs before and after profiling")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per op when profiling")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime intra-op threads (default 1: timed in thread CPU time, which other "
                             "processes on a shared machine do not inflate; 0: ORT's default, wall time)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    cpu = hardware.load("cpu")
    results = [bench(name, args.runs, args.repeats, args.threads) for name in args.models.split(",")]
    print(json.dumps({"machine": platform.node(), "cpu_profile": cpu.description, "onnxruntime": ort.__version__,
                      "threads": args.threads, "clock": cpu_clock("cpu", args.threads).__name__,
                      "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
