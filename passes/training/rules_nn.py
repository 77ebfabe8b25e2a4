"""Gradient rules of the layers: Conv/ConvTranspose, Gemm/MatMul, pooling, normalisation,
Softmax/LogSoftmax.

The input gradient (dX) and each parameter gradient (dW, dB) of a layer come from separate
groups of ops, so the planner may run them apart. Conv dX is a ConvTranspose with the same
geometry and the output_padding that restores X's size, or at stride 1 a Conv by the flipped,
channel-swapped weight where ONNX Runtime's ConvTranspose column buffer would be larger than
the weight's copies (`_input_grad`); Conv dW is a Conv whose input is X
with batch and channels swapped and whose kernel is dY, with the stride and dilation roles
swapped, then sliced to the kernel size (groups and depthwise through a reshape) -- or,
where batch x the weight is smaller than X and dY, a Conv of one more axis grouped by sample
over views of X and dY, summed over the batch (no activation-sized transpose); a strided
1x1 convolution (a ResNet downsample) takes its dW from X[..., ::s] at stride 1 where that
slice is smaller than the product beyond the kernel the strided form computes. MaxPool keeps
its argmax as int32 where the input has fewer than 2^31 elements.
BatchNormalization trains on batch statistics, as PyTorch's train mode does: its forward
is rewritten into primitive ops that keep the batch mean and 1/std for the backward pass; a BN
that feeds a ReLU (or ReLU6) keeps its normalised input instead of its input, and the backward
pass recomputes the activation from it (passes.training.bn_relu). The batch split's
ChunkedBatchNormalization (memsched.ops) trains the same way over all its chunks at once: the
batch statistics and the backward's two sums are added up from the chunks.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from memsched.onnx_utils import MEMSCHED_DOMAIN
from memsched.ops import CHUNKED_BATCH_NORM
from memsched.passes.training.bn_relu import stored_once
from memsched.passes.training.registry import rule
from memsched.passes.training.rules_shape import folded_bias, folded_scale, runs_as_gemm, scaled_scores

_STASH_DTYPE = TensorProto.FLOAT  # LayerNormalization's Mean/InvStdDev type (stash_type 1)


# ---- geometry -------------------------------------------------------------------------------
def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _geometry(op, in_shape, kernel) -> dict:
    """strides, dilations and explicit pads of a Conv/pool node (auto_pad resolved)."""
    n = len(kernel)
    attrs = op.attributes
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    pads = list(attrs.get("pads", [0] * (2 * n)))
    auto_pad = _text(attrs.get("auto_pad", "NOTSET"))
    if auto_pad == "VALID":
        pads = [0] * (2 * n)
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * n)
        for i, (size, k, s, d) in enumerate(zip(in_shape, kernel, strides, dilations)):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            pads[i], pads[n + i] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    return {"strides": strides, "dilations": dilations, "pads": pads}


def _output_padding(in_size, out_size, kernel, geo) -> list[int]:
    """The ConvTranspose output_padding that maps `out_size` back to `in_size` exactly."""
    n = len(kernel)
    s, d, p = geo["strides"], geo["dilations"], geo["pads"]
    return [in_size[i] - (s[i] * (out_size[i] - 1) + (kernel[i] - 1) * d[i] + 1 - p[i] - p[n + i])
            for i in range(n)]


def _weight_grad(em, inp, ker, group, geo, kernel):
    """sum over the batch of inp (x) ker: [Ck, Ci/group, *kernel].

    For Conv dW, inp is X and ker is dY; for ConvTranspose dW, inp is dY and ker is X.
    Without groups, where the per-sample products (batch x the weight) are smaller than
    inp and ker together, `_weight_grad_by_sample`: no activation-sized copy at all."""
    n_batch, ci = em.shape(inp)[:2]
    ck = em.shape(ker)[1]
    per_sample = n_batch * ck * ci * int(np.prod(kernel)) * em.np_dtype(inp).itemsize
    if group == 1 and len(kernel) <= 2 and per_sample <= em.tensors[inp].nbytes + em.tensors[ker].nbytes:
        return _weight_grad_by_sample(em, inp, ker, geo, kernel)
    spatial, spatial_k = list(em.shape(inp)[2:]), list(em.shape(ker)[2:])
    n = len(spatial)
    rest = list(range(3, 3 + n))
    if group == 1:
        a = em.transpose(inp, [1, 0] + list(range(2, 2 + n)))
        k = em.transpose(ker, [1, 0] + list(range(2, 2 + n)))
    else:
        cig, ckg = ci // group, ck // group
        a = em.regroup(inp, [n_batch, group, cig] + spatial, [2, 1, 0] + rest, [cig, group * n_batch] + spatial)
        k = em.regroup(ker, [n_batch, group, ckg] + spatial_k, [1, 2, 0] + rest, [ck, n_batch] + spatial_k)
    out = em.op("Conv", [a, k], group=group, kernel_shape=spatial_k, strides=geo["dilations"],
                dilations=geo["strides"], pads=geo["pads"])
    if list(em.shape(out)[2:]) != list(kernel):
        out = em.op("Slice", [out, em.ints([0] * n), em.ints(kernel), em.ints(range(2, 2 + n))])
    return em.transpose(out, [1, 0] + list(range(2, 2 + n)))


def _weight_grad_by_sample(em, inp, ker, geo, kernel):
    """One Conv of one more spatial axis, grouped by sample, over views only: inp as
    [1, N, Ci, *S] (the samples are the channels, Ci a spatial axis), ker as N groups of Ck
    kernels [N*Ck, 1, 1, *Sk]; out[n*Ck + k, c] is sample n's product, summed over the
    batch into [Ck, Ci, *kernel] with no transpose of X, dY or the result."""
    n_batch, ci = em.shape(inp)[:2]
    ck = em.shape(ker)[1]
    spatial_k = list(em.shape(ker)[2:])
    n = len(kernel)
    a = em.reshape(inp, [1, n_batch, ci] + list(em.shape(inp)[2:]))
    k = em.reshape(ker, [n_batch * ck, 1, 1] + spatial_k)
    pads = geo["pads"]
    out = em.op("Conv", [a, k], group=n_batch, kernel_shape=[1] + spatial_k, strides=[1] + geo["dilations"],
                dilations=[1] + geo["strides"], pads=[0] + pads[:n] + [0] + pads[n:])
    if list(em.shape(out)[3:]) != list(kernel):
        out = em.op("Slice", [out, em.ints([0] * n), em.ints(kernel), em.ints(range(3, 3 + n))])
    if n_batch == 1:
        return em.reshape(out, [ck, ci] + list(kernel))
    return em.reduce("ReduceSum", em.reshape(out, [n_batch, ck, ci] + list(kernel)), [0], keepdims=False)


def _bias_grad(em, dy):
    return em.reduce("ReduceSum", dy, [0] + list(range(2, em.rank(dy))), keepdims=False)


# ---- convolution ----------------------------------------------------------------------------
@rule("Conv")
def conv(em, op, dys, wants):
    x, w = op.inputs[:2]
    dy = dys[0]
    kernel = list(em.shape(w)[2:])
    geo = _geometry(op, em.shape(x)[2:], kernel)
    group = op.attributes.get("group", 1)
    grads = [None] * len(op.inputs)
    if wants[0]:
        grads[0] = _input_grad(em, x, w, dy, group, geo, kernel)
    if wants[1]:
        grads[1] = _weight_grad(em, *_pointwise_samples(em, x, dy, group, geo, kernel), kernel)
    if len(wants) > 2 and wants[2]:
        grads[2] = _bias_grad(em, dy)
    return grads


def _input_grad(em, x, w, dy, group, geo, kernel):
    """dX of a Conv: a ConvTranspose of dY by W with the Conv's geometry or, at stride 1 where
    that is cheaper, a Conv of dY by W flipped over its spatial axes with its channel axes
    swapped per group, padded by d * (k - 1) - p. Why: ONNX Runtime's CPU ConvTranspose
    multiplies into a column buffer of (C_in/group) x prod(kernel) x |dY's spatial| elements
    and folds it back (col2im), memory the plan does not see (72 MB for a 3-D U-Net's 3x3x3
    dX at 24^3 with 48 channels, beside a 10 MB arena); its Conv (MLAS) works in small tiles.
    The Conv form holds a weight-sized copy or two instead (the flip, then the swap), so it is
    taken where the column buffer is larger than those."""
    n = len(kernel)
    d, p = geo["dilations"], geo["pads"]
    pads = [d[i % n] * (kernel[i % n] - 1) - p[i] for i in range(2 * n)]
    column = (em.shape(x)[1] // group) * int(np.prod(kernel)) * int(np.prod(em.shape(dy)[2:]))
    copies = 2 if any(k > 1 for k in kernel) else 1       # the flip, then the channel swap
    if any(s != 1 for s in geo["strides"]) or min(pads) < 0 or column <= copies * int(np.prod(em.shape(w))):
        out_pad = _output_padding(em.shape(x)[2:], em.shape(dy)[2:], kernel, geo)
        return em.op("ConvTranspose", [dy, w], group=group, kernel_shape=kernel, output_padding=out_pad, **geo)
    c_out, c_in_group = em.shape(w)[:2]
    spatial = list(range(2, 2 + n))
    if any(k > 1 for k in kernel):
        w = em.op("Slice", [w, em.ints([-1] * n), em.ints([np.iinfo(np.int64).min] * n), em.ints(spatial),
                            em.ints([-1] * n)])
    if group == 1:
        w = em.transpose(w, [1, 0] + spatial)
    else:
        w = em.regroup(w, [group, c_out // group, c_in_group] + kernel, [0, 2, 1] + [a + 1 for a in spatial],
                       [group * c_in_group, c_out // group] + kernel)
    return em.op("Conv", [dy, w], group=group, kernel_shape=kernel, dilations=d, pads=pads)


def _pointwise_samples(em, x, dy, group, geo, kernel):
    """(input, dY, group, geometry) for the weight gradient. A strided 1x1 convolution without
    padding (a ResNet downsample) reads only X[..., ::s]: where that slice is smaller than what
    the strided form computes beyond the kernel (its product spans (H - (H_out - 1) * s) positions
    per axis, then sliced to 1), the gradient is taken from the slice at stride 1 instead."""
    strides = geo["strides"]
    if group != 1 or any(k != 1 for k in kernel) or any(geo["pads"]) or all(s == 1 for s in strides):
        return x, dy, group, geo
    n_batch, ci = em.shape(x)[:2]
    ck, out = em.shape(dy)[1], list(em.shape(dy)[2:])
    itemsize = em.np_dtype(x).itemsize
    reach = int(np.prod([size - (o - 1) * s for size, o, s in zip(em.shape(x)[2:], out, strides)]))
    by_sample = n_batch * ck * ci * itemsize <= em.tensors[x].nbytes + em.tensors[dy].nbytes
    oversize = ci * ck * (reach - 1) * itemsize * (n_batch if by_sample else 1)
    taken = n_batch * ci * int(np.prod(out)) * itemsize
    if taken >= oversize:
        return x, dy, group, geo
    n = len(kernel)
    samples = em.op("Slice", [x, em.ints([0] * n), em.ints(out_end * s for out_end, s in zip(out, strides)),
                              em.ints(range(2, 2 + n)), em.ints(strides)])
    return samples, dy, group, {"strides": [1] * n, "dilations": [1] * n, "pads": [0] * (2 * n)}


def _check_conv_transpose(em, op):
    if op.attributes.get("output_shape"):
        return "output_shape is not supported (give pads and output_padding)"
    if _text(op.attributes.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        return "auto_pad SAME_* is not supported (give pads)"
    return None


@rule("ConvTranspose", check=_check_conv_transpose)
def conv_transpose(em, op, dys, wants):
    x, w = op.inputs[:2]
    dy = dys[0]
    kernel = list(em.shape(w)[2:])
    n = len(kernel)
    attrs = op.attributes
    geo = {"strides": list(attrs.get("strides", [1] * n)), "dilations": list(attrs.get("dilations", [1] * n)),
           "pads": [0] * (2 * n) if _text(attrs.get("auto_pad", "NOTSET")) == "VALID"
           else list(attrs.get("pads", [0] * (2 * n)))}
    group = attrs.get("group", 1)
    grads = [None] * len(op.inputs)
    if wants[0]:
        grads[0] = em.op("Conv", [dy, w], group=group, kernel_shape=kernel, **geo)
    if wants[1]:
        grads[1] = _weight_grad(em, dy, x, group, geo, kernel)
    if len(wants) > 2 and wants[2]:
        grads[2] = _bias_grad(em, dy)
    return grads


# ---- matrix products ------------------------------------------------------------------------
@rule("Gemm")
def gemm(em, op, dys, wants):
    """y = alpha * op(A) op(B) + beta * C, op = optional transpose."""
    a, b = op.inputs[:2]
    dy = dys[0]
    alpha, beta = op.attributes.get("alpha", 1.0), op.attributes.get("beta", 1.0)
    ta, tb = op.attributes.get("transA", 0), op.attributes.get("transB", 0)
    grads = [None] * len(op.inputs)
    if wants[0]:
        grads[0] = (em.op("Gemm", [dy, b], alpha=alpha, transB=1 - tb) if not ta
                    else em.op("Gemm", [b, dy], alpha=alpha, transA=tb, transB=1))
    if wants[1]:
        grads[1] = (em.op("Gemm", [a, dy], alpha=alpha, transA=1 - ta) if not tb
                    else em.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=ta))
    if len(wants) > 2 and wants[2]:
        grad = em.sum_to(dy, em.shape(op.inputs[2]))
        grads[2] = grad if beta == 1.0 else em.op("Mul", [grad, em.scalar(beta, dy)])
    return grads


def _swap_last(em, x):
    rank = em.rank(x)
    return em.transpose(x, list(range(rank - 2)) + [rank - 1, rank - 2])


def _untransposed(em, b):
    """W where the forward made the 2-D operand b as Transpose(W) (a Linear in a training
    export: MatMul(x, Transpose(W))), else None. dX = dy @ b^T = dy @ W reads W, which is
    resident anyway, so no transposed copy lives until dX (the forward makes none where the
    Transpose folds into a Gemm, see `folds_into_gemm`); and it reads dy unflattened, so dW's
    flattening can take dy's storage once dX has run."""
    producer = em.source.producer.get(b)
    if producer is None or producer.op_type != "Transpose" or len(em.shape(b)) != 2:
        return None
    if list(producer.attributes.get("perm", [1, 0])) != [1, 0]:
        return None
    return producer.inputs[0]


