"""The cost model: how long one op takes, from a roofline on a Hardware or from a measured table.

Roofline: every op has an op class, a FLOP count and the bytes it moves (each input read
once, each output written once; gathers read only the rows they fetch). On a profile,

    time = max(flops / effective FLOP/s, bytes / effective bandwidth) + launch overhead

where the effective figures are the profile's calibrated per-class values if it has them
(the measured `cpu` profile), else the peak for the op's dtype and the device bandwidth.
Shape-only ops (Reshape, Squeeze, Shape, Identity, Constant, ...) launch no kernel: time 0.

FLOPs (one multiply-add = 2):
  Conv           2 * |Y| * (C_in/group * prod(kernel))  (+ |Y| with a bias)
  ConvTranspose  2 * |X| * (C_out/group * prod(kernel)) (+ |Y| with a bias)
  Gemm           2 * M * N * K (+ M * N with C);  MatMul (batched, broadcast) 2 * |Y| * K
  elementwise    |Y| (largest output);  reductions |X|;  pooling |Y| * prod(kernel), global |X|
  normalisation  2 |X| (BatchNorm, inference), 5 |X| otherwise (mean, var, normalise, affine)
  Softmax        4 |X| (max, exp, sum, divide);  gathers, scatters, copies and shape ops 0

Measured: a `CostTable` (written by `memsched profile`, see memsched.measure) maps each op
name to seconds, and each op signature (type, attributes, input shapes/dtypes) to seconds so
a table also prices ops it was not made from but that match one it timed.

`op_time(op, graph, source)` is the one entry point: source is a Hardware or a CostTable.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import UserError
from .hardware import Hardware
from .ir import Graph, Op, tensor_value
from .onnx_utils import write_text_atomic

SHAPE_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Shape", "Size", "Identity", "Constant"})
TRANSCENDENTAL_OPS = frozenset({
    "Exp", "Log", "Tanh", "Sigmoid", "Erf", "Pow", "Softplus", "Softsign", "Elu", "Selu", "Celu", "Gelu",
    "HardSwish", "Mish", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
})
ELEMENTWISE_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "ThresholdedRelu", "HardSigmoid",
    "Clip", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Max", "Min", "Sum", "Mean", "Where",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "Cast",
    "CastLike", "Dropout", "IsNaN", "IsInf", "Mod", "BitShift", "Shrink",
}) | TRANSCENDENTAL_OPS
REDUCTION_OPS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                           "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
                           "CumSum"})
POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
NORM_OPS = frozenset({"BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
                      "LpNormalization", "MeanVarianceNormalization"})
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax", "SoftmaxCrossEntropyLoss"})
GATHER_OPS = frozenset({"Gather", "GatherElements", "GatherND", "Scatter", "ScatterElements", "ScatterND",
                        "NegativeLogLikelihoodLoss", "OneHot"})
DATA_OPS = frozenset({"Transpose", "Concat", "Split", "Slice", "Pad", "Expand", "Tile", "Resize", "Upsample",
                      "DepthToSpace", "SpaceToDepth", "ConstantOfShape", "Range", "Trilu", "EyeLike"})
# The classes a calibrated profile may carry its own figures for.
OP_CLASSES = ("conv", "conv_grouped", "gemm", "elementwise", "transcendental", "reduction", "pool", "norm",
              "softmax", "gather", "data", "shape", "other")


@dataclass(frozen=True)
class OpCost:
    op_class: str
    flops: int
    bytes: int
    dtype: str      # numpy name of the dtype the arithmetic runs in


def op_class(op: Op) -> str:
    t = op.op_type
    if op.domain not in ("", "ai.onnx"):
        return "other"
    if t in ("Conv", "ConvTranspose"):
        return "conv" if int(op.attributes.get("group", 1)) == 1 else "conv_grouped"
    if t in ("Gemm", "MatMul", "MatMulInteger"):
        return "gemm"
    if t in SHAPE_OPS:
        return "shape"
    if t in TRANSCENDENTAL_OPS:
        return "transcendental"
    for cls, ops in (("elementwise", ELEMENTWISE_OPS), ("reduction", REDUCTION_OPS), ("pool", POOL_OPS),
                     ("norm", NORM_OPS), ("softmax", SOFTMAX_OPS), ("gather", GATHER_OPS), ("data", DATA_OPS)):
        if t in ops:
            return cls
    return "other"


def op_cost(op: Op, graph: Graph) -> OpCost:
    """The op's class, FLOPs and bytes moved (see the module docstring for the formulas)."""
    cls = op_class(op)
    ins = [graph.tensors[n] for n in op.present_inputs]
    outs = [graph.tensors[n] for n in op.present_outputs]
    dtype = _arith_dtype(ins, outs)
    if cls == "shape":
        return OpCost(cls, 0, 0, dtype)
    numel_out = max((t.numel for t in outs), default=0)
    numel_in = ins[0].numel if ins else 0
    t = op.op_type
    if t == "Conv":
        w = ins[1].shape
        flops = 2 * outs[0].numel * math.prod(w[1:]) + (outs[0].numel if len(ins) > 2 else 0)
    elif t == "ConvTranspose":
        w = ins[1].shape
        flops = 2 * ins[0].numel * math.prod(w[1:]) + (outs[0].numel if len(ins) > 2 else 0)
    elif t == "Gemm":
        a = ins[0].shape
        k = a[0] if op.attributes.get("transA", 0) else a[1]
        flops = 2 * outs[0].numel * k + (outs[0].numel if len(ins) > 2 else 0)
    elif t in ("MatMul", "MatMulInteger"):
        k = ins[0].shape[-1]
        flops = 2 * outs[0].numel * k
    elif cls in ("elementwise", "transcendental", "other"):
        flops = numel_out
    elif cls == "reduction":
        flops = numel_in
    elif cls == "pool":
        kernel = op.attributes.get("kernel_shape")
        flops = numel_out * math.prod(kernel) if kernel else numel_in
    elif cls == "norm":
        flops = (2 if t == "BatchNormalization" and len(outs) == 1 else 5) * numel_in
    elif cls == "softmax":
        flops = 4 * numel_in
    else:                   # gather, data: copies, no arithmetic
        flops = 0
    return OpCost(cls, int(flops), _bytes_moved(op, cls, ins, outs), dtype)


