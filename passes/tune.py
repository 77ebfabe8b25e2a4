"""Mini-batch size tuning: the largest batch that fits per strategy set, and the fastest per sample.

Published experience: maximising GPU utilisation does not find the fastest batch; minimising
the time per sample does, and a memory plan moves where that optimum can be. For each
strategy set, the batch size is searched, not listed: doubling from 1 until the plan no
longer fits the device (or the budget), then bisection between the last fit and the first
miss (peak memory grows with the batch). Every batch tried is compiled with the pipeline and
simulated; the rows keep peak, fit and predicted time per sample. The batch with the best
predicted throughput is the fitting row with the least time per sample.

The time limit is the whole search's: each batch's compile gets COMPILE_SHARE of it as its
own (counted) effort, so the same limit gives the same rows, and the command's one deadline
ends the search where it falls: no compile starts past it (nor one the time left cannot
hold, judged by the last compile), and the result says which strategy sets were searched to
the end (`complete`).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import onnx

from memsched import frontend
from memsched import hardware as hardware_mod
from memsched.deadline import Deadline
from memsched.errors import BudgetError, UserError
from memsched.ir import Graph
from memsched.units import format_bytes, parse_bytes

from memsched.passes.pipeline import compile as compile_plan

# Strategy sets compared; "none" is the framework baseline (no plan).
STRATEGY_SETS = {"none": (), "order,reuse": ("order", "reuse"),
                 "full": ("order", "reuse", "recompute", "swap")}
MAX_BATCH = 1 << 16
COMPILE_SHARE = 0.05    # of the search's time limit, each batch's compile's own (a search compiles ~10-40)


def compile_time_limit(time_limit: float) -> float:
    """The time limit of each batch's compile in a search given `time_limit` in all."""
    return COMPILE_SHARE * time_limit


class _OutOfTime(Exception):
    """The search's deadline passed before another compile."""


@dataclasses.dataclass
class TuneResult:
    rows: list[dict]                     # one per (strategy set, batch) compiled
    largest: dict[str, int | None]       # strategy set -> largest batch that fits
    best: dict[str, dict | None]         # strategy set -> its row with the least time per sample
    best_overall: dict | None
    capacity_bytes: int
    complete: dict[str, bool] = dataclasses.field(default_factory=dict)   # set -> searched to the end

    def to_dict(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "largest_batch": self.largest,
                "best": self.best, "best_overall": self.best_overall, "complete": self.complete,
                "rows": self.rows}


def graph_builder(model: str, dims: dict[str, int] | None = None, batch_dim: str | None = None,
                  size: int | None = None, seq: int | None = None, weights: bool = False) -> Callable[[int], Graph]:
    """batch -> forward Graph. MODEL is a bundled model name or an ONNX file with a symbolic batch dim.

    Bundled models are built shape-only (planning needs no weights) unless `weights`."""
    from memsched import models

    names = {entry["name"] for entry in models.catalog()}
    if model in names and not Path(model).exists():
        extra = {k: v for k, v in (("size", size), ("seq", seq)) if v is not None}
        return lambda batch: frontend.lower(models.build(model, batch=batch, weights=weights, **extra))
    proto = frontend.read_model(Path(model))
    dim = batch_dim or _first_symbolic_dim(proto)
    if dim is None:
        raise UserError(f"{model} has a fixed batch size; export it with a symbolic batch dimension "
                        f"(e.g. torch.onnx.export(..., dynamic_axes=...)) or name a bundled model")
    base_dir = str(Path(model).parent)

    def build(batch: int) -> Graph:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        return frontend.lower(copy, {**(dims or {}), dim: batch}, base_dir=base_dir)
    return build


def _first_symbolic_dim(model: onnx.ModelProto) -> str | None:
    initializers = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                return d.dim_param
    return None