def _matmul_forward(em, op, needed):
    """Gemm(x's rows, W, transB=1) where the right operand is a folded Transpose(W); with
    the bias as C where an Add of it is the product's one reader (`folded_bias`): the Gemm
    then writes the Add's output."""
    if not runs_as_gemm(em.source, op):
        divided = scaled_scores(em)["scores"].get(op.name)   # attention scores: the Div's output
        em.keep(op, outputs=[divided] if divided else None)
        return
    x, weight, out = op.inputs[0], _untransposed(em, op.inputs[1]), op.outputs[0]
    absorbed = folded_bias(em.source, op)
    bias = [absorbed[1]] if absorbed else []
    if absorbed:
        out = absorbed[0].outputs[0]
    scale = folded_scale(em, op)
    x, alpha = scale if scale else (x, 1.0)
    query = scaled_scores(em)["linear"].get(op.name, 1.0)   # attention's query, scaled for its scores
    scaled = {"alpha": alpha * query} if scale or query != 1.0 else {}
    if query != 1.0 and bias:
        scaled["beta"] = query
    if em.rank(x) == 2:
        em.op("Gemm", [x, weight, *bias], outputs=[out], name=op.name, transB=1, **scaled)
        return
    with em.scope(op.name):
        rows = em.reshape(x, (int(np.prod(em.shape(x)[:-1])), em.shape(x)[-1]))
        product = em.op("Gemm", [rows, weight, *bias], transB=1, **scaled)
    em.op("Reshape", [product, em.ints(em.shape(x)[:-1] + (em.shape(weight)[0],))], outputs=[out], name=op.name)


