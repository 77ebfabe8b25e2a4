"""The first thing to run on a machine with a GPU: does every plan run on CUDA, correctly, in
the device memory it planned, and how fast against one plain ONNX Runtime CUDA session?

On a machine where CUDA is not usable it prints one line saying why (memsched.doctor) and exits
0. Otherwise, for every bundled model at a small size (bench_executor.SIZES), the SGD training
step is compiled for the GPU's preset profile with order,reuse and with every strategy at 60%,
and each plan runs in fresh subprocesses:

- `memsched`: `run_plan(device="cuda", check=True)`: the check against a plain run of the
  unscheduled step, the provider that really ran, step time (median after one warm-up);
- `ort`: one plain ONNX Runtime CUDA session of the same step, inputs bound on the device.

Each worker's device memory is read from outside by the parent, through NVML's per-process
figure (nvmlDeviceGetComputeRunningProcesses), polled while the worker runs: its peak is the
process's real device footprint (plan arena, ONNX Runtime's own workspace and the CUDA context
together), reported next to the planned arena and to the executor's own cudaMemGetInfo figure
(`run --json`'s `process.device`). Not measured yet: how much of the swap traffic
the copy streams hid behind compute (the executor does not time copies with CUDA events), and
a calibrated GPU profile (`hardware calibrate` measures the CPU): the JSON says so.

Prints one JSON object (and writes it to --out FILE if given).

    python bench/gpu_check.py [--out gpu_check.json] [--models resnet18,gpt2] [--steps 5] [--time-limit 20]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
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
NOT_MEASURED = {
    "swap_hidden_fraction": "not measured: the executor does not time its copies with CUDA events",
    "calibrated_profile": "not measured: `hardware calibrate` measures the CPU only; plans use the GPU's preset",
}


# ---- the workers: one configuration in a fresh process --------------------------------------
def worker(kind: str, plan_path: str, steps: int) -> dict:
    from memsched.emit import read_plan
    from memsched.executor import prepare_inputs, run_plan

    plan = read_plan(plan_path)
    feeds = prepare_inputs(plan.graph)
    if kind == "memsched":
        result = run_plan(plan, steps=steps + 1, device="cuda", check=True, threads=1, inputs=feeds)
        return {"provider": result.provider, "fallback": result.fallback,
                "check": {k: result.check[k] for k in ("passed", "exact", "max_abs_diff") if k in result.check},
                "step_time_s": statistics.median(result.step_times[1:]), "arena_bytes": result.arena_bytes,
                "device_memory_inside": (result.process or {}).get("device")}
    import onnxruntime as ort

    from memsched.ort import make_session

    session = make_session(plan.graph.to_onnx(), "cuda", threads=1)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cuda", 0)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - start)
    return {"provider": session.get_providers()[0], "step_time_s": statistics.median(times[1:])}


class DeviceMemoryPoll:
    """The peak device memory NVML reports for one process id, polled every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.005):
        self.pid, self.interval, self.peak = pid, interval, 0
        self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
        self.nvml.nvmlInit_v2()
        self.handle = ctypes.c_void_p()
        self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _used(self) -> int:
        class Info(ctypes.Structure):      # nvmlProcessInfo_v1_t: pid, usedGpuMemory
            _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong)]
        count = ctypes.c_uint(64)
        infos = (Info * 64)()
        if self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle, ctypes.byref(count), infos) != 0:
            return 0
        return max((int(i.used) for i in infos[:count.value] if i.pid == self.pid), default=0)

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(self.interval)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        self.nvml.nvmlShutdown()
        return self.peak


def run_worker(kind: str, plan_path: Path, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--plan", str(plan_path), "--steps", str(steps)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    poll = DeviceMemoryPoll(proc.pid)
    out, err = proc.communicate()
    peak = poll.close()
    if proc.returncode != 0:
        return {"error": err.strip()[-2000:]}
    return {**json.loads(out.strip().splitlines()[-1]), "device_memory_peak_bytes": peak}


# ---- the driver --------------------------------------------------------------------------
def check_model(name: str, hardware: str, directory: Path, steps: int, time_limit: float) -> dict:
    from memsched.emit import write_plan
    from memsched.errors import MemschedError
    from passes.pipeline import compile as compile_plan

    graph = small_training_step(name)
    entry = {"model": name, "size": SIZES[name], "ops": len(graph.ops), "plans": []}
    for strategies, budget in PLANS:
        row = {"strategies": strategies, "budget": budget}
        try:
            compiled = compile_plan(graph, hardware=hardware, strategies=strategies, budget=budget,
                                    time_limit=time_limit)
        except MemschedError as exc:
            row["error"] = str(exc)
            entry["plans"].append(row)
            continue
        plan = dataclasses.replace(compiled.plan, budget=None)
        path = write_plan(plan, directory / f"{name}-{len(entry['plans'])}.onnx")
        row["planned_arena_bytes"] = plan.notes.get("placement", {}).get("arena_bytes")
        row["predicted_step_time_s"] = compiled.report["plan"]["step_time_s"]
        row["memsched"] = run_worker("memsched", path, steps)
        row["ort"] = run_worker("ort", path, steps)
        if "error" not in row["memsched"] and "error" not in row["ort"]:
            row["time_vs_ort"] = row["memsched"]["step_time_s"] / row["ort"]["step_time_s"]
            row["device_memory_vs_ort"] = (row["memsched"]["device_memory_peak_bytes"]
                                           / max(1, row["ort"]["device_memory_peak_bytes"]))
            row["device_memory_over_arena_bytes"] = (row["memsched"]["device_memory_peak_bytes"]
                                                     - row["memsched"]["arena_bytes"])
        entry["plans"].append(row)
        print(f"{name} {strategies} {budget or ''}: check "
              f"{row['memsched'].get('check', row['memsched'].get('error'))}", file=sys.stderr, flush=True)
    return entry


def preset_for(gpu_name: str) -> str:
    return next((preset for key, preset in PRESETS.items() if key in gpu_name.upper()), "v100-16gb")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES), help="comma-separated model names")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per compile")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--worker", choices=("memsched", "ort"), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.plan, args.steps)))
        return 0
    from memsched.doctor import diagnose

    doctor = diagnose()
    if not doctor["cuda_usable"]:
        print(f"gpu_check: CUDA is not usable here, nothing to check: {doctor['reason']}")
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    gpu = doctor["gpus"][0]["name"] if doctor["gpus"] else "unknown GPU"
    hardware = preset_for(gpu)
    with tempfile.TemporaryDirectory(prefix="memsched-gpu-check-") as directory:
        rows = [check_model(name, hardware, Path(directory), args.steps, args.time_limit) for name in names]
    plans = [p for r in rows for p in r["plans"]]
    checked = [p for p in plans if "check" in p.get("memsched", {})]
    summary = {"plans": len(plans), "ran": len(checked),
               "checks_passed": sum(bool(p["memsched"]["check"].get("passed")) for p in checked),
               "all_on_cuda": all(p["memsched"]["provider"] == "CUDAExecutionProvider" for p in checked),
               "worst_time_vs_ort": max((p["time_vs_ort"] for p in plans if "time_vs_ort" in p), default=None)}
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "hardware_profile": hardware,
              "python": platform.python_version(), "doctor": doctor, "summary": summary,
              "not_measured": NOT_MEASURED, "models": rows}
    return emit(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
