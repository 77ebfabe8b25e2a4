"""The IR: Tensor, Op and Graph, lowered from ONNX and emitted back without loss.

A Graph keeps its ops in a list whose order is the default schedule, a dict of tensors,
and derives the rest (producers, consumers, a networkx DiGraph of ops with the tensors on
the edges). Passes build new graphs with `Graph.replace`; nothing mutates a graph in place.

memsched's own annotations (each tensor's kind, each op's phase) survive a round trip
through ONNX in `metadata_props` under the keys `memsched.kinds` and `memsched.phases`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable

import networkx as nx
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import dtypes
from .errors import UserError
from .onnx_utils import IR_VERSION, OPSET

TENSOR_KINDS = ("input", "parameter", "buffer", "activation", "gradient", "param_grad",
                "optimizer_state", "hyperparameter", "output", "constant")
PHASES = ("forward", "loss", "backward", "update")
# Tensors backed by an initializer stay resident for the whole step (docs/design.md, the memory model).
STATIC_KINDS = ("parameter", "buffer", "optimizer_state", "hyperparameter", "constant")
# Static tensors no op of the step overwrites: constants, and hyperparameters (a trainer
# writes them before each step; every update of the step reads the same value).
FIXED_KINDS = ("hyperparameter", "constant")

_KINDS_KEY = "memsched.kinds"
_PHASES_KEY = "memsched.phases"


def metadata_json(text: str, key: str, valid: Callable[[Any], bool], what: str):
    """The JSON value of metadata field `key`, when `valid` accepts it; else a UserError that
    names the field and says what it must be (the one reader of memsched.* metadata)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    else:
        try:
            if valid(value):
                return value
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            pass
    raise metadata_error(key, what)


def metadata_error(key: str, what: str) -> UserError:
    """The error for a memsched.* metadata field that is not `what`."""
    return UserError(f"the model's metadata '{key}' is not {what}; remove it or compile the model again")


