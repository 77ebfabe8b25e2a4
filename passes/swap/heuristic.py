"""The swap planner's heuristic: a valid plan fast, the CP-SAT model's warm start and fallback.

Three phases over the gaps of passes.swap.gaps:
1. memory: in order of how easily they hide -- statics that can start on the host first (no
   copy out), then the longest idle interval per transfer time (TFLMS: per byte; or the
   longest idle interval, or the earliest ready: SELECT_ORDERS, each tried), tiny tensors
   whose copies are mostly latency last -- free each gap that covers a step still
   over the budget, as aggressively as possible (out right after p, back right before q);
   host tiers first-fit, DRAM before NVDIMM; recompute where no host tier has room. Then
   undo the picks later ones made unnecessary, turn a second swap of a tensor the host
   already holds into an evict, and re-deal tiers: when DRAM cannot hold every tensor, the
   ones whose idle interval hides NVDIMM's slower transfer best go there.
2. placement: relax each swap so its transfer hides behind compute, as far as memory lets:
   the swap-out is released where its copy (started when the tensor is ready, queued behind
   the earlier ones on the device-to-host link) is done; the swap-in is issued just early
   enough that the host-to-device queue, filled backwards from the last use, finishes it
   before its use (the prefetch distance comes from op and transfer times, not a fixed N).
3. exchange: where the model timeline still waits, replace swaps by replays of their
   producers when that costs less time (Capuchin; the replay's inputs are kept or reloaded
   in time for it), all the clearly cheaper ones at once, then one by one, keeping each
   change that lowers the predicted delay.

`timeline` is the time model the CP-SAT model encodes, evaluated for fixed choices: the
compute stream runs the original steps at T[s] + D[s], where D[s] is the delay (waits on
transfers, replays) accumulated before step s; a copy out starts when its tensor is ready and
the previous copy out is done and must end before the first step after its release slot j
(the simulator's rule: later allocations wait for it); a copy in starts when compute reaches
its slot k, the previous copy in and every earlier copy out are done, and must end before its
use q (a replay that reads it: before the replay). Frees/swap-outs precede swap-ins, which
precede recomputes, in a slot.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from memsched.deadline import Deadline
from memsched.passes.swap.gaps import Gap, SwapProblem

MOVING = ("swap", "evict", "host")      # modes that put the tensor on a host tier
TRIALS = 64                             # phase 3's replay trials per phase-1 order, at most, and
TRIAL_STEPS = 300_000                   # the (steps + gaps) they may cover in all: each trial places and
                                        # times every gap over every step (BERT-base: 3,801 a trial, all 64;
                                        # GPT-2 with 60 layers: ~20,000, 15)


@dataclass(frozen=True)
class Choice:
    """What one gap does: mode, host tier, release slot j and reload slot k (keep: j = k = q)."""

    mode: str
    tier: str | None = None
    j: int = 0
    k: int = 0


def keep(g: Gap) -> Choice:
    return Choice("keep", None, g.q, g.q)


def freeing(g: Gap, mode: str, tier: str | None = None) -> Choice:
    """The mode with the most memory freed: gone right after p, back right before q."""
    return Choice(mode, tier, g.p + 1, g.q)


def reloads(g: Gap, c: Choice) -> bool:
    return c.mode in MOVING and not g.tail


@dataclass
class Timing:
    """The time model for fixed choices (ticks): delays and transfer intervals."""

    D: np.ndarray                       # delay before step s (after the slot's waits and replays)
    Dp: np.ndarray                      # delay once slot s's swap-outs are done (swap-ins start after)
    outs: dict[int, tuple[int, int]]    # gap index -> (start, end) of its copy out
    ins: dict[int, tuple[int, int]]     # gap index -> (start, end) of its copy in

    @property
    def delay(self) -> int:
        return int(self.D[-1])


def out_order(problem: SwapProblem, choices: list[Choice]) -> list[Gap]:
    """Copies out in link order: by release anchor p (the emitter orders swap-outs so)."""
    return sorted((g for g in problem.gaps if choices[g.index].mode == "swap"), key=lambda g: (g.p, g.index))


def in_order(problem: SwapProblem, choices: list[Choice]) -> list[Gap]:
    """Copies in in link order: by use q."""
    return sorted((g for g in problem.gaps if reloads(g, choices[g.index])), key=lambda g: (g.q, g.index))


def timeline(problem: SwapProblem, choices: list[Choice]) -> Timing:
    """Evaluate the time model (see the module docstring) in one sweep over the steps."""
    n, T = problem.n, problem.T
    outs, ins = out_order(problem, choices), in_order(problem, choices)
    out_at, in_at = defaultdict(list), defaultdict(list)
    for i, g in enumerate(outs):
        out_at[choices[g.index].j].append(i)
    for i, g in enumerate(ins):
        in_at[g.q].append(i)
    rec = defaultdict(int)
    waits = defaultdict(list)       # slot -> (input gap reloaded for a replay there, replay cost)
    for g in problem.gaps:
        if choices[g.index].mode == "recompute":
            rec[g.q] += g.rec_cost
            waits[g.q] += [(h, g.rec_cost) for h in g.rec_inputs if reloads(problem.gaps[h], choices[h])]
    in_pos = {g.index: i for i, g in enumerate(ins)}
    D = np.zeros(n + 1, dtype=np.int64)
    Dp = np.zeros(n + 1, dtype=np.int64)
    out_pos = {g.index: i for i, g in enumerate(outs)}
    out_t: dict[int, tuple[int, int]] = {}
    in_t: dict[int, tuple[int, int]] = {}
    state = {"out": 0, "out_free": 0, "in": 0, "in_free": 0}

    def at(x: int) -> int:
        return int(D[x]) if x >= 0 else 0

    def run_outs(upto: int) -> None:
        while state["out"] <= upto:
            g = outs[state["out"]]
            start = max(int(T[g.ready[0]]) + at(g.ready[1]), state["out_free"])
            end = start + g.d_out[choices[g.index].tier]
            out_t[g.index] = (start, end)
            state["out_free"] = end
            state["out"] += 1

    def run_ins(upto: int) -> None:
        while state["in"] <= upto:
            g = ins[state["in"]]
            c = choices[g.index]
            start = max(int(T[c.k]) + int(Dp[c.k]), state["in_free"])
            if c.mode == "swap":
                run_outs(out_pos[g.index])
                start = max(start, out_t[g.index][1])
            end = start + g.d_in[c.tier]
            in_t[g.index] = (start, end)
            state["in_free"] = end
            state["in"] += 1

    for s in range(n):
        base = at(s - 1)
        for i in out_at.get(s, ()):
            run_outs(i)
            base = max(base, out_t[outs[i].index][1] - int(T[s]))
        Dp[s] = base
        d = base + rec.get(s, 0)
        for h, cost in waits.get(s, ()):
            run_ins(in_pos[h])
            d = max(d, in_t[h][1] - int(T[s]) + cost)
        for i in in_at.get(s, ()):
            run_ins(i)
            d = max(d, in_t[ins[i].index][1] - int(T[s]))
        D[s] = d
    D[n] = D[n - 1] if n else 0
    run_outs(len(outs) - 1)          # copies released nowhere (none by construction) still take time
    return Timing(D, Dp, out_t, in_t)


def freed(problem: SwapProblem, choices: list[Choice]) -> np.ndarray:
    """Bytes each gap's choice frees at every original step (difference array over [j, k))."""
    diff = np.zeros(problem.n + 1, dtype=np.int64)
    for g in problem.gaps:
        c = choices[g.index]
        if c.mode != "keep":
            lo, hi = max(c.j, g.p + 1), min(c.k, g.q, problem.n)
            if lo < hi:
                diff[lo] += g.nbytes
                diff[hi] -= g.nbytes
    return np.cumsum(diff)[:problem.n]


