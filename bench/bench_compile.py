"""Compile time against the size of the training step: how long `compile --train --budget B`
takes (all four strategies, one deadline), how soon it has a fitting plan, and how good the
plan is at each time limit. Prints one JSON object on stdout (progress on stderr).

    python bench/bench_compile.py [--limits 10 60 300] [--budget 50%] [--only NAME ...]

Models are shape-only (weights=False: building them is instant at any size), planned on
v100-16gb with SGD. Per case and limit: the training step's op count, the wall seconds of
the compile call (load and emit excluded; they do not depend on the limit), the seconds to
the first fitting plan, whether the deadline cut the search, the predicted overhead of the
plan (plan step time / baseline step time - 1) and its peak and arena bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from memsched.errors import BudgetError  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from passes.pipeline import compile as compile_plan  # noqa: E402

PROFILE = "v100-16gb"
# name -> (bundled model, build options): training steps of about 900 to 10,000 ops (GPT-2 with
# 30 layers: 5,093 ops; with 60 layers: 10,133)
CASES = {
    "resnet18-b32": ("resnet18", {"batch": 32}),
    "resnet50-b16": ("resnet50", {"batch": 16}),
    "mobilenetv2-b32": ("mobilenetv2", {"batch": 32}),
    "bert-base-b32": ("bert-base", {"batch": 32, "seq": 128}),
    "gpt2-30-layers": ("gpt2", {"batch": 8, "seq": 128, "layers": 30}),
    "gpt2-60-layers": ("gpt2", {"batch": 4, "seq": 128, "layers": 60}),
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(name: str, limit: float, budget: str) -> dict:
    model, options = CASES[name]
    graph = lower(models.build(model, weights=False, **options))
    started = time.perf_counter()
    try:
        result = compile_plan(graph, train=True, hardware=PROFILE, budget=budget, time_limit=limit)
    except BudgetError as err:
        return {"case": name, "time_limit_s": limit, "fits": False, "error": str(err),
                "wall_s": round(time.perf_counter() - started, 2)}
    wall = time.perf_counter() - started
    report = result.report
    return {"case": name, "ops": report["graph"]["ops"], "time_limit_s": limit, "fits": True,
            "wall_s": round(wall, 2), "wall_over_limit": round(wall / limit, 3),
            "first_fit_s": report["solver"]["first_fit_s"], "deadline_hit": report["solver"]["deadline_hit"],
            "overhead": round(report["plan"]["overhead"], 4), "peak_bytes": report["plan"]["peak_bytes"],
            "arena_bytes": report["plan"]["arena_bytes"], "budget_bytes": report["budget_bytes"],
            "micro_batches": report["plan"]["micro_batches"],
            "chosen": next((t["candidate"] for t in report["passes"].get("fit", {}).get("tried", [])
                            if t["chosen"]), "as is"),
            "attempts": len(report["passes"].get("fit", {}).get("tried", [])),
            "pass_seconds": report["pass_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", type=float, nargs="+", default=[60.0], metavar="S")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="NAME")
    args = parser.parse_args()
    rows = []
    for name in args.only or CASES:
        for limit in args.limits:
            say(f"{name} at {args.budget}, --time-limit {limit:g}")
            rows.append(measure(name, limit, args.budget))
            say(json.dumps({k: v for k, v in rows[-1].items() if k != "pass_seconds"}))
    print(json.dumps({"bench": "compile", "hardware": PROFILE, "budget": args.budget, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