def _bytes_moved(op: Op, cls: str, ins, outs) -> int:
    out_bytes = sum(t.nbytes for t in outs)
    if op.op_type in ("Gather", "GatherElements", "GatherND"):
        # reads the fetched rows (as many bytes as it writes) and the indices, not the whole table
        return sum(t.nbytes for t in ins[1:]) + 2 * out_bytes
    if op.op_type == "Slice":
        return sum(t.nbytes for t in ins[1:]) + 2 * out_bytes
    return sum(t.nbytes for t in ins) + out_bytes


def _arith_dtype(ins, outs) -> str:
    for t in (*ins, *outs):
        if t.dtype in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                       onnx.TensorProto.DOUBLE):
            return _dtype_name(t.dtype)
    return _dtype_name(outs[0].dtype) if outs else "float32"


def _dtype_name(dtype: int) -> str:
    if dtype == onnx.TensorProto.BFLOAT16:
        return "bfloat16"    # numpy has no bfloat16; onnx maps it to uint16
    return onnx.helper.tensor_dtype_to_np_dtype(dtype).name


def roofline_time(op: Op, graph: Graph, hw: Hardware) -> float:
    c = op_cost(op, graph)
    if c.op_class == "shape":
        return 0.0
    return max(c.flops / hw.flops_for(c.op_class, c.dtype), c.bytes / hw.bandwidth_for(c.op_class)) \
        + hw.launch_overhead


