"""Helpers for the autodiff tests: tiny one-op models, ONNX Runtime runs, central differences.

A gradient check builds the training step with optimizer none, runs it once in ONNX Runtime
(CPU) for the analytic gradients `<param>.grad`, and compares them with central differences
of the same graph's `loss`, with the parameters fed as graph inputs.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from memsched.frontend import lower
from memsched.onnx_utils import make_model
from memsched.passes.training import TRAINING_KEY, build_training_step


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def with_inputs(model: onnx.ModelProto, names: list[str], outputs: list[str] | None = None) -> onnx.ModelProto:
    """A copy of `model` whose initializers `names` are graph inputs (so a run can change them);
    with `outputs`, only those outputs and the nodes they need."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = copy.graph
    keep = [t for t in g.initializer if t.name not in names]
    moved = {t.name: t for t in g.initializer if t.name in names}
    del g.initializer[:]
    g.initializer.extend(keep)
    for name in names:
        t = moved[name]
        g.input.append(helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    if outputs is not None:
        by_name = {o.name: o for o in g.output}
        del g.output[:]
        g.output.extend(by_name[o] for o in outputs)
        needed, kept = set(outputs), []
        for node in reversed(g.node):   # drop nodes the kept outputs do not need
            if needed.intersection(node.output):
                needed.update(node.input)
                kept.append(node)
        del g.node[:]
        g.node.extend(reversed(kept))
    return copy


def training_info(graph) -> dict:
    return json.loads(graph.metadata[TRAINING_KEY])


def initial_values(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    inits = {t.name: t for t in model.graph.initializer}
    return {n: numpy_helper.to_array(inits[n]).copy() for n in names}


def check_gradients(model: onnx.ModelProto, feeds: dict | None = None, *, loss: str = "output",
                    rtol: float = 1e-6, atol: float = 1e-9, eps: float = 1e-6, sample: int | None = None,
                    freeze=(), seed: int = 0):
    """Assert analytic == central-difference gradients for every trainable parameter.

    Returns the training Graph. `sample` limits the checked elements per parameter."""
    train = build_training_step(lower(model), loss=loss, optimizer="none", freeze=freeze)
    check_step_gradients(train, feeds, rtol=rtol, atol=atol, eps=eps, sample=sample, seed=seed)
    return train


def check_step_gradients(train, feeds: dict | None = None, *, rtol: float = 1e-6, atol: float = 1e-9,
                         eps: float = 1e-6, sample: int | None = None, seed: int = 0) -> None:
    """Assert that a training step built with optimizer none (`train`) gives every trainable
    parameter's gradient as central differences of its own loss do."""
    feeds = dict(feeds or {})
    proto = train.to_onnx()
    onnx.checker.check_model(proto)
    params = training_info(train)["parameters"]
    wanted = ["loss"] + [f"{p}.grad" for p in params]
    analytic = dict(zip(wanted, session(proto).run(wanted, feeds)))
    values = initial_values(proto, params)
    probe = session(with_inputs(proto, params, outputs=["loss"]))
    rng = np.random.default_rng(seed)

    def loss_at(name, flat_index, delta):
        changed = dict(values)
        changed[name] = values[name].copy()
        changed[name].reshape(-1)[flat_index] += delta
        return float(probe.run(None, {**feeds, **changed})[0])

    for name in params:
        size = values[name].size
        indices = range(size) if sample is None or sample >= size else rng.choice(size, sample, replace=False)
        numeric = np.array([(loss_at(name, i, eps) - loss_at(name, i, -eps)) / (2 * eps) for i in indices])
        got = analytic[f"{name}.grad"].reshape(-1)[list(indices)]
        np.testing.assert_allclose(got, numeric, rtol=rtol, atol=atol, err_msg=f"gradient of '{name}'")


def to_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model in float64: float32 initializers, Constant values and I/O converted."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = copy.graph
    for init in g.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for node in g.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64)))
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    return copy