# ---- phase 1: memory ---------------------------------------------------------------------
class HostSpace:
    """Bytes held per host tier over the steps, per tensor over [first gap, last gap]
    (covers the simulator's span from the first swap-out to the last swap-in)."""

    def __init__(self, problem: SwapProblem):
        self.problem = problem
        self.used = {t: np.zeros(problem.n + 1, dtype=np.int64) for t in problem.tiers}
        self.tier_of: dict[str, str] = {}
        spans: dict[str, list[int]] = {}
        for g in problem.gaps:
            lo, hi = max(g.p + 1, 0), min(g.q, problem.n - 1)
            span = spans.setdefault(g.tensor, [lo, hi])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
        self.spans = spans

    def fits(self, tensor: str, nbytes: int, tier: str) -> bool:
        lo, hi = self.spans[tensor]
        return int(self.used[tier][lo:hi + 1].max(initial=0)) + nbytes <= self.problem.capacity[tier]

    def take(self, tensor: str, nbytes: int, tier: str) -> None:
        lo, hi = self.spans[tensor]
        self.used[tier][lo:hi + 1] += nbytes
        self.tier_of[tensor] = tier


def _idle(problem: SwapProblem, g: Gap) -> int:
    return int(problem.T[g.q if not g.tail else problem.n] - problem.T[g.ready[0]])


