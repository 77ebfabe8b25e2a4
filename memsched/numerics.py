"""How far a training step's float32 gradients are from the same step run in float64.

`check(step)` runs one training step twice on the same inputs and weights: as it is, with
ONNX Runtime's CPU provider, and cast to double (`double_graph`: every float tensor,
initializer, constant and Cast target made DOUBLE). Per parameter it reports the relative
error of the gradient `<param>.grad` (a step built with optimizer none) or of the update
`<param>.updated - <param>` (a step with an optimizer):

    error = max |g32 - g64| / max |g64|

sorted worst first. The float64 run is the reference: an unstable formulation (a
cancellation, a badly ordered reduction) shows up as an error far above float32's rounding
(1e-7 per operation, ~1e-5..1e-4 over a deep network's backward pass), where a wrong
formula would show up in both runs alike (finite differences catch that).

The float64 run takes the float32 run's branch decisions (`decisions`: ReLU and Clip masks,
MaxPool argmaxes, fed to it rather than recomputed): an activation within rounding error of
a kink would otherwise send the two runs down different pieces of the step, a difference
no float32 arithmetic avoids (see `decisions`); `check(pin=False)` compares without them.

A gradient that is zero in exact arithmetic (a BatchNorm bias followed by a convolution and
another BatchNorm: the second one's input gradient sums to zero per channel) is in float64
at most `ZERO_GRADIENT` of the step's largest gradient (~1e-18 of it: the training step
divides its means by their counts, constants that float64 holds exactly); its float32 value
is rounding noise, so its error is taken relative to the step's largest gradient instead
(`zero` in the row).

ONNX Runtime's CPU provider has no double kernels for some ops (Conv, ConvTranspose,
AveragePool, GlobalAveragePool, Erf in 1.31; LayerNormalization computes in float32 inside):
`run_double` runs the double graph in segments, each maximal run of ops ONNX Runtime takes
in one session, the others with ONNX's reference evaluator (numpy, float64 throughout).
LayerNormalization is written out in primitive ops in the double graph, so its statistics
are float64 too.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .dtypes import FLOAT_TYPES
from .errors import UserError
from .measure import prepare_inputs, require_host_memory
from .memory import analyze
from .schedule import default_schedule
from .ir import Graph, Op, Tensor, tensor_value
from .measure import single_op_model
from .ort import make_session

ZERO_GRADIENT = 1e-9   # float64 gradients this far below the largest are zero in exact arithmetic


@dataclasses.dataclass
class Row:
    """One parameter's comparison: what was compared ("grad" or "update"), its relative
    error, the largest absolute error and the float64 scale it is relative to."""
    param: str
    compared: str
    error: float
    max_abs_error: float
    scale: float
    zero: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- the comparison -------------------------------------------------------------------------
def compared_outputs(step: Graph) -> dict[str, tuple[str, str]]:
    """output -> (parameter, "grad" | "update") for a training step's gradient or update
    outputs (`<param>.grad`, `<param>.updated` of a parameter; optimizer states are left out)."""
    result = {}
    for out in step.outputs:
        for suffix, compared in ((".grad", "grad"), (".updated", "update")):
            base = out[: -len(suffix)]
            if out.endswith(suffix) and base in step.tensors and step.tensors[base].kind == "parameter":
                result[out] = (base, compared)
    if not result:
        raise UserError("the graph has no <param>.grad or <param>.updated output: build it as a training "
                        "step first (memsched train-graph)")
    return result


def check(step: Graph, feeds: dict[str, np.ndarray] | None = None, *, seed: int = 0,
          threads: int = 0, pin: bool = True) -> list[Row]:
    """The float32-vs-float64 table of `step` (see the module doc), worst parameter first.

    `feeds`: the step's inputs (made up from `seed` where left out, as the executor does).
    `pin`: the float64 run takes the float32 run's branch decisions (`decisions`), so that
    both differentiate the same piece of the piecewise-smooth step; with pin=False it makes
    its own."""
    # the float64 run holds each float value at twice its bytes: at least the step's own peak
    require_host_memory(2 * analyze(step, default_schedule(step)).peak_bytes, "the float64 check of the step")
    feeds = prepare_inputs(step, feeds, seed=seed)
    compared = compared_outputs(step)
    names = list(compared)
    pinned = decisions(step) if pin else []
    wanted = names + [t for t in pinned if t not in compared]
    low = dict(zip(wanted, make_session(step.replace(outputs=list(dict.fromkeys(step.outputs + wanted))).to_onnx(),
                                        "cpu", threads).run(wanted, feeds)))
    double = pinned_graph(double_graph(step), pinned)
    high_feeds = {k: _widened(v) for k, v in feeds.items()} | {t: low[t] for t in pinned}
    high = run_double(double, high_feeds, names, threads=threads)
    diffs = {}
    for out, (param, kind) in compared.items():
        a, b = low[out].astype(np.float64), high[out]
        if kind == "update":
            a = a - tensor_value(step.tensors[param], step.base_dir).astype(np.float64)
            b = b - tensor_value(double.tensors[param], double.base_dir)
        diffs[out] = (a, b)
    top = max((float(np.abs(b).max()) for _, b in diffs.values() if b.size), default=0.0)
    rows = []
    for out, (a, b) in diffs.items():
        scale = float(np.abs(b).max()) if b.size else 0.0
        zero = scale <= ZERO_GRADIENT * top
        worst = float(np.abs(a - b).max()) if b.size else 0.0
        reference = top if zero else scale
        error = worst / reference if reference > 0 else (0.0 if worst == 0 else math.inf)
        if not np.all(np.isfinite(a)):
            error = math.inf
        rows.append(Row(compared[out][0], compared[out][1], error, worst, scale, zero))
    rows.sort(key=lambda r: (-r.error, r.param))
    return rows


def decisions(step: Graph) -> list[str]:
    """The step's branch decisions: every non-float tensor an op computes from a float one
    (ReLU and Clip masks, MaxPool's argmax indices, comparisons, Dropout masks).

    The step is piecewise smooth and these pick the piece. Where an activation lies within
    rounding error of a kink (a ReLU input within 1e-5 of 0 after a deep forward pass), the
    float32 and float64 runs can take different pieces, and a gradient that sums over few
    positions (BatchNorm over 16 values at ResNet-50's last stage at 64 px, batch 4) then
    differs by ~1/4 in exact arithmetic too: rounding only the forward convolutions' outputs
    to float32 and computing all else in float64 does the same. Both one-sided gradients are
    right; the float64 run, given the float32 run's decisions, differentiates the same piece,
    and what remains is the formulation's rounding error."""
    floats = {name for name, t in step.tensors.items() if t.dtype in FLOAT_TYPES}
    return [t for op in step.ops if any(i in floats for i in op.present_inputs)
            for t in op.present_outputs if t not in floats]


def pinned_graph(graph: Graph, pinned: list[str]) -> Graph:
    """`graph` with the tensors `pinned` made inputs, fed rather than computed: an op whose
    outputs are all pinned is left out, another writes its pinned outputs under new names."""
    if not pinned:
        return graph
    pinned_set = set(pinned)
    tensors = dict(graph.tensors)
    ops = []
    for op in graph.ops:
        present = op.present_outputs
        if present and all(t in pinned_set for t in present):
            continue
        outputs = list(op.outputs)
        for i, t in enumerate(outputs):
            if t in pinned_set:
                outputs[i] = f"{t}/unpinned"
                tensors[outputs[i]] = dataclasses.replace(tensors[t], name=outputs[i])
        ops.append(dataclasses.replace(op, outputs=outputs) if outputs != op.outputs else op)
    for t in pinned:
        tensors[t] = dataclasses.replace(tensors[t], kind="input", data=None)
    return graph.replace(ops=ops, tensors=tensors, inputs=list(graph.inputs) + [t for t in pinned
                                                                             if t not in graph.inputs])


def _widened(value: np.ndarray) -> np.ndarray:
    value = np.asarray(value)
    return value.astype(np.float64) if value.dtype.kind == "f" else value


# ---- the float64 graph ----------------------------------------------------------------------
def double_graph(graph: Graph) -> Graph:
    """`graph` with every float tensor, initializer, Constant value and Cast/dtype target made
    DOUBLE, LayerNormalization written out in primitive ops (ONNX Runtime computes it in
    float32 whatever the input type)."""
    tensors = {}
    for name, t in graph.tensors.items():
        if t.dtype not in FLOAT_TYPES:
            tensors[name] = t
            continue
        data = t.data
        if data is not None:
            data = numpy_helper.from_array(tensor_value(t, graph.base_dir).astype(np.float64), name)
        tensors[name] = dataclasses.replace(t, dtype=TensorProto.DOUBLE, data=data)
    opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 17))
    ops: list[Op] = []
    for op in graph.ops:
        if op.op_type == "LayerNormalization" and op.domain in ("", "ai.onnx"):
            ops += _layer_norm_ops(op, tensors, opset)
        else:
            ops.append(dataclasses.replace(op, attributes={k: _double_attribute(op, k, v)
                                                           for k, v in op.attributes.items()}))
    return graph.replace(ops=ops, tensors=tensors, metadata={})


