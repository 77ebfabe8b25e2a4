"""The front end: a path in, a fully shaped Graph out, or one clear UserError.

Steps: check the file, parse it without external data (cheap, works past 2 GB), check the
external-data files lie in the model's folder and exist, treat inputs that have an initializer
as initializers (IR < 4 lists them as both), inline local functions, refuse control flow whose
subgraphs capture main-graph tensors, bind symbolic dimensions (`--dim N=V`),
infer shapes (ONNX inference with data propagation; where that leaves a tensor unknown, one
probe run of ONNX Runtime on zeros), then lower to the IR and insist that every tensor has
a static shape and dtype.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

from .errors import UserError, first_line
from . import dtypes, model_file
from .ir import Graph, op_summary
from .ops import NON_TENSOR_OPS
from .onnx_utils import MEMSCHED_DOMAIN, TWO_GB, checkable_view, is_weight

SUPPORTED_DOMAINS = ("", "ai.onnx", MEMSCHED_DOMAIN)


def load(path: str | os.PathLike, dims: dict[str, int] | None = None) -> Graph:
    """Load an ONNX file into a Graph with every tensor shaped. Raises UserError on bad input."""
    path = Path(path)
    model = read_model(path)
    return lower(model, dims, base_dir=str(path.parent))


def lower(model: onnx.ModelProto, dims: dict[str, int] | None = None, base_dir: str | None = None) -> Graph:
    """Bind dims, infer shapes and lower an in-memory model (initializer data may be external)."""
    model = _inline_functions(model)
    _check_domains(model)
    _check_values(model)
    _check_nodes(model)
    _check_order(model.graph)
    _check_captures(model)
    _bind_dims(model, dict(dims or {}))
    for init in model.graph.initializer:
        _check_weight_size(init)
    view = _infer_shapes(model, base_dir)
    try:  # after inference: outputs declared without shapes are fine once inferred
        onnx.checker.check_model(view)
    except onnx.checker.ValidationError as exc:
        _explain_empty_inputs(model)
        raise UserError(f"not a valid ONNX model: {first_line(exc)}") from None
    graph = Graph.from_onnx(model, base_dir=base_dir)
    _check_complete(graph)
    return graph


def read_model(path: Path) -> onnx.ModelProto:
    """Parse `path` (external data stays on disk), with one-line errors for every bad file."""
    if not path.exists():
        raise UserError(f"no such file: {path}")
    if path.is_dir():
        raise UserError(f"{path} is a directory; give the path of an .onnx file")
    if not path.is_file():
        raise UserError(f"{path} is not a regular file (a device, a pipe or a socket); give the path of an "
                        f".onnx file")
    if path.stat().st_size == 0:
        raise UserError(f"{path} is empty; re-export the model")
    try:
        model = model_file.read(path)
    except (DecodeError, ValueError, RuntimeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a readable ONNX model (truncated or not ONNX): {first_line(exc)}") from None
    if not model.opset_import or not model.HasField("graph"):
        raise UserError(f"{path} is not an ONNX model (no graph or no opset); is it the right file?")
    if len(model.graph.node) == 0:
        raise UserError(f"{path} is an ONNX model whose graph has no ops; there is no step to plan "
                        f"(was it exported from the right module?)")
    if len(model.graph.output) == 0:
        raise UserError(f"{path} is an ONNX model whose graph names no outputs, so it computes nothing; "
                        f"export it with its outputs")
    _check_external_data(model, path.parent)
    return _initializers_not_inputs(model)


MAX_DIM = 2 ** 40      # a dimension past this holds more elements than any device: a typo, not a size


def parse_dims(items: list[str] | None) -> dict[str, int]:
    """['batch=8', 'seq=128'] -> {'batch': 8, 'seq': 128}."""
    dims: dict[str, int] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not re.fullmatch(r"[0-9]+", value.strip()) or not 0 < int(value) <= MAX_DIM:
            raise UserError(f"cannot read --dim '{item}'; write NAME=VALUE with a positive integer "
                            f"(at most {MAX_DIM:,})")
        dims[name.strip()] = int(value)
    return dims


# ---- steps -------------------------------------------------------------------------------
def _check_external_data(model: onnx.ModelProto, base_dir: Path) -> None:
    """Every external tensor's file lies in the model's folder, exists and holds the bytes it claims.

    A location that leaves the folder (absolute, '..', a symlink on the way) is refused before
    anything at it is stat-ed: a model file must not make memsched read, or tell the size or
    existence of, files elsewhere. The extent is judged from the file's size, never its bytes
    (weights can be GBs): see `_check_extent`."""
    from onnx.external_data_helper import _get_all_tensors

    for init in _get_all_tensors(model):
        if init.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        named = info.get("location", "")
        location = _contained_location(named, base_dir, init.name)
        if not location.is_file():
            raise UserError(f"external data file '{named or '?'}' for initializer "
                            f"'{init.name}' not found next to the model in {base_dir}")
        offset, length = (_byte_count(info, key, init.name, named) for key in ("offset", "length"))
        _check_extent(init, named, offset or 0, length, location.stat().st_size)


def _byte_count(info: dict[str, str], key: str, tensor: str, named: str) -> int | None:
    """The external-data entry `key` ('offset' or 'length') as a whole number of bytes, None
    where the model gives none; UserError where it is not a non-negative integer (onnx's
    reader would seek before the file's start, or fail deep inside a later command)."""
    if key not in info:
        return None
    text = info[key].strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise UserError(f"initializer '{tensor}' has external data {key} '{info[key]}' in '{named}'; "
                        f"it must be a non-negative whole number of bytes")
    return int(text)


def _check_extent(init: TensorProto, named: str, offset: int, length: int | None, size: int) -> None:
    """UserError where the external data of `init` cannot hold its values: a `length` other than
    the bytes its shape and type take, or a file of `size` bytes that ends before offset +
    those bytes (a truncated or foreign file, which every later reader would take as the
    weight, short). A tensor that gives no length gets one, its bytes: onnx's reader takes
    a tensor without one to the file's end, extra bytes and all."""
    needed = _stored_bytes(init)
    if needed is not None and length is not None and length != needed:
        shape = "x".join(map(str, init.dims)) or "scalar"
        raise UserError(f"not a valid ONNX model: initializer '{init.name}' declares shape {shape} "
                        f"({needed:,} bytes) but its external data in '{named}' gives length {length:,}; "
                        f"the file is damaged, re-export the model")
    extent = needed if needed is not None else (length or 0)
    if offset + extent > size:
        raise UserError(f"initializer '{init.name}' needs {extent:,} bytes of external data from "
                        f"'{named}' at offset {offset:,}, but the file holds {size:,}; it is "
                        f"truncated or not this model's data")
    if length is None and needed is not None:
        init.external_data.add(key="length", value=str(needed))


def _stored_bytes(init: TensorProto) -> int | None:
    """The bytes `init`'s values take in raw form (`dtypes.stored_bytes`), or None where that
    is not fixed (a negative dim is refused later, by name)."""
    if any(d < 0 for d in init.dims):
        return None
    return dtypes.stored_bytes(init.data_type, math.prod(init.dims))


def _contained_location(location: str, base_dir: Path, tensor: str) -> Path:
    """`base_dir / location` if that names a file inside `base_dir` through no symlink; else UserError.

    Only the text of `location` and the entries it passes inside `base_dir` are looked at (lstat),
    never the file a symlink points to."""
    refuse = f"initializer '{tensor}' has external data at '{location}', "
    parts = location.replace("\\", "/").split("/")
    if not location:
        raise UserError(f"initializer '{tensor}' is stored externally but names no data file")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", location):
        raise UserError(refuse + "an absolute path; external data must lie in the model's folder")
    if ".." in parts:
        raise UserError(refuse + "outside the model's folder ('..'); external data must lie in the model's folder")
    here = base_dir
    for part in (p for p in parts if p not in ("", ".")):
        here = here / part
        if here.is_symlink():
            raise UserError(refuse + "reached through a symlink; external data must be a plain file "
                                     "in the model's folder")
    return here


def _initializers_not_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Graph inputs that have an initializer are initializers, as ONNX Runtime treats them.

    IR < 4 requires every initializer to be listed as a graph input too; lowered as inputs, such
    a model would be fed its weights twice. They are dropped from the inputs and the IR version
    raised to 4, the first that lets an initializer stand alone (nothing else differs)."""
    initializers = {i.name for i in model.graph.initializer}
    kept = [vi for vi in model.graph.input if vi.name not in initializers]
    if len(kept) == len(model.graph.input):
        return model
    del model.graph.input[:]
    model.graph.input.extend(kept)
    if model.ir_version < 4:
        model.ir_version = 4
    return model


def _check_weight_size(init: TensorProto) -> None:
    """UserError where a weight holds another number of values than its dims say (a damaged
    file): the checker sees no weight's values (`onnx_utils.checkable_view`)."""
    if not is_weight(init) or init.data_location == TensorProto.EXTERNAL:
        return
    expected = int(np.prod(init.dims, dtype=np.int64))
    shape = "x".join(map(str, init.dims)) or "scalar"
    stored = len(init.raw_data)              # a copy of the bytes: read once
    if stored:
        needed = dtypes.stored_bytes(init.data_type, expected)
        if stored != needed:                 # bytes, not values: a stray byte is damage too
            raise UserError(f"not a valid ONNX model: initializer '{init.name}' declares shape {shape} "
                            f"({needed:,} bytes) but holds {stored:,} bytes; the file is "
                            f"damaged, re-export the model")
        return
    held = max(len(init.float_data), len(init.double_data), len(init.int32_data))
    if held and held != expected:            # none: a header only (shape-only graphs built for planning)
        raise UserError(f"not a valid ONNX model: initializer '{init.name}' declares shape {shape} "
                        f"({expected:,} values) but holds {held:,}; the file is damaged, re-export the model")


def _inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    if not model.functions:
        return model
    from onnx import inliner

    try:
        return inliner.inline_local_functions(model)
    except Exception as exc:  # noqa: BLE001 - onnx's inliner: ValidationError (a recursive function) and others
        raise UserError(f"not a valid ONNX model: its local functions cannot be inlined: {first_line(exc)}") from None


def _check_values(model: onnx.ModelProto) -> None:
    """Tensors only, of numeric element types: a graph input, output, annotated value or
    weight that is a sequence, map or optional, or holds strings or an element type ONNX does
    not define, and an op that makes or reads sequences (memsched.ops.NON_TENSOR_OPS), are
    one line naming it (their sizes are not fixed by the step)."""
    graph = model.graph
    for info in (*graph.input, *graph.output, *graph.value_info):
        kind = info.type.WhichOneof("value")
        if kind is not None and kind != "tensor_type":
            raise UserError(f"value '{info.name}' is a {kind.removesuffix('_type')}, not a tensor; memsched plans "
                            f"tensors only")
        if kind == "tensor_type" and info.type.tensor_type.elem_type:
            why = dtypes.problem(info.type.tensor_type.elem_type)
            if why is not None:
                raise UserError(f"tensor '{info.name}' {why}")
    for init in graph.initializer:
        why = dtypes.problem(init.data_type)
        if why is not None:
            raise UserError(f"weight '{init.name}' {why}")
    for index, node in enumerate(graph.node):
        if node.op_type in NON_TENSOR_OPS:
            raise UserError(f"{node.op_type} node '{node.name or index}' makes or reads sequences, maps or "
                            f"optionals; memsched plans tensors only")


def _check_domains(model: onnx.ModelProto) -> None:
    """Standard ops only."""
    for index, node in enumerate(model.graph.node):
        if node.domain not in SUPPORTED_DOMAINS:
            raise UserError(f"unsupported op '{node.op_type}' from domain '{node.domain}' at node "
                            f"'{node.name or index}'; memsched handles standard ONNX ops only")


# ops whose `strides` and `dilations` divide a window's steps: each must be at least 1
WINDOWED_OPS = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "ConvInteger", "QLinearConv"}


