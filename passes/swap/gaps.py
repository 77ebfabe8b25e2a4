"""What the swap planner chooses among: the idle gaps of tensors, their options, the time axis.

A tensor occupies the device in residencies (memsched.memory). Inside one it is read at some
steps, its uses. Between two consecutive *anchors* -- the step that makes it resident (or -1
for what is resident from the start), its uses, and `n` for what is held to the end of the
step -- it sits idle. Such a gap (p, q) is what a plan may free, over its interior p+1..q-1:

  keep       stay resident;
  swap       swap_out to a host tier before step j, swap_in before step k  (p < j <= k <= q);
             for a gap that ends the step (q = n) only the swap_out;
  evict      like swap without the device-to-host copy: the host already holds the tensor
             (an earlier gap of it was swapped, or a static that starts on the host): free(t)
             before step j, swap_in before step k;
  host       a static tensor's gap before its first use: it starts the step on the host
             (Plan.on_host) and is swapped in before step k;
  recompute  replay its producer before its next use q (Capuchin): its inputs must be resident
             there -- kept, or reloaded for their own later use -- or are replayed first
             themselves, back to resident tensors (a chain of single-output ops, the dead
             intermediates living only during the replay).

Under every option the tensor's bytes are counted at step s of the interior unless j <= s < k,
so a plan's device bytes at an original step are the input plan's minus what its gaps free;
steps the planner inserts (swaps, frees, recomputes) sit between original steps, ordered
frees/swap-outs first, then swap-ins, then recomputes, and never hold more than the original
step after them (or before them, for swap-outs).

Only gaps whose interior holds a step over the budget are candidates: freeing anything else
cannot help. Times are integer ticks (a power-of-two fraction of a second, so binary-fraction
op times stay exact); T[s] is the start of original step s when nothing waits.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

import numpy as np

from memsched.cost import op_time
from memsched.hardware import Hardware
from memsched.memory import MemoryProfile, Residency, buffer_groups
from memsched.ops import draws_random
from memsched.schedule import Plan, RUNS, StepKind

TICKS_PER_STEP_TIME = 2**20     # resolution of the time axis: the step is about 2^20 ticks long
PREFETCH_MULTIPLES = (1, 2, 4, 8, 16)   # swap distances offered to the solver, in transfer times


@dataclass
class Gap:
    """One idle stretch of one tensor and what may be done with it (see the module docstring)."""

    index: int
    tensor: str
    nbytes: int
    p: int                      # anchor before (-1: resident from the start of the step)
    q: int                      # anchor after (n: held to the end of the step)
    ready: tuple[int, int]      # the tensor is ready for a copy at T[ready[0]] + D[ready[1]]
    modes: list[str]
    d_out: dict[str, int] = field(default_factory=dict)   # ticks per tier, device -> host
    d_in: dict[str, int] = field(default_factory=dict)    # ticks per tier, host -> device
    producer: str | None = None     # op whose output this is, replayed last by 'recompute'
    producer_step: int = -1
    replay: list[str] = field(default_factory=list)       # ops 'recompute' replays, in order
    rec_cost: int = 0               # ticks
    rec_extra: int = 0              # bytes the replay's dead intermediates add in slot q
    rec_inputs: list[int] = field(default_factory=list)   # candidate gaps of its leaves covering q
    earlier: list[int] = field(default_factory=list)      # earlier candidate gaps of the tensor
    J: list[int] = field(default_factory=list)            # release slots offered (j)
    K: list[int] = field(default_factory=list)            # reload slots offered (k)
    first_over: int = 0         # first and last over-budget steps of the interior
    last_over: int = 0
    tail: bool = False          # q is the end of the step: nothing to reload


@dataclass
class SwapProblem:
    """Everything the heuristic, the CP-SAT model and the emitter share."""

    plan: Plan
    hw: Hardware
    n: int
    tick: float                 # seconds per tick
    T: np.ndarray               # int64 [n+1]: start tick of step s; T[n] = the whole step
    durations: list[float]      # seconds per step (compute/recompute; 0 otherwise)
    live: np.ndarray            # int64 [n]: device bytes per step of the input plan
    fresh: np.ndarray           # int64 [n]: bytes step s allocates (outputs not in place)
    budget: int
    tiers: list[str]            # host tiers, DRAM first
    capacity: dict[str, int]
    gaps: list[Gap]

    def over(self) -> np.ndarray:
        return self.live > self.budget

    def budgets(self, choices) -> np.ndarray:
        """The budget per step, less what replays' intermediates need in their slot."""
        limit = np.full(self.n, self.budget, dtype=np.int64)
        for g, c in zip(self.gaps, choices):
            if c.mode == "recompute" and g.rec_extra:
                limit[g.q] -= g.rec_extra
        return limit


