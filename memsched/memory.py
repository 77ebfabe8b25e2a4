"""The memory model: the one judge of every schedule (docs/design.md).

Rules, stated once:
1. Steps are numbered 0..n-1 in schedule order. A tensor occupies device memory in
   *residencies*: each starts at the step that makes it resident (compute or recompute of
   its producer, swap_in; step 0 for graph inputs and for initializer-backed tensors --
   parameters, buffers, optimizer state, constants -- unless the plan starts them on the host)
   and ends at its last use before the next event that ends it.
2. A use is a compute/recompute step reading the tensor, or a swap_out copying it. A
   residency ends at its last use; a swap_out ends it at the swap_out step (the copy reads
   it, then its storage is released); an explicit free(t) ends it at the step before the free.
   Initializer-backed tensors and graph outputs stay to the end of the step (n-1) unless
   swapped out or freed. A residency with no use lives only at its own step.
3. During a step, its inputs and its outputs are all resident (inputs end at, outputs start
   at the same step).
4. In-place: an output may alias an input (share its storage) where both have the same byte
   size and the op allows it. A shape-only view (Reshape, Flatten, Squeeze, Unsqueeze,
   Identity) shares its input's storage whether or not the input is read later, as ONNX
   Runtime's aliasing kernels do: the two are one buffer, live while either is (a graph
   input's too, whose storage no other op takes directly). Any other
   op (elementwise ops, a scatter over its data input, optimizer updates -- a fused Gemm
   update only over C, the parameter or state it updates) writes over the input, so that
   input's last use must be this op and no other tensor may still need the storage (a view
   of it read later, or held to the end of the step as a graph output); the input's
   residency ends there. The bytes of a buffer count once, at every step some
   residency in it covers.
5. Device bytes at a step = the sum of the bytes of the residencies covering it;
   peak = the maximum over steps; arena size = a placement's highest end, never below peak.
   A budget bounds the peak and, once the plan is placed, the arena too (the real footprint).

Anything that breaks these rules (a read of a tensor that is not resident, an op computed
twice without `recompute`, a free before a use) raises ScheduleError naming the tensor.
"""
from __future__ import annotations

import bisect
import heapq
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .errors import ScheduleError
from .ir import Graph
from .ops import VIEW_OPS, overwritable_inputs
from .schedule import Plan, RUNS, Schedule, StepKind



@dataclass(frozen=True)
class Residency:
    """One stretch of steps [start, end] during which `tensor` is on the device."""

    tensor: str
    index: int        # 0 for the first residency of the tensor, 1 for the next, ...
    start: int
    end: int
    nbytes: int
    kind: str         # the tensor's kind
    shares_with: tuple[str, int] | None = None  # (tensor, index) whose storage it takes
    counted_from: int | None = None   # first step its bytes count (rule 4: a buffer counts once)
    key: tuple[str, int] = field(init=False, repr=False, compare=False)   # (tensor, index)

    def __post_init__(self):
        # stored, not a property: the passes ask for it millions of times per compile
        object.__setattr__(self, "key", (self.tensor, self.index))


@dataclass
class MemoryProfile:
    """Device bytes at every step of a schedule, and the residencies behind them."""

    residencies: list[Residency]
    live_bytes: np.ndarray           # int64, one entry per step
    by_kind: dict[str, np.ndarray]   # kind -> int64 bytes per step
    step_names: list[str]

    @property
    def peak_bytes(self) -> int:
        return int(self.live_bytes.max()) if len(self.live_bytes) else 0

    @property
    def peak_step(self) -> int:
        return int(self.live_bytes.argmax()) if len(self.live_bytes) else 0

    def kinds_at(self, step: int) -> dict[str, int]:
        return {k: int(v[step]) for k, v in self.by_kind.items() if v[step]}

    def live_at(self, step: int) -> list[Residency]:
        return [r for r in self.residencies if r.start <= step <= r.end]


