"""The swap planner's CP-SAT model: keep / swap (per tier) / evict / host / recompute for every
candidate gap jointly, with where each swap-out and swap-in goes, minimising the delay the time
model of passes.swap.heuristic predicts (the two encode the same rules; `timeline` evaluates
them for fixed choices, which is how the heuristic's answer becomes a complete hint).

Per gap g: one mode literal each (swap/evict/host per tier), a one-hot release slot j over
g.J (plus q, which means keep) and a one-hot reload slot k over g.K (plus q).

Memory, exactly, in linear size: g frees its bytes at step s iff j <= s < k, i.e.
[j <= s] - [k <= s]. So the bytes freed at s, F(s) = F(s-1) + sum b_g [j_g = s] - sum b_g [k_g = s],
is a chain over the positions where anything changes, and F(s) >= live(s) - budget at every
over-budget step. Host tiers: each tensor that moves holds its bytes in its one tier over its
span (first gap to last gap, covering the simulator's first swap-out to last swap-in), a
chain per tier against the tier's capacity.

Time: D[s] (delay before step s) and D'[s] (delay once slot s's swap-outs are done) are
non-decreasing; a copy out is an interval that starts after its tensor is ready
(T[ready] + D[ready']) and after the previous copy out (link order: by release anchor p),
and ends by T[j] + D'[j]; a copy in starts after T[k] + D'[k], the previous copy in (order:
by use q) and its own copy out, and ends by T[q] + D[q]; D[s] >= D'[s] + replays in slot s.
Release slots follow link order, reload slots too (so the emitted schedule's stream order is
the model's). Objective: D[n-1], then fewer copies, DRAM before NVDIMM.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import reduce

from ortools.sat.python import cp_model

from memsched.deadline import Deadline

from memsched.passes import solver as cpsat
from memsched.passes.swap.gaps import Gap, SwapProblem
from memsched.passes.swap.heuristic import Choice, MOVING, Timing, in_order, out_order, timeline

# The swap model's deterministic seconds run slower than the other passes' models (0.05-0.2
# a wall second on the 2-core development machine, against 0.3 for an order window): its
# share of a limit in deterministic time (passes.solver.DETERMINISTIC_SHARE)
DETERMINISTIC_SHARE = 0.1
# Seconds to build the model per (release slot x reload slot) pair of a gap, a loaded core's
# figure (GPT-2 with 30 layers: 65,922 pairs, 8.7 s; BERT-base: 23,380, 5.6 s): passes.swap.planner
# builds no model priced at more than twice its time limit.
BUILD_COST = 1e-4


def build_seconds(problem: SwapProblem) -> float:
    """What building the model of `problem` is priced at (BUILD_COST per slot pair): a count,
    so whether the model is built depends on the problem and the time limit alone."""
    return BUILD_COST * sum(len(g.J) * len(g.K) for g in problem.gaps)


@dataclass
class Solved:
    choices: list[Choice] | None
    status: str          # optimal, feasible, or unknown when it found nothing
    delay: int | None    # ticks, the model's objective part
    bound: int | None    # ticks, proven lower bound on the delay
    seconds: float


def solve(problem: SwapProblem, hint: list[Choice], time_limit: float, started: float | None = None,
          deadline: Deadline | None = None) -> Solved:
    """Build the model with `hint` (a valid heuristic answer) as a complete hint and solve it
    in what is left of `time_limit` seconds counted from `started` (default now; never less
    than a tenth of a second of wall time), and before the command's `deadline`."""
    entered = time.perf_counter()
    begin = entered if started is None else started
    for g, c in zip(problem.gaps, hint):          # the hint's slots must be on offer
        if c.mode != "keep":
            if c.j not in g.J and c.j != g.q:
                g.J = sorted({*g.J, c.j})
            if c.k not in g.K:
                g.K = sorted({*g.K, c.k})
    model = _Model(problem)
    model.hint(hint, timeline(problem, hint))
    # presolve off: on graphs of thousands of steps it can use the whole limit before searching
    result = cpsat.solve(model.m, time_limit, presolve=False, started=begin, min_seconds=0.1, deadline=deadline,
                         share=DETERMINISTIC_SHARE)
    seconds = time.perf_counter() - entered
    if not result.has_solution:
        return Solved(None, result.status, None, None, seconds)
    solver = result.solver
    return Solved(model.read(solver), result.status, solver.Value(model.delay),
                  max(0, math.floor(result.bound / model.weight)), seconds)


