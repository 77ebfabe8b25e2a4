"""Arena offsets: where each storage buffer of a plan lives in one device arena.

The memory model gives the buffers to place (`memsched.memory.buffers`: one per residency,
in-place chains merged, each with its first and last step and its bytes); this module only
chooses offsets, and `check_placement` (the judge) confirms them. Two planners, after
TensorFlow Lite's arena planner and OLLA:

- `greedy_offsets`: greedy best fit. Buffers that live for the whole step (parameters,
  optimizer state) are stacked at the bottom first -- any packing can be rearranged so, at
  no cost -- then the rest one by one, each into the smallest gap left by the buffers it
  overlaps in time, or above them all. The order of the rest decides the result: by size
  (TFLite's greedy by size), by lifetime, by first step (TFLite's greedy by breadth), by
  last step, and mixes of these (GREEDY_ORDERS); `best_greedy` keeps the smallest arena.
- `improved_offsets`: where the best greedy is above the lower bound, a local search over its
  placing sequence (the buffer at the arena's top placed earlier, or one placed before it
  that overlaps it in time placed after it; kept when the arena does not grow), for at most
  LOCAL_SEARCH_TRIES moves (LOCAL_SEARCH_PATIENCE in a row without a gain) and no more than
  the time limit buys at LOCAL_SEARCH_RATE (a count, so a plan places alike under load). On a
  short limit that is all of it: ResNet-18 b32's swap plans (588 buffers) at 0.5 s make 127
  moves in about 0.9 s, and CP-SAT is skipped for want of time. On a 354-op encoder's plan
  the best greedy was 5.6% above the peak and CP-SAT, started from it, 3.1% after 10 s;
  started from the search's answer, 0.5-1.5% (two runs).
- `cpsat_offsets`: CP-SAT with NoOverlap2D over (lifetime x address), warm-started with the
  result so far and bounded by it, used when that arena is above the lower bound. Beyond
  MAX_CPSAT_BUFFERS movable buffers (`largest_first_offsets`), the model takes only the
  largest MAX_CPSAT_BUFFERS of them and best fit places the rest around them: a swap plan's
  arena is decided by its few big tensors going in and out. On a 3-D U-Net step at 264^3
  (528 buffers, 141 over 100 MB) the best greedy was 2.9% above the peak (17.53 GB for a
  17.03 GB peak, over the 16 GiB device) and this 0.007% (17.035 GB). Where that arena
  still misses the budget, the model runs again over every buffer of 1% of the peak or more
  (`largest_counts`; ResNet-50's swap plans at batch 980 have some 380).

Offsets are multiples of ALIGNMENT (64 bytes, what CUDA allocators and ORT's arena give);
each buffer reserves its size rounded up to it. The arena figure is the placement's highest
end (`check_placement`); its lower bound is the plan's peak of live bytes, and with alignment
the peak of the rounded sizes (also reported).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
from ortools.sat.python import cp_model

from memsched.deadline import Deadline
from memsched.memory import Buffer, analyze_plan, buffer_roots, buffers, check_placement
from memsched.schedule import Plan

from memsched.passes.solver import solve

ALIGNMENT = 64
# NoOverlap2D models beyond this many buffers found nothing better than the greedy within
# 10 s on the model zoo's training graphs (ResNet-18 with 441 buffers, ResNet-50 with 1104)
MAX_CPSAT_BUFFERS = 250
LARGE_SHARE = 0.01            # ... and where that misses the budget, every buffer of 1% of the peak or more
LOCAL_SEARCH_TRIES = 2000     # moves of the greedy's placing sequence, at most
LOCAL_SEARCH_RATE = 150_000   # ... and no more than the time limit x this / buffers (a move packs every
                              # buffer: 513 buffers, 170 moves a second on 2 cores); it stops once the
                              # arena holds the budget
LOCAL_SEARCH_PATIENCE = 500   # ... and it stops after this many in a row that lowered nothing (on the
                              # encoder of the module doc the last gain came at move 454 of 3,000)
LOCAL_SEARCH_SEED = 20240607

# orders in which the greedy places the buffers that do not live for the whole step
GREEDY_ORDERS = {
    "size": lambda b: (-b.nbytes, b.first, -b.last, *_tie(b)),
    "size, lifetime": lambda b: (-b.nbytes, b.first - b.last, b.first, *_tie(b)),
    "lifetime": lambda b: (b.first - b.last, -b.nbytes, b.first, *_tie(b)),
    "size x lifetime": lambda b: (-b.nbytes * (b.last - b.first + 1), -b.nbytes, b.first, *_tie(b)),
    "first step": lambda b: (b.first, -b.nbytes, *_tie(b)),
    "size, last step": lambda b: (-b.nbytes, -b.last, *_tie(b)),
    "size x sqrt lifetime": lambda b: (-b.nbytes * (b.last - b.first + 1) ** 0.5, *_tie(b)),
    "last step": lambda b: (-b.last, -b.nbytes, *_tie(b)),
}


def _tie(b: Buffer) -> tuple[str, int]:
    """The last key of every order: the tensor's name and residency, so equal buffers keep one order."""
    return str(b.key[0]), b.key[1]