def _double_tensor(value: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(value).astype(np.float64), value.name)


def _double_attribute(op: Op, key: str, value):
    if isinstance(value, TensorProto) and value.data_type in FLOAT_TYPES:
        return _double_tensor(value)
    if isinstance(value, onnx.GraphProto):                  # an If's branch, a Loop's or Scan's body
        return _double_subgraph(value)
    if isinstance(value, list) and value and all(isinstance(v, onnx.GraphProto) for v in value):
        return [_double_subgraph(v) for v in value]
    if key in ("to", "dtype") and value in FLOAT_TYPES and op.op_type != "QuantizeLinear":
        return TensorProto.DOUBLE
    if op.op_type == "Constant" and key in ("value_float", "value_floats"):
        raise UserError(f"Constant '{op.name}' holds a float attribute {key}; write it as a tensor value")
    return value


def _double_subgraph(graph: onnx.GraphProto) -> onnx.GraphProto:
    """A subgraph with its float values made DOUBLE as `double_graph` makes the graph's: its
    inputs, outputs and value types, its initializers, and its nodes' attributes (nested
    subgraphs too): the branches of an If then return what the float64 graph around them reads."""
    double = onnx.GraphProto()
    double.CopyFrom(graph)
    for info in (*double.input, *double.output, *double.value_info):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type in FLOAT_TYPES:
            info.type.tensor_type.elem_type = TensorProto.DOUBLE
    for init in double.initializer:
        if init.data_type in FLOAT_TYPES:
            init.CopyFrom(_double_tensor(init))
    for node in double.node:
        op = Op(node.name, node.op_type, list(node.input), list(node.output), {}, node.domain)
        for attribute in node.attribute:
            value = _double_attribute(op, attribute.name, helper.get_attribute_value(attribute))
            attribute.CopyFrom(helper.make_attribute(attribute.name, value, attr_type=attribute.type))
    return double


