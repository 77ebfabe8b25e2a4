"""Reuse without extra work: optimizer-in-backward, the dW/dX rule, in-place aliasing.

Three decisions, none adding a FLOP or a transfer:

- Per-layer update: each parameter's optimizer update (ops of phase `update`) runs as soon
  as its gradient exists and every other reader of the parameter has run, so the gradient
  dies at once and the update can overwrite the parameter in place (optimizer-in-backward).
- The dW/dX rule of Fujitsu's memory-efficient Caffe: where a layer's input X is larger than
  its weight (conv layers), dW runs before dX, so X dies before dX allocates a buffer of X's
  size; where the weight is larger (FC layers), dX runs first, so the weight's last reader is
  done and the update overwrites it in place.
- In-place aliasing (`Plan.aliases`): an output takes the storage of an input of the same
  size that dies at its op, where the memory model allows it (`memsched.ops.INPLACE_OPS`,
  update ops on their parameter). Chosen greedily; the judge (`analyze`) confirms.
- Fused per-layer update (SGD, momentum): where a weight's gradient is one Gemm read only by
  its update, the update's first step takes the gradient from the Gemm's accumulation -- SGD's
  w - lr * g becomes Gemm(A, B, C=w, alpha=-lr*alpha, beta=1), momentum's momentum * b + g
  becomes Gemm(A, B, C=b, alpha, beta=momentum) -- written over C: the gradient buffer never
  exists. Same FLOPs; the rounding is the Gemm's instead of the elementwise ops'. Where the
  gradient is an embedding's scatter-add of the batch's rows into zeros, the rows are
  scatter-added into w (SGD, scaled by -lr) or into momentum * b instead: no vocab x hidden
  gradient buffer. Adam keeps every gradient dense.
- PyTorch's baseline (`baseline_aliases`): the aliases that make the graph's own order the
  step PyTorch eager runs by default -- every gradient alive until its update, each update
  in place over its parameter and state.
- Rewritten steps: the caller may hand in the same training step rewritten (`variants`, e.g.
  passes.rewrites.concat_split's convolutions split over their Concats); each is judged like the
  graph itself, fused or not, and kept only where it does not lose.

The dW and dX ops of each weight come from the roles passes.training records in
`graph.metadata["memsched.grad_roles"]` (several ops per role, X the layer's input); for
graphs without them, from phases, tensor kinds and structure alone: a dW op is a backward
op writing a `param_grad` tensor (or a tensor an update op reads), its dX ops the other
backward ops reading the same incoming gradient, X as large as dX's output, W as dW's.
"""
from __future__ import annotations

import base64
import dataclasses
import heapq
import json
import weakref
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memsched.errors import ScheduleError
from memsched.ir import FIXED_KINDS, Graph, Op, Tensor, metadata_error, metadata_json, tensor_value
from memsched.memory import alias_problem, analyze
from memsched.ops import is_view, overwritable_inputs
from memsched.schedule import default_schedule, order_schedule, Plan, RUNS, Schedule, StepKind
from memsched.step_info import FORWARD_KEY, GRAD_ROLES_KEY, grad_roles, training_record

# what fuse_updates replaced, so the graph as given (the baseline's) can be rebuilt
FUSED_KEY = "memsched.fused_updates"
TENSOR_ATTRIBUTE = "tensor_proto_base64"   # how op_json writes a tensor-valued attribute


