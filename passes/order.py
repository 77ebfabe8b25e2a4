"""Operator order: a topological order of the ops with the lowest peak of device bytes.

Starts (`starts`), each judged by the memory model (`memsched.memory.analyze`): the given
order; XLA's list scheduler (run the ready op that frees the most bytes net of what it
defines); a depth-first order (run what the last op made ready); the training order of
`passes.reuse.training_order` (updates in the backward, the dW/dX rule); each also with
`sink` (ops that define more than they free moved down to where they are needed) and then
`hoist` (ops that free more than they define moved up to where they can run).

The best start is the hint of a CP-SAT model (`window_model`): op positions (one op per
step, data-flow precedences), each tensor an interval from its producer to its last reader,
a Cumulative over the intervals whose capacity -- the peak -- is minimised. Up to
WHOLE_GRAPH_OPS ops one model takes the whole graph; beyond, windows of consecutive ops
around the current peak step are re-optimised with the rest of the order fixed (steps
outside a window keep their bytes, so the peak never rises), growing until no peak step
is left to improve or the time is up. Up to WHOLE_FIRST_OPS ops a whole-graph model has
half the time first and the windows start from its answer (on a 354-op encoder it found a
2% lower peak that the windows alone, which stop in a local optimum, did not reach; hinted
with the windows' answer instead, it found nothing).

With `inplace` (the default when the plan already has aliases, i.e. after `reuse`), orders
are judged with greedy in-place aliases (`passes.reuse.choose_aliases`), and in the model
each eligible (output, input) pair is a choice: taken, every other reader of the input
runs first and the output takes no bytes of its own (the memory model's rule 4). A view
always shares its input's storage: the model keeps one tensor per buffer, read by the
readers of every view of it (`OrderProblem.buffer`).

Lower bounds (`LowerBound`), valid for every order (with any in-place aliases): the
structural one -- at each op, the tensors produced by an ancestor and read by a descendant
are resident in any order -- and, while time allows, min cuts at chosen ops (`cut_bound`),
which also see that one of two tensors must be kept where either may be; a whole-graph
CP-SAT optimum is one too. The status is `optimal` when the peak meets the bound,
`feasible` when CP-SAT ran, `heuristic` otherwise.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.graph.python import max_flow
from ortools.sat.python import cp_model

from memsched.deadline import Deadline, Work, unlimited
from memsched.errors import ScheduleError
from memsched.ir import Graph
from memsched.memory import analyze
from memsched.ops import is_view
from memsched.schedule import Plan, order_schedule

from memsched.passes.reuse import alias_table, choose_aliases, compute_order, training_order
from memsched.passes.solver import WALL_SLACK, solve

WHOLE_GRAPH_OPS = 120      # one CP-SAT model up to this many ops, windows beyond
WHOLE_FIRST_OPS = 400      # up to this many ops, a whole-graph model gets half the time before the windows
WINDOW_OPS = 60            # first window size; doubled when every peak step was tried
MAX_WINDOW_OPS = 240
WINDOW_PLACES = (0.5, 0.25, 0.75)   # where in a window its peak step sits, tried in this order
STRUCTURAL_BOUND_OPS = 12000   # bitset reachability beyond this costs too much memory
HEURISTIC_SHARE = 0.5          # of the time limit, at most, for the heuristic starts
BOUND_SHARE = 0.15             # of the time limit, for min-cut lower bounds before the search
# What one heuristic order (built and judged) and one min cut cost, per op, as the starts and
# the bounds count their time (Work): priced, not clocked, so the same limit runs the same
# heuristics and cuts under any load (measured on the bundled steps: 2.3e-5 to 3.4e-5 s and
# 1.4e-4 to 1.9e-4 s per op)
HEURISTIC_SECONDS_PER_OP = 4e-5
CUT_SECONDS_PER_OP = 2.5e-4
WRAP_UP_SHARE = 0.02           # of the time limit, kept back at the end of the search
SEARCH_SHARE = 0.6             # of the time limit, CP-SAT's to spend, counted in solver limits (not what
                               # the clock leaves), so the same limit gives the same order; the clock
                               # (the pass's end, the command's deadline) only cuts a loaded machine short
WINDOW_SHARE = 0.1             # of the search's seconds for one window model, at least one second


def order_pass(plan: Plan, time_limit: float = 10.0, inplace: bool | None = None,
               deadline: Deadline | None = None) -> Plan:
    """Reorder `plan`'s ops to lower its peak within `time_limit` seconds (and before the
    command's `deadline`); notes["order"]."""
    outer = deadline or unlimited()
    time_limit = outer.cap(max(0.0, float(time_limit)))
    start = time.perf_counter()
    # this pass's own wall end (a perf_counter reading): a safety net as the solves' wall
    # limits are; the counted limits end the pass on a quiet or a loaded machine alike
    ends_at = start + WALL_SLACK * time_limit
    order = compute_order(plan.schedule)
    if order is None:
        raise ScheduleError("the order pass needs a schedule of compute steps only; run it before "
                            "recompute and swap")
    inplace = bool(plan.aliases) if inplace is None else inplace
    problem = OrderProblem.build(plan.graph, inplace)
    judge = Judge(plan, inplace)

    budget = max(0.0, float(time_limit))
    heuristics, peaks = starts(problem, plan.graph, order, judge, Work(HEURISTIC_SHARE * budget, outer))
    first = min(peaks, key=lambda name: (peaks[name], list(peaks).index(name)))
    best = heuristics[first]
    bounds = LowerBound(problem, Work(BOUND_SHARE * budget, outer))
    bounds.cuts(bounds.candidates)
    lower = bounds.value

    # the search stops a little early: the wrap-up (a judge call, the notes) fits in the limit
    search = OrderSearch(problem, judge, best, ends_at - WRAP_UP_SHARE * budget, lower, outer, SEARCH_SHARE * budget)
    if peaks[first] <= lower:
        search.ended = "the start meets the lower bound"
    elif len(order) <= WHOLE_GRAPH_OPS:
        search.whole()
    else:
        if len(order) <= WHOLE_FIRST_OPS:   # a whole-graph model first, with half the time
            search.whole(search.seconds / 2)
        if search.proven is None and search.profile.peak_bytes > lower:
            search.windows()
    best, aliases, peak = search.order, search.aliases, search.profile.peak_bytes
    if peak > bounds.value:
        bounds.work = Work(BOUND_SHARE * budget, outer)
        steps = np.flatnonzero(search.profile.live_bytes == peak)
        bounds.cuts([problem.index[best[int(k)]] for k in steps[:2]])
    lower, lower_kind = bounds.value, bounds.kind
    if search.proven is not None and search.proven > lower:
        lower, lower_kind = search.proven, "cp-sat"
    if peak == lower:
        status = "optimal"
    else:
        status = "feasible" if search.solutions else "heuristic"
    schedule = order_schedule(best)
    notes = {"status": status, "peak_bytes": peak, "input_peak_bytes": judge.peak_of_plan(),
             "lower_bound_bytes": lower, "lower_bound": lower_kind, "cuts": bounds.cut_count,
             "inplace": inplace, "ops": len(order), "heuristic_peaks": peaks, "start": first,
             "cpsat": search.notes(),
             "deterministic": search.deterministic and not outer.expired,
             "time_limit_s": time_limit,
             "seconds": round(time.perf_counter() - start, 3)}
    return dataclasses.replace(plan, schedule=schedule, aliases=aliases, offsets=None,
                               notes={**plan.notes, "order": notes})


