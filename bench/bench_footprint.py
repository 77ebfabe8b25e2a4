"""The executor's real footprint and speed against one plain ONNX Runtime session of the same step.

For each model (its SGD training step at a small size, bench_executor.SIZES) two plans are
compiled for the `cpu` profile: order,reuse, and every strategy at 60% of the baseline peak.

Memory: each plan's step runs in fresh subprocesses, --memory-runs per configuration (the run
of median growth counts: growth varies by a few pages from process to process), and every process
gets to the same starting point before it is measured: Python, numpy, ONNX Runtime and
memsched imported, ONNX Runtime's environment made (memsched.ort.warm_environment: one
throwaway one-node session run once; it maps ~7 MiB of the library's code, which any ONNX
Runtime user pays before its first step), the plan read and the inputs made (for a plain
session also its model serialized, as a user holds it before building a session; the plan
is kept, as memsched's run keeps it), and the C heap's free pages given back to the OS
(memsched.measure.release_free_heap: serializing the plain session's model frees as much as
its weights again, which its session would otherwise grow into unseen). Growth is then the peak RSS
(memsched.measure.ProcessMemory) during the session builds and `--steps` + 1 steps, less RSS
at that start: the memory the step needs. For memsched that is `run_plan`: its arena, its
sessions, kernels' scratch, its own tables; for a plain session: its weights, its arena,
kernels' scratch and the outputs it returns. Each run also reports `file_growth_bytes`, the
part of its growth that is library code paged in (RssFile), and the ratios add
`anonymous_memory_vs_ort_defaults`, the memory ratio without it, for information: the
acceptance figure is the whole RSS growth.

- `memsched`: `memsched run` (executor.run_plan) with --threads N (default 1) and with its
  default (every core);
- `ort_same`: one plain ONNX Runtime session of the plan's step (the same graph, weights as
  initializers, as users run it) with the executor's options (memsched.ort.session_options:
  same optimisation level, N threads);
- `ort_same_threads`: the same with ONNX Runtime's default options but N threads;
- `ort_defaults`: ONNX Runtime's defaults (every optimisation, its memory arena, every core);
- `ort_trainable_threads` (time only): ONNX Runtime's default options at N threads on the
  step as a training loop must run it, parameters and optimizer state fed as inputs
  (`trainable_model`). This is the equal-threads time target's reference. With the weights
  baked in as initializers (`ort_same_threads`) ONNX Runtime does once, at load, work that a
  step updating those weights must do every step: it prepacks them (ConvTranspose and Gemm
  re-lay out their weight), folds the ops that read only them (a Conv's flipped weight for
  its input gradient) and, for its blocked NCHWc kernels, re-lays out convolution filters.
  Such a session repeats the first step, never the second; its time is reported
  (`time_vs_ort_same_threads`) beside what it saves:
- `ort_same_threads_no_prepack` and `ort_same_threads_no_folding` (time only): the same
  initializer session with prepacking off (session.disable_prepacking) and with constant
  folding off (the ConstantFolding optimizer disabled), so the JSON shows which of the two
  makes the initializer session faster.

Time: one more subprocess runs every configuration in turn, --rounds times (each round a
fresh run_plan and, for the plain sessions, sessions built once), so a shared machine's load
falls on all of them alike. Each configuration runs the same number of steps per round: at
least --steps, and enough for memsched's step to take --min-seconds (a step of a millisecond
would otherwise be timed three times, within the noise of a thread pool waking). A
configuration's step time is the fastest of its rounds' medians (each round's first step,
the warm-up, dropped): load from other processes only slows a round down. Times are only
compared as ratios measured in that process.

Prints one JSON object (and writes it to -o FILE if given).

    python bench/bench_footprint.py [--models resnet18,bert-base] [--steps 3] [--rounds 5] [--threads 1]
                                    [--min-seconds 1] [--time-limit 20] [--memory-runs 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_executor import SIZES, small_training_step  # noqa: E402
from json_report import emit  # noqa: E402

PLANS = [("order,reuse", None), ("order,reuse,recompute,swap", "60%")]
# acceptance: memory growth <= 0.6x ORT's defaults; time <= 1.1x the trainable step at equal
# threads, <= 1.25x ORT's defaults (initializer weights, every core)
TARGETS = {"memory_vs_ort_defaults": 0.6, "time_vs_ort_trainable_threads": 1.1, "time_vs_ort_defaults": 1.25}


# ---- the workers: each in a fresh process -----------------------------------------------
KINDS = ("memsched", "ort_same", "ort_same_threads", "ort_defaults")


def plain_session(model: bytes, kind: str, threads: int | None):
    """One plain ONNX Runtime session of `model` as configuration `kind` makes it (module
    docstring): the executor's options, or ONNX Runtime's defaults with `threads` and, for the
    two variants, prepacking or constant folding off."""
    import onnxruntime as ort

    from memsched.ort import session_options

    disabled = None
    if kind == "ort_same":
        options = session_options(threads or 0)
    else:
        options = ort.SessionOptions()
        if kind.startswith("ort_same_threads"):
            options.intra_op_num_threads = threads or 0
        if kind == "ort_same_threads_no_prepack":
            options.add_session_config_entry("session.disable_prepacking", "1")
        if kind == "ort_same_threads_no_folding":
            disabled = ["ConstantFolding"]
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def plain_steps(session, feeds: dict, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return times


def worker(kind: str, plan_path: str, threads: int | None, steps: int) -> dict:
    """Memory: run `steps` + 1 steps of the plan's step in this process, measured from the
    common starting point (module docstring). `file_growth_bytes`: how much of the growth is
    library code paged in (kernels run for the first time), which both sides pay per kernel
    they use and which no plan can change; reported beside the growth, not taken from it."""
    from memsched.emit import read_plan
    from memsched.runtime import prepare_inputs, run_plan
    from memsched.measure import ProcessMemory, release_free_heap
    from memsched.ort import warm_environment

    warm_environment()
    plan = read_plan(plan_path)
    feeds = prepare_inputs(plan.graph)
    if kind == "memsched":
        release_free_heap()
        memory = ProcessMemory()
        result = run_plan(plan, steps=steps + 1, threads=threads or 0, inputs=feeds)
        return {"rss_growth_bytes": memory.growth(), "file_growth_bytes": memory.file_growth(),
                "step_time_s": statistics.median(result.step_times[1:]), "run_report": result.process,
                "sessions": result.sessions, "ops": result.ops}
    model = plan.graph.to_onnx().SerializeToString()
    # the plan stays: freeing it here would hand the plain session heap that memsched's run
    # (which keeps the plan) does not get, and its growth would look smaller than it is
    release_free_heap()
    memory = ProcessMemory()
    session = plain_session(model, kind, threads)
    times = plain_steps(session, feeds, steps + 1)
    return {"rss_growth_bytes": memory.growth(), "file_growth_bytes": memory.file_growth(),
            "step_time_s": statistics.median(times[1:])}


def timing_worker(plan_path: str, threads: int, steps: int, rounds: int, min_seconds: float) -> dict:
    """Time: every configuration in turn, `rounds` times, in this one process, each the same
    number of steps per round (at least `steps`, enough for memsched's step to take
    `min_seconds`). Per configuration: the median of each round's steps (the first dropped),
    and the step time is the fastest of those medians. A shared machine only ever slows a
    round down, and on two cores a pool of every core loses whole rounds to another
    process's burst (one run: the MLP at every core 1.11x ONNX Runtime's defaults, the next
    1.86x, by the median over all rounds)."""
    from memsched.emit import read_plan
    from memsched.runtime import prepare_inputs, run_plan
    from memsched.ort import warm_environment

    warm_environment()
    plan = read_plan(plan_path)
    feeds = prepare_inputs(plan.graph)
    proto = plan.graph.to_onnx()
    model = proto.SerializeToString()
    plain = {(kind, t): plain_session(model, kind, t)
             for kind, t in (("ort_same", threads), ("ort_same_threads", threads), ("ort_defaults", None),
                             ("ort_same_threads_no_prepack", threads), ("ort_same_threads_no_folding", threads))}
    trainable, state = trainable_model(proto, plan.graph)
    plain[("ort_trainable_threads", threads)] = plain_session(trainable, "ort_same_threads", threads)
    probe = run_plan(plan, steps=2, threads=threads, inputs=feeds).step_times[1]
    steps = max(steps, math.ceil(min_seconds / max(probe, 1e-6)))
    medians: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for t, key in ((threads, "memsched"), (0, "memsched_default_threads")):
            medians[key].append(statistics.median(run_plan(plan, steps=steps + 1, threads=t,
                                                           inputs=feeds).step_times[1:]))
        for (kind, t), session in plain.items():
            feed = {**feeds, **state} if kind == "ort_trainable_threads" else feeds
            medians[kind].append(statistics.median(plain_steps(session, feed, steps + 1)[1:]))
    return {"step_time_s": {key: min(values) for key, values in medians.items()},
            "round_medians_s": dict(medians), "steps_per_round": steps}


def trainable_model(model, graph) -> tuple[bytes, dict]:
    """The step as a training loop must run it on plain ONNX Runtime: the parameters, buffers
    and optimizer state fed as inputs every step (their `.updated` outputs fed back), not
    baked in as initializers, which ONNX Runtime may prepack and re-lay out once and which no
    step can change. `model` is the graph's ONNX model, turned so in place. Returns the
    serialized model and the state to feed."""
    import onnx
    from onnx import numpy_helper

    state, kept = {}, []
    for init in model.graph.initializer:
        if graph.tensors[init.name].kind in ("parameter", "buffer", "optimizer_state"):
            state[init.name] = numpy_helper.to_array(init)
            model.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model.SerializeToString(), state


def run_worker(kind: str, plan_path: Path, threads: int | None, steps: int, rounds: int = 1,
               min_seconds: float = 0.0) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--plan", str(plan_path), "--steps", str(steps),
               "--rounds", str(rounds), "--min-seconds", str(min_seconds)]
    if threads is not None:
        command += ["--threads", str(threads)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the driver --------------------------------------------------------------------------
def median_run(kind: str, plan_path: Path, threads: int | None, steps: int, repeats: int) -> dict:
    """The memory worker run `repeats` times in fresh processes; the run of median growth, with
    every run's growth beside it (`rss_growth_runs_bytes`). One process's growth varies by a
    few pages of heap and of library code (faulted in 64 KiB at a time) from run to run."""
    runs = sorted((run_worker(kind, plan_path, threads, steps) for _ in range(repeats)),
                  key=lambda run: run["rss_growth_bytes"])
    return {**runs[len(runs) // 2], "rss_growth_runs_bytes": [run["rss_growth_bytes"] for run in runs]}


def bench_plan(plan_path: Path, arena: int, steps: int, threads: int, rounds: int, min_seconds: float,
               memory_runs: int) -> dict:
    configurations = {"memsched": ("memsched", threads), "memsched_default_threads": ("memsched", None),
                      "ort_same": ("ort_same", threads), "ort_same_threads": ("ort_same_threads", threads),
                      "ort_defaults": ("ort_defaults", None)}
    runs = {key: median_run(kind, plan_path, t, steps, memory_runs) for key, (kind, t) in configurations.items()}
    timing = run_worker("timing", plan_path, threads, steps, rounds, min_seconds)
    times = timing["step_time_s"]
    grown = {key: run["rss_growth_bytes"] for key, run in runs.items()}
    ratios = {
        "memory_vs_ort_defaults": grown["memsched_default_threads"] / grown["ort_defaults"],
        "memory_vs_ort_same": grown["memsched"] / grown["ort_same"],
        "time_vs_ort_same": times["memsched"] / times["ort_same"],
        "time_vs_ort_same_threads": times["memsched"] / times["ort_same_threads"],
        "time_vs_ort_defaults": times["memsched_default_threads"] / times["ort_defaults"],
        "time_vs_ort_trainable_threads": times["memsched"] / times["ort_trainable_threads"],
        "time_vs_ort_same_threads_no_prepack": times["memsched"] / times["ort_same_threads_no_prepack"],
        "time_vs_ort_same_threads_no_folding": times["memsched"] / times["ort_same_threads_no_folding"],
    }
    met = {key: ratios[key] <= limit for key, limit in TARGETS.items()}
    anonymous = {key: run["rss_growth_bytes"] - run["file_growth_bytes"] for key, run in runs.items()}
    ratios["anonymous_memory_vs_ort_defaults"] = anonymous["memsched_default_threads"] / anonymous["ort_defaults"]
    return {"arena_bytes": arena, "runs": runs, **timing, "ratios": ratios, "targets_met": met}


def bench_model(name: str, directory: Path, steps: int, threads: int, rounds: int, min_seconds: float,
                time_limit: float, memory_runs: int) -> dict:
    from memsched.emit import write_plan
    from memsched.errors import MemschedError
    from memsched.memory import analyze_plan, check_placement
    from memsched.passes.pipeline import compile as compile_plan

    graph = small_training_step(name)
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
        row.update(bench_plan(path, check_placement(analyze_plan(plan), plan.offsets), steps, threads, rounds,
                              min_seconds, memory_runs))
        entry["plans"].append(row)
        print(f"{name} {strategies} {budget or ''}: " + ", ".join(f"{k} {v:.3f}" for k, v in row["ratios"].items()),
              file=sys.stderr, flush=True)
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES), help="comma-separated model names")
    parser.add_argument("--steps", type=int, default=3, help="steps per run and per timing round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (every configuration once in each)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of the equal-threads runs (default 1); the default-threads runs "
                             "use every core")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="timing: steps per round enough for memsched's step to take this long")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per compile")
    parser.add_argument("--memory-runs", type=int, default=3,
                        help="memory: fresh processes per configuration; the run of median growth counts")
    parser.add_argument("-o", "--output", help="also write the JSON here")
    parser.add_argument("--worker", choices=KINDS + ("timing",), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "timing":
        print(json.dumps(timing_worker(args.plan, args.threads or 0, args.steps, args.rounds, args.min_seconds)))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.plan, args.threads, args.steps)))
        return 0
    if args.steps < 1 or args.rounds < 1 or args.memory_runs < 1:
        parser.error("--steps, --rounds and --memory-runs must be at least 1")
    threads = 1 if args.threads is None else args.threads
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    load = list(os.getloadavg())      # 1, 5 and 15 minute load averages: how shared the machine was
    with tempfile.TemporaryDirectory(prefix="memsched-footprint-") as directory:
        rows = [bench_model(name, Path(directory), args.steps, threads, args.rounds, args.min_seconds,
                            args.time_limit, args.memory_runs)
                for name in names]
    done = [p for r in rows for p in r["plans"] if "ratios" in p]
    summary = {"plans": len(done),
               "worst": {key: max(p["ratios"][key] for p in done) for key in done[0]["ratios"]} if done else {},
               "all_targets_met": {key: all(p["targets_met"][key] for p in done) for key in TARGETS}}
    report = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "load_before": load, "load_after": list(os.getloadavg())},
              "threads": threads, "steps": args.steps, "rounds": args.rounds, "min_seconds": args.min_seconds,
              "memory_runs": args.memory_runs,
              "targets": TARGETS, "summary": summary,
              "models": rows}
    return emit(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
