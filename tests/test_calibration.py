"""The calibrated cost model: per-class lines fitted exactly from synthetic timings, the shape
classes and broadcast loops they price, and spec-sheet profiles left on the roofline."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import frontend, hardware
from memsched.cost import (FLOP_CLASSES, LOOP_CLASSES, OP_CLASSES, broadcast_loops, fit_class_costs, fitted_time,
                           op_cost, profile_class, roofline_time)
from memsched.measure import fit_figures, graph_rows
from memsched.onnx_utils import make_model

# known lines: overhead (s), FLOP/s, bytes/s, s per broadcast loop
TRUE = {"conv": (2e-6, 80e9, 20e9, None), "conv_wgrad": (0.0, 30e9, 5e9, None), "gemm": (3e-7, 100e9, 60e9, None),
        "elementwise": (2.5e-7, None, 40e9, 1e-8), "softmax": (7e-6, None, 9e9, None), "data": (1e-6, None, 25e9, None)}


def synthetic_rows(rng) -> list[dict]:
    """Rows timed exactly by the TRUE lines, at work spread over three decades, some rows summing ops."""
    rows = []
    for cls, (overhead, flops_rate, bw, loop) in TRUE.items():
        for _ in range(12):
            ops = int(rng.integers(1, 5))
            flops = int(rng.integers(1e5, 1e9)) if cls in FLOP_CLASSES else 0
            nbytes = int(rng.integers(1e4, 1e8))
            loops = int(rng.integers(0, 1e5)) if cls in LOOP_CLASSES and rng.random() < 0.6 else 0
            seconds = ops * overhead + (flops / flops_rate if flops_rate else 0) + nbytes / bw \
                + (loops * loop if loop else 0)
            rows.append({"class": cls, "ops": ops, "flops": flops, "bytes": nbytes, "loops": loops,
                         "seconds": seconds})
    return rows


@pytest.mark.parametrize("power", [0.0, 0.25, 1.0])
def test_fit_recovers_known_overheads_and_rates_from_synthetic_timings(power):
    fit = fit_class_costs(synthetic_rows(np.random.default_rng(7)), power)
    assert set(fit) == set(TRUE)
    for cls, (overhead, flops_rate, bw, loop) in TRUE.items():
        line = fit[cls]
        assert line["overhead"] == pytest.approx(overhead, rel=1e-7, abs=1e-15), cls
        assert line["bandwidth"] == pytest.approx(bw, rel=1e-7), cls
        assert ("flops" in line) == (flops_rate is not None) and ("loop" in line) == (loop is not None), cls
        if flops_rate:
            assert line["flops"] == pytest.approx(flops_rate, rel=1e-7), cls
        if loop:
            assert line["loop"] == pytest.approx(loop, rel=1e-7), cls


def test_fit_keeps_coefficients_non_negative():
    # time falls with bytes here: unconstrained least squares would give a negative per-byte cost
    rows = [{"class": "data", "ops": 1, "flops": 0, "bytes": b, "loops": 0, "seconds": 1e-5 - b * 1e-12}
            for b in (1e3, 1e4, 1e5, 1e6)]
    line = fit_class_costs(rows, 0.0)["data"]
    assert "bandwidth" not in line and line["overhead"] > 0


def single(node, inputs, initializers=()):
    vis = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    out = helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)
    g = frontend.lower(make_model(helper.make_graph([node], "one", vis, [out], list(initializers))))
    return g.ops[0], g


def fitted_profile(fit):
    """A profile holding `fit`'s lines, through the file form."""
    hw = dataclasses.replace(hardware.load("v100-16gb"), launch_overhead=4e-7, **fit_figures(fit))
    return hardware.from_dict(hw.to_dict(), where="test")


def test_calibrated_lines_price_ops_and_survive_the_profile_file():
    fit = fit_class_costs(synthetic_rows(np.random.default_rng(3)))
    hw = fitted_profile(fit)
    w = numpy_helper.from_array(np.zeros((8, 4, 3, 3), np.float32), "w")
    op, g = single(helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]), [("x", [2, 4, 16, 16])], [w])
    c = op_cost(op, g)
    overhead, flops_rate, bw, _ = TRUE["conv"]
    assert c.rereads == 8 * 4 * 9 * 4              # the kernel (float32) once more for the second image
    assert roofline_time(op, g, hw) == pytest.approx(overhead + c.flops / flops_rate + (c.bytes + c.rereads) / bw,
                                                     rel=1e-6)
    # a class the fit lacks, with a parent it has: priced by the parent's line
    op, g = single(helper.make_node("ConvTranspose", ["x", "w"], ["y"]), [("x", [2, 8, 16, 16])], [w])
    c = op_cost(op, g)
    assert c.op_class == "conv_transpose" and profile_class("conv_transpose", hw) == "conv"
    assert roofline_time(op, g, hw) == fitted_time(hw, "conv", c.flops, c.fitted_bytes, 0)
    # a class without a line and without a parent: the roofline with the launch overhead
    op, g = single(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2]), [("x", [2, 4, 16, 16])])
    c = op_cost(op, g)
    assert roofline_time(op, g, hw) == max(c.flops / hw.flops_for("pool", "float32"),
                                           c.bytes / hw.bandwidth_for("pool")) + hw.launch_overhead