def find_problem(plan: Plan, profile: MemoryProfile, hw: Hardware, source, budget: int) -> SwapProblem:
    """Gaps, options and the time axis of `plan` (source: a Hardware or CostTable for op times)."""
    graph, schedule, n = plan.graph, plan.schedule, len(plan.schedule)
    durations = [op_time(graph.op_by_name[s.target], graph, source) if s.kind in RUNS
                 else 0.0 for s in schedule]
    total = sum(durations)
    tick = 2.0 ** math.floor(math.log2(total / TICKS_PER_STEP_TIME)) if total > 0 else 1e-6
    starts = np.concatenate([[0.0], np.cumsum(durations)])
    T = np.rint(starts / tick).astype(np.int64)
    tiers = [t for t in ("dram", "nvdimm") if t in hw.tiers] + [t for t in hw.tiers if t not in ("dram", "nvdimm")]
    fresh = np.zeros(n, dtype=np.int64)
    for r in profile.residencies:
        if r.shares_with is None and _maker(plan, r) == r.start:
            fresh[r.start] += r.nbytes
    problem = SwapProblem(plan, hw, n, tick, T, durations, profile.live_bytes.astype(np.int64), fresh, budget,
                      tiers, {t: hw.tier(t).capacity for t in tiers}, [])
    uses = _uses(plan)
    over = problem.over()
    over_steps = np.flatnonzero(over)
    gaps: list[Gap] = []
    sharers = _sharers(profile)
    for r in sorted(profile.residencies, key=lambda r: (r.tensor, r.index)):
        if r.nbytes == 0:
            continue
        for p, q, maker in _gap_bounds(plan, r, uses.get(r.tensor, []), n):
            p = _after_sharers(sharers[r.key], p, q)
            if p is None:
                continue
            g = _new_gap(problem, r, p, q, maker, len(gaps))
            lo, hi = bisect_left(over_steps, p + 1), bisect_right(over_steps, q - 1)
            if lo < hi:
                g.first_over, g.last_over = int(over_steps[lo]), int(over_steps[hi - 1])
                gaps.append(g)
    problem.gaps = _renumber(gaps)
    _link(problem, profile)
    for g in problem.gaps:
        _menus(problem, g)
    return problem


def _uses(plan: Plan) -> dict[str, list[int]]:
    """tensor -> steps that read it (compute/recompute inputs, swap-outs), ascending."""
    uses: dict[str, list[int]] = {}
    for i, step in enumerate(plan.schedule):
        if step.kind in RUNS:
            for t in dict.fromkeys(plan.graph.op_by_name[step.target].present_inputs):
                uses.setdefault(t, []).append(i)
        elif step.kind == StepKind.SWAP_OUT:
            uses.setdefault(step.target, []).append(i)
    return uses


def _maker(plan: Plan, r: Residency) -> int:
    """The step that made residency r (-1: resident from the start of the step)."""
    step = plan.schedule[r.start] if plan.schedule else None
    if step is not None and step.kind in RUNS:
        if r.tensor in plan.graph.op_by_name[step.target].present_outputs:
            return r.start
    if step is not None and step.kind == StepKind.SWAP_IN and step.target == r.tensor:
        return r.start
    return -1


def _sharers(profile: MemoryProfile) -> dict[tuple[str, int], list[Residency]]:
    """Residency key -> the other residencies in its storage buffer (views, in-place chains)."""
    return {r.key: [m for m in members if m.key != r.key]
            for members in buffer_groups(profile).values() for r in members}


