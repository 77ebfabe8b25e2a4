"""Write a Plan as a scheduled ONNX graph, and read one back (docs/design.md, the file format).

The file is a valid ONNX model that Netron shows as the step really runs:
- nodes in schedule order; a recomputation is a clone of its op named `<op>.recompute<k>`
  whose outputs are renamed `<tensor>.recompute<k>` so the graph stays SSA;
- a swap-out is a `SwapOut` node (domain `ai.memsched`, attribute `tier`) from the device
  tensor to its host copy `<tensor>.host<k>`; a swap-in is a `SwapIn` node from the host
  copy (or, for a static tensor that starts on the host, its initializer) to
  `<tensor>.swap_in<k>`; later readers read the newest name;
- everything else about the plan (the schedule with its frees and streams, aliases, arena
  offsets, what starts on the host, the budget, the renames) is one JSON document in
  `metadata_props` under `memsched.plan`, with a format version;
- the document also holds `graph_sha256`, a digest of the scheduled graph as written, of what
  the document says runs and trains, and of the step's metadata (see `plan_digest`), so a plan
  edited after compile is refused instead of run or reported.

`read_plan` inverts this: the unscheduled Graph (original ops in their original order,
kinds and phases intact, no clones or swap nodes) and the Plan's decisions. The metadata is
the plan; the nodes are its rendering, and a file whose nodes disagree with its metadata (a
node out of order, a SwapOut whose `tier` attribute names another tier, an initializer whose
data does not fill its shape, a graph that no longer matches its digest) is rejected rather
than guessed at.

`passes.rebuild.model_step` builds again, from the user's original model file, the step a plan
claims to run (the training options are in the plan's `memsched.training` metadata), so `run
--against` can compare the plan with the model and not only with itself.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import _get_all_tensors

from . import dtypes
from .documents import parse_text
from .errors import ScheduleError, UserError, first_line
from .frontend import read_model
from .hardware import Hardware, preset_names
from .hardware import from_dict as hardware_from_dict
from .hardware import load as load_hardware
from .ir import Graph, Op, Tensor, tensor_kinds
from .onnx_utils import MEMSCHED_DOMAIN, checkable_view, save_model_atomic
from .schedule import Plan, RUNS, Step, STEP_KINDS, StepKind

PLAN_KEY = "memsched.plan"
FORMAT_VERSION = 3     # 2: trained values (weights, states, hyperparameters) out of the digest;
                       # 3: the digest seals the document's schedule and outputs and the step's metadata
SWAP_OPS = {StepKind.SWAP_OUT: "SwapOut", StepKind.SWAP_IN: "SwapIn"}
# initializer kinds whose values training changes: never in the digest
VALUE_KINDS = ("parameter", "buffer", "optimizer_state", "hyperparameter")
DIGEST_VALUES = 32      # elements: tensors up to this size (shapes, axes) enter the digest with their values


# ---- writing -----------------------------------------------------------------------------
def plan_to_onnx(plan: Plan, load_external_data: bool = True) -> onnx.ModelProto:
    """The scheduled graph of `plan` as an ONNX model, with the plan in its metadata; without
    `load_external_data`, weights stored outside the model stay there (relative to the
    graph's base_dir)."""
    scheduled, renamed, clones = _scheduled_graph(plan)
    model = scheduled.to_onnx(load_external_data=load_external_data)
    document = {
        "version": FORMAT_VERSION,
        "schedule": [_step_json(s) for s in plan.schedule],
        "aliases": dict(plan.aliases),
        "offsets": None if plan.offsets is None else
        [[t, i, int(o)] for (t, i), o in sorted(plan.offsets.items())],
        "on_host": sorted(plan.on_host),
        "budget": None if plan.budget is None else int(plan.budget),
        "hardware": _hardware_json(plan.hardware),
        "notes": plan.notes,
        "graph_order": [op.name for op in plan.graph.ops],
        "outputs": list(plan.graph.outputs),
        "opset_imports": dict(plan.graph.opset_imports),
        "renamed": renamed,
        "clones": clones,
    }
    document = json.loads(json.dumps(document, default=_json_default))    # as a reader will see it
    document["graph_sha256"] = plan_digest(model, document)
    props = {p.key: p.value for p in model.metadata_props}
    props[PLAN_KEY] = json.dumps(document, default=_json_default, separators=(",", ":"))
    onnx.helper.set_model_props(model, props)
    onnx.checker.check_model(checkable_view(model))      # the weights came checked with the model
    return model


# The rate `write_seconds` assumes: writing GPT-2's 1.86 GB plan took 9.5 s on the 2-core
# development machine (its disk takes about 270 MB/s).
WRITE_BYTES_PER_S = 150e6


def write_seconds(graph: Graph) -> float:
    """About how long `write_plan` takes for a plan of `graph`: its stored values, at
    WRITE_BYTES_PER_S (a compile keeps this much of its time limit for the write)."""
    return sum(t.nbytes for t in graph.initializers()) / WRITE_BYTES_PER_S


def write_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Emit `plan` to `path` atomically (initializers go to a data file beside it past
    `onnx_utils.INLINE_BYTES`). Weights the model kept in external files (or in its own file,
    `model_file`) are copied from there into the plan's own data file."""
    # where the graph names no folder its external data is read from the working directory,
    # as Graph.to_onnx loads it
    return save_model_atomic(plan_to_onnx(plan, load_external_data=False), path,
                             source_dir=plan.graph.base_dir or ".")


def _scheduled_graph(plan: Plan) -> tuple[Graph, dict[str, str], dict[str, str]]:
    """The graph with nodes in schedule order, clones and swap nodes added, SSA names.

    Returns it with `renamed` (new tensor name -> original) and `clones` (clone op -> op)."""
    graph = plan.graph
    taken = {"op": set(graph.op_by_name), "tensor": set(graph.tensors)}   # ONNX keeps two namespaces
    current = {name: name for name in graph.tensors}       # the newest name of each tensor
    host = {name: name for name in plan.on_host}            # where its host copy is
    counts: dict[tuple[str, str], int] = {}
    ops: list[Op] = []
    tensors = dict(graph.tensors)
    renamed: dict[str, str] = {}
    clones: dict[str, str] = {}

    def fresh(base: str, space: str = "op") -> str:
        name, k = base, 1
        while name in taken[space]:
            name, k = f"{base}.{k}", k + 1
        taken[space].add(name)
        return name

    def new_tensor(original: str, base: str) -> str:
        name = fresh(base, "tensor")
        t = graph.tensors[original]
        tensors[name] = Tensor(name, t.shape, t.dtype, t.kind)
        renamed[name] = original
        return name

    def count(kind: str, target: str) -> int:
        k = counts.get((kind, target), 0) + 1
        counts[(kind, target)] = k
        return k

    for index, step in enumerate(plan.schedule):
        if step.kind not in STEP_KINDS:
            raise ScheduleError(f"step {index} has unknown kind '{step.kind}'")
        if step.kind in RUNS:
            op = graph.op_by_name.get(step.target)
            if op is None:
                raise ScheduleError(f"step {index} names op '{step.target}', which the graph does not have")
            inputs = [current.get(t, t) if t else "" for t in op.inputs]
            if step.kind == StepKind.COMPUTE:
                ops.append(dataclasses.replace(op, inputs=inputs))
                continue
            k = count("recompute", op.name)
            outputs = []
            for t in op.outputs:
                if t:
                    current[t] = new_tensor(t, f"{t}.recompute{k}")
                outputs.append(current[t] if t else "")
            name = fresh(f"{op.name}.recompute{k}")
            clones[name] = op.name
            ops.append(dataclasses.replace(op, name=name, inputs=inputs, outputs=outputs))
        elif step.kind in SWAP_OPS:
            t = step.target
            if t not in graph.tensors:
                raise ScheduleError(f"step {index} swaps tensor '{t}', which the graph does not have")
            k = count(step.kind, t)
            if step.kind == StepKind.SWAP_OUT:
                source, output = current[t], new_tensor(t, f"{t}.host{k}")
                host[t] = output
            else:
                if t not in host:
                    raise ScheduleError(f"tensor '{t}' is swapped in at step {index} but has no host "
                                        f"copy (never swapped out and not on the host at the start)")
                source, output = host[t], new_tensor(t, f"{t}.swap_in{k}")
                current[t] = output
            ops.append(Op(fresh(f"{t}.{step.kind}{k}"), SWAP_OPS[step.kind], [source], [output],
                          {"tier": step.tier or "dram"}, MEMSCHED_DOMAIN, _phase_of(graph, t)))
    outputs = [current[t] for t in graph.outputs]
    opsets = dict(graph.opset_imports)
    opsets[MEMSCHED_DOMAIN] = 1
    metadata = {k: v for k, v in graph.metadata.items() if k != PLAN_KEY}
    scheduled = graph.replace(ops=ops, tensors=tensors, outputs=outputs, opset_imports=opsets,
                              metadata=metadata)
    return scheduled, renamed, clones


def _phase_of(graph: Graph, tensor: str) -> str:
    producer = graph.producer.get(tensor)
    return producer.phase if producer is not None else "forward"


def _step_json(step: Step) -> list:
    return [step.kind, step.target, step.tier, step.stream]


def _hardware_json(hardware: Hardware | str | None) -> dict | str | None:
    """A Hardware as its whole profile (a custom file's figures survive); a name stays a name."""
    if isinstance(hardware, Hardware):
        return hardware.to_dict()
    if hardware is None or isinstance(hardware, str):
        return hardware
    raise ScheduleError(f"cannot store hardware of type {type(hardware).__name__} in the plan")


def _hardware_from_json(value: Any, source: str) -> Hardware | None:
    """The plan's hardware: a profile written out, or a preset's name. Never a path: a plan
    file must not make memsched open (or tell the existence of) a file it names."""
    if isinstance(value, dict):
        return hardware_from_dict(value, where=f"the hardware in the plan of {source}")
    if value is None:
        return None
    if isinstance(value, str) and value in preset_names():
        return load_hardware(value)
    if isinstance(value, str):
        raise UserError(f"the plan in {source} names hardware {value[:40]!r}, which is no preset; a plan holds "
                        f"its profile itself")
    raise UserError(f"the plan in {source} has a malformed hardware entry")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot store {type(value).__name__} in the plan metadata")


# ---- reading -----------------------------------------------------------------------------
def read_plan(path: str | os.PathLike) -> Plan:
    """The Plan stored in a scheduled.onnx written by `write_plan`. UserError if it is not one."""
    path = Path(path)
    model = read_model(path)
    return plan_from_onnx(model, base_dir=str(path.parent), source=str(path))


def plan_from_onnx(model: onnx.ModelProto, base_dir: str | None = None, source: str = "the model") -> Plan:
    """Rebuild the unscheduled Graph and the plan's decisions from an emitted model."""
    props = {p.key: p.value for p in model.metadata_props}
    if PLAN_KEY not in props:
        raise UserError(f"{source} holds no memsched plan (no '{PLAN_KEY}' metadata); "
                        f"write one with `memsched compile`")
    doc = parse_text(props[PLAN_KEY], f"the plan in {source} is not valid JSON")
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise UserError(f"the plan in {source} has format version {version!r}; this memsched reads "
                        f"version {FORMAT_VERSION}")
    _check_document(doc, source)
    try:
        schedule = [Step(StepKind(kind), target, tier, stream) for kind, target, tier, stream in doc["schedule"]]
        renamed: dict[str, str] = doc["renamed"]
        clones: dict[str, str] = doc["clones"]
        graph_order: list[str] = doc["graph_order"]
        offsets = None if doc["offsets"] is None else {(t, int(i)): int(o) for t, i, o in doc["offsets"]}
        plan_fields = dict(aliases=dict(doc["aliases"]), offsets=offsets, on_host=frozenset(doc["on_host"]),
                           budget=doc["budget"], hardware=_hardware_from_json(doc["hardware"], source),
                           notes=doc["notes"])
        outputs, opsets = list(doc["outputs"]), dict(doc["opset_imports"])
    except KeyError as exc:
        raise UserError(f"the plan in {source} is malformed: it has no field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"the plan in {source} is malformed ({type(exc).__name__}: {exc})") from None

    _check_initializer_sizes(model, source)
    if doc["graph_sha256"] != plan_digest(model, doc):
        raise UserError(f"the graph in {source} no longer matches the plan written with it (its sha256 "
                        f"differs: ops, shapes, constants or memsched metadata were edited; weights may "
                        f"change, these may not); "
                        f"compile the model again")
    _check_shapes(model, source)
    scheduled = Graph.from_onnx(model, base_dir=base_dir)
    _check_nodes_match(scheduled, schedule, clones, renamed, source)
    original = {}
    for op in scheduled.ops:
        if op.name in clones or op.domain == MEMSCHED_DOMAIN:
            continue
        original[op.name] = dataclasses.replace(op, inputs=[renamed.get(t, t) if t else "" for t in op.inputs])
    missing = [name for name in graph_order if name not in original]
    if missing or len(original) != len(graph_order):
        raise UserError(f"the plan in {source} lists ops its graph does not have (e.g. "
                        f"'{(missing or sorted(set(original) - set(graph_order)))[0]}'); was it edited by hand?")
    tensors = {name: t for name, t in scheduled.tensors.items() if name not in renamed}
    unknown = sorted(set(plan_fields["on_host"]) - set(tensors)) or sorted(set(outputs) - set(tensors))
    if unknown:
        raise UserError(f"the plan in {source} names tensor '{unknown[0]}', which its graph does not have; "
                        f"was it edited by hand?")
    metadata = {k: v for k, v in scheduled.metadata.items() if k != PLAN_KEY}
    graph = scheduled.replace(ops=[original[name] for name in graph_order], tensors=tensors, outputs=outputs,
                              opset_imports=opsets, metadata=metadata)
    if not graph.is_topological():       # the graph as given (the baseline's order, the reference run's)
        raise UserError(f"the plan in {source} lists an op of its graph_order before the op that makes its input; "
                        f"was it edited by hand?")
    return Plan(graph, schedule, **plan_fields)


def _check_shapes(model: onnx.ModelProto, source: str) -> None:
    """Every op's declared output shapes follow from its inputs (ONNX's strict inference on the
    weightless view), and every tensor the ops touch has one: a graph edited and resealed (a
    stride changed, an output dropped) is one line here, not an error of ONNX Runtime's."""
    try:
        onnx.shape_inference.infer_shapes(checkable_view(model), check_type=True, strict_mode=True,
                                          data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise UserError(f"the graph in {source} is not consistent: {first_line(exc)}; was it edited by hand? "
                        f"compile the model again") from None
    shaped = {vi.name for vi in [*model.graph.value_info, *model.graph.output, *model.graph.input]
              if vi.type.tensor_type.HasField("shape")} | {i.name for i in model.graph.initializer}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in shaped and node.op_type != "Constant":
                raise UserError(f"the graph in {source} declares no shape for tensor '{name}' (output of "
                                f"'{node.name}'); was it edited by hand? compile the model again")


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _string_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


MAX_BYTES = 2 ** 63 - 1       # a byte count or offset of a plan: what an int64 holds


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bytes(value) -> bool:
    """A whole number of bytes an int64 holds (0 included)."""
    return _whole(value) and 0 <= value <= MAX_BYTES


# each field of the plan document and what it must be
_DOCUMENT_FIELDS = {
    "schedule": ("a list of [kind, target, tier, stream]", lambda v: isinstance(v, list) and all(
        isinstance(s, list) and len(s) == 4 and s[0] in STEP_KINDS and isinstance(s[1], str)
        and (s[2] is None or isinstance(s[2], str)) and isinstance(s[3], str) for s in v)),
    "aliases": ("an object of tensor names", _string_map),
    "offsets": ("null or a list of [tensor, index, offset]", lambda v: v is None or isinstance(v, list) and all(
        isinstance(o, list) and len(o) == 3 and isinstance(o[0], str) and _whole(o[1]) and _bytes(o[2])
        for o in v)),
    "on_host": ("a list of tensor names", _strings),
    "budget": ("null or a number of bytes above 0, at most 2^63 - 1", lambda v: v is None or _bytes(v) and v > 0),
    "notes": ("an object", lambda v: isinstance(v, dict)),
    "graph_order": ("a list of op names", _strings),
    "outputs": ("a list of tensor names", _strings),
    "opset_imports": ("an object of domains to versions", lambda v: isinstance(v, dict) and all(
        _whole(x) and x > 0 for x in v.values())),
    "renamed": ("an object of tensor names", _string_map),
    "clones": ("an object of op names", _string_map),
    "graph_sha256": ("the plan's sha256 digest", lambda v: isinstance(v, str)),
}


def _check_document(doc: dict, source: str) -> None:
    """Every field of a plan document has the type memsched writes; else a UserError naming it."""
    for key, (what, valid) in _DOCUMENT_FIELDS.items():
        if key not in doc:
            raise UserError(f"the plan in {source} has no '{key}'; was it edited by hand?")
        if not valid(doc[key]):
            raise UserError(f"the plan in {source} has a malformed '{key}' (it must be {what}); "
                            f"was it edited by hand?")


def _check_nodes_match(scheduled: Graph, schedule: list[Step], clones: dict[str, str],
                       renamed: dict[str, str], source: str) -> None:
    """The node order must be the metadata schedule without its frees."""
    events = [s for s in schedule if s.kind != StepKind.FREE]
    if len(events) != len(scheduled.ops):
        raise UserError(f"the plan in {source} has {len(events)} compute/recompute/swap steps but the "
                        f"graph has {len(scheduled.ops)} nodes; was it edited by hand?")
    for index, (step, op) in enumerate(zip(events, scheduled.ops)):
        if step.kind == StepKind.COMPUTE:
            ok = op.name == step.target and op.domain != MEMSCHED_DOMAIN
        elif step.kind == StepKind.RECOMPUTE:
            ok = clones.get(op.name) == step.target
        elif step.kind in SWAP_OPS:
            ok = (op.domain == MEMSCHED_DOMAIN and op.op_type == SWAP_OPS[step.kind]
                  and renamed.get(op.outputs[0]) == step.target if op.outputs else False)
            tier = op.attributes.get("tier", b"")
            tier = tier.decode("utf-8", "replace") if isinstance(tier, bytes) else str(tier)
            if ok and tier != (step.tier or "dram"):
                raise UserError(f"the plan in {source} swaps '{step.target}' to {step.tier or 'dram'} at event "
                                f"{index}, but its node '{op.name}' says tier '{tier}'; was it edited by hand?")
        else:
            raise UserError(f"the plan in {source} has a step of unknown kind '{step.kind}'")
        if not ok:
            raise UserError(f"the plan in {source} does not match its nodes at event {index}: the "
                            f"metadata says {step}, the node is '{op.name}'; was it edited by hand?")


# what the plan document says runs and what it trains: an edit to any of these is another plan
SEALED_FIELDS = ("schedule", "aliases", "offsets", "on_host", "budget", "graph_order", "outputs",
                 "opset_imports", "renamed", "clones")


def plan_digest(model: onnx.ModelProto, document: dict) -> str:
    """sha256 of the plan as written: `graph_digest` of its graph, the document's
    SEALED_FIELDS, and the step's other memsched.* metadata (the training record: which
    parameters are trained, with which loss and optimizer; the data-parallel options). A
    plan whose metadata alone was edited (a parameter dropped from its outputs and its
    trained list) no longer matches."""
    digest = hashlib.sha256(graph_digest(model).encode())
    digest.update(json.dumps({key: document.get(key) for key in SEALED_FIELDS}, sort_keys=True).encode())
    extra = sorted((p.key, p.value) for p in model.metadata_props
                   if p.key.startswith("memsched.") and p.key != PLAN_KEY)
    digest.update(json.dumps(extra).encode())
    return digest.hexdigest()


def graph_digest(model: onnx.ModelProto) -> str:
    """sha256 of the graph a plan was made for: nodes, attributes, names, shapes and dtypes of every
    tensor, each tensor's kind, and the values of small constants (up to DIGEST_VALUES elements:
    shapes, axes, pads).

    Left out: the values of large tensors, which do not change the plan, and where they are
    stored (inline, or an external-data file renamed after writing) must not change the digest;
    and the values a training run changes whatever their size: parameters, buffers, optimizer
    states and hyperparameters (`VALUE_KINDS`), so a plan holding trained weights is the same
    plan. The graph is copied without its initializers, which join as headers (a copy of a
    1.8 GB GPT-2's weights took 5 s)."""
    holder = onnx.ModelProto()
    copy = holder.graph
    for field, value in model.graph.ListFields():
        if field.name == "initializer":
            continue
        if hasattr(value, "extend"):
            getattr(copy, field.name).extend(value)
        else:
            setattr(copy, field.name, value)
    for tensor in _get_all_tensors(holder):       # the tensors in attributes (Constant values)
        tensor.CopyFrom(_digest_header(tensor))
    kinds = tensor_kinds(model)
    copy.initializer.extend(_digest_header(t, kinds.get(t.name) not in VALUE_KINDS) for t in model.graph.initializer)
    digest = hashlib.sha256(copy.SerializeToString(deterministic=True))
    digest.update(json.dumps(sorted(kinds.items())).encode())
    return digest.hexdigest()


def _digest_header(tensor: TensorProto, with_values: bool = True) -> TensorProto:
    """What the digest keeps of a tensor: name, dtype, dims, and its values where small (and
    `with_values`)."""
    small = with_values and tensor.data_location != TensorProto.EXTERNAL and math.prod(tensor.dims) <= DIGEST_VALUES
    try:
        values = numpy_helper.to_array(tensor).tobytes() if small else b""
    except Exception:  # noqa: BLE001 - data that does not fill its dims: digest what is stored
        values = tensor.SerializeToString(deterministic=True)
    header = TensorProto(name=tensor.name, data_type=tensor.data_type, raw_data=values)
    header.dims.extend(tensor.dims)
    return header


def _check_initializer_sizes(model: onnx.ModelProto, source: str) -> None:
    """Every initializer's stored bytes fill exactly the shape it declares (a hand-edited shape
    is refused). External data is judged where the file is read (`frontend.read_model`: its
    length and extent against the same `dtypes.stored_bytes`); typed fields when numpy_helper
    reads the values."""
    for init in model.graph.initializer:
        expected = dtypes.stored_bytes(init.data_type, math.prod(init.dims))
        if expected is None or init.data_location == TensorProto.EXTERNAL or not init.HasField("raw_data"):
            continue
        stored = len(init.raw_data)
        if stored != expected:
            shape = "x".join(map(str, init.dims)) or "scalar"
            raise UserError(f"initializer '{init.name}' in {source} declares shape {shape} ({expected} bytes) but "
                            f"holds {stored} bytes; was the plan edited by hand?")


# ---- the model a plan was compiled from --------------------------------------------------
