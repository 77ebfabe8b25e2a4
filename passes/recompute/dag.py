"""Rematerialisation under a memory budget: drop activations, replay their producers later.

Works on an abstract DAG (a `RematProblem`): every node has a `cost` (time) and a `size`
(bytes of its single output); edges are data dependencies; an initial topological order
fixes when each node is first computed; `pinned_bytes` is always resident. Other modules map
memsched's training plans onto this; here nothing knows about ONNX.

Memory model (as Checkmate and Moccasin use it), the one judge is `evaluate`:
- A schedule is a sequence of node ids; the first occurrence computes a node, a repeated id
  is a recomputation.
- Every input of a node must have been computed at an earlier step; it is then live.
- A computation's output is live from its step until the last step that uses it as an input
  before the node is next recomputed; an output used by nobody in that stretch (a sink's, for
  one) is live only at its own step.
- During a step, the node's inputs and its output are all live.
- Peak = max over steps of the live bytes, plus `pinned_bytes`.

Search space of every solver here (a *plan*): first computations follow the initial order;
recomputations are inserted at *stages*, stage t being the recomputations placed just before
order[t] (in topological order), then order[t] itself. Any plan is a valid schedule (every
input comes earlier in the order), so solvers only trade cost against memory. A plan lets
each node be computed at most `max_computations` (C) times. "optimal" from CP-SAT means
optimal over plans (C computations per node, recomputation only for `recompute_candidates`,
costs rounded down to integers); brute force over all schedules agrees on small graphs.

This judge is for abstract DAGs only; ONNX plans keep memsched/memory.py as their judge.

Solvers: checkpoint-all (no recomputation), Chen et al.'s sqrt(n) segments, a greedy
evictor, a repair (the greedy with more computations per node allowed), a local search
(pruning, ruin and recreate), and CP-SAT in the spirit of Moccasin (Bartan et al., ICML
2023): one retention interval per computation, O(n) integer variables, a cumulative
constraint for memory; on the whole plan, or on windows of consecutive stages with the
rest of the plan fixed (a large-neighbourhood search that scales past the whole model).
`plan` runs them anytime -- feasibility first, then improvement -- and returns the
cheapest schedule that fits.
"""
from __future__ import annotations

import bisect
import itertools
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import networkx as nx
import numpy as np

from memsched.documents import read_document
from memsched.deadline import Deadline, Work
from memsched.errors import BudgetError, UserError

from memsched.passes.solver import SolveResult, run, safety_wall, solve

CHECKPOINT_ALL = "checkpoint_all"
SQRT_N = "sqrt_n"
GREEDY = "greedy"
CPSAT = "cpsat"
METHODS = (CHECKPOINT_ALL, SQRT_N, GREEDY, CPSAT)
REPAIR = "repair"               # `plan`'s feasibility phase, when no baseline fits
LOCAL_SEARCH = "local_search"   # `plan`'s improvement of the best plan so far (prune, ruin and recreate)
WINDOW = "window"               # `plan`'s improvement of the local search's plan, window by window with CP-SAT
FIT_WINDOWS = "fit_windows"     # `plan`'s last feasibility phase: windows around the peak lower it
REPAIR_ROUNDS = 6               # computations per node the repair may add beyond max_computations
LNS_SHARES = (0.1, 0.3, 0.6)    # shares of the recomputations a local-search round removes
LNS_PATIENCE = 60               # local-search rounds without a cheaper plan before it stops
LNS_SEED = 20240607
LNS_TIME_SHARE = 0.3            # share of `plan`'s time limit given to the first local search, as schedule steps
STEPS_PER_SECOND = 300_000      # schedule steps judged per second on a loaded core (a low estimate)
WHOLE_NODES = 1500              # up to this many nodes the heuristics run whole even with a caller's `Work`
                                # (ResNet-18's step, ~960 nodes); beyond, they are bounded by counted steps (BERT-base
                                # b32 at 30%: the whole repair took 34 s to find no recompute-only plan, before swap):
FLOOR_STEPS = 300_000           # steps a greedy run (the repair, a pruning) may always judge, even when the work
                                # is spent: ~50 greedy rounds on GPT-2 with 30 layers (5,369 nodes, ~5 s)
CPSAT_NODE_COST = 2e-7          # seconds per node squared to build a CP-SAT model (its covering cuts):
CPSAT_FLOOR_S = 1.0             # with a `Work`, CP-SAT runs only where that is within the work left (or this)
CPSAT_MIN_SHARE = 0.1           # share of the time limit left to CP-SAT by the clock's backstop on the heuristics,
                                # and the least CP-SAT gets (counted) where no plan fits
PRUNE_SHARE = 0.05              # share of `plan`'s time limit kept for pruning CP-SAT's answer
CPSAT_DTIME_COST = 0.1          # counted seconds per node and deterministic second of `plan`'s CP-SAT on one loaded
                                # core (alone: 8-13 s a deterministic second at 250 nodes, 7-26 s at 1,000)
CPSAT_PRESOLVE_COST = 5e-3      # counted seconds per node for presolving that model (~2.7 s at 1,000 nodes alone)
WINDOW_STAGES = 30              # stages in a window of `solve_windows`
WINDOW_REPLAYS = 1              # recomputations per node a window may place (more where the plan has them there)
WINDOW_DTIME = 1.0              # CP-SAT's deterministic seconds per window, at most
WINDOW_TERM_COST = 2e-4         # counted seconds per term (interval, literal) of a window model: building, presolve
WINDOW_DTIME_COST = 5.0         # counted seconds per deterministic second of a window's search (one loaded core)
WINDOW_SHARE = 0.4              # share of `plan`'s time limit the windows may take, counted
FIT_STAGES = 20                 # stages in a window of `solve_windows_to_fit` (its model is dearer per stage)
FIT_OFFSETS = (0.5, 0.25, 0.75, 0.0, 1.0)   # where the peak stage sits in the windows tried around it, in turn
RESERVE_SHARE = 0.15            # share of `plan`'s time limit never counted out: start-up, judging, a loaded machine


class RematInputError(UserError, ValueError):
    """A graph or argument that cannot be planned: missing file, bad JSON, a cycle, missing
    costs, a bad option (the CLI exits 1)."""


class BudgetInfeasible(BudgetError):
    """No schedule within the budget was found (the CLI exits 3).

    `smallest_budget` is the lowest peak any solver reached (a budget known to work);
    `lower_bound` is a proven floor (no schedule can peak below it); `closest` (from `plan`)
    the Result that reached `smallest_budget`.
    """

    def __init__(self, budget_bytes: int, smallest_budget: int, lower_bound: int, closest=None):
        self.budget_bytes = budget_bytes
        self.smallest_budget = smallest_budget
        self.lower_bound = lower_bound
        self.closest = closest
        super().__init__(
            f"budget {budget_bytes} bytes cannot be met; the smallest budget found is "
            f"{smallest_budget} bytes (no schedule can go below {lower_bound} bytes)", smallest_budget)


# --------------------------------------------------------------------------- problem

@dataclass(frozen=True)
class RematProblem:
    """A DAG in its initial topological order; nodes are referred to by position 0..n-1.

    `ids[i]` is the user's id of the node at position i; `preds[i]` the positions of its
    inputs (all < i). `fixed` holds positions that may be computed only once (a replay would
    be wrong, e.g. a random op, or is not wanted); `deadline` (empty, or one entry per node)
    the last stage at which a node may be recomputed, None for any (stage t: before the node
    at position t; a caller's input is overwritten there, say). Every solver and `evaluate`
    honour both. Build one with `make_problem` or `load_node_link`.
    """

    ids: tuple
    cost: tuple[float, ...]
    size: tuple[int, ...]
    preds: tuple[tuple[int, ...], ...]
    pinned_bytes: int = 0
    fixed: frozenset = frozenset()
    deadline: tuple = ()
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        succs: list[list[int]] = [[] for _ in self.ids]
        for v, inputs in enumerate(self.preds):
            for u in inputs:
                succs[u].append(v)
        object.__setattr__(self, "succs", tuple(tuple(s) for s in succs))

    @property
    def n(self) -> int:
        return len(self.ids)

    def may_replay(self, v: int, stage: int) -> bool:
        """May node v be recomputed at `stage` (before the node at position `stage`)?"""
        if v in self.fixed:
            return False
        last = self.deadline[v] if self.deadline else None
        return last is None or stage <= last

    @property
    def base_cost(self) -> float:
        """Cost of computing every node once: the floor of any schedule's cost."""
        return float(sum(self.cost))


