"""Lowering a plan to a program: what each schedule step binds in the arena (`Run`, `Copy`,
`Const`), the op runs cut into segments that each run as one ONNX Runtime session
(`Segment`, `segment_model`), the moves that put each update in place, and the constants
and inputs read from host arrays. Nothing here runs ONNX Runtime: `lower` is handed the
device side (`memsched.runtime.device.Runtime`), which builds each segment's session."""
import dataclasses
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import dtypes
from ..errors import ScheduleError
from ..ir import Graph, Op, _make_node, tensor_value
from ..memory import MemoryProfile, Residency, buffer_groups, buffer_roots
from ..onnx_utils import MEMSCHED_DOMAIN
from ..ops import CONSTANT_OPS, HOISTED_OPS, draws_random, is_view
from ..ort import providers_for
from ..schedule import COPIES, Plan, RUNS, StepKind

if TYPE_CHECKING:
    from .device import Runtime


# ---- the program: what each schedule step binds --------------------------------------------
@dataclass
class Run:
    op: Op
    reads: list[tuple[str, int, int]]                        # tensor, lo, hi
    writes: list[tuple[tuple[str, int], int, int, tuple | None]]  # key, lo, hi, key it shares
    waits: list[int] = field(default_factory=list)
    provider: str = ""   # the execution provider ONNX Runtime assigned the op's node to


@dataclass
class Copy:
    kind: str           # swap_out or swap_in
    key: tuple[str, int]
    lo: int
    hi: int
    tier: str
    store: np.ndarray   # uint8 view of the tensor's place in the tier's store
    event: int          # index of this copy's completion event
    waits: list[int] = field(default_factory=list)
    poison: list[tuple[int, int]] = field(default_factory=list)   # released bytes to poison after it


@dataclass
class Segment:
    """Consecutive op runs in one session: its inputs and outputs bound into the arena."""

    runs: list[Run]
    first: int          # schedule step of its first run
    last: int           # schedule step of its last run
    steps: set = field(default_factory=set)    # schedule steps of its runs
    session: object = None
    binding: object = None
    waits: list[int] = field(default_factory=list)
    poison: list[tuple[int, int]] = field(default_factory=list)   # released bytes to poison after it


@dataclass
class Const:
    """A Constant op's run: its value, computed once, written at its offset."""

    run: Run
    step: int
    lo: int
    data: np.ndarray    # the value's bytes
    waits: list[int] = field(default_factory=list)
    hoisted: bool = False   # written before the segment its step falls in
    poison: list[tuple[int, int]] = field(default_factory=list)   # released bytes to poison after it


@dataclass
class Program:
    actions: list          # one per schedule step; None for a free
    releases: list         # per step: [(key, lo, hi, kept: another residency still holds the bytes)]
    initial: list          # [(key, lo, hi)] loaded before step 0 (inputs, device-resident statics)
    host_initial: dict     # static tensor -> store view it starts in (plan.on_host)
    finals: dict           # output -> ('arena', lo, hi) | ('store', view)
    types: dict            # tensor -> (numpy dtype, shape)
    swapped_bytes: Counter
    events: int
    items: list = field(default_factory=list)      # what runs, in order: Segment and Copy
    exact: bool = True     # segments cut for ONNX Runtime's priority order of their nodes as given
    regions: dict = field(default_factory=dict)    # residency key -> its (lo, hi) in the arena
    updates: list = field(default_factory=list)    # moves that put `<name>.updated` where `<name>` starts

    @property
    def segments(self) -> list[Segment]:
        return [item for item in self.items if isinstance(item, Segment)]

    @property
    def updated(self) -> set[str]:
        """Statics whose next-step value a move brings (so they are not loaded again)."""
        return {name for name, _, _ in self.updates}

@dataclass
class Hooks:
    """Callables around schedule steps (run_plan's `before` and `after`)."""

    before: dict[int, Callable]
    after: dict[int, Callable]