# ---- measured costs ----------------------------------------------------------------------
@dataclass
class CostTable:
    """Measured seconds per op (by name) and per op signature; `meta` says how it was measured."""

    times: dict[str, float]
    by_signature: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def time(self, op: Op, graph: Graph) -> float:
        if op.name in self.times:
            return self.times[op.name]
        sig = signature(op, graph)
        if sig in self.by_signature:
            return self.by_signature[sig]
        raise UserError(f"the cost table has no time for op '{op.name}' ({op.op_type}); "
                        f"profile this graph with `memsched profile`")

    def total(self) -> float:
        return sum(self.times.values())

    def to_dict(self) -> dict:
        return {"format": "memsched-costs", "version": 1, **self.meta, "times": self.times,
                "by_signature": self.by_signature}

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"no such cost table: {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path} is not a readable cost table: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != "memsched-costs":
            raise UserError(f"{path} is not a memsched cost table (write one with `memsched profile`)")
        times = _seconds_table(data.get("times", {}), "times", path)
        by_sig = _seconds_table(data.get("by_signature", {}), "by_signature", path)
        meta = {k: v for k, v in data.items() if k not in ("format", "version", "times", "by_signature")}
        return cls(times, by_sig, meta)


MAX_OP_SECONDS = 3600.0    # an op timed longer than an hour is a broken table, and sums of such overflow


def _seconds_table(value, key: str, path: Path) -> dict[str, float]:
    """A cost table's `key` entry: names to finite, non-negative seconds (no strings, bools or NaN)."""
    if not isinstance(value, dict):
        raise UserError(f"{path}: '{key}' must be a table of op name -> seconds")
    table = {}
    for name, seconds in value.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not 0 <= seconds <= MAX_OP_SECONDS:      # NaN fails both comparisons
            raise UserError(f"{path}: {key}['{name}'] must be seconds from 0 to {MAX_OP_SECONDS:g}, "
                            f"not {seconds!r}")
        table[str(name)] = float(seconds)
    return table


def op_time(op: Op, graph: Graph, source: "Hardware | CostTable") -> float:
    """Seconds `op` takes: measured if `source` is a CostTable, else the roofline on `source`."""
    if isinstance(source, CostTable):
        return source.time(op, graph)
    return roofline_time(op, graph, source)


# ---- signatures --------------------------------------------------------------------------
SMALL_CONSTANT = 64   # elements: constant inputs up to this size (shapes, axes) enter the signature


def signature(op: Op, graph: Graph) -> str:
    """What determines an op's run time: domain, type, attributes, input shapes and dtypes, which
    inputs are constants, and the values of small non-float constants (shapes, axes, pads).
    Same signature, same time."""
    inputs = []
    for name in op.inputs:
        if not name:
            inputs.append(None)
            continue
        t = graph.tensors[name]
        entry = [list(t.shape), int(t.dtype), t.is_static]
        if t.is_static and t.numel <= SMALL_CONSTANT and not _is_float_dtype(t.dtype):
            entry.append(np.asarray(tensor_value(t, graph.base_dir)).ravel().tolist())
        inputs.append(entry)
    attrs = {k: _jsonable(v) for k, v in sorted(op.attributes.items())}
    return json.dumps([op.domain, op.op_type, attrs, inputs], sort_keys=True, separators=(",", ":"))


def _is_float_dtype(dtype: int) -> bool:
    return dtype in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                     onnx.TensorProto.DOUBLE)


def _jsonable(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, onnx.TensorProto):
        array = numpy_helper.to_array(value)
        if array.size <= SMALL_CONSTANT:
            return {"dtype": int(value.data_type), "value": array.ravel().tolist(), "dims": list(value.dims)}
        return {"dtype": int(value.data_type), "dims": list(value.dims),
                "sha1": hashlib.sha1(value.SerializeToString()).hexdigest()}
    if isinstance(value, (onnx.GraphProto, onnx.SparseTensorProto, onnx.TypeProto)):
        return {"sha1": hashlib.sha1(value.SerializeToString()).hexdigest()}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value
