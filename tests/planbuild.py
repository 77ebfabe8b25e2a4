"""Hand-built graphs and plans for the emitter and executor tests.

Plans use every kind of step (compute, recompute, swap_out/swap_in to both tiers, free,
in-place aliases, parameters that start on the host). Offsets come from the real placement
pass; the order and reuse strategies are the real passes. Recompute and swap plans are made
by hand here (`with_recomputes`, `with_swaps`: the memory model picks the valid candidates)
until passes/recompute and passes/swap exist.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from memsched import frontend
from memsched.onnx_utils import make_model
from memsched.schedule import Plan, compute, default_schedule, free, recompute, swap_in, swap_out
from memsched.passes.order import order_pass
from memsched.passes.placement import place_pass
from memsched.passes.reuse import reuse_pass

PASS_SECONDS = 1.0   # solver time limit per pass in tests


def place(plan: Plan) -> Plan:
    """The plan with arena offsets from the placement pass."""
    return place_pass(dataclasses.replace(plan, offsets=None), PASS_SECONDS)


def lower_graph(nodes, inputs, outputs, initializers, name):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    return frontend.lower(make_model(graph))


def cnn_graph(batch: int = 2, seed: int = 0, dtype=np.float32):
    """Conv-BN-Relu-MaxPool-Conv-Relu-GAP-Gemm, inference: numerics of real kernels."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape).astype(np.float32) * 0.3).astype(dtype), name)

    inits = [init("w1", 8, 3, 3, 3), init("b1", 8), init("w2", 16, 8, 3, 3), init("fc", 10, 16), init("fcb", 10),
             numpy_helper.from_array((np.abs(rng.standard_normal(8)).astype(np.float32) + 0.5).astype(dtype),
                                     "bn_var"),
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
    return lower_graph(nodes, [helper.make_tensor_value_info("x", elem, [batch, 3, 12, 12])],
                  [helper.make_tensor_value_info("logits", elem, [batch, 10])], inits, "cnn")


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
    graph = lower_graph(forward + loss + backward + update,
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
    """The graph's own order, placed."""
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


# ---- generic hand-made strategies for any training graph -----------------------------------
FORWARD_PHASES = ("forward", "loss")


def _first_and_last_readers(schedule, graph, tensor):
    """Indices of the last forward-phase reader and the first backward/update reader of `tensor`."""
    last_forward = first_backward = None
    for i, step in enumerate(schedule):
        if step.kind not in ("compute", "recompute"):
            continue
        op = graph.op_by_name[step.target]
        if tensor in op.present_outputs and last_forward is None:
            last_forward = i
        if tensor in op.present_inputs:
            if op.phase in FORWARD_PHASES:
                last_forward = i
            elif first_backward is None:
                first_backward = i
    return last_forward, first_backward


def _candidates(plan, every):
    """Forward activations read again in backward, every `every`-th one, largest first."""
    graph = plan.graph
    names = [t for op in graph.ops if op.phase == "forward" and op.op_type not in ("Dropout", "Constant")
             for t in op.present_outputs if graph.tensors[t].kind == "activation"
             and any(c.phase not in FORWARD_PHASES for c in graph.consumers.get(t, []))]
    return sorted(names[::every], key=lambda t: -graph.tensors[t].nbytes)


def _keep_if_valid(plan, schedule, on_host=None) -> bool:
    from memsched.errors import ScheduleError
    from memsched.memory import analyze

    try:
        analyze(plan.graph, schedule, plan.aliases, plan.on_host if on_host is None else on_host)
    except ScheduleError:
        return False
    return True


def with_recomputes(plan: Plan, every: int = 2) -> Plan:
    """Replay the producers of some forward activations right before their first backward
    reader (candidates the memory model rejects, e.g. whose inputs are gone, are skipped)."""
    schedule = list(plan.schedule)
    for t in _candidates(plan, every):
        producer = plan.graph.producer[t].name
        _, first_backward = _first_and_last_readers(schedule, plan.graph, t)
        trial = schedule[:first_backward] + [recompute(producer)] + schedule[first_backward:]
        if _keep_if_valid(plan, trial):
            schedule = trial
    return place(dataclasses.replace(plan, schedule=schedule, offsets=None))


def with_swaps(plan: Plan, every: int = 2) -> Plan:
    """Swap some forward activations out after their last forward reader and back in before
    their first backward reader, alternating DRAM and NVDIMM; the largest parameter starts on
    the host and is swapped in before its first use."""
    graph = plan.graph
    schedule = list(plan.schedule)
    for k, t in enumerate(_candidates(plan, every)):
        tier = ("dram", "nvdimm")[k % 2]
        last_forward, first_backward = _first_and_last_readers(schedule, graph, t)
        trial = (schedule[:last_forward + 1] + [swap_out(t, tier)] + schedule[last_forward + 1:first_backward]
                 + [swap_in(t, tier)] + schedule[first_backward:])
        if _keep_if_valid(plan, trial):
            schedule = trial
    on_host = set(plan.on_host)
    params = sorted(graph.parameters(), key=lambda p: -p.nbytes)
    if params:
        p = params[0].name
        first = next(i for i, s in enumerate(schedule) if s.kind in ("compute", "recompute")
                     and p in graph.op_by_name[s.target].present_inputs)
        trial = schedule[:first] + [swap_in(p, "dram")] + schedule[first:]
        if _keep_if_valid(plan, trial, frozenset(on_host | {p})):
            schedule, on_host = trial, on_host | {p}
    return place(dataclasses.replace(plan, schedule=schedule, on_host=frozenset(on_host), offsets=None))


def strategy_plans(graph) -> dict[str, Plan]:
    """Each strategy set on top of the last: order; + reuse; + recompute; + swap (by hand)."""
    base = Plan.initial(graph)
    ordered = order_pass(base, PASS_SECONDS)
    reused = order_pass(reuse_pass(base), PASS_SECONDS)
    return {"order": place(ordered), "reuse": place(reused), "recompute": with_recomputes(reused),
            "swap": with_swaps(reused)}


def training_graph(name: str, optimizer: str = "sgd"):
    """The training step of a bundled network at its small test size."""
    from memsched.passes.training import build_training_step

    return build_training_step(small_model(name), loss="cross_entropy", optimizer=optimizer)


def all_plans(graph) -> dict[str, Plan]:
    return {"order": order_plan(graph), "reuse": reuse_plan(graph), "recompute": recompute_plan(graph),
            "swap": swap_plan(graph)}


def with_step_inserted(plan: Plan, index: int, step) -> Plan:
    schedule = list(plan.schedule)
    schedule.insert(index, step)
    return dataclasses.replace(plan, schedule=schedule)


__all__ = ["place", "cnn_graph", "mlp_train_graph", "order_plan", "reuse_plan", "recompute_plan", "swap_plan",
           "all_plans", "with_step_inserted", "edit_plan_metadata", "with_recomputes", "with_swaps", "strategy_plans",
           "training_graph", "small_model", "SMALL_MODELS", "compute"]


def edit_plan_metadata(path, edit, reseal: bool = False) -> None:
    """Rewrite the `memsched.plan` JSON of an emitted file in place, as a user with a text
    editor would: `edit(document)` changes the dict. With `reseal`, the digest is computed
    again afterwards, as a deliberate tamperer would (to reach the checks behind it)."""
    import json

    import onnx

    from memsched.emit import PLAN_KEY, plan_digest

    model = onnx.load(str(path))
    for prop in model.metadata_props:
        if prop.key == PLAN_KEY:
            document = json.loads(prop.value)
            edit(document)
            if reseal:
                document["graph_sha256"] = plan_digest(model, document)
            prop.value = json.dumps(document)
    onnx.save_model(model, str(path))


# every bundled network at a size small enough to run op by op in a test
SMALL_MODELS = {
    "mlp": dict(batch=4),
    "vgg16": dict(batch=1, size=32, classes=10, hidden=64),
    "resnet18": dict(batch=2, size=32, classes=10),
    "resnet50": dict(batch=1, size=32, classes=10),
    "mobilenetv2": dict(batch=2, size=32, classes=10),
    "unet2d": dict(batch=1, size=32, width=8, depth=2),
    "unet3d": dict(batch=1, size=16, width=4, depth=2),
    "bert-base": dict(batch=2, seq=16, layers=2, hidden=64, heads=4, vocab=100, max_positions=32),
    "gpt2": dict(batch=2, seq=16, layers=2, hidden=64, heads=4, vocab=100, max_positions=32),
}


def small_model(name: str, **extra):
    """A bundled network at its small test size, lowered to a Graph."""
    from memsched import models

    return frontend.lower(models.build(name, **{**SMALL_MODELS[name], **extra}))