def reuse_pass(plan: Plan, fuse: bool = True, variants: dict[str, Graph] | None = None) -> Plan:
    """Move updates into the backward, apply the dW/dX rule, alias in place, fuse SGD and
    momentum updates into their dW Gemms (`fuse`; not for data-parallel training, whose
    gradients must exist to be all-reduced); never raise the peak.

    Candidate orders (the given one, updates moved, updates moved plus the dW/dX rule), on the
    graph, on `variants` (name -> the same step rewritten, e.g. passes.rewrites.concat_split's; in its
    own op order) and on the fused form of each, are each given greedy in-place aliases and
    judged; the lowest peak wins, ties going to the graph rewritten the most (fewer buffers),
    then to the one that reuses more. Schedules with recompute/swap steps keep their order and
    graph (aliases only).
    """
    graph = plan.graph
    order = compute_order(plan.schedule)
    prefer = plan.aliases
    if order is None:
        aliases = choose_aliases(graph, plan.schedule, prefer)
        profile = analyze(graph, plan.schedule, aliases, plan.on_host)
        notes = {"order": "kept (schedule has recompute/swap steps)", "peak_bytes": profile.peak_bytes,
                 **_alias_notes(graph, aliases)}
        return dataclasses.replace(plan, aliases=aliases, offsets=None,
                                   notes={**plan.notes, "reuse": notes})
    # prefix -> (graph, its given order, the variant it is or comes from, updates fused in it)
    graphs = {"": (graph, order, None, 0)}
    graphs.update({f"{name}, ": (g, [op.name for op in g.ops], name, 0) for name, g in (variants or {}).items()})
    for prefix, (g, g_order, variant, _) in list(graphs.items()):
        fused_graph, fused = fuse_updates(g) if fuse else (g, [])
        if fused:     # judged beside the unfused graph: the fusion is kept only where it does not lose
            graphs[f"{prefix}fused, "] = (fused_graph, carried_order(g, fused_graph, g_order), variant, len(fused))
    candidates, judged = {}, {}
    for prefix, (g, given, variant, fused) in graphs.items():
        for name, candidate in {"given": given,
                                "updates-in-backward": training_order(g, given, dwdx=False),
                                "dw-dx-rule": training_order(g, given)}.items():
            schedule = order_schedule(candidate)
            aliases = choose_aliases(g, schedule, prefer if name == "given" else None)
            candidates[prefix + name] = (g, candidate, variant, fused)
            judged[prefix + name] = (analyze(g, schedule, aliases, plan.on_host).peak_bytes, schedule, aliases)

    def rewrites(name: str) -> int:
        _, _, variant, fused = candidates[name]
        return (variant is not None) + (fused > 0)

    # the lowest peak; on a tie the graph rewritten the most (fewer buffers), then the later candidate
    best = min(judged, key=lambda name: (judged[name][0], -rewrites(name), -list(judged).index(name)))
    peak, schedule, aliases = judged[best]
    input_peak = analyze(graph, plan.schedule, plan.aliases, plan.on_host).peak_bytes
    graph, chosen, variant, fused = candidates[best]
    notes = {"order": best, "peak_bytes": peak, "input_peak_bytes": input_peak,
             "candidate_peaks": {name: j[0] for name, j in judged.items()},
             "fused_updates": fused, "variant": variant,
             "updates_in_backward": _updates_in_backward(graph, chosen),
             **_dwdx_notes(graph, chosen), **_alias_notes(graph, aliases)}
    return dataclasses.replace(plan, graph=graph, schedule=schedule, aliases=aliases, offsets=None,
                               notes={**plan.notes, "reuse": notes})


def carried_order(graph: Graph, fused: Graph, order: list[str]) -> list[str]:
    """`order` (of `graph`'s ops) for `fused`: a fused op where the op whose outputs it makes
    stood, preceded by the new ops feeding it (a fused update's scaling of its rows), the ops
    fused away left out."""
    names: list[str] = []
    placed: set[str] = set()

    def place(op: Op) -> None:
        if op.name in placed:
            return
        placed.add(op.name)
        for t in op.present_inputs:
            feeder = fused.producer.get(t)
            if feeder is not None and feeder.name not in graph.op_by_name:
                place(feeder)
        names.append(op.name)

    for name in order:
        if name in fused.op_by_name:
            names.append(name)
            continue
        outputs = graph.op_by_name[name].present_outputs
        maker = fused.producer.get(outputs[0]) if outputs else None
        if maker is not None and maker.name not in graph.op_by_name:
            place(maker)
    return names


def compute_order(schedule: Schedule) -> list[str] | None:
    """The op names of a compute-only schedule, or None when it has other steps."""
    if any(step.kind != StepKind.COMPUTE for step in schedule):
        return None
    return [step.target for step in schedule]


