"""Predicted vs measured step time on this machine, as a user measures it, per model and per op class
(one JSON object).

For each bundled model at each size (`small`: the calibration's reference sizes,
passes.calibration.REFERENCE_SIZES; `large`: LARGE_SIZES below, which the calibration never
saw), the model is written as ONNX (memsched.models.export) and then, as a user does,
  - `memsched compile MODEL --train --strategies order,reuse -o PLAN` (forward, cross-entropy,
    backward, SGD; the DCGAN halves with their losses),
  - `memsched run PLAN --steps RUNS+1 --threads T --json --hardware PROFILE`: `measured_s` is
    its measured step time (the median after the first step), `predicted_s` its predicted one
    (the simulator on --hardware, default the bundled `cpu` profile);
then, in this process, the plan's ops are profiled one by one with ONNX Runtime
(memsched.measure.profile_graph) and the plan simulated with that cost table
(`predicted_table_s`). Per op class, the profile's prediction is compared with the profiled
ops' times (`classes`); `summary` pools the classes over every model and size. Target:
predicted / measured within 0.8-1.25. The run's clock is the wall clock, as a user's: run it
on a quiet machine.

    python bench/bench_predict.py [--models all] [--sizes small,large] [--runs 3] [--repeats 10]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched import hardware, models  # noqa: E402
from memsched.cost import op_cost, op_time  # noqa: E402
from memsched.emit import read_plan  # noqa: E402
from memsched.measure import profile_graph  # noqa: E402
from memsched.simulate import simulate  # noqa: E402
from memsched.passes.calibration import LOSSES, REFERENCE_SIZES  # noqa: E402

LARGE_SIZES = {"mlp": dict(batch=256), "vgg16": dict(batch=4, size=64), "resnet18": dict(batch=8, size=64),
               "resnet50": dict(batch=4, size=64), "mobilenetv2": dict(batch=8, size=96),
               "unet2d": dict(batch=2, size=64), "unet3d": dict(batch=1, size=32, width=16),
               "bert-base": dict(batch=2, seq=64, layers=2), "gpt2": dict(batch=2, seq=64, layers=2),
               "dcgan-generator": dict(batch=16, size=64), "dcgan-discriminator": dict(batch=16, size=64)}
SIZES = {"small": REFERENCE_SIZES, "large": LARGE_SIZES}
LOW, HIGH = 0.8, 1.25


def memsched(*args: str) -> str:
    """One memsched command as a user types it; its standard output."""
    done = subprocess.run([sys.executable, "-m", "memsched", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"memsched {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


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


def bench(name: str, size: str, hw, profile: str, runs: int, repeats: int, threads: int, folder: Path) -> dict:
    options = SIZES[size][name]
    model, plan_path = folder / f"{name}-{size}.onnx", folder / f"{name}-{size}.plan.onnx"
    models.export(name, model, **options)
    memsched("compile", str(model), "--train", "--loss", LOSSES.get(name, "cross_entropy"), "--strategies",
             "order,reuse", "-o", str(plan_path), "--time-limit", "30")
    run = json.loads(memsched("run", str(plan_path), "--steps", str(runs + 1), "--threads", str(threads), "--json",
                              "--hardware", profile))
    plan = read_plan(plan_path)
    start = time.perf_counter()
    table = profile_graph(plan.graph, "cpu", repeats=repeats, threads=threads)
    profile_s = time.perf_counter() - start
    measured, predicted = run["measured"]["step_time_s"], run["predicted"]["step_time_s"]
    by_table = simulate(plan, hw, costs=table).step_time
    return {"model": name, "size": size, "options": options, "ops": len(plan.graph.ops),
            "timed_ops": table.meta["timed_ops"], "measured_s": measured, "step_times_s": run["step_times_s"],
            "predicted_s": predicted, "predicted_table_s": by_table, "profiled_sum_s": table.total(),
            "ratio": predicted / measured, "ratio_table": by_table / measured,
            "within_target": LOW <= predicted / measured <= HIGH,
            "classes": class_times(plan.graph, table, hw), "profile_seconds": profile_s}


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
    parser.add_argument("--runs", type=int, default=3, help="steps `memsched run` times after its first (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per op when profiling")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime intra-op threads of the run and the profiling (default 1)")
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
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as folder:
        results = [bench(name, size, hw, args.hardware, args.runs, args.repeats, args.threads, Path(folder))
                   for size in sizes for name in names]
    print(json.dumps({"machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "profile": hw.description, "onnxruntime": ort.__version__, "threads": args.threads,
                      "load_average": list(os.getloadavg()), "results": results,
                      "summary": summary(results)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
