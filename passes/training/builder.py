"""build_training_step: forward graph in, one training-step graph out (see the package doc)."""
from __future__ import annotations

import base64
import dataclasses
import fnmatch
import json
import math
from collections import defaultdict

from memsched.data_parallel import BATCH_STATISTICS_KEY
from memsched.errors import UserError
from memsched.frontend import captured_names, subgraphs
from memsched.ir import Graph, Op, header_only
from memsched.ops import is_batch_norm, is_chunked_batch_norm
from memsched.step_info import FORWARD_KEY, GRAD_ROLES_KEY, TRAINING_KEY, training_record
from memsched.onnx_utils import IR_VERSION, OPSET
from memsched.ops import WEIGHT_PART_OPS, WEIGHT_VIEW_OPS

from memsched.passes.training import rules_elementwise, rules_nn, rules_shape  # noqa: F401 - they fill RULES
from memsched.passes.training.emitter import Emitter
from memsched.passes.training.fuse import fuse_patterns
from memsched.passes.training.loss import LOSS_NAME, LOSSES, emit_loss
from memsched.passes.training.optimizer import OPTIMIZERS, STATES, emit_update, update_outputs
from memsched.passes.training.rederive import rederive_in_backward
from memsched.dtypes import FLOAT_TYPES
from memsched.passes.training.registry import differentiable_outputs, differentiable_positions, rule_of
from memsched.passes.training.simplify import drop_no_ops


MIN_OPSET, MAX_OPSET = 13, 21


def build_training_step(graph: Graph, loss: str = "cross_entropy", optimizer: str = "none",
                        lr: float = 0.01, freeze: tuple[str, ...] | list[str] = (), *,
                        momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
                        eps: float = 1e-8, weight_decay: float = 0.0, fuse: bool = True) -> Graph:
    """Forward + loss + backward (+ optimizer update) of `graph` as one Graph.

    Identity nodes and Dropouts that drop nothing are left out first (`simplify.drop_no_ops`):
    they would be real copies in the step. Raises UserError for bad options, for control flow
    the gradient would have to pass through and for every node that has no gradient rule,
    before anything is built. With `fuse`, GELU, LayerNorm and softmax written out in
    primitive ops become one op each first (`fuse.fuse_patterns`): their backward then keeps
    what PyTorch's kernels keep, not every intermediate of the forward. A BatchNormalization
    that feeds a ReLU or ReLU6 keeps its normalised input alone (`bn_relu`). Last, a value
    that cheap ops make from tensors the backward keeps anyway (a GELU or LayerNorm output, a
    BN output and its ReLU from the normalised input) is derived again right before its
    backward readers instead of kept (`rederive.rederive_in_backward`).

    The hyperparameters are tensors of the step (`optimizer`'s module doc), each training
    BatchNorm's running statistics are updated as PyTorch's train mode does and carried as
    `<buffer>.updated` outputs, and the forward graph as given is kept in the metadata
    (`FORWARD_KEY`, its weights as headers only) for the inference model a trainer writes."""
    hyper = _check_options(loss, optimizer, lr, momentum, betas, eps, weight_decay)
    given = graph
    opset = _training_opset(graph)
    graph = drop_no_ops(graph)
    graph, fusions = fuse_patterns(graph) if fuse else (graph, {})
    if not graph.outputs:
        raise UserError("the model has no output to train on")
    output = graph.outputs[0]
    live = _reaching_output(graph, output)
    _check_control_flow(graph, live, [])
    params = _trainable(graph, live, freeze)
    requiring = _requiring_grad(graph, params)
    needed = needed_ops(graph, live, requiring)
    _check_control_flow(graph, live, needed)
    em = Emitter(graph, opset, fusions)
    _check_supported(em, needed)
    taken = taken_names(graph, optimizer, params)
    if taken:
        raise UserError(f"the model already has tensors named {', '.join(repr(n) for n in taken[:5])}, "
                        f"which the training step needs for its own outputs")

    _emit_forward(em, graph, needed)
    em.phase = "loss"
    extra_inputs, loss_backward = emit_loss(em, loss, output)
    em.phase = "backward"
    grads, roles = _emit_backward(em, graph, needed, params, requiring, {output: loss_backward()})
    if optimizer == "none":
        outputs = [LOSS_NAME] + [grads[param] for param in params]
    else:
        outputs = [LOSS_NAME] + emit_updates(em, optimizer, params, grads, hyper, roles)
    em.phase = "update"
    for update in em.statistics_updates:     # BatchNorm running statistics, written over their buffers
        update()
    step = _assemble(graph, em, extra_inputs, outputs, params, roles, opset,
                     {"loss": loss, "optimizer": optimizer, **hyper})
    step = step.replace(metadata={**step.metadata, FORWARD_KEY: forward_record(given, step)})
    return rederive_in_backward(step)