# ---- fused per-layer update ------------------------------------------------------------
def fuse_updates(graph: Graph) -> tuple[Graph, list[str]]:
    """`graph` with each SGD or momentum update fused into the op that makes its weight
    gradient g, where g (or a Reshape of it to the weight's shape) is read only by the update:

    - g one Gemm (a Linear's dW): SGD's w' = w - lr * g becomes Gemm(lr * A, B, C=w,
      alpha=-alpha, beta=1) in place of the Sub, the smaller of A and B scaled by the step's
      lr tensor (`FusedScale`), so a learning-rate schedule reaches it -- where that operand
      holds no more values than w: BERT-base at 32 x 512 tokens would scale 12.6M values to
      spare a 2.4M gradient (+0.5 % step time on h100-80gb, and a larger temporary); momentum's
      b' = momentum * b + g becomes Gemm(A, B, C=momentum * b, alpha, beta=1) in place of the
      Add (the Mul by the step's momentum tensor stays).
    - g a scatter-add of rows into zeros (an embedding's dW, ScatterND with reduction add):
      the rows are scattered into the accumulator itself -- SGD: ScatterND(w, indices,
      -lr * rows, reduction=add) in place of the Sub; momentum: ScatterND(momentum * b,
      indices, rows, reduction=add) in place of the Add. Repeated indices add up, as they do
      in the dense gradient; only the batch's rows are touched, no vocab x hidden gradient.

    Momentum's step w' = w - lr * b' reads b' as before. The new ops (`<scope>/FusedGemm`;
    `<scope>/FusedScale` and `<scope>/FusedScatter`) stand where the replaced op stood in the
    op order (so the given order stays topological), make its outputs, and the one that
    replaces the gradient's maker takes its grad role (dW). Returns (graph, the parameters
    fused); the graph itself when none is. Adam reads g twice (both moments) and keeps the
    dense gradient."""
    optimizer = training_record(graph).get("optimizer")
    if optimizer not in ("sgd", "momentum") or FUSED_KEY in graph.metadata:   # nothing to fuse, or fused already
        return graph, []
    tensors = dict(graph.tensors)
    roles = grad_roles(graph)
    removed: set[str] = set()
    new_ops: dict[str, list[Op]] = {}
    fused = []
    for op in graph.ops:
        fusion = _fusion(graph, op, optimizer) if op.phase == "update" else None
        if fusion is None:
            continue
        new_ops[op.name] = fusion.ops
        removed.update(o.name for o in fusion.removed)
        tensors.update({t.name: t for t in fusion.tensors})
        roles.update({new: roles[old] for new, old in fusion.roles.items() if old in roles})
        roles.update({new.name: {"role": "update", "param": fusion.param} for new in fusion.ops
                      if new.name not in fusion.roles})
        fused.append(fusion.param)
    if not fused:
        return graph, []
    ops = [new for op in graph.ops if op.name not in removed for new in new_ops.get(op.name, [op])]
    if len({op.name for op in ops}) < len(ops):
        return graph, []           # a name taken already (a graph not from passes.training)
    gone = (removed | set(new_ops)) - {op.name for op in ops}
    used = set(graph.inputs) | set(graph.outputs) | {t for op in ops for t in op.present_inputs + op.present_outputs}
    fused_graph = graph.replace(ops=ops, tensors={name: t for name, t in tensors.items() if name in used},
                                metadata={**graph.metadata, GRAD_ROLES_KEY: json.dumps(
                                    {k: v for k, v in roles.items() if k not in gone}, sort_keys=True)})
    return record_rewrite(graph, fused_graph, FUSED_KEY), fused


def unfused_graph(graph: Graph) -> Graph:
    """The graph before `fuse_updates` (the one the baseline runs)."""
    return undo_rewrite(graph, FUSED_KEY)


# ---- records that undo a rewrite ----------------------------------------------------------
def record_rewrite(given: Graph, rewritten: Graph, key: str, **extra) -> Graph:
    """`rewritten` (the step `given` with some ops replaced) with what changed recorded in its
    metadata under `key`, for `undo_rewrite`: the ops of `given` it lacks or changed, with
    their places in the op order and their grad roles; the names of the ops it added; the
    tensors of `given` it lacks or changed; `extra` fields as they are. Raises TypeError where
    an attribute has no JSON form (op_json)."""
    key_of = {op.name: _op_key(op) for op in rewritten.ops}
    removed = [(i, op) for i, op in enumerate(given.ops) if key_of.get(op.name) != _op_key(op)]
    kept = {op.name for op in given.ops} - {op.name for _, op in removed}
    roles = grad_roles(given)
    record = {**extra, "added": [op.name for op in rewritten.ops if op.name not in kept],
              "ops": [dict(op_json(op), index=i, role=roles.get(op.name)) for i, op in removed],
              "tensors": [tensor_json(t, given.base_dir) for name, t in given.tensors.items()
                          if name not in rewritten.tensors or not _same_tensor(t, rewritten.tensors[name])]}
    # the forward model the user gave stays the step's (a rewritten step is built from a rewritten forward)
    forward = {FORWARD_KEY: given.metadata[FORWARD_KEY]} if FORWARD_KEY in given.metadata else {}
    return rewritten.replace(metadata={**rewritten.metadata, **forward, key: json.dumps(record, sort_keys=True)})


def undo_rewrite(graph: Graph, key: str) -> Graph:
    """The graph before the rewrite recorded under `key` (`record_rewrite`): the ops it added
    taken out, the ones it replaced back at their places in the op order, their tensors and
    grad roles restored; the graph itself where there is no such record."""
    raw = graph.metadata.get(key)
    if raw is None:
        return graph
    what = "a record of a rewrite memsched made"
    record = metadata_json(raw, key, lambda v: isinstance(v, dict) and isinstance(v.get("ops"), list)
                           and isinstance(v.get("tensors"), list), what)
    try:
        return _undone(graph, record, key)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):   # a model's garbage, not memsched's
        raise metadata_error(key, what) from None


