"""Batch split: the per-sample front of a network runs in micro-batches (chunks).

    f(Concat_i x_i) = Concat_i f(x_i)      for every op f that treats samples independently

A convolution's input plus its output can be larger than the device by itself (VGG-16 at
batch 1065: 27 GB at the first block), and then no order, recompute or swap plan fits: each
op must hold its operands whole. Split over the batch, each chunk's ops hold a chunk's
operands, and each chunk's activations are tensors of their own that the swap and recompute
passes can move one by one (the last chunk's may stay while the earlier ones are on the host).

`split_batch(forward, chunks)` rewrites the forward model: the batch inputs are Split on axis
0 into `chunks` near-equal pieces, every op of the region runs once per chunk (chunk-major:
the region up to its next BatchNorm for chunk 0, then chunk 1, ...), and a Concat on axis 0 gives back each
region tensor that an op outside it (or the graph's output) reads. Autodiff then builds the
step from it: each chunk's backward is its own, and a weight read by every chunk gets its
gradient summed over the chunks (the same sum over samples, rounded in pieces).

The region: ops of PER_SAMPLE_OPS types (memsched.ops) whose every input is either a region
tensor (a chunked input or a region op's output) or an initializer without a batch axis, grown
in graph order from the batch inputs, and the BatchNormalizations on batch statistics between
them. A BN couples the samples, so it runs as one CHUNKED_BATCH_NORM node over all chunks of its
input: the batch mean and variance summed from the chunks, every chunk normalised with them, and
in the backward pass the two per-channel sums of its input gradient summed alike: the step of
the whole batch, exact as synchronised BatchNorm is across workers (the convolutions around it
hold chunks). The region ends at the first op that couples samples otherwise (the loss, a
MaxPool's indices) and at ops whose parameters outweigh their batch tensors (a VGG classifier's
Gemm: 411 MB of weight beside 17 MB of activations; split, it would only add partial weight
gradients). The split forward runs stage by stage (`_stages`): a chunk runs alone up to the
next BN, which waits for all of them. As with the concat split, the training step records
what changed (SPLIT_KEY) so that `unsplit_graph` gives back the step as given.
"""
from __future__ import annotations

from typing import Callable

from memsched.ir import Graph, Op, Tensor
from memsched.onnx_utils import MEMSCHED_DOMAIN
from memsched.ops import CHUNKED_BATCH_NORM, PER_SAMPLE_OPS, is_batch_norm
from memsched.step_info import TRAINING_KEY, training_record

from memsched.passes.rewrites.concat_split import even_sizes, names_taken, sizes_constant
from memsched.passes.rewrites.concat_split import unsplit_graph as unsplit_concat
from memsched.passes.reuse import record_rewrite, undo_rewrite, unfused_graph

SPLIT_KEY = "memsched.batch_split"    # what split_training_step changed, so it can be undone
# the share of the room beside the parameters an op's working set must take for the step to
# be planned in micro-batches too (U-Net b32: 0.84 and 1.02 won, 0.72 lost; ResNet-50 b16
# at 0.56 planned the same, slower)
CROWDED = 0.75


def given_graph(graph: Graph) -> Graph:
    """The training step as given, the one the baseline runs: fused updates, concat splits and
    batch splits undone, in the reverse of the order they were made."""
    return unsplit_graph(unsplit_concat(unfused_graph(graph)))


def batch_size(forward: Graph) -> int | None:
    """The batch (axis 0) shared by the model's data inputs, or None where there is none to split."""
    sizes = {forward.tensors[name].shape[0] for name in _batch_inputs(forward)}
    return sizes.pop() if len(sizes) == 1 else None