def forward_record(forward: Graph, step: Graph) -> str:
    """`forward` as a base64 ONNX model for the step's metadata: each initializer that the
    step holds under its name with its type (weights, buffers, constants) as a header only
    (memsched.inference fills it from the trainer's values), the others with their values."""
    tensors = {}
    for name, t in forward.tensors.items():
        held = step.tensors.get(name)
        if t.is_static and held is not None and held.is_static and (held.shape, held.dtype) == (t.shape, t.dtype):
            t = dataclasses.replace(t, data=header_only(t.data))
        tensors[name] = t
    metadata = {k: v for k, v in forward.metadata.items() if k != FORWARD_KEY}
    model = forward.replace(tensors=tensors, metadata=metadata).to_onnx(load_external_data=False)
    return base64.b64encode(model.SerializeToString()).decode()


def needed_ops(graph: Graph, live: set[str], requiring: set[str]) -> list[Op]:
    """Ops a gradient flows through: an output reaching the loss, an input requiring one."""
    return [op for op in graph.ops
            if any(t in live for t in differentiable_outputs(op, graph.tensors))
            and any(op.inputs[i] in requiring for i in differentiable_positions(op, graph.tensors))]


def emit_updates(em: Emitter, optimizer: str, params: list[str], grads: dict[str, str], hyper: dict,
                 roles: dict[str, dict]) -> list[str]:
    """Each parameter's optimizer update, in order, in phase `update`; records each update op's
    role in `roles`; returns the update outputs."""
    em.phase = "update"
    outputs = []
    for param in params:
        start = len(em.ops)
        outputs += emit_update(em, optimizer, param, grads[param], hyper)
        roles.update({op.name: {"role": "update", "param": param} for op in em.ops[start:]})
    return outputs


def _emit_forward(em: Emitter, graph: Graph, needed: list[Op]) -> None:
    """The forward ops, in training form where a rule says so (BN on batch statistics, ...)."""
    needed_names = {op.name for op in needed}
    for op in graph.ops:
        rule = rule_of(op)
        if rule is not None and rule.forward is not None:
            rule.forward(em, op, op.name in needed_names)
        else:
            em.keep(op)


def _emit_backward(em: Emitter, graph: Graph, needed: list[Op], params: list[str], requiring: set[str],
                   grads: dict[str, str]) -> tuple[dict[str, str], dict[str, dict]]:
    """The backward ops, forward op by forward op in reverse; gradients of a tensor read
    twice are summed as they arrive. Returns (tensor -> its gradient, grad roles)."""
    roles: dict[str, dict] = {}
    finish_at = _last_contribution(graph, needed, params, requiring)
    views = _parameter_views(graph, params)
    done: set[str] = set()   # tensors whose backward has run
    for index in reversed(range(len(needed))):
        op = needed[index]
        start = len(em.ops)
        wants = _wants(graph, op, requiring)
        with em.scope(f"{op.name}/grad"):
            flowing = set(differentiable_outputs(op, graph.tensors))
            produced = rule_of(op).grad(em, op, [grads.get(t) if t in flowing else None
                                                       for t in op.outputs], wants)
            produced = list(produced) + [None] * (len(op.inputs) - len(produced))
            done.update(op.outputs)
            targets = {}
            for name, want, grad in zip(op.inputs, wants, produced):
                if not want:
                    continue
                if grad is None:
                    raise RuntimeError(f"internal error: the {op.op_type} rule gave no gradient for "
                                       f"'{name}' of node '{op.name}'")
                grads[name] = grad if name not in grads else em.op("Add", [grads[name], grad])
                targets[name] = grads[name]
            for param in finish_at.get(index, ()):
                targets[param] = grads[param] = _finish_param_grad(em, grads, param, done)
        _tag_roles(em.ops[start:], op, targets, views, roles)
    return grads, roles