def tune_batch(build: Callable[[int], Graph], *, hardware=hardware_mod.PLANNING_PROFILE,
               budget: str | int | None = None, strategy_sets: dict[str, tuple[str, ...]] | None = None,
               train: bool = True,
               loss: str = "cross_entropy", optimizer: str = "sgd", time_limit: float = 60.0,
               max_batch: int = MAX_BATCH, progress: Callable[[str], None] | None = None,
               measure: str | None = None, measure_build: Callable[[int], Graph] | None = None,
               measure_steps: int = 3, deadline: Deadline | None = None) -> TuneResult:
    """Search the batch size per strategy set within `time_limit` seconds in all (or by
    `deadline`); see the module docstring. A set whose search the deadline ends keeps what it
    found: its largest batch is then the largest seen to fit (a lower bound)."""
    say = progress or (lambda message: None)
    deadline = deadline or Deadline(time_limit)
    hw = hardware_mod.load(hardware)
    if budget is not None and str(budget).strip().endswith("%"):
        raise UserError("tune-batch needs an absolute budget (e.g. 12GiB): a percentage of the "
                        "baseline peak changes with the batch size")
    capacity = parse_bytes(budget) if budget is not None else hw.device_memory
    sets = strategy_sets or STRATEGY_SETS
    options = dict(train=train, loss=loss, optimizer=optimizer, time_limit=compile_time_limit(time_limit),
                   deadline=deadline)
    trials = _Trials(build, hw, capacity, options, deadline, say)
    largest: dict[str, int | None] = {}
    best: dict[str, dict | None] = {}
    complete: dict[str, bool] = {}
    for name, strategies in sets.items():
        seen: dict[int, dict] = {}

        def row(b: int) -> dict:
            if b not in seen:
                seen[b] = trials.row(name, strategies, b)
            return seen[b]
        try:
            largest[name] = search_largest(lambda b: row(b)["fits"], max_batch)
            if largest[name] is not None:
                refine_fastest(row, seen, largest[name])
            complete[name] = True
        except _OutOfTime:
            largest[name] = max((b for b, r in seen.items() if r["fits"]), default=None)
            complete[name] = False
        best[name] = _fastest(list(seen.values()))
    if measure:
        for name, row in best.items():
            if row is not None and deadline.cuts():
                row["measured"] = None          # past the time limit: not measured
            elif row is not None:
                say(f"{name}: measuring batch {row['batch']} on {measure}")
                row.update(measure_row(measure_build or build, row["batch"], sets[name], hw, capacity, measure,
                                       measure_steps, options))
    if not trials.rows:
        raise UserError("the time limit ended before a batch was planned; give tune-batch a longer --time-limit")
    if not any(row["fits"] for row in trials.rows):
        raise _nothing_fits(trials.rows, capacity)
    return TuneResult(trials.rows, largest, best, _fastest(trials.rows), capacity, complete)


def _nothing_fits(rows: list[dict], capacity: int) -> BudgetError:
    """The error where no batch fits under any strategy set (exit 3): the smallest peak a
    batch of 1 reached, where it was tried, is the smallest budget that works."""
    ones = [row["peak_bytes"] for row in rows if row["batch"] == 1 and row.get("peak_bytes")]
    smallest = min(ones, default=None)
    reached = f"; batch 1 needs at least {format_bytes(smallest)} ({smallest:,} B)" if smallest else ""
    return BudgetError(f"no batch size fits in {format_bytes(capacity)} ({capacity:,} B) with any strategy set"
                       f"{reached}", smallest)


