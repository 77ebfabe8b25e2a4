"""Gradient rules of ops that move or select data: reshapes, Transpose, Concat/Split,
Slice, Gather (embeddings), Expand/Tile, Pad and the reductions. Their attributes often
arrive as tensors (shapes, starts, pads, axes); shapes are static, so those are folded to
constants before the backward pass is written."""
from __future__ import annotations

import numpy as np

from memsched.passes.training.registry import rule


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", inputs=(0,))
def reshape(em, op, dys, wants):
    return [em.reshape(dys[0], em.shape(op.inputs[0]))]


def folds_into_gemm(graph, transpose) -> bool:
    """Whether the forward can drop `transpose`, a Transpose(W) of a 2-D W feeding only the
    right operand of MatMuls (a Linear, tied or not, in a training export): each such MatMul
    runs as Gemm(x, W, transB=1) on x's rows instead, so no transposed copy of the weight is
    made (154 MB a step for GPT-2's tied LM head, live beside the logits). Their rules then
    give the gradient flowing into the Transpose in W's layout, so none is made backward
    either."""
    if transpose.op_type != "Transpose" or list(transpose.attributes.get("perm", [1, 0])) != [1, 0]:
        return False
    out = transpose.outputs[0]
    readers = graph.consumers.get(out, [])
    if not readers or out in graph.outputs or len(graph.tensors[out].shape) != 2:
        return False
    return all(r.op_type == "MatMul" and r.inputs[1] == out and r.inputs[0] != out
               and len(graph.tensors[r.inputs[0]].shape) >= 2 for r in readers)


def runs_as_gemm(graph, matmul) -> bool:
    """Whether `matmul` is a Linear the forward runs as a Gemm over W: a MatMul whose right
    operand is a Transpose(W) that `folds_into_gemm`."""
    transpose = graph.producer.get(matmul.inputs[1]) if matmul.op_type == "MatMul" else None
    return transpose is not None and folds_into_gemm(graph, transpose)


def folded_bias(graph, matmul):
    """(the Add, the bias) where `matmul` runs as a Gemm over W (`folds_into_gemm`) and its
    product is read only by an Add of a 1-D bias of the product's last size (a Linear in a
    training export: MatMul(x, Transpose(W)) then Add(bias, .)); else None. The forward's
    Gemm then takes the bias as C, so no elementwise pass over the product adds it. The
    gradients are unchanged: the Add's rule still sums dy into the bias, and the MatMul's
    rule reads its inputs, never the product."""
    if not runs_as_gemm(graph, matmul):
        return None
    product = matmul.outputs[0]
    readers = graph.consumers.get(product, [])
    if len(readers) != 1 or product in graph.outputs:
        return None
    add = readers[0]
    if add.op_type != "Add" or len(add.inputs) != 2 or add.inputs.count(product) != 1:
        return None
    bias = add.inputs[1 - add.inputs.index(product)]
    have, want = graph.tensors[bias], graph.tensors[product]
    if have.dtype != want.dtype or tuple(have.shape or ()) != tuple(want.shape[-1:]):
        return None
    return add, bias


def folded_scale(em, matmul):
    """(m, c) where `matmul` runs as a Gemm over W (`folds_into_gemm`) and its left operand is
    Mul(m, c) of a scalar constant c, read by nothing else (the closing * 0.5 of GELU in a BERT
    export, before the FFN's second Linear); else None. The Gemm then reads m with alpha c, so
    no pass of its own scales m, and dW = c * dy^T @ m reads m too. dX is unchanged (dy @ W,
    which the Mul's rule scales by c): the MatMul's product is the same, only computed in one
    kernel."""
    graph = em.source
    if not runs_as_gemm(graph, matmul):
        return None
    scaled = matmul.inputs[0]
    mul = graph.producer.get(scaled)
    if mul is None or mul.op_type != "Mul" or scaled in graph.outputs or len(graph.consumers.get(scaled, [])) != 1:
        return None
    for i in (0, 1):
        value = em.value(mul.inputs[1 - i])
        if value is not None and value.size == 1 and graph.tensors[mul.inputs[i]].shape == graph.tensors[scaled].shape:
            return mul.inputs[i], float(value.reshape(()))
    return None


