"""compile(): the whole flow of docs/design.md in one call -- load, (train), plan, place, simulate.

    model --frontend--> Graph --training step (train)--> Graph
      baseline = the graph's own order, updates in place (what PyTorch eager does)
      plan     = reuse -> order -> fit (passes.fit: the fastest placed plan within the
                 budget, recompute and swap only while over it) -> placement
      where the plan needs recompute or swap (or nothing fits), the step in micro-batches
      (passes.rewrites.batch_split: the per-sample front run chunk by chunk) is planned the same way,
      and the faster of the two plans is kept
    each pass's result is judged by the memory model; both plans are simulated.

One deadline (memsched.deadline) bounds the whole call: every pass gets a fixed share of
the time limit as its effort (so the same input gives the same plan), and the deadline only
cuts what would run past it. Both forms of the step make their first plans before either is
improved, so a fitting plan exists early; stopping the deadline (Ctrl-C) keeps the best.

The result carries both plans and the report dict (the `compile`/`report` JSON of docs/json.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memsched import frontend
from memsched import hardware as hardware_mod
from memsched.cost import CostTable, model_pricing
from memsched.errors import BudgetError, UserError
from memsched.ir import Graph
from memsched.data_parallel import DEFAULT_BUCKET_BYTES, batch_inputs, record_options, worker_forward
from memsched.data_parallel import data_parallel as data_parallel_estimate
from memsched.deadline import Deadline
from memsched.memory import MemoryProfile, validate
from memsched.report import input_pipeline, tensor_decisions
from memsched.schedule import Plan, StepKind
from memsched.simulate import Simulation, simulate
from memsched.units import format_bytes, parse_bytes, parse_percent

from memsched.passes.rewrites.batch_split import batch_split_step, given_graph
from memsched.passes.rewrites.concat_split import reuse_variants
from memsched.passes.fit import MAX_LEVELS, Ledger, FitSearch
from memsched.passes.context import PassContext, PassRunner
from memsched.passes.reuse import FUSED_KEY, baseline_aliases

STRATEGIES = ("order", "reuse", "recompute", "swap")
PLACEMENT_FREE = ("order", "reuse")      # the strategies without a budget: no added time
DEFAULT_TIME_LIMIT = 60.0                # seconds for the whole compile
ORDER = 0.1                              # the order pass's share of the time limit without a budget
# The time the report takes after the search, per op of the step (two judgements, two
# simulations, the tables): 1.4 s for GPT-2's 10,193 ops on the 2-core development machine,
# doubled for a loaded one.
REPORT_SECONDS_PER_OP = 3e-4


@dataclass
class CompileResult:
    graph: Graph
    baseline: Plan
    baseline_profile: MemoryProfile
    baseline_sim: Simulation
    plan: Plan
    profile: MemoryProfile
    sim: Simulation
    report: dict


def parse_budget(text: str | int | None, baseline_peak: int) -> int | None:
    """'40%' -> 40% of the baseline peak; '12GiB' / '800MB' / 1048576 -> bytes; None -> None.

    Every form must give at least one byte: '0', '0%', 'inf%', 'nan%', '1e30%' are UserErrors (exit 1)."""
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise UserError(f"budget {text} must be at least 1 byte")
        return text
    text = str(text).strip()
    if text.endswith("%"):
        return max(1, int(baseline_peak * parse_percent(text, "budget")))
    return parse_bytes(text)


def parse_strategies(text: str | list[str] | tuple[str, ...] | None, budget: bool = True) -> tuple[str, ...]:
    """The strategies named in `text` (comma-separated or a sequence); None means all of them
    where a `budget` is given, else the two that need none."""
    if text is None:
        return STRATEGIES if budget else PLACEMENT_FREE
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [s.strip() for s in items if s.strip()]
    unknown = [s for s in items if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    return tuple(s for s in STRATEGIES if s in items)


def load_graph(model: "str | Path | Graph", dims: dict[str, int] | None = None, train: bool = False,
               loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
               freeze: tuple[str, ...] = (), options: dict | None = None) -> Graph:
    """The graph to plan: the model itself, or its training step (`options`: the builder's
    further optimizer options, momentum, weight_decay, betas, eps)."""
    graph = model if isinstance(model, Graph) else frontend.load(model, dims)
    if train:
        from memsched.passes.training import build_training_step

        graph = build_training_step(graph, loss=loss, optimizer=optimizer, lr=lr, freeze=tuple(freeze),
                                    **(options or {}))
    return graph


def step_builder(loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
                 freeze: tuple[str, ...] = (), options: dict | None = None) -> Callable[[Graph], Graph]:
    """forward graph -> its training step, built with these options (the given step and every
    rewritten one are built alike)."""
    return lambda forward: load_graph(forward, None, True, loss, optimizer, lr, freeze, options)


def training_steps(forward: Graph, loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
                   freeze: tuple[str, ...] = (), variants: bool = True,
                   options: dict | None = None) -> tuple[Graph, dict[str, Graph]]:
    """The training step of `forward` as given, and (with `variants`) the rewritten steps the
    reuse pass may pick instead (`passes.rewrites.concat_split`), all built with the same options."""
    build = step_builder(loss, optimizer, lr, freeze, options)
    given = build(forward)
    return given, reuse_variants(forward, given, build) if variants else {}


def compile(model: "str | Path | Graph", *, dims: dict[str, int] | None = None, train: bool = False,
            loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
            freeze: tuple[str, ...] = (), training_options: dict | None = None,
            hardware: "str | hardware_mod.Hardware" = hardware_mod.PLANNING_PROFILE,
            budget: str | int | None = None, strategies=None, time_limit: float = DEFAULT_TIME_LIMIT,
            costs: "CostTable | str | Path | None" = None, data_parallel: int | None = None,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES, progress: Callable[[str], None] | None = None,
            deadline: Deadline | None = None, reserve: Callable[[Graph], float] | None = None) -> CompileResult:
    """Plan `model`'s memory within `time_limit` seconds in all (or by `deadline`, which a
    caller may stop early: the best plan found by then is returned). `strategies` None means
    every strategy where a budget is given (recompute and swap run only while the plan is
    over it), order and reuse otherwise. `training_options`: the training-step builder's
    further options (momentum, weight_decay, betas, eps). Raises UserError on bad input,
    BudgetError if the budget cannot be met.

    `data_parallel` N: the step as each of N workers runs it (memsched.data_parallel): with
    `train`, the model's batch is the global one and each worker's step takes 1/N of it (a
    training step given as such is one worker's); no update is fused into its dW op, and the
    updates run after the backward (as DDP's optimizer step does), so every gradient is kept
    until its bucket (`bucket_bytes`) is all-reduced and its update read it.

    The search ends early enough for the report (REPORT_SECONDS_PER_OP) and for `reserve(step)`
    seconds more: what the caller does with the plan before the command ends (writing it)."""
    say = progress or (lambda message: None)
    deadline = deadline or Deadline(time_limit)
    strategies = parse_strategies(strategies, budget is not None)
    hw = hardware_mod.load(hardware)
    say("loading the model" + (" and building the training step" if train else ""))
    forward = load_graph(model, dims)
    if data_parallel is not None and data_parallel < 1:
        raise UserError(f"--data-parallel needs at least 1 worker, not {data_parallel}")
    if data_parallel and train:
        forward = worker_forward(forward, data_parallel)
    graph, variants = training_steps(forward, loss, optimizer, lr, freeze, variants="reuse" in strategies,
                                     options=training_options) \
        if train else (given_graph(forward), {})

    initial = Plan.initial(graph, hardware=hw)
    baseline = framework_baseline(initial)
    budget_bytes = parse_budget(budget, validate(baseline).peak_bytes)
    costs = CostTable.load(costs) if isinstance(costs, (str, Path)) else costs
    runner = PassRunner(PassContext(costs, deadline, bool(data_parallel)))
    ledger = Ledger(time_limit)

    def search(step: Plan, variants: dict[str, Graph], label: str) -> FitSearch:
        return _search(step, runner.with_variants(variants), budget_bytes, strategies, time_limit, ledger, say,
                       label)

    with deadline.reserving(REPORT_SECONDS_PER_OP * len(graph.ops) + (reserve(graph) if reserve else 0.0)):
        searches, split = {"given": search(initial, variants, "")}, None
        if budget_bytes is not None:
            given = searches["given"]
            needs_more = given.best is None or (not deadline.cuts() and not ledger.closed and given.adds_time())
            if train and {"recompute", "swap"} & set(strategies) and not deadline.stopped and needs_more:
                split = batch_split_step(forward, graph, step_builder(loss, optimizer, lr, freeze, training_options),
                                         budget_bytes)
            if split is not None:      # the first plan adds time (or none fits): try micro-batches too
                searches["split"] = search(Plan.initial(split[0], hardware=hw), {}, f"{split[1]} micro-batches: ")
            after_first_plans(searches, ledger, deadline)
    try:
        plan = _faster(searches, split[1] if split is not None else None, strategies, hw, costs)
    except BudgetError:
        if deadline.stopped:
            raise KeyboardInterrupt from None     # stopped before any plan fit: nothing to keep
        raise
    if deadline.stopped:
        plan = dataclasses.replace(plan, notes={**plan.notes, "interrupted": True})
    if data_parallel:
        record_options(plan.graph, data_parallel, bucket_bytes, batch_inputs(forward, plan.graph))
    say("simulating the baseline and the plan")
    result = assess(plan, baseline, strategies, runner.timings, model, costs, data_parallel)
    result.report["solver"].update(
        deadline_hit=deadline.cut, interrupted=deadline.stopped,
        first_fit_s=min((h["seconds"] for f in searches.values() for h in f.history), default=None),
        wall_s=round(deadline.elapsed(), 3))
    result.report["time_limit_s"] = time_limit
    return result


def _search(step: Plan, runner: PassRunner, budget_bytes: int | None, strategies, time_limit: float,
            ledger: Ledger, say: Callable[[str], None], label: str) -> FitSearch:
    """The fit search of `step` after reuse and order, its first plans made. The order pass
    gets ORDER of the time limit without a budget (its peak is the plan's), the ledger's
    fixed effort with one (so that a longer limit starts the search from the same order)."""
    start, peak = dataclasses.replace(step, budget=None), validate(step).peak_bytes
    effort = ORDER * time_limit if budget_bytes is None else ledger.order
    for name in ("reuse", "order"):
        if name in strategies:
            say(f"{label}{name} ({len(start.schedule)} steps)")
            if name == "order" and budget_bytes is not None:
                ledger.charge(effort)
            start, peak = runner.apply(name, start, effort)
    found = FitSearch(start, peak, budget_bytes, strategies, runner, time_limit, say, label, ledger)
    found.first_plans()
    return found


def after_first_plans(searches: dict[str, FitSearch], ledger: Ledger, deadline: Deadline) -> None:
    """The phases after every search's first plans: the joint climbs, the search with the
    fastest plan first (the ledger may afford no other), the improvement levels, the rescue."""
    for name in sorted(searches, key=lambda n: (_best_time(searches[n]), n)):
        searches[name].joint_climb()
    improvement_levels(searches, ledger, deadline)
    for found in searches.values():
        found.rescue()


def improvement_levels(searches: dict[str, FitSearch], ledger: Ledger, deadline: Deadline) -> None:
    """The improvement levels over every search of the command, fastest first, while the
    ledger affords them: level k re-plans each search's fastest candidates at `Ledger.level(k)`
    seconds a pass; after level 1, the searches explore drained orders."""
    for level in range(1, MAX_LEVELS + 1):
        ranked = [searches[n] for n in sorted(searches, key=lambda n: (_best_time(searches[n]), n))]
        if ledger.closed or deadline.cuts() or not any(found.improvable() for found in ranked):
            return
        for found in ranked:
            if found.improvable():
                found.improve(ledger.level(level))
        for found in ranked if level == 1 else ():
            found.explore()


def _best_time(search: FitSearch) -> float:
    return search.best.step_time if search.best is not None else float("inf")


def _faster(searches: dict[str, FitSearch], chunks: int | None, strategies, hw, costs) -> Plan:
    """The faster of the plan of the step as given and the plan of its micro-batched step (the
    simulator's step time), with what both gave in its notes ("batch_split"); where neither
    fit, the error that reached the smaller peak."""
    plans, errors = {}, {}
    for name, found in searches.items():
        try:
            plans[name] = found.result(strategies)
        except BudgetError as err:
            errors[name] = err
    if not plans:
        raise min(errors.values(), key=lambda e: e.smallest_feasible_bytes or float("inf"))
    if chunks is None:
        return plans["given"]
    times = {name: simulate(p, hw, costs).step_time for name, p in plans.items()}
    chosen = min(times, key=lambda name: (times[name], name != "given"))
    note = {"chunks": chunks, "chosen": chosen == "split",
            "step_time_s": {"given": times.get("given"), "split": times.get("split")},
            "errors": {name: str(e) for name, e in errors.items()}}
    plan = plans[chosen]
    return dataclasses.replace(plan, notes={**plan.notes, "batch_split": note})


BASELINE_ASSUMES = ("the step as memsched builds it (cheap values derived again in the backward), in its own order; "
                    "gradients alive until their update; updates in place, as torch.optim's")


def framework_baseline(initial: Plan) -> Plan:
    """The baseline a plan is judged against, as PyTorch eager runs a step: `initial` (the
    graph's own order, nothing reused) with each optimizer update written in place over its
    parameter and state (`passes.reuse.baseline_aliases`). The searches start from `initial`."""
    return dataclasses.replace(initial, aliases=baseline_aliases(initial.graph))


def baseline_of(plan: Plan) -> Plan:
    """The baseline `plan` is judged against: its graph as given (fused updates and concat
    splits undone) as `framework_baseline` runs it, on the plan's hardware."""
    return framework_baseline(Plan.initial(given_graph(plan.graph), hardware=plan.hardware))


def assess(plan: Plan, baseline: Plan, strategies, timings: dict[str, float], model,
           costs: "CostTable | str | Path | None" = None, data_parallel: int | None = None) -> CompileResult:
    """Judge and simulate a finished plan against its baseline; build the report (compile, report)."""
    hw = plan.hardware
    costs = CostTable.load(costs) if isinstance(costs, (str, Path)) else costs
    baseline_profile = validate(dataclasses.replace(baseline, budget=None))
    profile = validate(plan)
    baseline_sim = simulate(baseline, hw, costs)
    sim = simulate(plan, hw, costs)
    graph = baseline.graph     # the model as given (the plan's may have fused updates, split convs)
    report = build_report(graph, hw, plan.budget, strategies, baseline_profile, baseline_sim, plan, profile,
                          sim, timings, model)
    report["costs"] = costs.pricing(plan.graph) if costs is not None else model_pricing(plan.graph, hw)
    report["tensors"] = tensor_decisions(plan)
    report["input_pipeline"] = input_pipeline(graph, hw, sim.step_time, sim.stream_busy.get("h2d", 0.0))
    if data_parallel:
        if FUSED_KEY in plan.graph.metadata:
            raise UserError("the plan fuses optimizer updates into the ops that make their gradients, so those "
                            "gradients are never made to be all-reduced; compile it with --data-parallel to "
                            "keep them")
        report["data_parallel"] = data_parallel_estimate(plan, sim, data_parallel).to_dict()
    return CompileResult(graph, baseline, baseline_profile, baseline_sim, plan, profile, sim, report)


def strategies_of(plan: Plan) -> tuple[str, ...]:
    """The strategies a plan was made with, from the notes its passes left."""
    return tuple(s for s in STRATEGIES if s in plan.notes)


# ---- the report ----------------------------------------------------------------------------
def build_report(graph: Graph, hw, budget_bytes: int | None, strategies, baseline_profile: MemoryProfile,
                 baseline_sim: Simulation, plan: Plan, profile: MemoryProfile, sim: Simulation,
                 timings: dict[str, float], model) -> dict:
    """The `compile` JSON of docs/json.md, plus what each pass did."""
    notes = plan.notes
    recomputed = sorted({s.target for s in plan.schedule if s.kind == StepKind.RECOMPUTE})
    overhead = sim.step_time / baseline_sim.step_time - 1 if baseline_sim.step_time else 0.0
    solver = _solver_summary(notes, timings)
    report = {
        "model": str(model) if not isinstance(model, Graph) else model.name,
        "graph": {"ops": len(graph.ops), "tensors": len(graph.tensors),
                  "parameter_bytes": sum(t.nbytes for t in graph.parameters()),
                  "training": any(op.phase != "forward" for op in graph.ops)},
        "hardware": hw.name,
        "device_memory_bytes": hw.device_memory,
        "budget_bytes": budget_bytes,
        "strategies": list(strategies),
        "baseline": {"peak_bytes": baseline_profile.peak_bytes, "step_time_s": baseline_sim.step_time,
                     "peak_step": baseline_profile.peak_step, "assumes": BASELINE_ASSUMES},
        "plan": {"peak_bytes": profile.peak_bytes, "arena_bytes": notes.get("placement", {}).get("arena_bytes"),
                 "step_time_s": sim.step_time, "overhead": overhead, "stall_s": sim.stall,
                 "recomputed_ops": recomputed, "swapped_bytes": {tier: t["out"] for tier, t in sim.traffic.items()},
                 "host_peak_bytes": sim.host_peak, "steps": len(plan.schedule), "aliases": len(plan.aliases),
                 "micro_batches": notes["batch_split"]["chunks"] if notes.get("batch_split", {}).get("chosen") else 1},
        "solver": solver,
        "fits_device": profile.peak_bytes <= hw.device_memory,
        "passes": {name: _jsonable(value) for name, value in notes.items()},
        "pass_seconds": {name: round(t, 3) for name, t in timings.items()},
    }
    report["verdict"] = verdict(report)
    return report


def _solver_summary(notes: dict, timings: dict[str, float]) -> dict:
    """One status for the whole plan: the weakest of the solver passes that ran."""
    rank = {"optimal": 0, "feasible": 1, "heuristic": 2}
    statuses = [notes[n]["status"] for n in ("order", "recompute", "swap") if n in notes and "status" in notes[n]]
    status = max(statuses, key=lambda s: rank.get(s, 3)) if statuses else "heuristic"
    # order's bound holds for every order of the same ops; once recompute or swap changed the
    # ops, the budget is what the plan was held to and no peak bound is claimed
    changed = any(n in notes for n in ("recompute", "swap"))
    return {"status": status, "seconds": round(sum(timings.values()), 3),
            "lower_bound_bytes": None if changed else notes.get("order", {}).get("lower_bound_bytes"),
            "by_pass": {n: notes[n].get("status") for n in ("order", "recompute", "swap", "placement")
                        if n in notes}}


def verdict(report: dict) -> str:
    """One line a person can act on: does it fit, at what cost."""
    plan, base = report["plan"], report["baseline"]
    saving = 1 - plan["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else 0.0
    cost = f"{plan['overhead'] * 100:+.1f}% step time"
    target = report["budget_bytes"] if report["budget_bytes"] is not None else report["device_memory_bytes"]
    where = f"the {format_bytes(target)} budget" if report["budget_bytes"] is not None else \
        f"{format_bytes(target)} ({report['hardware']})"
    fits = plan["peak_bytes"] <= target
    return (f"{'fits in' if fits else 'does NOT fit in'} {where} at {cost}: peak {format_bytes(base['peak_bytes'])}"
            f" -> {format_bytes(plan['peak_bytes'])} ({-saving * 100:+.1f}%)")


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)
