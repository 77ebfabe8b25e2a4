"""Tiny hand-written ONNX graphs for tests (exact byte figures are easy to work out by hand)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from memsched.onnx_utils import make_model


def mlp_model(batch: int | str = 2, width: int = 4) -> "onnx.ModelProto":
    """x[b,4] -> MatMul W1[4,w] -> Relu -> MatMul W2[w,3] -> y[b,3]."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, width)).astype(np.float32), "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((width, 3)).astype(np.float32), "W2")
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "W2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])], [w1, w2])
    return make_model(graph)


def reshape_model() -> "onnx.ModelProto":
    """Shape arithmetic as torch exports it: Shape -> Gather -> Unsqueeze -> Concat -> Reshape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Constant", [], ["zero"], name="c0", value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="unsq"),
        helper.make_node("Constant", [], ["minus1"], name="c1",
                         value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Concat", ["n1", "minus1"], ["newshape"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "newshape"], ["flat"], name="reshape"),
        helper.make_node("Dropout", ["flat"], ["d"], name="dropout"),
        helper.make_node("Identity", ["d"], ["y"], name="identity"),
    ]
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    graph = helper.make_graph(nodes, "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [axes])
    return make_model(graph)