def align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-int(nbytes) // alignment) * alignment


def place_pass(plan: Plan, time_limit: float = 10.0, deadline: Deadline | None = None) -> Plan:
    """Give every residency of `plan` an arena offset; notes["placement"] says how tight it is.
    The search ends within `time_limit` seconds and before the command's `deadline`."""
    if deadline is not None:
        time_limit = deadline.cap(time_limit)
    start = time.perf_counter()
    profile = analyze_plan(plan)
    items = [b for b in buffers(profile) if b.nbytes > 0]
    n_steps = len(profile.live_bytes)
    offsets, info = place_buffers(items, n_steps, time_limit, plan.budget, deadline)
    roots = buffer_roots(profile)
    by_residency = {key: offsets.get(root, 0) for key, root in roots.items()}
    arena = check_placement(profile, by_residency)
    peak = profile.peak_bytes
    info.update(arena_bytes=arena, lower_bound_bytes=peak, alignment=ALIGNMENT,
                arena_over_peak=round(arena / peak, 6) if peak else 1.0,
                seconds=round(time.perf_counter() - start, 3))
    if arena == peak:
        info["status"] = "optimal"
    return dataclasses.replace(plan, offsets=by_residency, notes={**plan.notes, "placement": info})


def place_buffers(items: list[Buffer], n_steps: int, time_limit: float,
                  budget: int | None = None, deadline: Deadline | None = None) -> tuple[dict, dict]:
    """Offsets for `items` (the best greedy, the local search over its sequence, then CP-SAT
    where they may help); returns (offsets, info). Beyond MAX_CPSAT_BUFFERS, the largest-first
    model runs only where the arena is over `budget` (if given): offsets decide when a copy
    in may start (after the copy out of whatever held its addresses), so a tighter packing
    than the budget needs can only add waits. Where its arena still misses `budget`, it runs
    again over more of the largest (`largest_counts`), unless the command's deadline has passed."""
    started = time.perf_counter()
    greedy, name = best_greedy(items, n_steps, deadline)
    arena = _arena_aligned(items, greedy, ALIGNMENT)
    bound = aligned_peak(items, n_steps)
    info = {"method": f"greedy ({name})", "status": "optimal" if arena <= bound else "heuristic",
            "buffers": len(items), "greedy_arena_bytes": _arena(items, greedy),
            "aligned_lower_bound_bytes": bound}
    if budget is not None and arena <= budget:
        info["search"] = "skipped: the greedy arena holds the budget"
        return greedy, info
    priced = len(GREEDY_ORDERS) * max(1, len(items)) / LOCAL_SEARCH_RATE   # seconds, as the moves are priced
    if arena > bound:
        tries = min(LOCAL_SEARCH_TRIES, int(time_limit * LOCAL_SEARCH_RATE / max(1, len(items))))
        searched, tried = improved_offsets(items, n_steps, GREEDY_ORDERS[name], deadline, tries, goal=budget)
        info["local_search_moves"] = tried
        priced += tried * max(1, len(items)) / LOCAL_SEARCH_RATE
        searched_arena = _arena_aligned(items, searched, ALIGNMENT)
        if searched_arena < arena:
            greedy, arena = searched, searched_arena
            info["method"] = f"greedy ({name}), local search"
            info["status"] = "optimal" if arena <= bound else "heuristic"
    # the solves' deterministic limits are shares of all of `time_limit` (the greedy's and the
    # local search's wall time moves only their wall limits: `started`); they are skipped where
    # the greedy and the local search spent the time limit as their moves are priced (counted,
    # not clocked) or the command's deadline has passed, so a loaded machine places alike
    if arena <= bound:
        return greedy, info
    if priced >= time_limit or (deadline is not None and deadline.cuts()):
        info["cpsat"] = "skipped: no time left"
        return greedy, info
    movable = [b for b in items if not _whole_step(b, n_steps)]
    if len(movable) > MAX_CPSAT_BUFFERS:
        if budget is not None and arena <= budget:
            info["cpsat"] = f"skipped: the arena holds the budget ({len(movable)} buffers)"
            return greedy, info
        tried, spent = [], 0.0
        for count in largest_counts(movable, bound):
            if tried and (budget is None or arena <= budget or (deadline is not None and deadline.cuts())):
                break           # the model with more buffers runs only for a budget still missed
            offsets, status, seconds = largest_first_offsets(items, n_steps, greedy, time_limit, count,
                                                             deadline=deadline, started=started)
            tried.append(f"{status} on the {count} largest")
            spent += seconds
            found = _arena_aligned(items, offsets, ALIGNMENT) if offsets is not None else None
            if found is not None and found < arena:
                info["method"] = f"cp-sat NoOverlap2D ({count} largest), best fit (the rest)"
                info["status"] = "optimal" if found <= bound else "heuristic"
                greedy, arena = offsets, found
        info.update(cpsat=f"{', then '.join(tried)} of {len(movable)} buffers", cpsat_seconds=round(spent, 3))
        return greedy, info
    offsets, status, proven, seconds = cpsat_offsets(items, n_steps, greedy, bound, time_limit, deadline=deadline,
                                                     started=started)
    info.update(cpsat=status, cpsat_seconds=round(seconds, 3))
    if offsets is not None and _arena_aligned(items, offsets, ALIGNMENT) < arena:
        info["method"] = "cp-sat NoOverlap2D"
        greedy = offsets
    if status == "optimal":
        info["status"] = "optimal"
    elif offsets is not None:
        info["status"] = "feasible"
    if proven is not None:
        info["proven_lower_bound_bytes"] = proven
    return greedy, info