def folds_into_matmul_scale(em, mul) -> bool:
    """Whether `mul` is a scale that the Gemm of the Linear reading it takes as alpha (`folded_scale`)."""
    readers = em.source.consumers.get(mul.outputs[0], [])
    return len(readers) == 1 and folded_scale(em, readers[0]) is not None


def scaled_scores(em) -> dict[str, dict]:
    """Attention's scores scaled by a constant, folded into the query's Linear: {"div": {Div:
    f}, "scores": {score MatMul: the Div's output}, "linear": {query Linear's MatMul: f}}.

    Where Div(s, c) divides s = MatMul(q, k) (read only by the Div) by a scalar constant c, and
    q comes through Reshapes and Transposes (each read once) from a Linear that runs as a Gemm
    over W (`folds_into_gemm`; its bias folded or absent): scores / sqrt(d) in a BERT export.
    The Linear's Gemm then scales by f = 1/c (alpha, and beta for its bias), so q and every
    view of it hold q * f, the score MatMul writes the Div's output, and no pass over the
    scores (the largest tensor of attention) divides them, forward or backward. The
    backward follows: the Div passes its gradient on unchanged (the score MatMul's rule reads
    the scaled q), and the Linear's gradients (dX, dW and the bias's) are scaled by f. Made
    once per training step (`Emitter.analyses`)."""
    if "scaled_scores" in em.analyses:
        return em.analyses["scaled_scores"]
    graph = em.source
    found = {"div": {}, "scores": {}, "linear": {}}
    for div in graph.ops:
        if div.op_type != "Div" or len(div.inputs) != 2:
            continue
        value = em.value(div.inputs[1])
        scores = div.inputs[0]
        matmul = graph.producer.get(scores)
        if (value is None or value.size != 1 or float(value.reshape(())) == 0.0 or matmul is None
                or matmul.op_type != "MatMul" or scores in graph.outputs or len(graph.consumers[scores]) != 1):
            continue
        if runs_as_gemm(graph, matmul):
            continue   # a Linear itself, run as a Gemm: not attention's scores
        linear = _linear_behind_views(graph, matmul.inputs[0])
        if linear is None or linear.name in found["linear"]:
            continue
        f = 1.0 / float(value.reshape(()))
        found["div"][div.name] = f
        found["scores"][matmul.name] = div.outputs[0]
        found["linear"][linear.name] = f
    em.analyses["scaled_scores"] = found
    return found


def _linear_behind_views(graph, t):
    """The MatMul of a Linear run as a Gemm over W whose output (or bias Add's, where folded)
    reaches `t` through Reshapes and Transposes, each tensor on the way read once; else None."""
    while True:
        producer = graph.producer.get(t)
        if producer is None or t in graph.outputs or len(graph.consumers.get(t, [])) != 1:
            return None
        if producer.op_type not in ("Reshape", "Transpose"):
            break
        t = producer.inputs[0]
    if producer.op_type == "Add":
        product = folded_product(graph, producer)
        return graph.producer[product] if product else None
    return producer if runs_as_gemm(graph, producer) else None


def folded_product(graph, add) -> str | None:
    """The Linear product whose Gemm takes `add`'s bias as C (`folded_bias`), if any: the
    forward then runs no such Add."""
    for name in add.inputs:
        producer = graph.producer.get(name)
        found = folded_bias(graph, producer) if producer is not None else None
        if found is not None and found[0] is add:
            return name
    return None


def _transpose_forward(em, op, needed):
    """Nothing where the MatMuls reading it run as Gemms over W itself."""
    if not folds_into_gemm(em.source, op):
        em.keep(op)