# ---- analysis ---------------------------------------------------------------------------------
def _check_options(loss, optimizer, lr, momentum, betas, eps, weight_decay=0.0) -> dict:
    if loss not in LOSSES:
        raise UserError(f"unknown loss '{loss}'; choose one of {', '.join(LOSSES)}")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer '{optimizer}'; choose one of {', '.join(OPTIMIZERS)}")
    for name, value in (("learning rate", lr), ("eps", eps)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise UserError(f"the {name} must be a positive number, not {value!r}")
    if not (isinstance(lr, (int, float)) and lr < 1e6):
        raise UserError(f"the learning rate must be below 1e6, not {lr!r}")
    if not 0 <= momentum < 1 or not all(0 <= b < 1 for b in betas):
        raise UserError("momentum and Adam betas must lie in [0, 1)")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and 0 <= weight_decay < 1e6):
        raise UserError(f"the weight decay must be a number from 0 up, not {weight_decay!r}")
    return {"lr": float(lr), "momentum": float(momentum), "betas": [float(b) for b in betas], "eps": float(eps),
            "weight_decay": float(weight_decay)}


def _training_opset(graph: Graph) -> int:
    version = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx"))
    if version is None or not MIN_OPSET <= version <= MAX_OPSET:
        raise UserError(f"the model uses ONNX opset {version}; memsched builds training steps for opsets "
                        f"{MIN_OPSET}..{MAX_OPSET} (re-export the model, e.g. with opset_version=17)")
    return max(version, OPSET)


def _reaching_output(graph: Graph, output: str) -> set[str]:
    """Float tensors with a differentiable path to `output`."""
    live = {output}
    for op in reversed(graph.ops):
        if any(t in live for t in differentiable_outputs(op, graph.tensors)):
            live.update(op.inputs[i] for i in differentiable_positions(op, graph.tensors))
    return live


def _trainable(graph: Graph, live: set[str], freeze) -> list[str]:
    """Float parameters that reach the loss, in order of first use; not BN running stats
    (kind buffer), not 0-d scalars (constants of exports), not frozen."""
    patterns = list(freeze)
    order = list(dict.fromkeys(t for op in graph.ops for t in op.present_inputs))
    candidates = [t for t in order if graph.tensors[t].kind == "parameter" and t in live
                  and graph.tensors[t].dtype in FLOAT_TYPES and len(graph.tensors[t].shape or ()) > 0]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(t, pattern) for t in candidates):
            raise UserError(f"--freeze '{pattern}' matches no trainable parameter")
    params = [t for t in candidates if not any(fnmatch.fnmatchcase(t, p) for p in patterns)]
    if not params:
        raise UserError("the model has no trainable parameter that reaches its output"
                        + (" (all are frozen)" if candidates else ""))
    return params


def _requiring_grad(graph: Graph, params: list[str]) -> set[str]:
    """Tensors computed from a trainable parameter through differentiable inputs."""
    requiring = set(params)
    for op in graph.ops:
        if any(op.inputs[i] in requiring for i in differentiable_positions(op, graph.tensors)):
            requiring.update(differentiable_outputs(op, graph.tensors))
    return requiring


def _wants(graph: Graph, op: Op, requiring: set[str]) -> list[bool]:
    positions = set(differentiable_positions(op, graph.tensors))
    return [i in positions and op.inputs[i] in requiring for i in range(len(op.inputs))]


def _check_control_flow(graph: Graph, live: set[str], needed: list[Op]) -> None:
    """Refuse an If, Loop or Scan (any op with a subgraph) that the backward pass would have to
    go through: one in `needed` (a gradient flows into its listed inputs), or one whose outputs
    reach the loss while its subgraph reads main-graph tensors (a parameter read only there
    would silently get no gradient). Control flow whose outputs reach the loss from inputs that
    need no gradient is kept as a forward op."""
    needed_names = {op.name for op in needed}
    for op in graph.ops:
        bodies = subgraphs(op.attributes.values())
        if not bodies:
            continue
        reaches = any(t in live for t in differentiable_outputs(op, graph.tensors))
        captured = list(dict.fromkeys(n for body in bodies for n in captured_names(body)))
        if op.name in needed_names or (reaches and captured):
            why = (f"its subgraph reads {', '.join(repr(n) for n in captured[:3])} from the main graph, "
                   f"whose gradients would be lost" if captured else "a gradient would have to flow through "
                   "its subgraph, and memsched has no gradient rule for subgraphs")
            fix = "" if captured else ", or --freeze the parameters before it"
            raise UserError(f"memsched cannot differentiate through {op.op_type} node '{op.name}' (control "
                            f"flow); {why}: export the model with the control flow unrolled{fix}")


