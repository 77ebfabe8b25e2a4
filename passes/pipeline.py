"""compile(): the whole flow of DESIGN.md in one call -- load, (train), plan, place, simulate.

    model --frontend--> Graph --autodiff (train)--> Graph
      baseline = the graph's own order, nothing reused (what frameworks do)
      plan     = reuse -> order -> fit -> placement, where fit (only while the plan is over
                 its budget) tries recompute alone, swap alone, and recompute to a relaxed
                 budget then swap the rest (the strategies asked for), and keeps the plan
                 the simulator predicts fastest
      where the plan needs recompute or swap (or nothing fits), the step in micro-batches
      (passes.batch_split: the per-sample front run chunk by chunk) is planned the same way,
      and the faster of the two plans is kept
    each pass's result is judged by the memory model; both plans are simulated.

The result carries both plans and the report dict (the `compile`/`report` JSON of DESIGN.md).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memsched import frontend
from memsched import hardware as hardware_mod
from memsched.cost import CostTable
from memsched.errors import BudgetError, UserError
from memsched.ir import Graph
from memsched.data_parallel import data_parallel as data_parallel_estimate
from memsched.memory import MemoryProfile, validate
from memsched.report import input_pipeline, tensor_decisions
from memsched.schedule import Plan
from memsched.simulate import Simulation, simulate
from memsched.units import format_bytes, parse_bytes

from .batch_split import batch_split_step, given_graph
from .concat_split import reuse_variants
from .reuse import FUSED_KEY, compute_order

STRATEGIES = ("order", "reuse", "recompute", "swap")
DEFAULT_STRATEGIES = ("order", "reuse")
# Data-parallel interconnect: 100 Gb/s InfiniBand (12.5 GB/s) with ~5 us per message.
INTERCONNECT = (12.5e9, 5e-6)
# Rounds of re-planning against a lower target when placement's fragmentation overshoots.
FIT_ROUNDS = 3
# Joint recompute + swap: recompute down to a relaxed target first (replaying what is cheap
# per byte), then swap the rest, whose transfers the link can hide. The best relaxation depends
# on the model and the link (predicted on v100-16gb: BERT-base batch 660 best at 1.5x, +12.0%,
# against +14.9% at 1.25x; ResNet-50 batch 975 best at 1.75x, +15.4%, against +17.0% at 1.5x
# and +22.3% at 2x), so fit starts from RELAXATION_START and climbs this grid towards the
# faster neighbour until the fastest point has both neighbours tried.
RELAXATION_GRID = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
RELAXATION_START = (1.5, 2.0)
# The recompute pass on its base orders and on them drained as well (passes.order.drain): the
# replays may cost the same while the swap after them gains much (3-D U-Net 264^3: +14.9%
# against +48.1%) or loses some (ResNet-50 batch 1004 at 1.75x: +30.9% against +18.6%), so
# fit climbs the relaxations once without and once with them, and the simulator chooses.
DRAINED = "recompute (drained orders too)"


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
    """'40%' -> 40% of the baseline peak; '12GiB' / '800MB' / 1048576 -> bytes; None -> None."""
    if text is None:
        return None
    if isinstance(text, int):
        return text
    text = str(text).strip()
    if text.endswith("%"):
        try:
            fraction = float(text[:-1]) / 100
        except ValueError:
            raise UserError(f"cannot read budget '{text}'; write e.g. 40% or 12GiB") from None
        if not 0 < fraction:
            raise UserError(f"budget '{text}' must be above 0%")
        return int(baseline_peak * fraction)
    return parse_bytes(text)


def parse_strategies(text: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_STRATEGIES
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [s.strip() for s in items if s.strip()]
    unknown = [s for s in items if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    return tuple(s for s in STRATEGIES if s in items)


def load_graph(model: "str | Path | Graph", dims: dict[str, int] | None = None, train: bool = False,
               loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
               freeze: tuple[str, ...] = ()) -> Graph:
    """The graph to plan: the model itself, or its training step."""
    graph = model if isinstance(model, Graph) else frontend.load(model, dims)
    if train:
        from .autodiff import build_training_step

        graph = build_training_step(graph, loss=loss, optimizer=optimizer, lr=lr, freeze=tuple(freeze))
    return graph


def step_builder(loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
                 freeze: tuple[str, ...] = ()) -> Callable[[Graph], Graph]:
    """forward graph -> its training step, built with these options (the given step and every
    rewritten one are built alike)."""
    return lambda forward: load_graph(forward, None, True, loss, optimizer, lr, freeze)


def training_steps(forward: Graph, loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
                   freeze: tuple[str, ...] = (), variants: bool = True) -> tuple[Graph, dict[str, Graph]]:
    """The training step of `forward` as given, and (with `variants`) the rewritten steps the
    reuse pass may pick instead (`passes.concat_split`), all built with the same options."""
    build = step_builder(loss, optimizer, lr, freeze)
    given = build(forward)
    return given, reuse_variants(forward, given, build) if variants else {}


def compile(model: "str | Path | Graph", *, dims: dict[str, int] | None = None, train: bool = False,
            loss: str = "cross_entropy", optimizer: str = "sgd", lr: float = 0.01,
            freeze: tuple[str, ...] = (), hardware: "str | hardware_mod.Hardware" = "v100-16gb",
            budget: str | int | None = None, strategies=DEFAULT_STRATEGIES, time_limit: float = 30.0,
            costs: "CostTable | str | Path | None" = None, data_parallel: int | None = None,
            progress: Callable[[str], None] | None = None) -> CompileResult:
    """Plan `model`'s memory. Raises UserError on bad input, BudgetError if the budget cannot be met."""
    say = progress or (lambda message: None)
    strategies = parse_strategies(strategies)
    hw = hardware_mod.load(hardware)
    say("loading the model" + (" and building the training step" if train else ""))
    forward = load_graph(model, dims)
    graph, variants = training_steps(forward, loss, optimizer, lr, freeze, variants="reuse" in strategies) \
        if train else (given_graph(forward), {})

    baseline = Plan.initial(graph, hardware=hw)
    baseline_profile = validate(baseline)
    budget_bytes = parse_budget(budget, baseline_profile.peak_bytes)
    costs = CostTable.load(costs) if isinstance(costs, (str, Path)) else costs
    timings: dict[str, float] = {}

    def run(name: str, apply, start: Plan) -> tuple[Plan, int]:
        """Apply a pass to `start`, time it, and judge the result: (plan, its peak)."""
        say(f"{name}: planning ({len(start.schedule)} steps)")
        started = time.perf_counter()
        planned = apply(start)
        judged = validate(dataclasses.replace(planned, budget=None)).peak_bytes  # every pass is judged
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - started
        return planned, judged

    def planned(step: Plan, step_variants: dict[str, Graph]) -> tuple[Plan | None, BudgetError | None]:
        passes = _passes(fuse_updates=not data_parallel, variants=step_variants)   # data parallel all-reduces every gradient
        try:
            return plan_step(dataclasses.replace(step, budget=None), validate(step).peak_bytes, budget_bytes,
                             strategies, passes, time_limit, costs, run), None
        except BudgetError as err:
            return None, err

    plan, error = planned(baseline, variants)
    split = None
    if train and budget_bytes is not None and {"recompute", "swap"} & set(strategies) and \
            (plan is None or {"recompute", "swap"} & set(plan.notes)):
        split = batch_split_step(forward, graph, step_builder(loss, optimizer, lr, freeze), budget_bytes)
    if split is not None:      # the step needs recompute or swap (or fits not at all): try micro-batches too
        say(f"planning the step in {split[1]} micro-batches too")
        other, other_error = planned(Plan.initial(split[0], hardware=hw), {})
        plan, error = _faster(plan, error, other, other_error, split[1], hw, costs)
    if plan is None:
        raise error
    say("simulating the baseline and the plan")
    return assess(plan, baseline, strategies, timings, model, costs, data_parallel)