def largest_counts(movable: list[Buffer], bound: int) -> list[int]:
    """How many of the largest buffers the CP-SAT model takes, in the order tried: first
    MAX_CPSAT_BUFFERS, then (where the arena still misses the budget) every buffer of at least
    LARGE_SHARE of the aligned peak, where that is more. Best fit packs small buffers into the
    gaps the model leaves; a cut inside a run of large ones leaves them gaps too small (ResNet-50
    batch 980, recompute to 1.5x then swap: 382 buffers of 1% or more, up to 393 MB cut at the
    250th; arena 1.068 x the peak with 250, 1.007 with 382)."""
    large = sum(b.nbytes >= LARGE_SHARE * bound for b in movable)
    return [MAX_CPSAT_BUFFERS] + ([large] if large > MAX_CPSAT_BUFFERS else [])


def largest_first_offsets(items: list[Buffer], n_steps: int, hint: dict, time_limit: float,
                          count: int | None = None, alignment: int = ALIGNMENT, deadline: Deadline | None = None,
                          started: float | None = None):
    """The whole-step buffers and the `count` (MAX_CPSAT_BUFFERS) largest others placed by
    `cpsat_offsets` (hinted with `hint`, bounded below by their own aligned peak), then the
    rest by best fit around them, largest first. Returns (offsets or None, status, seconds).
    `started`: when `time_limit` began (solver.solve)."""
    count = MAX_CPSAT_BUFFERS if count is None else count
    whole = [b for b in items if _whole_step(b, n_steps)]
    movable = sorted((b for b in items if not _whole_step(b, n_steps)), key=GREEDY_ORDERS["size"])
    largest, rest = movable[:count], movable[count:]
    chosen = whole + largest
    offsets, status, _, seconds = cpsat_offsets(chosen, n_steps, hint, aligned_peak(chosen, n_steps, alignment),
                                                time_limit, alignment, deadline, started)
    if offsets is None:
        return None, status, seconds
    base = max((offsets[b.key] + align(b.nbytes, alignment) for b in whole), default=0)
    los, _ = _pack(rest, base, alignment, placed=[(b, offsets[b.key]) for b in largest])
    offsets.update((b.key, int(lo)) for b, lo in zip(rest, los))
    return offsets, status, seconds