def _check_supported(em: Emitter, needed: list[Op]) -> None:
    """One UserError naming every node the backward pass cannot go through."""
    missing: dict[str, list[str]] = defaultdict(list)
    reasons = []
    for op in needed:
        rule = rule_of(op)
        if rule is None:
            missing[op.op_type if not op.domain else f"{op.domain}.{op.op_type}"].append(op.name)
        elif rule.check is not None:
            reason = rule.check(em, op)
            if reason:
                reasons.append(f"{op.op_type} node '{op.name}': {reason}")
    if not missing and not reasons:
        return
    parts = [f"{op_type} ({'node' if len(names) == 1 else 'nodes'} {', '.join(repr(n) for n in names)})"
             for op_type, names in sorted(missing.items())]
    message = "cannot build the backward pass:"
    if parts:
        message += f" no gradient rule for {'; '.join(parts)}"
    if reasons:
        message += ("; " if parts else " ") + "; ".join(reasons)
    raise UserError(message)


def taken_names(graph: Graph, optimizer: str, params: list[str]) -> list[str]:
    """The names the step gives `params`' gradients, optimizer states and updated values that
    `graph` already uses (the step and the GAN step refuse such a model)."""
    planned = [name for p in params for name in update_outputs(optimizer, p)]
    planned += [f"{p}.{s}" for p in params for s in STATES[optimizer]]
    if optimizer != "none":
        planned += [f"{p}.grad" for p in params]
    return [n for n in planned if n in graph.tensors]


def _last_contribution(graph, needed, params, requiring) -> dict[int, list[str]]:
    """index in `needed` -> parameters whose gradient is complete once that op is done."""
    first: dict[str, int] = {}
    for index, op in enumerate(needed):
        for name, want in zip(op.inputs, _wants(graph, op, requiring)):
            if want and name in params and name not in first:
                first[name] = index
    result: dict[int, list[str]] = defaultdict(list)
    for param in params:
        result[first[param]].append(param)
    return result


# ---- backward bookkeeping --------------------------------------------------------------------
def _finish_param_grad(em: Emitter, grads: dict[str, str], param: str, done: set[str]) -> str:
    """Name the finished gradient of `param` `<param>.grad` (an Identity where it is shared
    with a tensor whose backward is still to come; `done`: tensors whose backward has run, as
    a folded Transpose(W) whose gradient is W's, in W's layout)."""
    grad, name = grads[param], f"{param}.grad"
    shared = any(v == grad for k, v in grads.items() if k != param and k not in done)
    if shared or not em.rename(grad, name):
        em.op("Identity", [grad], outputs=[name])
    return name