@rule("MatMul", forward=_matmul_forward)
def matmul(em, op, dys, wants):
    """Batched, broadcasting MatMul (1-D operands promoted as numpy does). A 2-D right
    operand (a linear layer's weight) gets its gradients from Gemm over flattened rows."""
    a, b = op.inputs[:2]
    shape_a, shape_b = em.shape(a), em.shape(b)
    a2 = shape_a if len(shape_a) >= 2 else (1,) + shape_a
    b2 = shape_b if len(shape_b) >= 2 else shape_b + (1,)
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    dy = em.reshape(dys[0], tuple(batch) + (a2[-2], b2[-1]))
    grads = [None, None]
    if len(b2) == 2:  # batch == a2[:-2]: the rows of A meet one weight matrix
        rows = int(np.prod(a2[:-1], dtype=np.int64))
        query = scaled_scores(em)["linear"].get(op.name, 1.0)   # dy is the scaled query's gradient
        if wants[0]:  # each gradient flattens dy itself: dX and dW stay separate groups
            untransposed = _untransposed(em, b)
            if untransposed is not None and query == 1.0:   # dy as it is
                product = em.op("MatMul", [dy, untransposed])
            else:
                product = em.op("Gemm", [em.reshape(dy, (rows, b2[-1])), untransposed or em.reshape(b, b2)],
                                transB=0 if untransposed else 1, **({"alpha": query} if query != 1.0 else {}))
            grads[0] = em.reshape(product, shape_a)
        if wants[1]:
            dy_rows = em.reshape(dy, (rows, b2[-1]))
            scale = folded_scale(em, op)   # x = c * m, and the forward never made x: c * dy^T @ m
            a_rows = em.reshape(scale[0] if scale else a, (rows, a2[-1]))
            alpha = (scale[1] if scale else 1.0) * query
            if runs_as_gemm(em.source, op):  # W's own layout (dy^T @ x), as the Transpose's rule expects: no copy
                grads[1] = em.op("Gemm", [dy_rows, a_rows], transA=1, **({"alpha": alpha} if alpha != 1.0 else {}))
            else:
                grads[1] = em.reshape(em.op("Gemm", [a_rows, dy_rows], transA=1), shape_b)
        return grads
    if wants[0]:
        grad = em.op("MatMul", [dy, _swap_last(em, em.reshape(b, b2))])
        grads[0] = em.reshape(em.sum_to(grad, a2), shape_a)
    if wants[1]:
        grad = em.op("MatMul", [_swap_last(em, em.reshape(a, a2)), dy])
        grads[1] = em.reshape(em.sum_to(grad, b2), shape_b)
    return grads