# ---- the problem, indexed ----------------------------------------------------------------
@dataclass
class OrderProblem:
    """The graph as integers: ops by index (graph order), tensors with producer/readers."""

    graph: Graph
    names: list[str]
    index: dict[str, int]
    preds: list[list[int]]
    succs: list[list[int]]
    tensors: list[str]             # modelled tensors: not static, more than 0 bytes
    nbytes: list[int]
    producer: list[int]            # op index, -1 for graph inputs
    readers: list[list[int]]       # distinct op indices
    held: list[bool]               # graph outputs: resident to the end of the step
    may_alias: list[bool]          # with in-place: this output may take an input's storage
    takes_static: list[bool]       # ... the storage of a parameter (an in-place update)
    static_bytes: int
    inplace: bool
    buffer: dict[str, int]         # tensor -> its modelled tensor: itself, or (with in-place)
                                   # the tensor whose storage a view of it shares

    @classmethod
    def build(cls, graph: Graph, inplace: bool) -> "OrderProblem":
        names = [op.name for op in graph.ops]
        index = {name: i for i, name in enumerate(names)}
        preds = [sorted({index[p] for p in graph.nx.predecessors(name)}) for name in names]
        succs = [sorted({index[s] for s in graph.nx.successors(name)}) for name in names]
        tensors, nbytes, producer, readers, held, may_alias, takes_static = [], [], [], [], [], [], []
        static = 0
        table = alias_table(graph)
        shares = _shared_views(graph, table) if inplace else {}
        buffer: dict[str, int] = {}
        for name, t in graph.tensors.items():
            if t.is_static:
                static += t.nbytes
                continue
            op = graph.producer.get(name)
            if (op is None and name not in graph.inputs) or t.nbytes == 0 or name in shares:
                continue
            buffer[name] = len(tensors)
            tensors.append(name)
            nbytes.append(t.nbytes)
            producer.append(index[op.name] if op is not None else -1)
            readers.append(sorted({index[c.name] for c in graph.consumers.get(name, [])}))
            held.append(name in graph.outputs)
            sources = table[name] if inplace and op is not None else []
            may_alias.append(bool(sources))
            takes_static.append(any(graph.tensors[x].is_static for x in sources))
        for name, root in shares.items():       # a view: its readers and holding go to its buffer
            k = buffer[name] = buffer[root]
            readers[k] = sorted(set(readers[k]) | {index[c.name] for c in graph.consumers.get(name, [])})
            held[k] = held[k] or name in graph.outputs
        return cls(graph, names, index, preds, succs, tensors, nbytes, producer, readers, held,
                   may_alias, takes_static, static, inplace, buffer)


def _shared_views(graph: Graph, table: dict[str, list[str]]) -> dict[str, str]:
    """View output -> the tensor whose storage it shares (rule 4: always, in place), views
    of views followed to the first tensor of the buffer. Views of parameters, graph inputs
    and the like copy (they are not alias sources)."""
    shares: dict[str, str] = {}
    for op in graph.ops:
        if not is_view(op):
            continue
        for out in op.present_outputs:
            sources = [x for x in table[out] if not graph.tensors[x].is_static]
            if sources and graph.tensors[out].nbytes:
                shares[out] = sources[0]
    for out in shares:
        while shares[out] in shares:
            shares[out] = shares[shares[out]]
    return shares


class Judge:
    """Candidate orders judged by the memory model, with greedy in-place aliases when asked."""

    def __init__(self, plan: Plan, inplace: bool):
        self.plan = plan
        self.inplace = inplace

    def aliases(self, order: list[str], prefer: dict[str, str] | None = None) -> dict[str, str]:
        if not self.inplace:
            return {}
        return choose_aliases(self.plan.graph, order_schedule(order), prefer or self.plan.aliases)

    def profile(self, order: list[str], aliases: dict[str, str]):
        return analyze(self.plan.graph, order_schedule(order), aliases, self.plan.on_host)

    def peak(self, order: list[str]) -> int:
        return self.profile(order, self.aliases(order)).peak_bytes

    def peak_of_plan(self) -> int:
        plan = self.plan
        return analyze(plan.graph, plan.schedule, plan.aliases, plan.on_host).peak_bytes


