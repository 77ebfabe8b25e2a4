"""Data-parallel training over N workers: gradient buckets and when their all-reduces hide.

Each worker runs the same plan on its share of the batch (`worker_forward` plans the model at
the per-worker batch), and the workers' weight gradients are averaged by all-reduces. The
gradients (`weight_gradients`: what the updates read) are grouped into buckets as DDP does
(`gradient_buckets`): walking the schedule, each backward op's weight gradients join the open
bucket, which closes once it holds `bucket_bytes` (DDP's default 25 MiB) -- or earlier, where an
op is about to read one of its gradients (an update that runs before the bucket would fill).
A bucket's all-reduce starts when the op that closes it (its last gradient's maker) ends; an op
that reads a gradient waits for that gradient's bucket only. The buckets are a function of the
plan, so every worker, the estimate and the runtime (memsched.runtime.distributed) see the same ones.

A ring all-reduce of a bucket takes

    2 (N - 1) / N * bytes / bandwidth + 2 (N - 1) * latency

on one network stream, buckets in the order they close (FIFO, as one communicator does).

The estimate (`data_parallel`) replays the plan as one worker runs it: the compute stream runs
the schedule's ops in order with the simulator's per-op times (swap stalls are the simulator's
business and are not repeated here), an op that reads a gradient starts once that gradient's
all-reduce is done. With overlap, a bucket's all-reduce starts when it closes, while backward
goes on; without, it starts only when an op (or the end of the step) needs it, every closed
bucket then all-reduced before compute goes on (backward first, then all communication, then
the updates, where the updates follow backward).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from .errors import UserError
from .ir import Graph, metadata_json
from .schedule import Plan, RUNS, StepKind
from .simulate import Simulation

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024      # DDP's bucket_cap_mb=25
# The default interconnect: 100 Gb/s InfiniBand (12.5 GB/s) with ~5 us per message.
INTERCONNECT = (12.5e9, 5e-6)
# Where a data-parallel plan records its workers, bucket size and per-sample inputs (graph metadata).
PLAN_KEY = "memsched.data_parallel"
# where the training step records each BatchNormalization's per-channel batch statistics:
# {BN name: {"forward": [mean, variance], "backward": [sum of dy, sum of dy * xhat]}}
BATCH_STATISTICS_KEY = "memsched.batch_statistics"


def allreduce_time(nbytes: int, workers: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `nbytes` over `workers`: reduce-scatter then all-gather."""
    if workers < 1 or bandwidth <= 0 or latency < 0:
        raise UserError("data parallel needs at least one worker, a positive bandwidth and a latency >= 0")
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * latency


@dataclass(frozen=True)
class Bucket:
    op: str                  # the op whose end closes the bucket (its last gradient's maker)
    step: int                # that op's index in the schedule
    grads: tuple[str, ...]   # param_grad tensors, in the order they are made
    nbytes: int
    seconds: float = 0.0     # its all-reduce (the estimate's)


@dataclass(frozen=True)
class DataParallel:
    workers: int
    bucket_bytes: int
    compute_s: float                 # one step's compute on one worker (updates included)
    allreduce_s: float               # sum of all buckets' all-reduces
    step_no_overlap_s: float
    step_overlap_s: float
    buckets: list[Bucket]

    @property
    def exposed_comm_s(self) -> float:
        """Time the compute stream waits for all-reduces, with overlap."""
        return self.step_overlap_s - self.compute_s

    @property
    def overlap_fraction(self) -> float:
        """The share of all-reduce time hidden behind compute (1 where there is none)."""
        return 1.0 - self.exposed_comm_s / self.allreduce_s if self.allreduce_s > 0 else 1.0

    def to_dict(self) -> dict:
        return {"workers": self.workers, "bucket_bytes": self.bucket_bytes, "compute_s": self.compute_s,
                "allreduce_s": self.allreduce_s, "step_no_overlap_s": self.step_no_overlap_s,
                "step_overlap_s": self.step_overlap_s, "exposed_comm_s": self.exposed_comm_s,
                "overlap_fraction": self.overlap_fraction,
                "buckets": [{"op": b.op, "grads": list(b.grads), "bytes": b.nbytes, "seconds": b.seconds}
                            for b in self.buckets]}


def weight_gradients(graph: Graph) -> set[str]:
    """The weight gradients the workers average: `param_grad` tensors that only update ops read
    (or none: a step's gradient outputs). Autodiff also marks the tensors on the way to a
    weight's gradient (a convolution's transposed or reshaped partial results) `param_grad`;
    backward ops read those, and they are no gradient of a weight yet."""
    consumers = graph.consumers
    return {name for name, t in graph.tensors.items() if t.kind == "param_grad"
            and all(op.phase == "update" for op in consumers.get(name, ()))}


