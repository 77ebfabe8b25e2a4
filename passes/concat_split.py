"""Concat split: a convolution over a channel concatenation becomes one convolution per part.

    Conv(Concat(x_1, ..., x_k, axis=1), W, B) = Sum_i Conv(x_i, W_i, B on the first part only)

where W_i are W's input-channel slices (one Split of W). The concatenated tensor never
exists: a U-Net decoder's Concat of skip and upsampled maps holds its inputs and its output
at once (twice the bytes of its output), and its gradient is that size again before the
Slices hand it to the parts. Split, each part's input stays its own buffer, read by its own
convolution, and each part gets its input gradient from its own transposed convolution.
Same FLOPs plus one Add per extra part; the sum over input channels is rounded in k pieces
(a run differs from the model as given by rounding only). The weight parts that the backward
reads are split off W again right before it: held from the forward they would be live across
the whole step. Autodiff gives each part's convolution the weight's dW and dX roles, so the
dW/dX rule orders each part as a layer.

The rewrite is made on the forward model (`split_concat_convs`) and the training step built
again from it (`split_training_step`); what changed in the training step is recorded in its
metadata (SPLIT_KEY) so that `unsplit_graph` gives back the training step as given, the one
the baseline runs. The reuse pass judges the split step beside the given one and keeps it
where it does not raise the peak.

A convolution qualifies when its data input is a Concat on axis 1 (channels) read by it
alone (and not a graph output), it has one group, and the weight's input channels equal
the parts' channels (all shapes known).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from onnx import TensorProto, numpy_helper

from memsched.ir import Graph, Op, Tensor

from .reuse import record_rewrite, undo_rewrite, unfused_graph

SPLIT_KEY = "memsched.concat_split"   # what split_training_step changed, so it can be undone
VARIANT = "concat-split"              # the reuse pass's name for the split step


def reuse_variants(forward: Graph, given: Graph, build: Callable[[Graph], Graph]) -> dict[str, Graph]:
    """The rewritten training steps the reuse pass may pick instead of `given` (built from
    `forward` by `build`): the concat split, where a convolution qualifies."""
    split = split_training_step(forward, given, build)
    return {VARIANT: split} if split is not None else {}


def given_graph(graph: Graph) -> Graph:
    """The training step as given, the one the baseline runs: fused updates and concat splits
    undone (in the reverse of the order the reuse pass made them)."""
    return unsplit_graph(unfused_graph(graph))


def split_concat_convs(forward: Graph) -> tuple[Graph, list[str]]:
    """`forward` with every qualifying Conv over a Concat split into one Conv per part (module
    docstring); returns (graph, the convolutions split), the graph itself when none is."""
    consumers = forward.consumers
    replaced: dict[str, list[Op]] = {}   # conv name -> the ops standing in its place
    dropped: set[str] = set()            # the Concats
    tensors = dict(forward.tensors)
    for conv in forward.ops:
        concat = _split_site(forward, conv, consumers)
        if concat is None:
            continue
        new_ops, new_tensors = _split_ops(forward, conv, concat)
        if any(t.name in tensors for t in new_tensors) or any(op.name in forward.op_by_name for op in new_ops):
            continue   # a name taken already
        tensors.update({t.name: t for t in new_tensors})
        tensors.pop(concat.outputs[0])
        replaced[conv.name] = new_ops
        dropped.add(concat.name)
    if not replaced:
        return forward, []
    ops = [new for op in forward.ops if op.name not in dropped for new in replaced.get(op.name, [op])]
    return forward.replace(ops=ops, tensors=tensors), list(replaced)


def _split_site(graph: Graph, conv: Op, consumers) -> Op | None:
    """The Concat that `conv` may be split over, or None."""
    if conv.op_type != "Conv" or conv.domain or int(conv.attributes.get("group", 1)) != 1:
        return None
    data, weight = conv.inputs[0], conv.inputs[1]
    concat = graph.producer.get(data)
    if concat is None or concat.op_type != "Concat" or concat.domain or data in graph.outputs:
        return None
    if [op.name for op in consumers.get(data, [])] != [conv.name] or conv.inputs.count(data) != 1:
        return None
    shapes = [graph.tensors[t].shape for t in concat.inputs]
    wshape = graph.tensors[weight].shape
    if len(concat.inputs) < 2 or any(s is None for s in shapes) or wshape is None or len(wshape) < 2:
        return None
    rank = len(shapes[0])
    axis = int(concat.attributes.get("axis", 0))
    if (axis + rank if axis < 0 else axis) != 1 or sum(s[1] for s in shapes) != wshape[1]:
        return None
    return concat


def _split_ops(graph: Graph, conv: Op, concat: Op) -> tuple[list[Op], list[Tensor]]:
    """The ops and new tensors that replace `conv` (and its Concat)."""
    weight, out = conv.inputs[1], conv.outputs[0]
    bias = conv.inputs[2] if len(conv.inputs) > 2 else ""
    parts = list(concat.inputs)
    w = graph.tensors[weight]
    y = graph.tensors[out]
    sizes = [graph.tensors[x].shape[1] for x in parts]
    scope = conv.name
    sizes_name = f"{scope}/split_sizes"
    sizes_tensor = Tensor(sizes_name, (len(sizes),), TensorProto.INT64, "constant",
                          numpy_helper.from_array(np.asarray(sizes, dtype=np.int64), sizes_name))
    w_parts = [Tensor(f"{weight}/part{i}", (w.shape[0], c, *w.shape[2:]), w.dtype, "activation")
               for i, c in enumerate(sizes)]
    y_parts = [Tensor(f"{out}/part{i}", y.shape, y.dtype, "activation") for i in range(len(parts))]
    split = Op(f"{scope}/SplitWeight", "Split", [weight, sizes_name], [t.name for t in w_parts], {"axis": 1},
               phase=conv.phase, doc_string=f"concat split: {weight} by the input channels of {concat.name}")
    ops = [split]
    for i, (x, wp, yp) in enumerate(zip(parts, w_parts, y_parts)):
        inputs = [x, wp.name] + ([bias] if bias and i == 0 else [])
        ops.append(Op(f"{scope}/part{i}", "Conv", inputs, [yp.name], dict(conv.attributes), phase=conv.phase,
                      doc_string=f"concat split: {conv.name} over {x}"))
    total = y_parts[0].name
    for i in range(1, len(parts)):
        last = i == len(parts) - 1
        target = out if last else f"{out}/sum{i}"
        ops.append(Op(f"{scope}/Sum{i}", "Add", [total, y_parts[i].name], [target], phase=conv.phase,
                      doc_string=f"concat split: the parts of {conv.name}"))
        total = target
    sums = [Tensor(f"{out}/sum{i}", y.shape, y.dtype, "activation") for i in range(1, len(parts) - 1)]
    return ops, [sizes_tensor, *w_parts, *y_parts, *sums]


def split_training_step(forward: Graph, given: Graph, build: Callable[[Graph], Graph]) -> Graph | None:
    """The training step of `forward` with its Concat convolutions split, `build` being how
    `given` was built from `forward` (passes.autodiff with the same options); None when no
    convolution qualifies. The step records how to get `given` back (`unsplit_graph`)."""
    split_forward, convs = split_concat_convs(forward)
    if not convs:
        return None
    split = _weights_split_again(build(split_forward), convs)
    if (split.inputs, split.outputs) != (given.inputs, given.outputs):
        return None
    try:
        return record_rewrite(given, split, SPLIT_KEY, convs=convs)
    except TypeError:       # an attribute JSON cannot hold (a subgraph, say): keep the step as given
        return None


def _weights_split_again(step: Graph, convs: list[str]) -> Graph:
    """`step` with the weight parts that the backward reads (each part's input gradient is a
    transposed convolution over it) split off the weight again right before their first
    backward reader: a Split is a copy of the weight, while the forward's parts would be held
    from the forward to the backward (21 MB for the 3-D U-Net's deepest decoder conv)."""
    ops = list(step.ops)
    tensors = dict(step.tensors)
    for conv in convs:
        split = step.op_by_name.get(f"{conv}/SplitWeight")
        if split is None:
            continue
        renamed = {part: f"{part}/backward" for part in split.outputs}
        readers = [i for i, op in enumerate(ops) if op.phase != "forward" and set(op.inputs) & set(renamed)]
        if not readers or any(name in tensors for name in renamed.values()):
            continue
        for i in readers:
            ops[i] = dataclasses.replace(ops[i], inputs=[renamed.get(t, t) for t in ops[i].inputs])
        for part, name in renamed.items():
            tensors[name] = dataclasses.replace(tensors[part], name=name)
        ops.insert(readers[0], dataclasses.replace(split, name=f"{split.name}/backward", outputs=list(renamed.values()),
                                                   phase=ops[readers[0]].phase))
    return step.replace(ops=ops, tensors=tensors)


def unsplit_graph(graph: Graph) -> Graph:
    """The training step before `split_training_step` (the one the baseline runs)."""
    return undo_rewrite(graph, SPLIT_KEY)