def _faster(given: Plan | None, given_error: BudgetError | None, split: Plan | None,
            split_error: BudgetError | None, chunks: int, hw, costs) -> tuple[Plan | None, BudgetError | None]:
    """The faster of the plan of the step as given and the plan of its micro-batched step (the
    simulator's step time; None where one did not fit), with what both gave in its notes
    ("batch_split"); where neither fit, the error that reached the smaller peak."""
    if given is None and split is None:
        errors = [e for e in (given_error, split_error) if e is not None]
        return None, min(errors, key=lambda e: e.smallest_feasible_bytes or float("inf"))
    times = {name: simulate(p, hw, costs).step_time for name, p in (("given", given), ("split", split))
             if p is not None}
    chosen = min(times, key=lambda name: (times[name], name != "given"))
    note = {"chunks": chunks, "chosen": chosen == "split",
            "step_time_s": {"given": times.get("given"), "split": times.get("split")},
            "errors": {name: str(e) for name, e in (("given", given_error), ("split", split_error)) if e is not None}}
    plan = split if chosen == "split" else given
    return dataclasses.replace(plan, notes={**plan.notes, "batch_split": note}), None


def plan_step(plan: Plan, peak: int, budget_bytes: int | None, strategies, passes: dict[str, Callable],
              time_limit: float, costs, run) -> Plan:
    """`plan` (a training step or model in some order, no budget; `peak` its judged peak)
    through reuse -> order -> fit -> placement: the fastest placed plan that holds
    `budget_bytes`, with its budget set. `run(name, apply, start)` applies and judges a pass.
    Raises BudgetError when none holds it."""
    for name in ("reuse", "order"):
        if name in strategies:
            plan, peak = run(name, lambda p, f=passes[name]: f(p, time_limit), plan)
    zero_overhead, zero_overhead_peak, target = plan, peak, budget_bytes

    def place_fastest(ranked, tried) -> tuple[tuple | None, int | None]:
        """Place the candidates, fastest first, until one's arena holds the budget. Returns
        ((placed plan, its step time, its record in tried), the fastest candidate's overshoot
        or None), or (None, that overshoot) when none holds it."""
        overshoot = None
        for candidate, _, record, step_time in ranked:
            placed, _ = run("placement", lambda p: passes["placement"](dataclasses.replace(p, budget=budget_bytes),
                                                                      min(time_limit, 10.0)), candidate)
            arena = placed.notes["placement"]["arena_bytes"]
            if record is not None:
                tried[record]["arena_bytes"] = arena
            if budget_bytes is None or arena <= budget_bytes:
                return (placed, step_time, record), overshoot
            overshoot = arena - budget_bytes if overshoot is None else overshoot
        return None, overshoot

    # Each round: fit the target, then place the fastest candidate whose arena holds the budget.
    # Where a faster one's arena overshot, fit again against a target lowered by its overshoot,
    # re-planning only the candidates that were faster than the placed one (a slower one cannot
    # win); where nothing fits a lowered target, the next round tries halfway back to the target
    # whose plans overshot. The fastest placed plan of all rounds wins.
    best = None      # (step time, placed plan, its round, its record in that round's tried)
    only = None      # the candidates a round re-plans (None: all)
    rounds = []      # per round: its target and what it tried, for the notes
    overshot_at = None       # the last target whose plans fit but whose fastest arena overshot
    smallest_arena = None    # the smallest arena over the budget seen
    for attempt in range(1, FIT_ROUNDS + 1):
        ranked, tried = [(zero_overhead, zero_overhead_peak, None, 0.0)], []
        if target is not None and zero_overhead_peak > target:
            ranked, tried, reached = fit(zero_overhead, zero_overhead_peak, target, strategies, time_limit, run,
                                         costs, only)
            if not ranked and overshot_at is None:    # nothing fits the budget itself
                missing = [s for s in ("recompute", "swap") if s not in strategies]
                hint = f"; add {' or '.join(missing)} to --strategies to go lower" if missing else ""
                raise BudgetError(f"the budget of {format_bytes(budget_bytes)} ({budget_bytes:,} B) cannot be met "
                                  f"with {','.join(strategies) or 'no strategies'}: the smallest peak reached is "
                                  f"{format_bytes(reached)} ({reached:,} B){hint}", reached)
            if not ranked:       # a lowered target too low to fit: halfway back next
                rounds.append({"round": attempt, "target_bytes": target, "tried": tried})
                target = (target + overshot_at) // 2
                continue
        placed, overshoot = place_fastest(ranked, tried)
        rounds.append({"round": attempt, "target_bytes": target, "tried": tried})
        if placed is not None and (best is None or placed[1] < best[0]):
            best = (placed[1], placed[0], attempt, placed[2])
        if overshoot is None:
            break           # the round's fastest candidate was placed (or none fit at all)
        smallest_arena = min(smallest_arena or budget_bytes + overshoot, budget_bytes + overshoot)
        overshot_at = target
        target -= overshoot
        only = None if placed is None else {t["candidate"] for t in tried if t.get("arena_bytes", 0) > budget_bytes}
    if best is None:
        raise BudgetError(f"the plan's live bytes fit the budget of {format_bytes(budget_bytes)} but its arena "
                          f"does not after {FIT_ROUNDS} rounds: the smallest arena over it is "
                          f"{format_bytes(smallest_arena)} ({smallest_arena:,} B)", smallest_arena)
    _, plan, attempt, record = best
    chosen = rounds[attempt - 1]
    if record is not None:
        chosen["tried"][record]["chosen"] = True
    others = [r for r in rounds if r is not chosen]
    plan = dataclasses.replace(plan, notes={**plan.notes, "fit": {
        "rounds": attempt, "target_bytes": chosen["target_bytes"], "tried": chosen["tried"], "other_rounds": others}})
    return dataclasses.replace(plan, budget=budget_bytes)