class _Places:
    """Where the plan puts each residency: its (lo, hi) in the arena, and which residency of a
    tensor covers or starts at a schedule step."""

    def __init__(self, plan: Plan, profile: MemoryProfile, types: dict):
        self.plan, self.types = plan, types
        self.by_key = {r.key: r for r in profile.residencies}
        self.by_tensor: dict[str, list[Residency]] = defaultdict(list)
        for r in profile.residencies:
            self.by_tensor[r.tensor].append(r)
        self.roots = buffer_roots(profile)

    def region(self, key) -> tuple[int, int]:
        r = self.by_key[key]
        lo = self.plan.offsets.get(self.roots[key], 0) if r.nbytes else 0
        itemsize = self.types[r.tensor][0].itemsize
        if lo % itemsize:
            raise ScheduleError(f"tensor '{r.tensor}' is placed at arena offset {lo}, not a multiple of "
                                f"its element size {itemsize}")
        return lo, lo + r.nbytes

    def covering(self, tensor: str, step: int) -> Residency:
        for r in self.by_tensor[tensor]:
            if r.start <= step <= r.end:
                return r
        raise ScheduleError(f"tensor '{tensor}' is not resident at step {step}")

    def starting(self, tensor: str, step: int) -> Residency:
        for r in self.by_tensor[tensor]:
            if r.start == step:
                return r
        raise ScheduleError(f"tensor '{tensor}' gets no residency at step {step}")


def lower(plan: Plan, profile: MemoryProfile, rt: "Runtime", hooks: "Hooks") -> Program:
    """The plan as a program over the arena: what each schedule step binds, the releases, the
    moves of the updates, and the items that run (segments cut for ONNX Runtime's order,
    copies, constant writes), not yet given sessions (`Runtime.bind`). Of `rt` it reads the
    device, the arena's address, the values read from host arrays, and it asks it for the host
    tiers' stores: a stand-in with those runs no ONNX Runtime (tests/test_lowering.py)."""
    graph, n = plan.graph, len(plan.schedule)
    types = {name: (helper.tensor_dtype_to_np_dtype(t.dtype), t.shape) for name, t in graph.tensors.items()}
    places = _Places(plan, profile, types)
    sharers = buffer_groups(profile)       # buffer -> its residencies (in-place chains, views)
    releases: list[list] = [[] for _ in range(n)]
    for r in profile.residencies:
        if 0 <= r.end < n:
            kept = any(m.key != r.key and m.start <= r.end < m.end for m in sharers[places.roots[r.key]])
            releases[r.end].append((r.key, *places.region(r.key), kept))

    host_initial_tier = _first_swap_in_tiers(plan)
    stores = rt.stores(_store_sizes(plan, host_initial_tier))
    host_initial = {t: stores[(tier, t)] for t, tier in host_initial_tier.items()}
    static_at_start = [r for r in profile.residencies if r.index == 0 and r.start == 0
                       and (r.tensor in graph.inputs or (graph.tensors[r.tensor].is_static
                                                         and r.tensor not in plan.on_host))]
    initial = [(r.key, *places.region(r.key)) for r in static_at_start]
    finals = _finals(plan, places.by_tensor, places.region, stores, n)
    actions, swapped, events = _actions(plan, places, stores, host_initial_tier)
    program = Program(actions, releases, initial, host_initial, finals, types, swapped, events)
    program.updates = _updates(plan, program, places.region)
    # ONNX Runtime adds nodes of its own around float16 kernels it runs in float32 (Casts): those
    # run out of index order, so such a step is cut for any order. On CUDA it may add copies
    # between devices; a segment where it did is found at build (adds_no_nodes) and re-cut.
    inserts = any(t.dtype in dtypes.HALF_TYPES for t in graph.tensors.values())
    order = _OrderGuard.ANY if inserts else _OrderGuard.ORDERED
    unwritten = _unwritten(plan, rt.host_values)
    # on the CPU a swap copy is a node of the session around it (in the order given, which
    # ORDERED keeps), so swaps do not end sessions; elsewhere a copy is a step of its own
    copy_base = rt.base if rt.device == "cpu" and order == _OrderGuard.ORDERED else None
    program.items = _items(program.actions, graph, rt.device == "cuda", order, hooks, unwritten, copy_base)
    program.exact = order == _OrderGuard.ORDERED
    program.regions = {r.key: places.region(r.key) for r in profile.residencies}
    for run in program.actions:          # a Constant is written, or read from the host: no session runs it
        if isinstance(run, Run) and run.op.op_type in CONSTANT_OPS:
            run.provider = providers_for(rt.device)[0] if rt.device == "cpu" else "CUDAExecutionProvider"
    return program


