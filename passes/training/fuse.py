"""Recognise GELU, LayerNorm and Softmax written out in primitive ops, so that their backward
keeps what PyTorch's fused kernels keep.

Exporters write these functions out op by op: torch.onnx writes gelu as
x * (erf(x / sqrt2) + 1) * 0.5 (and its tanh approximation, HF's gelu_new, as
0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))), LayerNorm at opsets below 17 as
ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add, and a hand-written softmax as
Exp(x - max) / sum. Differentiated op by op, every intermediate that a backward op reads stays
alive from the forward pass to the backward pass: BERT-base's GELUs alone hold three
input-sized tensors each (x, x / sqrt2, erf + 1), 302 MB at batch 8 x 128, where PyTorch keeps x.

`fuse_patterns(graph)` replaces each such group of ops by one op of the function:
- GELU -> `Gelu` (approximate none or tanh), whose backward reads x only and recomputes
  erf/tanh from it. Gelu is an ONNX op from opset 20 on; below that the Gelu rule's forward
  emits the group's own ops (`Fusion.ops`), unchanged, so the forward computes what the model
  says and only the backward changes;
- LayerNorm -> `LayerNormalization` (the training step's opset is 17 or more): its backward
  reads x and the per-row mean and 1/std;
- softmax -> `Softmax`: its backward reads its output y only.

Every intermediate of a group must be read only inside the group and not be a graph output
(otherwise it has to exist anyway and nothing is matched); the group's input (x) may have any
readers. Constants are matched by value to within a few units of the rounding of x's dtype.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

from memsched.ir import Graph, Op, tensor_value
from memsched.ops import ARITHMETIC_OPS

_MAX_POWER = 4   # x^3 is the highest power a GELU formula has; higher ones are not GELU
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_TANH_CUBIC = 0.044715


@dataclass(frozen=True)
class Fusion:
    """One recognised group: the op that stands for it and the source ops it replaces
    (in graph order; the fused op takes the name of the last one)."""
    op: Op
    ops: tuple[Op, ...]


def fuse_patterns(graph: Graph) -> tuple[Graph, dict[str, Fusion]]:
    """`graph` with every recognised GELU, LayerNorm and softmax group as one op (see the
    module doc), and {fused op name: Fusion}. The same Graph object where nothing matches."""
    matcher = _Matcher(graph)
    fusions: dict[str, Fusion] = {}
    claimed: set[str] = set()
    for op in graph.ops:
        for match in (matcher.gelu, matcher.layer_norm, matcher.softmax):
            fusion = match(op)
            if fusion is not None and not claimed.intersection(o.name for o in fusion.ops):
                claimed.update(o.name for o in fusion.ops)
                fusions[fusion.op.name] = fusion
                break
    if not fusions:
        return graph, {}
    ops = []
    for op in graph.ops:
        if op.name in fusions:
            ops.append(fusions[op.name].op)
        elif op.name not in claimed:
            ops.append(op)
    return graph.replace(ops=ops), fusions


class _Matcher:
    """Pattern matching over one graph's producers, consumers and constants."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.outputs = set(graph.outputs)

    # ---- basics ---------------------------------------------------------------------------
    def readers(self, name: str) -> list[Op]:
        return self.graph.consumers.get(name, [])

    def only_reader(self, name: str) -> Op | None:
        """The one op that reads `name`, where it is an intermediate: read once, not an output."""
        readers = self.readers(name)
        if len(readers) != 1 or name in self.outputs or name in self.graph.inputs:
            return None
        return readers[0]

    def producer(self, name: str, op_type: str | None = None) -> Op | None:
        op = self.graph.producer.get(name)
        if op is None or op.domain not in ("", "ai.onnx") or (op_type and op.op_type != op_type):
            return None
        return op

    def scalar(self, name: str) -> float | None:
        """The value of a one-element constant (a Constant node, or an initializer that is not
        a trainable parameter), else None."""
        if not name or name in self.graph.inputs:
            return None
        t = self.graph.tensors.get(name)
        producer = self.graph.producer.get(name)
        if producer is not None and producer.op_type == "Constant":
            value = producer.attributes.get("value")
            if value is None:
                value = producer.attributes.get("value_float")
                return None if value is None else float(value)
            array = numpy_helper.to_array(value)
        elif t is not None and t.is_static and (t.kind != "parameter" or not t.shape):
            array = tensor_value(t, self.graph.base_dir)
        else:
            return None
        return float(array.reshape(-1)[0]) if array.size == 1 and array.dtype.kind == "f" else None

    def ints(self, op: Op, position: int = 1) -> list[int] | None:
        """A reduction's axes: its `axes` attribute or its constant axes input."""
        if "axes" in op.attributes:
            return [int(a) for a in op.attributes["axes"]]
        if len(op.inputs) <= position or not op.inputs[position]:
            return None
        name = op.inputs[position]
        t = self.graph.tensors.get(name)
        producer = self.graph.producer.get(name)
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            return [int(a) for a in numpy_helper.to_array(producer.attributes["value"]).reshape(-1)]
        if t is not None and t.is_static and name not in self.graph.inputs:
            return [int(a) for a in tensor_value(t, self.graph.base_dir).reshape(-1)]
        return None

    def close(self, value: float | None, want: float, like: str) -> bool:
        """`value` equals `want` to within a few roundings of `like`'s dtype."""
        if value is None:
            return False
        eps = float(np.finfo(helper.tensor_dtype_to_np_dtype(self.graph.tensors[like].dtype)).eps)
        return abs(value - want) <= 8 * max(eps, 1e-12) * abs(want)

    def rank(self, name: str) -> int:
        return len(self.graph.tensors[name].shape)

    def reduce_axes(self, op: Op, op_type: str, x: str) -> list[int] | None:
        """The sorted, non-negative axes of a keepdims reduction `op_type` of x, else None."""
        if op.op_type != op_type or op.inputs[0] != x or not op.attributes.get("keepdims", 1):
            return None
        axes = self.ints(op)
        if not axes:
            return None
        rank = self.rank(x)
        return sorted(a + rank if a < 0 else a for a in axes)

    def fusion(self, op_type: str, inputs: list[str], output: str, ops: list[Op], **attributes) -> Fusion:
        ordered = sorted(ops, key=self.graph.ops.index)
        last = ordered[-1]
        return Fusion(Op(last.name, op_type, inputs, [output], attributes), tuple(ordered))

    # ---- polynomials in one variable ----------------------------------------------------
    def polynomial(self, name: str, var: str | None, ops: list[Op]) -> tuple[str, dict[int, float]] | None:
        """`name` as a polynomial in one tensor: (variable, {power: coefficient}), through
        arithmetic ops whose outputs are intermediates (appended to `ops`); constants are
        leaves, and so is `var` (or, with var None, the one non-constant leaf found)."""
        value = self.scalar(name)
        if value is not None:
            return var, {0: value}
        if name == var:
            return var, {1: 1.0}
        producer = self.producer(name)
        if producer is None or producer.op_type not in ARITHMETIC_OPS or self.only_reader(name) is None:
            return (name, {1: 1.0}) if var is None else None
        if producer.op_type == "Neg":
            inner = self.polynomial(producer.inputs[0], var, ops)
            result = None if inner is None else (inner[0], _scaled(inner[1], -1.0))
        elif producer.op_type == "Pow":
            exponent = self.scalar(producer.inputs[1])
            inner = self.polynomial(producer.inputs[0], var, ops)
            if inner is None or exponent is None or exponent != int(exponent) or not 0 <= exponent <= _MAX_POWER:
                return None
            terms = {0: 1.0}
            for _ in range(int(exponent)):
                terms = _product(terms, inner[1])
            result = inner[0], terms
        else:
            left = self.polynomial(producer.inputs[0], var, ops)
            if left is None:
                return None
            right = self.polynomial(producer.inputs[1], left[0] if var is None else var, ops)
            if right is None:
                return None
            found = left[0] if left[0] is not None else right[0]
            if right[0] is not None and left[0] is not None and right[0] != left[0]:
                return None
            a, b = left[1], right[1]
            if producer.op_type == "Add":
                result = found, _sum(a, b)
            elif producer.op_type == "Sub":
                result = found, _sum(a, _scaled(b, -1.0))
            elif producer.op_type == "Mul":
                result = found, _product(a, b)
            elif set(b) == {0} and b[0] != 0:   # Div by a constant
                result = found, _scaled(a, 1 / b[0])
            else:
                return None
        if result is not None and max(result[1], default=0) > _MAX_POWER:
            return None
        ops.append(producer)
        return result

    # ---- GELU -----------------------------------------------------------------------------
    def gelu(self, anchor: Op) -> Fusion | None:
        """x * 0.5 * (1 + erf(x / sqrt2)) or 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), in
        any arrangement of the products and sums, anchored at its Erf or Tanh."""
        if anchor.op_type not in ("Erf", "Tanh") or anchor.domain not in ("", "ai.onnx"):
            return None
        ops: list[Op] = [anchor]
        found = self.polynomial(anchor.inputs[0], None, ops)
        if found is None or found[0] is None:
            return None
        x, arg = found
        if anchor.op_type == "Erf":
            approximate, want = "none", {1: 1 / math.sqrt(2)}
        else:
            approximate, want = "tanh", {1: _SQRT_2_OVER_PI, 3: _SQRT_2_OVER_PI * _TANH_CUBIC}
        if not self.same_polynomial(arg, want, x):
            return None
        plus = self.only_reader(anchor.outputs[0])
        if plus is None or plus.op_type != "Add":
            return None
        other = plus.inputs[1] if plus.inputs[0] == anchor.outputs[0] else plus.inputs[0]
        if not self.close(self.scalar(other), 1.0, x):
            return None
        ops.append(plus)
        return self.gelu_products(x, plus.outputs[0], approximate, ops)

    def gelu_products(self, x: str, factor: str, approximate: str, ops: list[Op]) -> Fusion | None:
        """Follow the chain of products from (1 + erf/tanh) until the other factors make 0.5x."""
        current, scale = factor, {0: 1.0}
        while True:
            reader = self.only_reader(current)
            if reader is None or reader.op_type not in ("Mul", "Div") or reader.inputs[0] == reader.inputs[1]:
                return None
            other = reader.inputs[1] if reader.inputs[0] == current else reader.inputs[0]
            if reader.op_type == "Div" and reader.inputs[0] != current:
                return None
            side: list[Op] = []
            poly = self.polynomial(other, x, side)
            if poly is None or (reader.op_type == "Div" and set(poly[1]) != {0}):
                return None
            scale = _product(scale, poly[1] if reader.op_type == "Mul" else {0: 1 / poly[1][0]})
            if len(scale) != 1 or max(scale) > 1:
                return None
            ops += side + [reader]
            current = reader.outputs[0]
            if self.same_polynomial(scale, {1: 0.5}, x):
                return self.fusion("Gelu", [x], current, ops, approximate=approximate)

    def same_polynomial(self, have: dict[int, float], want: dict[int, float], like: str) -> bool:
        powers = {p for p, c in have.items() if c != 0}
        return powers == set(want) and all(self.close(have[p], want[p], like) for p in want)

    # ---- LayerNorm ------------------------------------------------------------------------
    def layer_norm(self, mean_op: Op) -> Fusion | None:
        """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* weight] [+ bias] over trailing
        axes, anchored at the first ReduceMean."""
        if mean_op.op_type != "ReduceMean" or mean_op.domain not in ("", "ai.onnx"):
            return None
        x = mean_op.inputs[0]
        axes = self.reduce_axes(mean_op, "ReduceMean", x)
        if axes is None or axes != list(range(axes[0], self.rank(x))):
            return None
        sub = self.only_reader(mean_op.outputs[0])
        if sub is None or sub.op_type != "Sub" or sub.inputs != [x, mean_op.outputs[0]]:
            return None
        centred = sub.outputs[0]
        readers = self.readers(centred)
        if centred in self.outputs or len(readers) != 2:
            return None
        square = next((r for r in readers if r.op_type in ("Pow", "Mul") and r.inputs[0] == centred), None)
        divide = next((r for r in readers if r.op_type == "Div" and r.inputs[0] == centred), None)
        if square is None or divide is None:
            return None
        if square.op_type == "Pow" and self.scalar(square.inputs[1]) != 2.0:
            return None
        if square.op_type == "Mul" and square.inputs[1] != centred:
            return None
        var_op = self.only_reader(square.outputs[0])
        if var_op is None or self.reduce_axes(var_op, "ReduceMean", square.outputs[0]) != axes:
            return None
        add = self.only_reader(var_op.outputs[0])
        if add is None or add.op_type != "Add":
            return None
        eps = self.scalar(add.inputs[1] if add.inputs[0] == var_op.outputs[0] else add.inputs[0])
        sqrt = self.only_reader(add.outputs[0])
        if eps is None or eps < 0 or sqrt is None or sqrt.op_type != "Sqrt":
            return None
        if self.only_reader(sqrt.outputs[0]) is not divide or divide.inputs[1] != sqrt.outputs[0]:
            return None
        ops = [mean_op, sub, square, var_op, add, sqrt, divide]
        normalized = tuple(self.graph.tensors[x].shape[axes[0]:])
        out, affine = divide.outputs[0], []
        for op_type in ("Mul", "Add"):
            reader = self.only_reader(out)
            if reader is None or reader.op_type != op_type:
                break
            other = reader.inputs[1] if reader.inputs[0] == out else reader.inputs[0]
            t = self.graph.tensors[other]
            if t.shape != normalized or t.dtype != self.graph.tensors[x].dtype or other == out:
                break
            affine.append(other)
            ops.append(reader)
            out = reader.outputs[0]
        if not affine or self.graph.tensors[divide.outputs[0]].shape != self.graph.tensors[x].shape:
            return None   # no scale: LayerNormalization needs one
        return self.fusion("LayerNormalization", [x] + affine, out, ops, axis=axes[0], epsilon=eps)

    # ---- softmax --------------------------------------------------------------------------
    def softmax(self, exp: Op) -> Fusion | None:
        """exp(x - max(x)) / sum(exp(x - max(x))) (or without the max) over one axis,
        anchored at the Exp."""
        if exp.op_type != "Exp" or exp.domain not in ("", "ai.onnx"):
            return None
        e, ops = exp.outputs[0], [exp]
        x = exp.inputs[0]
        sub = self.producer(x, "Sub")
        if sub is not None and self.only_reader(x) is exp:
            peak = self.producer(sub.inputs[1], "ReduceMax")
            if peak is not None and peak.inputs[0] == sub.inputs[0] and self.only_reader(peak.outputs[0]) is sub:
                ops += [sub, peak]
                x = sub.inputs[0]
        readers = self.readers(e)
        if e in self.outputs or len(readers) != 2:
            return None
        total = next((r for r in readers if r.op_type == "ReduceSum"), None)
        divide = next((r for r in readers if r.op_type == "Div" and r.inputs[0] == e), None)
        if total is None or divide is None:
            return None
        axes = self.reduce_axes(total, "ReduceSum", e)
        if axes is None or len(axes) != 1 or divide.inputs[1] != total.outputs[0]:
            return None
        if self.only_reader(total.outputs[0]) is not divide:
            return None
        if len(ops) > 1 and self.reduce_axes(ops[2], "ReduceMax", x) != axes:
            return None
        return self.fusion("Softmax", [x], divide.outputs[0], ops + [total, divide], axis=axes[0])


def _scaled(terms: dict[int, float], factor: float) -> dict[int, float]:
    return {p: c * factor for p, c in terms.items()}


def _sum(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    result = dict(a)
    for p, c in b.items():
        result[p] = result.get(p, 0.0) + c
    return result


def _product(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    result: dict[int, float] = {}
    for p, c in a.items():
        for q, d in b.items():
            result[p + q] = result.get(p + q, 0.0) + c * d
    return result


def emit_original(em, fusion: Fusion) -> None:
    """Emit a fused group's own source ops, unchanged (its forward where the fused op does
    not exist in the step's opset)."""
    for op in fusion.ops:
        em.keep(dataclasses.replace(op))
