"""Compile time against the size of the training step: how long `compile --train --budget B`
takes (all four strategies, one deadline), how soon it has a fitting plan, and how good the
plan is at each time limit. Prints one JSON object on stdout (progress on stderr).

    python bench/bench_compile.py [--limits 10 60 300] [--budget 50%] [--only NAME ...]
                                  [--load K] [--out FILE]

Models are shape-only (weights=False: building them is instant at any size), planned on
v100-16gb with SGD. Per case and limit: the training step's op count, the wall seconds of
the compile call (load and emit excluded; they do not depend on the limit), the seconds to
the first fitting plan, whether the deadline cut the search, the predicted overhead of the
plan (plan step time / baseline step time - 1) and its peak and arena bytes.

Two promises are checked per case: a longer limit never gives a slower plan (`monotone`:
each limit's overhead at most the one before it), and, with `--load K`, every limit is
compiled again beside K busy processes and must give the same plan (`same_under_load`: the
same `plan_sha256`, a digest of the plan's figures and of which tensors it recomputes and
swaps where).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_report import emit  # noqa: E402

from memsched import models  # noqa: E402
from memsched.errors import BudgetError  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402

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


def _busy() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes that spin on a core each until the block ends."""
    spinners = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def report_digest(report: dict) -> str:
    """sha256 of what makes two plans the same: the plan's figures and each tensor the plan
    recomputes or swaps, with where and when."""
    swap = report["passes"].get("swap", {})
    decisions = [{k: t.get(k) for k in ("tensor", "to", "how", "out_before_step", "back_before_step")}
                 for t in swap.get("tensors", [])]
    text = json.dumps({"plan": report["plan"], "decisions": decisions,
                       "recomputed": swap.get("recomputed_ops")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


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
            "micro_batches": report["plan"]["micro_batches"], "plan_sha256": report_digest(report),
            "chosen": next((t["candidate"] for t in report["passes"].get("fit", {}).get("tried", [])
                            if t["chosen"]), "as is"),
            "attempts": len(report["passes"].get("fit", {}).get("tried", [])),
            "pass_seconds": report["pass_seconds"]}


def summary(name: str, quiet: list[dict], loaded: list[dict]) -> dict:
    """Whether a longer limit was never slower, and whether load changed any plan."""
    overheads = [row["overhead"] if row["fits"] else None for row in quiet]
    monotone = all(b is not None and (a is None or b <= a) for a, b in zip(overheads, overheads[1:]))
    result = {"case": name, "overheads": overheads, "monotone": monotone}
    if loaded:
        result["same_under_load"] = all(q.get("plan_sha256") == l.get("plan_sha256") for q, l in zip(quiet, loaded))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", type=float, nargs="+", default=[60.0], metavar="S")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="NAME")
    parser.add_argument("--load", type=int, default=0, metavar="K",
                        help="compile every limit again beside K busy processes")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows, summaries = [], []
    for name in args.only or CASES:
        quiet, loaded = [], []
        for limit in sorted(args.limits):
            say(f"{name} at {args.budget}, --time-limit {limit:g}")
            quiet.append(measure(name, limit, args.budget))
            say(json.dumps({k: v for k, v in quiet[-1].items() if k != "pass_seconds"}))
            if args.load:
                say(f"{name} at {args.budget}, --time-limit {limit:g}, beside {args.load} busy processes")
                with busy_processes(args.load):
                    loaded.append(dict(measure(name, limit, args.budget), load=args.load))
                say(json.dumps({k: v for k, v in loaded[-1].items() if k != "pass_seconds"}))
        rows += quiet + loaded
        summaries.append(summary(name, quiet, loaded))
        say(json.dumps(summaries[-1]))
    return emit({"bench": "compile", "hardware": PROFILE, "budget": args.budget, "runs": rows,
                 "cases": summaries}, args.out)


if __name__ == "__main__":
    sys.exit(main())
