"""The first thing to run on a machine with a GPU: does every plan run on CUDA, correctly, in
the device memory it planned, and how fast against one plain ONNX Runtime CUDA session?

On a machine where CUDA is not usable it prints one line saying why (memsched.doctor) and exits
0. Otherwise, for every bundled model at a small size (bench_executor.SIZES), the SGD training
step is compiled for the GPU's preset profile with order,reuse and with every strategy at 60%,
and each plan runs in fresh subprocesses:

- `check`: `run_plan(device="cuda", check=True)`, two steps: the check against a plain run of
  the unscheduled step, the providers that really ran, the number of sessions;
- `memsched`: `run_plan(device="cuda")`, unchecked (no reference session in the process, no
  poisoning): step time (median after one warm-up) and device memory;
- `ort`: one plain ONNX Runtime CUDA session of the same step, inputs bound on the device.

With each check, `reference_repeat`: how far the plain reference's outputs move between two
runs, with TF32 kernels and without (a checked run turns TF32 off). Once per run,
`session_cost`: the device memory each further session takes, as the executor makes it (a
small cuBLAS workspace), with cuBLAS's default workspace and with a 32 MiB one.

Each worker's device memory is read from outside by the parent, through NVML's per-process
figure (nvmlDeviceGetComputeRunningProcesses), polled while the worker runs: its peak is the
process's real device footprint (plan arena, ONNX Runtime's own workspace and the CUDA context
together), reported next to the planned arena and to the executor's own cudaMemGetInfo figure
(`run --json`'s `process.device`), and against what the process is accounted to hold: the
arena plus the fixed per-process overhead `memsched doctor` measures once per run
(`device_memory_vs_accounted`). Not measured yet: how much of the swap traffic
the copy streams hid behind compute (the executor does not time copies with CUDA events), and
a calibrated GPU profile (`hardware calibrate` measures the CPU): the JSON says so.

The README's model (resnet18 at batch 32, 224x224, budget 360 MiB) runs too, as `resnet18-224`.

Compiling and running can happen on two machines, so that a lent GPU's time goes to running:
`--compile-to DIR --hardware h200` compiles every plan here and writes them with a manifest;
`--plans DIR` on the GPU machine runs them (onnxruntime-gpu is all it needs there, not ortools).
Prints one JSON object (and writes it to --out FILE if given, after each model too, so a run cut
short leaves what it measured).

    python bench/gpu_check.py [--out gpu_check.json] [--models resnet18,gpt2] [--steps 5] [--time-limit 20]
    python bench/gpu_check.py --compile-to plans/ --hardware h200     # here
    python bench/gpu_check.py --plans plans/ --out gpu_check.json     # on the GPU
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_executor import SIZES, small_training_step  # noqa: E402
from json_report import emit  # noqa: E402

PLANS = [("order,reuse", None), ("order,reuse,recompute,swap", "60%")]
PRESETS = {"H100": "h100-80gb", "H200": "h200", "A100": "a100-80gb", "V100": "v100-32gb"}
# what a further session costs: label -> (worker, environment)
SESSION_COST = {"memsched": ("sessions", {}), "cublas_default": ("sessions-cublas-default", {}),
                "cublas_4MiBx8": ("sessions", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})}
NOT_MEASURED = {
    "swap_hidden_fraction": "not measured: the executor does not time its copies with CUDA events",
    "calibrated_profile": "not measured: `hardware calibrate` measures the CPU only; plans use the GPU's preset",
}


# ---- the workers: one configuration in a fresh process --------------------------------------
def worker(kind: str, plan_path: str, steps: int) -> dict:
    if kind.startswith("sessions"):
        return session_cost(cublas_default=kind == "sessions-cublas-default")
    from memsched.emit import read_plan
    from memsched.runtime import prepare_inputs, run_plan

    plan = read_plan(plan_path)
    feeds = prepare_inputs(plan.graph)
    if kind == "check":
        from memsched import ort as ort_plumbing

        result = run_plan(plan, steps=2, device="cuda", check=True, threads=1, inputs=feeds)
        worst = sorted(result.check["per_output"].items(), key=lambda item: -item[1])[:3]
        return {"provider": result.provider, "fallback": result.fallback, "sessions": result.sessions,
                "providers": result.providers, "cuda_arena": ort_plumbing.cuda_arena_state,
                **{k: result.check[k] for k in ("passed", "exact", "max_abs_diff", "max_scaled_diff")},
                "worst_outputs": dict(worst), "reference_repeat": reference_repeat(plan.graph, feeds)}
    if kind == "memsched":
        result = run_plan(plan, steps=steps + 1, device="cuda", threads=1, inputs=feeds)
        return {"provider": result.provider, "sessions": result.sessions,
                "step_time_s": statistics.median(result.step_times[1:]), "arena_bytes": result.arena_bytes,
                "device_memory_inside": (result.process or {}).get("device")}
    from onnx import helper

    from memsched.measure import Timer
    from memsched.ort import make_session

    session = make_session(plan.graph.to_onnx(), "cuda", threads=1)
    graph = plan.graph
    outputs = [(name, graph.tensors[name].shape, helper.tensor_dtype_to_np_dtype(graph.tensors[name].dtype))
               for name in graph.outputs]
    timer = Timer.bind(session, feeds, outputs, "cuda")       # inputs copied to the device once
    times = [timer.run() for _ in range(steps + 1)]
    return {"provider": session.get_providers()[0], "step_time_s": statistics.median(times[1:])}


def reference_repeat(graph, feeds: dict) -> dict:
    """How far the plain reference session's outputs move between two runs of one step on the
    same inputs, as the check scales them (max |a - b| / max(1, max |a|)), with TF32 kernels
    (ONNX Runtime's default) and without (as a checked run makes them): the floor any CUDA
    check stands on."""
    import onnxruntime as ort

    from memsched.runtime import compare_outputs, reference_model
    from memsched.runtime.check import statics
    from memsched.ort import providers_for, session_options

    model = reference_model(graph).SerializeToString()
    inputs = {**feeds, **statics(graph)}
    result = {}
    for label, tf32 in (("tf32", True), ("float32", False)):
        session = ort.InferenceSession(model, session_options(1), providers=providers_for("cuda", tf32=tf32))
        names = [o.name for o in session.get_outputs()]
        first, second = (dict(zip(names, session.run(names, inputs))) for _ in range(2))
        diffs = compare_outputs(second, first)
        worst = max(diffs.items(), key=lambda item: item[1]["max_abs_diff"] / item[1]["scale"])
        result[label] = {"max_scaled_diff": worst[1]["max_abs_diff"] / worst[1]["scale"], "worst_output": worst[0],
                         "bit_identical": all(d["bit_identical"] for d in diffs.values())}
    return result


def session_cost(cublas_default: bool = False, count: int = 4) -> dict:
    """The device memory each further executor session takes: `count` bound CUDA sessions of
    one small Conv -> MatMul model (so that each makes its cuDNN and cuBLAS handles), made and
    run one after another in this process, free device memory read after each
    (cudaMemGetInfo). `cublas_default`: with cuBLAS's own workspace, not the small one the
    executor sets (memsched.cuda.small_cublas_workspace)."""
    from memsched import ort as plumbing
    from memsched.cuda import device_memory, load_cudart
    from memsched.ort import bound_session, handles_model

    if cublas_default:
        plumbing.small_cublas_workspace = lambda: os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")

    model, feeds = handles_model()
    cudart = load_cudart()
    free = [device_memory(cudart)[0]]
    sessions = []
    for _ in range(count):
        sessions.append(bound_session(model, 1, "cuda"))
        sessions[-1].run(None, feeds)
        cudart.cudaDeviceSynchronize()
        free.append(device_memory(cudart)[0])
    steps = [a - b for a, b in zip(free, free[1:])]
    return {"sessions": count, "first_session_bytes": steps[0], "further_session_bytes": steps[1:],
            "provider": sessions[-1].get_providers()[0],
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


class DeviceMemoryPoll:
    """The peak device memory NVML reports for one process id, polled every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.005):
        from memsched.cuda import Nvml

        self.pid, self.interval, self.peak = pid, interval, 0
        self.nvml = Nvml()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.nvml.process_bytes(self.pid) or 0)
            time.sleep(self.interval)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        self.nvml.close()
        return self.peak


