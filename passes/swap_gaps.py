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
  recompute  replay its producer before its next use q (Capuchin): only for a tensor made by a
             single-output op whose inputs are resident there anyway.

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
from memsched.memory import MemoryProfile, Residency
from memsched.schedule import Plan

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
    residency: tuple[str, int]  # the memory model's residency key
    static: bool
    ready: tuple[int, int]      # the tensor is ready for a copy at T[ready[0]] + D[ready[1]]
    modes: list[str]
    d_out: dict[str, int] = field(default_factory=dict)   # ticks per tier, device -> host
    d_in: dict[str, int] = field(default_factory=dict)    # ticks per tier, host -> device
    producer: str | None = None     # op replayed by 'recompute'
    producer_step: int = -1
    rec_cost: int = 0               # ticks
    rec_inputs: list[int] = field(default_factory=list)   # candidate gaps of its inputs covering q
    earlier: list[int] = field(default_factory=list)      # earlier candidate gaps of the tensor
    J: list[int] = field(default_factory=list)            # release slots offered (j)
    K: list[int] = field(default_factory=list)            # reload slots offered (k)
    first_over: int = 0         # first and last over-budget steps of the interior
    last_over: int = 0
    tail: bool = False          # q is the end of the step: nothing to reload


@dataclass
class Problem:
    """Everything the heuristic, the CP-SAT model and the emitter share."""

    plan: Plan
    hw: Hardware
    n: int
    tick: float                 # seconds per tick
    T: np.ndarray               # int64 [n+1]: start tick of step s; T[n] = the whole step
    durations: list[float]      # seconds per step (compute/recompute; 0 otherwise)
    live: np.ndarray            # int64 [n]: device bytes per step of the input plan
    budget: int
    tiers: list[str]            # host tiers, DRAM first
    capacity: dict[str, int]
    gaps: list[Gap]
    all_gaps: list[Gap]         # every gap with an interior (candidates or not): the floor on memory

    def over(self) -> np.ndarray:
        return self.live > self.budget


def find_problem(plan: Plan, profile: MemoryProfile, hw: Hardware, source, budget: int) -> Problem:
    """Gaps, options and the time axis of `plan` (source: a Hardware or CostTable for op times)."""
    graph, schedule, n = plan.graph, plan.schedule, len(plan.schedule)
    durations = [op_time(graph.op_by_name[s.target], graph, source) if s.kind in ("compute", "recompute")
                 else 0.0 for s in schedule]
    total = sum(durations)
    tick = 2.0 ** math.floor(math.log2(total / TICKS_PER_STEP_TIME)) if total > 0 else 1e-6
    starts = np.concatenate([[0.0], np.cumsum(durations)])
    T = np.rint(starts / tick).astype(np.int64)
    tiers = [t for t in ("dram", "nvdimm") if t in hw.tiers] + [t for t in hw.tiers if t not in ("dram", "nvdimm")]
    problem = Problem(plan, hw, n, tick, T, durations, profile.live_bytes.astype(np.int64), budget, tiers,
                      {t: hw.tier(t).capacity for t in tiers}, [], [])
    uses = _uses(plan)
    over = problem.over()
    over_steps = np.flatnonzero(over)
    gaps: list[Gap] = []
    for r in sorted(profile.residencies, key=lambda r: (r.tensor, r.index)):
        if r.nbytes == 0:
            continue
        for p, q, maker in _gap_bounds(plan, r, uses.get(r.tensor, []), n):
            g = _new_gap(problem, r, p, q, maker, len(problem.all_gaps))
            problem.all_gaps.append(g)
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
        if step.kind in ("compute", "recompute"):
            for t in dict.fromkeys(plan.graph.op_by_name[step.target].present_inputs):
                uses.setdefault(t, []).append(i)
        elif step.kind == "swap_out":
            uses.setdefault(step.target, []).append(i)
    return uses


def _maker(plan: Plan, r: Residency) -> int:
    """The step that made residency r (-1: resident from the start of the step)."""
    step = plan.schedule[r.start] if plan.schedule else None
    if step is not None and step.kind in ("compute", "recompute"):
        if r.tensor in plan.graph.op_by_name[step.target].present_outputs:
            return r.start
    if step is not None and step.kind == "swap_in" and step.target == r.tensor:
        return r.start
    return -1


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


def _new_gap(problem: Problem, r: Residency, p: int, q: int, maker: int, index: int) -> Gap:
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
    g = Gap(index, r.tensor, r.nbytes, p, q, r.key, static, ready, modes, tail=q == n)
    for tier in problem.tiers:
        g.d_out[tier] = _ticks(problem.hw.transfer_time(r.nbytes, tier, "d2h"), problem.tick)
        g.d_in[tier] = _ticks(problem.hw.transfer_time(r.nbytes, tier, "h2d"), problem.tick)
    if "recompute" in modes and maker >= 0 and plan.schedule[maker].kind in ("compute", "recompute"):
        op = plan.graph.op_by_name[plan.schedule[maker].target]
        if len(op.present_outputs) == 1 and r.tensor not in plan.aliases and op.phase != "update":
            g.producer, g.producer_step = op.name, maker
            g.rec_cost = _ticks(problem.durations[maker], problem.tick)
    return g


def _ticks(seconds: float, tick: float) -> int:
    """Seconds to ticks, rounded up (a transfer or replay never looks shorter than it is)."""
    return max(0, math.ceil(seconds / tick - 1e-9))


def _renumber(gaps: list[Gap]) -> list[Gap]:
    for i, g in enumerate(gaps):
        g.index = i
    return gaps


def _link(problem: Problem, profile: MemoryProfile) -> None:
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
    graph = problem.plan.graph
    for g in problem.gaps:
        if g.producer is None:
            if "recompute" in g.modes:
                g.modes.remove("recompute")
            continue
        ok = True
        for x in dict.fromkeys(graph.op_by_name[g.producer].present_inputs):
            # x must be resident across the boundary into step q in the input plan ...
            if x == g.tensor or not any(r.start <= g.q - 1 and r.end >= g.q for r in residencies.get(x, [])):
                ok = False
                break
            # ... and, if a candidate gap of x spans that boundary, that gap must keep it there
            g.rec_inputs += [h.index for h in by_tensor.get(x, []) if h.p < g.q <= h.q - 1]
        if not ok:
            g.producer = None
            g.rec_inputs = []
            g.modes.remove("recompute")


def _menus(problem: Problem, g: Gap) -> None:
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