# graph -> the last PROFILES_KEPT profiles made of it, by (schedule, aliases, on_host): a
# compile judges the same plan several times over (after its pass, to price it, to place
# it), and a 10,000-op step takes a quarter of a second to analyze
PROFILES_KEPT = 4
_PROFILES: "weakref.WeakKeyDictionary[Graph, OrderedDict[tuple, MemoryProfile]]" = weakref.WeakKeyDictionary()


def analyze(graph: Graph, schedule: Schedule, aliases: dict[str, str] | None = None,
            on_host: frozenset[str] | set[str] = frozenset()) -> MemoryProfile:
    """Apply the rules above to `schedule`; raise ScheduleError where it is invalid. The same
    schedule, aliases and host tensors of the same graph give the same profile object (its
    arrays are read-only)."""
    key = (tuple(schedule), frozenset((aliases or {}).items()), frozenset(on_host))
    kept = _PROFILES.setdefault(graph, OrderedDict())
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    profile = _analyze(graph, schedule, aliases or {}, on_host)
    for values in (profile.live_bytes, *profile.by_kind.values()):
        values.flags.writeable = False
    kept[key] = profile
    if len(kept) > PROFILES_KEPT:
        kept.popitem(last=False)
    return profile


def _analyze(graph: Graph, schedule: Schedule, aliases: dict[str, str],
             on_host: frozenset[str] | set[str]) -> MemoryProfile:
    n = len(schedule)
    walk = _Walk(graph, aliases, on_host)
    for i, step in enumerate(schedule):
        walk.step(i, step)
    closed = walk.finish(n)
    _end_written_over(closed, walk.alias_events)
    tensors = graph.tensors
    residencies = [Residency(r["tensor"], r["index"], r["start"], r["end"], tensors[r["tensor"]].nbytes,
                             tensors[r["tensor"]].kind, r["shares_with"]) for r in closed]
    groups = _groups(residencies)
    held = {(r["tensor"], r["index"]) for r in closed if r["closed_by"] == "end of step"}
    _check_writers_own_buffers(groups, walk.alias_events, held)
    first = _counted_from(groups)
    for r in residencies:                   # set once, before anyone else holds them
        object.__setattr__(r, "counted_from", first[r.key])
    live, by_kind = _timeline(residencies, n)
    return MemoryProfile(residencies, live, by_kind, [str(s) for s in schedule])