def _undone(graph: Graph, record: dict, key: str) -> Graph:
    """`undo_rewrite` of a parsed record; KeyError, TypeError, ... where a field is not as written."""
    if "added" in record:
        added = set(record["added"])
    else:   # a fused-update record written before records named the ops they added: its ops make the outputs
        added = {graph.producer[t].name for o in record["ops"] for t in o["outputs"] if t in graph.producer}
    ops = [op for op in graph.ops if op.name not in added]
    roles = {k: v for k, v in grad_roles(graph).items() if k not in added}
    for o in sorted(record["ops"], key=lambda o: o["index"]):
        ops.insert(o["index"], op_from_json(o))
        if o["role"] is not None:
            roles[o["name"]] = o["role"]
    used = {t for op in ops for t in op.present_inputs + op.present_outputs} | set(graph.inputs) | set(graph.outputs)
    tensors = {name: t for name, t in graph.tensors.items() if name in used}
    tensors.update({t["name"]: tensor_from_json(t) for t in record["tensors"]})
    metadata = {k: v for k, v in graph.metadata.items() if k != key}
    metadata[GRAD_ROLES_KEY] = json.dumps(roles, sort_keys=True)
    return graph.replace(ops=ops, tensors=tensors, metadata=metadata)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return (a.shape, a.dtype, a.kind, a.data) == (b.shape, b.dtype, b.kind, b.data)


def _op_key(op: Op) -> tuple:
    """What makes two ops the same op (attributes by their text: they may hold protos)."""
    return (op.op_type, op.domain, tuple(op.inputs), tuple(op.outputs), op.phase, op.doc_string,
            repr(sorted(op.attributes.items())))


def op_json(op: Op) -> dict:
    """An op as JSON-able data (for the records that undo a rewrite); a tensor attribute (a
    ConstantOfShape's value, say) as its serialised proto in base64."""
    attributes = {k: {TENSOR_ATTRIBUTE: base64.b64encode(v.SerializeToString()).decode()}
                  if isinstance(v, onnx.TensorProto) else v for k, v in op.attributes.items()}
    return {"name": op.name, "op_type": op.op_type, "inputs": list(op.inputs), "outputs": list(op.outputs),
            "attributes": attributes, "domain": op.domain, "phase": op.phase, "doc_string": op.doc_string}


def op_from_json(o: dict) -> Op:
    attributes = {k: onnx.TensorProto.FromString(base64.b64decode(v[TENSOR_ATTRIBUTE]))
                  if isinstance(v, dict) and TENSOR_ATTRIBUTE in v else v for k, v in o["attributes"].items()}
    return Op(o["name"], o["op_type"], o["inputs"], o["outputs"], attributes, domain=o.get("domain", ""),
              phase=o["phase"], doc_string=o["doc_string"])


def tensor_json(t: Tensor, base_dir: str | None) -> dict:
    value = tensor_value(t, base_dir).tolist() if t.is_static else None
    return {"name": t.name, "shape": None if t.shape is None else list(t.shape), "dtype": t.dtype,
            "kind": t.kind, "value": value}


def tensor_from_json(t: dict) -> Tensor:
    shape = None if t["shape"] is None else tuple(t["shape"])
    data = None
    if t["value"] is not None:
        array = np.asarray(t["value"], dtype=helper.tensor_dtype_to_np_dtype(t["dtype"])).reshape(shape)
        data = numpy_helper.from_array(array, t["name"])
    return Tensor(t["name"], shape, t["dtype"], t["kind"], data)


@dataclass
class _Fusion:
    """One fused update: `ops` stand where the update op stood, `removed` leave the graph
    (besides the update op), `tensors` are new; `roles` maps a new op to the removed op whose
    grad role it takes; `param` is the parameter updated."""

    ops: list[Op]
    removed: list[Op]
    tensors: list[Tensor]
    roles: dict[str, str]
    param: str


def _fusion(graph: Graph, op: Op, optimizer: str) -> _Fusion | None:
    """The fusion of update op `op` into its gradient's maker (`fuse_updates`), else None."""
    matched = (_sgd_fusable if optimizer == "sgd" else _momentum_fusable)(graph, op)
    if matched is None:
        return None
    maker, mul, views, accumulator, lr, param = matched
    scope = op.name.rpartition("/")[0] or op.name
    why = f"{optimizer} update of {param} fused with {maker.name}"
    removed = [maker, *views] + ([mul] if lr is not None else [])
    taken = [f"{scope}/FusedScale_output_0", f"{scope}/FusedNegate_output_0"]
    if any(name in graph.tensors for name in taken):
        return None
    scaled, negated = taken
    dtype = graph.tensors[accumulator].dtype
    ops, tensors = [], []
    if maker.op_type == "Gemm":
        name = f"{scope}/FusedGemm"
        a, b = maker.inputs[:2]
        alpha = float(maker.attributes.get("alpha", 1.0))
        if lr is not None:           # w - lr * A B: the smaller operand scaled by the step's lr
            smaller = 0 if graph.tensors[a].numel <= graph.tensors[b].numel else 1
            operand = maker.inputs[smaller]
            if graph.tensors[operand].numel > graph.tensors[param].numel:
                return None          # scaling it would cost more time and memory than the gradient it spares
            tensors.append(Tensor(scaled, graph.tensors[operand].shape, dtype, "gradient"))
            ops.append(Op(f"{scope}/FusedScale", "Mul", [operand, lr], [scaled], phase="update", doc_string=why))
            a, b = (scaled, b) if smaller == 0 else (a, scaled)
            alpha = -alpha
        ops.append(Op(name, "Gemm", [a, b, accumulator], list(op.outputs),
                      {**maker.attributes, "alpha": alpha, "beta": 1.0}, phase="update", doc_string=why))
        return _Fusion(ops, removed, tensors, {name: maker.name}, param)
    zeros = graph.producer[maker.inputs[0]]
    _, indices, rows = maker.inputs
    removed.append(zeros)
    if lr is not None:                     # -lr * rows add into w
        row_tensor = graph.tensors[rows]
        tensors += [Tensor(negated, (), dtype, "gradient"), Tensor(scaled, row_tensor.shape, dtype, "gradient")]
        ops += [Op(f"{scope}/FusedNegate", "Neg", [lr], [negated], phase="update", doc_string=why),
                Op(f"{scope}/FusedScale", "Mul", [rows, negated], [scaled], phase="update", doc_string=why)]
        rows = scaled
    name = f"{scope}/FusedScatter"
    ops.append(Op(name, "ScatterND", [accumulator, indices, rows], list(op.outputs), {"reduction": "add"},
                  phase="update", doc_string=why))
    return _Fusion(ops, removed, tensors, {name: maker.name}, param)