def _after_sharers(sharers: list[Residency], p: int, q: int) -> int | None:
    """Where a gap (p, q) of a residency may start when others share its storage (a view, or
    the tensor it views): after the last of them that began before the gap ends, since moving
    the bytes frees nothing while one still holds them; None when one begins inside the gap
    or none leaves room (two steps)."""
    during = [m for m in sharers if m.start < q and m.end > p]
    if any(m.start > p for m in during):
        return None
    start = max([p] + [m.end for m in during])
    return start if q - start >= 2 else None


def _gap_bounds(plan: Plan, r: Residency, uses: list[int], n: int):
    """(p, q, maker) for each consecutive pair of anchors of r with at least one step between."""
    maker = _maker(plan, r)
    anchors = [maker] + [u for u in uses if r.start <= u <= r.end and u != maker]
    t = plan.graph.tensors[r.tensor]
    if r.end == n - 1 and (t.is_static or r.tensor in plan.graph.outputs) and anchors[-1] < n - 1:
        anchors.append(n)                       # held to the end of the step
    for p, q in zip(anchors, anchors[1:]):
        if q - p >= 2:
            yield p, q, maker


def _new_gap(problem: SwapProblem, r: Residency, p: int, q: int, maker: int, index: int) -> Gap:
    plan, n = problem.plan, problem.n
    t = plan.graph.tensors[r.tensor]
    static = t.is_static
    if p == maker:      # first gap of the residency: ready when its maker ends (time 0 if none)
        ready = (maker + 1, maker) if maker >= 0 else (0, -1)
    else:               # after a use: certainly ready when that use starts
        ready = (p, p)
    if static and p == -1:
        modes = ["keep", "host"]
    elif q == n:
        modes = ["keep", "swap", "evict"]
    else:
        modes = ["keep", "swap", "evict", "recompute"]
    g = Gap(index, r.tensor, r.nbytes, p, q, ready, modes, tail=q == n)
    for tier in problem.tiers:
        g.d_out[tier] = _ticks(problem.hw.transfer_time(r.nbytes, tier, "d2h"), problem.tick)
        g.d_in[tier] = _ticks(problem.hw.transfer_time(r.nbytes, tier, "h2d"), problem.tick)
    if "recompute" in modes and maker >= 0 and plan.schedule[maker].kind in RUNS:
        g.producer, g.producer_step = plan.schedule[maker].target, maker
    return g


def _ticks(seconds: float, tick: float) -> int:
    """Seconds to ticks, rounded up (a transfer or replay never looks shorter than it is)."""
    return max(0, math.ceil(seconds / tick - 1e-9))


def _renumber(gaps: list[Gap]) -> list[Gap]:
    for i, g in enumerate(gaps):
        g.index = i
    return gaps


def _link(problem: SwapProblem, profile: MemoryProfile) -> None:
    """Earlier gaps of the same tensor (for evict), and the recompute input conditions."""
    by_tensor: dict[str, list[Gap]] = {}
    for g in problem.gaps:
        by_tensor.setdefault(g.tensor, []).append(g)
    for gs in by_tensor.values():
        gs.sort(key=lambda g: g.p)
        for i, g in enumerate(gs):
            g.earlier = [h.index for h in gs[:i]]
            if not g.earlier and "evict" in g.modes:
                g.modes.remove("evict")
    residencies: dict[str, list[Residency]] = {}
    for r in profile.residencies:
        residencies.setdefault(r.tensor, []).append(r)
    computed_at = {s.target: i for i, s in enumerate(problem.plan.schedule) if s.kind == StepKind.COMPUTE}
    for g in problem.gaps:
        chain = _replay_chain(problem, g, residencies, computed_at) if g.producer is not None else None
        if chain is None:
            g.producer = None
            if "recompute" in g.modes:
                g.modes.remove("recompute")
            continue
        g.replay, leaves, g.rec_extra = chain
        g.rec_cost = sum(_ticks(problem.durations[computed_at[op]], problem.tick) for op in g.replay)
        # a leaf with a candidate gap across q: that gap must leave it resident there
        g.rec_inputs = [h.index for x in leaves for h in by_tensor.get(x, []) if h.p < g.q <= h.q - 1]