def split_batch(forward: Graph, chunks: int) -> tuple[Graph, list[str]]:
    """`forward` with its per-sample region run in `chunks` micro-batches (module docstring);
    returns (graph, the region's ops), the graph itself and [] where nothing splits."""
    batch = batch_size(forward)
    if batch is None or chunks < 2 or chunks > batch:
        return forward, []
    region = _region(forward, batch)
    if not region:
        return forward, []
    sizes = even_sizes(batch, chunks)
    new_tensors: list[Tensor] = []
    chunked: dict[str, list[str]] = {}     # tensor -> its chunks' names
    ops: list[Op] = []

    def add_chunks(name: str) -> list[str]:
        t = forward.tensors[name]
        chunked[name] = [f"{name}/chunk{i}" for i in range(chunks)]
        new_tensors.extend(Tensor(part, (size, *t.shape[1:]), t.dtype, "activation")
                           for part, size in zip(chunked[name], sizes))
        return chunked[name]

    for name in _batch_inputs(forward):
        new_tensors.append(sizes_constant(f"{name}/chunk_sizes", sizes))
        ops.append(Op(f"{name}/SplitBatch", "Split", [name, new_tensors[-1].name], add_chunks(name), {"axis": 0},
                      doc_string=f"batch split: {name} in {chunks} chunks"))
    region_ops = [op for op in forward.ops if op.name in region]
    for op in region_ops:
        for out in op.outputs:
            add_chunks(out)
    for stage in _stages(region_ops):
        for i in range(chunks):
            ops.extend(Op(f"{op.name}/chunk{i}", op.op_type, [chunked[t][i] if t in chunked else t for t in op.inputs],
                          [chunked[t][i] for t in op.outputs], dict(op.attributes), op.domain, op.phase,
                          doc_string=f"batch split: {op.name}, chunk {i}") for op in stage if not is_batch_norm(op))
        ops.extend(Op(f"{op.name}/chunks", CHUNKED_BATCH_NORM, [*chunked[op.inputs[0]], *op.inputs[1:]],
                      chunked[op.outputs[0]], dict(op.attributes), MEMSCHED_DOMAIN, op.phase,
                      doc_string=f"batch split: {op.name} on the statistics of all {chunks} chunks")
                   for op in stage if is_batch_norm(op))
    consumers = forward.consumers
    outside = [t for op in region_ops for t in op.outputs
               if t in forward.outputs or any(c.name not in region for c in consumers.get(t, []))]
    for name in outside:
        ops.append(Op(f"{name}/ConcatBatch", "Concat", chunked[name], [name], {"axis": 0},
                      doc_string=f"batch split: the chunks of {name}"))
    if names_taken(forward, forward.tensors, ops, new_tensors):
        return forward, []
    tensors = {name: t for name, t in forward.tensors.items()
               if name not in chunked or name in outside or name in forward.inputs}
    tensors.update({t.name: t for t in new_tensors})
    ops += [op for op in forward.ops if op.name not in region]
    return forward.replace(ops=ops, tensors=tensors), [op.name for op in region_ops]


