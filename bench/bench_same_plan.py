"""The same command gives the same plan, alone and beside busy processes: seven bundled models
at small sizes (MLP, ResNet-18 and MobileNetV2 at 32 px, BERT and GPT-2 of two layers, U-Net
at 64 px, the DCGAN generator), each compiled for training with no budget, at 60 % and at
35 % (`v100-16gb`, `--time-limit 60`, where no deadline cuts the search), once alone and once
beside K busy processes. Per case: a digest of the whole plan (ops, schedule, in-place
aliases, arena offsets, tensors that start on the host), its arena, its predicted step time
over the baseline's, and which passes said a search ended on the clock. Prints one JSON object.

    python bench/bench_same_plan.py [--load 2] [--only resnet18 mobilenetv2] [--out FILE]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_compile import busy_processes  # noqa: E402
from json_report import emit  # noqa: E402

from memsched import models  # noqa: E402
from memsched.errors import BudgetError  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402

PROFILE = "v100-16gb"
BUDGETS = (None, "60%", "35%")
CASES = {"mlp": ("mlp", {"batch": 32}), "resnet18": ("resnet18", {"batch": 4, "size": 32}),
         "mobilenetv2": ("mobilenetv2", {"batch": 4, "size": 32}),
         "bert": ("bert-base", {"batch": 2, "seq": 32, "layers": 2}),
         "gpt2": ("gpt2", {"batch": 2, "seq": 32, "layers": 2}),
         "unet": ("unet2d", {"batch": 2, "size": 64}), "dcgan": ("dcgan-generator", {"batch": 4})}


def whole_plan_digest(plan) -> str:
    """sha256 of everything a plan decides."""
    text = json.dumps([[(op.name, op.op_type, op.inputs, op.outputs) for op in plan.graph.ops],
                       [str(step) for step in plan.schedule], sorted(plan.aliases.items()),
                       sorted((str(key), offset) for key, offset in (plan.offsets or {}).items()),
                       sorted(plan.on_host)])
    return hashlib.sha256(text.encode()).hexdigest()


def clock_ended(notes) -> list[str]:
    """The notes' paths whose `deterministic` is false: searches the wall clock ended."""
    found = []

    def walk(path: str, value) -> None:
        if isinstance(value, dict):
            if value.get("deterministic") is False:
                found.append(path)
            for key, inner in value.items():
                walk(f"{path}.{key}" if path else key, inner)
    walk("", notes)
    return found


def measure(name: str, budget: str | None) -> dict:
    model, options = CASES[name]
    graph = lower(models.build(model, **options))
    started = time.perf_counter()
    row = {"case": name, "budget": budget}
    try:
        result = compile_plan(graph, train=True, hardware=PROFILE, budget=budget, time_limit=60)
    except BudgetError as err:
        return {**row, "fits": False, "smallest_bytes": err.smallest_feasible_bytes,
                "seconds": round(time.perf_counter() - started, 2)}
    return {**row, "fits": True, "plan_sha256": whole_plan_digest(result.plan),
            "arena_bytes": result.report["plan"]["arena_bytes"],
            "step_over_baseline": round(result.sim.step_time / result.baseline_sim.step_time, 5),
            "clock_ended": clock_ended(result.plan.notes), "seconds": round(time.perf_counter() - started, 2)}


def same(a: dict, b: dict) -> bool:
    keys = ("fits", "plan_sha256", "smallest_bytes")
    return all(a.get(k) == b.get(k) for k in keys)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=2, metavar="K", help="busy processes beside the second run")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="NAME")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    names = args.only or list(CASES)
    alone = [measure(name, budget) for name in names for budget in BUDGETS]
    with busy_processes(args.load):
        loaded = [measure(name, budget) for name in names for budget in BUDGETS]
    differ = [f"{a['case']}@{a['budget']}" for a, b in zip(alone, loaded) if not same(a, b)]
    return emit({"bench": "same_plan", "hardware": PROFILE, "load": args.load, "alone": alone, "loaded": loaded,
                 "cases": len(alone), "same_under_load": not differ, "differ": differ}, args.out)


if __name__ == "__main__":
    sys.exit(main())
