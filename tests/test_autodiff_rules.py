"""Every gradient rule against central differences through ONNX Runtime (CPU).

Each case is one op fed by trainable initializers, followed by sum(y * r) with a fixed
random r. Ops ONNX Runtime runs in double are checked in float64 (tight tolerance); the
others (Conv, ConvTranspose, pooling, Erf, ...) in float32, where they are linear in each
input or smooth, with a wider step and tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from memsched.frontend import lower
from memsched.passes.training import build_training_step
from tests.gradcheck import check_gradients, one_op_model

rng = np.random.default_rng(0)


def r(*shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def pos(*shape, dtype=np.float64):
    return (rng.random(shape) + 0.5).astype(dtype)


def ints(*values):
    return np.array(values, dtype=np.int64)


def f32(*shape):
    return r(*shape, dtype=np.float32)


DOUBLE_CASES = {
    "Relu": ("Relu", [r(3, 4)], {}),
    "LeakyRelu": ("LeakyRelu", [r(3, 4)], {"alpha": 0.1}),
    "LeakyRelu-flat": ("LeakyRelu", [r(3, 4)], {"alpha": 0.0}),
    "LeakyRelu-steep": ("LeakyRelu", [r(3, 4)], {"alpha": 1.5}),
    "Sigmoid": ("Sigmoid", [r(3, 4)], {}),
    "Tanh": ("Tanh", [r(3, 4)], {}),
    "Exp": ("Exp", [r(3, 4)], {}),
    "Log": ("Log", [pos(3, 4)], {}),
    "Neg": ("Neg", [r(3, 4)], {}),
    "Reciprocal": ("Reciprocal", [pos(3, 4)], {}),
    "Sqrt": ("Sqrt", [pos(3, 4)], {}),
    "Abs": ("Abs", [pos(3, 4) * np.sign(r(3, 4))], {}),
    "Identity": ("Identity", [r(3, 4)], {}),
    "Clip": ("Clip", [r(3, 4), np.array(-0.5), np.array(0.6)], {}),
    "Clip-min-only": ("Clip", [r(3, 4), np.array(-0.5)], {}),
    "Clip-max-only": ("Clip", [r(3, 4), "", np.array(0.2)], {}),
    "Dropout-eval": ("Dropout", [r(3, 4)], {}),
    "Dropout-ratio0-training": ("Dropout", [r(3, 4), np.array(0.0), np.array(True)], {}),
    "Add-broadcast": ("Add", [r(2, 3, 4), r(3, 1)], {}),
    "Sub-broadcast": ("Sub", [r(1, 4), r(2, 3, 4)], {}),
    "Mul-broadcast": ("Mul", [r(2, 3, 4), r(3, 1)], {}),
    "Div-broadcast": ("Div", [r(2, 3, 4), pos(1, 3, 1)], {}),
    "Pow-square": ("Pow", [r(2, 3), np.array(2.0)], {}),
    "Pow-cube": ("Pow", [r(2, 3), np.array(3.0)], {}),
    "Pow-both": ("Pow", [pos(2, 3), r(3)], {}),
    "Sum-broadcast": ("Sum", [r(2, 3), r(3), r(1, 1)], {}),
    "Where-broadcast": ("Where", [rng.random((2, 3, 4)) > 0.5, r(3, 4), r(2, 1, 4)], {}),
    "Reshape": ("Reshape", [r(2, 3, 4), ints(4, -1)], {}),
    "Flatten": ("Flatten", [r(2, 3, 4)], {"axis": 2}),
    "Squeeze": ("Squeeze", [r(2, 1, 4), ints(1)], {}),
    "Unsqueeze": ("Unsqueeze", [r(2, 4), ints(0, 2)], {}),
    "Transpose": ("Transpose", [r(2, 3, 4)], {"perm": [1, 2, 0]}),
    "Transpose-default": ("Transpose", [r(2, 3, 4)], {}),
    "Concat": ("Concat", [r(2, 3), r(2, 1), r(2, 2)], {"axis": -1}),
    "Slice": ("Slice", [r(4, 5), ints(1, -4), ints(3, 100), ints(0, 1)], {}),
    "Slice-steps": ("Slice", [r(4, 6), ints(0, 5), ints(4, -10), ints(0, 1), ints(2, -2)], {}),
    "Gather-rows-repeated-negative": ("Gather", [r(5, 3), ints(0, 4, 4, -1, 2, 0).reshape(2, 3)], {}),
    "Gather-axis1": ("Gather", [r(2, 5, 3), ints(1, 1, -1)], {"axis": 1}),
    "Gather-scalar-index": ("Gather", [r(2, 5, 3), np.array(3, dtype=np.int64)], {"axis": 1}),
    "GatherElements": ("GatherElements", [r(3, 4), ints(0, 3, 3, 1, 2, 2).reshape(3, 2)], {"axis": 1}),
    "Expand": ("Expand", [r(3, 1), ints(2, 3, 4)], {}),
    "Tile": ("Tile", [r(2, 3), ints(2, 3)], {}),
    "Pad": ("Pad", [r(3, 4), ints(1, 0, 2, 1)], {}),
    "Pad-negative": ("Pad", [r(3, 4), ints(1, -1, -1, 2)], {}),
    "ReduceSum": ("ReduceSum", [r(2, 3, 4), ints(1)], {"keepdims": 0}),
    "ReduceSum-all": ("ReduceSum", [r(2, 3, 4)], {"keepdims": 1}),
    "ReduceMean": ("ReduceMean", [r(2, 3, 4)], {"axes": [0, 2]}),
    "Softmax": ("Softmax", [r(2, 3, 4)], {"axis": 1}),
    "LogSoftmax": ("LogSoftmax", [r(2, 3, 4)], {}),
    "Gemm": ("Gemm", [r(3, 4), r(4, 5), r(5)], {}),
    "Gemm-transposed-alpha-beta": ("Gemm", [r(4, 3), r(5, 4), r(1, 5)],
                                   {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}),
    "Gemm-transA-full-bias": ("Gemm", [r(4, 3), r(4, 5), r(3, 5)], {"transA": 1}),
    "Gemm-transB-no-bias": ("Gemm", [r(3, 4), r(5, 4)], {"transB": 1}),
    "MatMul": ("MatMul", [r(3, 4), r(4, 5)], {}),
    "MatMul-batched-by-weight": ("MatMul", [r(2, 3, 4), r(4, 5)], {}),
    "MatMul-batched-broadcast": ("MatMul", [r(1, 3, 2, 4), r(2, 1, 4, 5)], {}),
    "MatMul-vector-left": ("MatMul", [r(4), r(2, 4, 5)], {}),
    "MatMul-vector-right": ("MatMul", [r(2, 3, 4), r(4)], {}),
    "MatMul-matrix-by-batch": ("MatMul", [r(3, 4), r(2, 4, 5)], {}),
    "MaxPool-overlapping-padded": ("MaxPool", [r(2, 3, 5, 5)],
                                   {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "MaxPool-ceil": ("MaxPool", [r(1, 2, 6, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "BatchNormalization": ("BatchNormalization", [r(3, 2, 3, 3), r(2), r(2), r(2), pos(2)], {"epsilon": 1e-3}),
    "BatchNormalization-2d": ("BatchNormalization", [r(4, 3), r(3), r(3), r(3), pos(3)], {}),
    "LayerNormalization": ("LayerNormalization", [r(2, 3, 4), r(4), r(4)], {}),
    "LayerNormalization-axis1": ("LayerNormalization", [r(2, 3, 4), r(3, 4), r(4)], {"axis": 1}),
}

FLOAT_CASES = {
    "Conv": ("Conv", [f32(2, 3, 5, 5), f32(4, 3, 3, 3)], {}),
    "Conv-bias-pad": ("Conv", [f32(2, 3, 5, 5), f32(4, 3, 3, 3), f32(4)], {"pads": [1, 1, 1, 1]}),
    "Conv-stride-asymmetric-pad": ("Conv", [f32(2, 3, 7, 6), f32(4, 3, 3, 3)],
                                   {"strides": [2, 2], "pads": [1, 0, 1, 1]}),
    "Conv-dilation": ("Conv", [f32(1, 2, 7, 7), f32(3, 2, 3, 2)], {"dilations": [2, 3], "pads": [2, 1, 0, 2]}),
    "Conv-group": ("Conv", [f32(2, 4, 6, 6), f32(6, 2, 3, 3), f32(6)],
                   {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "Conv-depthwise": ("Conv", [f32(2, 3, 6, 6), f32(6, 1, 3, 3)],
                       {"group": 3, "pads": [1, 1, 1, 1], "strides": [2, 1]}),
    "Conv-depthwise-batch-1": ("Conv", [f32(1, 4, 6, 6), f32(4, 1, 3, 3)], {"group": 4, "pads": [1, 1, 1, 1]}),
    "Conv-group-batch-1": ("Conv", [f32(1, 4, 5, 5), f32(6, 2, 3, 3), f32(6)], {"group": 2}),
    "Conv-same-upper": ("Conv", [f32(1, 2, 7, 7), f32(3, 2, 3, 3)], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "Conv-same-lower": ("Conv", [f32(1, 2, 6, 6), f32(3, 2, 4, 4)], {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    "Conv-1d": ("Conv", [f32(2, 3, 9), f32(4, 3, 3), f32(4)], {"strides": [2], "pads": [1, 1]}),
    # a downsample: 1x1, strides 2 and 3 over even and odd sizes (the weight gradient from X[..., ::s])
    "Conv-pointwise-strided": ("Conv", [f32(2, 3, 8, 7), f32(64, 3, 1, 1)], {"strides": [2, 3]}),
    "Conv-3d": ("Conv", [f32(1, 2, 4, 5, 4), f32(3, 2, 3, 3, 3)],
                {"strides": [1, 2, 1], "pads": [1, 1, 1, 1, 1, 1]}),
    "ConvTranspose-bias": ("ConvTranspose", [f32(2, 3, 4, 4), f32(3, 2, 3, 3), f32(2)], {}),
    "ConvTranspose-stride-pad-output-padding": ("ConvTranspose", [f32(2, 3, 4, 4), f32(3, 2, 3, 3)],
                                                {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]}),
    "ConvTranspose-group": ("ConvTranspose", [f32(1, 4, 3, 3), f32(4, 3, 2, 2), f32(6)],
                            {"strides": [2, 2], "group": 2}),
    "ConvTranspose-dilation": ("ConvTranspose", [f32(1, 2, 3, 3), f32(2, 2, 3, 3)],
                               {"dilations": [2, 2], "strides": [2, 1], "pads": [1, 0, 0, 1]}),
    "ConvTranspose-3d": ("ConvTranspose", [f32(1, 2, 2, 3, 2), f32(2, 3, 2, 2, 2)], {"strides": [2, 2, 2]}),
    "AveragePool": ("AveragePool", [f32(2, 3, 6, 6)], {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "AveragePool-pad-exclude": ("AveragePool", [f32(1, 2, 5, 5)],
                                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "AveragePool-pad-include": ("AveragePool", [f32(1, 2, 5, 6)], {"kernel_shape": [3, 2], "strides": [2, 1],
                                                                   "pads": [1, 0, 1, 1], "count_include_pad": 1}),
    "GlobalAveragePool": ("GlobalAveragePool", [f32(2, 3, 4, 5)], {}),
    "Erf": ("Erf", [f32(3, 4)], {}),
    "Softplus": ("Softplus", [f32(3, 4)], {}),
}


@pytest.mark.parametrize("case", sorted(DOUBLE_CASES))
def test_rule_float64(case):
    op_type, inputs, attrs = DOUBLE_CASES[case]
    check_gradients(one_op_model(op_type, inputs, attrs))


@pytest.mark.parametrize("case", sorted(FLOAT_CASES))
def test_rule_float32(case):
    op_type, inputs, attrs = FLOAT_CASES[case]
    check_gradients(one_op_model(op_type, inputs, attrs), rtol=2e-3, atol=2e-3, eps=1e-2)


@pytest.mark.parametrize("opset", [17, 18])
def test_split_with_an_unused_output_and_opset_forms(opset):
    """Split's gradient concatenates zeros for outputs that do not reach the loss."""
    attrs = {"axis": 1, "num_outputs": 3} if opset >= 18 else {"axis": 1}
    inputs = [r(2, 6)] if opset >= 18 else [r(2, 6), ints(2, 1, 3)]
    model = one_op_model("Split", inputs, attrs, outputs=3, opset=opset)
    terms = next(n for n in model.graph.node if n.op_type == "Sum")
    terms.input.remove("y1_sum")   # y1 no longer reaches the loss
    check_gradients(model)
    check_gradients(one_op_model("ReduceMean", [r(2, 3, 4), ints(-1)], {"keepdims": 0}, opset=18))