# ---- heuristics ----------------------------------------------------------------------------
def starts(problem: OrderProblem, graph: Graph, order: list[str], judge: "Judge", work: Work):
    """The heuristic orders and their judged peaks: the given order always, the others (each
    base, then sunk, then sunk and hoisted) while `work` allows (each priced at
    HEURISTIC_SECONDS_PER_OP), best-first as measured on the model zoo. Returns
    ({name: order}, {name: peak}); fewer than 12 when the work ran out."""
    bases = {"given": lambda: order, "list": lambda: list_schedule(problem),
             "training": lambda: training_order(graph, order), "dfs": lambda: dfs_schedule(problem, order)}
    steps = [("", lambda previous: previous), ("+sink", lambda previous: sink(problem, previous)),
             ("+hoist", lambda previous: hoist(problem, previous))]
    orders: dict[str, list[str]] = {}
    peaks: dict[str, int] = {}
    for name, build in bases.items():
        candidate = None
        for suffix, transform in steps:
            if orders and not work.ok():
                return orders, peaks
            candidate = build() if candidate is None else transform(candidate)
            name += suffix
            orders[name] = candidate
            peaks[name] = judge.peak(candidate)
            work.spend(HEURISTIC_SECONDS_PER_OP * len(order))
    return orders, peaks


def list_schedule(problem: OrderProblem) -> list[str]:
    """XLA's list scheduler: run the ready op with the most bytes freed minus bytes defined
    (ties: graph order). With in-place, an output that can take a parameter's storage at its
    last read defines nothing."""
    graph = problem.graph
    ops = graph.ops
    n = len(ops)
    tensors = graph.tensors
    remaining = {name: len({c.name for c in cs}) for name, cs in graph.consumers.items()}
    readers = {name: [problem.index[c.name] for c in cs] for name, cs in graph.consumers.items()}
    table = alias_table(graph) if problem.inplace else {}
    sources = [{out: table[out] for out in op.present_outputs} if problem.inplace else {} for op in ops]
    done = [False] * n
    waiting = [len(p) for p in problem.preds]
    version = [0] * n
    kept = set(graph.outputs)

    def priority(i: int) -> int:
        op = ops[i]
        freed = sum(tensors[t].nbytes for t in set(op.present_inputs)
                    if remaining[t] == 1 and not tensors[t].is_static and t not in kept)
        defined = 0
        for out in op.present_outputs:
            takes_parameter = any(remaining[x] == 1 and tensors[x].is_static for x in sources[i].get(out, ()))
            defined += 0 if takes_parameter else tensors[out].nbytes
        return freed - defined

    heap = [(-priority(i), i, 0) for i in range(n) if waiting[i] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, i, v = heapq.heappop(heap)
        if done[i] or v != version[i]:
            continue
        done[i] = True
        order.append(problem.names[i])
        for t in set(ops[i].present_inputs):
            remaining[t] -= 1
            if remaining[t] == 1:
                for j in readers[t]:
                    if not done[j] and waiting[j] == 0:
                        version[j] += 1
                        heapq.heappush(heap, (-priority(j), j, version[j]))
        for j in problem.succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, (-priority(j), j, version[j]))
    return order


def dfs_schedule(problem: OrderProblem, order: list[str]) -> list[str]:
    """Depth-first: always run an op made ready by the last one (latest in `order` first
    among them), so each chain is finished -- and its temporaries freed -- before the next."""
    position = {problem.index[name]: k for k, name in enumerate(order)}
    waiting = [len(p) for p in problem.preds]
    stack = sorted((i for i in range(len(waiting)) if waiting[i] == 0), key=lambda i: -position[i])
    result = []
    while stack:
        i = stack.pop()
        result.append(problem.names[i])
        newly = []
        for j in problem.succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                newly.append(j)
        stack.extend(sorted(newly, key=lambda j: -position[j]))
    return result


def _last_reads(problem: OrderProblem, order: list[str]) -> tuple[dict[str, int], set[str], dict[str, int]]:
    """Per modelled tensor (a storage buffer: views of it included) the step of its last
    reader in `order`, the tensors whose storage goes after that read (not graph outputs),
    and their sizes."""
    graph = problem.graph
    last_read: dict[str, int] = {}
    for k, name in enumerate(order):
        for t in _buffers(problem, graph.op_by_name[name].present_inputs):
            last_read[t] = k
    nbytes = dict(zip(problem.tensors, problem.nbytes))
    freeable = {t for t, held in zip(problem.tensors, problem.held) if not held}
    return last_read, freeable, nbytes


def _buffers(problem: OrderProblem, names: list[str]) -> list[str]:
    """The modelled tensors (storage buffers) behind `names`, once each, statics left out."""
    return [problem.tensors[k] for k in _buffer_indices(problem, names)]


def _buffer_indices(problem: OrderProblem, names: list[str]) -> list[int]:
    """The indices of those tensors (views resolved), once each."""
    return list(dict.fromkeys(problem.buffer[t] for t in names if t in problem.buffer))


def _balance(problem: OrderProblem, op, k: int, last_read, freeable, nbytes) -> tuple[list[str], int, int]:
    """(buffers the op at step k frees, bytes freed, bytes defined: a view defines none)."""
    freed = [t for t in _buffers(problem, op.present_inputs) if last_read.get(t) == k and t in freeable]
    return freed, sum(nbytes[t] for t in freed), sum(nbytes.get(t, 0) for t in op.present_outputs)


def sink(problem: OrderProblem, order: list[str]) -> list[str]:
    """`order` with each op that defines more bytes than it frees moved down to just before
    the first op that needs it: the first reader of one of its outputs, or the last reader
    of an input it does not free. Between its old and new step the outputs are not yet there
    and the freed inputs still are, which lowers those steps; the moved op's own step may
    hold more (what ran meanwhile), so the result is a candidate for the judge, not a sure
    gain. An op that frees what a moved op defined, and defines as much, moves with it (a
    chain X - mean -> * invstd of a norm's backward). Fixes the list scheduler's habit of
    running backward prologues (a Reshape of a forward activation) early."""
    index = problem.index
    graph = problem.graph
    position = {index[name]: k for k, name in enumerate(order)}
    last_read, freeable, nbytes = _last_reads(problem, order)
    triggers: dict[int, list[int]] = {}
    deferred: set[int] = set()
    producer = graph.producer
    for k, name in enumerate(order):
        op = graph.op_by_name[name]
        freed, freed_bytes, defined = _balance(problem, op, k, last_read, freeable, nbytes)
        carries = defined == freed_bytes > 0 and any(
            t in producer and index[producer[t].name] in deferred for t in freed)
        if defined <= freed_bytes and not carries:
            continue
        i = index[name]
        deadline = {r for t in op.present_outputs for r in (index[c.name] for c in graph.consumers.get(t, []))}
        deadline |= {index[order[last_read[t]]] for t in _buffers(problem, op.present_inputs)
                     if t in freeable and t not in freed}
        deadline.discard(i)
        deferred.add(i)
        for w in deadline:
            triggers.setdefault(w, []).append(i)
    result: list[str] = []
    emitted: set[int] = set()

    def emit(first: int) -> None:
        """Emit `first` after the deferred ops it triggers (their triggers first, and so on)."""
        stack = [(first, iter(sorted(triggers.get(first, ()), key=position.get)))]
        while stack:
            node, pending = stack[-1]
            for v in pending:
                if v not in emitted:
                    stack.append((v, iter(sorted(triggers.get(v, ()), key=position.get))))
                    break
            else:
                stack.pop()
                if node not in emitted:
                    emitted.add(node)
                    result.append(problem.names[node])

    for name in order:
        if index[name] not in deferred:
            emit(index[name])
    for name in order:
        emit(index[name])
    return result