def _check_nodes(model: onnx.ModelProto) -> None:
    """Before ONNX's shape inference, which names no node for them (and divides by a
    ConvTranspose's group natively: SIGFPE): every window stride and dilation is at least 1,
    and a convolution has at least one group."""
    for index, node in enumerate(model.graph.node):
        if node.op_type not in WINDOWED_OPS or node.domain:
            continue
        where = f"{node.op_type} node '{node.name or index}'"
        if node.op_type in ("Conv", "ConvTranspose"):
            group = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "group"), 1)
            if not isinstance(group, int) or group < 1:
                raise UserError(f"{where} has group={group}; group must be at least 1 and divide the channels")
        for a in node.attribute:
            if a.name in ("strides", "dilations") and any(v < 1 for v in a.ints):
                raise UserError(f"{where} has {a.name}={list(a.ints)}; each must be at least 1")


def _explain_empty_inputs(model: onnx.ModelProto) -> None:
    """Where ONNX's inference or checker failed: a node that leaves an input its schema
    requires empty is named (ONNX says "Field 'shape' of 'type' is required but missing").
    Only on that path: some exporters leave a required input empty that inference tolerates
    (Resize's roi at opset 11)."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    for index, node in enumerate(model.graph.node):
        where = f"{node.op_type} node '{node.name or index}'"
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain or "", 1), node.domain or "")
        except onnx.defs.SchemaError:
            continue            # unknown ops: the checker names them
        for i, formal in enumerate(schema.inputs):
            if formal.option == onnx.defs.OpSchema.FormalParameterOption.Single and \
                    (i >= len(node.input) or not node.input[i]):
                raise UserError(f"{where} leaves its required input {i} ('{formal.name}') empty")


def _check_order(graph: onnx.GraphProto) -> None:
    """Nodes in topological order, as ONNX requires: a cycle is named with its nodes, an
    acyclic graph out of order with the first node that reads ahead."""
    made = {out: index for index, node in enumerate(graph.node) for out in node.output if out}
    late = next(((i, name) for i, node in enumerate(graph.node) for name in node.input
                 if name and made.get(name, -1) >= i), None)
    if late is None:
        return
    import networkx as nx

    nodes = graph.node
    edges = nx.DiGraph((made[name], i) for i, node in enumerate(nodes) for name in node.input if name in made)
    try:
        cycle = nx.find_cycle(edges)
    except nx.NetworkXNoCycle:
        i, name = late
        maker = nodes[made[name]].name or made[name]
        raise UserError(f"node '{nodes[i].name or i}' reads '{name}' before node '{maker}' makes it; ONNX "
                        f"wants the nodes in topological order: export the model again") from None
    names = " -> ".join(f"'{nodes[u].name or u}'" for u, _ in cycle)
    raise UserError(f"the graph has a cycle: {names} -> '{nodes[cycle[0][0]].name or cycle[0][0]}'")


def subgraphs(attributes) -> list[onnx.GraphProto]:
    """The subgraphs among an op's attribute values (If's branches, a Loop's or Scan's body)."""
    found = []
    for value in attributes:
        if isinstance(value, onnx.GraphProto):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, onnx.GraphProto))
    return found


def captured_names(graph: onnx.GraphProto) -> list[str]:
    """Names `graph`'s nodes (and theirs, nested) read without defining them: tensors of an
    enclosing graph it captures implicitly, in order of first use."""
    defined = {vi.name for vi in graph.input} | {i.name for i in graph.initializer} \
        | {i.values.name for i in graph.sparse_initializer}
    free: dict[str, None] = {}
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                free[name] = None
        for sub in subgraphs(helper.get_attribute_value(a) for a in node.attribute):
            free.update(dict.fromkeys(n for n in captured_names(sub) if n not in defined))
        defined.update(node.output)
    return list(free)


def _check_captures(model: onnx.ModelProto) -> None:
    """Refuse control flow whose subgraphs read main-graph tensors. The schedule sees only an
    op's listed inputs: a captured tensor could be freed, swapped or its buffer reused before
    the If, Loop or Scan runs, the executor's per-segment models would not bind it, and a
    parameter read only inside a branch would get no gradient. Control flow that reads only
    its listed inputs is planned and run like any op."""
    for index, node in enumerate(model.graph.node):
        captured = list(dict.fromkeys(
            name for sub in subgraphs(helper.get_attribute_value(a) for a in node.attribute)
            for name in captured_names(sub)))
        if captured:
            shown = ", ".join(repr(n) for n in captured[:3]) + (f" and {len(captured) - 3} more"
                                                                 if len(captured) > 3 else "")
            raise UserError(f"memsched cannot plan {node.op_type} node '{node.name or index}' (control flow): "
                            f"its subgraph reads {shown} from the main graph, which the schedule and the "
                            f"backward pass cannot see; export the model with the control flow unrolled or "
                            f"the branch taken")


def _bind_dims(model: onnx.ModelProto, dims: dict[str, int]) -> None:
    """Replace symbolic dims by the given values on inputs/outputs; drop stale value_info."""
    g = model.graph
    initializers = {i.name for i in g.initializer}
    seen: set[str] = set()
    for vi in list(g.input) + list(g.output):
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                seen.add(d.dim_param)
                if d.dim_param in dims:
                    d.dim_value = dims[d.dim_param]
    unknown = sorted(set(dims) - seen)
    if unknown:
        have = ", ".join(sorted(seen)) or "none"
        raise UserError(f"the model has no symbolic dimension named {', '.join(unknown)} "
                        f"(symbolic dimensions: {have})")
    for vi in g.input:
        if vi.name in initializers:
            continue
        if not vi.type.HasField("tensor_type"):
            raise UserError(f"input '{vi.name}' is not a tensor; memsched handles tensor inputs only")
        ttype = vi.type.tensor_type
        if not ttype.HasField("shape"):
            raise UserError(f"input '{vi.name}' has no shape; give the model a fixed input shape")
        for axis, d in enumerate(ttype.shape.dim):
            if d.HasField("dim_param"):
                raise UserError(f"input '{vi.name}' has unbound symbolic dimension '{d.dim_param}'; "
                                f"pass --dim {d.dim_param}=VALUE")
            if not d.HasField("dim_value"):
                raise UserError(f"input '{vi.name}' has an unnamed unknown dimension (axis {axis}); "
                                f"re-export it with a fixed shape")
    for vi in g.output:  # symbolic output dims left over would clash with inference
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_param"):
                    d.Clear()
    del g.value_info[:]


def _infer_shapes(model: onnx.ModelProto, base_dir: str | None) -> onnx.ModelProto:
    """Shape `model` in place: ONNX inference on its `onnx_utils.checkable_view` (no weight's
    values), whose inferred value infos, outputs and nodes (their subgraphs' value infos) it
    takes; a probe run for what that leaves unknown. Returns the shaped view, for the checker."""
    try:
        view = onnx.shape_inference.infer_shapes(checkable_view(model), check_type=True, strict_mode=True,
                                                 data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        # strict: an op whose operands cannot compose (a MatMul of 2x3 by 4x5) or a declared
        # shape the op cannot make is refused, not planned by its declared shapes; the
        # convolutions' own checks and the empty inputs say it in their words where they apply
        _explain_empty_inputs(model)
        try:
            _check_convolutions(onnx.shape_inference.infer_shapes(checkable_view(model), strict_mode=False))
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
            pass
        raise UserError(f"shape inference failed: {first_line(exc)}") from None
    _check_convolutions(view)
    graph = model.graph
    for field in ("value_info", "output", "node"):
        del getattr(graph, field)[:]
        getattr(graph, field).extend(getattr(view.graph, field))
    unknown = _unknown_tensors(model)
    if unknown:
        _probe_shapes(model, unknown, base_dir)
        for field in ("value_info", "output"):
            del getattr(view.graph, field)[:]
            getattr(view.graph, field).extend(getattr(graph, field))
    return view


def _known_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the graph's inputs and of every tensor shape inference shaped: what a run of the
    model holds at the least."""
    total = 0
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if _fully_shaped(vi):
            total += math.prod(d.dim_value for d in vi.type.tensor_type.shape.dim) * \
                dtypes.itemsize(vi.type.tensor_type.elem_type)
    return total


def _unknown_tensors(model: onnx.ModelProto) -> list[str]:
    known = {vi.name for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)
             if _fully_shaped(vi)}
    return [t for node in model.graph.node for t in node.output
            if t and t not in known and node.op_type != "Constant"]