def _actions(plan: Plan, places: _Places, stores: dict, host_initial_tier: dict[str, str]) -> tuple[list, Counter, int]:
    """One action per schedule step (a Run, a Copy, or None for a free), each with the copy
    events it waits for: those still in flight over bytes it touches; and the bytes swapped out
    per tier and the number of copy events."""
    graph = plan.graph
    actions: list = []
    swapped = Counter()
    pending: list[tuple[int, int, int, str, str]] = []    # event, lo, hi, kind, tensor@tier
    on_host_copy: dict[tuple[str, str], int] = {}          # (tensor, tier) -> event of its swap-out
    events = 0

    def waits_for(regions: list[tuple[int, int]]) -> list[int]:
        return sorted({e for e, lo, hi, _, _ in pending
                       if any(lo < b and a < hi for a, b in regions)})

    for i, step in enumerate(plan.schedule):
        if step.kind in RUNS:
            op = graph.op_by_name[step.target]
            if step.kind == StepKind.RECOMPUTE and draws_random(op):
                raise ScheduleError(f"op '{op.name}' ({op.op_type}) draws random numbers; recomputing it "
                                    f"would change its result")
            reads = [(t, *places.region(places.covering(t, i).key)) for t in op.inputs if t]
            writes = []
            for t in op.present_outputs:
                r = places.starting(t, i)
                writes.append((r.key, *places.region(r.key), r.shares_with))
            touched = [(lo, hi) for _, lo, hi in reads] + [(lo, hi) for _, lo, hi, _ in writes]
            actions.append(Run(op, reads, writes, waits_for(touched)))
            pending = [p for p in pending if p[0] not in actions[-1].waits]
        elif step.kind in COPIES:
            tier = step.tier or "dram"
            t = step.target
            r = places.covering(t, i) if step.kind == StepKind.SWAP_OUT else places.starting(t, i)
            lo, hi = places.region(r.key)
            waits = waits_for([(lo, hi)])
            if step.kind == StepKind.SWAP_OUT:
                swapped[tier] += r.nbytes
                on_host_copy[(t, tier)] = events
            elif (t, tier) in on_host_copy:
                waits = sorted(set(waits) | {on_host_copy[(t, tier)]})
            elif host_initial_tier.get(t) != tier:
                raise ScheduleError(f"tensor '{t}' is swapped in from {tier} at step {i} but no copy of it "
                                    f"was put there")
            actions.append(Copy(step.kind, r.key, lo, hi, tier, stores[(tier, t)], events, waits))
            pending.append((events, lo, hi, step.kind, f"{t}@{tier}"))
            events += 1
        else:
            actions.append(None)
    return actions, swapped, events


def recut(program: Program, segment: Segment, graph: Graph, split_at_waits: bool, hooks: "Hooks") -> list:
    """`segment` cut again where any order of its runs would be wrong: ONNX Runtime's record of
    the nodes it assigned differed from the segment's (it added nodes of its own)."""
    return _items([r if i in segment.steps else None for i, r in enumerate(program.actions)], graph,
                  split_at_waits, _OrderGuard.ANY, hooks)