def fit(start: Plan, start_peak: int, target: int, strategies, time_limit: float, run, costs=None,
        only: set[str] | None = None):
    """Plans that bring `start` (over `target`) within it, with the recompute and swap
    strategies asked for. Candidates: recompute alone; swap alone (it replays too); recompute
    to relaxed targets (climb_relaxations over RELAXATION_GRID x target), then swap the rest;
    the same with the drained base orders added (DRAINED) where draining changes them.
    `only` names the candidates to plan (the relaxations in it are planned without a climb).
    Returns (ranked, tried, lowest): the candidates that fit as (plan, judged peak, index in
    tried, step time), fastest first by the simulator (timed before placement, whose offsets
    can only narrow the waits for swap-outs); what each candidate gave (step time, or the
    lowest peak it reached); and the lowest peak reached by any (for the error when none fits)."""
    passes = _passes()
    tried: list[dict] = []
    fitting: list[tuple[Plan, int, int, float]] = []   # plan, peak, its record, step time
    lowest = start_peak

    def attempt(name: str, steps) -> float | None:
        """Run the passes of `steps` in turn; record the candidate. Its step time, or None."""
        nonlocal lowest
        plan, peak = start, start_peak
        try:
            for pass_name, budget in steps:
                if peak > budget:
                    plan, peak = run(pass_name, lambda p, f=passes[pass_name], b=budget:
                                     f(dataclasses.replace(p, budget=b), time_limit), plan)
        except BudgetError as err:
            reached = err.smallest_feasible_bytes
            tried.append({"candidate": name, "fits": False, "smallest_peak_bytes": reached, "chosen": False})
            lowest = min(lowest, reached) if reached is not None else lowest
            return None
        step_time = simulate(dataclasses.replace(plan, budget=None), start.hardware, costs).step_time
        tried.append({"candidate": name, "fits": True, "peak_bytes": peak, "step_time_s": step_time,
                      "chosen": False})
        fitting.append((plan, peak, len(tried) - 1, step_time))
        lowest = min(lowest, peak)
        return step_time

    def wanted(name: str) -> bool:
        return only is None or name in only

    def relaxed_name(relax: float, drained: bool = False) -> str:
        return f"recompute to {relax:g}x{' on drained orders too' if drained else ''}, then swap"

    def relaxed(relax: float, drained: bool = False) -> float | None:
        return attempt(relaxed_name(relax, drained), [(DRAINED if drained else "recompute", int(relax * target)),
                                                      ("swap", target)])

    free = False        # recompute alone fits at no added time: nothing to swap for
    if "recompute" in strategies and wanted("recompute") and \
            attempt("recompute", [("recompute", target)]) is not None:
        free = fitting[-1][0].notes["recompute"].get("overhead", 1.0) <= 0.0
    if "swap" in strategies and not free:
        if wanted("swap"):
            attempt("swap", [("swap", target)])
        if "recompute" in strategies:
            grid = [relax for relax in RELAXATION_GRID if start_peak > int(relax * target)]
            for drained in (False, True) if drains_anything(start) else (False,):
                if only is None:
                    climb_relaxations(lambda relax, d=drained: relaxed(relax, d), grid)
                else:
                    for relax in grid:
                        if relaxed_name(relax, drained) in only:
                            relaxed(relax, drained)
    return sorted(fitting, key=lambda c: (c[3], c[2])), tried, lowest