def test_cast_between_float_types():
    check_gradients(one_op_model("Cast", [f32(3, 4)], {"to": 11}), eps=2.0 ** -8, rtol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_opset20(approximate):
    check_gradients(one_op_model("Gelu", [f32(3, 4)], {"approximate": approximate}, opset=20),
                    rtol=2e-3, atol=2e-3, eps=1e-2)


def test_repeated_input_accumulates():
    """x * x and x + x: one input read twice gets both contributions."""
    x = r(3, 4)
    for op_type in ("Mul", "Add"):
        model = one_op_model(op_type, [x, x], {})
        node = next(n for n in model.graph.node if n.op_type == op_type)
        node.input[1] = node.input[0]
        check_gradients(model)


@pytest.mark.parametrize("case", ["Relu", "LeakyRelu", "LeakyRelu-flat", "Clip", "Clip-min-only", "Where-broadcast"])
def test_mask_gradients_take_no_where(case):
    """A gradient that passes dy where a condition holds multiplies by the condition as a float
    tensor: ONNX Runtime's CPU Where asks for twice its output in scratch the plan cannot see.
    The condition itself stays a bool tensor (a branch decision numerics pins)."""
    op_type, inputs, attrs = DOUBLE_CASES[case]
    step = build_training_step(lower(one_op_model(op_type, inputs, attrs)), loss="output", optimizer="sgd")
    backward = [op.op_type for op in step.ops if op.phase == "backward"]
    assert "Where" not in backward and "Cast" in backward


def test_training_dropout_scales_by_the_kept_mask():
    """ratio 0.5 in training mode: the gradient is r * mask / (1 - ratio), the mask being
    where the output is non-zero (random, so checked through its relation to the output)."""
    from memsched.passes.training import build_training_step
    from memsched.frontend import lower

    from tests.gradcheck import session

    x = pos(40, 50)
    model = one_op_model("Dropout", [x, np.array(0.5), np.array(True)], {})
    weight = next(numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant")
    train = build_training_step(lower(model), loss="output")
    grad, = session(train.to_onnx()).run(["in0.grad"], {})
    kept = grad != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(grad[kept], 2 * weight[kept], rtol=1e-12)


@pytest.mark.parametrize("op_type, inputs", [
    ("BatchNormalization", [r(3, 2, 3, 3), r(2), r(2), r(2), pos(2)]),
    ("LayerNormalization", [r(3, 4, 5), r(5), r(5)]),
])
def test_a_norms_variance_never_makes_the_squared_map(op_type, inputs):
    """var = ReduceSumSquare(x - mean) / count: no input-sized x - mean times itself."""
    step = build_training_step(lower(one_op_model(op_type, inputs)), loss="output", optimizer="sgd")
    forward = [op for op in step.ops if op.phase == "forward"]
    assert any(op.op_type == "ReduceSumSquare" for op in forward)
    assert not [op.name for op in forward if op.op_type == "Mul" and op.inputs[0] == op.inputs[1]]


def test_max_pool_keeps_its_argmax_as_int32():
    """The backward scatters through int32 indices (half the bytes of ONNX's and PyTorch's
    int64 ones); the int64 Indices output is read only by their Cast, in the forward."""
    from onnx import TensorProto

    step = build_training_step(lower(one_op_model("MaxPool", [r(2, 3, 6, 6)], {"kernel_shape": [2, 2]})),
                               loss="output")
    scatter = next(op for op in step.ops if op.op_type == "ScatterElements")
    flat = step.producer[scatter.inputs[1]]      # the indices flattened for the scatter
    assert flat.op_type == "Reshape" and step.tensors[flat.inputs[0]].dtype == TensorProto.INT32
    cast = step.producer[flat.inputs[0]]
    assert cast.op_type == "Cast" and cast.phase == "forward"
    assert [op.name for op in step.consumers[cast.inputs[0]]] == [cast.name]
    assert step.tensors[cast.inputs[0]].dtype == TensorProto.INT64


def test_a_strided_pointwise_weight_gradient_reads_the_strided_samples():
    """A ResNet downsample's dW: a Slice of X with the conv's steps, no product beyond the kernel."""
    model = one_op_model("Conv", [f32(2, 3, 8, 8), f32(64, 3, 1, 1)], {"strides": [2, 2]})
    step = build_training_step(lower(model), loss="output")
    sliced = [op for op in step.ops if op.op_type == "Slice" and op.phase == "backward"]
    assert len(sliced) == 1 and sliced[0].inputs[0] == "in0"
    assert step.tensors[sliced[0].outputs[0]].shape == (2, 3, 4, 4)
    dw = [op for op in step.ops if op.op_type == "Conv" and op.phase == "backward"]
    assert len(dw) == 1 and step.tensors[dw[0].outputs[0]].shape[-2:] == (1, 1)     # the kernel's size, no more


def test_a_stride_1_conv_input_gradient_is_a_conv_where_the_column_buffer_outweighs_the_weight():
    """ONNX Runtime's CPU ConvTranspose multiplies into a (C_in/group) x prod(kernel) x |dY| column
    buffer that no plan sees: a stride-1 Conv's dX is a Conv by the flipped, channel-swapped
    weight instead; a strided Conv and one whose weight is larger than that buffer keep it."""
    def backward_types(inputs, attrs):
        step = build_training_step(lower(one_op_model("Conv", inputs, attrs)), loss="output")
        return [op.op_type for op in step.ops if op.phase == "backward"]

    volume = backward_types([f32(1, 6, 8, 8, 8), f32(4, 6, 3, 3, 3)], {"pads": [1] * 6})
    assert "ConvTranspose" not in volume and volume.count("Conv") == 2      # dX and dW
    grouped = backward_types([f32(2, 4, 6, 6), f32(6, 2, 3, 3)], {"group": 2, "pads": [1, 1, 1, 1]})
    assert "ConvTranspose" not in grouped
    assert "ConvTranspose" in backward_types([f32(1, 6, 8, 8), f32(4, 6, 3, 3)], {"strides": [2, 2]})
    assert "ConvTranspose" in backward_types([f32(1, 64, 2, 2), f32(64, 64, 3, 3)], {"pads": [1, 1, 1, 1]})
