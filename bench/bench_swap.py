"""Swap planner benchmark: how much larger a batch (3-D U-Net: resolution) fits on a V100-16GB
(PCIe 3) training step with SGD when the plan may reorder, reuse, recompute and swap, and at
what predicted step-time overhead; then the same step with host DRAM set small, to show the
NVDIMM tier taking what DRAM cannot. Prints one JSON object on stdout (progress on stderr).

    python bench/bench_swap.py [--quick] [--time-limit S] [--only NAME ...]
    python bench/bench_swap.py --nvdimm resnet50:1004      # only the small-DRAM check
    python bench/bench_swap.py --at unet3d:264 unet3d:256  # only the full plan at these sizes

Sizes are searched by doubling, then bisection (planning cost does not grow with the batch:
graphs are shape-only, weights=False). "no plan" is the framework's own order with nothing
reused or swapped; "full plan" is passes.pipeline.compile with every strategy that has landed
(the JSON says which) under a budget of the whole device memory. Times are the event
simulator's (roofline op times on the profile), overhead = plan time / no-plan time at the
same size - 1. Targets (issue 8): largest fitting size >= 5x the no-plan one at <= 15%.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx  # noqa: E402

from memsched import models  # noqa: E402
from memsched import hardware as hardware_mod  # noqa: E402
from memsched.errors import BudgetError  # noqa: E402
from memsched.ir import Graph  # noqa: E402
from memsched.memory import analyze  # noqa: E402
from memsched.schedule import default_schedule  # noqa: E402
from memsched.passes import pipeline  # noqa: E402
from memsched.passes.training import build_training_step  # noqa: E402

PROFILE = "v100-16gb"
OVERHEAD_TARGET = 0.15
RATIO_TARGET = 5.0
GB = 10**9
# model -> (axis, size -> build options, the smallest size, step): 3-D U-Net grows its volume
CASES = {
    "vgg16": ("batch", lambda b: {"batch": b}, 1, 1),
    "resnet50": ("batch", lambda b: {"batch": b}, 1, 1),
    "unet3d": ("size", lambda s: {"size": s}, 16, 8),     # three poolings: sides in multiples of 8
    "bert-base": ("batch", lambda b: {"batch": b, "seq": 128}, 1, 1),
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def forward_graph(name: str, size: int) -> Graph:
    """A bundled model, shape-only (no weights: instant at any size)."""
    axis, options, _, _ = CASES[name]
    return Graph.from_onnx(onnx.shape_inference.infer_shapes(models.build(name, weights=False, **options(size)),
                                                             data_prop=True))


def training_graph(name: str, size: int) -> Graph:
    """The SGD training step of a bundled model, shape-only."""
    return build_training_step(forward_graph(name, size), loss="cross_entropy", optimizer="sgd")


def strategies() -> list[str]:
    """Every strategy whose pass is on this branch (recompute and swap are optional modules)."""
    optional = {"recompute": "passes.recompute.planner", "swap": "passes.swap.planner"}
    return [s for s in pipeline.STRATEGIES if s not in optional or importlib.util.find_spec(optional[s])]


def no_plan(name: str, size: int, hw) -> dict | None:
    graph = training_graph(name, size)
    peak = analyze(graph, default_schedule(graph)).peak_bytes
    return {"peak_bytes": peak} if peak <= hw.device_memory else None


def full_plan(name: str, size: int, hw, used: list[str], time_limit: float) -> dict | None:
    try:   # from the forward model, as `memsched compile --train` plans it (reuse may rewrite the step)
        result = pipeline.compile(forward_graph(name, size), train=True, loss="cross_entropy", optimizer="sgd",
                                  hardware=hw, budget=hw.device_memory, strategies=used, time_limit=time_limit)
    except BudgetError:
        return None
    plan, swap = result.report["plan"], result.plan.notes.get("swap", {})
    return {"overhead": plan["overhead"], "step_time_s": plan["step_time_s"],
            "no_plan_step_time_s": result.report["baseline"]["step_time_s"], "stall_s": plan["stall_s"],
            "peak_bytes": plan["peak_bytes"], "baseline_peak_bytes": result.report["baseline"]["peak_bytes"],
            "swapped_bytes": swap.get("swapped_bytes", {}), "host_peak_bytes": swap.get("host_peak_bytes", {}),
            "recomputed_ops": len(plan["recomputed_ops"]), "micro_batches": plan["micro_batches"],
            "swap_status": swap.get("status"), "solver_chosen": swap.get("solver", {}).get("chosen"),
            "pass_seconds": result.report["pass_seconds"], "fit": fit_summary(result.plan.notes.get("fit", {})),
            "notes": swap}


def fit_summary(fit: dict) -> dict:
    """What fit tried in the chosen round (predicted step time before placement, arena where
    placed), so that a row's figure can be traced to the candidate it came from."""
    keys = ("step_time_s", "peak_bytes", "arena_bytes", "smallest_peak_bytes", "chosen")
    return {"rounds": fit.get("rounds"), "target_bytes": fit.get("target_bytes"),
            "tried": {t["candidate"]: {k: t[k] for k in keys if k in t} for t in fit.get("tried", [])}}


