"""BatchNormalization + ReLU/ReLU6 stored once (passes.training.bn_relu): the step keeps the
normalised input x^ where PyTorch keeps the BN input and the activation output, the backward
pass derives the BN output and the activation from x^ again (passes.training.rederive), the
gradients are kept (finite differences in float64,
float32 against float64, a channel whose scale is 0 included), and leaves other graphs as they
were."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import models
import memsched.passes.training.bn_relu as bn_relu
from memsched.frontend import lower
from memsched.onnx_utils import make_model
from memsched.passes.training import build_training_step
from tests.gradcheck import check_against_float64

BATCH, SIDE, CLASSES = 2, 6, 5


def _stack(*, scale1=None, residual_read: bool = False) -> onnx.ModelProto:
    """conv -> BN -> Relu -> conv -> BN -> Clip(0, 6) -> 1x1 conv -> global pool -> logits;
    `residual_read`: the first BN's output is also added to the activation (an Add reads it)."""
    rng = np.random.default_rng(3)
    inits = []

    def param(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.float32), name))
        return name

    def bn(scope, x, channels, scale=None):
        scale = rng.uniform(0.5, 1.5, channels) * rng.choice([-1, 1], channels) if scale is None else scale
        names = [param(f"{scope}.weight", scale), param(f"{scope}.bias", rng.normal(0, 0.3, channels)),
                 param(f"{scope}.running_mean", np.zeros(channels)), param(f"{scope}.running_var", np.ones(channels))]
        return helper.make_node("BatchNormalization", [x] + names, [f"{scope}.out"], name=scope, epsilon=1e-5)

    nodes = [
        helper.make_node("Conv", ["x", param("conv1.weight", rng.normal(0, 0.4, (4, 3, 3, 3)))], ["c1"],
                         name="conv1", pads=[1, 1, 1, 1]),
        bn("bn1", "c1", 4, scale1),
        helper.make_node("Relu", ["bn1.out"], ["r1"], name="relu1"),
    ]
    act = "r1"
    if residual_read:
        nodes.append(helper.make_node("Add", ["r1", "bn1.out"], ["s1"], name="add1"))
        act = "s1"
    nodes += [
        helper.make_node("Conv", [act, param("conv2.weight", rng.normal(0, 0.4, (4, 4, 3, 3)))], ["c2"],
                         name="conv2", pads=[1, 1, 1, 1]),
        bn("bn2", "c2", 4),
        helper.make_node("Clip", ["bn2.out", param("lo", 0.0), param("hi", 6.0)], ["r2"], name="relu6"),
        helper.make_node("Conv", ["r2", param("conv3.weight", rng.normal(0, 0.4, (CLASSES, 4, 1, 1)))], ["c3"],
                         name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["logits"], name="flatten"),
    ]
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             [BATCH, 3, SIDE, SIDE])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, CLASSES])], inits)
    return make_model(graph, opset=17)


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((BATCH, 3, SIDE, SIDE)).astype(np.float32),
            "labels": rng.integers(0, CLASSES, BATCH)}


def _unmatched(monkeypatch):
    """Build steps as if no BN matched the pattern (the step without this module)."""
    monkeypatch.setattr(bn_relu, "find_pairs", lambda graph: {})


def _backward_reads(step) -> set[str]:
    return {t for op in step.ops if op.phase == "backward" for t in op.present_inputs}


def _kept(step) -> set[str]:
    """Activation maps (over 64 B: not per-channel statistics) the forward pass makes and the
    backward pass reads: what is alive from one to the other."""
    made = {t for op in step.ops if op.phase in ("forward", "loss") for t in op.present_outputs}
    return {t for t in _backward_reads(step) if t in made and step.tensors[t].nbytes > 64}


def test_the_backward_reads_neither_the_bn_input_nor_the_activation(monkeypatch):
    step = build_training_step(lower(_stack()), optimizer="sgd")
    reads = _backward_reads(step)
    assert not reads & {"c1", "bn1.out", "r1", "c2", "bn2.out", "r2"}
    derived = [op for op in step.ops if op.name.endswith("/rederived")]
    # per BN: x^ * scale + bias (the scale and bias reshaped to a channel), then its activation
    assert [op.op_type for op in derived if op.op_type != "Reshape"] == ["Mul", "Add", "Clip", "Mul", "Add", "Relu"]
    assert all(op.phase == "backward" for op in derived)
    size = BATCH * 4 * SIDE * SIDE * 4   # one activation map
    xhats = sorted(_kept(step))   # one x^ per BN, made by the BN's forward ops
    assert [t.split("/")[0] for t in xhats] == ["bn1", "bn2"]
    assert all(step.tensors[t].nbytes == size for t in xhats)
    _unmatched(monkeypatch)
    before = build_training_step(lower(_stack()), optimizer="sgd")
    # without the pattern the backward keeps both BN inputs (it normalises them again) and
    # derives the BN outputs and activations from them: as many tensors, and more work
    assert _kept(before) == {"c1", "c2"}
    assert len(before.ops) > len(step.ops)


@pytest.mark.parametrize("scale1", [None, [1.2, 0.0, -1e-6, 0.7]], ids=["trained", "zero-and-tiny-scale"])
def test_gradients_match_finite_differences_and_float64(scale1):
    """x^ is kept, not recovered from the BN output: a channel whose scale is 0 still gets
    its scale gradient sum(dy * x^)."""
    model = _stack(scale1=None if scale1 is None else np.asarray(scale1))
    grads = check_against_float64(model, _feeds(), loss="cross_entropy", rtol=1e-5, sample=3)
    if scale1 is not None:
        assert abs(grads["bn1.weight"][1]) > 1e-4


def test_a_bn_output_read_twice_is_built_as_before(monkeypatch):
    step = build_training_step(lower(_stack(residual_read=True)), optimizer="sgd")
    # bn1 keeps its input, as without the pattern; bn2 keeps x^
    assert "c1" in _backward_reads(step) and not any(t.startswith("bn1/") for t in _kept(step))
    assert {"bn1", "bn2"} >= set(bn_relu.find_pairs(lower(_stack(residual_read=True)))) == {"bn2"}
    _unmatched(monkeypatch)
    plain = build_training_step(lower(_stack(residual_read=True)), optimizer="sgd")
    assert [op.op_type for op in plain.ops if op.name.startswith("bn1")] == \
        [op.op_type for op in step.ops if op.name.startswith("bn1")]


def test_resnet_matches_each_bn_that_feeds_a_relu_not_the_residual_ones():
    graph = lower(models.build("resnet18", batch=1, size=32, classes=10, weights=False))
    pairs = bn_relu.find_pairs(graph)
    assert sorted(pairs) == sorted(op.name for op in graph.ops if op.op_type == "BatchNormalization"
                                   and op.name.split("/")[-2] == "bn1")
    assert {act.op_type for act in pairs.values()} == {"Relu"}