def hoist(problem: OrderProblem, order: list[str]) -> list[str]:
    """`order` with each op that frees more bytes than it defines moved up to just after the
    last op it waits for: the producers of its inputs and the other readers of the inputs
    it frees. Between its new and old step the freed inputs are gone and the outputs there,
    which lowers those steps (the moved op's own step may hold more: a candidate for the
    judge, as with `sink`, whose mirror it is)."""
    index = problem.index
    graph = problem.graph
    last_read, freeable, nbytes = _last_reads(problem, order)
    remaining: dict[int, int] = {}
    waiting: dict[int, list[int]] = {}
    for k, name in enumerate(order):
        op = graph.op_by_name[name]
        freed, freed_bytes, defined = _balance(problem, op, k, last_read, freeable, nbytes)
        if freed_bytes <= defined:
            continue
        i = index[name]
        waits = set(problem.preds[i])
        waits |= {r for t in freed for r in problem.readers[problem.buffer[t]]}
        waits.discard(i)
        remaining[i] = len(waits)
        for w in waits:
            waiting.setdefault(w, []).append(i)
    result: list[str] = []
    emitted: set[int] = set()

    def emit(first: int) -> None:
        """Emit `first`, then every eager op it was the last wait of (and theirs, ...)."""
        ready = [first]
        while ready:
            node = ready.pop()
            if node in emitted:
                continue
            emitted.add(node)
            result.append(problem.names[node])
            for e in reversed(waiting.get(node, [])):
                remaining[e] -= 1
                if remaining[e] == 0:
                    ready.append(e)

    for name in order:
        i = index[name]
        if remaining.get(i) == 0:
            emit(i)
    for name in order:
        i = index[name]
        if i not in remaining:
            emit(i)
    return result


def drain(problem: OrderProblem, order: list[str]) -> list[str]:
    """`order` with buffers drained: after each op, the readers still to come of each buffer
    it makes or reads run right away -- with what they still wait for -- where all of them may
    (no op of another phase joins, but an update in the backward) and together they free more
    bytes than they keep. A U-Net decoder's partial sum then follows its second part, not its
    third; the upsampling's backward follows the gradient of each of its pieces; a ReLU's mask
    follows the dW that was the activation's other reader. The peak with everything kept, which
    the order pass minimises, rarely sees these; a plan that must swap or replay under a budget
    does: each big tensor dies young instead of waiting, resident or in flight, for an op the
    order put later for no reason (`passes.recompute.planner.base_orders`)."""
    graph = problem.graph
    phase = [graph.op_by_name[name].phase for name in problem.names]
    position = {problem.index[name]: k for k, name in enumerate(order)}
    made: dict[int, list[int]] = {}
    for b, p in enumerate(problem.producer):
        if p >= 0:
            made.setdefault(p, []).append(b)
    reads = [_buffer_indices(problem, graph.op_by_name[name].present_inputs) for name in problem.names]
    emitted: set[int] = set()
    result: list[str] = []

    def readers_now(trigger: int, b: int) -> list[int] | None:
        """The unrun readers of buffer b and their unrun ancestors, in order, if they may run
        after `trigger` and free more than they keep; else None."""
        group: set[int] = set()
        stack = [r for r in problem.readers[b] if r not in emitted]
        while stack:
            r = stack.pop()
            if r in emitted or r in group:
                continue
            if phase[r] != phase[trigger] and not (phase[trigger] == "backward" and phase[r] == "update"):
                return None
            group.add(r)
            stack.extend(problem.preds[r])
        ran = emitted | group
        freed = sum(problem.nbytes[x] for x in {x for r in group for x in reads[r]}
                    if not problem.held[x] and problem.producer[x] not in group
                    and all(r in ran for r in problem.readers[x]))
        kept = sum(problem.nbytes[x] for r in group for x in made.get(r, [])
                   if problem.held[x] or any(r2 not in ran for r2 in problem.readers[x]))
        return sorted(group, key=position.__getitem__) if group and freed > kept else None

    for name in order:
        first = problem.index[name]
        if first in emitted:
            continue
        queue = [first]
        while queue:
            op = queue.pop(0)
            if op not in emitted:
                emitted.add(op)
                result.append(problem.names[op])
            for b in made.get(op, []) + reads[op]:
                group = None if problem.held[b] else readers_now(op, b)
                if group:
                    emitted.update(group)
                    result.extend(problem.names[r] for r in group)
                    queue.extend(group)
    return result


# ---- lower bound -------------------------------------------------------------------------
def reachability(problem: OrderProblem) -> tuple[list[int], list[int]]:
    """Per op, bitsets (bit i = op index i) of its ancestors and of its descendants, itself
    included in both."""
    n = len(problem.names)
    topo = _topological(problem)
    anc = [0] * n
    for i in topo:
        bits = 1 << i
        for p in problem.preds[i]:
            bits |= anc[p]
        anc[i] = bits
    desc = [0] * n
    for i in reversed(topo):
        bits = 1 << i
        for s in problem.succs[i]:
            bits |= desc[s]
        desc[i] = bits
    return anc, desc