def run_worker(kind: str, plan_path: Path | None, steps: int, timeout: float = 240.0, env: dict | None = None) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--plan", str(plan_path), "--steps", str(steps)]
    return run_measured(command, timeout, env)


def run_measured(command: list[str], timeout: float = 240.0, env: dict | None = None) -> dict:
    """Run `command` (a worker that prints one JSON object as its last line) in a fresh
    process, its device memory polled from outside (DeviceMemoryPoll): the object, with
    `device_memory_peak_bytes`; or {'error': why} where it failed or ran past `timeout` s."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    poll = DeviceMemoryPoll(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        poll.close()
        return {"error": f"ran past {timeout:.0f} s"}
    peak = poll.close()
    if proc.returncode != 0:
        return {"error": err.strip()[-2000:]}
    return {**json.loads(out.strip().splitlines()[-1]), "device_memory_peak_bytes": peak}


# ---- the driver --------------------------------------------------------------------------
# label -> (bundled model, its size, the plans: (strategies, budget))
CASES = {name: (name, size, PLANS) for name, size in SIZES.items()}
CASES["resnet18-224"] = ("resnet18", dict(batch=32, size=224, classes=1000),
                         [("order,reuse", None), ("order,reuse,recompute,swap", "360MiB")])


def compile_case(label: str, hardware: str, directory: Path, time_limit: float) -> dict:
    """Compile every plan of case `label` for `hardware` into `directory`: the manifest's entry."""
    from memsched.emit import write_plan
    from memsched.errors import MemschedError
    from memsched.passes.pipeline import compile as compile_plan

    model, size, plans = CASES[label]
    graph = small_training_step(model, size)
    entry = {"model": label, "size": size, "ops": len(graph.ops), "hardware": hardware, "plans": []}
    for index, (strategies, budget) in enumerate(plans):
        row = {"strategies": strategies, "budget": budget}
        try:
            compiled = compile_plan(graph, hardware=hardware, strategies=strategies, budget=budget,
                                    time_limit=time_limit)
        except MemschedError as exc:
            row["error"] = str(exc)
        else:
            plan = dataclasses.replace(compiled.plan, budget=None)
            path = write_plan(plan, directory / f"{label}-{index}.onnx")
            row["plan_file"], row["weights"] = path.name, slim_weights(path)
            row["planned_arena_bytes"] = plan.notes.get("placement", {}).get("arena_bytes")
            row["planned_peak_bytes"] = compiled.report["plan"].get("peak_bytes")
            row["predicted_step_time_s"] = compiled.report["plan"]["step_time_s"]
        entry["plans"].append(row)
    return entry