class _Walk:
    """Rules 1-3 applied step by step: the residencies of one schedule as they open and
    close, and the in-place events that rule 4 checks once the walk is over."""

    def __init__(self, graph: Graph, aliases: dict[str, str], on_host: frozenset[str] | set[str]):
        self.graph, self.aliases = graph, aliases
        self.held_to_end = set(graph.outputs)
        self.open: dict[str, dict] = {}          # tensor -> the open residency being built
        self.closed: list[dict] = []
        self.counts: dict[str, int] = {}
        self.computed: set[str] = set()
        self.ever_produced: set[str] = set()
        self.alias_events: list[tuple] = []   # (output, index), (source, index), step, is a view
        for name in graph.inputs:
            self.start(name, 0)
        for t in graph.initializers():
            if t.name not in on_host:
                self.start(t.name, 0)
            else:
                self.ever_produced.add(t.name)

    def start(self, name: str, step: int) -> None:
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        self.open[name] = {"tensor": name, "index": index, "start": step, "last_use": step, "end": None,
                           "shares_with": None}
        self.ever_produced.add(name)

    def close(self, name: str, end: int, reason: str) -> None:
        res = self.open.pop(name)
        res["end"], res["closed_by"] = end, reason
        self.closed.append(res)

    def use(self, name: str, step: int, what: str) -> None:
        if name not in self.open:
            if name in self.ever_produced:
                raise ScheduleError(f"tensor '{name}' is read by {what} at step {step} but is not "
                                    f"resident there (freed or swapped out earlier)")
            raise ScheduleError(f"tensor '{name}' is read by {what} at step {step} before it is produced")
        self.open[name]["last_use"] = step

    def step(self, i: int, step) -> None:
        target, open_ = step.target, self.open
        if step.kind in RUNS:
            self.run(i, step)
        elif step.kind == StepKind.SWAP_OUT:
            self.use(target, i, "a swap-out")
            self.close(target, i, StepKind.SWAP_OUT)
        elif step.kind == StepKind.SWAP_IN:
            if target in open_:
                raise ScheduleError(f"tensor '{target}' is swapped in at step {i} while resident")
            if target not in self.ever_produced:
                raise ScheduleError(f"tensor '{target}' is swapped in at step {i} before it exists")
            self.start(target, i)
        elif step.kind == StepKind.FREE:
            if target not in open_:
                raise ScheduleError(f"tensor '{target}' is freed at step {i} but is not resident")
            self.close(target, i - 1, StepKind.FREE)
        else:
            raise ScheduleError(f"step {i} has unknown kind '{step.kind}'")

    def run(self, i: int, step) -> None:
        """A compute or recompute step: its inputs read, its outputs made (rule 3)."""
        graph, open_, counts = self.graph, self.open, self.counts
        op = graph.op_by_name.get(step.target)
        if op is None:
            raise ScheduleError(f"step {i} names op '{step.target}', which the graph does not have")
        if step.kind == StepKind.COMPUTE:
            if op.name in self.computed:
                raise ScheduleError(f"op '{op.name}' is computed twice (step {i}); mark replays "
                                    f"as recompute")
            self.computed.add(op.name)
        elif op.name not in self.computed:
            raise ScheduleError(f"op '{op.name}' is recomputed at step {i} before it is computed")
        for name in op.present_inputs:
            self.use(name, i, f"op '{op.name}'")
        for name in op.present_outputs:
            if name in open_:
                self.close(name, open_[name]["last_use"], "last use")
            self.start(name, i)
            source = self.aliases.get(name)
            if source is not None:
                _check_alias(graph, op, name, source)
                open_[name]["shares_with"] = (source, counts[source] - 1)
                self.alias_events.append(((name, counts[name] - 1), (source, counts[source] - 1), i,
                                          op.op_type in VIEW_OPS))

    def finish(self, n: int) -> list[dict]:
        """Close what is still open at the end of the step (rule 2); the closed residencies."""
        tensors = self.graph.tensors
        for name in list(self.open):
            if tensors[name].is_static or name in self.held_to_end:
                self.close(name, max(n - 1, self.open[name]["start"]), "end of step")
            else:
                self.close(name, self.open[name]["last_use"], "last use")
        return self.closed


def _end_written_over(closed: list[dict], alias_events: list[tuple]) -> None:
    """In-place (rule 4): a writer's source must die at the aliasing op; its residency ends there."""
    by_key = {(r["tensor"], r["index"]): r for r in closed}
    for (output, _), (source, index), step, view in alias_events:
        src = by_key[(source, index)]
        if view:
            continue
        if src["last_use"] != step or src["closed_by"] in (StepKind.SWAP_OUT, StepKind.FREE):
            raise ScheduleError(f"'{output}' may not alias '{source}': '{source}' is still used after "
                                f"step {step}")
        src["end"], src["closed_by"] = step, "written over"


def alias_problem(graph: Graph, op, output: str, source: str) -> str | None:
    """Why `output` of `op` may not take the storage of `source` by rule 4's static half (the
    walk checks that the source dies at the op), or None where it may: the op overwrites that
    input (memsched.ops.overwritable_inputs), the two are the same size, and the source is no
    graph output, nor a graph input unless the op is a view (a view shares the caller's bytes;
    no other op takes them as its own)."""
    if source not in op.present_inputs:
        return "it is not an input of op '" + op.name + "'"
    if graph.tensors[output].nbytes != graph.tensors[source].nbytes:
        return "their sizes differ"
    overwritable = overwritable_inputs(op)
    if not overwritable:
        return f"{op.op_type} does not run in place"
    if source not in overwritable:
        if op.op_type == "Gemm":
            return "a Gemm update writes in place only over C, the parameter or state it updates"
        over = "its two branches" if op.op_type == "Where" else "its first input"
        return f"{op.op_type} writes in place only over {over}"
    if source in graph.outputs or (source in graph.inputs and op.op_type not in VIEW_OPS):
        return "it is a graph input or output"
    return None


