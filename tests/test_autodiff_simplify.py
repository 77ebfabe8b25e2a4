"""No-op nodes (Identity, Dropout that drops nothing) are left out of the training step: its
peak falls to that of the same model written without them, and its gradients do not change."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memsched.frontend import lower
from memsched.memory import analyze_plan
from memsched.onnx_utils import make_model
from memsched.schedule import Plan
from memsched.passes.training import build_training_step, builder
from memsched.passes.training.simplify import drop_no_ops
from tests.gradcheck import session, training_info

BATCH, WIDTH, CLASSES = 32, 256, 10


def _mlp(no_ops: bool, training_dropout: bool = False) -> onnx.ModelProto:
    """x -> fc1 -> [Identity] -> Relu -> [Dropout] -> fc2 -> [Identity] -> logits; the
    Dropouts are eval-form (no training_mode), ratio 0 in training mode, and eval-form with a
    constant training_mode false. With `training_dropout`, one more Dropout really drops."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.1, "fc1.weight"),
             numpy_helper.from_array(rng.standard_normal((WIDTH, CLASSES)).astype(np.float32) * 0.1, "fc2.weight"),
             numpy_helper.from_array(np.asarray(0.1, np.float32), "ratio"),
             numpy_helper.from_array(np.asarray(0.0, np.float32), "zero_ratio"),
             numpy_helper.from_array(np.asarray(True), "train"),
             numpy_helper.from_array(np.asarray(0.3, np.float32), "drop_ratio")]
    nodes = [helper.make_node("MatMul", ["x", "fc1.weight"], ["h"], name="fc1")]
    last = "h"

    def through(op_type, inputs, name, **attrs):
        nonlocal last
        if no_ops:
            nodes.append(helper.make_node(op_type, [last] + inputs, [f"{name}_out"], name=name, **attrs))
            last = f"{name}_out"

    through("Identity", [], "id1")
    nodes.append(helper.make_node("Relu", [last], ["r"], name="relu"))
    last = "r"
    through("Dropout", ["ratio"], "drop_eval")
    through("Dropout", ["zero_ratio", "train"], "drop_zero")
    if no_ops:
        nodes.append(helper.make_node("Constant", [], ["off"], name="off", value=numpy_helper.from_array(
            np.asarray(False), "off")))
    through("Dropout", ["ratio", "off"], "drop_off")
    if training_dropout:
        nodes.append(helper.make_node("Dropout", [last, "drop_ratio", "train"], ["d", "mask"], name="drop", seed=1))
        last = "d"
    nodes.append(helper.make_node("MatMul", [last, "fc2.weight"], ["logits" if not no_ops else "m"], name="fc2"))
    if no_ops:
        nodes.append(helper.make_node("Identity", ["m"], ["logits"], name="id2"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, CLASSES])], inits)
    return make_model(graph)


def _peak(step) -> int:
    return analyze_plan(Plan.initial(step)).peak_bytes


def _gradients(step, feeds) -> dict[str, np.ndarray]:
    names = [f"{p}.grad" for p in training_info(step)["parameters"]]
    return dict(zip(names, session(step.to_onnx()).run(names, feeds)))


def _feeds():
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
            "labels": rng.integers(0, CLASSES, BATCH)}


def test_no_op_nodes_leave_the_step_and_its_peak_falls(monkeypatch):
    noisy, clean = lower(_mlp(True)), lower(_mlp(False))
    step = build_training_step(noisy, optimizer="none")
    assert {op.op_type for op in step.ops if op.phase == "forward"} == {"MatMul", "Relu"}
    reference = build_training_step(clean, optimizer="none")
    assert _peak(step) == _peak(reference)
    monkeypatch.setattr(builder, "drop_no_ops", lambda graph: graph)
    kept = build_training_step(noisy, optimizer="none")
    assert {"Identity", "Dropout"} <= {op.op_type for op in kept.ops if op.phase == "forward"}
    assert _peak(step) < _peak(kept)
    feeds = _feeds()
    for name, grad in _gradients(kept, feeds).items():
        np.testing.assert_array_equal(_gradients(step, feeds)[name], grad)
        np.testing.assert_array_equal(_gradients(reference, feeds)[name], grad)


def test_the_graph_output_keeps_its_name_and_a_dropping_dropout_stays():
    graph = drop_no_ops(lower(_mlp(True, training_dropout=True)))
    assert graph.outputs == ["logits"]
    assert graph.producer["logits"].op_type == "MatMul"
    assert [op.name for op in graph.ops if op.op_type in ("Dropout", "Identity", "Constant")] == ["drop"]
    assert "off" not in graph.tensors and "ratio" not in graph.tensors and "drop_ratio" in graph.tensors
    assert graph.is_topological()
    onnx.checker.check_model(graph.to_onnx())


def test_an_identity_from_input_to_output_stays():
    node = helper.make_node("Identity", ["x"], ["y"], name="id")
    graph = lower(make_model(helper.make_graph(
        [node], "pass", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])))
    assert drop_no_ops(graph) is graph