def _fully_shaped(vi: onnx.ValueInfoProto) -> bool:
    ttype = vi.type.tensor_type
    return (vi.type.HasField("tensor_type") and ttype.elem_type != 0 and ttype.HasField("shape")
            and all(d.HasField("dim_value") for d in ttype.shape.dim))


def _probe_shapes(model: onnx.ModelProto, names: list[str], base_dir: str | None) -> None:
    """Run the model once on zeros with `names` as extra outputs and record their shapes.

    ONNX's own inference gives up on shape arithmetic such as Shape->Gather->Concat->Reshape
    in some exports; a real run knows. Models past 2 GB cannot be probed in memory, nor models
    whose inputs and shaped tensors alone pass PROBE_MAX_BYTES (a run would need at least that
    much host memory, and the time to fill it)."""
    from .ort import probe_session

    if _known_bytes(model) > PROBE_MAX_BYTES:
        return

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    if base_dir:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(probe, base_dir)
    if probe.ByteSize() >= TWO_GB:
        return
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = probe_session(probe.SerializeToString())
    if session is None:      # the completeness check after the probe names what stayed unknown
        return
    feeds = {}
    initializers = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = np.zeros(shape, dtype=helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    try:
        values = session.run(names, feeds)
    except Exception:  # noqa: BLE001
        return
    by_name = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}
    for name, value in zip(names, values):
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        info = helper.make_tensor_value_info(name, elem, list(value.shape))
        if name in by_name:
            by_name[name].CopyFrom(info)
        else:
            model.graph.value_info.append(info)