def _sgd_fusable(graph: Graph, sub: Op):
    """For the SGD step `sub` = w - Mul(g, lr): (g's maker, the Mul, the Reshapes between g's
    maker and the Mul, the accumulator w, the lr tensor, w); else None."""
    if sub.op_type != "Sub" or len(sub.present_inputs) != 2 or len(sub.present_outputs) != 1:
        return None
    param, scaled = sub.inputs
    mul = _sole_producer(graph, scaled, "Mul")
    if graph.tensors[param].kind != "parameter" or mul is None:
        return None
    grad, lr = mul.inputs
    found = _gradient_maker(graph, grad, param)
    if found is None or not _is_scalar(graph, lr):
        return None
    maker, views = found
    return maker, mul, views, param, lr, param


def _momentum_fusable(graph: Graph, add: Op):
    """For the momentum step `add` = Mul(b, momentum) + g: (g's maker, the Mul, the Reshapes
    between g's maker and `add`, the accumulator Mul(b, momentum) (the Mul stays: it reads the
    step's momentum), no lr, the parameter); else None."""
    if add.op_type != "Add" or len(add.present_inputs) != 2 or len(add.present_outputs) != 1:
        return None
    scaled, grad = add.inputs
    mul = _sole_producer(graph, scaled, "Mul")
    if mul is None:
        return None
    buffer, momentum = mul.inputs
    state = graph.tensors[buffer]
    param = buffer[:-len(".momentum_buffer")] if buffer.endswith(".momentum_buffer") else None
    found = _gradient_maker(graph, grad, buffer)
    if state.kind != "optimizer_state" or param not in graph.tensors or found is None \
            or not _is_scalar(graph, momentum):
        return None
    maker, views = found
    return maker, mul, views, scaled, None, param


def _read_once(graph: Graph, t: str) -> bool:
    """Read by one op only (the next of a chain) and not a graph output."""
    return len(graph.consumers.get(t, [])) == 1 and t not in graph.outputs


def _sole_producer(graph: Graph, t: str, op_type: str) -> Op | None:
    """The update op of `op_type` with two inputs making `t`, which only one op reads; else None."""
    op = graph.producer.get(t)
    if op is None or op.op_type != op_type or op.phase != "update" or len(op.present_inputs) != 2:
        return None
    return op if _read_once(graph, t) else None


def _gradient_maker(graph: Graph, grad: str, like: str) -> tuple[Op, list[Op]] | None:
    """(the backward op making `grad`, the Reshapes between) where each link is read only by
    the next, the maker's output is shaped and typed as `like`, and the maker is a Gemm
    without C or a scatter-add into zeros (`_scatter_into_zeros`); else None."""
    views = []
    maker = graph.producer.get(grad)
    while maker is not None and maker.op_type == "Reshape" and _read_once(graph, grad):
        views.append(maker)
        grad = maker.inputs[0]
        maker = graph.producer.get(grad)
    t, w = graph.tensors.get(grad), graph.tensors[like]
    if maker is None or maker.phase != "backward" or not _read_once(graph, grad) \
            or (t.shape, t.dtype) != (w.shape, w.dtype):
        return None
    gemm = maker.op_type == "Gemm" and len(maker.present_inputs) == 2
    return (maker, views) if gemm or _scatter_into_zeros(graph, maker) else None


