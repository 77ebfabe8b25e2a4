"""Gradient rules of elementwise ops: activations, arithmetic with broadcasting, Where,
Cast, Clip, Dropout. Binary ops sum their gradients back to each input's shape."""
from __future__ import annotations

import math

import numpy as np

from memsched.passes.training.fuse import emit_original
from memsched.dtypes import FLOAT_TYPES
from memsched.passes.training.registry import rule
from memsched.passes.training.rules_shape import folded_product, folds_into_matmul_scale, scaled_scores


def _x(op):
    return op.inputs[0]


def _y(op):
    return op.outputs[0]


@rule("Identity")
def identity(em, op, dys, wants):
    return [dys[0]]


def _masked(em, dy, condition):
    """dy where `condition` holds, 0 elsewhere, as dy * float(condition) rather than a Where.

    Why not Where: ONNX Runtime's CPU Where computes each branch into a temporary of the
    output's size and then merges the two, so it asks for twice its output in scratch, memory
    the plan cannot see and the kernels' scratch arena keeps. The float mask is a tensor of
    the graph, which the plan places and frees. The products are exact (dy * 1, dy * 0); only
    a non-finite dy where the mask is 0 gives NaN where Where gives 0. The condition stays a
    bool tensor of its own: the float64 check pins such branch decisions to the float32 run's
    (memsched.numerics.decisions)."""
    return em.op("Mul", [dy, em.op("Cast", [condition], to=em.dtype(dy))])


@rule("Relu")
def relu(em, op, dys, wants):
    y = _y(op)
    return [_masked(em, dys[0], em.op("Greater", [y, em.scalar(0, y)]))]


@rule("LeakyRelu")
def leaky_relu(em, op, dys, wants):
    """dy * (1 where x > 0, alpha elsewhere), torch's rule. For 0 <= alpha <= 1 that slope is
    Max(float(x > 0), alpha), exactly, with no Where (`_masked`)."""
    y, dy = _y(op), dys[0]
    alpha_value = op.attributes.get("alpha", 0.01)
    alpha = em.scalar(alpha_value, y)
    positive = em.op("Greater", [_x(op), em.scalar(0, y)])
    if 0 <= alpha_value <= 1:
        return [em.op("Mul", [dy, em.op("Max", [em.op("Cast", [positive], to=em.dtype(y)), alpha])])]
    return [em.op("Where", [positive, dy, em.op("Mul", [dy, alpha])])]


@rule("Sigmoid")
def sigmoid(em, op, dys, wants):
    y = _y(op)
    slope = em.op("Mul", [y, em.op("Sub", [em.scalar(1, y), y])])
    return [em.op("Mul", [dys[0], slope])]


@rule("Tanh")
def tanh(em, op, dys, wants):
    y = _y(op)
    slope = em.op("Sub", [em.scalar(1, y), em.op("Mul", [y, y])])
    return [em.op("Mul", [dys[0], slope])]


@rule("Exp")
def exp(em, op, dys, wants):
    return [em.op("Mul", [dys[0], _y(op)])]


@rule("Log")
def log(em, op, dys, wants):
    return [em.op("Div", [dys[0], _x(op)])]


@rule("Neg")
def neg(em, op, dys, wants):
    return [em.op("Neg", [dys[0]])]


@rule("Reciprocal")
def reciprocal(em, op, dys, wants):
    y = _y(op)
    return [em.op("Neg", [em.op("Mul", [dys[0], em.op("Mul", [y, y])])])]


@rule("Sqrt")
def sqrt(em, op, dys, wants):
    y = _y(op)
    return [em.op("Div", [em.op("Mul", [dys[0], em.scalar(0.5, y)]), y])]


@rule("Abs")
def abs_(em, op, dys, wants):
    return [em.op("Mul", [dys[0], em.op("Sign", [_x(op)])])]


@rule("Softplus")
def softplus(em, op, dys, wants):
    return [em.op("Mul", [dys[0], em.op("Sigmoid", [_x(op)])])]


@rule("Erf")
def erf(em, op, dys, wants):
    x = _x(op)
    gauss = em.op("Exp", [em.op("Neg", [em.op("Mul", [x, x])])])
    return [em.op("Mul", [dys[0], em.op("Mul", [gauss, em.scalar(2 / math.sqrt(math.pi), x)])])]