def constant_value(op: Op, graph: Graph) -> np.ndarray:
    """The bytes of a Constant op's output, as the graph types it: a `value` tensor read
    directly, any other form through onnx's reference evaluator (imported only then: it
    weighs megabytes)."""
    t = graph.tensors[op.outputs[0]]
    if isinstance(op.attributes.get("value"), onnx.TensorProto):
        value = numpy_helper.to_array(op.attributes["value"])
    else:
        from onnx.reference import ReferenceEvaluator

        node = _make_node(dataclasses.replace(op, name="constant", inputs=[], outputs=["y"], doc_string=""))
        opsets = [helper.make_opsetid(d, v) for d, v in graph.opset_imports.items() if d != MEMSCHED_DOMAIN]
        model = helper.make_model(helper.make_graph([node], "constant", [], [helper.make_tensor_value_info(
            "y", t.dtype, list(t.shape))]), opset_imports=opsets)
        model.ir_version = graph.ir_version
        value = np.asarray(ReferenceEvaluator(model).run(None, {})[0])
    dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
    if value.dtype != dtype or value.shape != t.shape:
        raise ScheduleError(f"Constant op '{op.name}' makes {value.dtype} of shape {value.shape}, but the graph "
                            f"says {dtype} of shape {t.shape}")
    return np.ascontiguousarray(value).reshape(-1).view(np.uint8)


# integer tensors: shapes, axes, indices; the CUDA provider reads the shape-like ones on the host
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})
# on CUDA, a float Constant larger than this stays in the arena (a host one is uploaded every run)
HOST_CONSTANT_BYTES = 64 * 1024


def host_constants(graph: Graph, feeds: dict, device: str = "cpu") -> dict[str, np.ndarray]:
    """The values read from host arrays instead of the arena, by tensor: every Constant output
    (on CUDA the float ones up to HOST_CONSTANT_BYTES), and every integer tensor whose value is
    the same in every step: Shape and Size outputs (shapes are static) and integer initializers
    no update replaces.

    Two reasons. ONNX Runtime's CUDA kernels take shape-like inputs (Reshape's shape,
    Unsqueeze's and ReduceSum's axes, Slice's starts...) in host memory; bound on the device,
    such an input is copied to the host as the run starts, and that copy was seen read before
    it had landed (an Unsqueeze's axes read as 0, a Reshape's shape as another tensor's). And a
    Constant that no one reads from the arena needs no write there (`_items`), so it no longer
    ends a segment where its bytes were another tensor's. On the CPU a host array is bound as
    the arena is, without a copy."""
    updated = {name.removesuffix(".updated") for name in graph.outputs if name.endswith(".updated")}
    producer = graph.producer
    values: dict[str, np.ndarray] = {}
    for name, t in graph.tensors.items():
        if t.shape is None or t.dtype in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
            continue
        dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
        integer = t.dtype in _INTEGER_TYPES
        op = producer.get(name)
        if op is not None and op.op_type in CONSTANT_OPS:
            if not integer and device == "cuda" and t.nbytes > HOST_CONSTANT_BYTES:
                continue
            value = constant_value(op, graph).view(dtype)
        elif not integer:
            continue
        elif op is None:
            if not t.is_static or name in updated or name in feeds:
                continue
            value = tensor_value(t, graph.base_dir)
        elif op.op_type in HOISTED_OPS and graph.tensors[op.inputs[0]].shape is not None:
            shape = graph.tensors[op.inputs[0]].shape
            if op.op_type == "Size":
                value = np.array(math.prod(shape))
            else:
                start, end = op.attributes.get("start", 0), op.attributes.get("end", len(shape))
                value = np.array(shape[slice(start, end)])
        else:
            continue
        values[name] = np.array(value, dtype=dtype).reshape(t.shape)    # a copy, 0-d kept 0-d
    return values