def _check_alias(graph: Graph, op, output: str, source: str) -> None:
    problem = alias_problem(graph, op, output, source)
    if problem is not None:
        raise ScheduleError(f"'{output}' may not alias '{source}': {problem}")


def _groups(residencies: list[Residency]) -> dict[tuple[str, int], list[Residency]]:
    """Storage buffer (its root residency's key) -> the residencies in it, in-place chains
    and views followed. Each chain is walked once: roots found are remembered, so a chain
    of N in-place ops costs O(N), not O(N^2)."""
    by_key = {r.key: r for r in residencies}
    root: dict[tuple[str, int], tuple[str, int]] = {}
    groups: dict[tuple[str, int], list[Residency]] = {}
    for r in residencies:
        path, key = [], r.key
        while key not in root and (shared := by_key[key].shares_with) is not None:
            path.append(key)
            key = shared
        top = root.get(key, key)
        for walked in path:
            root[walked] = top
        root[r.key] = top
        groups.setdefault(top, []).append(r)
    return groups


def _counted_from(groups: dict[tuple[str, int], list[Residency]]) -> dict[tuple[str, int], int]:
    """Residency key -> the first step its bytes count: a buffer's bytes count once, by the
    residency that started first among those covering a step."""
    first: dict[tuple[str, int], int] = {}
    for members in groups.values():
        covered = -1
        for r in sorted(members, key=lambda r: (r.start, r.shares_with is not None)):
            first[r.key] = max(r.start + (r.shares_with is not None), covered + 1)
            covered = max(covered, r.end)
    return first


def _check_writers_own_buffers(groups: dict[tuple[str, int], list[Residency]], alias_events,
                               held: set[tuple[str, int]]) -> None:
    """Rule 4's last clause: an op that writes over its input's storage needs every other
    residency in that buffer (a view still read later, or held past the last step: `held`)
    over by its step."""
    writers = {output: (source[0], step) for output, source, step, view in alias_events if not view}
    if not writers:
        return
    for members in groups.values():
        if len(members) == 1:        # nothing else in its buffer to be overwritten
            continue
        # members by start, with the two latest-ending among each prefix: a writer at step s
        # clashes with the latest-ending other member started by s, found in O(log M)
        members = sorted(members, key=lambda m: m.start)
        starts = [m.start for m in members]
        best: list[tuple[tuple[int, int], tuple[int, int]]] = []
        first = second = (-1, -1)          # (end + held, index)
        for i, m in enumerate(members):
            this = (m.end + (m.key in held), i)
            if this > first:
                first, second = this, first
            elif this > second:
                second = this
            best.append((first, second))
        for i, r in enumerate(members):
            if r.key not in writers or r.start != writers[r.key][1]:
                continue
            step = r.start
            first, second = best[bisect.bisect_right(starts, step) - 1]
            end, j = second if first[1] == i else first
            if j >= 0 and end > step:
                raise ScheduleError(f"'{r.tensor}' may not overwrite '{writers[r.key][0]}' in place at "
                                    f"step {step}: '{members[j].tensor}' shares that storage and is read later")


