"""Recompute on memsched's training plans: drop activations after the forward, replay their
producers right before the backward reads them again, at the least added compute time.

`recompute_pass(plan, time_limit)` plans on the abstract problem of `passes.recompute.dag` and lets
the memory model (`memsched.memory`) judge every answer:

- Mapping (`to_problem`): one node per op in the plan's order; cost = the op's time on the
  plan's hardware (`memsched.cost.op_time`); size = the bytes of its outputs, less those that
  overwrite a static tensor in place (an optimizer update taking its parameter's storage);
  pinned = the initializer-backed tensors, resident the whole step. An op with several
  outputs gets a zero-cost node per read output right after it, so each output dies at its
  own last reader. Graph inputs are zero-cost sources (live until their last reader, as the
  judge has them); one zero-cost sink at the end reads every graph output (held to the end
  of the step). A view that shares its source's storage (`shared_views`) has no bytes of its
  own and its readers read the source's node (and the view's shape input, which a replay of
  the view reads again): one buffer, live while either is read; when the source is
  replayed, `to_schedule` replays the view (no bytes, next to no time) before its next
  reader. Only that shape input is counted beyond the judge, while the view is read. An op
  reading a parameter that an update overwrites in place may be replayed only before that
  update (a deadline). Without in-place aliases (views aside) the abstract bytes equal the
  judge's at every step when nothing is replayed, and are never below them when something
  is (a replayed multi-output op is counted twice at its replay step).
- Solving (`solve`): training-aware starting plans (`seed_plans`: keep the outputs that are
  dear to recompute per byte, replay the rest at their first backward reader, as MONeT and
  Checkmate find for BN/ReLU outputs; and the greedy allowed DEEP_GREEDY computations per op,
  where a U-Net's encoder is best replayed twice), each seed pruned (`prune`: drop the replays
  the budget does not need -- all of a node's, or a second replay of it, whose readers then
  read the first: the greedy replays a node again where the peak it was evicting for has
  moved on; and, whatever the budget, a replay nothing reads before the next one); then `dag.plan`
  (checkpoint-all, sqrt(n), greedy, CP-SAT warm-started from the best, with room for the
  warm start's replays), then `prune` of its answer.
- Judging (`search`): the answer is mapped back (first occurrence `compute`, repeats
  `recompute`), given fresh in-place aliases if the plan had any (`passes.reuse.choose_aliases`;
  replayed views share; a replayed tensor is written over, or a replay writes over its
  input, only where that residency dies there at every run and no view shares it, and only
  where the judge accepts the lot) and analysed.
  In-place writes are what the abstract model cannot say. Unless the judged peak is within
  CLOSE_ENOUGH under the budget, the next abstract budget is the budget plus the gap just
  seen between the abstract and the judged peak (lower when the judge counted more; higher
  when it counted less: a cheaper plan may fit, or, where the abstract problem had no
  answer, one may fit all the same); bisection once an abstract budget that fits and one
  that overshoots are known; at most MAX_ROUNDS rounds within the time limit. Every round's
  answer is judged, so a BudgetError names the smallest peak the judge saw.
- Polishing (`polish`, method "auto"): the last POLISH_SHARE of the time limit improves the
  best judged plan by local search (`improve`: keep one replayed output, let the greedy
  repair the budget elsewhere, prune what moved, keep the move if cheaper) at the abstract
  budget it was found at; the result stands where the judge agrees (method `...+search`).
- Base orders (`base_orders`): the plan's own; the same with each parameter update moved
  after the parameter's other readers (so it overwrites the parameter) and after the
  backward readers of what the forward derived from that parameter (else a weight transpose
  is pinned from the forward to dX); and the graph's stored order with updates in the
  backward (`passes.reuse.training_order`), since the order pass minimises the peak without
  replays and can leave a late layer's update at the end, where no replay helps. The
  cheapest plan the judge accepts wins. With `drained`, each of these drained as well
  (`passes.order.drain`: a big tensor's readers run together as soon as they can), which a
  swap after the replays may need; compile plans with and without and keeps the faster.

Which ops may be replayed (`replay_blocker`): forward, loss and backward ops
(REPLAYABLE_PHASES: each is a pure function of the step's inputs and parameters; a backward
op that the order pass ran early, in the forward -- a BatchNorm's x - mean, a ReLU's mask --
is an activation kept for the backward like any other), deterministic ones
(`memsched.ops.draws_random`: not RandomNormal/RandomUniform(Like)/Bernoulli/Multinomial,
and no Dropout given a training_mode input -- autodiff keeps a training Dropout's random mask
for the backward, and a replay would draw a new one; the executor refuses such replays too),
and none with an output that is a graph output (held to the end of the step anyway, so a
replay frees nothing). Graph inputs are never replayed.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import time

import numpy as np

from memsched import hardware as hardware_mod
from memsched.cost import CostTable, op_time
from memsched.deadline import Deadline, Work, unlimited
from memsched.errors import BudgetError, ScheduleError, UserError
from memsched.ir import Graph, Op
from memsched.memory import analyze, validate
from memsched.ops import draws_random, is_view
from memsched.schedule import compute, order_schedule, Plan, recompute, Schedule, StepKind
from memsched.simulate import simulate
from memsched.units import format_bytes

from memsched.passes.recompute import dag
from memsched.passes.order import OrderProblem, drain
from memsched.passes.reuse import alias_table, choose_aliases, compute_order, priority_order, training_order

MAX_ROUNDS = 6
FIRST_ROUND_SHARE = 0.4     # of the time limit; later rounds split what is left
CLOSE_ENOUGH = 0.005        # stop raising the abstract budget once the judged peak is this near
SEED_SHARE = 0.3           # of a round's time for the seeds, at most
PRUNE_SHARE = 0.15          # of a round's time kept for pruning the answer
SEED_FAMILY = 33           # members of the keep-costly family (quantiles of time per byte)
SEED_CONTINUED = 3          # of them continued by the greedy
DEEP_GREEDY = (3, 4)        # computations per op the extra greedy seeds may use (dag.plan's own: 2)
EVALUATE_COST = 1e-6        # seconds per node of one judged plan (2,197 nodes: 1.6 ms), and
GREEDY_COST = 2.5e-7        # seconds per node squared of one greedy run (2,197 nodes: 1.0-1.3 s on 2 cores): the
                            # heuristics count their steps against these prices (memsched.deadline.Work),
                            # not the clock, so the same time limit plans the same on any machine
POLISH_SHARE = 0.3          # of the time limit kept for the local search on the best plan found
ANCESTRY = 4                # levels of inputs of a kept node whose replays the search prunes again
REPLAYABLE_PHASES = frozenset({"forward", "loss", "backward"})   # not updates: they write new parameters
END = ("end",)              # id of the sink that holds graph outputs to the end of the step


def recompute_pass(plan: Plan, time_limit: float = 30.0, method: str = "auto", drained: bool = False,
                   deadline: Deadline | None = None, costs: CostTable | None = None) -> Plan:
    """`plan` with recompute steps so that its judged peak is within `plan.budget`, at the least
    added compute time found within `time_limit` seconds; notes["recompute"] says how.

    Needs a budget, a hardware profile (op times) and a schedule of compute steps only (run
    it after order/reuse, before swap and placement). `method`: "auto" (all solvers and the
    seeds), or one of `dag.METHODS` alone (for benchmarks; "cpsat" keeps the seeds).
    `drained`: plan on the drained base orders too (`base_orders`). The search ends before
    the command's `deadline` too, and at once once it is stopped (Ctrl-C). `costs`: a measured
    cost table that prices the replays and the step, instead of the hardware's roofline.
    Raises BudgetError naming the smallest peak reached when no plan fits.
    """
    outer = deadline or unlimited()
    started = time.perf_counter()
    time_limit = outer.cap(max(0.0, float(time_limit)))
    if plan.budget is None:
        raise UserError("the recompute pass needs a memory budget")
    order = compute_order(plan.schedule)
    if order is None:
        raise ScheduleError("the recompute pass needs a schedule of compute steps only; run it before swap")
    hw = _hardware(plan)
    graph, budget = plan.graph, int(plan.budget)
    input_peak = analyze(graph, plan.schedule, plan.aliases, plan.on_host).peak_bytes
    if input_peak <= budget:   # nothing to replay: the same keys as below
        step_time = simulate(plan, hw, costs).step_time
        notes = {"status": "optimal", "method": dag.CHECKPOINT_ALL, "base_order": "given", "recomputed_ops": [],
                 "recomputations": 0, "added_compute_s": 0.0, "step_time_before_s": step_time,
                 "step_time_after_s": step_time, "overhead": 0.0, "budget_bytes": budget, "peak_bytes": input_peak,
                 "input_peak_bytes": input_peak, "lower_bound_added_s": 0.0, "abstract": None, "rounds": [],
                 "seconds": round(time.perf_counter() - started, 3)}
        return dataclasses.replace(plan, notes={**plan.notes, "recompute": notes})

    best, rounds, base_name, problem, base_of_best = None, [], None, None, None
    bases = base_orders(plan, order, drained)
    searched = time_limit * (1 - POLISH_SHARE if method == "auto" else 1.0)
    # every round runs remat's greedy at least once: as many bases as the work affords one
    # round each (the first always: an answer comes), the rest left out
    greedy = GREEDY_COST * len(order) ** 2
    bases = dict(list(bases.items())[:max(1, min(len(bases), int(searched / greedy)))])
    for name, base in bases.items():
        base_plan = _with_order(plan, base)
        base_problem = to_problem(base_plan, costs)
        found, base_rounds = search(base_problem, base_plan, budget, searched / len(bases), method, outer)
        rounds += [{"base_order": name, **r} for r in base_rounds]
        if found is not None and (best is None or found[0].total_cost < best[0].total_cost):
            best, base_name, problem, base_of_best = found, name, base_problem, base_plan
    if best is None:
        reached = min([r["judged_peak_bytes"] for r in rounds] + [input_peak])
        raise BudgetError(f"recompute cannot fit the budget of {format_bytes(budget)} ({budget:,} B): the smallest "
                          f"peak reached is {format_bytes(reached)} ({reached:,} B)", reached)
    if method == "auto":
        best = polish(problem, base_of_best, best, budget, Work(POLISH_SHARE * time_limit, outer))

    result, schedule, aliases, peak, _ = best
    new_plan = dataclasses.replace(plan, schedule=schedule, aliases=aliases, offsets=None)
    validate(new_plan)   # the judge has the last word (raises if anything is off)
    before, after = simulate(plan, hw, costs).step_time, simulate(new_plan, hw, costs).step_time
    replays = [step.target for step in schedule if step.kind == StepKind.RECOMPUTE]
    lower = result.lower_bound
    notes = {
        "status": result.status, "method": result.method, "base_order": base_name,
        "recomputed_ops": sorted(set(replays)), "recomputations": len(replays),
        "added_compute_s": sum(op_time(graph.op_by_name[name], graph, costs if costs is not None else hw)
                              for name in replays),
        "step_time_before_s": before, "step_time_after_s": after,
        "overhead": after / before - 1 if before else 0.0,
        "budget_bytes": budget, "peak_bytes": peak, "input_peak_bytes": input_peak,
        "lower_bound_added_s": None if lower is None else max(0.0, lower - problem.base_cost),
        "abstract": {"nodes": problem.n, "fixed": len(problem.fixed), "pinned_bytes": problem.pinned_bytes},
        "rounds": rounds, "seconds": round(time.perf_counter() - started, 3),
    }
    return dataclasses.replace(new_plan, notes={**plan.notes, "recompute": notes})


def base_orders(plan: Plan, order: list[str], drained: bool = False) -> dict[str, list[str]]:
    """Op orders to plan replays on, each new one only where it differs from those before:
    - "given": the plan's own;
    - "late-updates": the given order with each update that may overwrite its parameter moved
      after the parameter's other readers (so that it does: the order pass, blind to replays,
      may run an FC layer's update before its dX and keep the new weights as a second copy to
      the end of the step, where replays then leave the peak) and after the backward readers
      of forward ops that read the parameter (a weight transpose W^T read by dX, say): replays
      must precede the update (the deadlines of `to_problem`), so an early update pins such
      outputs from the forward to the backward;
    - "training": the graph's stored order with updates in the backward and the dW/dX rule
      (`passes.reuse.training_order`): the order pass minimises the peak *without* replays and
      may leave work where replays cannot help (a late layer's update at the end, say).
    With `drained`, also each of those drained (`passes.order.drain`, named "+drain"): the
    readers of a big tensor run together as soon as they can, so that it dies young -- what
    the swap after the replays may need, and what neither the peak with everything kept (the
    order pass's goal) nor the replays' cost (this pass's) sees, so compile's fit plans with
    and without them and lets the simulator choose."""
    graph = plan.graph
    candidates = {"given": order}
    edges = _late_update_edges(plan)
    if edges:
        try:
            candidates["late-updates"] = priority_order(graph, {name: i for i, name in enumerate(order)}, edges)
        except ScheduleError:
            pass   # the precedences close a cycle: no such order
    candidates["training"] = training_order(graph, [op.name for op in graph.ops])
    if drained:
        problem = OrderProblem.build(graph, bool(plan.aliases))
        candidates.update({f"{name}+drain": drain(problem, candidate) for name, candidate in list(candidates.items())})
    bases: dict[str, list[str]] = {}
    for name, candidate in candidates.items():
        if candidate not in bases.values():
            bases[name] = candidate
    return bases


def _late_update_edges(plan: Plan) -> list[tuple[str, str]]:
    """(reader, update) pairs: an update that may overwrite a parameter in place waits for the
    parameter's other readers (so it can: else the new value is a second copy held to the
    end of the step) and for every non-forward reader of a replayable forward op that reads
    the parameter."""
    graph = plan.graph
    table = alias_table(graph)
    edges = []
    for update in graph.ops:
        if update.phase != "update":
            continue
        for source in {s for out in update.present_outputs for s in table[out] if graph.tensors[s].is_static}:
            for op in graph.consumers.get(source, []):
                if op.phase != "update":
                    edges.append((op.name, update.name))
                if op.phase != "forward" or replay_blocker(graph, op) is not None:
                    continue
                edges.extend((reader.name, update.name) for t in op.present_outputs
                             for reader in graph.consumers.get(t, []) if reader.phase not in ("forward", "update"))
    return edges


def _with_order(plan: Plan, order: list[str]) -> Plan:
    """`plan` with its compute steps in `order` and in-place aliases chosen for it."""
    if compute_order(plan.schedule) == order:
        return plan
    schedule = order_schedule(order)
    return dataclasses.replace(plan, schedule=schedule, aliases=_aliases_for(plan, schedule))


def _aliases_for(plan: Plan, schedule: Schedule) -> dict[str, str]:
    """Fresh in-place aliases for `schedule`, where `plan` had some (reuse ran), else none."""
    return choose_aliases(plan.graph, schedule, plan.aliases) if plan.aliases else {}


def _judged(plan: Plan, schedule: Schedule):
    """(aliases, judged peak) of `schedule` with fresh in-place aliases where `plan` had some:
    replays written over too (a GELU's replayed erf + 1 over the replayed erf) where the
    judge accepts them, else none for replays."""
    if plan.aliases:
        aliases = choose_aliases(plan.graph, schedule, plan.aliases, replays=True)
        try:
            return aliases, analyze(plan.graph, schedule, aliases, plan.on_host).peak_bytes
        except ScheduleError:
            pass
    aliases = _aliases_for(plan, schedule)
    return aliases, analyze(plan.graph, schedule, aliases, plan.on_host).peak_bytes


# ---- which ops may be replayed ---------------------------------------------------------------
def replay_blocker(graph: Graph, op: Op) -> str | None:
    """Why `op` may not be recomputed, or None if it may (see the module docstring)."""
    if op.phase not in REPLAYABLE_PHASES:
        return f"a {op.phase} op"
    if draws_random(op):
        return "draws random numbers (a Dropout given a training_mode may draw a mask)"
    held = [t for t in op.present_outputs if t in graph.outputs]
    if held:
        return f"its output '{held[0]}' is a graph output"
    return None


# ---- the mapping -----------------------------------------------------------------------------
def to_problem(plan: Plan, costs: CostTable | None = None) -> dag.RematProblem:
    """The plan's compute schedule as a RematProblem (see the module docstring).

    Ids: op names for ops; ("input", name) for graph inputs; ("output", name) for the outputs
    of an op with several, each a zero-cost node right after its op that readers of that
    output read (so each output dies at its own last reader, as the judge has it; the op's
    node holds all its outputs only at its own step); END for the sink. An op reading a
    static tensor that an update overwrites in place (`plan.aliases`) may be replayed only
    before that update (its deadline): after it, the judge would keep the old value too.
    Op times: `costs` where given, else the plan's hardware (`memsched.cost.op_time`)."""
    graph, hw = plan.graph, _hardware(plan)
    source = costs if costs is not None else hw
    order = compute_order(plan.schedule)
    if order is None:
        raise ScheduleError("the recompute pass needs a schedule of compute steps only")
    static = {t.name for t in graph.initializers()}
    shared = shared_views(plan)
    ids, cost, size, preds, fixed = [], [], [], [], set()
    node_of: dict[str, tuple[int, ...]] = {}   # tensor -> the nodes a reader of it reads

    def add(node_id, seconds: float, nbytes: int, inputs, frozen: bool) -> int:
        if frozen:
            fixed.add(len(ids))
        ids.append(node_id)
        cost.append(seconds)
        size.append(nbytes)
        preds.append(tuple(sorted(set(inputs))))
        return len(ids) - 1

    for name in dict.fromkeys(graph.inputs):
        if name not in static:
            node_of[name] = (add(("input", name), 0.0, graph.tensors[name].nbytes, (), True),)
    for name in order:
        op = graph.op_by_name[name]
        outputs = [t for t in op.present_outputs if plan.aliases.get(t) not in static]
        frozen = replay_blocker(graph, op) is not None
        if op.present_outputs and op.present_outputs[0] in shared:   # one buffer with its source
            view = op.present_outputs[0]
            reads = tuple(v for t in op.present_inputs if t in node_of for v in node_of[t])
            add(name, op_time(op, graph, source), 0, reads, frozen)
            node_of[view] = reads   # its shape too: a replay of the view reads it again
            continue
        v = add(name, op_time(op, graph, source), sum(graph.tensors[t].nbytes for t in outputs),
                [v for t in op.present_inputs if t in node_of for v in node_of[t]], frozen)
        if len(op.present_outputs) == 1:
            node_of.update(dict.fromkeys(op.present_outputs, (v,)))
            continue
        for t in outputs:
            if graph.consumers.get(t) or t in graph.outputs:
                node_of[t] = (add(("output", t), 0.0, graph.tensors[t].nbytes, (v,), frozen),)
    add(END, 0.0, 0, [v for t in graph.outputs if t in node_of for v in node_of[t]], True)

    position = {node_id: v for v, node_id in enumerate(ids)}
    overwritten: dict[str, int] = {}   # static tensor -> abstract position of the op overwriting it
    for out, source in plan.aliases.items():
        if source in static and out in graph.producer:
            at = position[graph.producer[out].name]
            overwritten[source] = min(overwritten.get(source, at), at)
    deadline = tuple(min((overwritten[t] for t in graph.op_by_name[node_id].present_inputs if t in overwritten),
                         default=None) if isinstance(node_id, str) else None for node_id in ids)
    pinned = sum(graph.tensors[t].nbytes for t in static if t not in plan.on_host)
    return dag.RematProblem(tuple(ids), tuple(cost), tuple(size), tuple(preds), pinned, frozenset(fixed),
                              deadline if any(d is not None for d in deadline) else ())


def shared_views(plan: Plan) -> dict[str, str]:
    """View -> its source, for the views that share their source's storage in `plan` (its
    aliases): `to_problem` gives such a view no bytes of its own and lets its readers read
    the source's node, so the one buffer lives while either is read (rule 4 of the memory
    model), and `to_schedule` replays the view wherever its source was replayed."""
    graph = plan.graph
    return {out: source for out, source in plan.aliases.items()
            if is_view(graph.producer[out]) and not graph.tensors[source].is_static}


def to_schedule(ids, graph: Graph | None = None, shared: dict[str, str] | None = None) -> Schedule:
    """An abstract schedule back as steps: an op's first occurrence computes it, repeats
    recompute. With `shared` (`shared_views`), a view is made again right before a read
    when its source has been made again since the view was (its repeats in `ids` are
    dropped: the abstract readers of a shared view read its source)."""
    shared = shared or {}
    seen: set[str] = set()
    steps = []
    made: dict[str, int] = {}      # tensor -> times its producer has run so far
    made_from: dict[str, int] = {}  # shared view -> made[source] when the view was last made

    def run(name: str) -> None:
        steps.append(recompute(name) if name in seen else compute(name))
        seen.add(name)
        for t in graph.op_by_name[name].present_outputs if shared else ():
            made[t] = made.get(t, 0) + 1
            if t in shared:
                made_from[t] = made.get(shared[t], 0)

    def refresh(view: str) -> None:
        source = shared[view]
        if source in shared:
            refresh(source)
        if made_from[view] != made.get(source, 0):
            run(graph.producer[view].name)

    for v in ids:
        if not isinstance(v, str):
            continue
        if shared:
            op = graph.op_by_name[v]
            if v in seen and op.present_outputs and op.present_outputs[0] in shared:
                continue
            for t in op.present_inputs:
                if t in shared:
                    refresh(t)
        run(v)
    return steps


# ---- starting plans that know the training step ------------------------------------------------
def late_readers(problem: dag.RematProblem, graph: Graph) -> list[bool]:
    """Per node: does it run after the forward (loss, backward, update, or the end sink)?"""
    return [v == END or (isinstance(v, str) and graph.op_by_name[v].phase != "forward") for v in problem.ids]


def drop_plan(problem: dag.RematProblem, late: list[bool], keep: set[int]) -> list[list[int]]:
    """A plan that keeps the first computation of `keep` (and of fixed nodes) for all its
    readers, and replays every other node once, at its first late reader -- or earlier, where a
    replayed reader needs it: Chen et al.'s checkpoints, with the checkpoints chosen freely."""
    stage: list[int | None] = [None] * problem.n
    for v in reversed(range(problem.n)):
        if v in problem.fixed or v in keep:
            continue
        wanted = [c for c in problem.succs[v] if late[c]] + [stage[c] for c in problem.succs[v] if stage[c] is not None]
        if wanted and problem.may_replay(v, min(wanted)):
            stage[v] = min(wanted)
    return [[t] if t is not None else [] for t in stage]


def plan_cost_peak(problem: dag.RematProblem, plan: list[list[int]]) -> tuple[float, int]:
    """(added cost, abstract peak) of a plan, by remat's judge."""
    _, peak, total, _ = dag.evaluate(problem, [problem.ids[v] for v in dag.schedule_from_plan(problem, plan)])
    return total - problem.base_cost, peak


def prune(problem: dag.RematProblem, plan: list[list[int]], budget: int, work: Work,
          nodes=None, first: bool = False) -> list[list[int]]:
    """Drop replays that the budget does not need, the dearest per byte first: every replay of
    a node at once, then later single replays of a node replayed more than once (their readers
    read the replay before, kept alive longer). First, replays that nothing reads before the
    node's next replay go whatever the budget (they only cost time). `nodes`: only these
    nodes' replays (default: all). `first`: the first of several replays may go too, its
    readers then reading the node's computation before (the local search's pruning: plans
    that fill the budget at more steps are cheaper, but leave less room to a swap pass run
    after a relaxed recompute). Each trial is charged to `work`; it stops when that is spent."""
    plan = _without_unread_replays(problem, plan)
    dearest = sorted((v for v in (range(problem.n) if nodes is None else nodes) if plan[v]),
                     key=lambda v: -problem.cost[v] / max(1, problem.size[v]))
    trial = EVALUATE_COST * problem.n
    for v in dearest:
        if not work.ok():
            return plan
        work.spend(trial)
        stages, plan[v] = plan[v], []
        if plan_cost_peak(problem, plan)[1] > budget:
            plan[v] = stages
    for v in dearest:
        for stage in list(plan[v] if first else plan[v][1:]) if len(plan[v]) > 1 else ():
            if not work.ok():
                return plan
            work.spend(trial)
            plan[v].remove(stage)
            if plan_cost_peak(problem, plan)[1] > budget:
                bisect.insort(plan[v], stage)
    return plan


def _without_unread_replays(problem: dag.RematProblem, plan: list[list[int]]) -> list[list[int]]:
    """`plan` (copied) less each replay of a node that no reader uses before the node's next
    replay (a reader computed, or replayed, at a stage from that replay's up to the next one's):
    the greedy can leave one behind when a later replay serves every reader (BERT-base's
    last-layer GELU Div was replayed, read by nothing, and replayed again). Dropping it frees
    memory at its own step and changes nothing else."""
    plan = [list(stages) for stages in plan]
    for v in range(problem.n):
        if len(plan[v]) < 2:
            continue
        kept = []
        for stage, following in zip(plan[v], plan[v][1:]):
            if any(stage <= u < following or any(stage <= t < following for t in plan[u]) for u in problem.succs[v]):
                kept.append(stage)
        plan[v] = kept + plan[v][-1:]
    return plan


def improve(problem: dag.RematProblem, plan: list[list[int]], budget: int, work: Work,
            copies: int = DEEP_GREEDY[0]) -> list[list[int]]:
    """A cheaper plan within `budget` near a fitting `plan`, by local search (ruin and
    recreate): keep one replayed node's output instead (its replays dropped), let the greedy,
    continued from there, replay others until the budget holds, prune the replays that moved
    (and those of the kept node's inputs), and take the result if it costs less. Nodes kept by
    an accepted move stay kept: else the greedy undoes the move, the freed node being again
    the cheapest per byte at the peak. Dearest replays first, pass after pass while one
    improves, until `work` is spent (each move charged a greedy run, its prune its trials).

    Why: the greedy chooses per byte at one peak step at a time. On BERT-base at half its
    zero-overhead peak it replays every layer's first FFN Linear (0.31 ms each) to keep the
    attention outputs (3.1 MB, 31 us to replay); keeping three of those Linears' outputs and
    replaying the attention outputs instead costs 10% less."""
    plan = [list(stages) for stages in plan]
    cost = plan_cost_peak(problem, plan)[0]
    kept: set[int] = set()
    improved = True
    while improved and work.ok():
        improved = False
        for v in sorted((v for v in range(problem.n) if plan[v]), key=lambda v: -problem.cost[v] * len(plan[v])):
            if not work.ok():
                break
            if not plan[v]:
                continue   # an earlier move this pass dropped its replays
            start = [list(stages) for stages in plan]
            start[v] = []
            barred = dataclasses.replace(problem, fixed=problem.fixed | kept | {v})
            work.spend(GREEDY_COST * problem.n ** 2)   # the run's price; a copy of what is left bounds it
            found = dag.solve_greedy(barred, budget, copies, start=start, work=Work(work.left, work.deadline))
            if not found.fits:
                continue
            grown = dag.plan_from_schedule(problem, found.schedule)
            moved = {u for u in range(problem.n) if grown[u] != plan[u]} | _ancestors(problem, v, ANCESTRY)
            trial = prune(problem, grown, budget, work, moved, first=True)
            added, peak = plan_cost_peak(problem, trial)
            if peak <= budget and added < cost * (1 - 1e-9):
                plan, cost, improved = trial, added, True
                kept.add(v)
    return plan


def _ancestors(problem: dag.RematProblem, v: int, depth: int) -> set[int]:
    """The inputs of node v, their inputs, ... up to `depth` levels."""
    seen, frontier = set(), {v}
    for _ in range(depth):
        frontier = {u for w in frontier for u in problem.preds[w]} - seen
        seen |= frontier
    return seen


def seed_plans(problem: dag.RematProblem, late: list[bool], budget: int, work: Work,
               family: int = SEED_FAMILY, continued: int = SEED_CONTINUED) -> dict[str, list[list[int]]]:
    """Starting plans for `dag.plan` at `budget`, from a family of `drop_plan`s.

    Member q keeps the nodes that cost the most time per byte (above the q-quantile of the
    ratio; MONeT's and Checkmate's cheap-to-recompute activations, BN and ReLU outputs, go
    first). "keep-costly": the cheapest member that fits, its needless replays pruned.
    "keep-costly+greedy": remat's greedy continued from the `continued` lowest-peak members
    among those that do not fit and are cheaper than any that does, pruned if it then fits;
    the best of them. Without a fitting plan, the lowest-peak ones are returned all the same
    (the repair and CP-SAT start from them): the greedy's, else the lowest-peak member's.
    """
    n = problem.n
    droppable = [v for v in range(n) if v not in problem.fixed and problem.size[v] > 0]
    if not droppable:
        return {}
    ratio = [problem.cost[v] / max(1, problem.size[v]) for v in range(n)]
    levels = sorted({ratio[v] for v in droppable})
    members = []
    for q in np.linspace(0.0, 1.0, family):
        cut = levels[min(len(levels) - 1, int(q * (len(levels) - 1)))]
        plan = drop_plan(problem, late, {v for v in range(n) if problem.size[v] == 0 or ratio[v] > cut})
        members.append((*plan_cost_peak(problem, plan), plan))
    members.sort(key=lambda m: (m[0], m[1]))
    fitting = [m for m in members if m[1] <= budget]
    seeds = {}
    if fitting:
        seeds["keep-costly"] = prune(problem, fitting[0][2], budget, work)
    cheaper = sorted((m for m in members if m[1] > budget and (not fitting or m[0] < fitting[0][0])),
                     key=lambda m: m[1])
    best = None
    for _, _, start in cheaper[:continued]:
        found = dag.solve_greedy(problem, budget, 2, start=start, work=Work(work.left, work.deadline))
        plan = dag.plan_from_schedule(problem, found.schedule)
        if found.fits:
            plan = prune(problem, plan, budget, work)
        cost, peak = plan_cost_peak(problem, plan)
        if best is None or (peak <= budget, -cost, -peak) > (best[1] <= budget, -best[0], -best[1]):
            best = (cost, peak, plan)
    if best is not None:
        seeds["keep-costly+greedy"] = best[2]
    elif not fitting:   # no greedy afforded (a large graph): the lowest-peak member, for the repair to start from
        seeds["keep-costly"] = min(members, key=lambda m: (m[1], m[0]))[2]
    return seeds


# ---- the search over abstract budgets ----------------------------------------------------------
def solve(problem: dag.RematProblem, late: list[bool], budget: int, seconds: float,
          method: str = "auto", outer: Deadline | None = None) -> dag.Result:
    """One abstract solve at `budget` with `seconds` of work (memsched.deadline.Work): the
    training-aware seeds (auto and cpsat only; pruned before CP-SAT, which may spend all its
    time and find nothing on a large graph; the optional greedy ones as many as `greedy_runs`
    affords), `dag.plan` (baselines, then CP-SAT from the best) in what the seeds left, then
    `prune` of the answer (its status drops to feasible/heuristic if that made it cheaper)."""
    started = time.perf_counter()
    work = Work((1 - PRUNE_SHARE) * seconds, outer)
    runs = greedy_runs(problem, seconds)
    deep = DEEP_GREEDY[:runs] if method == "auto" else ()
    seeds = seed_plans(problem, late, budget, Work(SEED_SHARE * seconds, outer),
                       continued=min(SEED_CONTINUED, runs - len(deep))) if method in ("auto", dag.CPSAT) else {}
    work.spend(min(SEED_SHARE * seconds, GREEDY_COST * problem.n ** 2 * (runs - len(deep))))
    if method == "auto":
        for copies in deep:
            work.spend(GREEDY_COST * problem.n ** 2)
            found = dag.solve_greedy(problem, budget, copies, name=f"greedy-{copies}",
                                       work=Work(work.left, work.deadline))
            plan = dag.plan_from_schedule(problem, found.schedule)
            pruned = prune(problem, plan, budget, work) if found.fits else plan
            seeds[found.method if pruned == plan else f"{found.method}+prune"] = pruned
    result = dag.plan(problem, budget, max(0.05, work.left), method, seeds=seeds,
                        work=Work(work.left, outer))
    if result.status == "optimal":
        return result
    plan = prune(problem, dag.plan_from_schedule(problem, result.schedule), budget,
                 Work(PRUNE_SHARE * seconds, outer))
    return _cheaper(problem, result, plan, "prune", started) or result


def greedy_runs(problem: dag.RematProblem, seconds: float) -> int:
    """How many optional greedy runs (deep seeds, continued seeds) `seconds` afford on `problem`."""
    return int(seconds / (GREEDY_COST * max(1, problem.n) ** 2))


def _cheaper(problem: dag.RematProblem, result: dag.Result, plan: list[list[int]], how: str,
             started: float) -> dag.Result | None:
    """`result` remade from `plan`, `how` (prune, search) added to its method, where `plan`
    costs less; else None. Its status drops to feasible (CP-SAT's bound still holds) or
    heuristic."""
    added, peak = plan_cost_peak(problem, plan)
    total = problem.base_cost + added
    if total >= result.total_cost:
        return None
    schedule = tuple(problem.ids[v] for v in dag.schedule_from_plan(problem, plan))
    status = "feasible" if result.lower_bound is not None else "heuristic"
    return dataclasses.replace(result, method=f"{result.method}+{how}", schedule=schedule, peak_bytes=peak,
                               total_cost=total, overhead=total / problem.base_cost - 1 if problem.base_cost else 0.0,
                               status=status, seconds=time.perf_counter() - started)


def search(problem: dag.RematProblem, plan: Plan, budget: int, seconds: float, method: str = "auto",
           outer: Deadline | None = None):
    """Solve the abstract problem at abstract budgets steered by the judge (module docstring),
    with `seconds` of work shared by the rounds: FIRST_ROUND_SHARE to the first, then each
    an equal share of the rest (all of it to a retry), a count, not the clock.

    Returns (best, rounds): best = (remat Result, schedule, aliases, judged peak, abstract
    budget it was found at) of the cheapest plan within `budget` by the judge, or None;
    rounds = what each round did."""
    graph = plan.graph
    late = late_readers(problem, graph)
    shared = shared_views(plan)
    target = budget
    fits_at, over_at = None, None     # highest abstract budget whose plan fit, lowest whose plan overshot
    best, rounds = None, []
    left = seconds
    for r in range(MAX_ROUNDS):
        now = time.perf_counter()
        if r and (left < GREEDY_COST * problem.n ** 2 or outer is not None and outer.cuts()):
            break   # a round runs remat's greedy at least once: no work left for one
        retry = any(target == record["abstract_budget_bytes"] for record in rounds)
        share = left if retry else left * FIRST_ROUND_SHARE if r == 0 else left / (MAX_ROUNDS - r)
        left -= share
        record = {"abstract_budget_bytes": target, "work_s": round(share, 3)}
        rounds.append(record)
        try:
            result = solve(problem, late, target, max(0.05, share), method, outer)
        except dag.BudgetInfeasible as exc:   # judge the closest all the same: the judge may differ
            result = exc.closest
            record["abstract"] = "infeasible"
        schedule = to_schedule(result.schedule, graph, shared)
        aliases, peak = _judged(plan, schedule)
        fits = peak <= budget
        record.update(fits=fits, judged_peak_bytes=peak, abstract_peak_bytes=result.peak_bytes,
                      method=result.method, status=result.status, added_cost_s=result.total_cost - problem.base_cost,
                      seconds=round(time.perf_counter() - now, 3))
        reached = max(target, result.peak_bytes)   # above the target where the abstract had no answer
        if fits:
            if best is None or result.total_cost < best[0].total_cost:
                best = (result, schedule, aliases, peak, target)
            fits_at = reached if fits_at is None else max(fits_at, reached)
            if budget - peak <= CLOSE_ENOUGH * budget or result.total_cost <= problem.base_cost:
                break   # as close as it gets, or nothing left to save
        else:
            over_at = reached if over_at is None else min(over_at, reached)
        # the abstract budget that the judge would see as `budget`, if the gap holds
        proposal = budget + (result.peak_bytes - peak)
        target = _next_target(proposal, fits_at, over_at)
        tried = [record for record in rounds if record["abstract_budget_bytes"] == target]
        if target is None or tried and (len(tried) > 1 or tried[0].get("abstract") != "infeasible"):
            break       # the two sides have met, or nothing new to try (an abstract budget with no
                        # answer is tried once more, with all the time left: the solver may have timed out)
    return best, rounds


def polish(problem: dag.RematProblem, plan: Plan, best: tuple, budget: int, work: Work) -> tuple:
    """`best` (as `search` returns it, on `plan`'s order) improved by `improve` at the abstract
    budget it was found at, with `work`, where the judge agrees that it fits; else `best`."""
    result, _, _, _, target = best
    started = time.perf_counter()
    if result.status == "optimal" or result.total_cost <= problem.base_cost or not work.ok():
        return best   # nothing cheaper at that abstract budget, or no time
    start = dag.plan_from_schedule(problem, result.schedule)
    better = _cheaper(problem, result, improve(problem, start, target, work), "search", started) \
        if start is not None else None
    if better is None:
        return best
    schedule = to_schedule(better.schedule, plan.graph, shared_views(plan))
    aliases, peak = _judged(plan, schedule)
    return best if peak > budget else (better, schedule, aliases, peak, target)


def _next_target(proposal: int, fits_at: int | None, over_at: int | None) -> int | None:
    """The proposal if it lies strictly between what fit and what overshot, else their middle;
    None when the two have met."""
    lo = fits_at if fits_at is not None else -math.inf
    hi = over_at if over_at is not None else math.inf
    if hi - lo <= 1:
        return None
    if lo < proposal < hi:
        return int(proposal)
    if math.isinf(lo) or math.isinf(hi):
        return None
    return int((lo + hi) // 2)


def _hardware(plan: Plan):
    if plan.hardware is None:
        raise UserError("the recompute pass needs a hardware profile to price the replays")
    return hardware_mod.load(plan.hardware)
