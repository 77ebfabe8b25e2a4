"""Every network of the model zoo trains: the loss falls over 20 SGD steps run with ONNX
Runtime on a fixed batch, and its gradients match central differences (float64 twin run by
ONNX's reference evaluator; see tests/gradcheck.py). Small sizes; the CNNs are slow."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import models
from memsched.frontend import lower
from passes.autodiff import GRAD_ROLES_KEY, TRAINING_KEY, build_training_step
from passes.autodiff.loss import class_axis
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
}
DEFAULTS = dict(lr=0.1, eps=1e-7, agree=1e-3, rtol=1e-5, slow=False)


def _cases():
    for name, case in CASES.items():
        case = {**DEFAULTS, **case}
        yield pytest.param(name, case, marks=[pytest.mark.slow] if case.pop("slow") else [], id=name)


def test_every_zoo_model_has_a_case():
    assert set(CASES) == set(models.NAMES)


def _batch(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """A fixed random batch: inputs, token ids below the vocabulary, labels below the classes."""
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
    axis = class_axis(shape)
    feeds["labels"] = rng.integers(0, shape[axis], shape[:axis] + shape[axis + 1:])
    return feeds


@pytest.mark.parametrize("name, case", list(_cases()))
def test_zoo_model_trains_and_its_gradients_match(name, case):
    model = models.build(name, **case["options"])
    feeds = _batch(model)
    losses = train_losses(model, feeds, steps=20, loss="cross_entropy", optimizer="sgd", lr=case["lr"])
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < 0.8 * losses[0], losses
    check_against_float64(model, feeds, loss="cross_entropy", params=3, sample=2, eps=case["eps"],
                          agree=case["agree"], rtol=case["rtol"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_training_step_tags_dw_and_dx_per_layer(name):
    """Every trainable parameter has its dW ops and its update, the only ops shared by dW and
    dX are a norm's xhat (Sub, Mul) and, for BatchNormalization, the sums of dy and dy * xhat
    that are its bias and scale gradients (Mul, ReduceSum), and weights seen through views (MatMul(x, Transpose(W))
    in training exports) count for the layer they feed. Built without weight data: structure
    only."""
    model = models.build(name, weights=False, **CASES[name]["options"])
    source = lower(model)
    train = build_training_step(source, loss="cross_entropy", optimizer="adam")
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