def structural_bound(problem: OrderProblem, reach: tuple[list[int], list[int]]) -> tuple[int, np.ndarray]:
    """The bytes resident at each op's step in *every* order -- tensors produced by an
    ancestor (or the op) and read by a descendant (or the op) -- and the largest such sum,
    static bytes included. Returns (bound, bytes per op)."""
    anc, desc = reach
    n = len(problem.names)
    everything = (1 << n) - 1
    width = (n + 7) // 8
    totals = np.zeros(n, dtype=np.int64)

    def add(mask: int, nbytes: int) -> None:
        if mask:
            bits = np.unpackbits(np.frombuffer(mask.to_bytes(width, "little"), dtype=np.uint8),
                                 bitorder="little")[:n]
            totals[:] += bits.astype(np.int64) * nbytes

    def read_by(readers: list[int]) -> int:
        ends = 0
        for c in readers:
            ends |= anc[c]
        return ends

    always, released = _static_residency(problem)
    for nbytes, readers in released:
        add(read_by(readers), nbytes)
    for k, nbytes in enumerate(problem.nbytes):
        u = problem.producer[k]
        if problem.takes_static[k]:
            continue      # it may live in a parameter's storage, counted with the parameter
        if u < 0:
            starts = everything
        else:
            starts = desc[u] & ~(1 << u) if problem.may_alias[k] else desc[u]
        if problem.held[k]:
            ends = everything
        elif problem.readers[k]:
            ends = read_by(problem.readers[k])
        else:
            ends = (1 << u) if u >= 0 else 0
        add(starts & ends, nbytes)
    return int(totals.max()) + always, totals + always


def cut_bound(problem: OrderProblem, u: int, reach: tuple[list[int], list[int]]) -> int:
    """Bytes resident at op u's step in every order, by a minimum cut.

    The ops run by u's step form a set S holding u and its ancestors, none of its
    descendants, closed under predecessors; every tensor produced in S (or a graph input)
    and read outside it is resident then, as are u's own inputs and outputs and the static
    bytes no order releases. The least such sum over all S is a max-flow min-cut: op nodes
    with uncuttable edges to their predecessors (closure), a node per tensor entered from
    its producer at its byte size and leaving to each reader uncuttably. Stronger than the
    structural bound where one of two tensors must be kept (x or a same-sized function of
    it) but either may be."""
    graph = problem.graph
    anc, desc = reach
    source, sink_ = "source", "sink"
    arcs: dict[tuple, int | None] = {}          # (tail, head) -> capacity; None: uncuttable
    for v, preds in enumerate(problem.preds):
        arcs.update(((v, p), None) for p in preds)
    arcs.update(((source, a), None) for a in _members(anc[u]))
    arcs.update(((d, sink_), None) for d in _members(desc[u] & ~(1 << u)))
    op = graph.op_by_name[problem.names[u]]
    around = {problem.tensors[problem.buffer[t]] for t in op.present_inputs + op.present_outputs
              if t in problem.buffer}
    constant = _static_residency(problem)[0]
    for k, nbytes in enumerate(problem.nbytes):
        name, producer = problem.tensors[k], problem.producer[k]
        if problem.takes_static[k] or (producer == u and problem.may_alias[k]):
            continue                       # lives in storage counted elsewhere
        if name in around or (problem.held[k] and producer < 0):
            constant += nbytes
            continue
        tail = source if producer < 0 else producer
        if problem.held[k]:
            _add_capacity(arcs, tail, sink_, nbytes)
        elif problem.readers[k]:
            _add_capacity(arcs, tail, ("t", k), nbytes)
            arcs.update(((("t", k), r), None) for r in problem.readers[k])
    return constant + _max_flow(arcs, source, sink_)


def _max_flow(arcs: dict[tuple, int | None], source, sink) -> int:
    """The maximum flow from `source` to `sink` (= the minimum cut's value) over `arcs`, by
    OR-Tools' max-flow in C++ (networkx's preflow-push took 2.5 s a cut on a 10,193-op step).
    Uncuttable arcs get more capacity than all the others together."""
    nodes: dict = {}
    index = [nodes.setdefault(node, len(nodes)) for arc in arcs for node in arc]
    if source not in nodes or sink not in nodes:
        return 0
    finite = sum(c for c in arcs.values() if c is not None)
    capacities = np.array([finite + 1 if c is None else c for c in arcs.values()], dtype=np.int64)
    flow = max_flow.SimpleMaxFlow()
    flow.add_arcs_with_capacity(np.array(index[0::2], dtype=np.int32), np.array(index[1::2], dtype=np.int32),
                                capacities)
    status = flow.solve(nodes[source], nodes[sink])
    if status != flow.OPTIMAL:
        raise RuntimeError(f"max flow ended with status {status}")
    return int(flow.optimal_flow())


def _members(bits: int) -> list[int]:
    """Indices of the set bits of `bits`."""
    width = (bits.bit_length() + 7) // 8
    if not width:
        return []
    flags = np.unpackbits(np.frombuffer(bits.to_bytes(width, "little"), dtype=np.uint8), bitorder="little")
    return [int(i) for i in np.flatnonzero(flags)]


def _add_capacity(arcs: dict[tuple, int | None], tail, head, nbytes: int) -> None:
    """Add `nbytes` to the arc's capacity (an uncuttable arc stays uncuttable)."""
    if (tail, head) not in arcs:
        arcs[(tail, head)] = nbytes
    elif arcs[(tail, head)] is not None:
        arcs[(tail, head)] += nbytes


def cut_candidates(problem: OrderProblem, reach, totals: np.ndarray, count: int = 5) -> list[int]:
    """Ops worth a min cut: the largest structural sums, and the ops with the most ancestors
    times descendants (in a training step, where the forward hands over to the backward)."""
    anc, desc = reach
    spread = [(anc[i].bit_count() - 1) * (desc[i].bit_count() - 1) for i in range(len(anc))]
    by_total = [int(i) for i in np.argsort(-totals, kind="stable")[:count]]
    by_spread = sorted(range(len(anc)), key=lambda i: (-spread[i], i))[:count]
    return list(dict.fromkeys(x for pair in zip(by_spread, by_total) for x in pair))