class _Model:
    def __init__(self, problem: SwapProblem):
        self.p = problem
        self.m = cp_model.CpModel()
        gaps, n, T = problem.gaps, problem.n, problem.T
        horizon = int(T[n]) + sum(max(g.d_out.values(), default=0) + max(g.d_in.values(), default=0)
                                  + g.rec_cost for g in gaps) + 1
        self.horizon = horizon
        self.mode: list[dict[tuple[str, str | None], cp_model.IntVar]] = []
        self.jsel: list[dict[int, cp_model.IntVar]] = []
        self.ksel: list[dict[int, cp_model.IntVar]] = []
        for g in gaps:
            self._gap(g)
        self._tensors()
        self._memory()
        self._host()
        self._time()

    # ---- decisions --------------------------------------------------------------------
    def _gap(self, g: Gap) -> None:
        m, tiers = self.m, self.p.tiers
        modes = {}
        for mode in g.modes:
            for tier in (tiers if mode in MOVING else [None]):
                modes[(mode, tier)] = m.NewBoolVar(f"{mode}_{tier}_{g.index}")
        m.AddExactlyOne(modes.values())
        jvals = sorted({*g.J, g.q})
        kvals = sorted({*g.K, g.q})
        jsel = {v: m.NewBoolVar(f"j{v}_{g.index}") for v in jvals}
        ksel = {w: m.NewBoolVar(f"k{w}_{g.index}") for w in kvals}
        m.AddExactlyOne(jsel.values())
        m.AddExactlyOne(ksel.values())
        keep = modes[("keep", None)]
        m.Add(jsel[g.q] == keep)                    # j = q only for keep
        m.AddImplication(keep, ksel[g.q])
        first = g.p + 1
        for (mode, _), lit in modes.items():
            if mode in ("recompute", "host", "evict"):
                m.AddImplication(lit, jsel[first])
            if mode == "recompute":
                m.AddImplication(lit, ksel[g.q])
        for v in jvals:                             # out strictly before back in
            for w in kvals:
                if v >= w and not (v == g.q and w == g.q):
                    m.AddBoolOr([jsel[v].Not(), ksel[w].Not()])
        for tier in tiers:                          # evict needs a copy made by an earlier gap
            if ("evict", tier) in modes:
                roots = [self.mode[h][(mode, tier)] for h in g.earlier for mode in ("swap", "host")
                         if (mode, tier) in self.mode[h]]
                m.Add(modes[("evict", tier)] <= sum(roots))
        self.mode.append(modes)
        self.jsel.append(jsel)
        self.ksel.append(ksel)

    def _tensors(self) -> None:
        """A replay's inputs are resident at its slot (released after it, or reloaded by then);
        one host tier per tensor."""
        m = self.m
        self.waits = []                 # (replay gap, input gap, literal: the input is reloaded for it)
        for g in self.p.gaps:
            rec = self.mode[g.index].get(("recompute", None))
            for h in g.rec_inputs if rec is not None else ():
                kept = [lit for v, lit in self.jsel[h].items() if v > g.q]
                back = [lit for w, lit in self.ksel[h].items() if w <= g.q]
                m.Add(rec <= sum(kept) + sum(back))
                if back:
                    wait = m.NewBoolVar(f"wait_{g.index}_{h}")
                    m.Add(wait >= rec + sum(back) - 1)
                    self.waits.append((g, h, wait))
        self.uses: dict[str, dict[str, object]] = {}
        by_tensor: dict[str, list[Gap]] = {}
        for g in self.p.gaps:
            by_tensor.setdefault(g.tensor, []).append(g)
        for tensor, gs in by_tensor.items():
            per_tier = {}
            for tier in self.p.tiers:
                lits = [self.mode[g.index][(mode, tier)] for g in gs for mode in MOVING
                        if (mode, tier) in self.mode[g.index]]
                if not lits:
                    continue
                if len(lits) == 1:
                    per_tier[tier] = lits[0]
                else:
                    use = m.NewBoolVar(f"use_{tier}_{tensor}")
                    for lit in lits:
                        m.AddImplication(lit, use)
                    m.Add(use <= sum(lits))
                    per_tier[tier] = use
            if len(per_tier) > 1:
                m.AddAtMostOne(per_tier.values())
            self.uses[tensor] = per_tier
        self.by_tensor = by_tensor

    # ---- memory -------------------------------------------------------------------------
    def _memory(self) -> None:
        p, m = self.p, self.m
        excess = {int(s): int(p.live[s]) - p.budget for s in range(p.n) if p.live[s] > p.budget}
        unit = reduce(math.gcd, [g.nbytes for g in p.gaps], 0) or 1
        self.unit = unit
        delta: dict[int, list] = {}
        for g in p.gaps:
            b = g.nbytes // unit
            for v, lit in self.jsel[g.index].items():
                delta.setdefault(v, []).append(b * lit)
            for w, lit in self.ksel[g.index].items():
                delta.setdefault(w, []).append(-b * lit)
        total = sum(g.nbytes // unit for g in p.gaps)
        prev = 0
        self.freed = {}
        for s in sorted(set(delta) | set(excess)):
            if s >= p.n:
                break
            f = m.NewIntVar(0, total, f"F{s}")
            m.Add(f == prev + sum(delta.get(s, [])))
            if s in excess:
                m.Add(f >= -(-excess[s] // unit))
            self.freed[s] = f
            prev = f
        for g in p.gaps:                    # a replay's intermediates need room in its slot
            rec = self.mode[g.index].get(("recompute", None))
            need = int(p.live[g.q]) + g.rec_extra - p.budget if rec is not None and g.rec_extra else 0
            if need > 0:
                m.Add(self.freed[g.q] >= -(-need // unit)).OnlyEnforceIf(rec)

    def _host(self) -> None:
        p, m = self.p, self.m
        spans = {}
        for tensor, gs in self.by_tensor.items():
            lo = min(max(g.p + 1, 0) for g in gs)
            hi = min(max(g.q for g in gs), p.n - 1)
            spans[tensor] = (lo, hi, gs[0].nbytes)
        for tier in p.tiers:
            cap = p.capacity[tier]
            moving = [t for t in spans if tier in self.uses[t]]
            if sum(spans[t][2] for t in moving) <= cap:
                continue
            delta: dict[int, list] = {}
            for t in moving:
                lo, hi, b = spans[t]
                delta.setdefault(lo, []).append(b // self.unit * self.uses[t][tier])
                delta.setdefault(hi + 1, []).append(-(b // self.unit) * self.uses[t][tier])
            prev = 0
            limit = cap // self.unit
            for s in sorted(delta):
                h = m.NewIntVar(0, sum(spans[t][2] // self.unit for t in moving), f"H{tier}{s}")
                m.Add(h == prev + sum(delta[s]))
                m.Add(h <= limit)
                prev = h

    # ---- time ---------------------------------------------------------------------------
    def _time(self) -> None:
        p, m, n, T = self.p, self.m, self.p.n, self.p.T
        gaps, H = p.gaps, self.horizon
        outs = [g for g in gaps if any(mode == "swap" for mode, _ in self.mode[g.index])]
        outs.sort(key=lambda g: (g.p, g.index))
        ins = [g for g in gaps if not g.tail and any(mode in MOVING for mode, _ in self.mode[g.index])]
        ins.sort(key=lambda g: (g.q, g.index))
        rec_at: dict[int, list] = {}
        for g in gaps:
            if ("recompute", None) in self.mode[g.index]:
                rec_at.setdefault(g.q, []).append(g.rec_cost * self.mode[g.index][("recompute", None)])
        slots = set()
        for g in outs:
            slots.update(v for v in self.jsel[g.index] if v != g.q)
        for g in ins:
            slots.update(w for w in self.ksel[g.index])
        positions = {n - 1}
        for s in slots | set(rec_at):
            positions.update((s - 1, s))
        positions.update(g.ready[1] for g in outs)
        positions.update(g.q for g in ins)
        positions = sorted(x for x in positions if 0 <= x < n)
        D = {}
        prev = None
        for s in positions:
            D[s] = m.NewIntVar(0, H, f"D{s}")
            if prev is not None:
                m.Add(D[s] >= prev)
            prev = D[s]
        Dp = {}
        for s in sorted(slots):
            if s >= n:
                continue
            Dp[s] = m.NewIntVar(0, H, f"Dp{s}")
            if s - 1 >= 0:
                m.Add(Dp[s] >= D[s - 1])
            m.Add(D[s] >= Dp[s] + sum(rec_at.get(s, [])))
        for s, costs in rec_at.items():
            if s not in Dp:
                m.Add(D[s] >= (D[s - 1] if s - 1 >= 0 else 0) + sum(costs))
        self.D, self.Dp, self.delay = D, Dp, D[n - 1]

        def at(x: int):
            return D[x] if x >= 0 else 0

        self.out_vars, self.in_vars = {}, {}
        link = (0, 0)                   # (when the link is free, the last slot used on it)
        for g in outs:
            swaps = {lit: g.d_out[tier] for (mode, tier), lit in self.mode[g.index].items() if mode == "swap"}
            on, start, end, *link = self._copy(g, "out", swaps, self.jsel[g.index], *link)
            m.Add(start >= int(T[g.ready[0]]) + at(g.ready[1])).OnlyEnforceIf(on)
            for v, lit in self.jsel[g.index].items():
                if v != g.q:
                    m.Add(end <= int(T[v]) + Dp[v]).OnlyEnforceIf([lit, on])
            self.out_vars[g.index] = (on, start, end, *link)
        link = (0, 0)
        for g in ins:
            moving = {lit: g.d_in[tier] for (mode, tier), lit in self.mode[g.index].items() if mode in MOVING}
            on, start, end, *link = self._copy(g, "in", moving, self.ksel[g.index], *link)
            for w, lit in self.ksel[g.index].items():
                m.Add(start >= int(T[w]) + Dp[w]).OnlyEnforceIf([lit, on])
            if g.index in self.out_vars:
                out_on, _, out_end, _, _ = self.out_vars[g.index]
                m.Add(start >= out_end).OnlyEnforceIf(out_on)
            m.Add(end <= int(T[g.q]) + D[g.q]).OnlyEnforceIf(on)
            self.in_vars[g.index] = (on, start, end, *link)

        penalty = []
        for g in gaps:
            for (mode, tier), lit in self.mode[g.index].items():
                cost = {"keep": 0, "swap": 2, "evict": 1, "host": 1, "recompute": 1}[mode]
                cost += 1 if tier is not None and tier != p.tiers[0] else 0
                if cost:
                    penalty.append(cost * lit)
        for g, h, wait in self.waits:          # a replay waits for the inputs reloaded for it
            if h in self.in_vars:
                m.Add(self.in_vars[h][2] + g.rec_cost <= int(T[g.q]) + D[g.q]).OnlyEnforceIf(wait)
        self.weight = 3 * len(gaps) + 1
        m.Minimize(self.weight * self.delay + sum(penalty))

    def _copy(self, g: Gap, tag: str, durations: dict, slot: dict, free, last):
        """One copy on a link, present when one of `durations`' literals is: it starts after the
        previous copy on that link ends (FIFO in link order) and its slot is no earlier than
        the previous one's, so the emitted schedule's stream order is the model's.
        Returns (present, start, end, link free after it, last slot after it)."""
        m, H = self.m, self.horizon
        on = m.NewBoolVar(f"{tag}_{g.index}")
        m.Add(on == sum(durations))
        start, end = m.NewIntVar(0, 2 * H, f"s{tag}{g.index}"), m.NewIntVar(0, 2 * H, f"e{tag}{g.index}")
        m.Add(end == start + sum(d * lit for lit, d in durations.items()))
        m.Add(start >= free).OnlyEnforceIf(on)
        nfree = m.NewIntVar(0, 2 * H, f"f{tag}{g.index}")
        m.Add(nfree >= free)
        m.Add(nfree >= end).OnlyEnforceIf(on)
        at = sum(v * lit for v, lit in slot.items())
        nlast = m.NewIntVar(0, self.p.n, f"g{tag}{g.index}")
        m.Add(nlast >= last)
        m.Add(nlast >= at).OnlyEnforceIf(on)
        m.Add(at >= last).OnlyEnforceIf(on)
        return on, start, end, nfree, nlast

    # ---- hint and read-back -------------------------------------------------------------
    def hint(self, choices: list[Choice], timing: Timing) -> None:
        m, p = self.m, self.p
        for g, c in zip(p.gaps, choices):
            for (mode, tier), lit in self.mode[g.index].items():
                m.AddHint(lit, mode == c.mode and (tier == c.tier or mode not in MOVING))
            for v, lit in self.jsel[g.index].items():
                m.AddHint(lit, v == c.j)
            for w, lit in self.ksel[g.index].items():
                m.AddHint(lit, w == c.k)
        for s, var in self.D.items():
            m.AddHint(var, int(timing.D[s]))
        for s, var in self.Dp.items():
            m.AddHint(var, int(timing.Dp[s]))
        for order, vars_, times, pick in ((out_order(p, choices), self.out_vars, timing.outs, lambda c: c.j),
                                          (in_order(p, choices), self.in_vars, timing.ins, lambda c: c.k)):
            on_set = {g.index for g in order}
            free, last = 0, 0
            for index, (on, start, end, nfree, nlast) in vars_.items():
                present = index in on_set
                m.AddHint(on, present)
                if present:
                    s, e = times[index]
                    free, last = max(free, e), max(last, pick(choices[index]))
                else:
                    s = e = free
                m.AddHint(start, s)
                m.AddHint(end, e)
                m.AddHint(nfree, free)
                m.AddHint(nlast, last)
        freed = {}
        level = 0
        changes: dict[int, int] = {}
        for g, c in zip(p.gaps, choices):
            b = g.nbytes // self.unit
            changes[c.j] = changes.get(c.j, 0) + b
            changes[c.k] = changes.get(c.k, 0) - b
        for s in sorted(set(changes) | set(self.freed)):
            level += changes.get(s, 0)
            freed[s] = level
        for s, var in self.freed.items():
            m.AddHint(var, freed[s])
        for g, h, wait in self.waits:
            m.AddHint(wait, choices[g.index].mode == "recompute" and choices[h].mode in MOVING
                      and choices[h].k <= g.q)
        for tensor, per_tier in self.uses.items():
            tiers = {c.tier for g in self.by_tensor[tensor] for c in [choices[g.index]] if c.mode in MOVING}
            for tier, lit in per_tier.items():
                if isinstance(lit, cp_model.IntVar) and lit.Name().startswith("use_"):
                    m.AddHint(lit, tier in tiers)

    def read(self, solver: cp_model.CpSolver) -> list[Choice]:
        choices = []
        for g in self.p.gaps:
            mode, tier = next(key for key, lit in self.mode[g.index].items() if solver.BooleanValue(lit))
            j = next(v for v, lit in self.jsel[g.index].items() if solver.BooleanValue(lit))
            k = next(w for w, lit in self.ksel[g.index].items() if solver.BooleanValue(lit))
            choices.append(Choice(mode, tier, j, k))
        return choices