def _scatter_into_zeros(graph: Graph, op: Op) -> bool:
    """Whether `op` is ScatterND(zeros, indices, rows, reduction=add) whose zeros (a
    ConstantOfShape of value 0) only it reads: the dense gradient of a Gather."""
    reduction = op.attributes.get("reduction")
    if op.op_type != "ScatterND" or reduction not in ("add", b"add") or len(op.present_inputs) != 3:
        return False
    zeros = graph.producer.get(op.inputs[0])
    if zeros is None or zeros.op_type != "ConstantOfShape" or not _read_once(graph, op.inputs[0]):
        return False
    value = zeros.attributes.get("value")
    return value is None or not numpy_helper.to_array(value).any()


def _is_scalar(graph: Graph, name: str) -> bool:
    """Whether `name` is a one-element initializer (a hyperparameter of the step)."""
    t = graph.tensors[name]
    return t.is_static and t.numel == 1


# ---- in-place ---------------------------------------------------------------------------
def alias_sources(graph: Graph, op: Op, output: str) -> list[str]:
    """Inputs of `op` that `output` may overwrite if they die at `op` (the static half of the
    memory model's rule 4, plus: only update ops overwrite parameters and optimizer state --
    they persist across steps otherwise -- and constants are never overwritten). A graph
    input is the source of views alone: a view shares the input's bytes (in the arena, or on
    the CPU the caller's array, `memsched.runtime.program.host_inputs`), while no other op takes them
    as its own directly.
    Parameters come first: taking their storage saves them for the rest of the step."""
    if graph.tensors[output].nbytes == 0 or output in graph.inputs:
        return []
    found = []
    for name in dict.fromkeys(t for t in overwritable_inputs(op) if t):
        if alias_problem(graph, op, output, name) is not None:
            continue
        t = graph.tensors[name]
        if t.is_static and (op.phase != "update" or t.kind in FIXED_KINDS):
            continue
        found.append(name)
    return sorted(found, key=lambda name: not graph.tensors[name].is_static)


_TABLES: "weakref.WeakKeyDictionary[Graph, dict[str, list[str]]]" = weakref.WeakKeyDictionary()


def alias_table(graph: Graph) -> dict[str, list[str]]:
    """Output -> `alias_sources` of it, for every op output of `graph` (cached per graph)."""
    table = _TABLES.get(graph)
    if table is None:
        table = {out: alias_sources(graph, op, out) for op in graph.ops for out in op.present_outputs}
        _TABLES[graph] = table
    return table


def choose_aliases(graph: Graph, schedule: Schedule, prefer: dict[str, str] | None = None,
                   replays: bool = False) -> dict[str, str]:
    """Greedy in-place aliases for `schedule`: each view shares its input's storage; each
    other output takes an eligible input whose storage nothing reads after its op (a
    parameter first, then a pair in `prefer`). Tensors that are swapped or freed are left
    alone. An op run more than once, or a source made more than once, aliases only with
    `replays` (else replayed ops' outputs but views, which share whichever residency of
    their source they read, are left alone): where the source's residency dies at every
    run of the op, and neither is a view nor read by one (so no other tensor shares that
    storage). `memsched.memory.analyze` is the judge of the result."""
    prefer = prefer or {}
    last_read: dict[str, int] = {}
    moved: set[str] = set()          # swapped or freed: each residency keeps storage of its own
    runs: dict[str, list[int]] = {}  # op -> the steps that compute or recompute it
    made: dict[str, int] = {}        # tensor -> computations of its producer so far
    read_at: dict[tuple[int, str], tuple[str, int]] = {}   # (step, input) -> the residency it reads
    last_read_of: dict[tuple[str, int], int] = {}          # residency -> its last read
    for i, step in enumerate(schedule):
        if step.kind in RUNS:
            op = graph.op_by_name[step.target]
            runs.setdefault(op.name, []).append(i)
            for t in op.present_inputs:
                last_read[t] = i
                if replays:   # residencies matter only where replays may alias
                    read_at[(i, t)] = residency = (t, max(made.get(t, 0) - 1, 0))
                    last_read_of[residency] = i
            for t in op.present_outputs:
                made[t] = made.get(t, 0) + 1
        else:
            moved.add(step.target)
            if step.kind == StepKind.SWAP_OUT:
                last_read[step.target] = i
    for t in graph.outputs:
        last_read[t] = len(schedule)         # held to the end of the step (memory rule 2)
    # a writer's source must die at its op; where either is made more than once, only the
    # residencies can say so (a view shares whichever residency of its source it reads)
    replayed = {t for t, count in made.items() if count > 1}
    viewed = {t for op in graph.ops if is_view(op) for t in op.present_inputs} if replays else set()

    def dies_at_every_run(op, source: str) -> bool:
        return (replays and source not in viewed and source not in graph.outputs and not graph.tensors[source].is_static
                and graph.producer.get(source) is not None and not is_view(graph.producer[source])
                and all(last_read_of[read_at[(i, source)]] == i for i in runs[op.name]))

    table = alias_table(graph)
    aliases: dict[str, str] = {}
    taken: set[str] = set()
    root: dict[str, str] = {}                # tensor -> the first tensor of its storage buffer
    buffer_last: dict[str, int] = {}         # buffer root -> the last read of any tensor in it
    for i, step in enumerate(schedule):
        if step.kind != StepKind.COMPUTE:
            continue
        op = graph.op_by_name[step.target]
        view = is_view(op)
        rerun = len(runs[op.name]) > 1
        # preferred pairs first, so another output of the op cannot take their source
        for out in sorted(op.present_outputs, key=lambda out: out not in prefer):
            if out in moved or (not view and rerun and not replays):
                continue
            sources = [x for x in table[out] if x not in moved and x not in taken and (
                view or (dies_at_every_run(op, x) if rerun or x in replayed else
                         buffer_last.get(root.get(x, x), last_read.get(x)) == i == last_read.get(x)))]
            if sources:
                # a parameter first (its storage is saved to the end of the step), then `prefer`
                static = graph.tensors[sources[0]].is_static
                source = prefer.get(out) if prefer.get(out) in sources and not static else sources[0]
                aliases[out] = source
                if not view:
                    taken.add(source)
                base = root[out] = root.get(source, source)
                buffer_last[base] = max(buffer_last.get(base, last_read.get(source, i)), last_read.get(out, i))
    return aliases