def host_inputs(plan: Plan, feeds: dict, device: str = "cpu") -> dict[str, np.ndarray]:
    """On the CPU, the graph inputs read in place from the caller's arrays instead of copies in
    the arena, by tensor, with the shape views that share their storage (a Flatten of the
    batch): the view is bound at its input's address, where ONNX Runtime's view kernels copy
    nothing. A plain session reads its feeds so; a copy of the batch in the arena would be
    memory the step does not need. An input stays in the arena where an op writes over its
    storage (an in-place op over one of its views), where the plan swaps it or a view of it,
    or where it or a view is a graph output. The plan still places their bytes; those pages
    of the arena are never touched."""
    if device != "cpu":
        return {}
    graph = plan.graph
    moved = _swapped(plan)
    root = input_roots(plan, [name for name in graph.inputs if name in feeds])
    written = {root[source] for out, source in plan.aliases.items()
               if source in root and not is_view(graph.producer[out])}
    kept = {root[t] for t in root if t in moved or t in graph.outputs} | written
    values = {}
    for name, base in root.items():
        if base not in kept:
            values[name] = feeds[base].reshape(graph.tensors[name].shape)
    return values


def input_roots(plan: Plan, inputs: list[str]) -> dict[str, str]:
    """Each of graph inputs `inputs`, and each shape view sharing its storage, -> the input."""
    root = {name: name for name in inputs}
    for op in plan.graph.ops:             # graph order: a view's input is rooted before it
        if is_view(op) and op.present_inputs and op.present_inputs[0] in root:
            root.update({out: root[op.present_inputs[0]] for out in op.present_outputs
                         if plan.aliases.get(out) == op.present_inputs[0]})
    return root


def _swapped(plan: Plan) -> set[str]:
    """The tensors `plan` swaps out or in somewhere in the step."""
    return {s.target for s in plan.schedule if s.kind in COPIES}


def _unwritten(plan: Plan, host_values: dict) -> frozenset[str]:
    """Constant outputs read only by runs, and from host arrays: no write of them is needed
    (not a step output, never swapped)."""
    graph = plan.graph
    moved = _swapped(plan)
    producer = graph.producer
    return frozenset(t for t in host_values if t in producer and producer[t].op_type in CONSTANT_OPS
                     and t not in graph.outputs and t not in moved)


def _items(actions: list, graph: Graph, split_at_waits: bool, order: str, hooks: "Hooks",
           unwritten: frozenset[str] = frozenset(), copy_base: int | None = None) -> list:
    """The program as it runs: segments of consecutive op runs, cut at every copy (and on CUDA
    at every run that waits for one, so a copy overlaps the runs before it), before and after
    each run that has `hooks`, and wherever the `_OrderGuard` (in mode `order`) refuses a run,
    and the copies; Constant ops (CONSTANT_OPS) become writes of their value, except those in
    `unwritten` (read from host arrays only), which need none. With `copy_base` (the arena's
    address, on the CPU) a copy is a run of the segment instead (`_copy_run`)."""
    items: list = []
    current: Segment | None = None
    guard = _OrderGuard(order)
    for i, action in enumerate(actions):
        if isinstance(action, Copy) and copy_base is not None:
            action = _copy_run(action, copy_base)
        if isinstance(action, Run) and action.op.op_type in CONSTANT_OPS:
            if action.op.outputs[0] in unwritten:
                continue
            const = Const(action, i, action.writes[0][1], constant_value(action.op, graph), list(action.waits))
            if current is not None and not action.waits and guard.hoist(action):
                const.hoisted = True              # written before the segment: no run of it touches the bytes
                items.insert(items.index(current), const)
            else:
                items.append(const)
                current = None
        elif isinstance(action, Run):
            if current is None or (split_at_waits and action.waits) or i in hooks.before \
                    or current.last in hooks.after or not guard.admit(action):
                current = Segment([], i, i, waits=list(action.waits))
                items.append(current)
                guard = _OrderGuard(order)
                guard.admit(action)
            current.runs.append(action)
            current.last = i
            current.steps.add(i)
        elif isinstance(action, Copy):
            items.append(action)
            current = None
    return items


