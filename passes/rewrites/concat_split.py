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

First, an upsampling ConvTranspose that is one part of such a Concat is cut over its output
channels into pieces no wider than the Concat's widest other part (`split_upsamplings`), so
each piece becomes a part of its own: the upsampled map (a U-Net decoder's is twice the
skip's width) and its gradient never exist whole either.

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

from memsched.passes.reuse import record_rewrite, undo_rewrite

SPLIT_KEY = "memsched.concat_split"   # what split_training_step changed, so it can be undone
VARIANT = "concat-split"              # the reuse pass's name for the split step


def reuse_variants(forward: Graph, given: Graph, build: Callable[[Graph], Graph]) -> dict[str, Graph]:
    """The rewritten training steps the reuse pass may pick instead of `given` (built from
    `forward` by `build`): the concat split, where a convolution qualifies."""
    split = split_training_step(forward, given, build)
    return {VARIANT: split} if split is not None else {}


def split_concat_convs(forward: Graph) -> tuple[Graph, list[str]]:
    """`forward` with every qualifying Conv over a Concat split into one Conv per part (module
    docstring); returns (graph, the convolutions split), the graph itself when none is."""
    forward, upsamplings = split_upsamplings(forward)
    replaced: dict[str, list[Op]] = {}   # conv name -> the ops standing in its place
    dropped: set[str] = set()            # the Concats
    tensors = dict(forward.tensors)
    for conv, concat in _split_sites(forward):
        new_ops, new_tensors = _split_ops(forward, conv, concat)
        if names_taken(forward, tensors, new_ops, new_tensors):
            continue
        tensors.update({t.name: t for t in new_tensors})
        tensors.pop(concat.outputs[0])
        replaced[conv.name] = new_ops
        dropped.add(concat.name)
    if not replaced:
        return forward, upsamplings
    ops = [new for op in forward.ops if op.name not in dropped for new in replaced.get(op.name, [op])]
    return forward.replace(ops=ops, tensors=tensors), [*upsamplings, *replaced]


def split_upsamplings(forward: Graph) -> tuple[Graph, list[str]]:
    """`forward` with every ConvTranspose whose output is one part of a splittable Concat cut
    into pieces over its output channels, each no wider than the Concat's widest other part:
    `ConvTranspose(x, W) = Concat_i ConvTranspose(x, W[:, c_i])` (W's output-channel slices,
    one Split of W). The concat split then gives each piece its own convolution, so neither
    the upsampled map nor its gradient exists whole: a U-Net decoder's upsampled map is
    twice the skip's width (the 3-D U-Net's last one 9.4 GB at 264^3 beside a 4.7 GB skip).
    Same FLOPs, exact (each output channel is computed once, as before). Qualifies: group 1,
    no bias, read by that Concat alone, all shapes known. Returns (graph, the ones split)."""
    consumers = forward.consumers
    replaced: dict[str, list[Op]] = {}
    tensors = dict(forward.tensors)
    concat_parts: dict[str, list[str]] = {}      # concat name -> its new inputs
    for _, concat in _split_sites(forward):
        for up_name in concat.inputs:
            up = forward.producer.get(up_name)
            widths = [forward.tensors[t].shape[1] for t in concat.inputs if t != up_name]
            pieces = _upsampling_pieces(forward, up, concat, consumers, max(widths))
            if pieces is None:
                continue
            new_ops, new_tensors = _upsampling_ops(forward, up, pieces)
            if names_taken(forward, tensors, new_ops, new_tensors):
                continue
            tensors.update({t.name: t for t in new_tensors})
            tensors.pop(up_name)
            replaced[up.name] = new_ops
            inputs = concat_parts.setdefault(concat.name, list(concat.inputs))
            at = inputs.index(up_name)
            inputs[at:at + 1] = [op.outputs[0] for op in new_ops[1:]]
    if not replaced:
        return forward, []
    ops = []
    for op in forward.ops:
        if op.name in concat_parts:
            op = dataclasses.replace(op, inputs=concat_parts[op.name])
        ops.extend(replaced.get(op.name, [op]))
    return forward.replace(ops=ops, tensors=tensors), list(replaced)


def _upsampling_pieces(graph: Graph, up: Op | None, concat: Op, consumers, width: int) -> list[int] | None:
    """The output-channel widths to cut `up` into (None: it does not qualify, or one piece)."""
    if up is None or up.op_type != "ConvTranspose" or up.domain or int(up.attributes.get("group", 1)) != 1:
        return None
    if len([t for t in up.inputs if t]) != 2 or len(up.outputs) != 1 or \
            not _read_only_by(graph, consumers, up.outputs[0], concat):
        return None
    wshape = graph.tensors[up.inputs[1]].shape
    channels = wshape[1] if wshape is not None and len(wshape) > 2 else None
    if not channels or width <= 0 or channels <= width:
        return None
    return even_sizes(channels, -(-channels // width))


def _upsampling_ops(graph: Graph, up: Op, pieces: list[int]) -> tuple[list[Op], list[Tensor]]:
    """A Split of the ConvTranspose's weight over its output channels and one ConvTranspose per piece."""
    weight, out = up.inputs[1], up.outputs[0]
    w, y = graph.tensors[weight], graph.tensors[out]
    scope = up.name
    split, sizes_tensor, w_parts = _weight_split(w, scope, pieces, up.phase,
                                                 f"upsampling split: {weight} by output channels")
    y_parts = [Tensor(f"{out}/part{i}", (y.shape[0], c, *y.shape[2:]), y.dtype, "activation")
               for i, c in enumerate(pieces)]
    ops = [split] + [Op(f"{scope}/part{i}", "ConvTranspose", [up.inputs[0], wp.name], [yp.name],
                        dict(up.attributes), phase=up.phase, doc_string=f"upsampling split: {up.name}, piece {i}")
                     for i, (wp, yp) in enumerate(zip(w_parts, y_parts))]
    return ops, [sizes_tensor, *w_parts, *y_parts]


def _split_sites(forward: Graph):
    """(conv, concat) for every Conv that reads a Concat the split applies to (`_split_site`)."""
    consumers = forward.consumers
    for conv in forward.ops:
        concat = _split_site(forward, conv, consumers)
        if concat is not None:
            yield conv, concat


def _split_site(graph: Graph, conv: Op, consumers) -> Op | None:
    """The Concat that `conv` may be split over, or None."""
    if conv.op_type != "Conv" or conv.domain or int(conv.attributes.get("group", 1)) != 1:
        return None
    data, weight = conv.inputs[0], conv.inputs[1]
    concat = graph.producer.get(data)
    if concat is None or concat.op_type != "Concat" or concat.domain or \
            not _read_only_by(graph, consumers, data, conv):
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


def _read_only_by(graph: Graph, consumers, tensor: str, op: Op) -> bool:
    """Whether `op` reads `tensor` once and nothing else reads it (nor is it a graph output):
    the one way a rewrite may drop the tensor."""
    return tensor not in graph.outputs and [c.name for c in consumers.get(tensor, [])] == [op.name] and \
        op.inputs.count(tensor) == 1


def names_taken(graph: Graph, tensors: dict[str, Tensor], new_ops: list[Op], new_tensors: list[Tensor]) -> bool:
    """Whether a rewrite's new ops or tensors would take a name the graph (or an earlier rewrite) holds."""
    return any(t.name in tensors for t in new_tensors) or any(op.name in graph.op_by_name for op in new_ops)


def even_sizes(total: int, count: int) -> list[int]:
    """`total` cut into `count` sizes that differ by at most one, the larger first."""
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


def sizes_constant(name: str, sizes: list[int]) -> Tensor:
    """The int64 constant a Split reads for the sizes of its pieces."""
    return Tensor(name, (len(sizes),), TensorProto.INT64, "constant",
                  numpy_helper.from_array(np.asarray(sizes, dtype=np.int64), name))


def _weight_split(w: Tensor, scope: str, sizes: list[int], phase: str, why: str) -> tuple[Op, Tensor, list[Tensor]]:
    """One Split of weight `w` over axis 1 (a Conv's input channels, a ConvTranspose's output
    channels) into parts of `sizes`: (the Split `{scope}/SplitWeight`, its sizes constant, the parts)."""
    sizes_tensor = sizes_constant(f"{scope}/split_sizes", sizes)
    parts = [Tensor(f"{w.name}/part{i}", (w.shape[0], c, *w.shape[2:]), w.dtype, "activation")
             for i, c in enumerate(sizes)]
    split = Op(f"{scope}/SplitWeight", "Split", [w.name, sizes_tensor.name], [t.name for t in parts], {"axis": 1},
               phase=phase, doc_string=why)
    return split, sizes_tensor, parts


def _split_ops(graph: Graph, conv: Op, concat: Op) -> tuple[list[Op], list[Tensor]]:
    """The ops and new tensors that replace `conv` (and its Concat)."""
    weight, out = conv.inputs[1], conv.outputs[0]
    bias = conv.inputs[2] if len(conv.inputs) > 2 else ""
    parts = list(concat.inputs)
    w = graph.tensors[weight]
    y = graph.tensors[out]
    sizes = [graph.tensors[x].shape[1] for x in parts]
    scope = conv.name
    split, sizes_tensor, w_parts = _weight_split(w, scope, sizes, conv.phase,
                                                 f"concat split: {weight} by the input channels of {concat.name}")
    y_parts = [Tensor(f"{out}/part{i}", y.shape, y.dtype, "activation") for i in range(len(parts))]
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
    `given` was built from `forward` (passes.training with the same options); None when no
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