def baseline_aliases(graph: Graph) -> dict[str, str]:
    """The in-place aliases of the baseline, which models PyTorch eager's default step
    (`loss.backward(); optimizer.step()` with torch.optim's in-place updates): in the graph's
    own order, each optimizer update writes over its parameter and its state, and its
    temporaries over the gradient they read (`p.add_(g, alpha=-lr)`, `buf.mul_(m).add_(g)`),
    so no second copy of the parameters exists at the end of the step. Nothing else runs in
    place, and every gradient lives until its update (all updates run after the backward)."""
    aliases = choose_aliases(graph, default_schedule(graph))
    return {out: source for out, source in aliases.items() if graph.producer[out].phase == "update"}


def _alias_notes(graph: Graph, aliases: dict[str, str]) -> dict:
    return {"aliases": len(aliases),
            "aliased_bytes": sum(graph.tensors[out].nbytes for out in aliases),
            "updates_in_place": sum(1 for out, src in aliases.items() if graph.tensors[src].is_static)}


# ---- per-layer update and the dW/dX rule ----------------------------------------------
def training_order(graph: Graph, order: list[str], dwdx: bool = True) -> list[str]:
    """`order` with each update run as soon as it can overwrite its parameter, and (with
    `dwdx`) each layer's dW and dX ops ordered by the Fujitsu rule, wherever the graph lets."""
    position = {name: float(i) for i, name in enumerate(order)}
    if dwdx:
        for group in layer_groups(graph):
            if not group.dx:
                continue
            if group.x_bytes > group.w_bytes:      # conv-like: dW first, X dies before dX
                first, moved = min(position[op.name] for op in group.dx), group.dw
            else:                                  # FC-like: dX first, the update overwrites W
                first, moved = min(position[op.name] for op in group.dw), group.dx
            ranked = sorted(moved, key=lambda op: position[op.name])
            for rank, op in enumerate(ranked):
                position[op.name] = min(position[op.name], first - 0.5 + rank / (2 * len(ranked) + 2))
    key = {name: (0 if graph.op_by_name[name].phase == "update" else 1, p) for name, p in position.items()}
    return priority_order(graph, key, update_edges(graph))


@dataclass
class LayerGroup:
    """A weight's gradient ops (dW) and its layer's input-gradient ops (dX), with the sizes
    the dW/dX rule compares: the layer's input X and the weight W."""

    dw: list[Op]
    dx: list[Op]
    x_bytes: int
    w_bytes: int


def layer_groups(graph: Graph) -> list[LayerGroup]:
    """One group per weight gradient: from autodiff's roles (graph.metadata[GRAD_ROLES_KEY])
    where present, else from structure -- a dW op writes a `param_grad` tensor (or one an
    update reads), its dX ops are the other backward ops reading the same incoming gradient,
    X is as large as dX's output and W as dW's."""
    roles = grad_roles(graph)
    if roles:
        return _groups_from_roles(graph, roles)
    producer = graph.producer
    updates_read = {t for op in graph.ops if op.phase == "update" for t in op.present_inputs}
    dw_ops = [op for op in graph.ops if op.phase == "backward" and any(
        graph.tensors[t].kind == "param_grad" or (t in updates_read and not graph.tensors[t].is_static)
        for t in op.present_outputs)]
    dw_names = {op.name for op in dw_ops}
    groups = []
    for dw in dw_ops:
        grads = [t for t in dw.present_inputs
                 if t in producer and producer[t].phase in ("backward", "loss")]
        dxs = {c.name: c for t in grads for c in graph.consumers.get(t, [])
               if c.phase == "backward" and c.name not in dw_names}
        x_bytes = max((_out_bytes(graph, dx) for dx in dxs.values()), default=0)
        groups.append(LayerGroup([dw], list(dxs.values()), x_bytes, _out_bytes(graph, dw)))
    return groups