# ---- pooling --------------------------------------------------------------------------------
def _pool_geometry(em, op):
    x = op.inputs[0]
    kernel = list(op.attributes["kernel_shape"])
    return kernel, _geometry(op, em.shape(x)[2:], kernel)


def _floor_shape(in_shape, kernel, geo):
    n = len(kernel)
    s, d, p = geo["strides"], geo["dilations"], geo["pads"]
    return [(in_shape[i] + p[i] + p[n + i] - (kernel[i] - 1) * d[i] - 1) // s[i] + 1 for i in range(n)]


def _check_max_pool(em, op):
    if op.attributes.get("storage_order", 0):
        return "storage_order=1 is not supported"
    return None


def _max_pool_forward(em, op, needed):
    """Keep the argmax Indices output for the backward pass: as int32 where the input has
    fewer than 2^31 elements and the model itself does not read the indices (ScatterElements
    takes either type), so the kept indices take half the bytes of ONNX's int64 ones (and of
    PyTorch's); the int64 output dies at once."""
    if not needed:
        em.keep(op)
        return
    em.keep_saving(op, {1: "indices"})
    given = op.outputs[1] if len(op.outputs) > 1 else ""
    read = bool(given) and (bool(em.source.consumers.get(given)) or given in em.source.outputs)
    if not read and int(np.prod(em.shape(op.inputs[0]))) < 2 ** 31:
        with em.scope(op.name):
            em.saved[op.name]["indices"] = em.op("Cast", [em.saved[op.name]["indices"]], to=TensorProto.INT32)


@rule("MaxPool", inputs=(0,), outputs=(0,), check=_check_max_pool, forward=_max_pool_forward)
def max_pool(em, op, dys, wants):
    """Scatter-add dy to the argmax positions (flat indices over the whole input), which is
    right where windows overlap (MaxUnpool is not)."""
    x = op.inputs[0]
    size = int(np.prod(em.shape(x)))
    flat_dy = em.reshape(dys[0], [int(np.prod(em.shape(dys[0])))])
    flat_idx = em.reshape(em.saved[op.name]["indices"], em.shape(flat_dy))
    grad = em.scatter_add("ScatterElements", em.zeros([size], x), flat_idx, flat_dy, axis=0)
    return [em.reshape(grad, em.shape(x))]


def _check_average_pool(em, op):
    kernel, geo = _pool_geometry(em, op)
    if any(d != 1 for d in geo["dilations"]):
        return "dilations are not supported"
    if list(em.shape(op.outputs[0])[2:]) != _floor_shape(em.shape(op.inputs[0])[2:], kernel, geo):
        return "ceil_mode that changes the output size is not supported"
    return None


def _window_counts(in_shape, out_shape, kernel, geo) -> np.ndarray:
    """How many real (unpadded) elements each output window covers."""
    n = len(kernel)
    per_axis = []
    for i in range(n):
        start = np.arange(out_shape[i]) * geo["strides"][i] - geo["pads"][i]
        stop = np.minimum(start + kernel[i], in_shape[i])
        per_axis.append(stop - np.maximum(start, 0))
    counts = per_axis[0]
    for axis_counts in per_axis[1:]:
        counts = np.multiply.outer(counts, axis_counts)
    return counts


@rule("AveragePool", inputs=(0,), check=_check_average_pool)
def average_pool(em, op, dys, wants):
    """Spread dy / window size over each window: dy divided by the size, then a ConvTranspose
    with a kernel of ones over the channels folded into the batch."""
    x, dy = op.inputs[0], dys[0]
    kernel, geo = _pool_geometry(em, op)
    n_batch, channels, *spatial = em.shape(x)
    out_spatial = list(em.shape(dy)[2:])
    grad = em.reshape(dy, [n_batch * channels, 1] + out_spatial)
    weight = np.ones([1, 1] + kernel, dtype=em.np_dtype(x))
    if op.attributes.get("count_include_pad", 0) or not any(geo["pads"]):
        grad = em.divide(grad, int(np.prod(kernel)))
    else:
        counts = _window_counts(spatial, out_spatial, kernel, geo)
        grad = em.op("Div", [grad, em.const(counts.astype(em.np_dtype(x)))])
    out_pad = _output_padding(spatial, out_spatial, kernel, geo)
    grad = em.op("ConvTranspose", [grad, em.const(weight)], kernel_shape=kernel, output_padding=out_pad,
                 strides=geo["strides"], pads=geo["pads"])
    return [em.reshape(grad, em.shape(x))]


@rule("GlobalAveragePool")
def global_average_pool(em, op, dys, wants):
    x = op.inputs[0]
    area = int(np.prod(em.shape(x)[2:]))
    return [em.op("Expand", [em.divide(dys[0], area), em.ints(em.shape(x))])]


# ---- normalisation --------------------------------------------------------------------------
def _batch_norm_forward(em, op, needed):
    """Training-mode BN from batch statistics (biased variance, as PyTorch normalises), for
    every BN node: eval-form exports train with batch statistics too."""
    x, scale, bias = op.inputs[:3]
    rank = em.rank(x)
    axes = [0] + list(range(2, rank))
    channel_shape = [1, em.shape(x)[1]] + [1] * (rank - 2)
    eps = op.attributes.get("epsilon", 1e-5)
    with em.scope(op.name):
        mean = em.reduce("ReduceMean", x, axes, keepdims=True)
        centred = em.op("Sub", [x, mean])
        var = em.mean_square(centred, axes, keepdims=True)
        inv_std = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.scalar(eps, x)])])])
        scale_b, bias_b = em.reshape(scale, channel_shape), em.reshape(bias, channel_shape)
        factor = em.op("Mul", [inv_std, scale_b])
        em.saved[op.name] = {"mean": mean, "var": var, "inv_std": inv_std, "k": factor}
        if needed and op.name in stored_once(em):   # x^ kept, the activation recomputed from it
            xhat = em.op("Mul", [centred, inv_std])
            scaled = em.op("Mul", [xhat, scale_b])
            em.saved[op.name].update(xhat=xhat, scale=scale_b, bias=bias_b)
        else:
            scaled = em.op("Mul", [centred, factor])
        em.op("Add", [scaled, bias_b], outputs=[op.outputs[0]], name=op.name)
        _running_statistics(em, op, {1: mean, 2: var})
        count = int(np.prod([em.shape(x)[a] for a in axes]))
        _carried_running_statistics(em, op, op.inputs[3:5], mean, var, count)