def name_map(text: str, key: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """A metadata field that maps names to one of `allowed` (`memsched.kinds`, `memsched.phases`)."""
    return metadata_json(text, key, lambda v: isinstance(v, dict) and all(x in allowed for x in v.values()),
                         f"a JSON object of names to one of {', '.join(allowed)}")


@dataclass
class Tensor:
    """A value in the graph. `data` holds an initializer's contents (possibly external)."""

    name: str
    shape: tuple[int, ...] | None
    dtype: int  # onnx.TensorProto element type
    kind: str = "activation"
    data: TensorProto | None = None

    @property
    def is_static(self) -> bool:
        """Backed by an initializer: resident from the start of the step to its end."""
        return self.data is not None

    @property
    def itemsize(self) -> int:
        if self.dtype == TensorProto.STRING or self.dtype == TensorProto.UNDEFINED:
            raise ValueError(f"tensor '{self.name}' has no fixed item size")
        return dtypes.itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            raise ValueError(f"tensor '{self.name}' has an unknown shape")
        return math.prod(self.shape) * self.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def dtype_name(self) -> str:
        return helper.tensor_dtype_to_np_dtype(self.dtype).name if self.dtype else "undefined"


@dataclass
class Op:
    """One operator. Missing optional inputs are '' as in ONNX."""

    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attributes: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    phase: str = "forward"
    doc_string: str = ""

    @property
    def present_inputs(self) -> list[str]:
        return [t for t in self.inputs if t]

    @property
    def present_outputs(self) -> list[str]:
        return [t for t in self.outputs if t]


class Graph:
    """Ops (in default-schedule order) and tensors, plus what round-trips to ONNX."""

    def __init__(self, ops: Iterable[Op], tensors: dict[str, Tensor], inputs: list[str],
                 outputs: list[str], name: str = "memsched", opset_imports: dict[str, int] | None = None,
                 ir_version: int = IR_VERSION, metadata: dict[str, str] | None = None,
                 base_dir: str | None = None, doc_string: str = ""):
        self.ops: list[Op] = list(ops)
        self.tensors = tensors
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.name = name
        self.opset_imports = dict(opset_imports or {"": OPSET})
        self.ir_version = ir_version
        self.metadata = dict(metadata or {})
        self.base_dir = base_dir  # where external initializer data lives, if any
        self.doc_string = doc_string
        self.op_by_name: dict[str, Op] = {}
        for op in self.ops:
            if op.name in self.op_by_name:
                raise ValueError(f"two ops are named '{op.name}'")
            self.op_by_name[op.name] = op

    def replace(self, **changes) -> "Graph":
        """A new Graph with some fields changed (ops, tensors, inputs, outputs, ...)."""
        fields = dict(ops=self.ops, tensors=self.tensors, inputs=self.inputs, outputs=self.outputs,
                      name=self.name, opset_imports=self.opset_imports, ir_version=self.ir_version,
                      metadata=self.metadata, base_dir=self.base_dir, doc_string=self.doc_string)
        fields.update(changes)
        return Graph(**fields)

    # ---- derived structure -------------------------------------------------------------
    @cached_property
    def producer(self) -> dict[str, Op]:
        """tensor name -> the op that writes it."""
        return {t: op for op in self.ops for t in op.present_outputs}

    @cached_property
    def consumers(self) -> dict[str, list[Op]]:
        """tensor name -> the ops that read it, in graph order (an op reading twice appears once)."""
        result: dict[str, list[Op]] = {name: [] for name in self.tensors}
        for op in self.ops:
            for t in dict.fromkeys(op.present_inputs):
                result.setdefault(t, []).append(op)
        return result

    @cached_property
    def nx(self) -> nx.DiGraph:
        """Ops as nodes; an edge u->v carries the set of tensors u writes and v reads."""
        g = nx.DiGraph()
        g.add_nodes_from(op.name for op in self.ops)
        for op in self.ops:
            for t in op.present_inputs:
                src = self.producer.get(t)
                if src is not None:
                    if g.has_edge(src.name, op.name):
                        g[src.name][op.name]["tensors"].add(t)
                    else:
                        g.add_edge(src.name, op.name, tensors={t})
        return g

    def parameters(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind == "parameter"]

    def initializers(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.is_static]

    def is_topological(self, order: Iterable[str] | None = None) -> bool:
        """True when every op's inputs are produced earlier in `order` (default: stored order)."""
        seen = set(self.inputs) | {t.name for t in self.initializers()}
        for name in (order if order is not None else (op.name for op in self.ops)):
            op = self.op_by_name[name]
            if any(t not in seen for t in op.present_inputs):
                return False
            seen.update(op.present_outputs)
        return True

    # ---- ONNX --------------------------------------------------------------------------
    @classmethod
    def from_onnx(cls, model: onnx.ModelProto, base_dir: str | None = None) -> "Graph":
        """Lower a (shape-inferred) ModelProto. Unknown shapes stay None; the front end checks."""
        g = model.graph
        metadata = {p.key: p.value for p in model.metadata_props}
        kinds = name_map(metadata.pop(_KINDS_KEY, "{}"), _KINDS_KEY, TENSOR_KINDS)
        phases = name_map(metadata.pop(_PHASES_KEY, "{}"), _PHASES_KEY, PHASES)

        types: dict[str, tuple[tuple[int, ...] | None, int]] = {}
        for vi in list(g.value_info) + list(g.input) + list(g.output):
            types[vi.name] = _shape_and_dtype(vi)
        tensors: dict[str, Tensor] = {}
        initializer_names = {init.name for init in g.initializer}
        for init in g.initializer:
            tensors[init.name] = Tensor(init.name, tuple(init.dims), init.data_type, "parameter", init)
        for sparse in g.sparse_initializer:
            raise ValueError(f"sparse initializer '{sparse.values.name}' is not supported")

        buffers = {n.input[i] for n in g.node if n.op_type == "BatchNormalization"
                   for i in (3, 4) if len(n.input) > i}
        for t in tensors.values():
            if not dtypes.is_float(t.dtype):
                t.kind = "constant"
            elif t.name in buffers:
                t.kind = "buffer"

        inputs = [vi.name for vi in g.input if vi.name not in initializer_names]
        for name in inputs:
            shape, dtype = types[name]
            tensors[name] = Tensor(name, shape, dtype, "input")

        ops: list[Op] = []
        used_names: set[str] = set()
        for index, node in enumerate(g.node):
            name = node.name if node.name and node.name not in used_names else _fresh_name(node, index, used_names)
            used_names.add(name)
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            op = Op(name, node.op_type, list(node.input), list(node.output), attrs, node.domain,
                    phases.get(name, "forward"), node.doc_string)
            ops.append(op)
            for t in op.present_outputs:
                shape, dtype = types.get(t, (None, TensorProto.UNDEFINED))
                if node.op_type == "Constant":
                    shape, dtype = _constant_type(node, shape, dtype)
                kind = "constant" if node.op_type in ("Constant", "ConstantOfShape") else "activation"
                tensors[t] = Tensor(t, shape, dtype, kind)
        for vi in g.output:
            if vi.name in tensors and not tensors[vi.name].is_static and vi.name not in inputs:
                tensors[vi.name].kind = "output"
        for name, kind in kinds.items():
            if name in tensors:
                tensors[name].kind = kind
        # an op input nobody defines: let the front end name it
        return cls(ops, tensors, inputs, [vi.name for vi in g.output], g.name or "memsched",
                   {imp.domain: imp.version for imp in model.opset_import}, model.ir_version,
                   metadata, base_dir, g.doc_string)

    def to_onnx(self, load_external_data: bool = True) -> onnx.ModelProto:
        """Emit an ONNX model; kinds/phases that differ from what lowering infers go in metadata."""
        nodes = [_make_node(op) for op in self.ops]
        initializers = []
        for t in self.initializers():
            proto = t.data
            if load_external_data and _is_external(proto):
                proto = _loaded_copy(proto, self.base_dir)
            initializers.append(proto)
        inputs = [_value_info(self.tensors[n]) for n in self.inputs]
        if self.ir_version < 4:
            inputs += [_value_info(t) for t in self.initializers()]
        outputs = [_value_info(self.tensors[n]) for n in self.outputs]
        boundary = set(self.inputs) | set(self.outputs)
        value_info = [_value_info(t) for t in self.tensors.values()
                      if not t.is_static and t.name not in boundary and t.shape is not None]
        # built in place: make_graph copies every initializer and make_model copies them again
        model = onnx.ModelProto(ir_version=self.ir_version, producer_name="memsched")
        model.opset_import.extend(helper.make_opsetid(d, v) for d, v in self.opset_imports.items())
        graph = model.graph
        graph.name = self.name
        if self.doc_string:
            graph.doc_string = self.doc_string
        graph.node.extend(nodes)
        graph.input.extend(inputs)
        graph.output.extend(outputs)
        graph.initializer.extend(initializers)
        graph.value_info.extend(value_info)
        metadata = dict(self.metadata)
        reference = Graph.from_onnx(_without_data(model))
        kinds = {n: t.kind for n, t in self.tensors.items()
                 if n in reference.tensors and reference.tensors[n].kind != t.kind}
        phases = {op.name: op.phase for op in self.ops if op.phase != "forward"}
        if kinds:
            metadata[_KINDS_KEY] = json.dumps(kinds, sort_keys=True)
        if phases:
            metadata[_PHASES_KEY] = json.dumps(phases, sort_keys=True)
        helper.set_model_props(model, metadata)
        return model


# ---- helpers ---------------------------------------------------------------------------
def _shape_and_dtype(vi: onnx.ValueInfoProto) -> tuple[tuple[int, ...] | None, int]:
    ttype = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        return None, TensorProto.UNDEFINED
    if not ttype.HasField("shape"):
        return None, ttype.elem_type
    dims = []
    for d in ttype.shape.dim:
        if not d.HasField("dim_value"):
            return None, ttype.elem_type
        dims.append(d.dim_value)
    return tuple(dims), ttype.elem_type


def _constant_type(node: onnx.NodeProto, shape, dtype):
    """A Constant's type from its attribute, for when inference left it out."""
    if shape is not None and dtype:
        return shape, dtype
    for a in node.attribute:
        if a.name == "value":
            return tuple(a.t.dims), a.t.data_type
        if a.name in ("value_float", "value_int"):
            return (), TensorProto.FLOAT if a.name == "value_float" else TensorProto.INT64
        if a.name in ("value_floats", "value_ints"):
            n = len(a.floats) if a.name == "value_floats" else len(a.ints)
            return (n,), TensorProto.FLOAT if a.name == "value_floats" else TensorProto.INT64
    return shape, dtype


def _fresh_name(node: onnx.NodeProto, index: int, used: set[str]) -> str:
    base = f"{node.op_type}_{index}"
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    return name


def _make_node(op: Op) -> onnx.NodeProto:
    node = helper.make_node(op.op_type, op.inputs, op.outputs, name=op.name, domain=op.domain or None,
                            doc_string=op.doc_string or None)
    for key, value in op.attributes.items():
        if isinstance(value, (list, tuple)) and len(value) == 0:
            node.attribute.append(helper.make_attribute(key, [], attr_type=onnx.AttributeProto.INTS))
        else:
            node.attribute.append(helper.make_attribute(key, value))
    return node


def _value_info(t: Tensor) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, t.dtype, list(t.shape) if t.shape is not None else None)