def gradient_buckets(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """The plan's gradient buckets, in the order they close (module docstring). Only an op's
    first computation makes gradients for a bucket (a recomputation replays it)."""
    if bucket_bytes < 1:
        raise UserError(f"the bucket size must be at least 1 byte, not {bucket_bytes}")
    graph = plan.graph
    weights = weight_gradients(graph)
    buckets: list[Bucket] = []
    grads: list[str] = []
    last: tuple[str, int] | None = None        # the latest op that added to the open bucket

    def close() -> None:
        nonlocal grads, last
        if grads:
            buckets.append(Bucket(last[0], last[1], tuple(grads), sum(graph.tensors[t].nbytes for t in grads)))
        grads, last = [], None

    for i, step in enumerate(plan.schedule):
        if step.kind not in RUNS:
            continue
        op = graph.op_by_name[step.target]
        if grads and set(op.present_inputs) & set(grads):
            close()
        made = [t for t in op.present_outputs if t in weights]
        if step.kind == StepKind.COMPUTE and made:
            grads.extend(made)
            last = (op.name, i)
            if sum(graph.tensors[t].nbytes for t in grads) >= bucket_bytes:
                close()
    close()
    return buckets


def readers(plan: Plan, buckets: list[Bucket]) -> dict[int, list[int]]:
    """Schedule step -> the buckets (indices) whose gradients its op reads."""
    of = {g: k for k, b in enumerate(buckets) for g in b.grads}
    result = {}
    for i, step in enumerate(plan.schedule):
        if step.kind in RUNS:
            needed = sorted({of[t] for t in plan.graph.op_by_name[step.target].present_inputs if t in of})
            if needed:
                result[i] = needed
    return result


def data_parallel(plan: Plan, sim: Simulation, workers: int, bandwidth: float = INTERCONNECT[0],
                  latency: float = INTERCONNECT[1], bucket_bytes: int | None = None) -> DataParallel:
    """Step times of `plan` on `workers` data-parallel workers, with and without overlap.
    `bucket_bytes` None: the size the plan was compiled with (`PLAN_KEY`), else DDP's default."""
    if bucket_bytes is None:
        bucket_bytes = plan_options(plan.graph).get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    buckets = [replace(b, seconds=allreduce_time(b.nbytes, workers, bandwidth, latency))
               for b in gradient_buckets(plan, bucket_bytes)]
    steps = [(e.step, e.end - e.start) for e in sim.on("compute")]
    compute = sum(t for _, t in steps)
    comm = sum(b.seconds for b in buckets)
    needs = readers(plan, buckets)
    return DataParallel(workers=workers, bucket_bytes=bucket_bytes, compute_s=compute, allreduce_s=comm,
                        step_no_overlap_s=_replay(steps, buckets, needs, overlap=False),
                        step_overlap_s=_replay(steps, buckets, needs, overlap=True), buckets=buckets)


def _replay(steps: list[tuple[int, float]], buckets: list[Bucket], needs: dict[int, list[int]],
            overlap: bool) -> float:
    """One step on one worker: the compute stream in schedule order, all-reduces on one network
    stream in the order they start; returns when both are done. `needs`: `readers` of the plan."""
    closing = {b.step: k for k, b in enumerate(buckets)}
    done: dict[int, float] = {}           # bucket -> when its all-reduce ends
    closed: list[int] = []                # buckets closed, not yet started (without overlap)
    clock = net = 0.0

    def start(ks) -> None:
        nonlocal net
        for k in ks:
            net = max(net, clock) + buckets[k].seconds
            done[k] = net

    for index, seconds in steps:
        wanted = needs.get(index, [])
        if not overlap and any(k not in done for k in wanted):
            start(closed)
            closed.clear()
            clock = max(clock, net)
        clock = max([clock] + [done[k] for k in wanted]) + seconds
        if index in closing:
            if overlap:
                start([closing[index]])
            else:
                closed.append(closing[index])
    start(closed)
    return max(clock, net)


# ---- the plan at the per-worker batch ---------------------------------------------------------
def plan_options(graph: Graph) -> dict:
    """What a data-parallel compile recorded in the graph: {'workers', 'bucket_bytes',
    'batch_inputs', 'worker_batch'}; {} for a plan compiled for one worker."""
    text = graph.metadata.get(PLAN_KEY)
    if not text:
        return {}
    return metadata_json(text, PLAN_KEY, lambda v: (
        isinstance(v, dict) and isinstance(v["workers"], int) and v["workers"] >= 1
        and isinstance(v["bucket_bytes"], int) and v["bucket_bytes"] >= 1
        and all(isinstance(n, str) and n in graph.tensors for n in v["batch_inputs"])
        and (v["worker_batch"] is None or isinstance(v["worker_batch"], int) and v["worker_batch"] >= 1)),
        "a JSON object of workers, bucket_bytes, batch_inputs (the step's inputs) and worker_batch")


def record_options(graph: Graph, workers: int, bucket_bytes: int, batch_inputs: list[str]) -> None:
    """Store the data-parallel options in `graph`'s metadata (they travel with the plan file)."""
    batch = graph.tensors[batch_inputs[0]].shape[0] if batch_inputs else None
    graph.metadata[PLAN_KEY] = json.dumps({"workers": workers, "bucket_bytes": bucket_bytes,
                                           "batch_inputs": list(batch_inputs), "worker_batch": batch})


def batch_statistics(graph: Graph) -> list[str]:
    """The per-channel tensors synchronised batch normalisation averages across the workers
    (`BATCH_STATISTICS_KEY`): each BN's batch mean and variance in the forward pass, and the
    two sums its input gradient takes in the backward pass. Averaged, they are the statistics
    and sums of the whole batch over the number of workers, and the BN step of each worker is
    the step of the whole batch: every worker's batch is the same size, so a mean of means is
    the whole batch's mean, and the backward divides the sums by its own batch's count."""
    text = graph.metadata.get(BATCH_STATISTICS_KEY)
    records = {} if not text else metadata_json(text, BATCH_STATISTICS_KEY, lambda v: isinstance(v, dict) and all(
        isinstance(r, dict) and all(isinstance(t, str) and t in graph.tensors for part in ("forward", "backward")
                                    for t in r.get(part, [])) for r in v.values()),
        "a JSON object of BatchNormalization names to their forward and backward statistics (the step's tensors)")
    return [t for record in records.values() for part in ("forward", "backward") for t in record.get(part, [])]


def batch_inputs(forward: Graph, step: Graph) -> list[str]:
    """The training step's per-sample inputs: the forward model's data inputs with a leading
    axis (the batch) and the inputs the loss adds (labels, targets) with the same leading axis."""
    data = [n for n in forward.inputs if not forward.tensors[n].is_static and forward.tensors[n].shape]
    return per_sample_inputs(step, forward.tensors[data[0]].shape[0]) if data else []


def per_sample_inputs(step: Graph, rows: int) -> list[str]:
    """The step's inputs that carry `rows` samples: not static, with a leading axis of `rows`
    (what a data-parallel record must list, and `distributed.check_plan` checks it does)."""
    return [n for n in step.inputs if not step.tensors[n].is_static and step.tensors[n].shape
            and step.tensors[n].shape[0] == rows]


def worker_forward(forward: Graph, workers: int) -> Graph:
    """`forward` at the per-worker batch: its data inputs' leading axis (the global batch, the
    same on every data input) divided by `workers`, shapes inferred again."""
    from .frontend import lower

    data = [n for n in forward.inputs if not forward.tensors[n].is_static]
    sizes = {forward.tensors[n].shape[0] for n in data if forward.tensors[n].shape}
    if len(sizes) != 1:
        raise UserError("data parallel splits the batch, the leading axis of every data input; the model's data "
                        "inputs " + ("have no leading axis" if not sizes else
                                     f"disagree on it ({', '.join(map(str, sorted(sizes)))})"))
    batch = sizes.pop()
    if batch % workers:
        raise UserError(f"the batch {batch} does not divide among {workers} workers; give a batch that is a "
                        f"multiple of {workers}")
    if workers == 1:
        return forward
    model = forward.to_onnx()
    for vi in list(model.graph.input) + list(model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.name in data:
            dims[0].dim_value = batch // workers
        elif vi.name in forward.outputs and dims and dims[0].HasField("dim_value") and dims[0].dim_value == batch:
            dims[0].Clear()            # inferred again from the inputs
    del model.graph.value_info[:]
    try:
        return lower(model, base_dir=forward.base_dir)
    except UserError as exc:
        raise UserError(f"the model does not run at the per-worker batch {batch // workers} ({exc}); export it with "
                        f"a batch axis that is not written into its ops") from None