def _rec_ok(g: Gap, choices: list[Choice]) -> bool:
    """Recompute needs the producer's inputs resident at q: here, their gaps released after q."""
    return g.producer is not None and all(choices[h].j > g.q for h in g.rec_inputs)


def _option(problem: SwapProblem, g: Gap, choices: list[Choice], host: HostSpace) -> Choice | None:
    """How g frees its interior now: start on the host (statics), swap to the tensor's tier or
    the first tier with room, else recompute; None if none is possible."""
    tier = host.tier_of.get(g.tensor)
    tiers = [tier] if tier else [t for t in problem.tiers if host.fits(g.tensor, g.nbytes, t)]
    if "host" in g.modes and tiers:
        return freeing(g, "host", tiers[0])
    if "swap" in g.modes and tiers:
        return freeing(g, "swap", tiers[0])
    if "recompute" in g.modes and _rec_ok(g, choices):
        return freeing(g, "recompute")
    return None


# Phase 1's orders among the gaps that hide well: the longest idle interval per transfer time
# (TFLMS: per byte) frees most per copy; the longest idle interval, or the earliest ready, frees
# the tensors with the most time around their copies, where a link near the budget's peak is
# busy (ResNet-50 batch 980 recomputed to 1.75x the device: 0.51 s of modelled delay by idle
# per byte, 0.25 s by idle). `heuristic` runs each and keeps the least delay.
SELECT_ORDERS = {
    "idle per transfer time": lambda idle, moved, g: -idle / max(moved, 1),
    "idle": lambda idle, moved, g: -idle,
    "first ready": lambda idle, moved, g: g.ready[0],
}


def _priority(problem: SwapProblem, g: Gap, order: str) -> tuple:
    """Lower is better: statics that start on the host (no copy out); then tensors whose copies
    are mostly bandwidth rather than per-transfer latency (tiny tensors free little and cost a
    latency each); then by the SELECT_ORDERS entry `order`."""
    first = problem.tiers[0]
    copies = 1 if "host" in g.modes else 2
    moved = g.d_in[first] + (g.d_out[first] if copies == 2 else 0)
    latency_bound = moved < 2 * copies * _ticks_of_latency(problem, first)    # bytes/bandwidth < latency
    return (copies, latency_bound, SELECT_ORDERS[order](_idle(problem, g), moved, g), -g.nbytes, g.index)


def _ticks_of_latency(problem: SwapProblem, tier: str) -> int:
    """Ticks a zero-byte transfer takes (link and tier latency)."""
    return int(problem.hw.transfer_time(0, tier, "h2d") / problem.tick)