def _copy_run(copy: Copy, base: int) -> Run:
    """A swap copy as the run of an Identity node from the tensor's bytes to its store's, or
    back; the store's place is given as an offset from the arena's address `base`, so the
    session binds it as it binds the arena. ONNX Runtime's CPU Identity copies its input's
    bytes into its output's where the two are bound apart."""
    tensor = copy.key[0]
    store = copy.store.ctypes.data - base
    arena, host = (copy.lo, copy.hi), (store, store + copy.hi - copy.lo)
    source, target = (arena, host) if copy.kind == StepKind.SWAP_OUT else (host, arena)
    op = Op(f"{copy.kind}/{tensor}", "Identity", [tensor], [tensor])
    return Run(op, [(tensor, *source)], [(copy.key, *target, None)], list(copy.waits))


def with_poison(items: list, program: Program, profile: MemoryProfile) -> list:
    """`items`, each given the bytes released up to its end that no live tensor holds after
    it: what a checked run poisons once the item has run (not after the last step of the
    schedule, where what is live is the step's result)."""
    n = len(program.actions)
    done = 0
    for item in items:
        if isinstance(item, Const) and item.hoisted:
            continue           # the segment after it poisons what was released up to its end
        end = (item.last if isinstance(item, Segment) else item.step if isinstance(item, Const)
               else program.actions.index(item))
        released = [(lo, hi) for step in range(done, min(end, n - 2) + 1)
                    for _, lo, hi, kept in program.releases[step] if not kept and hi > lo]
        live = [program.regions[r.key] for r in profile.residencies
                if r.start <= end and (end < r.end or r.end >= n - 1) and r.nbytes]
        item.poison = subtract(union(released), union(live))
        done = end + 1
    return items


class _OrderGuard:
    """Whether a segment runs as scheduled in the order ONNX Runtime picks.

    A session runs its nodes in a topological order of its own, and the plan reuses bytes: a
    run may write where a tensor that is no longer needed was. That is safe only if every run
    that read or wrote those bytes before runs first. The executor's sessions use ONNX
    Runtime's priority-based order: Kahn's algorithm that takes Shape and Size nodes as soon as
    they are ready and every other node in the order given (the schedule's, a topological
    order), so only a Shape or Size run can move, and only earlier. In mode ORDERED a
    Shape or Size run's writes, and in mode ANY (for a session where ONNX Runtime added nodes
    of its own, which run out of that order) every run's writes, must only cover bytes that
    runs reached through data edges (its ancestors) touched before, so that any such order
    runs them first. `admit` adds a run to the segment when that holds, and refuses it (the
    segment ends there) when it does not."""

    ORDERED, ANY = "ordered", "any"

    def __init__(self, order: str):
        self.order = order
        self.spans: list[list[int]] = []                     # [lo, hi, runs that touched them (bits)]
        self.ancestors: list[int] = []                       # per run: the runs it depends on (bits)
        self.written: dict[str, tuple[int, int, int, int]] = {}   # tensor -> lo, hi, span index, run
        self.outside: dict[tuple[str, int], int] = {}        # tensor read from outside, lo -> span index

    def hoist(self, run: Run) -> bool:
        """Whether a run that reads nothing (a Constant) can be done before the segment: no run
        of the segment touched the bytes it writes. If so, those bytes count as read from
        outside from here on."""
        if run.reads or any(a < hi and lo < b for _, lo, hi, _ in run.writes for a, b, _ in self.spans):
            return False
        for key, lo, hi, _ in run.writes:
            self.spans.append([lo, hi, 0])
        return True

    def admit(self, run: Run) -> bool:
        j = len(self.ancestors)
        me, before = 1 << j, 0
        inner = []
        for tensor, lo, hi in run.reads:
            w = self.written.get(tensor)
            if w is not None and w[:2] == (lo, hi):
                before |= (1 << w[3]) | self.ancestors[w[3]]
                inner.append(w[2])
            else:
                inner.append(None)
        allowed = before | me
        checked = run.writes if self.order == self.ANY or run.op.op_type in HOISTED_OPS else []
        for _, lo, hi, _ in checked:
            if any(a < hi and lo < b and touched & ~allowed for a, b, touched in self.spans):
                return False
        for (tensor, lo, hi), span in zip(run.reads, inner):
            if span is None:
                span = self.outside.get((tensor, lo))
                if span is None:
                    span = self.outside[(tensor, lo)] = len(self.spans)
                    self.spans.append([lo, hi, 0])
            self.spans[span][2] |= me
        for key, lo, hi, _ in run.writes:
            self.written[key[0]] = (lo, hi, len(self.spans), j)
            self.spans.append([lo, hi, me])
        self.ancestors.append(before)
        return True