# numpy's (and so ONNX Runtime's Python side's) most dimensions of an array
MAX_RANK = 32
# the largest model (its inputs and shaped tensors) run once to learn the shapes inference leaves unknown
PROBE_MAX_BYTES = 1 << 30
# the largest tensor planned: sums over a step's tensors stay far inside 64-bit integers
MAX_TENSOR_BYTES = 2 ** 48


def _check_convolutions(view: onnx.ModelProto) -> None:
    """A convolution's `group` divides its input and output channels, and its kernel's channel
    axis matches, where inference knows the shapes (ONNX's inference leaves such an output
    unshaped and ONNX Runtime fails at run time; the backward divides by it). `group` < 1 is
    refused before inference, by `_check_nodes`."""
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in list(view.graph.input) + list(view.graph.value_info) if vi.type.tensor_type.HasField("shape")}
    shapes.update({init.name: list(init.dims) for init in view.graph.initializer})
    for index, node in enumerate(view.graph.node):
        if node.op_type not in ("Conv", "ConvTranspose") or node.domain or len(node.input) < 2:
            continue
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        if not x or not w or len(x) < 2 or len(w) < 2 or None in (x[1], w[0], w[1]):
            continue
        group = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "group"), 1)
        channels = x[1]
        if node.op_type == "Conv":
            valid = channels % group == 0 and w[0] % group == 0 and w[1] * group == channels
        else:
            valid = channels % group == 0 and w[0] == channels
        if not valid:
            raise UserError(f"{node.op_type} node '{node.name or index}' has group={group} for {channels} input "
                            f"channels and a kernel of shape {'x'.join(map(str, w))}; group must divide the "
                            f"channels, the kernel holding channels/group of them")