def select(problem: SwapProblem, require: bool = True, order: str = "idle per transfer time") -> list[Choice] | None:
    """Phase 1: free gaps in the SELECT_ORDERS entry `order` until every step fits the budget;
    None when it cannot be done (with require=False: as far as it gets, which with a zero
    budget is everything that can move)."""
    gaps, n = problem.gaps, problem.n
    choices = [keep(g) for g in gaps]
    live = problem.live.copy()
    limit = problem.budgets(choices)
    host = HostSpace(problem)
    dependents: dict[int, list[Gap]] = defaultdict(list)    # recompute gaps needing g's tensor
    for g in gaps:
        for h in g.rec_inputs:
            dependents[h].append(g)
    picked: list[Gap] = []
    for g in sorted(gaps, key=lambda g: _priority(problem, g, order)):
        if not (live > limit).any():
            break
        lo, hi = g.p + 1, min(g.q, n)
        if not (live[lo:hi] > limit[lo:hi]).any():
            continue
        if any(choices[d.index].mode == "recompute" for d in dependents[g.index]):
            continue
        c = _option(problem, g, choices, host)
        if c is None or (c.mode == "recompute" and live[g.q] + g.rec_extra > limit[g.q]):
            continue
        choices[g.index] = c
        if c.tier and g.tensor not in host.tier_of:
            host.take(g.tensor, g.nbytes, c.tier)
        if c.mode == "recompute":
            limit[g.q] -= g.rec_extra
        live[lo:hi] -= g.nbytes
        picked.append(g)
    if (live > limit).any() and require:
        return None
    for g in reversed(picked):              # undo what the later picks made unnecessary
        lo, hi = g.p + 1, min(g.q, n)
        if (live[lo:hi] + g.nbytes <= limit[lo:hi]).all():
            live[lo:hi] += g.nbytes
            if choices[g.index].mode == "recompute":
                limit[g.q] += g.rec_extra
            choices[g.index] = keep(g)
    return retier(problem, _chain(problem, choices))


def _chain(problem: SwapProblem, choices: list[Choice]) -> list[Choice]:
    """A later swap of a tensor the host already holds (same tier) needs no copy out: evict."""
    held: set[str] = set()
    out = list(choices)
    for g in sorted(problem.gaps, key=lambda g: (g.p, g.index)):
        c = out[g.index]
        if c.mode == "swap" and g.tensor in held and "evict" in g.modes:
            out[g.index] = replace(c, mode="evict")
        if c.mode in ("swap", "host"):
            held.add(g.tensor)
    return out


def retier(problem: SwapProblem, choices: list[Choice]) -> list[Choice]:
    """When some tensors had to go to a slower tier, give DRAM (the first tier) to the tensors
    whose idle interval hides the slower tier's transfer worst. Keeps `choices` if the re-deal
    does not fit."""
    moved: dict[str, list[Gap]] = defaultdict(list)
    for g in problem.gaps:
        if choices[g.index].mode in MOVING:
            moved[g.tensor].append(g)
    tiers_used = {choices[gs[0].index].tier for gs in moved.values()}
    if len(tiers_used) < 2:
        return choices
    slow = problem.tiers[-1]

    def slack(gs: list[Gap]) -> int:
        return min(_idle(problem, g) - g.d_in[slow] - g.d_out[slow] for g in gs)

    host = HostSpace(problem)
    deal: dict[str, str] = {}
    for tensor, gs in sorted(moved.items(), key=lambda kv: (slack(kv[1]), kv[0])):
        nbytes = gs[0].nbytes
        tier = next((t for t in problem.tiers if host.fits(tensor, nbytes, t)), None)
        if tier is None:
            return choices
        host.take(tensor, nbytes, tier)
        deal[tensor] = tier
    return [replace(c, tier=deal[g.tensor]) if c.mode in MOVING else c for g, c in zip(problem.gaps, choices)]