class LowerBound:
    """The best proven lower bound so far: structural at once, min cuts while `work` allows
    (each priced at CUT_SECONDS_PER_OP per op)."""

    def __init__(self, problem: OrderProblem, work: Work):
        self.problem = problem
        self.work = work
        self.cut_count = 0
        self.skipped = 0             # cuts left out for want of time
        self.done: set[int] = set()
        n = len(problem.names)
        if n == 0:
            self.value, self.kind, self.reach, self.candidates = problem.static_bytes, "structural", None, []
        elif n > STRUCTURAL_BOUND_OPS:
            self.value, self.kind, self.reach, self.candidates = _per_op_bound(problem), "per-op", None, []
        else:
            self.reach = reachability(problem)
            self.value, totals = structural_bound(problem, self.reach)
            self.kind = "structural"
            self.candidates = cut_candidates(problem, self.reach, totals)

    def cuts(self, ops: list[int]) -> None:
        """Min cuts at `ops` (skipping those done), each while the work has time left."""
        if self.reach is None:
            return
        for u in ops:
            if u in self.done:
                continue
            if not self.work.ok():
                self.skipped += 1
                continue
            value = cut_bound(self.problem, u, self.reach)
            self.work.spend(CUT_SECONDS_PER_OP * len(self.problem.names))
            self.done.add(u)
            self.cut_count += 1
            if value > self.value:
                self.value, self.kind = value, "min-cut"


def _static_residency(problem: OrderProblem) -> tuple[int, list[tuple[int, list[int]]]]:
    """Static bytes resident at every step, and the statics that may leave early.

    A parameter overwritten in place by an update keeps its storage to the end when the
    update's output is a graph output (the storage holds one or the other); only where an
    overwriting output dies may the storage go, after the parameter's last reader at least:
    those come back as (bytes, reader op indices)."""
    if not problem.inplace:
        return problem.static_bytes, []
    graph = problem.graph
    table = alias_table(graph)
    writers: dict[str, list[str]] = {}
    for op in graph.ops:
        for out in op.present_outputs:
            for x in table[out]:
                if graph.tensors[x].is_static:
                    writers.setdefault(x, []).append(out)
    always = problem.static_bytes
    released = []
    for x, outs in writers.items():
        if all(out in graph.outputs for out in outs):
            continue
        always -= graph.tensors[x].nbytes
        readers = sorted({problem.index[c.name] for c in graph.consumers.get(x, [])})
        released.append((graph.tensors[x].nbytes, readers))
    return always, released


def _per_op_bound(problem: OrderProblem) -> int:
    """Each op's non-static inputs and outputs (less those it may write in place)."""
    at = np.zeros(len(problem.names), dtype=np.int64)
    for k, nbytes in enumerate(problem.nbytes):
        if problem.takes_static[k]:
            continue
        for c in problem.readers[k]:
            at[c] += nbytes
        u = problem.producer[k]
        if u >= 0 and not problem.may_alias[k] and u not in problem.readers[k]:
            at[u] += nbytes
    return int(at.max()) + _static_residency(problem)[0]


def _topological(problem: OrderProblem) -> list[int]:
    waiting = [len(p) for p in problem.preds]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    result = []
    while ready:
        i = ready.pop()
        result.append(i)
        for j in problem.succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    return result


# ---- CP-SAT --------------------------------------------------------------------------------
class OrderSearch:
    """CP-SAT improvement of an order: one whole-graph model, or windows around the peak."""

    def __init__(self, problem: OrderProblem, judge: Judge, order: list[str], deadline: float,
                 lower_bound: int = 0, outer: Deadline | None = None, seconds: float = math.inf):
        self.problem = problem
        self.outer = outer
        self.seconds = seconds       # CP-SAT's limits add up to at most this (a count, not the clock)
        self.spent = 0.0
        self.lower_bound = lower_bound
        self.judge = judge
        self.order = list(order)
        self.aliases = judge.aliases(self.order)
        self.profile = judge.profile(self.order, self.aliases)
        self.deadline = deadline
        self.mode = None
        self.solves = 0
        self.improved = 0
        self.solutions = 0
        self.statuses: dict[str, int] = {}
        self.proven: int | None = None
        self.deterministic = True
        self.window_ops = WINDOW_OPS
        self.ended = None

    def left(self) -> float:
        if self.outer is not None and self.outer.stopped:
            return 0.0
        return self.deadline - time.perf_counter()

    def whole(self, time_limit: float | None = None) -> None:
        self.mode = "whole graph"
        n = len(self.order)
        if n == 0 or self.left() <= 0.05:
            self.ended = "no time" if n else "empty graph"
            return
        if time_limit is None:
            limit = self.seconds - self.spent if self.seconds < math.inf else self.left()
        else:
            limit = time_limit
        solved, scale, modelled_static = self._step(0, n, limit, floor=self.lower_bound)
        if solved is not None and solved.status == "optimal":
            # the whole graph's exact model: its optimum bounds every order from below
            unmodelled = self.problem.static_bytes - modelled_static
            self.proven = unmodelled + scale * int(round(solved.bound))

    def windows(self) -> None:
        """Re-optimise windows around peak steps -- the peak at the window's middle, then at
        a quarter and at three quarters of it -- growing the windows when every peak step
        was tried, until none is left or the time is up."""
        self.mode = "windows" if self.mode is None else f"{self.mode}, then windows"
        tried: set[tuple[int, float]] = set()
        n = len(self.order)
        window_limit = max(1.0, WINDOW_SHARE * self.seconds)
        while True:
            if self.spent + window_limit > self.seconds:
                self.ended = "time limit"
                return
            if self.left() <= 0.1:
                self.ended = "the clock (a loaded machine)"
                self.deterministic = False
                return
            live = self.profile.live_bytes
            peak_steps = [int(s) for s in np.flatnonzero(live == live.max())]
            todo = [(s, f) for f in WINDOW_PLACES for s in peak_steps if (s, f) not in tried]
            if not todo:
                if self.window_ops >= min(MAX_WINDOW_OPS, n):
                    self.ended = "no peak step left to improve"
                    return
                self.window_ops = min(self.window_ops * 2, MAX_WINDOW_OPS)
                tried.clear()
                continue
            step, place = todo[0]
            ws = max(0, min(step - int(self.window_ops * place), n - self.window_ops))
            we = min(n, ws + self.window_ops)
            peak = self.profile.peak_bytes
            self._step(ws, we, window_limit)
            tried.update((s, place) for s in peak_steps if ws <= s < we)
            if self.profile.peak_bytes < peak:
                tried.clear()

    def _step(self, ws: int, we: int, time_limit: float, floor: int = 0):
        """Solve the window [ws, we) of the current order and keep the result if the judge
        finds it better. `floor`: a lower bound on the whole graph's peak (whole-graph models
        only). Returns (solve result or None, byte scale, static bytes modelled)."""
        model, positions, scale, pairs, modelled_static = window_model(self.problem, self.order, ws, we,
                                                                       self.aliases, floor)
        solved = solve(model, time_limit, presolve=False, deadline=self.outer)
        self.spent += time_limit
        self.solves += 1
        self.statuses[solved.status] = self.statuses.get(solved.status, 0) + 1
        self.deterministic &= solved.deterministic
        if not solved.has_solution:
            return None, scale, modelled_static
        self.solutions += 1
        value = solved.solver.Value
        inside = sorted(positions, key=lambda i: value(positions[i]))
        order = self.order[:ws] + [self.problem.names[i] for i in inside] + self.order[we:]
        window_outputs = {out for out, _, _ in pairs}
        prefer = {o: x for o, x in self.aliases.items() if o not in window_outputs}
        prefer.update({out: src for out, src, var in pairs if value(var)})
        aliases = self.judge.aliases(order, prefer)
        profile = self.judge.profile(order, aliases)
        if _better(profile, self.profile):
            self.order, self.aliases, self.profile = order, aliases, profile
            self.improved += 1
        return solved, scale, modelled_static

    def notes(self) -> dict:
        notes = {"mode": self.mode, "solves": self.solves, "improved": self.improved,
                 "statuses": self.statuses}
        if self.mode and self.mode.endswith("windows"):
            notes.update(window_ops=self.window_ops, ended=self.ended)
        elif self.ended:
            notes["ended"] = self.ended
        return notes