def _carried_running_statistics(em, op, running, mean, var, count):
    """For the running statistics `running` (the names of the mean and variance buffers), the
    step's outputs `<running_mean>.updated` and `<running_var>.updated`, carried to the next
    step like the weights, as PyTorch's train mode updates them:
    running = (1 - m) * running + m * batch, with m = 1 - the node's ONNX momentum (PyTorch's
    0.1 where the node says nothing) and the batch variance unbiased (times n / (n - 1)) for
    running_var. Only where both statistics are float initializers of the model (buffers). The
    ops are emitted after the optimizer's (`em.statistics_updates`, phase `update`): like
    those, they may write over the statics they update (PyTorch updates running statistics in
    place), so the step holds one copy of each."""
    if not em.carry_statistics:
        return
    running = list(running) + [""] * (2 - len(running))
    tensors = [em.source.tensors.get(name) for name in running]
    if not all(t is not None and t.is_static and t.kind == "buffer" for t in tensors):
        return
    names = [f"{name}.updated" for name in running]
    if any(name in em.tensors or name in em.carried for name in names):
        return
    m = 1.0 - float(op.attributes.get("momentum", 0.9))
    unbiased = count / (count - 1) if count > 1 else 1.0
    em.carried.extend(names)

    def update() -> None:
        with em.scope(f"{op.name}/running_statistics"):
            for stored, batch, factor, name in zip(running, (mean, var), (m, m * unbiased), names):
                old = em.op("Mul", [stored, em.scalar(1.0 - m, stored)], kind="activation")
                new = em.op("Mul", [em.reshape(batch, em.shape(stored)), em.scalar(factor, stored)],
                            kind="activation")
                em.op("Add", [old, new], outputs=[name], kind="output")
    em.statistics_updates.append(update)