def _check_complete(graph: Graph) -> None:
    """Every tensor an op touches has a static shape and a dtype; name the first that has not.
    No tensor has a negative dimension, more than MAX_RANK of them or more than
    MAX_TENSOR_BYTES."""
    for t in graph.tensors.values():
        why = dtypes.problem(t.dtype) if t.dtype else None
        if why is not None:                 # an inferred value: a Cast to strings
            raise UserError(f"tensor '{t.name}' {why}")
        if t.shape is None:
            continue
        if any(d < 0 for d in t.shape):
            raise UserError(f"tensor '{t.name}' has a negative dimension (shape {list(t.shape)}); a dimension "
                            f"is a size, 0 or more")
        if len(t.shape) > MAX_RANK:
            raise UserError(f"tensor '{t.name}' has {len(t.shape)} dimensions; memsched handles at most {MAX_RANK}")
        if math.prod(t.shape) * (t.itemsize if t.dtype else 1) > MAX_TENSOR_BYTES:
            raise UserError(f"tensor '{t.name}' of shape {'x'.join(map(str, t.shape))} holds more than "
                            f"{MAX_TENSOR_BYTES >> 40} TiB; memsched plans tensors up to that size")
    for op in graph.ops:
        for name in op.present_inputs:
            if name not in graph.tensors:
                raise UserError(f"tensor '{name}' read by {op_summary(op)} is never defined")
        for name in op.present_outputs:
            t = graph.tensors[name]
            if t.shape is None or not t.dtype:
                raise UserError(f"the shape of tensor '{name}' (output of {op_summary(op)}) is unknown "
                                f"after shape inference (and a probe run, for models up to "
                                f"{PROBE_MAX_BYTES >> 30} GiB of shaped tensors); bind symbolic dims with "
                                f"--dim NAME=VALUE or re-export with static shapes")
    for name in graph.outputs:
        if name not in graph.tensors:
            raise UserError(f"graph output '{name}' is never produced")
