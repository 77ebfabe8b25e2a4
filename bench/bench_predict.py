"""Predicted vs measured step time on this machine (prints one JSON object).

For each model: the graph (the training step if passes.autodiff is installed, else the
forward graph; the JSON says which) is
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

import numpy as np  # noqa: E402

from memsched import frontend, hardware  # noqa: E402
from memsched.measure import Timer, make_session, profile_graph, random_inputs  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from memsched.simulate import simulate  # noqa: E402

SIZES = {"resnet18": dict(batch=4, size=64), "mobilenetv2": dict(batch=4, size=64), "mlp": dict(batch=256),
         "vgg16": dict(batch=2, size=32), "bert-base": dict(batch=1, seq=32), "gpt2": dict(batch=1, seq=32)}


def training_step(graph):
    """The training step if the autodiff pass is present, else None."""
    try:
        from passes.autodiff import build_training_step
    except ImportError:
        return None
    return build_training_step(graph, loss="cross_entropy", optimizer="sgd")


def whole_graph_seconds(graph, runs: int, threads: int) -> list[float]:
    session = make_session(graph.to_onnx(), "cpu", threads)
    values = random_inputs(graph)
    outputs = [(n, graph.tensors[n].shape, np.dtype(values[n].dtype) if n in values else
                frontend_dtype(graph, n)) for n in graph.outputs]
    timer = Timer.bind(session, {n: values[n] for n in graph.inputs}, outputs, "cpu", threads)
    for _ in range(2):
        timer.run()
    return [timer.run() for _ in range(runs)]


def frontend_dtype(graph, name):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(graph.tensors[name].dtype)


def bench(name: str, runs: int, repeats: int, threads: int) -> dict:
    import models

    options = SIZES.get(name, {})
    graph = frontend.lower(models.build(name, **options))
    trained = training_step(graph)
    kind = "training" if trained is not None else "forward"
    graph = trained if trained is not None else graph
    before = whole_graph_seconds(graph, runs, threads)
    start = time.perf_counter()
    table = profile_graph(graph, "cpu", repeats=repeats, threads=threads)
    profile_s = time.perf_counter() - start
    after = whole_graph_seconds(graph, runs, threads)
    measured = statistics.median(before + after)
    plan = Plan.initial(graph)
    by_table = simulate(plan, "cpu", costs=table).step_time
    by_roofline = simulate(plan, "cpu").step_time
    return {"model": name, "options": options, "graph": kind, "ops": len(graph.ops),
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
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: default)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    cpu = hardware.load("cpu")
    results = [bench(name, args.runs, args.repeats, args.threads) for name in args.models.split(",")]
    print(json.dumps({"machine": platform.node(), "cpu_profile": cpu.description, "onnxruntime": ort.__version__,
                      "threads": args.threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