def best_greedy(items: list[Buffer], n_steps: int, deadline: Deadline | None = None) -> tuple[dict, str]:
    """The greedy placement with the smallest arena over GREEDY_ORDERS (ties: the first);
    the orders after the first only until the command's `deadline`."""
    best = None
    for name, order in GREEDY_ORDERS.items():
        if best is not None and deadline is not None and deadline.cuts():
            break
        offsets = greedy_offsets(items, n_steps, order)
        arena = _arena_aligned(items, offsets, ALIGNMENT)
        if best is None or arena < best[0]:
            best = (arena, offsets, name)
    return best[1], best[2]


def greedy_offsets(items: list[Buffer], n_steps: int, order=GREEDY_ORDERS["size"],
                   alignment: int = ALIGNMENT) -> dict:
    """Best fit in `order` (default: TFLite's greedy by size); whole-step buffers first."""
    offsets, base = _stack_whole_step(items, n_steps, alignment)
    rest = sorted((b for b in items if not _whole_step(b, n_steps)), key=order)
    los, _ = _pack(rest, base, alignment)
    offsets.update((b.key, int(lo)) for b, lo in zip(rest, los))
    return offsets


def improved_offsets(items: list[Buffer], n_steps: int, order, deadline: Deadline | None = None,
                     tries: int = LOCAL_SEARCH_TRIES, alignment: int = ALIGNMENT,
                     goal: int | None = None) -> tuple[dict, int]:
    """A local search over the greedy's placing sequence (first `order`): the buffer that sets
    the arena's top moves earlier, or a buffer placed before it that overlaps it in time moves
    after it; a move is kept when the arena does not grow. Stops at the aligned peak (nothing
    lower exists) or at `goal` (an arena within the budget needs no tighter packing), after
    `tries` moves or LOCAL_SEARCH_PATIENCE moves in a row that lowered
    nothing (a fixed seed: the same answer each time), or at the command's `deadline`. Returns
    (offsets, moves tried)."""
    offsets, base = _stack_whole_step(items, n_steps, alignment)
    bound = max(aligned_peak(items, n_steps, alignment), goal or 0)
    sequence = sorted((b for b in items if not _whole_step(b, n_steps)), key=order)
    los, his = _pack(sequence, base, alignment)
    rng = np.random.default_rng(LOCAL_SEARCH_SEED)
    tried = stale = 0
    while (sequence and tried < tries and stale < LOCAL_SEARCH_PATIENCE and his.max() > bound
           and not (deadline is not None and deadline.cuts())):
        tried += 1
        stale += 1
        top = int(np.argmax(his))
        culprit = sequence[top]
        if top and rng.random() < 0.5:
            j = int(rng.integers(0, top))
            candidate = sequence[:j] + [culprit] + sequence[j:top] + sequence[top + 1:]
        else:
            overlapping = [i for i in range(top)
                           if sequence[i].first <= culprit.last and sequence[i].last >= culprit.first]
            if not overlapping:
                continue
            i = overlapping[int(rng.integers(len(overlapping)))]
            rest = sequence[:i] + sequence[i + 1:]
            j = int(rng.integers(top, len(rest) + 1))    # after the culprit, now at top - 1
            candidate = rest[:j] + [sequence[i]] + rest[j:]
        new_los, new_his = _pack(candidate, base, alignment)
        if new_his.max() < his.max():
            stale = 0
        if new_his.max() <= his.max():
            sequence, los, his = candidate, new_los, new_his
    offsets.update((b.key, int(lo)) for b, lo in zip(sequence, los))
    return offsets, tried


def _stack_whole_step(items: list[Buffer], n_steps: int, alignment: int) -> tuple[dict, int]:
    """Buffers live for the whole step, stacked from 0 (largest first); (offsets, their top)."""
    offsets: dict = {}
    base = 0
    for key, first, last, nbytes in sorted((b for b in items if _whole_step(b, n_steps)),
                                           key=GREEDY_ORDERS["size"]):
        offsets[key] = base
        base += align(nbytes, alignment)
    return offsets, base