def check_against_float64(model: onnx.ModelProto, feeds: dict, *, loss: str, rtol: float = 1e-5,
                          agree: float = 1e-3, params: int | None = None, sample: int = 2,
                          eps: float = 1e-5, seed: int = 0, **options) -> dict[str, np.ndarray]:
    """Check the training step of a float32 model through its float64 twin, run by ONNX's
    reference evaluator (so ops ONNX Runtime has no double kernel for are covered):

    1. float64 gradients against central differences of the float64 loss, along one unit
       direction over all parameters (half along the gradient, half random) and at `sample`
       elements of `params` parameters
       (all when None; else spread from first to last), to `rtol`;
    2. the float32 gradients ONNX Runtime computes against the float64 ones: relative L2
       error of each parameter's gradient below `agree` (relative to at least 1e-3 of the
       largest gradient's norm, for gradients that are zero in exact arithmetic).

    Returns the float32 gradients by parameter."""
    from onnx.reference import ReferenceEvaluator

    train = build_training_step(lower(model), loss=loss, optimizer="none", **options)
    proto = train.to_onnx()
    onnx.checker.check_model(proto)
    names = training_info(train)["parameters"]
    grads32 = dict(zip(names, session(proto).run([f"{p}.grad" for p in names], feeds)))
    double = build_training_step(lower(to_double(model)), loss=loss, optimizer="none", **options).to_onnx()
    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    grads64 = dict(zip(names, ReferenceEvaluator(double).run([f"{p}.grad" for p in names], feeds64)))
    floor = 1e-3 * max(np.linalg.norm(g) for g in grads64.values())  # for gradients that are ~0
    for p in names:
        error = np.linalg.norm(grads32[p] - grads64[p]) / max(np.linalg.norm(grads64[p]), floor)
        assert error < agree, f"float32 gradient of '{p}' is off by {error:.2e} (relative L2)"

    probe = ReferenceEvaluator(with_inputs(double, names, outputs=["loss"]))
    values = initial_values(double, names)
    rng = np.random.default_rng(seed)

    def loss_at(delta: dict) -> float:
        moved = {p: values[p] + delta[p] if p in delta else values[p] for p in names}
        return float(probe.run(None, {**feeds64, **moved})[0])

    # half along the gradient (so the derivative is far above the loss's rounding noise), half
    # random (so errors orthogonal to it count too)
    def unit(vectors):
        norm = np.sqrt(sum((v * v).sum() for v in vectors.values()))
        return {p: v / norm for p, v in vectors.items()}

    along, noise = unit(grads64), unit({p: rng.standard_normal(values[p].shape) for p in names})
    direction = unit({p: along[p] + noise[p] for p in names})
    numeric = (loss_at({p: eps * d for p, d in direction.items()})
               - loss_at({p: -eps * d for p, d in direction.items()})) / (2 * eps)
    analytic = sum(float((grads64[p] * direction[p]).sum()) for p in names)
    np.testing.assert_allclose(analytic, numeric, rtol=rtol,
                               err_msg="directional derivative")
    chosen = names if params is None or params >= len(names) else [
        names[round(i * (len(names) - 1) / (params - 1))] for i in range(params)] if params > 1 else names[:1]
    scale = max(np.abs(g).max() for g in grads64.values())   # FD noise does not shrink with a gradient
    for p in chosen:
        for index in rng.choice(values[p].size, min(sample, values[p].size), replace=False):
            step = np.zeros(values[p].shape)
            step.reshape(-1)[index] = eps
            numeric = (loss_at({p: step}) - loss_at({p: -step})) / (2 * eps)
            np.testing.assert_allclose(grads64[p].reshape(-1)[index], numeric, rtol=rtol, atol=rtol * scale,
                                       err_msg=f"gradient of '{p}' at flat index {index}")
    return grads32


def one_op_model(op_type: str, inputs: list, attrs: dict | None = None, outputs: int = 1,
                 seed: int = 1, opset: int = 17) -> onnx.ModelProto:
    """A model of one `op_type` node fed by initializers, and a scalar output
    sum_i sum(y_i * r_i) with fixed random r_i (so every output element matters).

    `inputs` holds numpy arrays (float ones are trainable parameters unless 0-d) or '' for
    an absent optional input."""
    rng = np.random.default_rng(seed)
    inits, names = [], []
    for i, value in enumerate(inputs):
        if isinstance(value, str):
            names.append(value)
            continue
        name = f"in{i}"
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        names.append(name)
    ys = [f"y{i}" for i in range(outputs)]
    nodes = [helper.make_node(op_type, names, ys, name="op", **(attrs or {}))]
    model = make_model(helper.make_graph(nodes, "one_op", [], [helper.make_tensor_value_info(
        y, TensorProto.UNDEFINED, None) for y in ys], inits), opset=opset)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    types = {vi.name: vi.type.tensor_type for vi in inferred.graph.output}
    terms = []
    for y in ys:
        shape = [d.dim_value for d in types[y].shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(types[y].elem_type)
        weight = f"r_{y}"
        nodes.append(helper.make_node("Constant", [], [weight], value=numpy_helper.from_array(
            rng.standard_normal(shape).astype(dtype), weight)))
        nodes.append(helper.make_node("Mul", [y, weight], [f"{y}_weighted"]))
        nodes.append(helper.make_node("ReduceSum", [f"{y}_weighted"], [f"{y}_sum"], keepdims=0))
        terms.append(f"{y}_sum")
    nodes.append(helper.make_node("Sum", terms, ["out"]))
    out_type = types[ys[0]].elem_type
    graph = helper.make_graph(nodes, "one_op", [], [helper.make_tensor_value_info("out", out_type, [])], inits)
    return make_model(graph, opset=opset)


def train_losses(model: onnx.ModelProto, feeds: dict, steps: int = 20, **options) -> list[float]:
    """Run `steps` training steps on a fixed batch, feeding updated parameters and states
    back; return the loss of each step."""
    train = build_training_step(lower(model), **options)
    proto = train.to_onnx()
    onnx.checker.check_model(proto)
    carried = [o[: -len(".updated")] for o in train.outputs if o.endswith(".updated")]
    values = initial_values(proto, carried)
    run = session(with_inputs(proto, carried))
    names = ["loss"] + [f"{n}.updated" for n in carried]
    losses = []
    for _ in range(steps):
        results = dict(zip(names, run.run(names, {**feeds, **values})))
        losses.append(float(results["loss"]))
        values = {n: results[f"{n}.updated"] for n in carried}
    return losses
