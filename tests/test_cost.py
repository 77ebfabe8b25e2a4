"""The cost model: FLOPs and bytes worked out by hand, roofline times, measured tables."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import frontend, hardware
from memsched.cost import CostTable, op_cost, op_time, roofline_time, signature
from memsched.errors import UserError
from memsched.onnx_utils import make_model


def single(node, inputs, output, initializers=()):
    vis = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    out = helper.make_tensor_value_info(output, TensorProto.FLOAT, None)
    g = frontend.lower(make_model(helper.make_graph([node], "one", vis, [out], list(initializers))))
    return g.ops[0], g


def conv():
    w = numpy_helper.from_array(np.zeros((8, 3, 3, 3), np.float32), "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return single(node, [("x", [1, 3, 8, 8])], "y", [w, b])


HW = dataclasses.replace(hardware.load("v100-16gb"), peak_flops={"float32": 1e9}, memory_bandwidth=1e6,
                         launch_overhead=5e-6)


def test_conv_flops_and_bytes_by_hand():
    op, g = conv()
    c = op_cost(op, g)
    # Y = 1x8x8x8 = 512 outputs, each 3*3*3 = 27 multiply-adds, plus the bias add
    assert c.flops == 2 * 512 * 27 + 512 == 28160
    # read x (192 floats), w (216), b (8); write y (512)
    assert c.bytes == 4 * (192 + 216 + 8 + 512) == 3712
    assert (c.op_class, c.dtype) == ("conv", "float32")
    assert roofline_time(op, g, HW) == max(28160 / 1e9, 3712 / 1e6) + 5e-6    # memory bound here
    fast_memory = dataclasses.replace(HW, memory_bandwidth=1e9)
    assert roofline_time(op, g, fast_memory) == 28160 / 1e9 + 5e-6           # compute bound
    # op_time keeps a graph's times per hardware profile: each profile gets its own
    assert [op_time(op, g, hw) for hw in (HW, fast_memory, HW)] == \
        [roofline_time(op, g, HW), roofline_time(op, g, fast_memory), roofline_time(op, g, HW)]


def test_batched_matmul_flops_and_bytes_by_hand():
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")
    op, g = single(node, [("a", [2, 3, 4, 5]), ("b", [5, 6])], "y")
    c = op_cost(op, g)
    assert g.tensors["y"].shape == (2, 3, 4, 6)
    assert c.flops == 2 * (2 * 3 * 4 * 6) * 5 == 1440
    assert c.bytes == 4 * (120 + 30 + 144) == 1176 and c.op_class == "gemm"
    calibrated = dataclasses.replace(HW, op_class_flops={"gemm": 2e9}, op_class_bandwidth={"gemm": 1e7})
    assert op_time(op, g, calibrated) == max(1440 / 2e9, 1176 / 1e7) + 5e-6


def test_gemm_transposed_and_conv_transpose():
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], name="gemm", transA=1)
    op, g = single(node, [("a", [7, 4]), ("b", [7, 5]), ("c", [5])], "y")
    assert op_cost(op, g).flops == 2 * 4 * 5 * 7 + 4 * 5
    w = numpy_helper.from_array(np.zeros((3, 2, 4, 4), np.float32), "w")
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up", strides=[2, 2], pads=[1, 1, 1, 1])
    op, g = single(node, [("x", [1, 3, 5, 5])], "y", [w])
    # every input element scatters into C_out * 4 * 4 outputs
    assert op_cost(op, g).flops == 2 * 75 * 2 * 16


def test_shape_ops_cost_nothing_and_gathers_read_only_their_rows():
    node = helper.make_node("Flatten", ["x"], ["y"], name="flat")
    op, g = single(node, [("x", [4, 5, 6])], "y")
    assert op_cost(op, g).bytes == 0 and roofline_time(op, g, HW) == 0.0
    table = numpy_helper.from_array(np.zeros((1000, 16), np.float32), "table")
    idx = numpy_helper.from_array(np.zeros(10, np.int64), "idx")
    node = helper.make_node("Gather", ["table", "idx"], ["y"], name="emb")
    op, g = single(node, [], "y", [table, idx])
    assert op_cost(op, g).bytes == 10 * 8 + 2 * 10 * 16 * 4 and op_cost(op, g).flops == 0


def test_pool_norm_softmax_reduction_flops():
    cases = [
        (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2]), [1, 2, 9, 9], 2 * 16 * 9),
        (helper.make_node("GlobalAveragePool", ["x"], ["y"]), [1, 2, 9, 9], 162),
        (helper.make_node("Softmax", ["x"], ["y"], axis=-1), [4, 10], 4 * 40),
        (helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0), [4, 10], 40),
        (helper.make_node("LayerNormalization", ["x", "s"], ["y"], axis=-1), [4, 10], 5 * 40),
    ]
    for node, shape, flops in cases:
        node.name = node.op_type
        inits = [numpy_helper.from_array(np.ones(10, np.float32), "s")] if "s" in node.input else []
        op, g = single(node, [("x", shape)], "y", inits)
        assert op_cost(op, g).flops == flops, node.op_type


def test_cost_table_round_trip_and_signature_fallback(tmp_path):
    op, g = conv()
    table = CostTable({"conv": 0.5}, {signature(op, g): 0.25}, {"device": "cpu"})
    path = table.save(tmp_path / "costs.json")
    loaded = CostTable.load(path)
    assert loaded == table and op_time(op, g, loaded) == 0.5
    by_sig = CostTable({}, {signature(op, g): 0.25})
    assert op_time(op, g, by_sig) == 0.25           # an op of the same signature, another name
    with pytest.raises(UserError, match="no time for op 'conv'"):
        op_time(op, g, CostTable({}))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(UserError, match="not a memsched cost table"):
        CostTable.load(tmp_path / "junk.json")


def test_signature_separates_shapes_and_constant_values():
    shape_a = numpy_helper.from_array(np.array([4, 6], np.int64), "s")
    shape_b = numpy_helper.from_array(np.array([6, 4], np.int64), "s")
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="r")
    sig_a = signature(*single(node, [("x", [24])], "y", [shape_a]))
    sig_b = signature(*single(node, [("x", [24])], "y", [shape_b]))
    assert sig_a != sig_b
    assert sig_a == signature(*single(node, [("x", [24])], "y", [shape_a]))