def union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def subtract(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` less `holes` (both sorted, disjoint)."""
    result = []
    for lo, hi in spans:
        for a, b in holes:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                result.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            result.append((lo, hi))
    return result


def _same_place(a: tuple, b: tuple) -> bool:
    """Whether two places (see `_updates`) are the same bytes: a store's place holds an array
    view, compared by its address and size (== on arrays compares their elements)."""
    if a[0] != b[0]:
        return False
    if a[0] == "store":
        return (a[1].__array_interface__["data"][0], a[1].nbytes) == (b[1].__array_interface__["data"][0], b[1].nbytes)
    return a == b


def _updates(plan: Plan, program: Program, region) -> list[tuple[str, tuple | None, list]]:
    """Per static with a `<name>.updated` output of its type: where it starts a step and the
    moves, in a safe order, that put the update there (none where the update is written in
    place).

    A place is ('arena', lo, hi), ('store', view) or ('temp', k). Moving one update may
    overwrite the arena bytes where another update still waits, so moves run in an order in
    which none overwrites a source still to be read; a cycle is broken by copying one source
    to a temporary first (('stash', k, place) before the moves)."""
    graph = plan.graph
    starts = {key[0]: ("arena", lo, hi) for key, lo, hi in program.initial}
    starts.update({name: ("store", view) for name, view in program.host_initial.items()})
    pending = []
    for name in starts:
        t, updated = graph.tensors[name], graph.tensors.get(f"{name}.updated")
        if not t.is_static or updated is None or f"{name}.updated" not in program.finals:
            continue
        if updated.shape != t.shape or updated.dtype != t.dtype:
            continue
        where = program.finals[f"{name}.updated"]
        source = ("arena", where[1], where[2]) if where[0] == "arena" else ("store", where[1])
        pending.append((name, source, starts[name]))

    def overlaps(a, b) -> bool:
        return a[0] == b[0] == "arena" and a[1] < b[2] and b[1] < a[2]

    order: list[tuple[str, tuple | None, list]] = []
    temps = 0
    while pending:
        for k, (name, source, target) in enumerate(pending):
            if not any(j != k and overlaps(target, other[1]) for j, other in enumerate(pending)):
                order.append((name, target, [] if _same_place(source, target) else [("move", source, target)]))
                pending.pop(k)
                break
        else:
            name, source, target = pending[0]
            order.append((name, None, [("stash", temps, source)]))
            pending[0] = (name, ("temp", temps), target)
            temps += 1
    return order


def _first_swap_in_tiers(plan: Plan) -> dict[str, str]:
    """Static tensors that start on the host -> the tier their first swap-in reads."""
    tiers: dict[str, str] = {}
    for step in plan.schedule:
        if step.kind == StepKind.SWAP_IN and step.target in plan.on_host:
            tiers.setdefault(step.target, step.tier or "dram")
    for name in plan.on_host:
        tiers.setdefault(name, "dram")
    return tiers


def _store_sizes(plan: Plan, host_initial_tier: dict[str, str]) -> dict[tuple[str, str], int]:
    """(tier, tensor) -> bytes: one place per tensor in each tier it visits."""
    sizes = {(tier, t): plan.graph.tensors[t].nbytes for t, tier in host_initial_tier.items()}
    for step in plan.schedule:
        if step.kind in COPIES:
            sizes[(step.tier or "dram", step.target)] = plan.graph.tensors[step.target].nbytes
    return sizes


def _finals(plan: Plan, by_tensor, region, stores, n: int) -> dict:
    """Where each graph output is at the end of the step: in the arena, or in a tier's store
    where it was swapped out and not resident at the end (swapped in again for a reader and
    freed after it, its host copy still holds the value: tensors are written once)."""
    finals = {}
    for name in plan.graph.outputs:
        last = max(by_tensor[name], key=lambda r: r.index, default=None)
        if last is not None and last.end >= n - 1:
            finals[name] = ("arena", *region(last.key))
            continue
        swapped = [s for s in plan.schedule if s.target == name and s.kind == StepKind.SWAP_OUT]
        if last is not None and swapped:     # a value never changes: its host copy holds it still
            finals[name] = ("store", stores[(swapped[-1].tier or "dram", name)])
        else:
            raise ScheduleError(f"graph output '{name}' is freed before the end of the step; its value "
                                f"would be lost")
    return finals


# ---- sessions ---------------------------------------------------------------------------
def segment_model(segment: Segment, graph: Graph) -> tuple[onnx.ModelProto, list, list]:
    """The segment's ops as one model whose every tensor is a graph input or output.

    Values are named by what holds them, not by tensor: `x<k>` for a tensor read from outside
    the segment, `v<k>` for each one a run writes (a recomputed tensor is a new value), so the
    model is in SSA form whatever the schedule replays. Nodes are named `n<j>`, the j-th run.
    A float16 value read inside the segment reaches its readers through an Identity written
    onto its own bytes, as in the reference (`_fp16_barriers`): without it ONNX Runtime's CPU
    provider, running ops without a float16 kernel in float32 between Casts, drops the Cast
    pair between two of them and passes the float32 value on, unrounded.
    Returns the model, its inputs [(value, tensor, lo)] and its outputs [(value, tensor, lo)]."""
    inputs: dict[tuple[str, int], str] = {}
    written: dict[str, tuple[str, int, int]] = {}    # tensor -> (value, lo, hi) of its latest write
    barriers: dict[str, str] = {}                    # float16 value -> its Identity's output
    ins, outs, nodes = [], [], []
    for j, run in enumerate(segment.runs):
        op = run.op
        reads = iter(run.reads)
        names = []
        for t in op.inputs:
            if not t:
                names.append("")
                continue
            tensor, lo, hi = next(reads)
            if tensor in written and written[tensor][1:] == (lo, hi):
                value = written[tensor][0]
                if graph.tensors[tensor].dtype == onnx.TensorProto.FLOAT16:
                    if value not in barriers:
                        barriers[value] = f"{value}.fp16"
                        nodes.append(helper.make_node("Identity", [value], [barriers[value]], name=f"b{value}"))
                        outs.append((barriers[value], tensor, lo))
                    value = barriers[value]
                names.append(value)
                continue
            if (tensor, lo) not in inputs:
                inputs[(tensor, lo)] = f"x{len(inputs)}"
                ins.append((inputs[(tensor, lo)], tensor, lo))
            names.append(inputs[(tensor, lo)])
        writes = iter(run.writes)
        results = []
        for t in op.outputs:
            if not t:
                results.append("")
                continue
            _, lo, hi, _ = next(writes)
            value = f"v{len(outs)}"
            written[t] = (value, lo, hi)
            outs.append((value, t, lo))
            results.append(value)
        nodes.append(_make_node(dataclasses.replace(op, name=f"n{j}", inputs=names, outputs=results, doc_string="")))

    def info(values):
        return [helper.make_tensor_value_info(v, graph.tensors[t].dtype, list(graph.tensors[t].shape))
                for v, t, _ in values]

    g = helper.make_graph(nodes, "segment", info(ins), info(outs))
    opsets = [helper.make_opsetid(d, v) for d, v in graph.opset_imports.items() if d != MEMSCHED_DOMAIN]
    model = helper.make_model(g, opset_imports=opsets, producer_name="memsched")
    model.ir_version = graph.ir_version
    return model, ins, outs