@rule("Transpose", forward=_transpose_forward)
def transpose(em, op, dys, wants):
    if folds_into_gemm(em.source, op):   # its MatMuls gave W's gradient in W's own layout
        return [dys[0]]
    rank = em.rank(op.inputs[0])
    perm = op.attributes.get("perm", list(reversed(range(rank))))
    return [em.transpose(dys[0], np.argsort(perm))]


def _axis(op, rank, default=0):
    axis = op.attributes.get("axis", default)
    return axis + rank if axis < 0 else axis


@rule("Concat")
def concat(em, op, dys, wants):
    rank = em.rank(op.outputs[0])
    axis = _axis(op, rank)
    grads, offset = [], 0
    for name, want in zip(op.inputs, wants):
        size = em.shape(name)[axis]
        grads.append(em.op("Slice", [dys[0], em.ints([offset]), em.ints([offset + size]), em.ints([axis])])
                     if want else None)
        offset += size
    return grads


@rule("Split", inputs=(0,))
def split(em, op, dys, wants):
    axis = _axis(op, em.rank(op.inputs[0]))
    parts = [dy if dy is not None else em.zeros(em.shape(out), op.inputs[0])
             for out, dy in zip(op.outputs, dys)]
    return [em.op("Concat", parts, axis=axis) if len(parts) > 1 else parts[0]]


def _slice_ranges(em, op) -> list[range] | None:
    """Per axis of the input, the indices Slice keeps (ONNX clamping rules), or None."""
    shape = em.shape(op.inputs[0])
    values = [em.value(op.inputs[i]) if len(op.inputs) > i and op.inputs[i] else None for i in range(1, 5)]
    starts, ends, axes, steps = values
    if starts is None or ends is None or (len(op.inputs) > 3 and op.inputs[3] and axes is None) or (
            len(op.inputs) > 4 and op.inputs[4] and steps is None):
        return None
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    ranges = [range(d) for d in shape]
    for start, end, axis, step in zip(starts.tolist(), ends.tolist(), axes, steps):
        axis = int(axis) + len(shape) if axis < 0 else int(axis)
        dim, step = shape[axis], int(step)
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        ranges[axis] = range(start, end, step)
    return ranges


def _check_slice(em, op):
    return None if _slice_ranges(em, op) is not None else "its starts/ends/axes/steps are not constants"


@rule("Slice", inputs=(0,), check=_check_slice)
def slice_(em, op, dys, wants):
    """Unit steps: pad the gradient back with zeros. Other steps: scatter into zeros."""
    x = op.inputs[0]
    shape = em.shape(x)
    ranges = _slice_ranges(em, op)
    if all(r.step == 1 for r in ranges) and all(len(r) for r in ranges):
        pads = [r.start for r in ranges] + [d - r.stop for d, r in zip(shape, ranges)]
        return [em.op("Pad", [dys[0], em.ints(pads)], mode="constant")]
    index = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)[np.ix_(*[list(r) for r in ranges])]
    flat = em.op("ScatterElements", [em.zeros([int(np.prod(shape))], x), em.const(index.reshape(-1)),
                                     em.reshape(dys[0], [index.size])], axis=0)
    return [em.reshape(flat, shape)]


@rule("Gather", inputs=(0,))
def gather(em, op, dys, wants):
    """Scatter-add the rows back: ScatterND(zeros, indices[..., None], dy, reduction=add),
    with the gathered axis moved to the front (and back) when it is not axis 0."""
    x, indices = op.inputs[:2]
    shape = em.shape(x)
    rank, q = len(shape), em.rank(indices)
    axis = _axis(op, rank)
    dy = dys[0]
    if axis:
        index_dims = list(range(axis, axis + q))
        dy = em.transpose(dy, index_dims + list(range(axis)) + list(range(axis + q, rank + q - 1)))
    moved = [shape[axis]] + [d for i, d in enumerate(shape) if i != axis]
    where = em.op("Unsqueeze", [indices, em.ints([-1])])
    grad = em.scatter_add("ScatterND", em.zeros(moved, x), where, dy)
    if axis:
        grad = em.transpose(grad, list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank)))
    return [grad]


