"""Data-parallel training over N workers: when gradient all-reduces hide behind backward.

Each worker runs the plan's compute stream with the simulator's per-op times (swap stalls are
the simulator's business and are not repeated here). A gradient bucket is what one backward
op produces of `param_grad` tensors (one layer's dW). Its ring all-reduce takes

    2 (N - 1) / N * bytes / bandwidth + 2 (N - 1) * latency

on one network stream, buckets in the order they are ready (FIFO, as one communicator does).

With overlap, a bucket's all-reduce starts as soon as its dW op ends, while backward goes on.
The update is split per layer: an update-phase op runs once the all-reduces of the gradients
it depends on (through other update ops) are done, and the next step's ops that read a
parameter wait only for the update ops that read that parameter. The compute stream gives
priority to forward/backward ops; pending updates run, in order of readiness, when an op needs
their parameter or when the step's backward is over. Without overlap, all all-reduces start
after backward, all updates after the all-reduces, and the next forward after the updates.

The step time reported is the steady-state period: the time between the ends of the
backward passes of two consecutive steps (or of their all-reduces, if the network is the
bottleneck), from a short run of `ITERATIONS` steps.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from .errors import UserError
from .ir import Graph
from .schedule import Plan
from .simulate import Simulation

ITERATIONS = 3


def allreduce_time(nbytes: int, workers: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `nbytes` over `workers`: reduce-scatter then all-gather."""
    if workers < 1 or bandwidth <= 0 or latency < 0:
        raise UserError("data parallel needs at least one worker, a positive bandwidth and a latency >= 0")
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * latency


@dataclass(frozen=True)
class Bucket:
    op: str              # the backward op whose param_grad outputs form the bucket
    grads: tuple[str, ...]
    nbytes: int
    seconds: float       # its all-reduce


@dataclass(frozen=True)
class DataParallel:
    workers: int
    compute_s: float                 # one step's compute on one worker (updates included)
    allreduce_s: float               # sum of all buckets' all-reduces
    step_no_overlap_s: float
    step_overlap_s: float
    first_step_s: float              # one step from a cold start, with overlap, updates flushed
    buckets: list[Bucket]

    @property
    def exposed_comm_s(self) -> float:
        return self.step_overlap_s - self.compute_s

    def to_dict(self) -> dict:
        return {"workers": self.workers, "compute_s": self.compute_s, "allreduce_s": self.allreduce_s,
                "step_no_overlap_s": self.step_no_overlap_s, "step_overlap_s": self.step_overlap_s,
                "first_step_s": self.first_step_s, "exposed_comm_s": self.exposed_comm_s,
                "buckets": [{"op": b.op, "grads": list(b.grads), "bytes": b.nbytes, "seconds": b.seconds}
                            for b in self.buckets]}


def data_parallel(plan: Plan, sim: Simulation, workers: int, bandwidth: float, latency: float) -> DataParallel:
    """Step times of `plan` on `workers` data-parallel workers, with and without overlap."""
    graph = plan.graph
    steps = [(e.target, e.end - e.start, e.kind == "recompute") for e in sim.on("compute")]
    buckets = _buckets(graph, steps, workers, bandwidth, latency)
    main = [step for step in steps if graph.op_by_name[step[0]].phase != "update"]
    updates = [(name, t) for name, t, _ in steps if graph.op_by_name[name].phase == "update"]
    compute = sum(t for _, t, _ in steps)
    comm = sum(b.seconds for b in buckets.values())
    no_overlap = sum(t for _, t, _ in main) + comm + sum(t for _, t in updates)
    one = _run(graph, main, updates, buckets, iterations=1)
    many = _run(graph, main, updates, buckets, iterations=ITERATIONS)
    return DataParallel(workers=workers, compute_s=compute, allreduce_s=comm, step_no_overlap_s=no_overlap,
                        step_overlap_s=many["period"], first_step_s=one["end"], buckets=list(buckets.values()))


def _buckets(graph: Graph, steps, workers, bandwidth, latency) -> dict[str, Bucket]:
    """Backward op name -> the bucket of param_grad tensors it produces (not its replays)."""
    result = {}
    for name, _, replay in steps:
        op = graph.op_by_name[name]
        if op.phase != "backward" or replay:
            continue
        grads = tuple(t for t in op.present_outputs if graph.tensors[t].kind == "param_grad")
        if grads:
            nbytes = sum(graph.tensors[t].nbytes for t in grads)
            result[name] = Bucket(name, grads, nbytes, allreduce_time(nbytes, workers, bandwidth, latency))
    return result


def _grads_behind(graph: Graph, update_ops) -> dict[str, set[str]]:
    """Update op -> the param_grad tensors it reads, directly or through other update ops."""
    memo: dict[str, set[str]] = {}
    for name in update_ops:                 # schedule order: producers come first
        grads: set[str] = set()
        for t in graph.op_by_name[name].present_inputs:
            if graph.tensors[t].kind == "param_grad":
                grads.add(t)
            producer = graph.producer.get(t)
            if producer is not None and producer.phase == "update":
                grads |= memo.get(producer.name, set())
        memo[name] = grads
    return memo


def _run(graph: Graph, main, updates, buckets: dict[str, Bucket], iterations: int) -> dict:
    """Event simulation of `iterations` overlapped steps; returns the last period and the end."""
    behind = _grads_behind(graph, [n for n, _ in updates])
    reads = {n: [t for t in graph.op_by_name[n].present_inputs if graph.tensors[t].kind == "parameter"]
             for n, _, _ in main}
    updated_by: dict[str, list[str]] = {}       # parameter -> update ops reading it
    for n, _ in updates:
        for t in graph.op_by_name[n].present_inputs:
            if graph.tensors[t].kind == "parameter":
                updated_by.setdefault(t, []).append(n)
    clock = net = 0.0
    pending: list[tuple[float, int, str, float]] = []     # (ready, order, op, seconds) of earlier steps
    done: set[str] = set()                                 # update ops run for the latest pending step
    main_ends, net_ends = [], []

    def run_until(condition) -> None:
        nonlocal clock
        while pending and not condition():
            ready, _, name, seconds = heapq.heappop(pending)
            clock = max(clock, ready) + seconds
            done.add(name)

    for _ in range(iterations):
        grad_ready: dict[str, float] = {}
        for name, seconds, replay in main:
            for p in reads[name]:
                run_until(lambda p=p: all(u in done for u in updated_by.get(p, ())))
            clock += seconds
            if name in buckets and not replay:
                b = buckets[name]
                net = max(net, clock) + b.seconds
                for g in b.grads:
                    grad_ready[g] = net
        main_ends.append(clock)
        net_ends.append(net)
        run_until(lambda: False)             # the previous step's updates no op here needed
        done = set()
        for order, (name, seconds) in enumerate(updates):
            ready = max((grad_ready.get(g, 0.0) for g in behind[name]), default=0.0)
            heapq.heappush(pending, (ready, order, name, seconds))
    run_until(lambda: False)
    end = max(clock, net)
    if iterations == 1:
        return {"period": end, "end": end}
    return {"period": max(main_ends[-1] - main_ends[-2], net_ends[-1] - net_ends[-2]), "end": end}
