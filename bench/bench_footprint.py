"""The executor's real footprint and speed against one plain ONNX Runtime session of the same step.

For each model (its SGD training step at a small size, bench_executor.SIZES) two plans are
compiled for the `cpu` profile: order,reuse, and every strategy at 60% of the baseline peak.
Each plan's step is then run in fresh subprocesses, one per configuration, so that every
process starts alike (Python, numpy, ONNX Runtime and memsched loaded, the plan read, the
inputs made) and its memory growth is comparable:

- `memsched`: `memsched run` (executor.run_plan) with --threads N (default 1) and with its
  default (every core);
- `ort_same`: one plain ONNX Runtime session of the plan's step (the same graph, weights as
  initializers, as users run it) with the executor's options (memsched.ort.session_options:
  same optimisation level, N threads);
- `ort_same_threads`: the same with ONNX Runtime's default options but N threads;
- `ort_defaults`: ONNX Runtime's defaults (every optimisation, its memory arena, every core).

Memory is measured the same way in every process (memsched.measure.ProcessMemory): peak RSS
during the session builds and the steps, less RSS just before; for memsched that includes
copying the outputs out of the arena. Step time is the median over --steps steps after one
warm-up step; times are only compared as ratios measured in this one run.

Prints one JSON object (and writes it to -o FILE if given).

    python bench/bench_footprint.py [--models resnet18,bert-base] [--steps 3] [--threads 1] [--time-limit 20]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_executor import SIZES  # noqa: E402

PLANS = [("order,reuse", None), ("order,reuse,recompute,swap", "60%")]
# acceptance: memory growth <= 0.6x ORT's defaults; time <= 1.1x at equal threads, <= 1.25x at defaults
TARGETS = {"memory_vs_ort_defaults": 0.6, "time_vs_ort_same_threads": 1.1, "time_vs_ort_defaults": 1.25}


# ---- the worker: one configuration in a fresh process ---------------------------------------
def worker(kind: str, plan_path: str, threads: int | None, steps: int) -> dict:
    """Run `steps` + 1 steps of the plan's step in this process; return its memory and times."""
    import onnxruntime as ort

    from memsched.emit import read_plan
    from memsched.executor import prepare_inputs, run_plan
    from memsched.measure import ProcessMemory
    from memsched.ort import session_options

    plan = read_plan(plan_path)
    feeds = prepare_inputs(plan.graph)
    if kind == "memsched":
        memory = ProcessMemory()
        result = run_plan(plan, steps=steps + 1, threads=threads or 0, inputs=feeds)
        return {"rss_growth_bytes": memory.growth(), "step_time_s": statistics.median(result.step_times[1:]),
                "run_report": result.process, "sessions": result.sessions, "ops": result.ops}
    model = plan.graph.to_onnx().SerializeToString()
    del plan
    if kind == "ort_same":
        options = session_options(threads or 0)
    else:
        options = ort.SessionOptions()
        if kind == "ort_same_threads":
            options.intra_op_num_threads = threads or 0
    memory = ProcessMemory()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return {"rss_growth_bytes": memory.growth(), "step_time_s": statistics.median(times[1:])}


def run_worker(kind: str, plan_path: Path, threads: int | None, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--plan", str(plan_path), "--steps", str(steps)]
    if threads is not None:
        command += ["--threads", str(threads)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the driver --------------------------------------------------------------------------
def bench_plan(plan_path: Path, arena: int, steps: int, threads: int) -> dict:
    runs = {
        "memsched": run_worker("memsched", plan_path, threads, steps),
        "memsched_default_threads": run_worker("memsched", plan_path, None, steps),
        "ort_same": run_worker("ort_same", plan_path, threads, steps),
        "ort_same_threads": run_worker("ort_same_threads", plan_path, threads, steps),
        "ort_defaults": run_worker("ort_defaults", plan_path, None, steps),
    }
    ours = runs["memsched_default_threads"]
    ratios = {
        "memory_vs_ort_defaults": ours["rss_growth_bytes"] / runs["ort_defaults"]["rss_growth_bytes"],
        "memory_vs_ort_same": runs["memsched"]["rss_growth_bytes"] / runs["ort_same"]["rss_growth_bytes"],
        "time_vs_ort_same": runs["memsched"]["step_time_s"] / runs["ort_same"]["step_time_s"],
        "time_vs_ort_same_threads": runs["memsched"]["step_time_s"] / runs["ort_same_threads"]["step_time_s"],
        "time_vs_ort_defaults": ours["step_time_s"] / runs["ort_defaults"]["step_time_s"],
    }
    met = {key: ratios[key] <= limit for key, limit in TARGETS.items()}
    return {"arena_bytes": arena, "runs": runs, "ratios": ratios, "targets_met": met}


def bench_model(name: str, directory: Path, steps: int, threads: int, time_limit: float) -> dict:
    import models
    from memsched import frontend
    from memsched.emit import write_plan
    from memsched.errors import MemschedError
    from memsched.memory import analyze_plan, check_placement
    from passes.autodiff import build_training_step
    from passes.pipeline import compile as compile_plan

    graph = build_training_step(frontend.lower(models.build(name, **SIZES[name])), loss="cross_entropy",
                                optimizer="sgd")
    entry = {"model": name, "size": SIZES[name], "ops": len(graph.ops), "plans": []}
    for strategies, budget in PLANS:
        row = {"strategies": strategies, "budget": budget}
        try:
            compiled = compile_plan(graph, hardware="cpu", strategies=strategies, budget=budget,
                                    time_limit=time_limit)
        except MemschedError as exc:       # a budget the strategies cannot meet
            row["skipped"] = str(exc)
            entry["plans"].append(row)
            continue
        plan = dataclasses.replace(compiled.plan, budget=None)
        path = write_plan(plan, directory / f"{name}-{len(entry['plans'])}.onnx")
        row["peak_bytes"] = analyze_plan(plan).peak_bytes
        row.update(bench_plan(path, check_placement(analyze_plan(plan), plan.offsets), steps, threads))
        entry["plans"].append(row)
        print(f"{name} {strategies} {budget or ''}: " + ", ".join(f"{k} {v:.3f}" for k, v in row["ratios"].items()),
              file=sys.stderr, flush=True)
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES), help="comma-separated model names")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of the equal-threads runs (default 1); the default-threads runs "
                             "use every core")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per compile")
    parser.add_argument("-o", "--output", help="also write the JSON here")
    parser.add_argument("--worker", choices=("memsched", "ort_same", "ort_same_threads", "ort_defaults"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.plan, args.threads, args.steps)))
        return 0
    threads = 1 if args.threads is None else args.threads
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    with tempfile.TemporaryDirectory(prefix="memsched-footprint-") as directory:
        rows = [bench_model(name, Path(directory), args.steps, threads, args.time_limit) for name in names]
    done = [p for r in rows for p in r["plans"] if "ratios" in p]
    summary = {"plans": len(done),
               "worst": {key: max(p["ratios"][key] for p in done) for key in done[0]["ratios"]} if done else {},
               "all_targets_met": {key: all(p["targets_met"][key] for p in done) for key in TARGETS}}
    report = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count()},
              "threads": threads, "steps": args.steps, "targets": TARGETS, "summary": summary, "models": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