@rule("GatherElements", inputs=(0,))
def gather_elements(em, op, dys, wants):
    x, indices = op.inputs[:2]
    axis = _axis(op, em.rank(x))
    return [em.scatter_add("ScatterElements", em.zeros(em.shape(x), x), indices, dys[0], axis=axis)]


@rule("Expand", inputs=(0,))
def expand(em, op, dys, wants):
    return [em.sum_to(dys[0], em.shape(op.inputs[0]))]


def _check_tile(em, op):
    return None if em.value(op.inputs[1]) is not None else "its repeats are not a constant"


@rule("Tile", inputs=(0,), check=_check_tile)
def tile(em, op, dys, wants):
    """View dy as [r0, d0, r1, d1, ...] and sum over the repeat axes."""
    shape = em.shape(op.inputs[0])
    repeats = [int(r) for r in em.value(op.inputs[1])]
    split = [v for r, d in zip(repeats, shape) for v in (r, d)]
    summed = em.reduce("ReduceSum", em.reshape(dys[0], split), range(0, 2 * len(shape), 2), keepdims=False)
    return [em.reshape(summed, shape)]


def _pads(em, op) -> list[int] | None:
    rank = em.rank(op.inputs[0])
    pads = em.value(op.inputs[1]) if len(op.inputs) > 1 and op.inputs[1] else None
    if pads is None:
        return None
    pads = [int(p) for p in pads]
    if len(op.inputs) > 3 and op.inputs[3]:
        axes = em.value(op.inputs[3])
        if axes is None:
            return None
        full = [0] * (2 * rank)
        for k, axis in enumerate(int(a) + rank if a < 0 else int(a) for a in axes):
            full[axis], full[rank + axis] = pads[k], pads[len(axes) + k]
        pads = full
    return pads


def _check_pad(em, op):
    mode = op.attributes.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        return f"mode '{mode}' is not supported (only constant)"
    return None if _pads(em, op) is not None else "its pads are not a constant"


@rule("Pad", inputs=(0,), check=_check_pad)
def pad(em, op, dys, wants):
    """Crop the padding off; where the pad was negative (a crop), pad zeros back."""
    rank = em.rank(op.inputs[0])
    pads = _pads(em, op)
    grad = dys[0]
    if any(p < 0 for p in pads):
        grad = em.op("Pad", [grad, em.ints([max(-p, 0) for p in pads])], mode="constant")
    begin = [max(p, 0) for p in pads[:rank]]
    end = [d - max(p, 0) for d, p in zip(em.shape(grad), pads[rank:])]
    if begin == [0] * rank and end == list(em.shape(grad)):
        return [grad]
    return [em.op("Slice", [grad, em.ints(begin), em.ints(end), em.ints(range(rank))])]


def _reduce_axes(em, op) -> list[int] | None:
    rank = em.rank(op.inputs[0])
    if "axes" in op.attributes:
        axes = list(op.attributes["axes"])
    elif len(op.inputs) > 1 and op.inputs[1]:
        value = em.value(op.inputs[1])
        if value is None:
            return None
        axes = [int(a) for a in value.reshape(-1)]
    else:
        axes = []
    if not axes:
        return [] if op.attributes.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a + rank if a < 0 else a for a in axes)


def _check_reduce(em, op):
    return None if _reduce_axes(em, op) is not None else "its axes are not a constant"


@rule("ReduceSum", "ReduceMean", inputs=(0,), check=_check_reduce)
def reduce_(em, op, dys, wants):
    """Broadcast dy back over the reduced axes (divided by their size for a mean)."""
    x = op.inputs[0]
    shape = em.shape(x)
    axes = _reduce_axes(em, op)
    grad = dys[0]
    if op.op_type == "ReduceMean" and axes:
        count = int(np.prod([shape[a] for a in axes]))
        grad = em.divide(grad, count)
    kept = [1 if i in axes else d for i, d in enumerate(shape)]
    grad = em.reshape(grad, kept)
    return [grad if tuple(kept) == tuple(shape) else em.op("Expand", [grad, em.ints(shape)])]