def largest(fits, start: int, step: int, lo_known: int | None = None, tolerance: float = 0.0):
    """Largest size (a multiple of step) for which fits(size) is not None: doubling from `start`
    (or from a known fitting size), then bisection down to `tolerance` (relative)."""
    lo, lo_result = None, None
    size = lo_known or start
    while True:
        result = fits(size)
        if result is None:
            hi = size
            break
        lo, lo_result = size, result
        size *= 2
    if lo is None:
        return None, None
    while hi - lo > step and (hi - lo) > tolerance * lo:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        result = fits(mid)
        if result is None:
            hi = mid
        else:
            lo, lo_result = mid, result
    return lo, lo_result


def bench_model(name: str, hw, used: list[str], time_limit: float, tolerance: float) -> dict:
    axis, _, start, step = CASES[name]
    t0 = time.perf_counter()
    say(f"{name}: largest {axis} with no plan")
    base, base_result = largest(lambda s: no_plan(name, s, hw), start, step)
    cache: dict[int, dict | None] = {}

    def planned(size: int):
        if size not in cache:
            say(f"{name}: full plan at {axis} {size}")
            cache[size] = full_plan(name, size, hw, used, time_limit)
            if cache[size] is not None:
                say(f"    overhead {cache[size]['overhead']:+.1%}")
        return cache[size]

    say(f"{name}: largest {axis} with the full plan")
    fit, fit_result = largest(planned, start, step, lo_known=base, tolerance=tolerance)
    say(f"{name}: largest {axis} with the full plan at <= {OVERHEAD_TARGET:.0%} overhead")

    def cheap(size: int):
        result = planned(size)
        return result if result is not None and result["overhead"] <= OVERHEAD_TARGET else None

    within, within_result = largest(cheap, start, step, lo_known=base, tolerance=tolerance)
    volume = 3 if axis == "size" else 1            # memory grows with the volume (size^3)
    entry = {
        "axis": axis,
        "no_plan": {"largest": base, "peak_bytes": base_result["peak_bytes"] if base_result else None},
        "full_plan": _summary(fit, fit_result),
        "within_target_overhead": _summary(within, within_result),
        "ratio": fit / base if fit and base else None,
        "ratio_within_target": within / base if within and base else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if volume > 1:
        entry["volume_ratio"] = (fit / base) ** 3 if fit and base else None
        entry["volume_ratio_within_target"] = (within / base) ** 3 if within and base else None
    key = "volume_ratio_within_target" if volume > 1 else "ratio_within_target"
    entry["target_met"] = bool(entry[key] and entry[key] >= RATIO_TARGET)
    return entry


def _summary(size, result) -> dict:
    if result is None:
        return {"largest": size}
    keep = ("overhead", "step_time_s", "no_plan_step_time_s", "stall_s", "peak_bytes", "baseline_peak_bytes",
            "swapped_bytes", "host_peak_bytes", "recomputed_ops", "micro_batches", "swap_status", "solver_chosen",
            "pass_seconds", "fit")
    return {"largest": size, **{k: result[k] for k in keep}}


def where_tensors_went(notes: dict, top: int = 5) -> dict:
    """Per destination (tier or recompute): how many tensors, their bytes, the largest few."""
    by: dict[str, list] = defaultdict(list)
    for move in notes.get("tensors", []):
        by[move["to"]].append(move)
    out = {}
    for where, moves in sorted(by.items()):
        moves.sort(key=lambda m: -m["bytes"])
        out[where] = {"tensors": len({m["tensor"] for m in moves}), "bytes": sum(m["bytes"] for m in moves),
                      "how": dict(Counter(m["how"] for m in moves)),
                      "largest": [{"tensor": m["tensor"], "bytes": m["bytes"], "idle_steps": m["idle_steps"]}
                                  for m in moves[:top]]}
    return out


def bench_nvdimm(name: str, size: int, hw, used: list[str], time_limit: float, held: int) -> dict:
    """The same plan with DRAM set small: 64 GB, or half of the most bytes the plan held on
    the host at once when that is less (so that DRAM cannot hold them all)."""
    dram = min(64 * GB, max(held // 2, 1))
    tiers = dict(hw.tiers)
    tiers["dram"] = dataclasses.replace(tiers["dram"], capacity=dram)
    small = dataclasses.replace(hw, name=f"{hw.name}-dram-{dram}", tiers=tiers)
    say(f"nvdimm: {name} at {size} with {dram / GB:.1f} GB of DRAM")
    result = full_plan(name, size, small, used, time_limit)
    if result is None:
        return {"model": name, "size": size, "dram_bytes": dram, "fits": False}
    notes = result["notes"]
    return {"model": name, "size": size, "dram_bytes": dram, "nvdimm_bytes": small.tiers["nvdimm"].capacity,
            "fits": True, "overhead": result["overhead"], "stall_s": result["stall_s"],
            "swapped_bytes": result["swapped_bytes"], "host_peak_bytes": notes.get("host_peak_bytes"),
            "where": where_tensors_went(notes)}


def nvdimm_after(results: dict, names: list[str], hw, used: list[str], time_limit: float) -> dict | None:
    """The small-DRAM check on the first model (ResNet-50 first) that swapped, where its plan
    is meant to run: the largest size within the overhead target (else the largest that fits)."""
    for name in ("resnet50", *names):
        entry = results.get(name)
        points = (entry["within_target_overhead"], entry["full_plan"]) if entry else ()
        point = next((p for p in points if p.get("swapped_bytes")), None)
        if point:
            held = sum(point["host_peak_bytes"].values())
            return bench_nvdimm(name, point["largest"], hw, used, time_limit, held)
    return None


def nvdimm_alone(name: str, size: int, hw, used: list[str], time_limit: float) -> dict:
    """The small-DRAM check at a given size, without the size searches: one full plan with
    the profile's DRAM finds the host bytes it holds, then the check halves them."""
    say(f"{name}: full plan at {size} for the host bytes it holds")
    planned = full_plan(name, size, hw, used, time_limit)
    if planned is None:
        sys.exit(f"bench_swap: {name} at {size} does not fit with the full plan")
    return bench_nvdimm(name, size, hw, used, time_limit, sum(planned["host_peak_bytes"].values()))


def points(texts: list[str], hw, used: list[str], time_limit: float) -> dict:
    """The full plan at given sizes, beside the largest size that fits with no plan."""
    results: dict[str, dict] = {}
    for name, size in map(_model_at, texts):
        axis, _, start, step = CASES[name]
        if name not in results:
            say(f"{name}: largest {axis} with no plan")
            results[name] = {"axis": axis, "no_plan": {"largest": largest(lambda s: no_plan(name, s, hw), start,
                                                                          step)[0]}, "points": {}}
        say(f"{name}: full plan at {axis} {size}")
        point = full_plan(name, size, hw, used, time_limit)
        base = results[name]["no_plan"]["largest"]
        ratio = (size / base) ** (3 if axis == "size" else 1) if base else None
        results[name]["points"][size] = {"fits": point is not None, "ratio": ratio,
                                         **(_summary(size, point) if point else {})}
        if point:
            say(f"    overhead {point['overhead']:+.1%}")
    return results


def _model_at(text: str) -> tuple[str, int]:
    name, _, size = text.partition(":")
    if name not in CASES or not size.isdigit():
        sys.exit(f"bench_swap: --nvdimm wants MODEL:SIZE with MODEL one of {', '.join(CASES)}, not {text!r}")
    return name, int(size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, short solver limits, coarse search")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per solver (default 10, quick 2)")
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="models to run")
    parser.add_argument("--nvdimm", metavar="MODEL:SIZE",
                        help="only the small-DRAM check, for MODEL at SIZE (no size search)")
    parser.add_argument("--at", nargs="+", metavar="MODEL:SIZE",
                        help="only the full plan at these sizes (no search for the full plan's largest)")
    args = parser.parse_args(argv)
    quick = args.quick
    time_limit = args.time_limit or (2.0 if quick else 10.0)
    tolerance = 0.1 if quick else 0.02
    names = args.only or (["resnet50", "vgg16"] if quick else list(CASES))
    hw = hardware_mod.load(PROFILE)
    used = strategies()
    started = time.perf_counter()
    if args.nvdimm:
        results, nvdimm = {}, nvdimm_alone(*_model_at(args.nvdimm), hw, used, time_limit)
    elif args.at:
        results, nvdimm = points(args.at, hw, used, time_limit), None
    else:
        results = {name: bench_model(name, hw, used, time_limit, tolerance) for name in names}
        nvdimm = nvdimm_after(results, names, hw, used, time_limit)
    print(json.dumps({
        "hardware": hw.name, "device_memory_bytes": hw.device_memory, "optimizer": "sgd",
        "strategies": used, "time_limit_s": time_limit, "quick": quick,
        "targets": {"ratio": RATIO_TARGET, "overhead": OVERHEAD_TARGET},
        "models": results, "nvdimm": nvdimm, "seconds": round(time.perf_counter() - started, 1),
    }, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