class _Trials:
    """Each (strategy set, batch) compiled once, as a row of the result; the graph of the
    last batch kept. A compile that the time left cannot hold (the last one took longer) is
    not started: `_OutOfTime`, and the deadline is marked cut."""

    def __init__(self, build: Callable[[int], Graph], hw, capacity: int, options: dict, deadline: Deadline,
                 say: Callable[[str], None]):
        self.build, self.hw, self.capacity, self.options = build, hw, capacity, options
        self.deadline, self.say = deadline, say
        self.rows: list[dict] = []
        self.cache: dict[int, Graph] = {}
        self.last = 0.0        # seconds the last compile took

    def row(self, name: str, strategies: tuple[str, ...], batch: int) -> dict:
        deadline = self.deadline
        if deadline.expired or deadline.left() < self.last:
            deadline.cut = True
            raise _OutOfTime
        began = time.perf_counter()
        self.say(f"{name}: batch {batch}")
        if batch not in self.cache:
            self.cache.clear()  # graphs are rebuilt per batch; keep one
            self.cache[batch] = self.build(batch)
        graph = self.cache[batch]
        if deadline.cuts():        # building the graph took the rest
            raise _OutOfTime
        row = {"strategy": name, "batch": batch}
        try:
            result = compile_batch(graph, strategies, self.hw, self.capacity, **self.options)
        except BudgetError as exc:
            row.update(fits=False, peak_bytes=exc.smallest_feasible_bytes, step_time_s=None, time_per_sample_s=None)
        else:
            report = result.report
            peak = report["plan"]["peak_bytes"]
            row.update(fits=peak <= self.capacity, peak_bytes=peak, arena_bytes=report["plan"]["arena_bytes"],
                       baseline_peak_bytes=report["baseline"]["peak_bytes"],
                       step_time_s=report["plan"]["step_time_s"],
                       time_per_sample_s=report["plan"]["step_time_s"] / batch,
                       overhead=report["plan"]["overhead"])
        self.rows.append(row)
        self.last = time.perf_counter() - began
        return row


def compile_batch(graph: Graph, strategies: tuple[str, ...], hw, capacity: int, **options):
    """Compile one batch's graph; strategies that trade time for memory are held to `capacity`."""
    return compile_plan(graph, hardware=hw, budget=capacity if {"recompute", "swap"} & set(strategies) else None,
                        strategies=strategies, **options)


def measure_row(build: Callable[[int], Graph], batch: int, strategies: tuple[str, ...], hw, capacity: int,
                device: str, steps: int, options: dict) -> dict:
    """Compile `batch` again with real weights and run it with the executor: measured figures."""
    from memsched.runtime import run_plan

    result = compile_batch(build(batch), strategies, hw, capacity, **options)
    run = run_plan(result.plan, steps=steps, device=device)
    return {"measured": {"provider": run.provider, "step_time_s": run.step_time_s,
                         "time_per_sample_s": run.step_time_s / batch, "peak_bytes": run.peak_bytes,
                         "arena_bytes": run.arena_bytes, "planned_peak_bytes": run.planned_peak_bytes}}


def search_largest(fits: Callable[[int], bool], max_batch: int = MAX_BATCH) -> int | None:
    """The largest b in [1, max_batch] with fits(b), assuming fits is monotone (true, then false).

    Doubling finds the first miss, bisection the boundary: O(log b) calls."""
    if not fits(1):
        return None
    low, high = 1, 2
    while high <= max_batch and fits(high):
        low, high = high, high * 2
    high = min(high, max_batch + 1)
    while high - low > 1:  # fits(low), not fits(high) (or high past the cap)
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def refine_fastest(row: Callable[[int], dict], seen: dict[int, dict], largest: int) -> None:
    """Evaluate batches around the fastest one tried so far until its neighbours are known.

    Time per sample falls with the batch while fixed costs amortise and rises once the plan
    must recompute or swap more; on such a unimodal curve an integer ternary search between
    the best point's bracketing neighbours finds the minimum."""
    def cost(b: int) -> float:
        r = row(b)
        return r["time_per_sample_s"] if r["fits"] and r.get("time_per_sample_s") else float("inf")

    tried = sorted(b for b in seen if b <= largest)
    best = min(tried, key=lambda b: (cost(b), -b))
    index = tried.index(best)
    low = tried[index - 1] if index > 0 else 1
    high = tried[index + 1] if index + 1 < len(tried) else largest
    while high - low > 2:
        a, b = low + (high - low) // 3, high - (high - low) // 3
        if (cost(a), -a) < (cost(b), -b):
            high = b
        else:
            low = a
    for b in range(low, high + 1):
        cost(b)


def _fastest(rows: list[dict]) -> dict | None:
    fitting = [r for r in rows if r["fits"] and r.get("time_per_sample_s")]
    return min(fitting, key=lambda r: (r["time_per_sample_s"], -r["batch"])) if fitting else None