def _layer_norm_ops(op: Op, tensors: dict[str, Tensor], opset: int) -> list[Op]:
    """y = (x - mean) * inv_std * scale + bias over the axes from `axis` on; Mean and
    InvStdDev outputs, where present, are the float64 statistics."""
    x, scale = op.inputs[:2]
    bias = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2] else ""
    shape = tensors[x].shape
    rank = len(shape)
    axis = op.attributes.get("axis", -1)
    axes = list(range(axis + rank if axis < 0 else axis, rank))
    stat_shape = tuple(1 if i in axes else d for i, d in enumerate(shape))
    outputs = list(op.outputs) + [""] * (3 - len(op.outputs))
    ops: list[Op] = []
    base = f"{op.name}/double"

    def new(kind: str, shape_, value=None) -> str:
        name = f"{base}/{kind}"
        while name in tensors:
            name += "_"
        data = None if value is None else numpy_helper.from_array(value, name)
        dtype = TensorProto.INT64 if value is not None and value.dtype == np.int64 else TensorProto.DOUBLE
        tensors[name] = Tensor(name, tuple(shape_), dtype, "constant" if value is not None else "activation", data)
        return name

    def emit(op_type: str, inputs: list[str], out: str, **attrs) -> str:
        ops.append(Op(f"{base}/{op_type}_{len(ops)}", op_type, inputs, [out], attrs, phase=op.phase))
        return out

    def mean_of(value: str, kind: str) -> str:
        out = outputs[1] if kind == "mean" and outputs[1] else new(kind, stat_shape)
        if opset >= 18:
            return emit("ReduceMean", [value, new("axes", (len(axes),), np.asarray(axes, np.int64))], out,
                        keepdims=1)
        return emit("ReduceMean", [value], out, axes=axes, keepdims=1)

    mean = mean_of(x, "mean")
    centred = emit("Sub", [x, mean], new("centred", shape))
    var = mean_of(emit("Mul", [centred, centred], new("square", shape)), "var")
    eps = new("eps", (), np.asarray(op.attributes.get("epsilon", 1e-5), np.float64))
    std = emit("Sqrt", [emit("Add", [var, eps], new("var_eps", stat_shape))], new("std", stat_shape))
    inv_std = emit("Reciprocal", [std], outputs[2] or new("inv_std", stat_shape))
    normalised = emit("Mul", [centred, inv_std], new("xhat", shape))
    scaled = emit("Mul", [normalised, scale], outputs[0] if not bias else new("scaled", shape))
    if bias:
        emit("Add", [scaled, bias], outputs[0])
    return ops


