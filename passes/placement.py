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
- `cpsat_offsets`: CP-SAT with NoOverlap2D over (lifetime x address), warm-started with the
  greedy result and bounded by it, used when the greedy arena is above the lower bound.

Offsets are multiples of ALIGNMENT (64 bytes, what CUDA allocators and ORT's arena give);
each buffer reserves its size rounded up to it. The arena figure is the placement's highest
end (`check_placement`); its lower bound is the plan's peak of live bytes, and with alignment
the peak of the rounded sizes (also reported).
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
from ortools.sat.python import cp_model

from memsched.memory import analyze_plan, buffer_roots, buffers, check_placement
from memsched.schedule import Plan

from .solver import solve

ALIGNMENT = 64
# NoOverlap2D models beyond this many buffers found nothing better than the greedy within
# 10 s on the model zoo's training graphs (ResNet-18 with 441 buffers, ResNet-50 with 1104)
MAX_CPSAT_BUFFERS = 250

# orders in which the greedy places the buffers that do not live for the whole step
GREEDY_ORDERS = {
    "size": lambda b: (-b[3], b[1], -b[2], str(b[0][0]), b[0][1]),
    "size, lifetime": lambda b: (-b[3], b[1] - b[2], b[1], str(b[0][0]), b[0][1]),
    "lifetime": lambda b: (b[1] - b[2], -b[3], b[1], str(b[0][0]), b[0][1]),
    "size x lifetime": lambda b: (-b[3] * (b[2] - b[1] + 1), -b[3], b[1], str(b[0][0]), b[0][1]),
    "first step": lambda b: (b[1], -b[3], str(b[0][0]), b[0][1]),
    "size, last step": lambda b: (-b[3], -b[2], str(b[0][0]), b[0][1]),
    "size x sqrt lifetime": lambda b: (-b[3] * (b[2] - b[1] + 1) ** 0.5, str(b[0][0]), b[0][1]),
    "last step": lambda b: (-b[2], -b[3], str(b[0][0]), b[0][1]),
}

Buffer = tuple  # (key, first step, last step, bytes), as memsched.memory.buffers gives


def align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-int(nbytes) // alignment) * alignment


def place_pass(plan: Plan, time_limit: float = 10.0) -> Plan:
    """Give every residency of `plan` an arena offset; notes["placement"] says how tight it is."""
    start = time.perf_counter()
    profile = analyze_plan(plan)
    items = [b for b in buffers(profile) if b[3] > 0]
    n_steps = len(profile.live_bytes)
    offsets, info = place_buffers(items, n_steps, time_limit)
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


def place_buffers(items: list[Buffer], n_steps: int, time_limit: float) -> tuple[dict, dict]:
    """Offsets for `items` (greedy, then CP-SAT where it may help); returns (offsets, info)."""
    started = time.perf_counter()
    greedy, name = best_greedy(items, n_steps, started + time_limit / 2)
    time_limit -= time.perf_counter() - started
    arena = _arena_aligned(items, greedy, ALIGNMENT)
    bound = aligned_peak(items, n_steps)
    info = {"method": f"greedy ({name})", "status": "optimal" if arena <= bound else "heuristic",
            "buffers": len(items), "greedy_arena_bytes": _arena(items, greedy),
            "aligned_lower_bound_bytes": bound}
    if arena <= bound:
        return greedy, info
    movable = [b for b in items if not _whole_step(b, n_steps)]
    if len(movable) > MAX_CPSAT_BUFFERS:
        info["cpsat"] = f"skipped: {len(movable)} buffers > {MAX_CPSAT_BUFFERS}"
        return greedy, info
    if time_limit <= 0:
        info["cpsat"] = "skipped: no time left"
        return greedy, info
    offsets, status, proven, seconds = cpsat_offsets(items, n_steps, greedy, bound, time_limit)
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


def best_greedy(items: list[Buffer], n_steps: int, deadline: float = math.inf) -> tuple[dict, str]:
    """The greedy placement with the smallest arena over GREEDY_ORDERS (ties: the first);
    the orders after the first only while `deadline` (a perf_counter time) allows."""
    best = None
    for name, order in GREEDY_ORDERS.items():
        if best is not None and time.perf_counter() > deadline:
            break
        offsets = greedy_offsets(items, n_steps, order)
        arena = _arena_aligned(items, offsets, ALIGNMENT)
        if best is None or arena < best[0]:
            best = (arena, offsets, name)
    return best[1], best[2]


def greedy_offsets(items: list[Buffer], n_steps: int, order=GREEDY_ORDERS["size"],
                   alignment: int = ALIGNMENT) -> dict:
    """Best fit in `order` (default: TFLite's greedy by size); whole-step buffers first."""
    offsets: dict = {}
    base = 0
    for key, first, last, nbytes in sorted((b for b in items if _whole_step(b, n_steps)),
                                           key=GREEDY_ORDERS["size"]):
        offsets[key] = base
        base += align(nbytes, alignment)
    rest = sorted((b for b in items if not _whole_step(b, n_steps)), key=order)
    firsts = np.empty(len(rest), dtype=np.int64)
    lasts = np.empty(len(rest), dtype=np.int64)
    los = np.empty(len(rest), dtype=np.int64)
    his = np.empty(len(rest), dtype=np.int64)
    for i, (key, first, last, nbytes) in enumerate(rest):
        size = align(nbytes, alignment)
        live = (firsts[:i] <= last) & (lasts[:i] >= first)
        offset = _best_fit(los[:i][live], his[:i][live], size, base)
        offsets[key] = offset
        firsts[i], lasts[i], los[i], his[i] = first, last, offset, offset + size
    return offsets


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
                  time_limit: float, alignment: int = ALIGNMENT):
    """NoOverlap2D over (lifetime x address) in units of `alignment`, minimising the arena.

    Whole-step buffers keep their hinted place at the bottom (optimal, see the module doc).
    Returns (offsets or None, solver status, proven arena bound in bytes or None, seconds).
    """
    base = max((hint[b[0]] + align(b[3], alignment) for b in items if _whole_step(b, n_steps)),
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
    result = solve(model, time_limit)
    proven = base + int(result.bound) * alignment if result.bound is not None else None
    if not result.has_solution:
        return None, result.status, proven, result.seconds
    offsets = {b[0]: hint[b[0]] for b in items if _whole_step(b, n_steps)}
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
    return item[1] <= 0 and item[2] >= n_steps - 1


def _arena(items: list[Buffer], offsets: dict) -> int:
    return max((offsets[k] + b for k, _, _, b in items), default=0)


def _arena_aligned(items: list[Buffer], offsets: dict, alignment: int) -> int:
    return max((offsets[k] + align(b, alignment) for k, _, _, b in items), default=0)