def drains_anything(plan: Plan) -> bool:
    """Whether draining (`passes.order.drain`) changes any of the recompute pass's base
    orders of `plan`: if not, the drained candidates would plan the same steps again (a
    drained order equal to one before it is dropped from the bases)."""
    from .recompute import base_orders

    return any(name.endswith("+drain") for name in base_orders(plan, compute_order(plan.schedule), drained=True))


def climb_relaxations(step_time_at: Callable[[float], float | None], grid: list[float]) -> dict[float, float]:
    """Hill-climb the step time over the sorted `grid` of relaxations: try the points of
    RELAXATION_START there (else the largest), then the untried neighbours of the fastest
    until it has none. While none fits, step down instead (less relaxed: more recompute,
    less left to swap). `step_time_at(relax)` plans one (None: it does not fit). Returns the
    times tried (inf where none fit)."""
    times: dict[int, float] = {}

    def trial(i: int) -> None:
        found = step_time_at(grid[i])
        times[i] = float("inf") if found is None else found

    for i in [grid.index(r) for r in RELAXATION_START if r in grid] or ([len(grid) - 1] if grid else []):
        trial(i)
    while times:
        best = min(times, key=lambda i: (times[i], i))
        near = (best - 1, best + 1) if times[best] < float("inf") else (best - 1,)
        untried = [i for i in near if 0 <= i < len(grid) and i not in times]
        if not untried:
            break
        for i in untried:
            trial(i)
    return {grid[i]: t for i, t in sorted(times.items())}