def _pack(sequence: list[Buffer], base: int, alignment: int,
          placed: list[tuple[Buffer, int]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Best fit of each buffer in turn above `base`, around the `placed` (buffer, offset)
    pairs already in the arena: (offsets, ends), in sequence order."""
    k = len(placed)
    firsts = np.empty(k + len(sequence), dtype=np.int64)
    lasts = np.empty_like(firsts)
    los = np.empty_like(firsts)
    his = np.empty_like(firsts)
    for i, ((key, first, last, nbytes), offset) in enumerate(placed):
        firsts[i], lasts[i], los[i], his[i] = first, last, offset, offset + align(nbytes, alignment)
    for i, (key, first, last, nbytes) in enumerate(sequence, start=k):
        size = align(nbytes, alignment)
        live = (firsts[:i] <= last) & (lasts[:i] >= first)
        offset = _best_fit(los[:i][live], his[:i][live], size, base)
        firsts[i], lasts[i], los[i], his[i] = first, last, offset, offset + size
    return los[k:], his[k:]


def _best_fit(los: np.ndarray, his: np.ndarray, size: int, base: int) -> int:
    """The lowest offset of the smallest gap >= size among the taken ranges, else above them."""
    if len(los) == 0:
        return base
    order = np.argsort(los, kind="stable")
    los, his = los[order], his[order]
    # a gap starts where everything below it ends: the running max of the ends before it
    starts = np.concatenate(([base], np.maximum.accumulate(his)[:-1]))
    starts = np.maximum(starts, base)
    gaps = los - starts
    fits = np.flatnonzero(gaps >= size)
    if len(fits):
        best = fits[np.argmin(gaps[fits])]
        return int(starts[best])
    return int(max(base, his.max()))


def cpsat_offsets(items: list[Buffer], n_steps: int, hint: dict, lower_bound: int,
                  time_limit: float, alignment: int = ALIGNMENT, deadline: Deadline | None = None,
                  started: float | None = None):
    """NoOverlap2D over (lifetime x address) in units of `alignment`, minimising the arena
    (`started`: when `time_limit` began, solver.solve).

    Whole-step buffers keep their hinted place at the bottom (optimal, see the module doc).
    Returns (offsets or None, solver status, proven arena bound in bytes or None, seconds).
    """
    base = max((hint[b.key] + align(b.nbytes, alignment) for b in items if _whole_step(b, n_steps)),
               default=0)
    movable = [b for b in items if not _whole_step(b, n_steps)]
    upper = (_arena_aligned(items, hint, alignment) - base) // alignment
    model = cp_model.CpModel()
    top = model.NewIntVar(max(0, (lower_bound - base) // alignment), upper, "arena")
    xs, ys, ys_vars = [], [], []
    for i, (key, first, last, nbytes) in enumerate(movable):
        size = align(nbytes, alignment) // alignment
        y = model.NewIntVar(0, upper - size, f"y{i}")
        xs.append(model.NewFixedSizeIntervalVar(first, last - first + 1, f"t{i}"))
        ys.append(model.NewFixedSizeIntervalVar(y, size, f"a{i}"))
        ys_vars.append(y)
        model.Add(top >= y + size)
        model.AddHint(y, (hint[key] - base) // alignment)
    model.AddNoOverlap2D(xs, ys)
    model.Minimize(top)
    result = solve(model, time_limit, started=started, deadline=deadline)
    proven = base + int(result.bound) * alignment if result.bound is not None else None
    if not result.has_solution:
        return None, result.status, proven, result.seconds
    offsets = {b.key: hint[b.key] for b in items if _whole_step(b, n_steps)}
    for (key, *_), y in zip(movable, ys_vars):
        offsets[key] = base + result.solver.Value(y) * alignment
    return offsets, result.status, proven, result.seconds


def aligned_peak(items: list[Buffer], n_steps: int, alignment: int = ALIGNMENT) -> int:
    """The most rounded-up bytes live at one step: no aligned arena can be smaller."""
    diff = np.zeros(n_steps + 1, dtype=np.int64)
    for _, first, last, nbytes in items:
        diff[first] += align(nbytes, alignment)
        diff[last + 1] -= align(nbytes, alignment)
    return int(np.cumsum(diff).max()) if n_steps else 0


def _whole_step(item: Buffer, n_steps: int) -> bool:
    return item.first <= 0 and item.last >= n_steps - 1


def _arena(items: list[Buffer], offsets: dict) -> int:
    return max((offsets[k] + b for k, _, _, b in items), default=0)


def _arena_aligned(items: list[Buffer], offsets: dict, alignment: int) -> int:
    return max((offsets[k] + align(b, alignment) for k, _, _, b in items), default=0)