def _better(new, old) -> bool:
    """Lower peak, or the same peak at fewer steps (the next window can then remove the rest)."""
    new_count = int((new.live_bytes == new.peak_bytes).sum())
    old_count = int((old.live_bytes == old.peak_bytes).sum())
    return (new.peak_bytes, new_count) < (old.peak_bytes, old_count)


def window_model(problem: OrderProblem, order: list[str], ws: int, we: int, aliases: dict[str, str],
                 floor: int = 0):
    """CP-SAT model of steps [ws, we) of `order` with every other op fixed.

    Returns (model, {op index: position variable}, byte scale, [(output, source, bool var)],
    static bytes modelled). Each tensor is an interval from its producer to its last reader,
    clipped to the window; one no window op touches either spans the whole window (the same
    bytes at every step: left out) or is a fixed interval. With in-place, each eligible pair
    at a window op is a choice: taken, every other reader of the source runs first and the
    output starts one step after its op (rule 4 of the memory model). A parameter that may be
    overwritten is modelled too: to the end of the step, or to its last reader if overwritten.
    Pairs at ops outside the window keep `aliases`. `floor` (whole graph only) is a known
    lower bound on the peak, given to the solver to shorten its proof.
    """
    window = _Window(problem, order, ws, we, aliases)
    for k, nbytes in enumerate(problem.nbytes):
        window.add_tensor(k, nbytes)
    for x in window.statics:
        window.add_static(x)
    window.minimize_peak(floor)
    return window.model, window.pos, window.scale, window.pairs, window.modelled_static