def _running_statistics(em, op, batch_stats):
    """Training-mode outputs 1, 2 (running mean, var: momentum * running + (1 - momentum) *
    batch, ONNX's definition), computed only where some op reads them."""
    momentum = op.attributes.get("momentum", 0.9)
    for position, stat in batch_stats.items():
        name = op.outputs[position] if len(op.outputs) > position else ""
        if name and em.source.consumers.get(name):
            running = op.inputs[position + 2]
            old = em.op("Mul", [running, em.scalar(momentum, running)])
            new = em.op("Mul", [em.reshape(stat, em.shape(running)), em.scalar(1 - momentum, running)])
            em.op("Add", [old, new], outputs=[name])


def _normalized(em, x, mean, inv_std):
    """xhat, computed once per backward: the input and the scale gradients share it, so
    at most one input-sized tensor of a norm's backward can be kept from the forward."""
    return em.op("Mul", [em.op("Sub", [x, mean]), inv_std])


def _scaled_mean(em, k, count):
    """A function from a per-channel sum s to s * k / count. A 16-bit float's normal range
    ends above 1 / count once count > 2^14 (k / count can be subnormal, count itself over
    65,504), so there the product is taken in float32 and only the result, a mean scaled by
    k, comes back to the input's dtype."""
    if not em.narrow_float(k):
        k_mean = em.divide(k, count)
        return lambda total: em.op("Mul", [total, k_mean])
    dtype = em.dtype(k)
    wide = em.op("Cast", [k], to=TensorProto.FLOAT)
    k_mean = em.divide(wide, count)
    return lambda total: em.op("Cast", [em.op("Mul", [em.op("Cast", [total], to=TensorProto.FLOAT), k_mean])],
                               to=dtype)


