"""Every network of the model zoo trains: the loss falls over 20 SGD steps run with ONNX
Runtime on a fixed batch, and its gradients match central differences (float64 twin run by
ONNX's reference evaluator; see tests/gradcheck.py). Small sizes; the CNNs are slow."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import models
from memsched.frontend import lower
from memsched.memory import analyze_plan
from memsched.onnx_utils import make_model
from memsched.schedule import Plan
from memsched.passes.training import GRAD_ROLES_KEY, TRAINING_KEY, build_training_step
from memsched.passes.training.loss import class_axis
from memsched.passes.reuse import reuse_pass
from tests.gradcheck import check_against_float64, train_losses

# Per model: build options, SGD learning rate, and the gradient check's settings.
# eps (FD step): 1e-7 where ReLU/max-pool kinks lie close to the point (a smaller step
# crosses fewer); 1e-4 for transformers, whose attention masks add -1e4..-3e38 and leave
# ~1e-12 of rounding noise in the loss. agree: BN nets at tiny batches have dead channels
# whose batch-normalised values are pure rounding noise in float32 (exactly 0 in float64),
# which flips ReLU masks, so their float32 gradients are off by ~1e-2. ResNet-50 at batch 2
# is rough at every scale (gradient norm ~3e3; differences with steps 1e-5..1e-8 wander by
# 1e-2 and settle on the analytic value near 1e-9), hence its tiny step and rtol 1e-4.
TRANSFORMER = dict(batch=2, seq=8, layers=2, hidden=32, heads=2, vocab=50, max_positions=16)
CASES = {
    "mlp": dict(options=dict(batch=4, size=8, hidden=(16, 8)), eps=1e-7),
    "bert-base": dict(options=TRANSFORMER, eps=1e-4),
    "gpt2": dict(options=TRANSFORMER, eps=1e-4),
    "unet2d": dict(options=dict(batch=1, size=32, width=4, depth=2), agree=5e-2),
    "vgg16": dict(options=dict(batch=2, size=32, classes=10, hidden=64), slow=True),
    "resnet18": dict(options=dict(batch=4, size=64, classes=10), agree=5e-2, slow=True),
    "resnet50": dict(options=dict(batch=2, size=64, classes=10), eps=1e-9, agree=5e-2, rtol=1e-4, slow=True),
    "mobilenetv2": dict(options=dict(batch=4, size=64, classes=10, width=0.25), agree=5e-2, slow=True),
    "unet3d": dict(options=dict(batch=1, size=16, width=4, depth=2), agree=5e-2, slow=True),
    "dcgan-generator": dict(options=dict(batch=4, size=16, nz=8, ngf=4), loss="mse"),
    "dcgan-discriminator": dict(options=dict(batch=4, size=16, ndf=4), loss="bce_with_logits"),
}
DEFAULTS = dict(lr=0.1, eps=1e-7, agree=1e-3, rtol=1e-5, slow=False, loss="cross_entropy")


def _cases():
    for name, case in CASES.items():
        case = {**DEFAULTS, **case}
        yield pytest.param(name, case, marks=[pytest.mark.slow] if case.pop("slow") else [], id=name)


def test_every_zoo_model_has_a_case():
    assert set(CASES) == set(models.NAMES)


def _batch(model: onnx.ModelProto, seed: int = 0, loss: str = "cross_entropy") -> dict[str, np.ndarray]:
    """A fixed random batch: inputs, token ids below the vocabulary, labels below the classes
    (cross_entropy) or targets in [0, 1) shaped as the output (mse, bce_with_logits)."""
    graph = lower(model)
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in graph.inputs:
        t = graph.tensors[name]
        if t.dtype == onnx.TensorProto.INT64:
            feeds[name] = rng.integers(0, 50, t.shape)
        else:
            feeds[name] = rng.standard_normal(t.shape).astype(np.float32)
    shape = graph.tensors[graph.outputs[0]].shape
    if loss != "cross_entropy":
        feeds["targets"] = rng.random(shape).astype(np.float32)
        return feeds
    axis = class_axis(shape)
    feeds["labels"] = rng.integers(0, shape[axis], shape[:axis] + shape[axis + 1:])
    return feeds


@pytest.mark.parametrize("name, case", list(_cases()))
def test_zoo_model_trains_and_its_gradients_match(name, case):
    model = models.build(name, **case["options"])
    feeds = _batch(model, loss=case["loss"])
    losses = train_losses(model, feeds, steps=20, loss=case["loss"], optimizer="sgd", lr=case["lr"])
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < 0.8 * losses[0], losses
    check_against_float64(model, feeds, loss=case["loss"], params=3, sample=2, eps=case["eps"],
                          agree=case["agree"], rtol=case["rtol"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_training_step_tags_dw_and_dx_per_layer(name):
    """Every trainable parameter has its dW ops and its update, the only ops shared by dW and
    dX are a norm's xhat (Sub, Mul), dy * xhat (Mul) and BatchNormalization's sums of dy and
    dy * xhat, its bias and scale gradients (ReduceSum), and weights seen through views
    (MatMul(x, Transpose(W)) in training exports) count for the layer they feed. Built without
    weight data: structure only."""
    model = models.build(name, weights=False, **CASES[name]["options"])
    source = lower(model)
    train = build_training_step(source, loss=CASES[name].get("loss", "cross_entropy"), optimizer="adam")
    roles = json.loads(train.metadata[GRAD_ROLES_KEY])
    params = json.loads(train.metadata[TRAINING_KEY])["parameters"]
    assert {r["role"] for r in roles.values()} <= {"dW", "dX", "shared", "update"}
    assert {r["role"] for r in roles.values()} >= {"dW", "dX", "update"}
    shared = [op for op in train.ops if roles.get(op.name, {}).get("role") == "shared"]
    assert {op.op_type for op in shared} <= {"Sub", "Mul", "ReduceSum"}
    assert {source.op_by_name[roles[op.name]["layer"]].op_type for op in shared} <= {
        "BatchNormalization", "LayerNormalization"}
    by_role = {role: {r["param"] for r in roles.values() if r["role"] == role} for role in ("dW", "update")}
    assert by_role["dW"] == by_role["update"] == set(params)
    for param in params:
        producer = train.producer[f"{param}.grad"]
        assert roles[producer.name]["role"] == "dW" and roles[producer.name]["param"] == param
    phases = [("forward", "loss", "backward", "update").index(op.phase) for op in train.ops]
    assert phases == sorted(phases)


def test_linear_weights_behind_a_transpose_belong_to_their_matmul():
    model = models.build("bert-base", weights=False, **CASES["bert-base"]["options"])
    train = build_training_step(lower(model))
    roles = json.loads(train.metadata[GRAD_ROLES_KEY])
    weight = "bert.encoder.layer.0.attention.self.query.weight"
    layer = "/bert/encoder/layer.0/attention/self/query/MatMul"
    assert roles[train.producer[f"{weight}.grad"].name] == {"role": "dW", "layer": layer, "param": weight}
    assert {r["role"] for r in roles.values() if r["layer"] == layer} == {"dW", "dX"}


def _norm_beside_its_residual():
    """h = x @ W; z = LayerNorm(h) + h; loss z * z summed: LayerNorm's dy (dz) is read after
    its backward, by h's gradient sum (an ONNX model, float32)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w"),
             numpy_helper.from_array(np.ones(64, np.float32), "ln.weight"),
             numpy_helper.from_array(np.zeros(64, np.float32), "ln.bias")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("LayerNormalization", ["h", "ln.weight", "ln.bias"], ["y"], name="ln", axis=-1),
             helper.make_node("Add", ["y", "h"], ["z"], name="residual"),
             helper.make_node("Mul", ["z", "z"], ["q"], name="square"),
             helper.make_node("ReduceSum", ["q"], ["loss_value"], name="sum", keepdims=0)]
    graph = helper.make_graph(nodes, "ln-residual",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16, 64])],
                              [helper.make_tensor_value_info("loss_value", TensorProto.FLOAT, [])], inits)
    return make_model(graph)