class _Window:
    """The CP-SAT model of one window of an order as `window_model` builds it: the position
    variables, the tensors' intervals and byte demands (in units of `scale`), and the hinted
    order's bytes per window step (`load`)."""

    def __init__(self, problem: OrderProblem, order: list[str], ws: int, we: int, aliases: dict[str, str]):
        self.problem, self.ws, self.we, self.aliases, self.n = problem, ws, we, aliases, len(order)
        index, graph = problem.index, problem.graph
        self.position = position = {index[name]: k for k, name in enumerate(order)}
        inside = [index[name] for name in order[ws:we]]
        self.inside = inside_set = set(inside)
        self.model = model = cp_model.CpModel()
        self.pos = pos = {i: model.NewIntVar(ws, we - 1, f"p{i}") for i in inside}
        # one op per step; a NoOverlap of unit intervals, which CP-SAT does not expand into a
        # Boolean permutation matrix as it does an AllDifferent over exactly n values
        model.AddNoOverlap([model.NewFixedSizeIntervalVar(v, 1, f"o{i}") for i, v in pos.items()])
        for i in inside:
            model.AddHint(pos[i], position[i])
            for p in problem.preds[i]:
                if p in inside_set:
                    model.Add(pos[p] + 1 <= pos[i])
        self.pairs = _alias_choices(problem, model, pos, position, we, aliases) if problem.inplace else []
        self.takes: dict[str, list] = {}       # output -> its pair variables
        self.taken_by: dict[str, list] = {}    # source -> its pair variables
        for out, src, var in self.pairs:
            self.takes.setdefault(out, []).append(var)
            self.taken_by.setdefault(src, []).append(var)
        self.statics = sorted({src for _, src, _ in self.pairs if graph.tensors[src].is_static})
        self.modelled_static = sum(graph.tensors[x].nbytes for x in self.statics)
        self.scale = math.gcd(*problem.nbytes, *(graph.tensors[x].nbytes for x in self.statics)) or 1
        self.intervals: list = []
        self.demands: list[int] = []
        self.load = np.zeros(we - ws + 1, dtype=np.int64)     # the hinted order's bytes per window step

    def hinted(self, var, value: int):
        self.model.AddHint(var, int(value))
        return var

    def readers_end(self, readers: list[int], name: str):
        """The window step of the last of `readers` (a variable when several move), and its hint."""
        inner = [r for r in readers if r in self.inside]
        last = max(self.position[r] for r in inner)
        if len(inner) == 1:
            return self.pos[inner[0]], last
        end = self.hinted(self.model.NewIntVar(self.ws, self.we - 1, f"e{name}"), last)
        self.model.AddMaxEquality(end, [self.pos[r] for r in inner])
        return end, last

    def demand(self, interval, nbytes: int, first: int, last: int) -> None:
        """`interval` holds `nbytes`; in the hinted order, from window step `first` to `last`."""
        self.intervals.append(interval)
        self.demands.append(nbytes // self.scale)
        self.load[first - self.ws] += nbytes // self.scale
        self.load[last + 1 - self.ws] -= nbytes // self.scale

    def add(self, start, end, nbytes: int, name: str, hint: tuple[int, int]) -> None:
        size = self.hinted(self.model.NewIntVar(0, self.we - self.ws, f"s{name}"), hint[1] + 1 - hint[0])
        self.demand(self.model.NewIntervalVar(start, size, end + 1, f"t{name}"), nbytes, *hint)

    def add_tensor(self, k: int, nbytes: int) -> None:
        """Tensor `k`: an interval from its producer to its last reader, clipped to the window."""
        problem, position, inside, ws, we = self.problem, self.position, self.inside, self.ws, self.we
        name, u, readers = problem.tensors[k], problem.producer[k], problem.readers[k]
        if not (u in inside or any(r in inside for r in readers)):
            first = (position[u] + (name in self.aliases)) if u >= 0 else 0
            last = _fixed_end(problem, k, position, self.n)
            if (first > ws or last < we - 1) and first <= we - 1 and last >= ws:
                lo, hi = max(first, ws), min(last, we - 1)
                self.demand(self.model.NewIntervalVar(lo, hi - lo + 1, hi + 1, f"c{k}"), nbytes, lo, hi)
            return
        if u in inside:
            first = position[u] + (name in self.aliases and name in self.takes)
            start = self.hinted(self.model.NewIntVar(ws, we, f"b{k}"), first)
            self.model.Add(start == self.pos[u] + sum(self.takes.get(name, [])))
        else:
            start = first = ws
        if problem.held[k] or any(position[r] >= we for r in readers):
            end = last = we - 1
        elif any(r in inside for r in readers):
            end, last = self.readers_end(readers, str(k))
        else:
            end, last = self.pos[u], position[u]
        self.add(start, end, nbytes, str(k), (first, last))

    def add_static(self, x: str) -> None:
        """A parameter that may be overwritten: to the end of the step, or -- overwritten -- to
        its last reader, the overwriting op."""
        model, graph, ws, we = self.model, self.problem.graph, self.ws, self.we
        readers = [self.problem.index[c.name] for c in graph.consumers.get(x, [])]
        overwritten = x in self.aliases.values()
        taken = self.hinted(model.NewBoolVar(f"taken_{x}"), overwritten)
        model.Add(taken == sum(self.taken_by[x]))
        last, last_hint = self.readers_end(readers, x)
        hint = last_hint if overwritten else we - 1
        end = self.hinted(model.NewIntVar(ws, we - 1, f"end_{x}"), hint)
        model.Add(end == last).OnlyEnforceIf(taken)
        model.Add(end == we - 1).OnlyEnforceIf(taken.Not())
        self.add(ws, end, graph.tensors[x].nbytes, x, (ws, hint))

    def minimize_peak(self, floor: int) -> None:
        """The objective: the least capacity that holds every interval at every step, hinted
        with the given order's peak and bounded below by `floor` over the whole graph."""
        hint = int(np.cumsum(self.load)[:-1].max(initial=0))
        least = 0
        if floor and (self.ws, self.we) == (0, self.n):
            unmodelled = self.problem.static_bytes - self.modelled_static
            least = min(hint, max(0, -(-(floor - unmodelled) // self.scale)))
        capacity = self.hinted(self.model.NewIntVar(least, max(least, sum(self.demands)), "peak"), hint)
        self.model.AddCumulative(self.intervals, self.demands, capacity)
        self.model.Minimize(capacity)


def _alias_choices(problem: OrderProblem, model: cp_model.CpModel, pos: dict, position: dict, we: int,
                   aliases: dict[str, str]) -> list:
    """A bool per eligible (output, source) pair at a window op, each source and output used
    once; taken, every other reader of the source precedes the op. Hinted with `aliases`."""
    graph = problem.graph
    index = problem.index
    table = alias_table(graph)
    modelled = set(problem.tensors)
    pairs = []
    for i in pos:
        op = graph.op_by_name[problem.names[i]]
        for out in op.present_outputs:
            if out not in modelled:
                continue
            for src in table[out]:
                readers = (problem.readers[problem.buffer[src]] if src in problem.buffer
                           else [index[c.name] for c in graph.consumers.get(src, [])])
                others = [r for r in readers if r != i]
                if any(position[r] >= we for r in others):
                    continue              # a reader after the window: the source cannot die here
                var = model.NewBoolVar(f"a_{out}_{src}")
                model.AddHint(var, aliases.get(out) == src)
                for r in others:
                    if r in pos:
                        model.Add(pos[r] + 1 <= pos[i]).OnlyEnforceIf(var)
                pairs.append((out, src, var))
    for group in _groups(pairs, lambda p: p[0]) + _groups(pairs, lambda p: p[1]):
        if len(group) > 1:
            model.Add(sum(var for *_, var in group) <= 1)
    return pairs


def _groups(items: list, key) -> list[list]:
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def _fixed_end(problem: OrderProblem, k: int, position: dict[int, int], n: int) -> int:
    """Last step of tensor k when none of its ops moves (the memory model's rule 2)."""
    if problem.held[k]:
        return n - 1
    readers = problem.readers[k]
    if readers:
        return max(position[r] for r in readers)
    u = problem.producer[k]
    return position[u] if u >= 0 else 0