def test_spec_sheet_presets_stay_on_the_roofline():
    for name in hardware.PRESETS:
        hw = hardware.load(name)
        assert not hw.op_class_overhead and not hw.op_class_loop
    hw = hardware.load("v100-16gb")
    w = numpy_helper.from_array(np.zeros((8, 4, 3, 3, 3), np.float32), "w")
    op, g = single(helper.make_node("Conv", ["x", "w"], ["y"]), [("x", [2, 4, 8, 8, 8])], [w])
    c = op_cost(op, g)
    assert c.op_class == "conv_3d" and c.rereads > 0      # a CPU kernel's rereads: not a GPU's
    assert roofline_time(op, g, hw) == max(c.flops / 15.7e12, c.bytes / 900e9) + 5e-6


def test_shape_classes():
    w = numpy_helper.from_array(np.zeros((8, 1, 3, 3), np.float32), "w")
    op, g = single(helper.make_node("Conv", ["x", "w"], ["y"], group=8), [("x", [1, 8, 6, 6])], [w])
    assert op_cost(op, g).op_class == "conv_grouped"
    op, g = single(helper.make_node("Conv", ["x", "k"], ["y"]), [("x", [2, 8, 6, 6]), ("k", [4, 8, 3, 3])])
    assert op_cost(op, g).op_class == "conv_wgrad"          # a computed kernel: a weight gradient
    assert op_cost(op, g).rereads == 0                      # ... which ONNX Runtime loops otherwise
    op, g = single(helper.make_node("Conv", ["x", "k"], ["y"], group=4), [("x", [1, 8, 6, 6]), ("k", [4, 2, 3, 3])])
    assert op_cost(op, g).op_class == "conv_grouped_wgrad"
    op, g = single(helper.make_node("MatMul", ["q", "k"], ["y"]), [("q", [2, 4, 16, 8]), ("k", [2, 4, 8, 16])])
    assert op_cost(op, g).op_class == "matmul_batched"
    op, g = single(helper.make_node("MatMul", ["q", "k"], ["y"]), [("q", [2, 16, 8]), ("k", [8, 16])])
    assert op_cost(op, g).op_class == "gemm"
    assert set(OP_CLASSES) >= {"conv_transpose_3d", "conv_wgrad_3d", "conv_transpose_grouped"}


@pytest.mark.parametrize("shapes, loops", [
    ([(960, 160, 1, 1), ()], 960 * 160),          # a scalar over trailing 1s: one loop per element
    ([(960, 160, 1, 2), ()], 960 * 160),          # ... per pair
    ([(960, 1, 160), ()], 960),
    ([(4, 64, 56, 56), ()], 1),
    ([(4, 960, 2, 2), (1, 960, 1, 1)], 4 * 960),  # per channel: one loop per 2x2 plane
    ([(4, 64, 56, 56), (64, 1, 1)], 4 * 64),
    ([(960, 160, 1, 1), (160, 1, 1)], 960),
    ([(8, 8), (8, 8)], 0),                        # no broadcast
])
def test_broadcast_loops(shapes, loops):
    out = tuple(max(d) for d in itertools.zip_longest(*(s[::-1] for s in shapes), fillvalue=1))[::-1]
    assert broadcast_loops(shapes, out) == loops


def test_graph_rows_sum_ops_of_one_class_and_work():
    from memsched.cost import CostTable

    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r1"), helper.make_node("Relu", ["a"], ["b"], name="r2"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [64])  # noqa: E731
    g = frontend.lower(make_model(helper.make_graph(nodes, "g", [vi("x")], [vi("y")])))
    rows = graph_rows(g, CostTable({"r1": 1e-6, "r2": 2e-6, "add": 5e-6}))
    relu = next(r for r in rows if r["op"] == "Relu")
    assert (relu["ops"], relu["seconds"], relu["bytes"]) == (2, pytest.approx(3e-6), 2 * 2 * 64 * 4)
    assert len(rows) == 2