# ---- running the float64 graph --------------------------------------------------------------
def run_double(graph: Graph, feeds: dict[str, np.ndarray], outputs: list[str] | None = None, *,
               threads: int = 0) -> dict[str, np.ndarray]:
    """Run `graph` (a `double_graph`) on `feeds`: maximal runs of ops ONNX Runtime's CPU
    provider has kernels for as one session each, the other ops with ONNX's reference
    evaluator. Returns `outputs` (default: the graph outputs) by name."""
    outputs = list(outputs or graph.outputs)
    values = {t.name: tensor_value(t, graph.base_dir) for t in graph.initializers()}
    values.update(feeds)
    runs_in_ort: dict[tuple, bool] = {}
    segments: list[tuple[bool, list[Op]]] = []
    for op in graph.ops:
        ort = _ort_runs(op, graph, runs_in_ort)
        if segments and segments[-1][0] == ort:
            segments[-1][1].append(op)
        else:
            segments.append((ort, [op]))
    last_read: dict[str, int] = {}
    for index, (_, ops) in enumerate(segments):
        for op in ops:
            for t in op.present_inputs:
                last_read[t] = index
    wanted = set(outputs)
    for index, (ort, ops) in enumerate(segments):
        produced = [t for op in ops for t in op.present_outputs]
        made = set(produced)
        needed = [t for t in produced if t in wanted or last_read.get(t, -1) > index]
        if not needed:
            continue
        reads = list(dict.fromkeys(t for op in ops for t in op.present_inputs if t not in made))
        tensors = {t: dataclasses.replace(graph.tensors[t], data=None, kind="input") for t in reads}
        tensors.update({t: graph.tensors[t] for t in made})
        part = graph.replace(ops=ops, tensors=tensors, inputs=reads, outputs=needed, metadata={})
        feeds_here = {t: values[t] for t in reads}
        if ort:
            results = make_session(part.to_onnx(), "cpu", threads).run(needed, feeds_here)
        else:
            results = _reference(part.to_onnx()).run(needed, feeds_here)
        values.update(zip(needed, (np.asarray(r) for r in results)))
        for t in reads:
            if last_read.get(t) == index and t not in wanted and t not in feeds:
                values.pop(t, None)
    return {name: values[name] for name in outputs}