def make_problem(graph: nx.DiGraph, order=None, pinned_bytes: int = 0,
                 cost: str = "cost", size: str = "size") -> RematProblem:
    """A RematProblem from a networkx DAG whose nodes carry `cost` and `size` attributes.

    `order` (default: networkx's topological sort) must list every node once, inputs first.
    """
    if not isinstance(graph, nx.DiGraph) or graph.is_multigraph():
        raise RematInputError("the graph must be a networkx DiGraph")
    if graph.number_of_nodes() == 0:
        raise RematInputError("the graph has no nodes: there is nothing to schedule")
    try:
        sorted_order = list(nx.topological_sort(graph)) if order is None else None   # also the cycle check
    except nx.NetworkXUnfeasible:
        cycle = " -> ".join(repr(u) for u, _ in nx.find_cycle(graph))
        raise RematInputError(f"the graph has a cycle: {cycle}") from None
    order = sorted_order if order is None else list(order)
    pos = {v: i for i, v in enumerate(order)}
    if len(pos) != len(order) or set(pos) != set(graph.nodes):
        raise RematInputError("the order must list every node of the graph exactly once")
    for u, v in graph.edges:
        if pos[u] >= pos[v]:
            raise RematInputError(f"the order is not topological: {u!r} -> {v!r} runs backwards")
    costs, sizes = [], []
    for v in order:
        attrs = graph.nodes[v]
        for key in (cost, size):
            if key not in attrs:
                raise RematInputError(f"node {v!r} has no '{key}'")
            value = attrs[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise RematInputError(f"node {v!r}: '{key}' must be a finite number >= 0, not {value!r}")
        costs.append(float(attrs[cost]))
        sizes.append(int(math.ceil(attrs[size])))
    if pinned_bytes < 0:
        raise RematInputError("pinned_bytes must be >= 0")
    preds = tuple(tuple(sorted(pos[u] for u in graph.predecessors(v))) for v in order)
    return RematProblem(tuple(order), tuple(costs), tuple(sizes), preds, int(pinned_bytes))


def load_node_link(path, pinned_bytes: int = 0) -> RematProblem:
    """A Checkmate / Moccasin graph: networkx node-link JSON, nodes with `cost_cpu` (time) and
    `cost_ram` (bytes of the output), or the attributes Moccasin's files name in their graph
    data (`node_duration_tag`, `node_output_cost_tag`: its `duration` and `out_cost`); edges
    under "links" or "edges". The order is `graph["order"]` when the file gives one, else a
    topological sort.
    """
    path = Path(path)
    data = read_document(path, "node-link graph", RematInputError)
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise RematInputError(f"{path}: not a node-link graph (no 'nodes' list)")
    edges_key = "edges" if "edges" in data else "links"
    if not isinstance(data.get(edges_key, []), list):
        raise RematInputError(f"{path}: '{edges_key}' must be a list")
    if not isinstance(data.get("graph", {}), dict) or not all(isinstance(node, dict) for node in data["nodes"]):
        raise RematInputError(f"{path}: malformed node-link graph ('graph' must be an object and each node one)")
    data = dict(data, directed=True, multigraph=False)  # edges are dependencies, whatever the file says
    data.setdefault(edges_key, [])
    keys = _node_link_keys(data, edges_key)
    try:
        graph = nx.node_link_graph(data, edges=edges_key, **keys)
    except (KeyError, TypeError, AttributeError, ValueError, nx.NetworkXError) as exc:
        raise RematInputError(f"{path}: malformed node-link graph ({type(exc).__name__}: {exc})") from None
    if graph.number_of_nodes() > len(data["nodes"]):      # networkx adds an edge's unlisted end silently
        listed = {node.get(keys.get("name", "id")) for node in data["nodes"]}
        stray = next(v for v in graph.nodes if v not in listed)
        raise RematInputError(f"{path}: an edge names node {stray!r}, which the 'nodes' list does not hold")
    order = graph.graph.get("order")
    if order is not None and not isinstance(order, list):
        raise RematInputError(f"{path}: the graph's 'order' must be a list of its nodes, not {order!r}")
    cost, size = (graph.graph.get(tag, default) for tag, default in
                  (("node_duration_tag", "cost_cpu"), ("node_output_cost_tag", "cost_ram")))
    if not isinstance(cost, str) or not isinstance(size, str):
        raise RematInputError(f"{path}: the graph's attribute tags must be names, not {cost!r} and {size!r}")
    try:
        return make_problem(graph, order, pinned_bytes, cost=cost, size=size)
    except RematInputError as exc:
        raise RematInputError(f"{path}: {exc}") from None


def _node_link_keys(data: dict, edges_key: str) -> dict:
    """networkx's node-link keys: "id", "source" and "target", or those of Moccasin's files,
    whose nodes are named by "name" and whose edges hold their ends under "0" and "1"."""
    keys = {}
    if data["nodes"] and all("id" not in node and "name" in node for node in data["nodes"]):
        keys["name"] = "name"
    edges = data[edges_key]
    if edges and all(isinstance(e, dict) and "source" not in e and "0" in e and "1" in e for e in edges):
        keys.update(source="0", target="1")
    return keys


def to_node_link(problem: RematProblem) -> dict:
    """The problem as Checkmate-style node-link JSON data (what `load_node_link` reads)."""
    graph = nx.DiGraph(order=list(problem.ids))
    for i, v in enumerate(problem.ids):
        graph.add_node(v, cost_cpu=problem.cost[i], cost_ram=problem.size[i])
    for v, inputs in enumerate(problem.preds):
        for u in inputs:
            graph.add_edge(problem.ids[u], problem.ids[v])
    return nx.node_link_data(graph, edges="links")


def budget_from_fraction(problem: RematProblem, fraction: float) -> int:
    """F x the peak of the initial order without recomputation (Checkmate's budget convention)."""
    if not 0 < fraction <= 1:
        raise RematInputError(f"the budget fraction is a share of the graph's peak: above 0 and at most 1, "
                              f"not {fraction!r}")
    return int(fraction * checkpoint_all_peak(problem))


def checkpoint_all_peak(problem: RematProblem) -> int:
    return _liveness(problem, list(range(problem.n))).peak


def memory_lower_bound(problem: RematProblem) -> int:
    """No schedule peaks below this: every node runs with its inputs and output live."""
    per_node = (problem.size[v] + sum(problem.size[u] for u in problem.preds[v]) for v in range(problem.n))
    return problem.pinned_bytes + max(per_node, default=0)


# --------------------------------------------------------------------------- the judge

@dataclass
class _Liveness:
    """Computations ("instances") of a position-level schedule and the live bytes per step."""

    error: str | None
    node: list[int] = field(default_factory=list)     # instance -> node
    start: list[int] = field(default_factory=list)    # instance -> step computed
    end: list[int] = field(default_factory=list)      # instance -> last step live
    uses: list[list[int]] = field(default_factory=list)  # instance -> steps reading it
    memory: list[int] = field(default_factory=list)   # step -> live bytes incl. pinned
    peak: int = 0
    peak_step: int = 0


def _liveness(problem: RematProblem, seq: list[int]) -> _Liveness:
    """The memory model's body: see the module docstring. `seq` holds positions."""
    out = _Liveness(None)
    latest = [-1] * problem.n
    computed = 0   # nodes computed so far: a recomputation now is at this stage
    for k, v in enumerate(seq):
        if latest[v] < 0:
            computed += 1
        elif not problem.may_replay(v, computed):
            out.error = f"step {k}: {problem.ids[v]!r} may not be recomputed (here)"
            return out
        for u in problem.preds[v]:
            i = latest[u]
            if i < 0:
                out.error = (f"step {k}: {problem.ids[v]!r} needs {problem.ids[u]!r}, "
                             f"which is not computed before")
                return out
            out.end[i] = k
            out.uses[i].append(k)
        latest[v] = len(out.node)
        out.node.append(v)
        out.start.append(k)
        out.end.append(k)
        out.uses.append([])
    missing = [problem.ids[v] for v in range(problem.n) if latest[v] < 0]
    if missing:
        out.error = f"{len(missing)} node(s) never computed, e.g. {missing[0]!r}"
        return out
    delta = [0] * (len(seq) + 1)
    for v, a, b in zip(out.node, out.start, out.end):
        delta[a] += problem.size[v]
        delta[b + 1] -= problem.size[v]
    live = problem.pinned_bytes
    for k in range(len(seq)):
        live += delta[k]
        out.memory.append(live)
        if live > out.peak or k == 0:
            out.peak, out.peak_step = live, k
    return out


def evaluate(problem: RematProblem, schedule) -> tuple[bool, int | None, float | None, dict]:
    """Judge a schedule (node ids in run order): (valid, peak bytes, total cost, details).

    details: "error" (why it is invalid, else None), "memory" (live bytes per step, pinned
    included), "peak_step", "recomputations". Peak and cost are None when invalid.
    """
    index = {v: i for i, v in enumerate(problem.ids)}
    seq = []
    for k, v in enumerate(schedule):
        try:
            seq.append(index[v])
        except (KeyError, TypeError):
            return False, None, None, {"error": f"step {k}: unknown node {v!r}"}
    lv = _liveness(problem, seq)
    if lv.error:
        return False, None, None, {"error": lv.error}
    total = float(sum(problem.cost[v] for v in seq))
    return True, lv.peak, total, {"error": None, "memory": lv.memory, "peak_step": lv.peak_step,
                                  "recomputations": len(seq) - problem.n}


# --------------------------------------------------------------------------- plans

def schedule_from_plan(problem: RematProblem, plan: list[list[int]]) -> list[int]:
    """Positions in run order: at each stage t, the recomputations planned there (in
    topological order), then the node at position t. `plan[v]` lists v's recompute stages."""
    by_stage: list[list[int]] = [[] for _ in range(problem.n)]
    for v, stages in enumerate(plan):
        for t in stages:
            by_stage[t].append(v)
    seq = []
    for t in range(problem.n):
        seq.extend(sorted(by_stage[t]))
        seq.append(t)
    return seq


def plan_from_schedule(problem: RematProblem, schedule) -> list[list[int]] | None:
    """The plan behind a schedule, or None when the schedule is not of the plan form."""
    index = {v: i for i, v in enumerate(problem.ids)}
    plan: list[list[int]] = [[] for _ in range(problem.n)]
    pending: list[int] = []   # recomputations of the current stage t
    t = 0
    for v in schedule:
        v = index.get(v)
        if v is None or v > t:
            return None
        if v < t:
            pending.append(v)
            continue
        if any(a >= b for a, b in zip(pending, pending[1:])):
            return None   # not in topological order within the stage
        for u in pending:
            plan[u].append(t)
        pending, t = [], t + 1
    return plan if t == problem.n and not pending else None


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Result:
    """A schedule and how it was found.

    overhead = total_cost / (sum of node costs) - 1. status: "optimal" (proven, within the
    plan space), "feasible" (CP-SAT improved on the warm start; `lower_bound` is the proven
    floor on total_cost), "heuristic" (a baseline, or CP-SAT found nothing better).
    `runs` (from `plan`) holds every method's own result by name, each with `found_at`.
    """

    method: str
    schedule: tuple
    budget_bytes: int
    peak_bytes: int
    total_cost: float
    overhead: float
    status: str
    seconds: float
    lower_bound: float | None = None
    runs: dict = field(default_factory=dict, repr=False, compare=False)
    found_at: float | None = None   # (runs of `plan`) seconds from plan's start to this result

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    @property
    def recomputations(self) -> int:
        return len(self.schedule) - len(set(self.schedule))


def _result(problem: RematProblem, method: str, seq: list[int], budget: int, status: str,
            started: float, lower_bound: float | None = None) -> Result:
    """Judge `seq` with `evaluate` and wrap it; an invalid schedule here is a bug."""
    schedule = tuple(problem.ids[v] for v in seq)
    valid, peak, total, details = evaluate(problem, schedule)
    if not valid:
        raise RuntimeError(f"internal error: {method} produced an invalid schedule: {details['error']}")
    base = problem.base_cost
    overhead = total / base - 1.0 if base > 0 else 0.0
    return Result(method, schedule, budget, peak, total, overhead, status,
                  time.perf_counter() - started, lower_bound)


# --------------------------------------------------------------------------- baselines

def solve_checkpoint_all(problem: RematProblem, budget_bytes: int) -> Result:
    """The initial order, nothing recomputed: the cheapest schedule there is, if it fits."""
    started = time.perf_counter()
    seq = list(range(problem.n))
    result = _result(problem, CHECKPOINT_ALL, seq, budget_bytes, "heuristic", started)
    if result.fits:  # no recomputation at all: nothing can be cheaper
        result = replace(result, status="optimal", lower_bound=problem.base_cost)
    return result


def _sqrt_n_plan(problem: RematProblem, max_computations: int) -> list[list[int]]:
    """Chen et al. along the order: segments of ~sqrt(n) positions whose last nodes are kept.
    Any other node idle for more than a segment between two reads (for a training graph:
    between forward and backward) is dropped across its longest idle stretch, then
    recomputed -- with whatever dropped inputs it needs -- at the first stage after that
    stretch that reads it, and kept from there on."""
    n = problem.n
    plan: list[list[int]] = [[] for _ in range(n)]
    if max_computations < 2 or n == 0:
        return plan
    seg = max(1, math.ceil(math.sqrt(n)))
    keep_until: list[int | None] = [None] * n   # last stage served by the first copy; None: never dropped
    for v in range(n):
        marks = [v, *sorted(problem.succs[v])]
        if (v + 1) % seg == 0 or len(marks) < 2 or v in problem.fixed:
            continue   # a segment boundary, a sink, or a node that may not be replayed
        gap, last = max((b - a, a) for a, b in zip(marks, marks[1:]))
        if gap > seg:   # idle for longer than a segment: worth a replay
            keep_until[v] = last
    for t in range(n):
        stack = list(problem.preds[t])
        while stack:
            u = stack.pop()
            if keep_until[u] is not None and t > keep_until[u] and not plan[u] and problem.may_replay(u, t):
                plan[u].append(t)
                stack.extend(problem.preds[u])
    return plan


def solve_sqrt_n(problem: RematProblem, budget_bytes: int, max_computations: int = 2) -> Result:
    """Chen et al.'s sqrt(n) segment checkpointing, generalised to DAGs along the order."""
    started = time.perf_counter()
    seq = schedule_from_plan(problem, _sqrt_n_plan(problem, max_computations))
    return _result(problem, SQRT_N, seq, budget_bytes, "heuristic", started)


@dataclass
class _Effort:
    """Schedule steps judged so far: a measure of heuristic work that needs no clock, and
    the most a loop may take: `limit` steps, of which the first `floor` even past a command's
    `deadline` until some plan is kept (`Deadline.planned`: the first plan is owed an answer)."""

    steps: int = 0
    limit: float = math.inf
    floor: float = 0
    deadline: object = None      # a memsched.deadline.Deadline, or None

    def judge(self, problem: RematProblem, seq: list[int]) -> _Liveness:
        self.steps += len(seq)
        return _liveness(problem, seq)

    def ok(self) -> bool:
        """Whether another round may run."""
        late = self.deadline is not None and self.deadline.expired
        if self.steps < self.floor:
            stop = late and (self.deadline.stopped or self.deadline.planned)
        else:
            stop = self.steps >= self.limit or late
        if stop and late:
            self.deadline.cut = True      # the deadline, not the count, ends this work
        return not stop


def effort_of(problem: RematProblem, work: Work | None, floor: int = FLOOR_STEPS) -> _Effort:
    """An `_Effort` bounded by what `work` has left (at STEPS_PER_SECOND), or `floor` steps
    where that is more (see `_Effort` for the deadline); the floor is unbounded up to
    WHOLE_NODES nodes, and everything is without a `work`. The caller charges the steps
    back with `charge`."""
    if work is None:
        return _Effort()
    floor = floor if problem.n > WHOLE_NODES else math.inf
    return _Effort(limit=max(work.left * STEPS_PER_SECOND, floor), floor=floor, deadline=work.deadline)


def charge(work: Work | None, effort: _Effort) -> None:
    """Charge `effort`'s steps to `work` (priced at STEPS_PER_SECOND)."""
    if work is not None:
        work.spend(effort.steps / STEPS_PER_SECOND)


def _greedy_plan(problem: RematProblem, budget: int, max_computations: int,
                 start: list[list[int]] | None = None, effort: _Effort | None = None) -> list[list[int]]:
    """Evict at the peak step, cheapest time per byte first, until the budget holds.

    Each round finds the peak step k*, and for every output live but idle there, the cost of
    recomputing it at its next use (with the inputs that would otherwise be kept alive across
    k*, recursively) against the bytes that frees at k*. Starts from `start` (a plan) if
    given, else from no recomputation. Returns the lowest-peak plan seen. `effort` counts
    the steps judged and ends the rounds once its limit is reached (the first always runs).
    """
    n = problem.n
    effort = effort or _Effort()
    plan: list[list[int]] = [sorted(s) for s in start] if start is not None else [[] for _ in range(n)]
    by_stage = _by_stage(problem, plan)
    moves: list[tuple[int, list[int]]] = []     # evictions so far; the best plan is a prefix of them
    best_moves, best_peak = 0, None
    for _ in range(n * max(0, max_computations - 1) + 1):
        seq = [v for t in range(n) for v in (*by_stage[t], t)]      # schedule_from_plan's
        lv = effort.judge(problem, seq)
        if best_peak is None or lv.peak < best_peak:
            best_moves, best_peak = len(moves), lv.peak
        if lv.peak <= budget or not effort.ok():
            break
        move = _best_eviction(problem, plan, seq, lv, max_computations, by_stage)
        if move is None:
            break
        moves.append(move)
        stage, nodes = move
        for w in nodes:
            bisect.insort(plan[w], stage)
            bisect.insort(by_stage[stage], w)
    for stage, nodes in moves[best_moves:]:   # back to the lowest-peak plan seen
        for w in nodes:
            plan[w].remove(stage)
    return plan


def _by_stage(problem: RematProblem, plan: list[list[int]]) -> list[list[int]]:
    """Stage -> the nodes `plan` recomputes there, in topological order."""
    by_stage: list[list[int]] = [[] for _ in range(problem.n)]
    for v, stages in enumerate(plan):
        for s in stages:
            by_stage[s].append(v)
    for lst in by_stage:
        lst.sort()
    return by_stage


def _best_eviction(problem: RematProblem, plan, seq, lv: _Liveness, max_computations: int,
                   by_stage: list[list[int]] | None = None):
    """(stage, nodes to recompute there) with the least cost per byte freed at the peak step.
    `by_stage`: `_by_stage(problem, plan)`, where the caller keeps it."""
    n, k_peak = problem.n, lv.peak_step
    by_stage = _by_stage(problem, plan) if by_stage is None else by_stage
    sizes = [len(stage) + 1 for stage in by_stage]          # a stage's replays, then its main step
    stage_start = [0, *itertools.accumulate(sizes)]         # stage -> its first step
    stage_of = np.repeat(np.arange(n), sizes).tolist()      # step -> its stage
    instances_of: list[list[int]] = [[] for _ in range(n)]
    starts_of: list[list[int]] = [[] for _ in range(n)]
    for i, v in enumerate(lv.node):
        instances_of[v].append(i)
        starts_of[v].append(lv.start[i])

    def new_step(stage: int, w: int) -> int:
        """Where a recomputation of w at `stage` lands in the current sequence."""
        return stage_start[stage] + bisect.bisect_left(by_stage[stage], w)

    def serving(u: int, step: int) -> int:
        """The instance of u that a read just before `step` would use."""
        return instances_of[u][bisect.bisect_left(starts_of[u], step) - 1]

    best = None
    for i, v in enumerate(lv.node):
        if not (lv.start[i] < k_peak < lv.end[i]) or len(plan[v]) >= max_computations - 1:
            continue  # not live across k*, or no recomputation left
        after = bisect.bisect_right(lv.uses[i], k_peak)
        if after and lv.uses[i][after - 1] == k_peak:
            continue  # an input of the peak step itself
        stage = stage_of[lv.uses[i][after]]
        if new_step(stage, v) <= k_peak or not problem.may_replay(v, stage):
            continue  # the recomputation would land before the peak step, or may not be there
        # the cost only grows and the bytes freed only shrink as inputs join: once the cost so
        # far per byte of v exceeds the best score, v cannot win (the slack keeps float
        # rounding from pruning an exact tie)
        bound = best[0][0] * problem.size[v] * (1 + 1e-9) if best is not None else math.inf
        chosen, extra, todo, spent = {v}, 0, [v], problem.cost[v]
        while todo and spent <= bound:
            w = todo.pop()
            step = new_step(stage, w)
            for u in problem.preds[w]:
                if u in chosen:
                    continue
                j = serving(u, step)
                if lv.start[j] > k_peak or lv.end[j] >= k_peak:
                    continue  # already live at k* (or computed after it): no new bytes there
                if len(plan[u]) < max_computations - 1 and stage not in plan[u] and problem.may_replay(u, stage):
                    chosen.add(u)
                    todo.append(u)
                    spent += problem.cost[u]
                else:
                    extra += problem.size[u]
        freed = problem.size[v] - extra
        if freed <= 0 or spent > bound:
            continue
        score = (sum(problem.cost[w] for w in chosen) / freed, -freed)
        if best is None or score < best[0]:
            best = (score, stage, sorted(chosen))
    return None if best is None else (best[1], best[2])


def solve_greedy(problem: RematProblem, budget_bytes: int, max_computations: int = 2,
                 start: list[list[int]] | None = None, name: str = GREEDY, work: Work | None = None) -> Result:
    """Greedy eviction: cheapest recomputation per byte of peak freed, until the budget holds
    (or nothing more helps, or `work` -- at least FLOOR_STEPS of it -- is spent; the
    result then has the lowest peak it reached). `start`: a plan to continue from (the result
    is then called `name`)."""
    started = time.perf_counter()
    effort = effort_of(problem, work)
    seq = schedule_from_plan(problem, _greedy_plan(problem, budget_bytes, max_computations, start, effort))
    charge(work, effort)
    return _result(problem, name, seq, budget_bytes, "heuristic", started)


def _max_computations_of(plan: list[list[int]]) -> int:
    """The most computations any node has in `plan` (1 when nothing is recomputed)."""
    return 1 + max((len(stages) for stages in plan), default=0)


def _peak_of(problem: RematProblem, plan: list[list[int]], effort: _Effort | None = None) -> int:
    return (effort or _Effort()).judge(problem, schedule_from_plan(problem, plan)).peak


def _plan_cost(problem: RematProblem, plan: list[list[int]]) -> float:
    """What the recomputations of `plan` cost (on top of `problem.base_cost`)."""
    return float(sum(problem.cost[v] * len(stages) for v, stages in enumerate(plan)))


def solve_repair(problem: RematProblem, budget_bytes: int, starts: list[list[list[int]]],
                 max_computations: int = 2, rounds: int = REPAIR_ROUNDS, effort: _Effort | None = None) -> Result:
    """Feasibility first: the greedy evictor from each start plan, allowing one more
    computation per node each round, until the budget holds.

    Round r runs the greedy from every start in turn with r more computations per node than
    the start needs (at least `max_computations`), from the start itself: a greedy that
    may replay more chooses differently from its first eviction on. The work is bounded by
    counts, never by the clock (with `effort`: its limit, all runs together; the first run
    always starts), so the same input gives the same plan. Returns the first plan that fits,
    else the lowest-peak plan seen (a result that does not fit).
    """
    started = time.perf_counter()
    effort = effort or _Effort()
    best_plan, best_peak = [[] for _ in range(problem.n)], None
    for extra in range(1, rounds + 1):
        for start in starts:
            if best_peak is not None and not effort.ok():
                break
            copies = max(max_computations, _max_computations_of(start)) + extra
            current = _greedy_plan(problem, budget_bytes, copies, start, effort)
            peak = _peak_of(problem, current, effort)
            if best_peak is None or peak < best_peak:
                best_plan, best_peak = current, peak
            if peak <= budget_bytes:
                return _result(problem, REPAIR, schedule_from_plan(problem, current), budget_bytes, "heuristic",
                               started)
    return _result(problem, REPAIR, schedule_from_plan(problem, best_plan), budget_bytes, "heuristic", started)


def _prune_plan(problem: RematProblem, plan: list[list[int]], budget_bytes: int,
                effort: _Effort | None = None, only: set | None = None) -> list[list[int]]:
    """Drop each recomputation, costliest first, that the budget does without.

    One pass over the recomputations (each judged once; `only`: just these (node, stage)
    pairs), so the result depends on the plan alone, until `effort` (if bounded) is spent.
    A plan that fits still fits; its cost never grows.
    """
    current = [list(stages) for stages in plan]
    replays = sorted(((problem.cost[v], v, t) for v, stages in enumerate(plan) for t in stages
                      if only is None or (v, t) in only), key=lambda r: (-r[0], r[1], r[2]))
    for cost, v, t in replays:
        if cost <= 0 or effort is not None and not effort.ok():
            break
        current[v].remove(t)
        if _peak_of(problem, current, effort) > budget_bytes:
            bisect.insort(current[v], t)
    return current


def _ruin(plan: list[list[int]], rng: random.Random, round_: int, n: int) -> list[list[int]]:
    """`plan` with some recomputations removed: on even rounds a random share of them
    (cycling through LNS_SHARES), on odd rounds every one in a random window of n/10 stages."""
    replays = [(v, t) for v, stages in enumerate(plan) for t in stages]
    if round_ % 2 == 0:
        share = LNS_SHARES[(round_ // 2) % len(LNS_SHARES)]
        dropped = set(rng.sample(replays, max(1, round(share * len(replays))))) if replays else set()
    else:
        width = max(1, n // 10)
        first = rng.randrange(n)
        dropped = {(v, t) for v, t in replays if first <= t < first + width}
    return [[t for t in stages if (v, t) not in dropped] for v, stages in enumerate(plan)]


def solve_local_search(problem: RematProblem, budget_bytes: int, start: Result, max_computations: int = 2,
                       max_steps: int = 0, patience: int = LNS_PATIENCE, deadline: float | None = None,
                       work: Work | None = None) -> Result:
    """Improve a fitting result: prune it (`_prune_plan`), then ruin and recreate (large
    neighbourhood search): remove some recomputations (`_ruin`), let the greedy evictor put
    the budget right again, prune, and keep the plan when it is cheaper.

    Rounds stop after `patience` rounds without a cheaper plan or once `max_steps` schedule
    steps have been judged (0: prune only); both are counts, so the same input gives the
    same plan. `deadline` (a `time.perf_counter()` reading) is a backstop for a machine far
    slower than the step budget assumes. With `work`, all of it (the pruning too) stops at
    FLOOR_STEPS past `max_steps`, or at what `work` has left where that is more, and as
    `_Effort` says once `work`'s deadline has passed. The result is called LOCAL_SEARCH.
    """
    started = time.perf_counter()
    effort = effort_of(problem, work, FLOOR_STEPS + max_steps)
    best = _prune_plan(problem, plan_from_schedule(problem, start.schedule), budget_bytes, effort)
    best_cost = _plan_cost(problem, best)
    copies = max(max_computations, _max_computations_of(best)) + 1
    rng = random.Random(LNS_SEED)
    round_ = idle = 0
    while effort.steps < max_steps and idle < patience and best_cost > 0 and effort.ok():
        if deadline is not None and time.perf_counter() > deadline:
            break
        ruined = _ruin(best, rng, round_, problem.n)
        candidate = _greedy_plan(problem, budget_bytes, copies, ruined, effort)
        round_, idle = round_ + 1, idle + 1
        if _peak_of(problem, candidate, effort) > budget_bytes:
            continue
        added = {(v, t) for v, stages in enumerate(candidate) for t in stages} - \
            {(v, t) for v, stages in enumerate(ruined) for t in stages}
        candidate = _prune_plan(problem, candidate, budget_bytes, effort, only=added)
        cost = _plan_cost(problem, candidate)
        if cost < best_cost - 1e-9 * problem.base_cost:
            best, best_cost, idle = candidate, cost, 0
    charge(work, effort)
    return _result(problem, LOCAL_SEARCH, schedule_from_plan(problem, best), budget_bytes, "heuristic", started)


# --------------------------------------------------------------------------- CP-SAT

def recompute_candidates(problem: RematProblem, min_gap: int = 2, forced=()) -> tuple[set, list]:
    """(nodes worth recomputing, last stage at which each node may be read; None for sinks).

    Recomputing v can only help if some stage strictly between two of its reads (or between
    its computation and its first read) could go without it -- a gap of `min_gap` stages or
    more -- or if a consumer may itself be recomputed later (and then reads v again).
    Nodes in `forced` (a warm start's recomputations) are always candidates; nodes that may
    not be recomputed at all (`problem.may_replay`) never are.
    """
    forced = {v for v in forced if problem.may_replay(v, v + 1)}
    candidates: set[int] = set()
    last_read: list[int | None] = [None] * problem.n
    for v in reversed(range(problem.n)):
        readers = problem.succs[v]
        if not readers:
            continue
        last_read[v] = max(last_read[c] if c in candidates else c for c in readers)
        marks = [v, *sorted(readers)]
        gap = max(b - a for a, b in zip(marks, marks[1:]))
        if problem.may_replay(v, v + 1) and (v in forced or gap >= min_gap or any(c in candidates for c in readers)):
            candidates.add(v)
    return candidates, last_read


def _integer_costs(costs) -> tuple[list[int], float]:
    """Costs as integers for CP-SAT, rounded down (so bound / scale stays a true lower bound)."""
    top = max(costs, default=0.0)
    if top <= 0:
        return [0] * len(costs), 1.0
    if top <= 10**6 and all(float(c).is_integer() for c in costs):
        return [int(c) for c in costs], 1.0
    scale = 10**6 / top
    return [math.floor(c * scale) for c in costs], scale


@dataclass
class _Copy:
    """One computation of a node and its retention interval [start, fin) over points."""

    present: object   # True, or a Boolean literal (recomputations are optional)
    stage: object     # an int (first computation) or an IntVar
    start: object     # point of the computation: an int or a linear expression
    fin: object       # IntVar: first point where the output is no longer retained
    length: object = None   # IntVar fin - start (recomputations only; CP-SAT wants it affine)


@dataclass
class RematModel:
    """A CP-SAT model of the plan space and the handles needed to hint it and read it."""

    model: object
    copies: list[list[_Copy]]
    serves: dict          # (u, v, k) -> [(j, literal)]: which copy of u the read by copy k of v uses
    cost_scale: float
    width: int            # points per stage


def build_model(problem: RematProblem, budget_bytes: int, candidates: set, last_read: list,
                max_computations: int = 2) -> RematModel | None:
    """Moccasin-style model; None when the pinned bytes alone exceed the budget.

    Points: stage t has n+1 points, t*(n+1)+v for a recomputation of v (topological order
    inside the stage) and t*(n+1)+n for the main computation of position t. Every node has up
    to C computations, each retained over [start, fin); the first is fixed at its main point.
    A read of u at point P needs a copy of u with start < P < fin; memory is a cumulative over
    the retention intervals. Retention covers exactly the liveness of `evaluate`, so any
    solution fits the budget under the judge.
    """
    from ortools.sat.python import cp_model

    n = problem.n
    width = n + 1
    unit = math.gcd(*problem.size) or 1
    capacity = (budget_bytes - problem.pinned_bytes) // unit
    if capacity < 0:
        return None
    model = cp_model.CpModel()
    icost, scale = _integer_costs(problem.cost)

    def main(t: int) -> int:
        return t * width + n

    copies: list[list[_Copy]] = []
    intervals, demands, objective = [], [], []
    for v in range(n):
        readers = problem.succs[v]
        hi = main(last_read[v]) + 1 if readers else main(v) + 1
        lo = main(v) + 1
        if readers and v not in candidates:
            lo = main(max(readers)) + 1   # one copy serves every read
        fin = model.new_int_var(lo, hi, f"fin_{v}_0")
        intervals.append(model.new_interval_var(main(v), fin - main(v), fin, f"keep_{v}_0"))
        demands.append(problem.size[v] // unit)
        node_copies = [_Copy(True, v, main(v), fin)]
        for j in range(1, max_computations if v in candidates else 1):
            present = model.new_bool_var(f"re_{v}_{j}")
            last = problem.deadline[v] if problem.deadline and problem.deadline[v] is not None else last_read[v]
            stage = model.new_int_var(v + 1, min(last_read[v], last), f"stage_{v}_{j}")
            start = stage * width + v
            fin = model.new_int_var((v + 1) * width + v + 1, hi, f"fin_{v}_{j}")
            length = model.new_int_var(1, hi - (v + 1) * width - v, f"len_{v}_{j}")
            intervals.append(model.new_optional_interval_var(start, length, fin, present, f"keep_{v}_{j}"))
            demands.append(problem.size[v] // unit)
            previous = node_copies[-1]
            model.add(previous.fin <= start).only_enforce_if(present)
            if j >= 2:
                model.add_implication(present, previous.present)
            objective.append(icost[v] * present)
            node_copies.append(_Copy(present, stage, start, fin, length))
        copies.append(node_copies)

    serves = {}
    for v in range(n):
        for k, read in enumerate(copies[v]):
            point = read.start
            for u in problem.preds[v]:
                if len(copies[u]) == 1:
                    if k:   # reads by first computations are in fin's domain already
                        model.add(copies[u][0].fin >= point + 1).only_enforce_if(read.present)
                    continue
                options = []
                for j, source in enumerate(copies[u]):
                    lit = model.new_bool_var(f"serve_{u}_{j}_{v}_{k}")
                    model.add(source.fin >= point + 1).only_enforce_if(lit)
                    if j:
                        model.add(source.start <= point - 1).only_enforce_if(lit)
                        model.add_implication(lit, source.present)
                    options.append((j, lit))
                clause = model.add_bool_or([lit for _, lit in options])
                if k:
                    clause.only_enforce_if(read.present)
                serves[(u, v, k)] = options
    model.add_cumulative(intervals, demands, capacity)
    _add_covering_cuts(model, problem, budget_bytes, unit, copies)
    model.minimize(sum(objective))
    return RematModel(model, copies, serves, scale, width)


def _add_covering_cuts(model, problem: RematProblem, budget_bytes: int, unit: int, copies) -> None:
    """Redundant cuts that give CP-SAT's LP a real bound: at the main step of stage t, every
    output live there without recomputation stays live unless its node is recomputed at all
    and is neither run nor read at t, so those recomputations must cover the excess bytes."""
    no_recompute = _liveness(problem, list(range(problem.n)))
    live_until = [no_recompute.end[v] for v in range(problem.n)]
    for t, live in enumerate(no_recompute.memory):
        excess = live - budget_bytes
        if excess <= 0:
            continue
        droppable = [v for v in range(t) if live_until[v] > t and len(copies[v]) > 1
                     and v not in problem.preds[t]]
        model.add(sum((problem.size[v] // unit) * copies[v][1].present for v in droppable)
                  >= -(-excess // unit))


def _plan_points(problem: RematProblem, plan: list[list[int]], width: int):
    """For a plan: its schedule, liveness, and each step's point in the model's numbering."""
    seq = schedule_from_plan(problem, plan)
    lv = _liveness(problem, seq)
    points, t = [], 0
    for v in seq:
        points.append(t * width + (problem.n if v == t else v))
        t += v == t
    return seq, lv, points


def add_hint(rm: RematModel, problem: RematProblem, plan: list[list[int]]) -> bool:
    """Hint every variable from a plan; False (no hint) when the model cannot express it."""
    if any(len(stages) >= len(rm.copies[v]) for v, stages in enumerate(plan) if stages):
        return False
    _, lv, points = _plan_points(problem, plan, rm.width)
    instances: list[list[int]] = [[] for _ in range(problem.n)]
    for i, v in enumerate(lv.node):
        instances[v].append(i)
    model = rm.model
    for v, node_copies in enumerate(rm.copies):
        for j, copy in enumerate(node_copies):
            if j < len(instances[v]):
                i = instances[v][j]
                if j:
                    model.add_hint(copy.present, True)
                    model.add_hint(copy.stage, plan[v][j - 1])
                model.add_hint(copy.fin, points[lv.end[i]] + 1)
                if j:
                    model.add_hint(copy.length, points[lv.end[i]] + 1 - points[lv.start[i]])
            else:
                model.add_hint(copy.present, False)   # absent: any value in the domain
                model.add_hint(copy.stage, v + 1)
                model.add_hint(copy.fin, (v + 1) * rm.width + v + 1)
                model.add_hint(copy.length, 1)
    for (u, v, k), options in rm.serves.items():
        read_point = points[lv.start[instances[v][k]]] if k < len(instances[v]) else None
        starts = [points[lv.start[i]] for i in instances[u]]
        serving = None if read_point is None else bisect.bisect_left(starts, read_point) - 1
        for j, lit in options:
            model.add_hint(lit, j == serving)
    return True


def read_plan(rm: RematModel, solver) -> list[list[int]]:
    """The plan in a CP-SAT solution: each node's recomputation stages."""
    plan = []
    for node_copies in rm.copies:
        plan.append(sorted(solver.value(c.stage) for c in node_copies[1:] if solver.boolean_value(c.present)))
    return plan


def solve_cpsat(problem: RematProblem, budget_bytes: int, time_limit_s: float = 10.0,
                warm_start: Result | None = None, max_computations: int = 2,
                min_gap: int = 2, started: float | None = None, deadline=None,
                dtime: float | None = None) -> Result | None:
    """Least-cost plan within the budget by CP-SAT, warm-started from `warm_start`.

    The warm start's recomputations are always in the model; it is the hint only when it
    fits the budget, so a hinted model always has a solution (OR-Tools 9.12-9.15 abort the
    process on a hinted search of an infeasible model, see passes/solver.py), and presolve
    stays on. `started` (a `time.perf_counter()` reading, default now) is when the caller's
    `time_limit_s` began: the wall limit is what is left of it, the deterministic limit a
    share of all of it (see passes/solver.py `solve`); `deadline` (a command's
    memsched.deadline.Deadline) caps the wall limit and stops the search. `dtime` (deterministic
    seconds) runs instead one worker in interleaved turns for exactly that long (`_solve_counted`),
    the wall limit (what is left of `time_limit_s`) only a backstop.
    Returns None when no schedule within the budget was found (proven or timed out).
    Status: "optimal" (proven within the plan space), "feasible" (better than the warm start,
    not proven; lower_bound says how far it can still go), "heuristic" (nothing better found).
    """
    began = time.perf_counter()
    warm = plan_from_schedule(problem, warm_start.schedule) if warm_start is not None else None
    forced = {v for v, stages in enumerate(warm) if stages} if warm else set()
    if warm:   # room for the warm start's replays, so that it can be the hint
        max_computations = max(max_computations, _max_computations_of(warm))
    candidates, last_read = recompute_candidates(problem, min_gap, forced)
    rm = build_model(problem, budget_bytes, candidates, last_read, max_computations)
    if rm is None:
        return None
    if warm is not None and warm_start.fits:
        add_hint(rm, problem, warm)
    started = began if started is None else started
    if dtime is None:
        solved = solve(rm.model, time_limit_s, presolve=True, started=started, min_seconds=0.05, deadline=deadline)
    else:
        solved = _solve_counted(rm.model, dtime, time_limit_s - (time.perf_counter() - started), deadline, True)
    if not solved.has_solution:
        return None
    seq = schedule_from_plan(problem, read_plan(rm, solved.solver))
    lower = problem.base_cost + solved.bound / rm.cost_scale
    result = _result(problem, CPSAT, seq, budget_bytes, "feasible", began, lower)
    if not result.fits:
        raise RuntimeError(f"internal error: CP-SAT plan peaks at {result.peak_bytes} bytes, "
                           f"over the budget {budget_bytes}")
    if solved.status == "optimal":
        label = "optimal"
    elif warm_start is not None and warm_start.fits and result.total_cost >= warm_start.total_cost:
        label = "heuristic"
    else:
        label = "feasible"
    return replace(result, status=label, lower_bound=min(lower, result.total_cost))


# --------------------------------------------------------------------------- windows

@dataclass
class _Frame:
    """A window of stages [first, stop) of a plan whose recomputations outside it are fixed.

    `nodes` (in id order) are those the window model holds: the window's own nodes, the nodes
    they read, the nodes the plan recomputes in the window, and the inputs of every candidate.
    `stages`: each candidate's stages (0 = `first`) where it may be recomputed, `replays` how
    many times. `carried`: for each node of `nodes` computed before the window, the last step
    before it that reads the node's latest copy (its computation where none does): kept into
    the window, that copy is live from there on. `after`: nodes whose latest copy at the
    window's end is read after it. `floor`: (step, live bytes there with no copy kept into
    the window) for each step before the window with more of them than every later step
    before it: a kept copy is live at the later steps too, so the other steps never bound
    the window. `through`: bytes of the copies live across the whole window that nothing
    in it reads.
    """

    first: int
    stop: int
    nodes: list[int]
    stages: dict[int, list[int]]
    replays: dict[int, int]
    carried: dict[int, int]
    after: set[int]
    floor: list[tuple[int, int]]
    through: int


def _window_frame(problem: RematProblem, plan: list[list[int]], first: int, stop: int) -> _Frame:
    """The frame of the window [first, stop) of `plan` (see `_Frame`), read off the liveness
    of `plan` without its recomputations in the window. Each step of a schedule makes one
    instance, so instance i is step i."""
    fixed = [[t for t in stages if not first <= t < stop] for stages in plan]
    lv = _liveness(problem, schedule_from_plan(problem, fixed))
    begin = first + sum(t < first for stages in fixed for t in stages)     # the window's first step
    end = begin + stop - first                                             # the first step after it
    latest = {lv.node[i]: i for i in range(begin)}                         # later instances win
    own = range(first, stop)
    read = {u for t in own for u in problem.preds[t]}
    replayed = {v for v, stages in enumerate(plan) if any(first <= t < stop for t in stages)}
    stages, replays = {}, {}
    for v in sorted(read | replayed | set(own)):
        local = [t - first for t in range(max(first, v + 1), stop) if problem.may_replay(v, t)]
        if local:
            stages[v] = local
            replays[v] = max(WINDOW_REPLAYS, sum(first <= t < stop for t in plan[v]))
    nodes = read | set(own) | set(stages) | {u for v in stages for u in problem.preds[v]}
    carried = {}
    for u in nodes & latest.keys():
        uses = lv.uses[latest[u]]
        before = bisect.bisect_left(uses, begin)
        carried[u] = uses[before - 1] if before else latest[u]
    after = {u for u, i in latest.items() if lv.end[i] >= end} | {t for t in own if lv.end[begin + t - first] >= end}
    through = sum(problem.size[u] for u, i in latest.items() if lv.end[i] >= begin and u not in nodes)
    floor = _window_floor(problem, lv, latest, carried, begin)
    return _Frame(first, stop, sorted(nodes), stages, replays, carried, after & nodes, floor, through)


def _window_floor(problem: RematProblem, lv: _Liveness, latest: dict, carried: dict, begin: int) -> list:
    """`_Frame.floor`: the live bytes at each step before the window (step `begin`) with every
    carried copy ending at its last read before the window, kept where no later step has as many."""
    delta = [0] * (begin + 1)
    for i in range(begin):
        v = lv.node[i]
        last = carried[v] if v in carried and latest[v] == i else min(lv.end[i], begin - 1)
        delta[i] += problem.size[v]
        delta[last + 1] -= problem.size[v]
    levels = list(itertools.accumulate(delta[:begin], initial=problem.pinned_bytes))[1:]
    floor, top = [], -1
    for k in reversed(range(begin)):
        if levels[k] > top:
            top = levels[k]
            floor.append((k, levels[k]))
    return floor[::-1]


@dataclass
class _WindowModel:
    """A window's CP-SAT model: `copies` per node (its first copy is the one from before the
    window or its own computation in it), `serves` (reader, or (u, None, 0) for the reads after
    the window) -> [(copy, literal)], points `width` per stage, `span` points in all."""

    model: object
    copies: dict[int, list[_Copy]]
    serves: dict
    width: int
    span: int
    size: int = 0      # intervals and literals: the model's size, for counting work


def _window_model(problem: RematProblem, frame: _Frame, budget_bytes: int, icost: list[int],
                  ceiling: int | None = None) -> _WindowModel:
    """The Moccasin model of `build_model` restricted to a window: stage t of the window has
    points t*width + i for a recomputation of nodes[i] and t*width + width-1 for its own node.
    The steps before the window that bound it (`frame.floor`) are the points -len(floor)..-1,
    each a fixed interval of its live bytes; a copy kept into the window is live from the
    first of them after its last read there, so the one cumulative is the whole memory model.
    After the window, the live bytes do not depend on it: the reads there want only that
    some copy of each node of `frame.after` is kept to the window's end. With a `ceiling`
    (bytes, over the budget) the memory may reach it: the model then finds the lowest peak of
    the window down to the budget first and the cheapest recomputations for it second, as
    Moccasin's first phase minimises the footprint."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    unit = math.gcd(*problem.size) or 1
    width = len(frame.nodes) + 1
    wm = _WindowModel(model, {}, {}, width, (frame.stop - frame.first) * width)
    steps = [k for k, _ in frame.floor]
    intervals, demands, objective = [], [], []
    for j, (k, live) in enumerate(frame.floor):
        intervals.append(model.new_fixed_size_interval_var(j - len(steps), 1, f"before_{k}"))
        demands.append((live - problem.pinned_bytes) // unit)
    if frame.through:
        intervals.append(model.new_fixed_size_interval_var(0, wm.span, "through"))
        demands.append(frame.through // unit)
    for i, v in enumerate(frame.nodes):
        pre = bisect.bisect_right(steps, frame.carried[v]) - len(steps) if v < frame.first else None
        wm.copies[v], kept, costs = _window_copies(problem, frame, wm, v, i, pre, icost[v])
        intervals.extend(kept)
        demands.extend([problem.size[v] // unit] * len(kept))
        objective.extend(costs)
    _window_reads(wm, problem, frame)
    capacity = (budget_bytes - problem.pinned_bytes) // unit
    if ceiling is None:
        model.add_cumulative(intervals, demands, capacity)
        model.minimize(sum(objective))
    else:
        peak = model.new_int_var(capacity, max(capacity, (ceiling - problem.pinned_bytes) // unit), "peak")
        model.add_cumulative(intervals, demands, peak)
        model.minimize((sum(icost) + 1) * peak + sum(objective))
    wm.size = len(intervals) + sum(len(options) for options in wm.serves.values())
    return wm


def _window_copies(problem: RematProblem, frame: _Frame, wm: _WindowModel, v: int, index: int,
                   pre: int | None, cost: int) -> tuple[list[_Copy], list, list]:
    """Node v's copies in a window model, their intervals and objective terms. `pre` (for a
    node computed before the window) is the first point where keeping its copy into the
    window adds bytes (the first step of the floor after its last read there); the copy is
    kept exactly when it lasts past point 0."""
    from ortools.sat.python import cp_model

    model = wm.model
    if pre is not None:
        kept = model.new_bool_var(f"kept_{v}")
        fin = model.new_int_var(0, wm.span, f"fin_{v}_0")
        model.add(fin >= 1).only_enforce_if(kept)
        model.add(fin == 0).only_enforce_if(~kept)
        copies = [_Copy(kept, None, pre, fin)]
        intervals = [model.new_optional_interval_var(pre, fin - pre, fin, kept, f"keep_{v}_0")]
    else:
        main = (v - frame.first) * wm.width + wm.width - 1
        fin = model.new_int_var(main + 1, wm.span, f"fin_{v}_0")
        copies = [_Copy(True, v - frame.first, main, fin)]
        intervals = [model.new_interval_var(main, fin - main, fin, f"keep_{v}_0")]
    objective = []
    for j in range(1, 1 + frame.replays.get(v, 0)):
        present = model.new_bool_var(f"re_{v}_{j}")
        stage = model.new_int_var_from_domain(cp_model.Domain.from_values(frame.stages[v]), f"stage_{v}_{j}")
        start = stage * wm.width + index
        low = frame.stages[v][0] * wm.width + index + 1
        fin = model.new_int_var(low, wm.span, f"fin_{v}_{j}")
        length = model.new_int_var(1, wm.span - low + 1, f"len_{v}_{j}")
        intervals.append(model.new_optional_interval_var(start, length, fin, present, f"keep_{v}_{j}"))
        model.add(copies[-1].fin <= start).only_enforce_if(present)
        if j >= 2:
            model.add_implication(present, copies[-1].present)
        objective.append(cost * present)
        copies.append(_Copy(present, stage, start, fin, length))
    return copies, intervals, objective


def _serving(model, copies: list, name: str, fin, start=None) -> list:
    """(copy index, literal) for each copy of a node that may serve a read: a chosen copy
    lives to `fin` and, for a recomputation (`start` given: the reader's start), starts before
    the read and is present."""
    options = []
    for j, source in enumerate(copies):
        lit = model.new_bool_var(f"{name}_{j}")
        model.add(source.fin >= fin).only_enforce_if(lit)
        if j:   # a first copy comes before any read of it in the window
            if start is not None:
                model.add(source.start <= start - 1).only_enforce_if(lit)
            model.add_implication(lit, source.present)
        options.append((j, lit))
    return options


def _window_reads(wm: _WindowModel, problem: RematProblem, frame: _Frame) -> None:
    """Every read in the window (by its own nodes and by the recomputations) is served by a
    copy live there; every node read after the window has a copy kept to its end. Copies of a
    node do not overlap, so the serving copy is the latest, as in the judge."""
    model = wm.model
    readers = [(t, 0) for t in range(frame.first, frame.stop)]
    readers += [(v, k) for v in frame.stages for k in range(1, len(wm.copies[v]))]
    for v, k in readers:
        read = wm.copies[v][k]
        for u in problem.preds[v]:
            options = _serving(model, wm.copies[u], f"serve_{u}_{v}_{k}", read.start + 1, read.start)
            clause = model.add_bool_or([lit for _, lit in options])
            if k:
                clause.only_enforce_if(read.present)
            wm.serves[(u, v, k)] = options
    for u in frame.after:
        options = _serving(model, wm.copies[u], f"after_{u}", wm.span)
        model.add_bool_or([lit for _, lit in options])
        wm.serves[(u, None, 0)] = options


def _window_hint(wm: _WindowModel, problem: RematProblem, frame: _Frame, plan: list[list[int]]) -> None:
    """Hint every variable of the window model from `plan` (a solution of it)."""
    seq = schedule_from_plan(problem, plan)
    lv = _liveness(problem, seq)
    index = {v: i for i, v in enumerate(frame.nodes)}
    points, mine, t = [], {v: [] for v in frame.nodes}, 0
    for k, v in enumerate(seq):     # step -> point: -1 before the window, span after it
        inside = frame.first <= t < frame.stop
        points.append((t - frame.first) * wm.width + (wm.width - 1 if v == t else index[v]) if inside
                      else -1 if t < frame.first else wm.span)
        if v in mine and points[k] < wm.span:
            mine[v] = [k] if points[k] < 0 else mine[v] + [k]      # the window's instances of v
        t += v == t
    model = wm.model
    for v, node_copies in wm.copies.items():
        for j, copy in enumerate(node_copies):
            if j < len(mine[v]):
                k = mine[v][j]
                fin = 0 if points[lv.end[k]] < 0 else min(points[lv.end[k]] + 1, wm.span)
                model.add_hint(copy.fin, fin)
                if j == 0 and v < frame.first:
                    model.add_hint(copy.present, fin > 0)
                elif j:
                    model.add_hint(copy.present, True)
                    model.add_hint(copy.stage, points[k] // wm.width)
                    model.add_hint(copy.length, fin - points[k])
            else:
                model.add_hint(copy.present, False)   # absent: any value in the domain
                model.add_hint(copy.stage, frame.stages[v][0])
                model.add_hint(copy.fin, wm.span)
                model.add_hint(copy.length, wm.span - frame.stages[v][0] * wm.width - index[v])
    for (u, v, k), options in wm.serves.items():
        starts = [points[i] for i in mine[u]]
        if v is None:
            serving = len(starts) - 1
        else:
            serving = bisect.bisect_left(starts, points[mine[v][k]]) - 1 if k < len(mine[v]) else None
        for j, lit in options:
            model.add_hint(lit, j == serving)


def _solve_counted(model, dtime: float, wall: float, deadline: Deadline | None, interleave: bool,
                   probing: bool = True) -> SolveResult:
    """`passes.solver.run` for `dtime` deterministic seconds on one worker, which stops at that
    limit, so the same model gives the same answer under any load; the wall limit (`wall`, or
    the solver's safety net for `dtime` where that is longer: building a U-Net's model can
    take the caller's whole time) and `deadline` only stop a machine far slower than
    expected, and `deadline` is then marked cut."""
    return run(model, dtime, safety_wall(dtime, wall), True, deadline, interleave, probing)


def _solve_window(problem: RematProblem, plan: list[list[int]], budget_bytes: int, first: int, stop: int,
                  icost: list[int], dtime: float, interleave: bool, until: float, deadline: Deadline | None,
                  ceiling: int | None = None):
    """CP-SAT's answer for the window [first, stop) of `plan` (`ceiling`: see `_window_model`):
    (the plan with the window's recomputations replaced, or None where it found none; the
    counted seconds it took, at WINDOW_TERM_COST per model term and WINDOW_DTIME_COST per
    deterministic second; the SolveResult)."""
    frame = _window_frame(problem, plan, first, stop)
    wm = _window_model(problem, frame, budget_bytes, icost, ceiling)
    _window_hint(wm, problem, frame, plan)
    solved = _solve_counted(wm.model, dtime, until - time.perf_counter(), deadline, interleave, probing=False)
    spent = WINDOW_TERM_COST * wm.size + WINDOW_DTIME_COST * solved.solver.deterministic_time
    if not solved.has_solution:
        return None, spent, solved
    found = [[t for t in stages if not first <= t < stop] for stages in plan]
    for v in frame.stages:
        for copy in wm.copies[v][1:]:
            if solved.solver.boolean_value(copy.present):
                bisect.insort(found[v], first + solved.solver.value(copy.stage))
    return found, spent, solved


def _windows(problem: RematProblem, plan: list[list[int]], sweep: int) -> list[tuple[int, int]]:
    """The windows of WINDOW_STAGES stages of a sweep, overlapping by half (odd sweeps shift
    them by a quarter), from the last stages to the first, that hold a recomputation of
    `plan`: only there can a window's answer be cheaper."""
    n, width = problem.n, WINDOW_STAGES
    shift = width // 4 if sweep % 2 else 0
    firsts = sorted({*range(1 + shift, max(1, n - width), max(1, width // 2)), max(1, n - width)}, reverse=True)
    stages = sorted({t for s in plan for t in s})
    windows = []
    for first in firsts:
        stop = min(n, first + width)
        if bisect.bisect_left(stages, stop) > bisect.bisect_left(stages, first):
            windows.append((first, stop))
    return windows


def solve_windows(problem: RematProblem, budget_bytes: int, start: Result, seconds: float,
                  until: float | None = None, deadline: Deadline | None = None) -> tuple[Result, float]:
    """Improve a fitting result by a large-neighbourhood search over windows of consecutive
    stages: with the plan outside a window fixed, CP-SAT chooses the recomputations inside it
    exactly (`_window_model`, hinted with the plan; a window it does not close within
    WINDOW_DTIME gets a second, interleaved search), and its answer is kept when the judge
    finds it within the budget and cheaper: the plan never gets worse. Sweeps over the
    windows (`_windows`) repeat until two in a row keep nothing or `seconds` are spent.

    The seconds are counted, not clocked (`_solve_window`'s prices; every solve on one
    worker, the last one given what is left), so the same input gives the same plan under
    any load. `until` (a `time.perf_counter()` reading) and `deadline` (a command's) only
    stop a machine far slower than the prices assume. Returns the result, called WINDOW,
    and the counted seconds spent.
    """
    started = time.perf_counter()
    until = math.inf if until is None else until
    best = plan_from_schedule(problem, start.schedule)
    best_cost, left = _plan_cost(problem, best), float(seconds)
    icost, _ = _integer_costs(problem.cost)
    sweep = idle = 0
    clocked = False
    while idle < 2 and left > 0 and not clocked:
        idle += 1
        for first, stop in _windows(problem, best, sweep):
            for interleave in (False, True):
                clocked = clocked or _clock_ended(until, deadline)
                if left <= 0 or clocked:
                    break
                found, spent, solved = _solve_window(problem, best, budget_bytes, first, stop, icost,
                                                     min(WINDOW_DTIME, left / WINDOW_DTIME_COST), interleave,
                                                     until, deadline)
                left, clocked = left - spent, not solved.deterministic
                cost = _plan_cost(problem, found) if found is not None else math.inf
                if cost < best_cost - 1e-9 * problem.base_cost and _peak_of(problem, found) <= budget_bytes:
                    best, best_cost, idle = found, cost, 0
                if solved.status != "feasible":
                    break          # closed (or nothing found): a second search cannot do better
            if left <= 0 or clocked:
                break
        sweep += 1
    result = _result(problem, WINDOW, schedule_from_plan(problem, best), budget_bytes, "heuristic", started)
    return result, seconds - left


def _peak_stage(problem: RematProblem, plan: list[list[int]]) -> tuple[int, int]:
    """(the stage of `plan`'s peak step, the peak): a step's stage is the number of first
    computations before it."""
    seq = schedule_from_plan(problem, plan)
    lv = _liveness(problem, seq)
    return len(set(seq[:lv.peak_step])), lv.peak


def _clock_ended(until: float, deadline: Deadline | None) -> bool:
    """Whether a window search's clock backstop (`until`, a `time.perf_counter()` reading) or
    the command's deadline ends it (the deadline then marked cut)."""
    return time.perf_counter() >= until or deadline is not None and deadline.cuts()


def solve_windows_to_fit(problem: RematProblem, budget_bytes: int, start: Result, seconds: float,
                         until: float | None = None, deadline: Deadline | None = None) -> tuple[Result, float]:
    """Lower the peak of a plan that does not fit, window by window, as Moccasin's first phase
    minimises the footprint before its second minimises the time: CP-SAT re-solves a window of
    FIT_STAGES stages around the peak stage with the memory free up to the plan's peak
    (`_window_model`'s ceiling), lowest window peak first, cheapest second; the judge keeps an
    answer with a lower peak (or the same peak, cheaper). Windows placed around the peak at
    FIT_OFFSETS are tried in turn; the search stops once the plan fits, when no window around
    the peak lowers it, or when `seconds` (counted as `solve_windows` counts them) are spent.
    `until` and `deadline` as for `solve_windows`. Returns the result, called FIT_WINDOWS,
    and the counted seconds spent."""
    started = time.perf_counter()
    until = math.inf if until is None else until
    best = plan_from_schedule(problem, start.schedule)
    stage, peak = _peak_stage(problem, best)
    best_cost, left = _plan_cost(problem, best), float(seconds)
    icost, _ = _integer_costs(problem.cost)
    width = min(FIT_STAGES, problem.n - 1)
    lowered = True
    while lowered and peak > budget_bytes and left > 0:
        lowered = False
        for share in FIT_OFFSETS:
            if left <= 0 or _clock_ended(until, deadline):
                left = min(left, 0.0)
                break
            first = max(1, min(problem.n - width, stage - round(share * (width - 1))))
            found, spent, _ = _solve_window(problem, best, budget_bytes, first, first + width, icost,
                                            min(WINDOW_DTIME, left / WINDOW_DTIME_COST), False, until, deadline,
                                            ceiling=peak)
            left -= spent
            if found is None:
                continue
            (found_stage, found_peak), cost = _peak_stage(problem, found), _plan_cost(problem, found)
            if found_peak < peak or found_peak == peak and cost < best_cost - 1e-9 * problem.base_cost:
                best, best_cost, stage, peak, lowered = found, cost, found_stage, found_peak, True
                break
    result = _result(problem, FIT_WINDOWS, schedule_from_plan(problem, best), budget_bytes, "heuristic", started)
    return result, seconds - left


# --------------------------------------------------------------------------- entry point

def _cheapest(runs: dict[str, Result]) -> Result | None:
    """The cheapest fitting run; ties go to the run added first."""
    return min((r for r in runs.values() if r.fits), key=lambda r: r.total_cost, default=None)


def plan(problem: RematProblem, budget_bytes: int, time_limit_s: float = 10.0, method: str = "auto",
         max_computations: int = 2, seeds: dict[str, list[list[int]]] | None = None,
         work: Work | None = None, final: bool = False) -> Result:
    """The cheapest schedule within `budget_bytes`, found anytime: feasibility first, then
    improvement while `time_limit_s` lasts, always keeping the best plan so far.

    1. Baselines (checkpoint-all, sqrt(n), greedy) and `seeds` (name -> plan, e.g. from a
       caller that knows the graph's structure) are judged.
    2. If none fits, `solve_repair` continues the greedy from the lowest-peak ones with more
       computations per node allowed (run REPAIR); if none fits still and the budget is the
       command's own (`final`), `solve_windows_to_fit` lowers the peak of the lowest-peak plan
       window by window (run FIT_WINDOWS). A compile's inner solves try many budgets and
       learn from a miss, so they do not spend on it.
    3. `solve_local_search` improves the cheapest fitting plan for about LNS_TIME_SHARE of the
       time limit, counted in schedule steps judged (run LOCAL_SEARCH when it is cheaper).
    4. `solve_windows` re-solves windows of its plan's stages exactly with CP-SAT until they
       keep nothing, for at most WINDOW_SHARE of the limit and the counted time left less
       RESERVE_SHARE of it (run WINDOW when it is cheaper); then steps 3 and 4 take turns,
       each from the other's plan, while a turn makes it cheaper (`_improve`).
    5. CP-SAT on the whole model, warm-started from the best plan so far, for what the
       windows left less its presolve (CPSAT_PRESOLVE_COST per node), as deterministic
       seconds priced at CPSAT_DTIME_COST per node; where a plan fits, it is skipped when
       less is left for the search than for the presolve. A cheaper answer that is not
       optimal is pruned (LOCAL_SEARCH again when that helps). Without a fitting plan
       CP-SAT searches unhinted, the last resort.
    Every step is bounded by counts, not the clock (schedule steps judged, CP-SAT's
    deterministic time on one worker), so a plan that fits is found whatever the time limit,
    and the same input gives the same plan under any load; the clock only stops a machine
    far slower than the counts assume. Steps 2 to 4 add recomputations, so they run only
    where `max_computations` > 1; they may exceed it, as CP-SAT's model grows to take its
    warm start. `method` = "auto" (all), or one of METHODS alone ("cpsat" keeps every step
    before it, for its warm start).
    `work` (a caller's counted budget, with its command's deadline): steps 1 to 4 charge it
    their work and stop once it is spent (at least FLOOR_STEPS for the greedy and
    the repair together, as many for the local search: a first answer comes; whole up to
    WHOLE_NODES nodes), and CP-SAT
    runs only where building its model (CPSAT_NODE_COST per node squared) is within what is
    left, or within CPSAT_FLOOR_S: on a 6,500-node problem the heuristics' plan is the
    answer. Without it, steps 1 and 2 run whole. `final`: `budget_bytes` is the command's own
    budget (the `remat` command), so the first plan that fits it is the command's answer:
    `work`'s deadline is then marked planned, and no floor runs past it; the counts then
    follow the command's own time limit (`_counting`), not `time_limit_s`.
    Raises BudgetInfeasible naming the smallest budget reached.
    """
    started = time.perf_counter()
    if method != "auto" and method not in METHODS:
        raise RematInputError(f"unknown method {method!r}; choose auto or one of {', '.join(METHODS)}")
    if not time_limit_s > 0:
        raise RematInputError(f"the time limit must be > 0 seconds, not {time_limit_s!r}")
    if max_computations < 1:
        raise RematInputError("max_computations must be >= 1")
    budget_bytes = int(budget_bytes)
    runs = _Runs(started, work.deadline if final and work is not None else None)
    wanted = METHODS if method in ("auto", CPSAT) else (method,)
    lower = memory_lower_bound(problem)
    improve = CPSAT in wanted and budget_bytes >= lower
    recompute = max_computations > 1
    time_limit_s, counted = _counting(time_limit_s, work, final)
    _first_plans(problem, budget_bytes, wanted, max_computations, seeds, counted, runs, repair=improve and recompute)
    best = _cheapest(runs.results)
    if improve and recompute and best is None and final:
        best = _fit_by_windows(problem, budget_bytes, time_limit_s, counted, runs)
    if improve and recompute and best is not None and best.status != "optimal":
        best = _improve(problem, budget_bytes, time_limit_s, best, max_computations, counted, runs)
    left = _counted_left(counted, time_limit_s)
    affords = CPSAT_NODE_COST * problem.n ** 2 <= max(counted.left, CPSAT_FLOOR_S)
    presolve = CPSAT_PRESOLVE_COST * problem.n
    if improve and affords and not (best and best.status == "optimal") and (best is None or left >= 2 * presolve):
        best = _cpsat_step(problem, budget_bytes, time_limit_s, best, max_computations, counted, runs,
                           max(left - presolve, CPSAT_MIN_SHARE * time_limit_s) / (CPSAT_DTIME_COST * problem.n))
    if work is not None and counted is not work:
        work.spend(counted.spent)
    if best is None:
        closest = runs.by_peak()[0]
        raise BudgetInfeasible(budget_bytes, closest.peak_bytes, lower, closest)
    return replace(best, seconds=time.perf_counter() - started, runs=runs.results)


def _counting(time_limit_s: float, work: Work | None, final: bool) -> tuple[float, Work]:
    """(the time limit `plan`'s counts follow, the Work they charge). The `remat` command's
    plan (`final`, with its deadline) counts from the command's own time limit, not from what
    its start-up left of it, so a start-up slowed by load changes no count (RESERVE_SHARE of
    the limit covers it), and the caller's `work` is charged at the end; other callers' `work`
    is charged as it goes and bounds the steps; without one, an unbounded tally, whose
    spending the time limit bounds."""
    if work is None:
        return time_limit_s, Work(math.inf)
    deadline = work.deadline
    if final and deadline is not None and math.isfinite(deadline.end):
        limit = max(0.0, deadline.end - deadline.started)
        return limit, Work(limit, deadline)
    return time_limit_s, work


class _Runs:
    """Each method's own result by name, with when it was found. `planned`: the command's
    deadline, marked planned at the first result that fits (the `remat` command's budget)."""

    def __init__(self, started: float, planned: Deadline | None = None):
        self.started, self.planned = started, planned
        self.results: dict[str, Result] = {}

    def backstop(self, time_limit_s: float) -> float:
        """The clock's backstop on the heuristics (a `time.perf_counter()` reading): CPSAT_MIN_SHARE
        of the limit before its end."""
        return self.started + (1 - CPSAT_MIN_SHARE) * time_limit_s

    def by_peak(self) -> list[Result]:
        """The results, lowest peak (then cost) first."""
        return sorted(self.results.values(), key=lambda r: (r.peak_bytes, r.total_cost))

    def keep(self, name: str, result: Result) -> Result:
        self.results[name] = replace(result, found_at=time.perf_counter() - self.started)
        if self.planned is not None and result.fits:
            self.planned.planned = True
        return self.results[name]


def _first_plans(problem: RematProblem, budget_bytes: int, wanted, max_computations: int,
                 seeds: dict[str, list[list[int]]] | None, work: Work | None, runs: _Runs, repair: bool) -> None:
    """Steps 1 and 2 of `plan`: the baselines and seeds judged, then (with `repair`, where
    none fits) the greedy continued from the lowest-peak ones; `work` charged their effort."""
    if CHECKPOINT_ALL in wanted:
        runs.keep(CHECKPOINT_ALL, solve_checkpoint_all(problem, budget_bytes))
    if SQRT_N in wanted:
        runs.keep(SQRT_N, solve_sqrt_n(problem, budget_bytes, max_computations))
    effort = effort_of(problem, work)    # the greedy's and the repair's, one floor for both
    if GREEDY in wanted:
        began = time.perf_counter()
        seq = schedule_from_plan(problem, _greedy_plan(problem, budget_bytes, max_computations, effort=effort))
        runs.keep(GREEDY, _result(problem, GREEDY, seq, budget_bytes, "heuristic", began))
    for name, seed in (seeds or {}).items():
        runs.keep(name, _result(problem, name, schedule_from_plan(problem, seed), budget_bytes, "heuristic",
                                runs.started))
    if repair and _cheapest(runs.results) is None:
        starts = [plan_from_schedule(problem, r.schedule) for r in runs.by_peak()]
        runs.keep(REPAIR, solve_repair(problem, budget_bytes, [s for s in starts if s is not None],
                                       max_computations, effort=effort))
    charge(work, effort)


def _fit_by_windows(problem: RematProblem, budget_bytes: int, time_limit_s: float, counted: Work,
                    runs: _Runs) -> Result | None:
    """Step 2b of `plan`, where no plan fits yet: `solve_windows_to_fit` from the lowest-peak
    plan so far, for at most WINDOW_SHARE of the limit and the counted time left (kept as
    FIT_WINDOWS); its plan where it fits, else None."""
    seconds = min(WINDOW_SHARE * time_limit_s, _counted_left(counted, time_limit_s))
    lowest = next((r for r in runs.by_peak() if plan_from_schedule(problem, r.schedule) is not None), None)
    if seconds <= 0 or lowest is None:
        return None
    fitted, spent = solve_windows_to_fit(problem, budget_bytes, lowest, seconds, runs.backstop(time_limit_s),
                                         counted.deadline)
    counted.spend(spent)
    fitted = runs.keep(FIT_WINDOWS, fitted)
    return fitted if fitted.fits else None


def _counted_left(counted: Work, time_limit_s: float) -> float:
    """Counted seconds left to plan with: the time limit (and `counted`'s own budget) less
    what is spent and less RESERVE_SHARE of the limit."""
    return min(counted.left, time_limit_s - counted.spent) - RESERVE_SHARE * time_limit_s


def _improve(problem: RematProblem, budget_bytes: int, time_limit_s: float, best: Result, max_computations: int,
             counted: Work, runs: _Runs) -> Result:
    """Steps 3 and 4 of `plan`, in turns: the local search, then the windows from its plan,
    then the local search again from theirs, and so on while a turn makes the plan cheaper
    (each kept, as LOCAL_SEARCH or WINDOW, where cheaper). The two search different
    neighbourhoods: the windows trade recomputations between nearby stages exactly, the
    local search moves them across the whole plan, so each finds what the other's plan
    opens. The first local search takes at most LNS_TIME_SHARE of the limit, each windows'
    turn WINDOW_SHARE; the later local searches what is left; where the whole model's
    presolve is a small part of the limit, every turn leaves step 5 the time it needs to
    run. All charge `counted`. The best result then."""
    until = runs.backstop(time_limit_s)
    kept = 2 * CPSAT_PRESOLVE_COST * problem.n      # what step 5 needs left, where that is a small part of the limit
    kept = kept if kept <= CPSAT_MIN_SHARE * time_limit_s else 0.0
    searching = LNS_TIME_SHARE * time_limit_s
    while True:
        searched = solve_local_search(problem, budget_bytes, best, max_computations,
                                      max(0, int(searching * STEPS_PER_SECOND)), deadline=until, work=counted)
        if searched.total_cost < best.total_cost:
            best = runs.keep(LOCAL_SEARCH, searched)
        elif WINDOW in runs.results:
            return best         # the windows' plan is the local search's too: a turn more finds nothing
        seconds = min(WINDOW_SHARE * time_limit_s, _counted_left(counted, time_limit_s) - kept)
        if seconds <= 0 or best.total_cost <= problem.base_cost:
            return best
        windowed, spent = solve_windows(problem, budget_bytes, best, seconds, until, counted.deadline)
        counted.spend(spent)
        if windowed.total_cost >= best.total_cost:
            return best
        best = runs.keep(WINDOW, windowed)
        searching = _counted_left(counted, time_limit_s) - kept


def _cpsat_step(problem: RematProblem, budget_bytes: int, time_limit_s: float, best: Result | None,
                max_computations: int, counted: Work, runs: _Runs, dtime: float) -> Result | None:
    """Step 5 of `plan`: CP-SAT for `dtime` deterministic seconds on one worker, warm-started
    from `best` (or the lowest peak), its answer pruned by the local search where it is not
    optimal; the best result then."""
    warm = best or runs.by_peak()[0]
    # CP-SAT's wall backstop ends PRUNE_SHARE early, to prune its answer
    found = solve_cpsat(problem, budget_bytes, time_limit_s, warm, max_computations,
                        started=runs.started - PRUNE_SHARE * time_limit_s, deadline=counted.deadline, dtime=dtime)
    if found is None:
        return best
    found = runs.keep(CPSAT, found)
    if best is not None and found.total_cost >= best.total_cost:
        # no cheaper than the warm start: keep its name, take CP-SAT's verdict
        return replace(best, status=found.status, lower_bound=found.lower_bound)
    if found.status != "optimal":
        pruned = solve_local_search(problem, budget_bytes, found)   # CP-SAT ran: n is small
        if pruned.total_cost < found.total_cost:
            return runs.keep(LOCAL_SEARCH, replace(pruned, status=found.status, lower_bound=found.lower_bound))
    return found


def summary(problem: RematProblem, result: Result) -> dict:
    """The result as JSON-ready data (docs/json.md's `remat` keys, then extras)."""
    return {
        "nodes": problem.n, "budget_bytes": result.budget_bytes, "peak_bytes": result.peak_bytes,
        "total_cost": result.total_cost, "overhead": result.overhead, "seconds": result.seconds,
        "status": result.status, "schedule": list(result.schedule),
        "method": result.method, "lower_bound": result.lower_bound, "base_cost": problem.base_cost,
        "pinned_bytes": problem.pinned_bytes, "recomputations": result.recomputations,
        "methods": {name: {"fits": run.fits, "peak_bytes": run.peak_bytes, "total_cost": run.total_cost,
                           "overhead": run.overhead, "status": run.status, "seconds": run.seconds,
                           "found_at": run.found_at}
                    for name, run in result.runs.items()},
    }