MAX_REPLAY = 12     # ops in one replay chain


def _replay_chain(problem: SwapProblem, g: Gap, residencies, computed_at) -> tuple[list[str], set[str], int] | None:
    """The ops to replay before step q to rebuild g's tensor from tensors resident there, the
    resident tensors read (leaves), and the bytes its dead intermediates add over what step q
    holds; None when it cannot be done (multi-output or update ops, dead graph inputs, ...)."""
    plan, q = problem.plan, g.q
    graph = plan.graph
    ops: dict[str, int] = {}
    leaves: set[str] = set()

    def resident(x: str) -> bool:
        return any(r.start <= q - 1 and r.end >= q for r in residencies.get(x, []))

    def visit(name: str) -> bool:
        if name in ops:
            return True
        op = graph.op_by_name[name]
        step = computed_at.get(name)
        if step is None or step >= q or len(op.present_outputs) != 1 or op.phase == "update" \
                or draws_random(op) or len(ops) >= MAX_REPLAY:
            return False
        ops[name] = step
        for x in dict.fromkeys(op.present_inputs):
            if x == g.tensor:
                return False
            if resident(x):
                leaves.add(x)
            elif x not in graph.producer or not visit(graph.producer[x].name):
                return False
        return True

    if not visit(g.producer):
        return None
    order = sorted(ops, key=ops.get)
    temps = {graph.op_by_name[o].present_outputs[0] for o in order} - {g.tensor}
    for o in order:                 # in place over a tensor that lives on: not while replaying
        source = plan.aliases.get(graph.op_by_name[o].present_outputs[0])
        if source is not None and source not in temps:
            return None
    return order, leaves, max(0, _replay_peak(graph, plan.aliases, order, temps) - int(problem.fresh[q]))


def _replay_peak(graph, aliases, order: list[str], temps: set[str]) -> int:
    """Most bytes the chain's intermediates hold at once while it runs (the memory model's
    rules: a step holds its inputs and outputs, an in-place output takes its input's bytes)."""
    last = {}
    for i, name in enumerate(order):
        for x in graph.op_by_name[name].present_inputs:
            if x in temps:
                last[x] = i
    alive = peak = 0
    for i, name in enumerate(order):
        out = graph.op_by_name[name].present_outputs[0]
        inplace = aliases.get(out) in temps and last.get(aliases.get(out)) == i
        new = graph.tensors[out].nbytes if out in temps and not inplace else 0
        peak = max(peak, alive + new)
        alive += new
        for x in dict.fromkeys(graph.op_by_name[name].present_inputs):
            if x in temps and last.get(x) == i and not (inplace and aliases.get(out) == x):
                alive -= graph.tensors[x].nbytes
    return peak


def _menus(problem: SwapProblem, g: Gap) -> None:
    """Release slots J and reload slots K offered to the solver.

    j: right after p, at the first over-budget step (latest release that still frees it), and
    where a swap-out started when the tensor is ready has had 1, 2, 4, ... transfer times to
    finish. k: q, right after the last over-budget step, and where 1, 2, 4, ... transfer times
    of compute remain before q (the prefetch distance the link needs)."""
    T, n = problem.T, problem.n
    lo_j, hi_j = g.p + 1, g.last_over
    J = {lo_j, g.first_over}
    ready = int(T[g.ready[0]])
    for d in set(g.d_out.values()):
        for m in PREFETCH_MULTIPLES:
            v = int(np.searchsorted(T, ready + m * d, side="left"))
            if lo_j <= v <= hi_j:
                J.add(v)
    g.J = sorted(v for v in J if lo_j <= v <= hi_j)
    if g.q == n:
        g.K = [n]
        return
    lo_k, hi_k = g.first_over + 1, g.q
    K = {hi_k, g.last_over + 1}
    for d in set(g.d_in.values()):
        for m in PREFETCH_MULTIPLES:
            v = int(np.searchsorted(T, T[g.q] - m * d, side="right")) - 1
            if lo_k <= v <= hi_k:
                K.add(v)
    g.K = sorted(v for v in K if lo_k <= v <= hi_k)