def _reference(model: onnx.ModelProto):
    """ONNX's reference evaluator, with a vectorised ConvTranspose (its own loops over every
    output element take minutes on a backward pass's input gradients)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops import op_conv_transpose

    class ConvTranspose(op_conv_transpose.ConvTranspose):   # the evaluator matches ops by class name
        op_domain = ""

        def _run(self, x, w, b=None, auto_pad=None, dilations=None, group=None, kernel_shape=None,
                 output_padding=None, output_shape=None, pads=None, strides=None):
            if _text(auto_pad or "NOTSET") != "NOTSET" or output_shape:
                return super()._run(x, w, b, auto_pad=auto_pad, dilations=dilations, group=group,
                                    kernel_shape=kernel_shape, output_padding=output_padding,
                                    output_shape=output_shape, pads=pads, strides=strides)
            return (conv_transpose(x, w, b, group=group or 1, strides=strides, dilations=dilations, pads=pads,
                                   output_padding=output_padding),)

    return ReferenceEvaluator(model, new_ops=[ConvTranspose])


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def conv_transpose(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *, group: int = 1,
                   strides=None, dilations=None, pads=None, output_padding=None) -> np.ndarray:
    """ONNX ConvTranspose with explicit pads, in numpy: per kernel offset, one grouped
    product of x with that tap of w, added into the strided output positions it reaches."""
    n, cin, *spatial = x.shape
    kernel = list(w.shape[2:])
    dims = len(kernel)
    strides = list(strides or [1] * dims)
    dilations = list(dilations or [1] * dims)
    pads = list(pads or [0] * (2 * dims))
    output_padding = list(output_padding or [0] * dims)
    cog = w.shape[1]
    full = [strides[i] * (spatial[i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
            for i in range(dims)]
    out = np.zeros([n, group, cog] + full, dtype=np.result_type(x, w))
    xg = x.reshape([n, group, cin // group] + spatial)
    wg = w.reshape([group, cin // group, cog] + kernel)
    for tap in np.ndindex(*kernel):
        contribution = np.einsum("ngc...,gco->ngo...", xg, wg[(slice(None),) * 3 + tap])
        where = tuple(slice(tap[i] * dilations[i], tap[i] * dilations[i] + strides[i] * (spatial[i] - 1) + 1,
                            strides[i]) for i in range(dims))
        out[(slice(None),) * 3 + where] += contribution
    out = out.reshape([n, group * cog] + full)
    crop = tuple(slice(pads[i], full[i] - pads[dims + i]) for i in range(dims))
    out = out[(slice(None), slice(None)) + crop]
    if b is not None:
        out = out + b.reshape([1, -1] + [1] * dims)
    return np.ascontiguousarray(out)


def _ort_runs(op: Op, graph: Graph, cache: dict[tuple, bool]) -> bool:
    """Whether ONNX Runtime's CPU provider has a kernel for `op` with its input types
    (tried once per op type and type signature, on a one-node model)."""
    key = (op.domain, op.op_type, tuple(graph.tensors[t].dtype for t in op.present_inputs))
    if key not in cache:
        light = {t: dataclasses.replace(graph.tensors[t], data=None, kind="input") if graph.tensors[t].is_static
                 else graph.tensors[t] for t in op.present_inputs}
        probe = graph.replace(tensors={**graph.tensors, **light})
        try:
            model, _ = single_op_model(op, probe)
            onnx.checker.check_model(model)
            make_session(model, "cpu", 1)
            cache[key] = True
        except (UserError, onnx.checker.ValidationError):
            cache[key] = False
    return cache[key]


# ---- presentation ---------------------------------------------------------------------------
def format_rows(rows: list[Row], top: int | None = None) -> str:
    """The table as text, worst first (`top` rows)."""
    shown = rows if top is None else rows[:top]
    width = max([len(r.param) for r in shown] + [9])
    lines = [f"{'parameter':<{width}}  {'compared':<8}  {'rel. error':>10}  {'max |diff|':>10}  {'max |g64|':>10}"]
    for r in shown:
        note = "  (zero in exact arithmetic: relative to the largest)" if r.zero else ""
        lines.append(f"{r.param:<{width}}  {r.compared:<8}  {r.error:>10.3e}  {r.max_abs_error:>10.3e}  "
                     f"{r.scale:>10.3e}{note}")
    return "\n".join(lines)