# ---- phase 2: placement --------------------------------------------------------------------
def place(problem: SwapProblem, chosen: list[Choice], delay: np.ndarray | None = None) -> list[Choice] | None:
    """Phase 2: move releases later and reloads earlier where that hides transfers and memory
    allows. `delay` (ticks per step, from an earlier timeline) refines the step times. A
    tensor a replay reads is back by the replay's slot; None if memory does not allow that."""
    gaps = problem.gaps
    choices = [freeing(g, c.mode, c.tier) if c.mode != "keep" else c for g, c in zip(gaps, chosen)]
    budget = problem.budgets(choices)
    times = problem.T + (delay if delay is not None else 0)
    live = problem.live - freed(problem, choices)
    cap = {}                                    # reload slot bounds set by replays
    for g, c in zip(gaps, choices):
        if c.mode == "recompute":
            for h in g.rec_inputs:
                if choices[h].mode in MOVING:
                    cap[h] = min(cap.get(h, gaps[h].q), g.q)

    outs = out_order(problem, choices)
    free_at = 0
    for g in outs:
        c = choices[g.index]
        start = max(int(times[g.ready[0]]), free_at)
        free_at = start + g.d_out[c.tier]
        j_hide = int(np.searchsorted(times, free_at, side="left"))
        j = _stretch_right(live, g.p + 1, min(j_hide, g.last_over, cap.get(g.index, g.q) - 1), g.nbytes, budget)
        live[g.p + 1:j] += g.nbytes
        choices[g.index] = replace(c, j=j)
    for i in range(len(outs) - 2, -1, -1):           # link order = release order
        a, b = outs[i], outs[i + 1]
        ca, cb = choices[a.index], choices[b.index]
        if ca.j > cb.j:
            live[cb.j:ca.j] -= a.nbytes
            choices[a.index] = replace(ca, j=cb.j)

    ins = in_order(problem, choices)
    latest = None
    for g in reversed(ins):
        c = choices[g.index]
        due = int(times[g.q]) if latest is None else min(int(times[g.q]), latest)
        latest = due - g.d_in[c.tier]
        k_jit = int(np.searchsorted(times, latest, side="right")) - 1
        hi = cap.get(g.index, g.q)
        lo = min(max(c.j + 1, g.first_over + 1), hi)
        k = _stretch_left(live, max(lo, min(k_jit, hi)), g.q, g.nbytes, budget)
        if k > hi:
            return None
        live[k:g.q] += g.nbytes
        choices[g.index] = replace(c, k=k)
    for a, b in zip(ins, ins[1:]):                    # link order = issue order
        ca, cb = choices[a.index], choices[b.index]
        if cb.k < ca.k:
            if ca.k > cap.get(b.index, b.q):
                return None
            live[cb.k:ca.k] -= b.nbytes
            choices[b.index] = replace(cb, k=ca.k)
    return choices


def _stretch_right(live: np.ndarray, lo: int, want: int, nbytes: int, budget: np.ndarray) -> int:
    """Largest j <= want such that keeping nbytes over [lo, j) stays within the budget."""
    if want <= lo:
        return lo
    over = np.flatnonzero(live[lo:want] + nbytes > budget[lo:want])
    return lo + int(over[0]) if len(over) else want


def _stretch_left(live: np.ndarray, want: int, hi: int, nbytes: int, budget: np.ndarray) -> int:
    """Smallest k >= want such that holding nbytes over [k, hi) stays within the budget."""
    if want >= hi:
        return hi
    over = np.flatnonzero(live[want:hi] + nbytes > budget[want:hi])
    return want + int(over[-1]) + 1 if len(over) else want