@rule("BatchNormalization", inputs=(0, 1, 2), outputs=(0,), forward=_batch_norm_forward)
def batch_norm(em, op, dys, wants):
    """As PyTorch's batch_norm_backward: the scale is constant over the reduced axes, so the two
    sums the input gradient needs are the bias and scale gradients themselves,
        dx = k * (dy - sum(dy) / m - xhat * sum(dy * xhat) / m),  k = scale * inv_std,
    and no scaled copy of dy is made: three input-sized tensors live at most (dy, xhat and
    their product, summed), where computing g = dy * scale and g * xhat needs four."""
    x, scale, bias = op.inputs[:3]
    dy = dys[0]
    saved = em.saved[op.name]
    axes = [0] + list(range(2, em.rank(x)))
    grads = [None] * len(op.inputs)
    if wants[0] or wants[2]:
        sum_dy = em.reduce("ReduceSum", dy, axes, keepdims=True)
    if wants[0] or wants[1]:
        xhat = saved.get("xhat") or _normalized(em, x, saved["mean"], saved["inv_std"])
        sum_dy_xhat = em.reduce("ReduceSum", em.op("Mul", [dy, xhat]), axes, keepdims=True)
    # the per-channel sums synchronised BatchNorm averages across data-parallel workers
    saved["sums"] = ([sum_dy] if wants[0] or wants[2] else []) + ([sum_dy_xhat] if wants[0] or wants[1] else [])
    if wants[0]:
        k = saved["k"]   # the forward's scale * inv_std
        scaled_mean = _scaled_mean(em, k, int(np.prod([em.shape(x)[a] for a in axes])))
        centred = em.op("Sub", [em.op("Mul", [dy, k]), em.op("Mul", [xhat, scaled_mean(sum_dy_xhat)])])
        grads[0] = em.op("Sub", [centred, scaled_mean(sum_dy)])
    if wants[1]:
        grads[1] = em.reshape(sum_dy_xhat, em.shape(scale))
    if wants[2]:
        grads[2] = em.reshape(sum_dy, em.shape(bias))
    return grads


def _chunked_batch_norm_forward(em, op, needed):
    """CHUNKED_BATCH_NORM (memsched.ops) in training form: the whole batch's mean and biased
    variance from the chunks' partial sums (the mean first, then the squares of the centred
    chunks, as the whole-batch BN takes them), every chunk normalised with them; running
    statistics carried as a BN's. A BN of the `bn_relu` pattern (each chunk) keeps its chunks'
    normalised inputs x^_i, the others their inputs x_i."""
    chunks = len(op.outputs)
    xs, (scale, bias), running = op.inputs[:chunks], op.inputs[chunks:chunks + 2], op.inputs[chunks + 2:]
    rank = em.rank(xs[0])
    axes = [0] + list(range(2, rank))
    channel_shape = [1, em.shape(xs[0])[1]] + [1] * (rank - 2)
    count = sum(int(np.prod([em.shape(x)[a] for a in axes])) for x in xs)
    eps = op.attributes.get("epsilon", 1e-5)
    with em.scope(op.name):
        mean = em.divide(em.total([em.reduce("ReduceSum", x, axes, keepdims=True) for x in xs]), count)
        centred = [em.op("Sub", [x, mean]) for x in xs]
        var = em.divide(em.total([em.sum_square(c, axes, keepdims=True) for c in centred]), count)
        inv_std = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.scalar(eps, xs[0])])])])
        scale_b, bias_b = em.reshape(scale, channel_shape), em.reshape(bias, channel_shape)
        factor = em.op("Mul", [inv_std, scale_b])
        em.saved[op.name] = {"mean": mean, "var": var, "inv_std": inv_std, "k": factor, "count": count}
        if needed and op.name in stored_once(em):
            em.saved[op.name]["xhats"] = xhats = [em.op("Mul", [c, inv_std]) for c in centred]
            scaled = [em.op("Mul", [xhat, scale_b]) for xhat in xhats]
        else:
            scaled = [em.op("Mul", [c, factor]) for c in centred]
        for i, (part, y) in enumerate(zip(scaled, op.outputs)):
            em.op("Add", [part, bias_b], outputs=[y], name=f"{op.name}/chunk{i}")
        _carried_running_statistics(em, op, running, mean, var, count)