def slim_weights(path: Path) -> dict:
    """Drop the values of the plan's large float initializers from the file at `path` (its
    random weights are most of its bytes, too many to carry to a lent GPU); their mean and
    standard deviation, by name, for `refill_weights`."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    stats = {}
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT and len(tensor.raw_data) > 4096:
            values = numpy_helper.to_array(tensor).astype(np.float64)
            stats[tensor.name] = [float(values.mean()), float(values.std())]
            tensor.raw_data = b""
    onnx.save(model, str(path))
    return stats


def refill_weights(path: Path, stats: dict, directory: Path) -> Path:
    """The plan at `path` with its slimmed weights drawn again (normal, the original mean and
    standard deviation, seeded by name: every worker gets the same values), in `directory`."""
    import zlib

    import numpy as np
    import onnx

    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if tensor.name in stats:
            mean, std = stats[tensor.name]
            rng = np.random.default_rng(zlib.crc32(tensor.name.encode()))
            tensor.raw_data = rng.normal(mean, std, tuple(tensor.dims)).astype(np.float32).tobytes()
    out = directory / path.name
    onnx.save(model, str(out))
    return out


def run_case(entry: dict, directory: Path, steps: int, scratch: Path, fixed: int | None = None) -> dict:
    """Run every compiled plan of one manifest entry as memsched and as one plain ORT session;
    `fixed`: the fixed per-process device overhead doctor measured, which with the arena is
    what the process is accounted to hold (`device_memory_vs_accounted`)."""
    for row in entry["plans"]:
        if "plan_file" not in row:
            continue
        path = refill_weights(directory / row["plan_file"], row.get("weights", {}), scratch)
        row["check"] = run_worker("check", path, steps)
        row["memsched"] = run_worker("memsched", path, steps)
        row["ort"] = run_worker("ort", path, steps)
        if "error" not in row["memsched"] and "error" not in row["ort"]:
            row["time_vs_ort"] = row["memsched"]["step_time_s"] / row["ort"]["step_time_s"]
            row["device_memory_vs_ort"] = (row["memsched"]["device_memory_peak_bytes"]
                                           / max(1, row["ort"]["device_memory_peak_bytes"]))
            row["device_memory_over_arena_bytes"] = (row["memsched"]["device_memory_peak_bytes"]
                                                     - row["memsched"]["arena_bytes"])
            if fixed is not None:
                row["device_memory_vs_accounted"] = (row["memsched"]["device_memory_peak_bytes"]
                                                     / (row["memsched"]["arena_bytes"] + fixed))
        print(f"{entry['model']} {row['strategies']} {row['budget'] or ''}: check "
              f"{row['check'].get('passed', row['check'].get('error'))} {row['check'].get('max_scaled_diff')} "
              f"sessions {row['check'].get('sessions')} memsched {row['memsched'].get('step_time_s')} s "
              f"{row['memsched'].get('device_memory_peak_bytes')} B, ort {row['ort'].get('step_time_s')} s "
              f"{row['ort'].get('device_memory_peak_bytes')} B", file=sys.stderr, flush=True)
    return entry


def summarise(rows: list[dict]) -> dict:
    plans = [p for r in rows for p in r["plans"]]
    checked = [p for p in plans if "passed" in p.get("check", {})]
    return {"plans": len(plans), "ran": len(checked),
            "checks_passed": sum(bool(p["check"]["passed"]) for p in checked),
            "all_on_cuda": all(p["check"]["provider"] == "CUDAExecutionProvider" for p in checked),
            "worst_time_vs_ort": max((p["time_vs_ort"] for p in plans if "time_vs_ort" in p), default=None),
            "worst_device_memory_vs_ort": max((p["device_memory_vs_ort"] for p in plans
                                               if "device_memory_vs_ort" in p), default=None),
            "worst_device_memory_vs_accounted": max((p["device_memory_vs_accounted"] for p in plans
                                                     if "device_memory_vs_accounted" in p), default=None)}


def preset_for(gpu_name: str) -> str:
    return next((preset for key, preset in PRESETS.items() if key in gpu_name.upper()), "v100-16gb")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated, from " + ", ".join(CASES))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per compile")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--compile-to", help="only compile the plans, into this folder (no GPU needed)")
    parser.add_argument("--hardware", help="the profile to compile for (default: the GPU's preset)")
    parser.add_argument("--plans", help="run the plans `--compile-to` wrote in this folder")
    parser.add_argument("--worker", choices=("check", "memsched", "ort", "sessions", "sessions-cublas-default"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.plan, args.steps)))
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.compile_to:
        directory = Path(args.compile_to)
        directory.mkdir(parents=True, exist_ok=True)
        manifest = [compile_case(name, args.hardware or "h100-80gb", directory, args.time_limit) for name in names]
        return emit({"compiled": manifest}, str(directory / "manifest.json"))
    from memsched.doctor import diagnose

    doctor = diagnose()
    if not doctor["cuda_usable"]:
        print(f"gpu_check: CUDA is not usable here, nothing to check: {doctor['reason']}")
        return 0
    gpu = doctor["gpus"][0]["name"] if doctor["gpus"] else "unknown GPU"
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "python": platform.python_version(),
              "doctor": doctor, "not_measured": NOT_MEASURED, "models": []}
    # what each further session costs: as the executor makes it, with cuBLAS's default workspace, with 32 MiB
    report["session_cost"] = {label: run_worker(kind, None, 0, env=env) for label, (kind, env) in SESSION_COST.items()}
    print(f"session cost: {report['session_cost']}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="memsched-gpu-check-") as scratch:
        if args.plans:
            directory = Path(args.plans)
            compiled = {e["model"]: e for e in json.loads((directory / "manifest.json").read_text())["compiled"]}
            entries = [compiled[name] for name in names if name in compiled]
        else:
            directory = Path(scratch)
            hardware = args.hardware or preset_for(gpu)
            entries = (compile_case(name, hardware, directory, args.time_limit) for name in names)
        for entry in entries:
            report["models"].append(run_case(entry, directory, args.steps, Path(scratch),
                                             doctor["fixed_overhead"].get("bytes")))
            report["summary"] = summarise(report["models"])
            if args.out:                      # the report so far: a run cut short still leaves it
                emit(report, args.out, echo=False)
    return emit(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