def _groups_from_roles(graph: Graph, roles: dict) -> list[LayerGroup]:
    """One group per weight and layer reading it (a weight split into parts, one per
    convolution, passes.rewrites.concat_split's, is read by several)."""
    dw_by_key: dict[tuple[str, str], list[Op]] = {}
    dx_by_layer: dict[str, list[Op]] = {}
    for op in graph.ops:
        role = roles.get(op.name, {})
        if role.get("role") == "dW":
            dw_by_key.setdefault((role["param"], role["layer"]), []).append(op)
        elif role.get("role") == "dX":
            dx_by_layer.setdefault(role["layer"], []).append(op)
    groups = []
    for (param, layer_name), dws in dw_by_key.items():
        layer = graph.op_by_name.get(layer_name)
        dxs = dx_by_layer.get(layer_name, [])
        if layer is not None:
            x_bytes = max((graph.tensors[t].nbytes for t in layer.present_inputs
                           if not graph.tensors[t].is_static), default=0)
        else:
            x_bytes = max((_out_bytes(graph, dx) for dx in dxs), default=0)
        groups.append(LayerGroup(dws, dxs, x_bytes, graph.tensors[param].nbytes))
    return groups


def update_edges(graph: Graph) -> list[tuple[str, str]]:
    """Edges (reader, update op): an update waits for every other reader of the parameter it
    overwrites, so it can take the parameter's storage. Readers downstream of an update are
    skipped, which keeps the edges acyclic."""
    updates = [op for op in graph.ops if op.phase == "update"]
    downstream = set()
    frontier = [op.name for op in updates]
    while frontier:
        name = frontier.pop()
        for succ in graph.nx.successors(name):
            if succ not in downstream:
                downstream.add(succ)
                frontier.append(succ)
    edges = []
    for u in updates:
        for t in u.present_inputs:
            tensor = graph.tensors[t]
            if not tensor.is_static or tensor.kind in FIXED_KINDS:
                continue
            edges.extend((r.name, u.name) for r in graph.consumers.get(t, [])
                         if r.phase != "update" and r.name not in downstream)
    return edges


def priority_order(graph: Graph, key: dict, extra_edges: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Kahn's topological sort taking the ready op with the smallest key; `extra_edges` add
    precedences the data flow does not have. Raises ScheduleError if they close a cycle."""
    preds = {op.name: set(graph.nx.predecessors(op.name)) for op in graph.ops}
    succs = {op.name: set(graph.nx.successors(op.name)) for op in graph.ops}
    for a, b in extra_edges:
        if a != b:
            preds[b].add(a)
            succs[a].add(b)
    waiting = {name: len(p) for name, p in preds.items()}
    ready = [(key[name], name) for name, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for succ in succs[name]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                heapq.heappush(ready, (key[succ], succ))
    if len(order) != len(graph.ops):
        raise ScheduleError("the precedences asked of the op order form a cycle")
    return order


def _out_bytes(graph: Graph, op: Op) -> int:
    return sum(graph.tensors[t].nbytes for t in op.present_outputs)


def _updates_in_backward(graph: Graph, order: list[str]) -> int:
    """How many update ops run before the last backward op."""
    last_backward = max((i for i, name in enumerate(order) if graph.op_by_name[name].phase == "backward"),
                        default=-1)
    return sum(1 for i, name in enumerate(order[:last_backward]) if graph.op_by_name[name].phase == "update")


def _dwdx_notes(graph: Graph, order: list[str]) -> dict:
    """How many weights have all their dW ops before their layer's dX ops, and how many not."""
    position = {name: i for i, name in enumerate(order)}
    dw_first = dx_first = 0
    for group in layer_groups(graph):
        if group.dx:
            if max(position[op.name] for op in group.dw) < min(position[op.name] for op in group.dx):
                dw_first += 1
            else:
                dx_first += 1
    return {"layers_dw_first": dw_first, "layers_dx_first": dx_first}


def updates_last(plan: Plan) -> Plan:
    """`plan` with its update ops moved after every other op (in their order), as a
    data-parallel step runs them: each update waits for its gradients' all-reduce, which
    starts only once the gradients' bucket is complete. In-place aliases are chosen again for
    the new order (the earlier ones preferred). A schedule with recompute or swap steps is kept."""
    order = compute_order(plan.schedule)
    if order is None:
        return plan
    phase = {name: plan.graph.op_by_name[name].phase for name in order}
    moved = [n for n in order if phase[n] != "update"] + [n for n in order if phase[n] == "update"]
    if moved == order:
        return plan
    schedule = order_schedule(moved)
    return dataclasses.replace(plan, schedule=schedule, offsets=None,
                               aliases=choose_aliases(plan.graph, schedule, plan.aliases),
                               notes={**plan.notes, "data_parallel": {"updates_moved_last": True}})