def _timeline(residencies: list[Residency], n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Difference arrays: +bytes from the first counted step to the end, per kind, then a
    prefix sum."""
    diffs: dict[str, np.ndarray] = {}
    for r in residencies:
        start = r.counted_from
        if start > r.end or n == 0:
            continue
        d = diffs.setdefault(r.kind, np.zeros(n + 1, dtype=np.int64))
        d[start] += r.nbytes
        d[r.end + 1] -= r.nbytes
    by_kind = {k: np.cumsum(d)[:n] for k, d in sorted(diffs.items())}
    live = np.sum(list(by_kind.values()), axis=0) if by_kind else np.zeros(n, dtype=np.int64)
    return live.astype(np.int64), by_kind


def analyze_plan(plan: Plan) -> MemoryProfile:
    return analyze(plan.graph, plan.schedule, plan.aliases, plan.on_host)


def validate(plan: Plan) -> MemoryProfile:
    """Analyze a plan and check its budget and its placement (if it has one)."""
    profile = analyze_plan(plan)
    if plan.budget is not None and profile.peak_bytes > plan.budget:
        step = profile.peak_step
        raise ScheduleError(f"the plan needs {profile.peak_bytes} bytes at step {step} "
                            f"({profile.step_names[step]}), over its budget of {plan.budget}")
    if plan.offsets is not None:
        arena = check_placement(profile, plan.offsets)
        if plan.budget is not None and arena > plan.budget:
            raise ScheduleError(f"the plan's arena needs {arena} bytes, over its budget of {plan.budget} "
                                f"(its live bytes peak at {profile.peak_bytes})")
    return profile


def buffer_groups(profile: MemoryProfile) -> dict[tuple[str, int], list[Residency]]:
    """Storage buffer (the key of its first residency) -> the residencies in it."""
    return _groups(profile.residencies)


def buffer_roots(profile: MemoryProfile) -> dict[tuple[str, int], tuple[str, int]]:
    """Residency key -> the key of the storage buffer it lives in (in-place chains and views
    followed)."""
    return {r.key: root for root, members in buffer_groups(profile).items() for r in members}


class Buffer(NamedTuple):
    """One storage buffer to place in the arena: a residency `key` (its chain's root), the first
    and last steps it is live, and its bytes."""
    key: tuple[str, int]
    first: int
    last: int
    nbytes: int


def buffers(profile: MemoryProfile) -> list[Buffer]:
    """Storage buffers to place; in-place chains merged into their root's."""
    roots = buffer_roots(profile)
    spans: dict[tuple[str, int], list[int]] = {}
    for r in profile.residencies:
        k = roots[r.key]
        span = spans.setdefault(k, [r.start, r.end, r.nbytes])
        span[0], span[1], span[2] = min(span[0], r.start), max(span[1], r.end), max(span[2], r.nbytes)
    return [Buffer(k, s, e, b) for k, (s, e, b) in spans.items()]


def check_placement(profile: MemoryProfile, offsets: dict[tuple[str, int], int]) -> int:
    """Check that no two buffers live at the same step overlap in the arena; return arena bytes.

    In-place residencies are placed with the buffer they share (their own key may be absent)."""
    items = []
    for key, first, last, nbytes in buffers(profile):
        if nbytes == 0:
            continue
        if key not in offsets:
            raise ScheduleError(f"tensor '{key[0]}' (residency {key[1]}) has no arena offset")
        offset = offsets[key]
        if offset < 0:
            raise ScheduleError(f"tensor '{key[0]}' has a negative arena offset")
        items.append((first, last, offset, offset + nbytes, key))
    items.sort()
    # a sweep over the steps: the live buffers' byte ranges, disjoint, sorted by their start
    # (a new range overlaps one of them only if it overlaps its neighbours there), and a heap
    # of their last steps to drop them once the sweep is past
    starts: list[int] = []
    live: list[tuple[int, int, tuple]] = []      # (lo, hi, key), in the order of `starts`
    ending: list[tuple[int, int]] = []           # (last step, lo)
    arena = 0
    for first, last, lo, hi, key in items:
        while ending and ending[0][0] < first:
            _, gone = heapq.heappop(ending)
            at = bisect.bisect_left(starts, gone)
            del starts[at], live[at]
        at = bisect.bisect_left(starts, lo)
        for a_lo, a_hi, a_key in live[max(at - 1, 0):at + 1]:
            if lo < a_hi and a_lo < hi:
                raise ScheduleError(f"tensors '{key[0]}' and '{a_key[0]}' are live together at step "
                                    f"{first} and overlap in the arena ([{lo},{hi}) vs [{a_lo},{a_hi}))")
        starts.insert(at, lo)
        live.insert(at, (lo, hi, key))
        heapq.heappush(ending, (last, lo))
        arena = max(arena, hi)
    return arena