def _parameter_views(graph: Graph, params: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Weights as layers see them. Exports feed some weights through view ops (a Linear
    on 3-D input is MatMul(x, Transpose(W)) in a training export), and a weight may be cut
    into parts (a Split or Slice of it: passes.rewrites.concat_split's per-part convolutions): returns
    (tensor -> the parameter it is, views or is a part of, view op -> the one layer its view
    feeds)."""
    weights = {p: p for p in params}
    for op in graph.ops:
        if (op.op_type in WEIGHT_VIEW_OPS or op.op_type in WEIGHT_PART_OPS) and op.inputs and op.inputs[0] in weights:
            weights.update(dict.fromkeys(op.present_outputs, weights[op.inputs[0]]))
    layer_of = {}
    for op in graph.ops:
        if op.op_type in WEIGHT_VIEW_OPS and op.outputs[0] in weights and op.inputs[0] in weights:
            user = op
            while user.op_type in WEIGHT_VIEW_OPS and len(graph.consumers.get(user.outputs[0], [])) == 1:
                user = graph.consumers[user.outputs[0]][0]
            layer_of[op.name] = user.name if user.op_type not in WEIGHT_VIEW_OPS else op.name
    return weights, layer_of


def _tag_roles(ops: list[Op], layer: Op, targets: dict[str, str], views: tuple[dict, dict],
               roles: dict[str, dict]) -> None:
    """Tag each backward op of a layer with a trainable weight (a parameter or a view of
    one): dW (feeds only that parameter's gradient), dX (feeds only input gradients) or
    shared (both). The backward ops of a view of a weight belong to the layer it feeds."""
    weights, layer_of = views
    layer_params = [weights[t] for t in layer.present_inputs if t in weights]
    if not layer_params:
        return
    layer_name = layer_of.get(layer.name, layer.name)
    feeds: dict[str, set[str]] = defaultdict(set)   # tensor -> the inputs whose gradient it feeds
    for name, grad in targets.items():
        feeds[grad].add(f"param:{weights[name]}" if name in weights else name)
    for op in reversed(ops):
        reached = set().union(*(feeds.get(t, set()) for t in op.present_outputs))
        for t in op.present_inputs:
            feeds[t] |= reached
        fed_params = {r[len("param:"):] for r in reached if r.startswith("param:")}
        if not reached:
            continue
        if len(fed_params) == 1 and len(reached) == 1:
            roles[op.name] = {"role": "dW", "layer": layer_name, "param": next(iter(fed_params))}
        else:
            role = "shared" if fed_params else "dX"
            roles[op.name] = {"role": role, "layer": layer_name, "param": layer_params[0]}


# ---- assembly ---------------------------------------------------------------------------------
def _assemble(source: Graph, em: Emitter, extra_inputs, outputs, params, roles, opset, training) -> Graph:
    tensors = em.tensors
    for name, t in tensors.items():
        if t.kind == "output" and name not in outputs:
            t.kind = "activation"
    for op in em.ops:
        if roles.get(op.name, {}).get("role") == "dW":
            for t in op.present_outputs:
                tensors[t].kind = "param_grad"
    for param in params:
        if f"{param}.grad" in tensors:
            tensors[f"{param}.grad"].kind = "param_grad"
    outputs = list(outputs) + list(em.carried)
    for name in em.carried:
        tensors[name].kind = "output"
    inputs = list(source.inputs) + list(extra_inputs)
    used = set(inputs) | set(outputs) | {t for op in em.ops for t in op.present_inputs + op.present_outputs}
    kept = {name: t for name, t in tensors.items() if name in used}
    metadata = dict(source.metadata)
    metadata[GRAD_ROLES_KEY] = json.dumps(roles, sort_keys=True)
    metadata[TRAINING_KEY] = json.dumps({**training, "parameters": params, "inputs": list(extra_inputs),
                                         "hyperparameters": em.hyperparameters,
                                         "buffers": [name.removesuffix(".updated") for name in em.carried]},
                                        sort_keys=True)
    # each BatchNorm's batch statistics and backward sums, for synchronised BatchNorm (memsched.data_parallel)
    statistics = {name: {"forward": [t for t in (saved["mean"], saved["var"]) if t in kept],
                         "backward": [t for t in saved.get("sums", []) if t in kept]}
                  for name, saved in em.saved.items()
                  if name in source.op_by_name
                  and (is_batch_norm(source.op_by_name[name]) or is_chunked_batch_norm(source.op_by_name[name]))}
    if statistics:
        metadata[BATCH_STATISTICS_KEY] = json.dumps(statistics, sort_keys=True)
    return Graph(em.ops, kept, inputs, outputs, name=source.name, opset_imports={"": opset},
                 ir_version=min(max(source.ir_version, IR_VERSION), 10), metadata=metadata,
                 base_dir=source.base_dir, doc_string=source.doc_string)


def describe(graph: Graph) -> dict:
    """What `memsched train-graph` reports about a training step (JSON-able)."""
    info = training_record(graph)
    phases: dict[str, int] = {}
    for op in graph.ops:
        phases[op.phase] = phases.get(op.phase, 0) + 1
    params = [graph.tensors[p] for p in info["parameters"]]
    states = [t for t in graph.tensors.values() if t.kind == "optimizer_state"]
    return {
        "graph": graph.name,
        "loss": info["loss"],
        "optimizer": info["optimizer"],
        "lr": info["lr"],
        "ops": len(graph.ops),
        "phases": phases,
        "inputs": {n: list(graph.tensors[n].shape) for n in graph.inputs},
        "outputs": len(graph.outputs),
        "trainable_parameters": len(params),
        "parameters": sum(t.numel for t in params),
        "parameter_bytes": sum(t.nbytes for t in params),
        "optimizer_state_bytes": sum(t.nbytes for t in states),
    }
