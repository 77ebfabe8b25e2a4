"""Under one device-memory cap: the largest batch PyTorch eager trains, and a batch at least
twice that which memsched's plan trains, with the same losses as on the CPU.

For ResNet-50 (torchvision's, 224x224, 1000 classes) and BERT-base (sequence 128, 2 classes):

1. PyTorch: the largest batch for which one SGD step (forward, cross-entropy, backward,
   torch.optim.SGD) runs without an out-of-memory error, with the caching allocator capped by
   `torch.cuda.set_per_process_memory_fraction(cap / device memory)`: batches 1, 2, 4, ...
   until one fails, then bisection (`largest_batch`), each try in a fresh process. Then a
   few timed steps at that batch. The cap bounds PyTorch's allocator; its CUDA context lies
   outside it.
2. memsched: the SGD step of the bundled model at twice that batch, compiled with every
   strategy for the GPU's preset profile (gpu_check.preset_for) with the budget
   `cap - fixed overhead - workspace`: the fixed per-process overhead is what `memsched
   doctor` measures (memsched.cuda.fixed_overhead: CUDA context, cuDNN/cuBLAS handles, ONNX
   Runtime), the workspace is room left for kernels' scratch. ONNX Runtime's own allocations
   are capped by `gpu_mem_limit` (memsched.ort.cap_cuda_memory) at `cap - fixed overhead -
   arena`, so the whole process, context included, is meant to fit under the cap: a stricter
   bound than PyTorch's. A few steps with memsched's Trainer on CUDA and the same steps (same
   weights, same batches) on the CPU; the losses must agree within 1e-4 (scaled by
   max(1, |loss|)). Float32 kernels stay off TF32 on both sides, PyTorch's too.

Each worker's device memory is read from outside through NVML (gpu_check.run_measured);
`within_cap` says whether memsched's whole process stayed under the cap. The step time per
sample of memsched at its batch stands next to PyTorch's at its largest batch.

`--compile-to DIR` compiles the plans here, so that a lent GPU's time goes to running: the
batch is twice the largest one PyTorch's tensors fit in under the cap as computed on the meta
device (bench_sweep.meta_step_peak), an upper bound of what PyTorch reaches on the GPU (its
allocator adds workspaces and rounding), with an assumed fixed overhead (`--overhead`).
`--plans DIR` on the GPU uses such a plan where its batch is at least twice PyTorch's measured
one and its budget within the cap less the measured overhead, and compiles anew otherwise.

`--dry-run` runs the same logic on the CPU with a fake cap: small models (ResNet-18 at 64 px,
a 2-layer BERT at sequence 32), PyTorch's peak computed on the meta device instead of trying
batches on a GPU, the cap set to that peak at batch 6, no fixed overhead; memsched's plan is
compiled and trained on the CPU for 2 steps, and the losses are compared with a second CPU
run. Without `--dry-run` and without CUDA it prints one line saying why and exits 0.

One JSON object (bench/json_report.py), also written to --out after each model.

    python bench/gpu_cap.py --dry-run
    python bench/gpu_cap.py --compile-to plans/ --hardware h200              # here
    python bench/gpu_cap.py --plans plans/ --out $OUT/gpu_cap.json           # on the GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import preset_for, refill_weights, run_measured, slim_weights  # noqa: E402
from json_report import emit  # noqa: E402

from memsched.units import format_bytes, parse_bytes  # noqa: E402

# label -> the bundled model and its options, the PyTorch module ("bert": bench_vs_torch's
# bert_module with these options, else torchvision's classifier) and its batch's shape
CASES = {
    "resnet50": {"memsched": ("resnet50", {"size": 224, "classes": 1000}), "torch": ("resnet50", {}),
                 "image": 224, "classes": 1000},
    "bert-base": {"memsched": ("bert-base", {"seq": 128}), "torch": ("bert", {}), "seq": 128, "vocab": 30522,
                  "classes": 2},
    # the dry run's: small enough for a CPU
    "resnet18-64": {"memsched": ("resnet18", {"size": 64, "classes": 10}), "torch": ("resnet18", {}),
                    "image": 64, "classes": 10},
    "bert-tiny": {"memsched": ("bert-base", {"seq": 32, "layers": 2, "hidden": 128, "heads": 2, "vocab": 1000,
                                             "max_positions": 32}),
                  "torch": ("bert", {"layers": 2, "hidden": 128, "heads": 2, "vocab": 1000, "positions": 32}),
                  "seq": 32, "vocab": 1000, "classes": 2},
}
MODELS, DRY_MODELS = ("resnet50", "bert-base"), ("resnet18-64", "bert-tiny")
DRY_BATCH = 6              # the dry run's cap: PyTorch's computed peak at this batch
TOLERANCE = 1e-4           # losses on the device and on the CPU: |a - b| / max(1, |b|)
# what an allocation that failed under the cap looks like in PyTorch's errors (cuDNN's statuses
# included: a convolution whose workspace cannot be had fails so)
OOM_SIGNS = ("out of memory", "ALLOC_FAILED", "CUDNN_STATUS")


# ---- the search ------------------------------------------------------------------------------
def largest_batch(fits: Callable[[int], bool], start: int = 1, limit: int = 1024) -> tuple[int, list]:
    """The largest batch in [start, limit] for which `fits(batch)` is true, for a predicate
    true up to some batch and false above it (a step's memory grows with its batch): `start`,
    then doubling until a batch does not fit or `limit` fits (tried last), then bisection
    between the largest batch that fit and the smallest that did not. No batch is tried twice;
    0 where `start` does not fit. Returns (batch, [[batch, fits], ...] in the order tried)."""
    if start < 1 or limit < start:
        raise ValueError(f"the batch range must be 1 <= start <= limit, not [{start}, {limit}]")
    trials: list[list] = []

    def tried(batch: int) -> bool:
        ok = bool(fits(batch))
        trials.append([batch, ok])
        return ok

    if not tried(start):
        return 0, trials
    good, bad = start, None
    while bad is None:
        if good == limit:
            return good, trials
        batch = min(2 * good, limit)
        good, bad = (batch, None) if tried(batch) else (good, batch)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if tried(middle) else (good, middle)
    return good, trials


def compare_losses(device: list[float], reference: list[float], tolerance: float = TOLERANCE) -> dict:
    """How far the device run's losses lie from the reference run's, step by step, each
    difference scaled by max(1, |reference|); `match` where every one is finite and within."""
    if len(device) != len(reference) or not device:
        return {"max_scaled_diff": None, "tolerance": tolerance, "match": False,
                "reason": f"{len(device)} losses against {len(reference)}"}
    diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(device, reference)]
    if not all(math.isfinite(x) for x in [*device, *reference]):
        return {"max_scaled_diff": None, "tolerance": tolerance, "match": False, "reason": "a loss is not finite"}
    worst = max(diffs)
    return {"max_scaled_diff": worst, "tolerance": tolerance, "match": worst <= tolerance}


# ---- PyTorch ---------------------------------------------------------------------------------
def torch_module(label: str):
    """(the PyTorch module of case `label`, where it comes from)."""
    import torch

    case = CASES[label]
    name, options = case["torch"]
    torch.manual_seed(0)
    if name == "bert":
        from bench_vs_torch import bert_module

        return bert_module(classes=case["classes"], **options), "bench_vs_torch.bert_module"
    try:
        import torchvision
    except ImportError:
        from torch_models import torchvision_classifier

        return torchvision_classifier(name, case["classes"]), "torch_models.torchvision_classifier"
    return getattr(torchvision.models, name)(num_classes=case["classes"]), f"torchvision.models.{name}"


def torch_batch(label: str, batch: int, device=None):
    """(inputs, labels) of case `label` at `batch`, seeded, on `device` (torch's default where
    None: the meta device inside `with torch.device('meta')`)."""
    import torch

    case = CASES[label]
    generator = torch.Generator().manual_seed(1) if device is not None and str(device) != "meta" else None
    if "seq" in case:
        inputs = torch.randint(0, case["vocab"], (batch, case["seq"]), generator=generator)
    else:
        inputs = torch.randn(batch, 3, case["image"], case["image"], generator=generator)
    labels = torch.randint(0, case["classes"], (batch,), generator=generator)
    return (inputs.to(device), labels.to(device)) if device is not None else (inputs, labels)


def meta_peak(label: str, batch: int) -> int:
    """PyTorch eager's peak bytes for one SGD step of case `label` at `batch`, computed on the
    meta device (bench_sweep.meta_step_peak)."""
    from bench_sweep import meta_step_peak

    return meta_step_peak(lambda: torch_module(label)[0], lambda: torch_batch(label, batch))


def torch_steps(model: str, batch: int, steps: int, device: str, cap: int | None) -> dict:
    """A worker: one SGD step of case `model` at `batch` on `device`, then `steps` timed ones;
    on CUDA with the caching allocator capped at `cap` bytes and TF32 off. {'fits': False} on
    an out-of-memory error (cuBLAS's and cuDNN's failed allocations included)."""
    import torch

    if device == "cuda":
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        if cap is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    module, source = torch_module(model)
    row = {"batch": batch, "torch_module": source, "torch_version": torch.__version__}
    times = []
    try:
        module = module.to(device).train()
        inputs, labels = torch_batch(model, batch, device)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        for _ in range(1 + steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(module(inputs), labels).backward()
            optimizer.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and not any(s in str(exc) for s in OOM_SIGNS):
            raise
        return {**row, "fits": False, "error": str(exc).strip().splitlines()[0][:300]}
    row.update(fits=True, step_time_s=statistics.median(times[1:] or times))
    if device == "cuda":
        row.update(allocated_peak_bytes=torch.cuda.max_memory_allocated(), reserved_peak_bytes=
                   torch.cuda.max_memory_reserved())
    return row


# ---- memsched --------------------------------------------------------------------------------
def compile_case(label: str, batch: int, budget: int, hardware: str, directory: Path, time_limit: float) -> dict:
    """Compile the SGD step of case `label` at `batch` within `budget` bytes for `hardware`
    into `directory` (its weights slimmed, gpu_check.slim_weights): the plan's entry, or its
    error where the budget cannot be met."""
    from memsched import models
    from memsched.emit import write_plan
    from memsched.errors import BudgetError, MemschedError
    from memsched.frontend import lower
    from memsched.passes.pipeline import compile as compile_plan

    name, options = CASES[label]["memsched"]
    entry = {"model": label, "batch": batch, "budget_bytes": budget, "hardware": hardware}
    started = time.perf_counter()
    try:
        graph = lower(models.build(name, batch=batch, **options))
        compiled = compile_plan(graph, train=True, hardware=hardware, budget=budget, time_limit=time_limit)
    except BudgetError as exc:
        return {**entry, "error": str(exc), "smallest_feasible_bytes": exc.smallest_feasible_bytes}
    except MemschedError as exc:
        return {**entry, "error": str(exc)}
    plan = dataclasses.replace(compiled.plan, budget=None)
    path = write_plan(plan, directory / f"{label}-b{batch}.onnx")
    report = compiled.report["plan"]
    return {**entry, "plan_file": path.name, "weights": slim_weights(path), "arena_bytes": report["arena_bytes"],
            "planned_peak_bytes": report["peak_bytes"], "predicted_step_time_s": report["step_time_s"],
            "predicted_overhead": report.get("overhead"), "compile_s": round(time.perf_counter() - started, 1)}


def train_steps(plan: str, device: str, steps: int, limit: int | None) -> dict:
    """A worker: `steps` SGD steps of the plan at `plan` with memsched's Trainer on `device`
    (no fallback), float32 kernels off TF32, the batches seeded by step
    (memsched.measure.prepare_inputs), ONNX Runtime's own CUDA memory capped at `limit`."""
    from memsched.measure import prepare_inputs
    from memsched.ort import cap_cuda_memory
    from memsched.runtime import Trainer

    if device == "cuda" and limit is not None:
        cap_cuda_memory(limit)
    losses, times = [], []
    with Trainer(plan, device=device, allow_fallback=False, tf32=False) as trainer:
        for step in range(steps):
            result = trainer.step(prepare_inputs(trainer.graph, seed=step))
            losses.append(result.loss)
            times.append(result.seconds)
        batch, ran_on = trainer.batch_size, trainer.device
    return {"device": ran_on, "batch": batch, "losses": losses, "step_time_s": statistics.median(times[1:] or times)}


WORKERS = {"torch": torch_steps, "train": train_steps}


@dataclasses.dataclass
class Setting:
    """What every case of one run shares."""

    cap: int                        # bytes, for both sides
    overhead: int                   # memsched's fixed per-process device memory, bytes
    workspace: int                  # bytes left for kernels' scratch under the cap
    hardware: str                   # the profile plans are compiled for
    steps: int                      # memsched's steps (the first untimed); PyTorch times steps - 1 after one
    time_limit: float               # seconds per compile
    max_batch: int
    scratch: Path                   # plans and refilled weights go here
    dry_run: bool
    manifest: dict = dataclasses.field(default_factory=dict)    # model -> compiled entry (--plans)
    plans: Path | None = None       # the folder of the manifest's plans

    @property
    def budget(self) -> int:
        return self.cap - self.overhead - self.workspace

    def call(self, worker: str, **args) -> dict:
        """Run a worker: in this process for a dry run, else in a fresh one measured by NVML."""
        if self.dry_run:
            return WORKERS[worker](**args)
        command = [sys.executable, __file__, "--worker", worker, "--args", json.dumps(args)]
        return run_measured(command, timeout=900.0)


# ---- one case --------------------------------------------------------------------------------
def torch_side(label: str, setting: Setting) -> dict:
    """PyTorch's largest batch under the cap (tried on the GPU, or computed on the meta device
    in a dry run) and its step time there."""
    device = "cpu" if setting.dry_run else "cuda"
    tries: dict[int, dict] = {}

    def fits(batch: int) -> bool:
        if setting.dry_run:
            tries[batch] = {"peak_bytes": meta_peak(label, batch)}
            return tries[batch]["peak_bytes"] <= setting.cap
        tries[batch] = setting.call("torch", model=label, batch=batch, steps=0, device=device, cap=setting.cap)
        if "error" in tries[batch] and "fits" not in tries[batch]:
            raise RuntimeError(f"PyTorch failed at batch {batch}: {tries[batch]['error'][-300:]}")
        return tries[batch]["fits"]

    # where PyTorch's tensors alone stop fitting bounds its real largest batch from above: the
    # search starts at a quarter of it (fewer tries on a lent GPU), and below if that fails
    bound, _ = largest_batch(lambda b: meta_peak(label, b) <= setting.cap, 1, setting.max_batch)
    start = max(1, bound // 4)
    batch, trials = largest_batch(fits, start, setting.max_batch)
    if not batch and start > 1:
        batch, more = largest_batch(fits, 1, start - 1)
        trials += more
    side = {"largest_batch": batch, "meta_bound": bound, "trials": trials,
            "peaks": {b: t.get("peak_bytes", t.get("device_memory_peak_bytes")) for b, t in tries.items()},
            "errors": {b: t["error"] for b, t in tries.items() if "error" in t},
            "cap_applies_to": ("PyTorch eager's tensors, computed on the meta device (dry run)" if setting.dry_run
                               else "torch's caching allocator (set_per_process_memory_fraction); the CUDA "
                               "context is outside it")}
    if batch:
        timed = setting.call("torch", model=label, batch=batch, steps=max(1, setting.steps - 1), device=device,
                             cap=None if setting.dry_run else setting.cap)
        side.update(timed)
        if timed.get("step_time_s"):
            side["time_per_sample_s"] = timed["step_time_s"] / batch
    return side


def plan_for(label: str, batch: int, setting: Setting) -> tuple[dict, Path | None]:
    """The plan memsched trains case `label` with: the manifest's (--plans) where its batch is
    at least `batch` and its budget within this run's, else one compiled here; and its path
    with the weights drawn again (gpu_check.refill_weights), None where there is none."""
    entry = setting.manifest.get(label)
    usable = (entry is not None and "plan_file" in entry and entry["batch"] >= batch
              and entry["budget_bytes"] <= setting.budget)
    folder = setting.plans if usable else setting.scratch
    if not usable:
        entry = compile_case(label, batch, setting.budget, setting.hardware, setting.scratch, setting.time_limit)
        entry["compiled"] = "here"
    else:
        entry = {**entry, "compiled": "beforehand (--plans)"}
    if "plan_file" not in entry:
        return entry, None
    (setting.scratch / "refilled").mkdir(exist_ok=True)
    path = refill_weights(folder / entry["plan_file"], entry["weights"], setting.scratch / "refilled")
    return entry, path


def memsched_side(label: str, batch: int, setting: Setting) -> dict:
    """memsched's plan for case `label` at `batch` under the cap, trained on the device and on
    the CPU: its entry, both runs, the losses compared."""
    entry, path = plan_for(label, batch, setting)
    side = {key: value for key, value in entry.items() if key != "weights"}
    if path is None:
        return side
    device = "cpu" if setting.dry_run else "cuda"
    limit = setting.cap - setting.overhead - entry["arena_bytes"]
    side["provider_memory_limit_bytes"] = None if setting.dry_run else limit
    side["cap_applies_to"] = ("the plan's arena (dry run)" if setting.dry_run else
                              "the whole process as NVML counts it, CUDA context included: the plan's budget is "
                              "the cap less the fixed overhead and the workspace; ONNX Runtime's own allocations "
                              "are capped at the cap less the fixed overhead and the arena")
    run = setting.call("train", plan=str(path), device=device, steps=setting.steps, limit=limit)
    reference = setting.call("train", plan=str(path), device="cpu", steps=setting.steps, limit=None)
    side.update(run=run, cpu_reference=reference)
    if "losses" in run and "losses" in reference:
        side["losses"] = compare_losses(run["losses"], reference["losses"])
        side["time_per_sample_s"] = run["step_time_s"] / run["batch"]
    if "device_memory_peak_bytes" in run and not setting.dry_run:
        side["within_cap"] = run["device_memory_peak_bytes"] <= setting.cap
    return side


def measure_case(label: str, setting: Setting) -> dict:
    """One row: PyTorch's largest batch, memsched at twice it, the comparison."""
    row = {"model": label, "memsched_model": CASES[label]["memsched"], "cap_bytes": setting.cap,
           "budget_bytes": setting.budget}
    try:
        row["torch"] = torch_side(label, setting)
        largest = row["torch"]["largest_batch"]
        if not largest:
            return {**row, "error": "PyTorch trains no batch under the cap"}
        row["memsched"] = side = memsched_side(label, 2 * largest, setting)
    except Exception as exc:  # noqa: BLE001 - a model this run cannot measure is a row that says why
        say(f"{label}: {type(exc).__name__}: {exc}")
        return {**row, "error": f"{type(exc).__name__}: {str(exc)[-1000:]}"}
    if "batch" in side.get("run", {}):
        row["batch_over_torch"] = side["run"]["batch"] / largest
    if side.get("time_per_sample_s") and row["torch"].get("time_per_sample_s"):
        row["time_per_sample_vs_torch"] = side["time_per_sample_s"] / row["torch"]["time_per_sample_s"]
    say(f"{label}: PyTorch {largest}, memsched {side.get('batch')} ({side.get('error') or 'trained'}), "
        f"losses {side.get('losses', {}).get('match')}, within cap {side.get('within_cap')}")
    return row


def summarise(rows: list[dict]) -> dict:
    done = [r for r in rows if "losses" in r.get("memsched", {})]
    return {"models": len(rows), "trained": len(done),
            "batch_at_least_2x": all(r.get("batch_over_torch", 0) >= 2 for r in done) and len(done) == len(rows),
            "losses_match": all(r["memsched"]["losses"]["match"] for r in done) and len(done) == len(rows),
            "within_cap": (all(r["memsched"].get("within_cap") for r in done) and len(done) == len(rows)
                           if done and "within_cap" in done[0]["memsched"] else None)}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the driver ------------------------------------------------------------------------------
def compile_ahead(names: list[str], args, directory: Path) -> int:
    """--compile-to: for each case, the plan at twice the batch PyTorch's tensors fit in under
    the cap (computed on the meta device), for the assumed overhead; a manifest beside them."""
    directory.mkdir(parents=True, exist_ok=True)
    cap, overhead, workspace = (parse_bytes(args.cap or "4GiB"), parse_bytes(args.overhead),
                                parse_bytes(args.workspace))
    compiled = []
    for label in names:
        bound, _ = largest_batch(lambda batch: meta_peak(label, batch) <= cap, 1, args.max_batch)
        entry = (compile_case(label, 2 * bound, cap - overhead - workspace, args.hardware or "h200", directory,
                              args.time_limit) if bound else
                 {"model": label, "error": "PyTorch's tensors fit no batch under the cap"})
        compiled.append({**entry, "meta_largest_batch": bound})
        say(f"{label}: PyTorch's tensors fit up to batch {bound}; plan at {entry.get('batch')}: "
            f"{entry.get('error') or format_bytes(entry['arena_bytes'])}")
    return emit({"cap_bytes": cap, "overhead_assumed_bytes": overhead, "workspace_bytes": workspace,
                 "compiled": compiled}, str(directory / "manifest.json"))


def setting_for(args, scratch: Path) -> tuple[Setting | None, dict]:
    """The run's setting and the report's head; None where there is nothing to measure here
    (no CUDA without --dry-run), after saying why in one line. With --plans, the plans
    `--compile-to` wrote."""
    head = {"benchmark": "gpu-cap", "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "dry_run": args.dry_run, "tolerance": TOLERANCE, "tf32": False}
    setting, head = dry_setting(args, scratch, head) if args.dry_run else cuda_setting(args, scratch, head)
    if setting is not None and args.plans:
        manifest = json.loads((Path(args.plans) / "manifest.json").read_text())
        setting.manifest, setting.plans = {e["model"]: e for e in manifest["compiled"]}, Path(args.plans)
    return setting, head


def dry_setting(args, scratch: Path, head: dict) -> tuple[Setting, dict]:
    """A dry run's: on the CPU, no fixed overhead nor workspace, the cap given or (set per
    model by `run`) PyTorch's computed peak at DRY_BATCH."""
    cap = parse_bytes(args.cap) if args.cap else 0
    setting = Setting(cap, 0, 0, args.hardware or "h200", args.steps or 2, args.time_limit, args.max_batch,
                      scratch, True)
    return setting, {**head, "device": "cpu (dry run)",
                     "cap": "given" if cap else (f"per model: PyTorch eager's peak at batch {DRY_BATCH}, "
                                                 f"computed on the meta device"),
                     "fixed_overhead": {"bytes": 0, "reason": "a dry run: the fake cap holds PyTorch's tensors "
                                                              "and memsched's plan only"}}


def cuda_setting(args, scratch: Path, head: dict) -> tuple[Setting | None, dict]:
    """On a GPU: the cap given (default 4 GiB), the fixed overhead memsched doctor measures,
    the GPU's preset profile; None where CUDA, PyTorch or the measurement is missing."""
    from memsched.doctor import diagnose

    if importlib.util.find_spec("torch") is None:
        print("gpu_cap: PyTorch is not installed here, nothing to compare with")
        return None, head
    doctor = diagnose()
    if not doctor["cuda_usable"]:
        print(f"gpu_cap: CUDA is not usable here, nothing to measure: {doctor['reason']} "
              f"(--dry-run runs the same logic on the CPU)")
        return None, head
    overhead = doctor["fixed_overhead"]          # measured afresh by diagnose()
    if overhead["bytes"] is None:
        print(f"gpu_cap: the fixed device overhead could not be measured: {overhead['reason']}")
        return None, head
    gpu = doctor["gpus"][0]["name"] if doctor["gpus"] else "unknown GPU"
    setting = Setting(parse_bytes(args.cap or "4GiB"), overhead["bytes"], parse_bytes(args.workspace),
                      args.hardware or preset_for(gpu), args.steps or 3, args.time_limit, args.max_batch, scratch,
                      False)
    return setting, {**head, "device": gpu, "doctor": {k: doctor[k] for k in ("onnxruntime", "gpus")},
                     "fixed_overhead": overhead}


def run(names: list[str], args) -> int:
    with tempfile.TemporaryDirectory(prefix="memsched-gpu-cap-") as scratch:
        setting, report = setting_for(args, Path(scratch))
        if setting is None:
            return 0
        report["models"] = []
        for label in names:
            if setting.dry_run and not args.cap:     # the fake cap: PyTorch's peak at DRY_BATCH
                setting.cap = meta_peak(label, DRY_BATCH)
            report["models"].append(measure_case(label, setting))
            report.update(cap_bytes=None if setting.dry_run and not args.cap else setting.cap,
                          workspace_bytes=setting.workspace, hardware=setting.hardware, steps=setting.steps,
                          summary=summarise(report["models"]))
            if args.out:                 # the report so far: a run cut short still leaves it
                emit(report, args.out, echo=False)
        return emit(report, args.out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(CASES)} (default: "
                        f"{', '.join(MODELS)}; with --dry-run {', '.join(DRY_MODELS)})")
    parser.add_argument("--cap", help="the device-memory cap for both (default 4GiB; a dry run: PyTorch's "
                        f"computed peak at batch {DRY_BATCH})")
    parser.add_argument("--workspace", default="256MiB", help="room under the cap for kernels' workspace")
    parser.add_argument("--overhead", default="1GiB", help="with --compile-to: the fixed overhead to assume")
    parser.add_argument("--steps", type=int, help="memsched's steps (default 3; dry run 2)")
    parser.add_argument("--max-batch", type=int, default=1024, help="the largest batch the search tries")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per compile")
    parser.add_argument("--hardware", help="the profile plans are compiled for (default: the GPU's preset)")
    parser.add_argument("--dry-run", action="store_true", help="the same logic on the CPU with a fake cap")
    parser.add_argument("--compile-to", help="only compile the plans, into this folder (no GPU needed)")
    parser.add_argument("--plans", help="use the plans `--compile-to` wrote in this folder")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](**json.loads(args.args))))
        return 0
    names = [n.strip() for n in (args.models or ",".join(DRY_MODELS if args.dry_run else MODELS)).split(",")
             if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.compile_to:
        return compile_ahead(names, args, Path(args.compile_to))
    return run(names, args)


if __name__ == "__main__":
    sys.exit(main())