def _is_external(proto: TensorProto) -> bool:
    return proto.data_location == TensorProto.EXTERNAL


def _loaded_copy(proto: TensorProto, base_dir: str | None) -> TensorProto:
    from onnx.external_data_helper import load_external_data_for_tensor

    copy = TensorProto()
    copy.CopyFrom(proto)
    load_external_data_for_tensor(copy, base_dir or ".")
    copy.data_location = TensorProto.DEFAULT
    del copy.external_data[:]
    return copy


def _without_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose initializers keep only name, type and dims (cheap to lower)."""
    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    g = light.graph
    g.name = model.graph.name
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    for init in model.graph.initializer:
        g.initializer.add().CopyFrom(header_only(init))
    return light


def tensor_kinds(model: onnx.ModelProto) -> dict[str, str]:
    """The kind of each initializer of `model` as `Graph.from_onnx` gives it (its lowering's
    default, or the `memsched.kinds` metadata), without lowering the model."""
    kinds = name_map({p.key: p.value for p in model.metadata_props}.get(_KINDS_KEY, "{}"), _KINDS_KEY, TENSOR_KINDS)
    buffers = {n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization"
               for i in (3, 4) if len(n.input) > i}
    default = {init.name: ("constant" if not dtypes.is_float(init.data_type) else
                           "buffer" if init.name in buffers else "parameter") for init in model.graph.initializer}
    return {name: kinds.get(name, kind) for name, kind in default.items()}


def header_only(proto: TensorProto) -> TensorProto:
    header = TensorProto(name=proto.name, data_type=proto.data_type)
    header.dims.extend(proto.dims)
    return header


def tensor_value(t: Tensor, base_dir: str | None = None) -> np.ndarray:
    """The numpy value of an initializer-backed tensor (external data read on demand)."""
    if t.data is None:
        raise ValueError(f"tensor '{t.name}' has no stored value")
    proto = _loaded_copy(t.data, base_dir) if _is_external(t.data) else t.data
    return numpy_helper.to_array(proto)


def op_summary(op: Op) -> str:
    """'Conv node "conv1"' for error messages."""
    return f"{op.op_type} node '{op.name}'"


__all__ = ["Tensor", "Op", "Graph", "TENSOR_KINDS", "PHASES", "STATIC_KINDS", "FIXED_KINDS", "tensor_value",
           "op_summary"]
