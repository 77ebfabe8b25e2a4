"""Hand-built graphs and plans for the emitter and executor tests.

Plans use every kind of step (compute, recompute, swap_out/swap_in to both tiers, free,
in-place aliases, parameters that start on the host). Offsets come from a first-fit
placement written here, because the real placement pass lives in passes/ (see
`place`)."""
from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from memsched import frontend
from memsched.memory import analyze_plan, buffers
from memsched.onnx_utils import make_model
from memsched.schedule import Plan, compute, default_schedule, free, recompute, swap_in, swap_out

ALIGN = 64


def place(plan: Plan) -> Plan:
    """First-fit offsets for the plan's buffers (64-byte aligned), reusing freed space."""
    profile = analyze_plan(plan)
    placed: list[tuple[int, int, int, int]] = []   # first, last, lo, hi
    offsets = {}
    for key, first, last, nbytes in sorted(buffers(profile), key=lambda b: (b[1], -b[3], b[0])):
        if nbytes == 0:
            continue
        busy = sorted((lo, hi) for f, l, lo, hi in placed if f <= last and first <= l)
        offset = 0
        for lo, hi in busy:
            if offset + nbytes <= lo:
                break
            offset = max(offset, -(-hi // ALIGN) * ALIGN)
        offsets[key] = offset
        placed.append((first, last, offset, offset + nbytes))
    return dataclasses.replace(plan, offsets=offsets)


def _lower(nodes, inputs, outputs, initializers, name):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    return frontend.lower(make_model(graph))


def cnn_graph(batch: int = 2, seed: int = 0):
    """Conv-BN-Relu-MaxPool-Conv-Relu-GAP-Gemm, inference: numerics of real kernels."""
    rng = np.random.default_rng(seed)

    def init(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    inits = [init("w1", 8, 3, 3, 3), init("b1", 8), init("w2", 16, 8, 3, 3), init("fc", 10, 16), init("fcb", 10),
             numpy_helper.from_array(np.abs(rng.standard_normal(8)).astype(np.float32) + 0.5, "bn_var"),
             init("bn_scale", 8), init("bn_bias", 8), init("bn_mean", 8)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n1"], name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["logits"], name="fc", transB=1),
    ]
    return _lower(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [batch, 3, 12, 12])],
                  [helper.make_tensor_value_info("logits", TP.FLOAT, [batch, 10])], inits, "cnn")


def mlp_train_graph(batch: int = 4, d_in: int = 6, hidden: int = 8, d_out: int = 3, lr: float = 0.1, seed: int = 0):
    """A hand-written SGD training step of a 2-layer MLP with MSE loss.

    Outputs: loss and `<param>.updated` for W1, b1, W2, b2, as autodiff names them."""
    rng = np.random.default_rng(seed)

    def init(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.5, name)

    def const(name, value, dtype=np.float32):
        return helper.make_node("Constant", [], [name], name=f"const_{name}",
                                value=numpy_helper.from_array(np.asarray(value, dtype=dtype), name))

    node = helper.make_node
    forward = [
        node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        node("Add", ["h", "b1"], ["a"], name="add1"),
        node("Relu", ["a"], ["r"], name="relu"),
        node("MatMul", ["r", "W2"], ["o"], name="mm2"),
        node("Add", ["o", "b2"], ["p"], name="add2"),
    ]
    loss = [
        node("Sub", ["p", "y"], ["d"], name="diff"),
        node("Mul", ["d", "d"], ["sq"], name="square"),
        node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0),
    ]
    backward = [
        const("scale", 2.0 / (batch * d_out)),
        node("Mul", ["d", "scale"], ["dp"], name="dloss"),
        const("axis0", [0], np.int64),
        node("ReduceSum", ["dp", "axis0"], ["b2.grad"], name="db2", keepdims=0),
        node("Transpose", ["r"], ["rT"], name="rT"),
        node("MatMul", ["rT", "dp"], ["W2.grad"], name="dW2"),
        node("Transpose", ["W2"], ["W2T"], name="W2T"),
        node("MatMul", ["dp", "W2T"], ["dr"], name="dr"),
        const("zero", 0.0),
        node("Greater", ["a", "zero"], ["mask"], name="mask"),
        node("Where", ["mask", "dr", "zero"], ["da"], name="drelu"),
        node("ReduceSum", ["da", "axis0"], ["b1.grad"], name="db1", keepdims=0),
        node("Transpose", ["x"], ["xT"], name="xT"),
        node("MatMul", ["xT", "da"], ["W1.grad"], name="dW1"),
    ]
    update = [const("lr", lr)]
    for p in ("W1", "b1", "W2", "b2"):
        update += [node("Mul", [f"{p}.grad", "lr"], [f"{p}.step"], name=f"{p}.scale"),
                   node("Sub", [p, f"{p}.step"], [f"{p}.updated"], name=f"{p}.update")]
    inits = [init("W1", d_in, hidden), init("b1", hidden), init("W2", hidden, d_out), init("b2", d_out)]
    shapes = {"W1": [d_in, hidden], "b1": [hidden], "W2": [hidden, d_out], "b2": [d_out]}
    outputs = [helper.make_tensor_value_info("loss", TP.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(f"{p}.updated", TP.FLOAT, s) for p, s in shapes.items()]
    graph = _lower(forward + loss + backward + update,
                   [helper.make_tensor_value_info("x", TP.FLOAT, [batch, d_in]),
                    helper.make_tensor_value_info("y", TP.FLOAT, [batch, d_out])], outputs, inits, "mlp_train")
    phases = {**{n.name: "forward" for n in forward}, **{n.name: "loss" for n in loss},
              **{n.name: "backward" for n in backward}, **{n.name: "update" for n in update}}
    ops = [dataclasses.replace(op, phase=phases[op.name]) for op in graph.ops]
    tensors = {name: dataclasses.replace(t) for name, t in graph.tensors.items()}
    for name, t in tensors.items():
        if name.endswith(".grad"):
            t.kind = "param_grad"
        elif name in ("dp", "dr", "da", "rT", "W2T", "xT", "mask") or name.endswith(".step"):
            t.kind = "gradient"
    return graph.replace(ops=ops, tensors=tensors)


# ---- plans ------------------------------------------------------------------------------
def order_plan(graph, budget=None) -> Plan:
    """The default order, placed."""
    return place(Plan.initial(graph, budget=budget))


def reuse_plan(graph) -> Plan:
    """Default order, every allowed in-place alias of the training step taken, placed."""
    aliases = {"p": "o", "d": "p", "da": "dr", "W1.updated": "W1", "b1.updated": "b1", "W2.updated": "W2",
               "b2.updated": "b2"}
    return place(Plan(graph, default_schedule(graph), aliases={k: v for k, v in aliases.items() if k in graph.tensors}))


def recompute_plan(graph) -> Plan:
    """Drop the forward activations h, a, r after forward; recompute them for backward."""
    steps = []
    for s in default_schedule(graph):
        if s.target == "rT":
            steps += [recompute("mm1"), recompute("add1"), recompute("relu")]
        steps.append(s)
    plan = Plan(graph, steps, aliases={"W1.updated": "W1", "W2.updated": "W2"})
    return place(plan)


def swap_plan(graph) -> Plan:
    """Swap a (DRAM) and W1 (NVDIMM) out after forward and back for backward; b2 starts on the
    host; an explicit free of h; a recompute of relu after a swap-in of a."""
    steps = []
    for s in default_schedule(graph):
        if s.target == "xT":
            steps += [swap_in("W1", "nvdimm")]
        if s.target == "add2":
            steps += [swap_in("b2", "dram")]
        if s.target == "rT":
            steps += [swap_in("a", "dram"), recompute("relu")]
        steps.append(s)
        if s.target == "mm1":
            steps += [swap_out("W1", "nvdimm")]
        if s.target == "add1":
            steps += [free("h")]
        if s.target == "relu":
            steps += [swap_out("a", "dram")]
    return place(Plan(graph, steps, aliases={"W2.updated": "W2"}, on_host=frozenset({"b2"})))


def all_plans(graph) -> dict[str, Plan]:
    return {"order": order_plan(graph), "reuse": reuse_plan(graph), "recompute": recompute_plan(graph),
            "swap": swap_plan(graph)}


def with_step_inserted(plan: Plan, index: int, step) -> Plan:
    schedule = list(plan.schedule)
    schedule.insert(index, step)
    return dataclasses.replace(plan, schedule=schedule)


__all__ = ["place", "cnn_graph", "mlp_train_graph", "order_plan", "reuse_plan", "recompute_plan", "swap_plan",
           "all_plans", "with_step_inserted", "edit_plan_metadata", "compute"]


def edit_plan_metadata(path, edit) -> None:
    """Rewrite the `memsched.plan` JSON of an emitted file in place, as a user with a text
    editor would: `edit(document)` changes the dict."""
    import json

    import onnx

    from memsched.emit import PLAN_KEY

    model = onnx.load(str(path))
    for prop in model.metadata_props:
        if prop.key == PLAN_KEY:
            document = json.loads(prop.value)
            edit(document)
            prop.value = json.dumps(document)
    onnx.save_model(model, str(path))