def baseline_of(plan: Plan) -> Plan:
    """The baseline `plan` is judged against: its graph as given (fused updates and concat
    splits undone), in the given order, on the plan's hardware."""
    return Plan.initial(given_graph(plan.graph), hardware=plan.hardware)


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
    report["tensors"] = tensor_decisions(plan)
    report["input_pipeline"] = input_pipeline(graph, hw, sim.step_time, sim.stream_busy.get("h2d", 0.0))
    if data_parallel:
        if FUSED_KEY in plan.graph.metadata:
            raise UserError("the plan fuses optimizer updates into their weight-gradient Gemms, so those "
                            "gradients are never made to be all-reduced; compile it with --data-parallel to "
                            "keep them")
        report["data_parallel"] = data_parallel_estimate(plan, sim, data_parallel, *INTERCONNECT).to_dict()
    return CompileResult(graph, baseline, baseline_profile, baseline_sim, plan, profile, sim, report)


def strategies_of(plan: Plan) -> tuple[str, ...]:
    """The strategies a plan was made with, from the notes its passes left."""
    return tuple(s for s in STRATEGIES if s in plan.notes)


def _passes(fuse_updates: bool = True, variants: dict[str, Graph] | None = None) -> dict[str, Callable]:
    """Strategy name -> pass; imported on use so loading the pipeline stays cheap.
    `fuse_updates`: whether reuse may fuse SGD and momentum updates into their dW Gemms;
    `variants`: rewritten training steps reuse may pick instead (passes.concat_split)."""
    from .order import order_pass
    from .placement import place_pass
    from .recompute import recompute_pass
    from .reuse import reuse_pass
    from .swap import swap_pass

    return {"order": order_pass, "reuse": lambda plan, limit: reuse_pass(plan, fuse_updates, variants),
            "recompute": recompute_pass, DRAINED: lambda plan, limit: recompute_pass(plan, limit, drained=True),
            "swap": swap_pass, "placement": place_pass}


# ---- the report ----------------------------------------------------------------------------
def build_report(graph: Graph, hw, budget_bytes: int | None, strategies, baseline_profile: MemoryProfile,
                 baseline_sim: Simulation, plan: Plan, profile: MemoryProfile, sim: Simulation,
                 timings: dict[str, float], model) -> dict:
    """The DESIGN.md `compile` JSON, plus what each pass did."""
    notes = plan.notes
    recomputed = sorted({s.target for s in plan.schedule if s.kind == "recompute"})
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
                     "peak_step": baseline_profile.peak_step},
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