@pytest.mark.parametrize("name", ["resnet18", "bert-base", "ln-residual"])
def test_a_norm_backward_holds_at_most_three_input_sized_tensors(name):
    """BatchNorm's dx is PyTorch's (from its bias and scale gradients' sums) and LayerNorm's
    takes g * xhat from dy * xhat: with the reuse pass's in-place aliases, no step of a norm's
    backward holds more than three buffers of the norm's input size among the tensors its ops
    read and write, also where dy is read after it (ResNet's BatchNorm before the residual Add,
    the LayerNorm beside its residual; forming g = dy * scale, then g * xhat, held four)."""
    if name == "ln-residual":
        train = build_training_step(lower(_norm_beside_its_residual()), loss="output", optimizer="sgd")
    else:
        options = dict(batch=2, size=32, classes=10) if name == "resnet18" else TRANSFORMER
        train = build_training_step(lower(models.build(name, weights=False, **options)), optimizer="sgd")
    plan = reuse_pass(Plan.initial(train))
    profile = analyze_plan(plan)
    roles = json.loads(train.metadata[GRAD_ROLES_KEY])
    step_of = {step.target: i for i, step in enumerate(plan.schedule)}
    layers = {roles[op.name]["layer"] for op in train.ops if roles.get(op.name, {}).get("role") == "shared"}
    assert layers
    for layer in layers:
        ops = [op for op in train.ops if op.phase == "backward" and roles.get(op.name, {}).get("layer") == layer]
        size = max(train.tensors[t].nbytes for op in ops for t in op.present_inputs)
        touched = {t for op in ops for t in op.present_inputs + op.present_outputs if train.tensors[t].nbytes == size}
        residencies = [r for r in profile.residencies if r.tensor in touched]
        held = max(sum(r.nbytes for r in residencies if r.counted_from <= step_of[op.name] <= r.end) for op in ops)
        assert held <= 3 * size, (layer, held / size)


def test_float16_backward_keeps_its_constants_in_range():
    """At batch 8 x 64 x 64 a BatchNorm averages over 32,768 values: 1 / 32,768 is below
    float16's normal range (2^-14), so the per-channel means of its backward are taken in
    float32; no float16 constant a backward op reads is subnormal or infinite."""
    train = build_training_step(lower(models.build("resnet18", weights=False, batch=8, size=128, dtype="float16")),
                                optimizer="sgd")
    read = {t for op in train.ops if op.phase == "backward" for t in op.present_inputs}
    constants = [numpy_helper.to_array(train.tensors[t].data) for t in read
                 if train.tensors[t].kind == "constant" and train.tensors[t].dtype == TensorProto.FLOAT16]
    assert constants
    for value in constants:
        magnitude = np.abs(value.astype(np.float64))
        assert np.all(np.isfinite(magnitude)) and np.all((magnitude == 0) | (magnitude >= 2.0 ** -14)), value
