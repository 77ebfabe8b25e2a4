"""The Emitter: appends ops to the training graph under construction, one at a time.

Every op it emits gets a unique name under the current scope, the current phase, and output
tensors whose shapes and dtypes come from ONNX's own per-node shape inference (so a rule
never states a shape by hand, and a shape inference failure is caught where it happens).
Rules build their gradients with its helpers: constants (deduplicated initializers of kind
`constant`), opset-aware reductions, `sum_to` (undo broadcasting), `zeros`, and `value`
(constant folding of shape arithmetic, for attributes that arrive as tensors), and
`scatter_add` (16-bit floats summed in float32), and `divide` (a mean's division by its
count).
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memsched.dtypes import HALF_TYPES
from memsched.ir import Graph, Op, Tensor, tensor_value
from memsched.ops import FOLDABLE_OPS

_FOLD_LIMIT = 1 << 16  # elements: folding is for shapes and scalars, not for weights


class Emitter:
    """The ops and tensors of the graph being built, plus naming, phase and helpers."""

    def __init__(self, source: Graph, opset: int, fusions: dict | None = None):
        self.source = source
        self.opset = opset
        self.ops: list[Op] = []
        self.tensors: dict[str, Tensor] = {n: dataclasses.replace(t) for n, t in source.tensors.items()}
        self.phase = "forward"
        self._scope = ""
        self.fusions = dict(fusions or {})   # fused op -> passes.training.fuse.Fusion
        self._taken: set[str] = (set(source.tensors) | {op.name for op in source.ops}
                                 | {op.name for fusion in self.fusions.values() for op in fusion.ops})
        self._consts: dict[tuple, str] = {}
        self._values: dict[str, np.ndarray | None] = {}
        self._producer: dict[str, Op] = {}
        self._read: set[str] = set()
        self._emitted: set[str] = set()
        self.saved: dict[str, dict[str, str]] = {}  # forward op -> tensors its backward reads
        self.analyses: dict[str, object] = {}  # rules' analyses of the source graph, made once
        self.hyperparameters: dict[str, list[str]] = {}  # hyperparameter -> its tensors (one per dtype)
        self.carry_statistics = True  # BatchNorm running statistics updated and carried between steps
        self.carried: list[str] = []  # outputs `<static>.updated` besides the optimizer's (running statistics)
        self.statistics_updates: list = []  # callables emitting them, run in phase update after the optimizer's

    # ---- naming and scope -----------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A name no tensor or op has yet."""
        name, k = base, 1
        while name in self._taken:
            name, k = f"{base}_{k}", k + 1
        self._taken.add(name)
        return name

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Name the ops emitted inside `prefix/OpType`."""
        outer, self._scope = self._scope, prefix
        try:
            yield
        finally:
            self._scope = outer

    # ---- emission -------------------------------------------------------------------
    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, *,
           name: str | None = None, kind: str | None = None, **attrs) -> str | list[str]:
        """Append one default-domain op; return its output name (or names if several)."""
        if name is not None and name in self.source.op_by_name and name not in self._emitted:
            op_name = name  # a forward op rewritten for training keeps its name
        else:
            op_name = self.fresh(name or (f"{self._scope}/{op_type}" if self._scope else op_type))
        self._emitted.add(op_name)
        if isinstance(outputs, int):
            out_names = [self.fresh(f"{op_name}_output_{i}") for i in range(outputs)]
        else:
            out_names = list(outputs)
            self._taken.update(out_names)
        op = Op(op_name, op_type, list(inputs), out_names, dict(attrs), phase=self.phase)
        types = self._infer(op)
        default_kind = "activation" if self.phase in ("forward", "loss") else "gradient"
        for out in op.present_outputs:
            shape, dtype = types[out]
            self.tensors[out] = Tensor(out, shape, dtype, kind or default_kind)
            self._producer[out] = op
        self._read.update(op.present_inputs)
        self.ops.append(op)
        return out_names[0] if len(out_names) == 1 else out_names

    def keep(self, op: Op, outputs: list[str] | None = None) -> None:
        """Append an op of the source graph, unchanged or with more outputs (typed here)."""
        kept = dataclasses.replace(op, phase=self.phase, outputs=list(outputs or op.outputs))
        new = [t for t in kept.present_outputs if t not in self.tensors]
        if new:
            types = self._infer(kept)
            for t in new:
                self._taken.add(t)
                self.tensors[t] = Tensor(t, *types[t], "activation")
        self._read.update(kept.present_inputs)
        self._emitted.add(kept.name)
        self.ops.append(kept)

    def keep_saving(self, op: Op, outputs: dict[int, str]) -> None:
        """Keep `op` with its optional outputs {position: label} present (named
        `<op>_<label>` where the model left them out) and record them in `saved[op.name]`
        under their labels, for the op's backward pass."""
        names = list(op.outputs) + [""] * (max(outputs) + 1 - len(op.outputs))
        for position, label in outputs.items():
            names[position] = names[position] or self.fresh(f"{op.name}_{label}")
        self.keep(op, outputs=names)
        self.saved[op.name] = {label: names[position] for position, label in outputs.items()}

    def rename(self, old: str, new: str) -> bool:
        """Give the output `old` of an emitted op the name `new`; False where it cannot be
        (not produced here, or already read by another op)."""
        op = self._producer.get(old)
        if op is None or old in self._read or new in self.tensors:
            return False
        op.outputs = [new if t == old else t for t in op.outputs]
        self.tensors[new] = dataclasses.replace(self.tensors.pop(old), name=new)
        self._producer[new] = self._producer.pop(old)
        self._taken.add(new)
        return True

    def _infer(self, op: Op) -> dict[str, tuple[tuple[int, ...], int]]:
        schema = onnx.defs.get_schema(op.op_type, self.opset, "")
        node = helper.make_node(op.op_type, op.inputs, op.outputs, name=op.name, **op.attributes)
        types, data = {}, {}
        for t in op.present_inputs:
            tensor = self.tensors[t]
            types[t] = helper.make_tensor_type_proto(tensor.dtype, tensor.shape)
            if tensor.data is not None and (tensor.dtype == TensorProto.INT64 or tensor.numel <= 16):
                data[t] = tensor.data
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node, types, data, opset_imports=[helper.make_opsetid("", self.opset)])
        result = {}
        for out in op.present_outputs:
            ttype = inferred[out].tensor_type if out in inferred else None
            if ttype is None or not ttype.HasField("shape") or any(
                    not d.HasField("dim_value") for d in ttype.shape.dim):
                raise RuntimeError(f"internal error: no static shape for '{out}' of {op.op_type} "
                                   f"'{op.name}' (inputs {[self.shape(t) for t in op.present_inputs]})")
            result[out] = (tuple(d.dim_value for d in ttype.shape.dim), ttype.elem_type)
        return result

    # ---- constants and state ----------------------------------------------------------
    def const(self, value, dtype=None) -> str:
        """A deduplicated initializer of kind `constant` holding `value`."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = self.fresh("memsched.const")
            self.tensors[name] = Tensor(name, array.shape, helper.np_dtype_to_tensor_dtype(array.dtype),
                                        "constant", numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values) -> str:
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar(self, value: float, like: str) -> str:
        """A 0-d constant with the dtype of tensor `like`."""
        return self.const(np.asarray(value, dtype=self.np_dtype(like)))

    def hyperparameter(self, name: str, value: float, like: str) -> str:
        """The 0-d initializer of kind `hyperparameter` holding `name` in the dtype of tensor
        `like`: `memsched.<name>` for float32, `memsched.<name>.<dtype>` for another dtype.
        A trainer writes it before each step; `value` is its compile-time value."""
        dtype = self.np_dtype(like)
        tensor = f"memsched.{name}" if dtype == np.float32 else f"memsched.{name}.{dtype.name}"
        if tensor not in self.tensors:
            if tensor in self._taken:
                raise ValueError(f"tensor name '{tensor}' is taken")
            self._taken.add(tensor)
            array = np.asarray(value, dtype=dtype)
            self.tensors[tensor] = Tensor(tensor, (), self.tensors[like].dtype, "hyperparameter",
                                          numpy_helper.from_array(array, tensor))
            self.hyperparameters.setdefault(name, []).append(tensor)
        return tensor

    def state(self, name: str, shape: tuple[int, ...], like: str) -> str:
        """A zero-initialised initializer of kind `optimizer_state`."""
        if name in self._taken:
            raise ValueError(f"tensor name '{name}' is taken")
        self._taken.add(name)
        zeros = np.zeros(shape, dtype=self.np_dtype(like))
        self.tensors[name] = Tensor(name, tuple(shape), self.tensors[like].dtype, "optimizer_state",
                                    numpy_helper.from_array(zeros, name))
        return name

    def add_input(self, name: str, shape: tuple[int, ...], dtype: int) -> str:
        self._taken.add(name)
        self.tensors[name] = Tensor(name, tuple(shape), dtype, "input")
        return name

    # ---- queries ----------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def rank(self, name: str) -> int:
        return len(self.tensors[name].shape)

    def dtype(self, name: str) -> int:
        return self.tensors[name].dtype

    def narrow_float(self, name: str) -> bool:
        """Whether `name` is a 16-bit float, whose sums and small constants rules take in float32."""
        return self.dtype(name) in HALF_TYPES

    def np_dtype(self, name: str) -> np.dtype:
        return helper.tensor_dtype_to_np_dtype(self.tensors[name].dtype)

    def value(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is known before running the graph, else None."""
        if not name:
            return None
        if name not in self._values:
            self._values[name] = self._fold(name)
        return self._values[name]

    def _fold(self, name: str) -> np.ndarray | None:
        t = self.tensors.get(name)
        if t is None:
            return None
        if t.data is not None:
            return tensor_value(t, self.source.base_dir) if t.numel <= _FOLD_LIMIT else None
        op = self.source.producer.get(name)
        if op is None:
            return None
        if op.op_type == "Constant":
            return _constant_value(op)
        if op.op_type == "Shape" and self.tensors[op.inputs[0]].shape is not None:
            shape = np.array(self.tensors[op.inputs[0]].shape, dtype=np.int64)
            return shape[op.attributes.get("start", 0):op.attributes.get("end", len(shape))]
        if op.op_type not in FOLDABLE_OPS or t.numel > _FOLD_LIMIT:
            return None
        inputs = [self.value(i) for i in op.present_inputs]
        if any(v is None for v in inputs):
            return None
        from onnx.reference import ReferenceEvaluator

        node = helper.make_node(op.op_type, op.inputs, op.outputs, **op.attributes)
        feeds = dict(zip(op.present_inputs, inputs))
        graph = helper.make_graph([node], "fold", [helper.make_tensor_value_info(n, self.tensors[n].dtype, None)
                                                   for n in feeds],
                                  [helper.make_tensor_value_info(o, 0, None) for o in op.present_outputs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        results = ReferenceEvaluator(model).run(None, feeds)
        return np.asarray(results[op.present_outputs.index(name)])

    # ---- helpers for rules ------------------------------------------------------------
    def reduce(self, op_type: str, x: str, axes, keepdims: bool) -> str:
        """ReduceSum/ReduceMean/... over `axes`, written the way this opset wants them."""
        axes = [int(a) for a in axes]
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.op(op_type, [x, self.ints(axes)], keepdims=int(keepdims))
        return self.op(op_type, [x], axes=axes, keepdims=int(keepdims))

    def mean_square(self, x: str, axes, keepdims: bool) -> str:
        """mean(x * x) over `axes`: `sum_square` / count."""
        rank = self.rank(x)
        count = int(np.prod([self.shape(x)[int(a) % rank] for a in axes]))
        return self.divide(self.sum_square(x, axes, keepdims), count)

    def sum_square(self, x: str, axes, keepdims: bool) -> str:
        """sum(x * x) over `axes` as ReduceSumSquare: x * x is never made (a normalisation's
        variance over a 4.7 GB map would otherwise hold a third such map).

        Where more than the last axis is reduced and the last one is (BatchNorm's N, H, W),
        the sum of squares runs over the last axis alone and a ReduceSum adds those partial
        sums up (a tensor 1/W of x's size): ONNX Runtime's ReduceSumSquare over several axes
        accumulates one element after another (relative error 1.5e-4 over 32 x 112 x 112
        values, against ~2e-7 so), and a variance off by that much shifts every normalised
        value of the forward pass, enough to flip max-pool argmaxes and ReLU masks against
        the exact step."""
        rank = self.rank(x)
        axes = sorted(int(a) + rank if int(a) < 0 else int(a) for a in axes)
        if len(axes) > 1 and axes[-1] == rank - 1:
            partial = self.reduce("ReduceSumSquare", x, [rank - 1], keepdims=True)
            return self.reduce("ReduceSum", partial, axes, keepdims)
        return self.reduce("ReduceSumSquare", x, axes, keepdims)

    def total(self, parts: list[str]) -> str:
        """The sum of same-shaped tensors, added one after another (the chunks' partial sums)."""
        result = parts[0]
        for part in parts[1:]:
            result = self.op("Add", [result, part])
        return result

    def divide(self, x: str, count: float) -> str:
        """x / count, for a mean's count (or another constant that is exact in x's dtype): a
        Div by the count itself, not a Mul by 1 / count rounded to x's dtype. 1 / 51200 in
        float32 is off by up to 3e-8 of itself, so a step run in float64 from the float32
        graph (memsched.numerics) would take a mean that is not the mean: BatchNorm's input
        gradient then sums to ~1e-7 of its terms instead of 0, and a gradient that is zero in
        exact arithmetic (a bias before a BatchNorm) could not be told from a wrong one. Where
        the dtype does not hold `count` exactly (a float16 count over 2048), Mul by 1 / count."""
        dtype = self.np_dtype(x)
        with np.errstate(over="ignore"):
            exact = float(np.asarray(count, dtype=dtype)) == float(count)
        if exact:
            return self.op("Div", [x, self.scalar(count, x)])
        return self.op("Mul", [x, self.scalar(1 / count, x)])

    def reshape(self, x: str, shape) -> str:
        shape = tuple(int(d) for d in shape)
        return x if self.shape(x) == shape else self.op("Reshape", [x, self.ints(shape)])

    def transpose(self, x: str, perm) -> str:
        """Transpose x; a Reshape (a view, no copy) where only size-1 axes move, as in a
        conv weight gradient's [N, C, ...] -> [C, N, ...] at batch 1."""
        perm = [int(p) for p in perm]
        if perm == sorted(perm):
            return x
        shape = self.shape(x)
        if moves_only_unit_axes(shape, perm):
            return self.reshape(x, [shape[a] for a in perm])
        return self.op("Transpose", [x], perm=perm)

    def regroup(self, x: str, split, perm, merged) -> str:
        """Reshape x to `split`, transpose by `perm`, reshape to `merged`: one Reshape where the
        transpose moves only size-1 axes (a chain of copies the planner could not undo)."""
        if moves_only_unit_axes(split, perm):
            return self.reshape(x, merged)
        return self.reshape(self.transpose(self.reshape(x, split), perm), merged)

    def sum_to(self, g: str, shape) -> str:
        """Sum the gradient `g` of a broadcast result back to an input of shape `shape`."""
        shape = tuple(shape)
        have = self.shape(g)
        if have == shape:
            return g
        lead = len(have) - len(shape)
        inner = [lead + i for i, d in enumerate(shape) if d == 1 and have[lead + i] != 1]
        axes = list(range(lead)) + inner
        if not axes:
            return self.reshape(g, shape)
        if not inner:
            return self.reduce("ReduceSum", g, axes, keepdims=False)
        return self.reshape(self.reduce("ReduceSum", g, axes, keepdims=True), shape)

    def zeros(self, shape, like: str) -> str:
        """A zero tensor made at run time (ConstantOfShape), with the dtype of `like`."""
        zero = numpy_helper.from_array(np.zeros(1, dtype=self.np_dtype(like)), "value")
        return self.op("ConstantOfShape", [self.ints(shape)], value=zero)

    def scatter_add(self, op_type: str, data: str, indices: str, updates: str, **attributes) -> str:
        """`op_type` (ScatterElements or ScatterND) with reduction=add. 16-bit floats add in
        float32 -- ONNX Runtime's CPU provider has no float16 kernel for the add, and a float32
        sum of many updates loses less -- and only the result comes back to the data's dtype."""
        if not self.narrow_float(data):
            return self.op(op_type, [data, indices, updates], reduction="add", **attributes)
        dtype = self.dtype(data)
        data, updates = (self.op("Cast", [t], to=TensorProto.FLOAT) for t in (data, updates))
        return self.op("Cast", [self.op(op_type, [data, indices, updates], reduction="add", **attributes)], to=dtype)

    def emitted_since(self, index: int) -> list[Op]:
        return self.ops[index:]


def moves_only_unit_axes(shape, perm) -> bool:
    """Whether transposing `shape` by `perm` keeps the order of its axes longer than 1 (then
    the transpose is a reshape: no element moves in memory)."""
    return [a for a in perm if shape[a] != 1] == [a for a in range(len(perm)) if shape[a] != 1]


def _constant_value(op: Op) -> np.ndarray | None:
    attrs = op.attributes
    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    if "value_float" in attrs:
        return np.asarray(attrs["value_float"], dtype=np.float32)
    if "value_floats" in attrs:
        return np.asarray(attrs["value_floats"], dtype=np.float32)
    if "value_int" in attrs:
        return np.asarray(attrs["value_int"], dtype=np.int64)
    if "value_ints" in attrs:
        return np.asarray(attrs["value_ints"], dtype=np.int64)
    return None