def _check_gelu(em, op):
    approx = op.attributes.get("approximate", "none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return None if approx in ("none", "tanh") else f"approximate='{approx}' is not supported"


def _gelu_forward(em, op, needed):
    """A Gelu node of the model as it is; a GELU that `fuse.fuse_patterns` found written out
    in primitive ops as a Gelu op where the step's opset has one (20 on), else as those ops."""
    fusion = em.fusions.get(op.name)
    if fusion is None:
        em.keep(op)
    elif em.opset >= 20:
        em.op("Gelu", op.inputs, outputs=op.outputs, name=op.name, **op.attributes)
    else:
        emit_original(em, fusion)


@rule("Gelu", check=_check_gelu, forward=_gelu_forward)
def gelu(em, op, dys, wants):
    """From x alone, recomputing erf or tanh (PyTorch's gelu_backward keeps x only too):
    none: Phi(x) + x * phi(x), with Phi(x) = 0.5 + 0.5 * erf(x / sqrt2);
    tanh: with t = tanh(u), u = c * (x + k * x^3), du = c * (1 + 3k * x^2), the derivative of
    0.5 * x * (1 + t) is 0.5 * (1 + t) * (1 + x * (1 - t) * du), since 1 - t^2 = (1 + t)(1 - t).
    Each form holds at most three x-sized temporaries at once, and neither writes
    0.5 * (1 + tanh(.)) or (1 + erf(.)) * x, which ONNX Runtime's Gelu fusions would rewrite."""
    x, dy = _x(op), dys[0]
    approx = op.attributes.get("approximate", "none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    half = em.scalar(0.5, x)
    square = em.op("Mul", [x, x])
    if approx == "tanh":
        c, k = math.sqrt(2 / math.pi), 0.044715
        u = em.op("Mul", [em.op("Add", [em.op("Mul", [square, em.scalar(c * k, x)]), em.scalar(c, x)]), x])
        du = em.op("Add", [em.op("Mul", [square, em.scalar(3 * c * k, x)]), em.scalar(c, x)])
        t = em.op("Tanh", [u])
        slope = em.op("Mul", [em.op("Mul", [du, x]), em.op("Sub", [em.scalar(1, x), t])])
        rising = em.op("Add", [em.op("Mul", [t, half]), half])
        return [em.op("Mul", [dy, em.op("Mul", [rising, em.op("Add", [slope, em.scalar(1, x)])])])]
    density = em.op("Mul", [em.op("Exp", [em.op("Mul", [square, em.scalar(-0.5, x)])]), x])
    erf = em.op("Erf", [em.op("Mul", [x, em.scalar(1 / math.sqrt(2), x)])])
    cdf = em.op("Add", [em.op("Mul", [erf, half]), half])
    pdf = em.op("Mul", [density, em.scalar(1 / math.sqrt(2 * math.pi), x)])
    return [em.op("Mul", [dy, em.op("Add", [cdf, pdf])])]


@rule("Clip", inputs=(0,))
def clip(em, op, dys, wants):
    """Gradient passes where min <= x <= max (torch.clamp's rule)."""
    x = _x(op)
    inside = None
    for position, compare in ((1, "GreaterOrEqual"), (2, "LessOrEqual")):
        if len(op.inputs) > position and op.inputs[position]:
            test = em.op(compare, [x, op.inputs[position]])
            inside = test if inside is None else em.op("And", [inside, test])
    if inside is None:
        return [dys[0]]
    return [_masked(em, dys[0], inside)]


@rule("Floor", "Ceil", "Round", "Sign", inputs=())
def piecewise_constant(em, op, dys, wants):
    """Zero almost everywhere: no gradient flows through."""
    return [None]


@rule("Cast", inputs=(0,))
def cast(em, op, dys, wants):
    x = _x(op)
    if em.dtype(op.outputs[0]) not in FLOAT_TYPES:
        return [None]
    return [em.op("Cast", [dys[0]], to=em.dtype(x))]


def _dropout_mode(em, op) -> tuple[float, bool] | None:
    """(ratio, training) when both are known before running, else None."""
    ratio = em.value(op.inputs[1]) if len(op.inputs) > 1 and op.inputs[1] else np.asarray(0.5)
    training = em.value(op.inputs[2]) if len(op.inputs) > 2 and op.inputs[2] else np.asarray(False)
    if ratio is None or training is None:
        return None
    return float(ratio), bool(training)


def _check_dropout(em, op):
    return None if _dropout_mode(em, op) is not None else "its ratio or training_mode is not a constant"


def _dropout_masked(em, op) -> bool:
    ratio, training = _dropout_mode(em, op)
    return training and ratio > 0


def _dropout_forward(em, op, needed):
    """Training-mode dropout keeps its mask for the backward pass."""
    if needed and _dropout_masked(em, op):
        em.keep_saving(op, {1: "mask"})
    else:
        em.keep(op)


@rule("Dropout", inputs=(0,), outputs=(0,), check=_check_dropout, forward=_dropout_forward)
def dropout(em, op, dys, wants):
    """Eval mode or ratio 0: identity. Training: dy * mask / (1 - ratio)."""
    if not _dropout_masked(em, op):
        return [dys[0]]
    ratio, _ = _dropout_mode(em, op)
    y = _y(op)
    kept = em.op("Cast", [em.saved[op.name]["mask"]], to=em.dtype(y))
    return [em.op("Mul", [dys[0], em.op("Mul", [kept, em.scalar(1 / (1 - ratio), y)])])]


# ---- binary ops with broadcasting ---------------------------------------------------------
def _shape_of(em, op, i):
    return em.shape(op.inputs[i])


def _add_forward(em, op, needed):
    """Nothing where a Linear's Gemm takes this Add's bias as C (`folded_product`)."""
    if op.op_type != "Add" or folded_product(em.source, op) is None:
        em.keep(op)


@rule("Add", "Sum", forward=_add_forward)
def add(em, op, dys, wants):
    grads = [em.sum_to(dys[0], _shape_of(em, op, i)) if w else None for i, w in enumerate(wants)]
    product = folded_product(em.source, op) if op.op_type == "Add" else None
    query = scaled_scores(em)["linear"].get(em.source.producer[product].name, 1.0) if product else 1.0
    if query != 1.0:   # dy is the scaled query's gradient: the bias's is dy's sum scaled the same
        grads = [g if g is None or name == product else em.op("Mul", [g, em.scalar(query, g)])
                 for name, g in zip(op.inputs, grads)]
    return grads


@rule("Sub")
def sub(em, op, dys, wants):
    grads = [None, None]
    if wants[0]:
        grads[0] = em.sum_to(dys[0], _shape_of(em, op, 0))
    if wants[1]:
        grads[1] = em.op("Neg", [em.sum_to(dys[0], _shape_of(em, op, 1))])
    return grads


def _mul_forward(em, op, needed):
    """Nothing where a Linear's Gemm takes this scale as alpha (`folds_into_matmul_scale`)."""
    if not folds_into_matmul_scale(em, op):
        em.keep(op)


@rule("Mul", forward=_mul_forward)
def mul(em, op, dys, wants):
    a, b = op.inputs[:2]
    grads = [None, None]
    if wants[0]:
        grads[0] = em.sum_to(em.op("Mul", [dys[0], b]), em.shape(a))
    if wants[1]:
        grads[1] = em.sum_to(em.op("Mul", [dys[0], a]), em.shape(b))
    return grads


def _div_forward(em, op, needed):
    """Nothing where the query's Linear scaled attention's scores already (`scaled_scores`)."""
    if op.name not in scaled_scores(em)["div"]:
        em.keep(op)


@rule("Div", forward=_div_forward)
def div(em, op, dys, wants):
    """y = a / b: da = dy / b, db = -dy * y / b (where the query's Linear did the division,
    `scaled_scores`, dy passes on as it is: the scores' MatMul reads the scaled query)."""
    a, b = op.inputs[:2]
    if op.name in scaled_scores(em)["div"]:
        return [dys[0] if wants[0] else None, None]
    grads = [None, None]
    if wants[0]:
        grads[0] = em.sum_to(em.op("Div", [dys[0], b]), em.shape(a))
    if wants[1]:
        scaled = em.op("Div", [em.op("Mul", [dys[0], _y(op)]), b])
        grads[1] = em.op("Neg", [em.sum_to(scaled, em.shape(b))])
    return grads


@rule("Pow")
def pow_(em, op, dys, wants):
    """y = a^b: da = dy * b * a^(b-1), db = dy * y * ln(a)."""
    a, b = op.inputs[:2]
    grads = [None, None]
    if wants[0]:
        exponent = em.value(b)
        if exponent is not None and exponent.size == 1:
            e = float(exponent.reshape(()))
            if e == 2:
                slope = em.op("Mul", [a, em.scalar(2, a)])
            else:
                slope = em.op("Mul", [em.op("Pow", [a, em.scalar(e - 1, a)]), em.scalar(e, a)])
        else:
            slope = em.op("Mul", [em.op("Pow", [a, em.op("Sub", [b, em.scalar(1, b)])]), b])
        grads[0] = em.sum_to(em.op("Mul", [dys[0], slope]), em.shape(a))
    if wants[1]:
        grads[1] = em.sum_to(em.op("Mul", [dys[0], em.op("Mul", [_y(op), em.op("Log", [a])])]), em.shape(b))
    return grads


@rule("Where", inputs=(1, 2))
def where(em, op, dys, wants):
    cond = op.inputs[0]
    grads = [None, None, None]
    if wants[1]:
        grads[1] = em.sum_to(_masked(em, dys[0], cond), em.shape(op.inputs[1]))
    if wants[2]:
        grads[2] = em.sum_to(_masked(em, dys[0], em.op("Not", [cond])), em.shape(op.inputs[2]))
    return grads