@rule(f"{MEMSCHED_DOMAIN}.{CHUNKED_BATCH_NORM}", forward=_chunked_batch_norm_forward)
def chunked_batch_norm(em, op, dys, wants):
    """BatchNormalization's gradient (`batch_norm`) over chunks: the two per-channel sums are
    the chunks' partial sums added up, and each chunk's input gradient is
        dx_i = k * dy_i - x^_i * sum(dy * x^) * k / m - sum(dy) * k / m
    with m the whole batch's count. x^_i is the kept one, or normalised again from x_i for
    each of its two readers (one chunk-sized transient at a time, not every chunk's)."""
    chunks = len(op.outputs)
    xs, scale, bias = op.inputs[:chunks], op.inputs[chunks], op.inputs[chunks + 1]
    saved = em.saved[op.name]
    axes = [0] + list(range(2, em.rank(xs[0])))
    want_x, want_scale, want_bias = any(wants[:chunks]), wants[chunks], wants[chunks + 1]
    present = [i for i in range(chunks) if dys[i] is not None]
    kept = saved.get("xhats")

    def xhat(i: int) -> str:
        return kept[i] if kept else _normalized(em, xs[i], saved["mean"], saved["inv_std"])

    grads: list[str | None] = [None] * len(op.inputs)
    sums = []
    if want_x or want_bias:
        sum_dy = em.total([em.reduce("ReduceSum", dys[i], axes, keepdims=True) for i in present])
        sums.append(sum_dy)
    if want_x or want_scale:
        sum_dy_xhat = em.total([em.reduce("ReduceSum", em.op("Mul", [dys[i], xhat(i)]), axes, keepdims=True)
                                for i in present])
        sums.append(sum_dy_xhat)
    saved["sums"] = sums     # what synchronised BatchNorm averages across data-parallel workers
    if want_x:
        scaled_mean = _scaled_mean(em, saved["k"], saved["count"])
        along_xhat, along_one = scaled_mean(sum_dy_xhat), scaled_mean(sum_dy)
        for i in range(chunks):
            if not wants[i]:
                continue
            centred = em.op("Mul", [xhat(i), along_xhat])
            if dys[i] is None:
                grads[i] = em.op("Neg", [em.op("Add", [centred, along_one])])
            else:
                grads[i] = em.op("Sub", [em.op("Sub", [em.op("Mul", [dys[i], saved["k"]]), centred]), along_one])
    if want_scale:
        grads[chunks] = em.reshape(sum_dy_xhat, em.shape(scale))
    if want_bias:
        grads[chunks + 1] = em.reshape(sum_dy, em.shape(bias))
    return grads


def _layer_norm_forward(em, op, needed):
    """Keep the mean and 1/std for the backward pass: LayerNormalization's own Mean and
    InvStdDev outputs where they have the input's dtype (ONNX keeps them in float32), else
    computed beside it in the input's dtype, so that float64 models keep float64 precision."""
    x = op.inputs[0]
    if not needed:
        em.keep(op)
        return
    if em.dtype(x) != _STASH_DTYPE:
        em.keep(op)
        rank = em.rank(x)
        axis = op.attributes.get("axis", -1)
        axes = list(range(axis + rank if axis < 0 else axis, rank))
        with em.scope(op.name):
            mean = em.reduce("ReduceMean", x, axes, keepdims=True)
            centred = em.op("Sub", [x, mean])
            var = em.mean_square(centred, axes, keepdims=True)
            eps = em.scalar(op.attributes.get("epsilon", 1e-5), x)
            inv_std = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, eps])])])
        em.saved[op.name] = {"mean": mean, "inv_std": inv_std}
        return
    em.keep_saving(op, {1: "mean", 2: "inv_std"})


@rule("LayerNormalization", outputs=(0,), forward=_layer_norm_forward)
def layer_norm(em, op, dys, wants):
    """dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale, means over the
    normalised axes. g * xhat is taken as (dy * xhat) * scale from the product the scale
    gradient sums, so three input-sized tensors live at most (dy, xhat, one product), not four."""
    x, scale = op.inputs[:2]
    dy = dys[0]
    rank = em.rank(x)
    axis = op.attributes.get("axis", -1)
    axis = axis + rank if axis < 0 else axis
    norm_axes = list(range(axis, rank))
    grads = [None] * len(op.inputs)
    mean, inv_std = em.saved[op.name]["mean"], em.saved[op.name]["inv_std"]
    if wants[0] or wants[1]:
        xhat = _normalized(em, x, mean, inv_std)
        dy_xhat = em.op("Mul", [dy, xhat])
    if wants[1]:
        grads[1] = em.sum_to(dy_xhat, em.shape(scale))
    if wants[0]:
        mean_gx = em.reduce("ReduceMean", em.op("Mul", [dy_xhat, scale]), norm_axes, keepdims=True)
        g = em.op("Mul", [dy, scale])
        mean_g = em.reduce("ReduceMean", g, norm_axes, keepdims=True)
        centred = em.op("Sub", [em.op("Sub", [g, mean_g]), em.op("Mul", [xhat, mean_gx])])
        grads[0] = em.op("Mul", [centred, inv_std])
    if len(wants) > 2 and wants[2]:
        grads[2] = em.sum_to(dy, em.shape(op.inputs[2]))
    return grads


# ---- softmax --------------------------------------------------------------------------------
@rule("Softmax")
def softmax(em, op, dys, wants):
    """dx = y * (dy - sum(dy * y))."""
    y, dy = op.outputs[0], dys[0]
    axis = op.attributes.get("axis", -1)
    total = em.reduce("ReduceSum", em.op("Mul", [dy, y]), [axis], keepdims=True)
    return [em.op("Mul", [y, em.op("Sub", [dy, total])])]


@rule("LogSoftmax")
def log_softmax(em, op, dys, wants):
    """dx = dy - exp(y) * sum(dy)."""
    y, dy = op.outputs[0], dys[0]
    axis = op.attributes.get("axis", -1)
    total = em.reduce("ReduceSum", dy, [axis], keepdims=True)
    return [em.op("Sub", [dy, em.op("Mul", [em.op("Exp", [y]), total])])]