def chunk_count(forward: Graph, budget: int) -> int:
    """How many micro-batches: 0 where the model's parameters alone take `budget`; 1 (no
    split) where the region's activations (every tensor its ops make) fit beside them as they
    are, or where its largest working set (an op's batch inputs and outputs) takes less than
    CROWDED of the room beside them: no op crowds the budget, and micro-batches would only
    slow the search (a ResNet-50 b16 at a quarter of PyTorch's peak, 0.56: the same plan, 28 s
    later; a U-Net b32 at 0.35 of its baseline, 0.72: slower in micro-batches); else the
    fewest that cut that working set to half the room or less. Each op then leaves as much
    again to what the step keeps around it, and the step grows by no more copies of the
    region than that needs: each is more to plan (the U-Net at a quarter plans better in 2
    micro-batches than in 4 within the same time)."""
    batch = batch_size(forward)
    region = _region(forward, batch) if batch is not None else set()
    ops = [op for op in forward.ops if op.name in region]
    made = {t for op in ops for t in op.outputs}
    activations = sum(forward.tensors[t].nbytes for t in made)
    free = budget - sum(t.nbytes for t in forward.tensors.values() if t.is_static)
    if free <= 0:
        return 0
    if activations <= free:
        return 1
    batched = made | set(_batch_inputs(forward))
    largest = max(sum(forward.tensors[t].nbytes for t in {*op.inputs, *op.outputs} if t in batched) for op in ops)
    return 1 if largest < CROWDED * free else min(batch, -(-2 * largest // free))


def batch_split_step(forward: Graph, given: Graph, build: Callable[[Graph], Graph],
                     budget: int) -> tuple[Graph, int] | None:
    """(the training step in micro-batches, how many) for a step `given` (built from `forward`
    by `build`) over `budget`: None where `chunk_count` says 1 (or 0) or nothing splits."""
    chunks = chunk_count(forward, budget)
    step = split_training_step(forward, given, build, chunks) if chunks >= 2 else None
    return (step, chunks) if step is not None else None


def split_training_step(forward: Graph, given: Graph, build: Callable[[Graph], Graph], chunks: int) -> Graph | None:
    """The training step of `forward` with its per-sample region in `chunks` micro-batches,
    `build` being how `given` was built from `forward`; None where nothing splits. The step
    records how to get `given` back (`unsplit_graph`)."""
    split_forward, region = split_batch(forward, chunks)
    if not region:
        return None
    split = _in_given_order(build(split_forward), given)
    if split is None:
        return None
    try:
        return record_rewrite(given, split, SPLIT_KEY, chunks=chunks, region=region)
    except TypeError:       # an attribute JSON cannot hold: keep the step as given
        return None


def _in_given_order(split: Graph, given: Graph) -> Graph | None:
    """`split` (a step built from the split forward) with its outputs in `given`'s order and
    `given`'s training record, which lists its parameters and buffers in that order; None
    where the two steps differ in more than that order. The split forward runs stage by
    stage (`_stages`), so a parameter may be read first in another order than in the model
    (a ResNet block's downsample before its second BatchNorm)."""
    record, given_record = training_record(split), training_record(given)
    if split.inputs != given.inputs or sorted(split.outputs) != sorted(given.outputs) or \
            len(set(split.outputs)) != len(split.outputs) or _unordered(record) != _unordered(given_record):
        return None
    return split.replace(outputs=list(given.outputs),
                         metadata={**split.metadata, TRAINING_KEY: given.metadata[TRAINING_KEY]})


def _unordered(record: dict) -> dict:
    return {key: sorted(value) if key in ("parameters", "buffers") else value for key, value in record.items()}


def unsplit_graph(graph: Graph) -> Graph:
    """The training step before `split_training_step` (the one the baseline runs)."""
    return undo_rewrite(graph, SPLIT_KEY)


def _batch_inputs(forward: Graph) -> list[str]:
    """The model's data inputs (not initializers) with a known leading axis to split."""
    return [name for name in forward.inputs
            if not forward.tensors[name].is_static and forward.tensors[name].shape
            and isinstance(forward.tensors[name].shape[0], int) and forward.tensors[name].shape[0] > 1]


def _region(forward: Graph, batch: int) -> set[str]:
    """The ops to run per chunk: grown in graph order from the batch inputs (module docstring)."""
    batched = set(_batch_inputs(forward))
    region: set[str] = set()
    for op in forward.ops:
        if not _per_sample(forward, op, batched, batch) and not _normalises_chunks(forward, op, batched, batch):
            continue
        region.add(op.name)
        batched.update(op.outputs)
    return region


def _stages(region_ops: list[Op]) -> list[list[Op]]:
    """The region's ops in stages, each in graph order: an op's stage is the number of
    BatchNormalizations on its longest path from the batch inputs, a BN's that of its input
    (it closes the stage: every chunk of its input is made before it runs). Emitted stage by
    stage, chunk-major within a stage, the split graph is topologically ordered and each chunk
    runs as far as it can alone."""
    level: dict[str, int] = {}          # region tensor -> the stage of the ops that may read it
    stages: list[list[Op]] = []
    for op in region_ops:
        stage = max((level.get(t, 0) for t in op.inputs), default=0)
        for out in op.outputs:
            level[out] = stage + 1 if is_batch_norm(op) else stage
        stages.extend([] for _ in range(stage + 1 - len(stages)))
        stages[stage].append(op)
    return stages


def _normalises_chunks(graph: Graph, op: Op, batched: set[str], batch: int) -> bool:
    """Whether `op` is a BatchNormalization the region can run over its chunks at once
    (CHUNKED_BATCH_NORM): its input a region tensor, its scale, bias and running statistics
    initializers, one output (the running statistics as outputs 1 and 2 are not split)."""
    return (is_batch_norm(op) and len(op.inputs) == 5 and op.inputs[0] in batched
            and all(t and graph.tensors[t].is_static for t in op.inputs[1:])
            and len(op.present_outputs) == 1 and op.outputs[0] and graph.tensors[op.outputs[0]].shape is not None
            and graph.tensors[op.outputs[0]].shape[:1] == (batch,))


def _per_sample(graph: Graph, op: Op, batched: set[str], batch: int) -> bool:
    """Whether `op` may run per chunk: a PER_SAMPLE_OPS type in the form that keeps samples apart,
    reading batch tensors of the region and initializers that cannot reach across samples,
    its outputs batch-leading, and its batch tensors outweighing its parameters."""
    if op.domain or op.op_type not in PER_SAMPLE_OPS or not op.outputs:
        return False
    inputs = [t for t in op.inputs if t]
    data = [t for t in inputs if t in batched]
    fixed = [t for t in inputs if t not in batched]
    if not data or any(not graph.tensors[t].is_static or graph.tensors[t].shape is None for t in fixed):
        return False
    shapes = [graph.tensors[t].shape for t in op.outputs]
    if any(s is None or s[:1] != (batch,) for s in shapes):
        return False
    kind, rank = op.op_type, len(shapes[0])
    if kind in ("Softmax", "LogSoftmax", "Flatten") and int(op.attributes.get("axis", 1)) in (0, -rank):
        return False
    if kind == "MaxPool" and len(op.outputs) > 1:       # its indices count over the whole batch
        return False
    if kind == "Concat" and (len(data) != len(inputs) or int(op.attributes.get("axis", 0)) in (0, -rank)):
        return False
    if kind in ("Conv", "ConvTranspose", "Gemm", "MatMul") and inputs[0] not in batched or \
            kind in ("Gemm", "MatMul") and inputs[1] in batched:
        return False
    if kind == "Gemm" and int(op.attributes.get("transA", 0)):
        return False
    broadcast = fixed if kind in ("Add", "Sub", "Mul", "Div") else inputs[2:] if kind == "Gemm" else []
    if any(not _broadcast_safe(graph.tensors[t].shape, rank) for t in broadcast):
        return False
    if kind == "MatMul" and len(graph.tensors[inputs[1]].shape) > 2:
        return False
    params = sum(graph.tensors[t].nbytes for t in fixed)
    activations = sum(graph.tensors[t].nbytes for t in [*data, *op.outputs])
    return activations >= params


def _broadcast_safe(shape: tuple[int, ...], rank: int) -> bool:
    """Whether a tensor of `shape`, broadcast against a batch tensor of `rank`, reaches no
    further than one sample: it falls short of the batch axis or is 1 along it."""
    return len(shape) < rank or shape[0] == 1