# ---- phase 3: exchange ---------------------------------------------------------------------
def improve(problem: SwapProblem, chosen: list[Choice], max_trials: int | None = None,
            deadline: Deadline | None = None) -> tuple[list[Choice], Timing]:
    """Phases 2 and 3: place, then try recomputation instead of the swaps whose replay costs
    least against their copies, keeping each change that lowers the model's delay; at most
    `max_trials` of them (default: TRIALS, fewer where TRIAL_STEPS does not cover them: a count
    of the problem's size, so the same problem gets the same trials). No trial starts once the
    command's `deadline` has passed (the placed choices are a valid answer; on a 10,193-op
    GPT-2 step the trials are 9 of a swap attempt's 14 s)."""
    if max_trials is None:
        max_trials = min(TRIALS, max(1, TRIAL_STEPS // (problem.n + len(problem.gaps))))
    best = place(problem, chosen) or chosen       # phase 1's choices are valid as they are
    timing = timeline(problem, best)
    again = place(problem, chosen, timing.D)
    if again is not None:
        again_timing = timeline(problem, again)
        if again_timing.delay < timing.delay:
            best, timing = again, again_timing

    def attempt(gs: list[Gap]) -> bool:
        nonlocal best, timing
        base = list(best)
        for g in gs:
            base[g.index] = freeing(g, "recompute")
        trial = place(problem, base, timing.D)
        if trial is None or not consistent(problem, trial):
            return False
        trial_timing = timeline(problem, trial)
        if trial_timing.delay >= timing.delay:
            return False
        best, timing = trial, trial_timing
        return True

    def candidates() -> list[Gap]:
        needed = _read_by_recompute(problem, best)
        gs = [g for g in problem.gaps if best[g.index].mode == "swap" and g.producer is not None
              and _replayable(g, best) and g.index not in needed]
        return sorted(gs, key=lambda g: g.rec_cost - g.d_in[best[g.index].tier] - g.d_out[best[g.index].tier])

    def out_of_time() -> bool:
        return deadline is not None and deadline.cuts()

    cheap = [g for g in candidates() if g.rec_cost < g.d_in[best[g.index].tier]]
    if timing.delay and cheap and not out_of_time():          # every replay cheaper than its copy in, at once
        attempt([g for g in cheap if not any(h in {c.index for c in cheap} for h in g.rec_inputs)])
    for g in candidates()[:max_trials]:
        if timing.delay == 0 or out_of_time():
            break
        if g.rec_cost < timing.delay and best[g.index].mode == "swap" and _replayable(g, best) \
                and not _needed_by_recompute(problem, g, best):
            attempt([g])
    return best, timing


def _replayable(g: Gap, choices: list[Choice]) -> bool:
    """The producer's inputs can be resident at q: kept there, or on a host tier to reload."""
    return g.producer is not None and all(choices[h].j > g.q or choices[h].mode in MOVING for h in g.rec_inputs)


def _needed_by_recompute(problem: SwapProblem, g: Gap, choices: list[Choice]) -> bool:
    return g.index in _read_by_recompute(problem, choices)


def _read_by_recompute(problem: SwapProblem, choices: list[Choice]) -> set[int]:
    """The gaps whose tensors a replay chosen in `choices` reads."""
    return {h for d in problem.gaps if choices[d.index].mode == "recompute" for h in d.rec_inputs}


def consistent(problem: SwapProblem, choices: list[Choice]) -> bool:
    """The rules the emitter relies on: the budget at every step (replays' intermediates
    included), out before back in, a replay's inputs resident at its slot (kept there or
    reloaded by then), evicts after a copy of the same tensor."""
    if ((problem.live - freed(problem, choices)) > problem.budgets(choices)).any():
        return False
    moved = set()
    for g in sorted(problem.gaps, key=lambda g: (g.p, g.index)):
        c = choices[g.index]
        if c.mode != "keep" and not (g.p < c.j <= c.k <= g.q if not g.tail else g.p < c.j < g.q):
            return False
        if c.mode == "evict" and g.tensor not in moved:
            return False
        if c.mode in ("swap", "host"):
            moved.add(g.tensor)
        if c.mode == "recompute":
            for h in g.rec_inputs:
                ch = choices[h]
                if not (ch.j > g.q or (ch.mode in MOVING and ch.k <= g.q)):
                    return False
    return True


def heuristic(problem: SwapProblem, deadline: Deadline | None = None) -> tuple[list[Choice], Timing, str] | None:
    """All three phases from each of phase 1's SELECT_ORDERS; the choices with the least
    modelled delay (ties: the first order), their timing and the order's name. None when
    phase 1 meets the budget in none of them. Past the command's `deadline`, the first order
    that meets the budget is the answer, unimproved."""
    best = None
    for order in SELECT_ORDERS:
        if best is not None and deadline is not None and deadline.cuts():
            break
        chosen = select(problem, order=order)
        if chosen is None:      # host tiers filled first-fit in this order, or replays it ruled out
            continue
        choices, timing = improve(problem, chosen, deadline=deadline)
        if best is None or timing.delay < best[1].delay:
            best = (choices, timing, order)
    return best
