"""The training step as a whole: losses, optimizers, training runs, the graph's structure
(phases, kinds, dW/dX roles, interface) and its errors."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched.errors import UserError
from memsched.frontend import lower
from memsched.ir import Graph
from memsched.memory import analyze
from memsched.onnx_utils import make_model
from memsched.schedule import default_schedule
from memsched.passes.training import GRAD_ROLES_KEY, build_training_step
from tests.gradcheck import check_against_float64, check_gradients, initial_values, session, train_losses, training_info

FLOAT, DOUBLE = TensorProto.FLOAT, TensorProto.DOUBLE


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def mlp(batch=4, features=5, hidden=6, classes=3, dtype=np.float64, seed=0):
    """x -> Gemm -> Relu -> Gemm -> logits."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [_init("fc1.weight", rng.standard_normal((hidden, features)).astype(dtype) * 0.5),
             _init("fc1.bias", rng.standard_normal(hidden).astype(dtype) * 0.1),
             _init("fc2.weight", rng.standard_normal((classes, hidden)).astype(dtype) * 0.5),
             _init("fc2.bias", np.zeros(classes, dtype))]
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", elem, [batch, features])],
                              [helper.make_tensor_value_info("logits", elem, [batch, classes])], inits)
    return make_model(graph)


def small_cnn(batch=2, channels=3, size=8, classes=4, seed=0):
    """conv-bn-relu-maxpool, depthwise conv-bn-relu, avgpool, global pool, flatten, gemm (float32)."""
    rng = np.random.default_rng(seed)
    f = np.float32
    inits = [_init("conv1.weight", rng.standard_normal((6, channels, 3, 3)).astype(f) * 0.3),
             _init("bn1.weight", np.ones(6, f)), _init("bn1.bias", np.zeros(6, f)),
             _init("bn1.running_mean", np.zeros(6, f)), _init("bn1.running_var", np.ones(6, f)),
             _init("conv2.weight", rng.standard_normal((6, 1, 3, 3)).astype(f) * 0.3),
             _init("conv2.bias", np.zeros(6, f)),
             _init("bn2.weight", np.ones(6, f)), _init("bn2.bias", np.zeros(6, f)),
             _init("bn2.running_mean", np.zeros(6, f)), _init("bn2.running_var", np.ones(6, f)),
             _init("fc.weight", rng.standard_normal((classes, 6)).astype(f) * 0.3),
             _init("fc.bias", np.zeros(classes, f))]
    nodes = [
        helper.make_node("Conv", ["x", "conv1.weight"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn1.weight", "bn1.bias", "bn1.running_mean",
                                                "bn1.running_var"], ["b1"], name="bn1"),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], name="conv2", group=6,
                         pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c2", "bn2.weight", "bn2.bias", "bn2.running_mean",
                                                "bn2.running_var"], ["b2"], name="bn2"),
        helper.make_node("Relu", ["b2"], ["r2"], name="relu2"),
        helper.make_node("AveragePool", ["r2"], ["p2"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", FLOAT, [batch, channels, size, size])],
                              [helper.make_tensor_value_info("logits", FLOAT, [batch, classes])], inits)
    return make_model(graph)


def sequence_model(batch=2, seq=3, vocab=7, dim=4, seed=0):
    """token ids -> embedding (Gather) + positions -> LayerNorm -> MatMul -> [N, L, V] logits."""
    rng = np.random.default_rng(seed)
    inits = [_init("wte", rng.standard_normal((vocab, dim))), _init("wpe", rng.standard_normal((seq, dim))),
             _init("ln.weight", np.ones(dim)), _init("ln.bias", np.zeros(dim)),
             _init("head", rng.standard_normal((dim, vocab)))]
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["tok"], name="embed"),
             helper.make_node("Add", ["tok", "wpe"], ["h"], name="add_pos"),
             helper.make_node("LayerNormalization", ["h", "ln.weight", "ln.bias"], ["n"], name="ln"),
             helper.make_node("MatMul", ["n", "head"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "seq", [helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, seq])],
                              [helper.make_tensor_value_info("logits", DOUBLE, [batch, seq, vocab])], inits)
    return make_model(graph)


rng = np.random.default_rng(42)
MLP_FEEDS = {"x": rng.standard_normal((4, 5)), "labels": np.array([0, 2, 1, 2], dtype=np.int64)}
CNN_FEEDS = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32), "labels": np.array([1, 3], dtype=np.int64)}
SEQ_FEEDS = {"ids": np.array([[1, 6, 1], [0, 3, 5]], dtype=np.int64),
             "labels": np.array([[6, 1, 2], [3, 5, 0]], dtype=np.int64)}


# ---- losses ---------------------------------------------------------------------------------
def test_cross_entropy_gradients_mlp():
    check_gradients(mlp(), MLP_FEEDS, loss="cross_entropy")


def test_cross_entropy_over_sequences_means_over_every_token():
    train = check_gradients(sequence_model(), SEQ_FEEDS, loss="cross_entropy", rtol=1e-5)
    logits = session(lower(sequence_model()).to_onnx()).run(None, {"ids": SEQ_FEEDS["ids"]})[0]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, SEQ_FEEDS["labels"][..., None], -1).mean()
    loss, = session(train.to_onnx()).run(["loss"], SEQ_FEEDS)
    assert loss.shape == () and np.isclose(loss, expected, rtol=1e-12)


def test_cross_entropy_keeps_only_the_logits_for_the_backward():
    """log softmax = logits - logsumexp: no second logits-sized tensor is defined before the
    backward, and the loss is exact where the logits are large (the logsumexp is stable)."""
    model = sequence_model()
    train = build_training_step(lower(model), loss="cross_entropy", optimizer="sgd")
    logits = lower(model).outputs[0]
    size = train.tensors[logits].nbytes
    before_backward = [t for op in train.ops if op.phase in ("forward", "loss") for t in op.present_outputs]
    assert [t for t in before_backward if train.tensors[t].nbytes == size] == [logits]
    assert "LogSoftmax" not in {op.op_type for op in train.ops}
    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["logits"])], "bias",
                              [helper.make_tensor_value_info("x", DOUBLE, [1, 3])],
                              [helper.make_tensor_value_info("logits", DOUBLE, [1, 3])],
                              [_init("b", np.zeros(3))])
    big = {"x": np.array([[1000.0, 1001.0, 999.0]]), "labels": np.array([1])}
    loss, = session(build_training_step(lower(make_model(graph)), loss="cross_entropy",
                                        optimizer="none").to_onnx()).run(["loss"], big)
    assert np.isclose(loss, np.log(np.exp([-1.0, 0.0, -2.0]).sum()), rtol=1e-12)


def test_mse_gradients_and_value():
    feeds = {"x": MLP_FEEDS["x"], "targets": rng.standard_normal((4, 3))}
    train = check_gradients(mlp(), feeds, loss="mse")
    logits = session(mlp()).run(None, {"x": feeds["x"]})[0]
    loss, = session(train.to_onnx()).run(["loss"], feeds)
    assert np.isclose(loss, ((logits - feeds["targets"]) ** 2).mean(), rtol=1e-12)
    assert train.inputs == ["x", "targets"]


def test_cnn_gradients_with_batch_statistics():
    """Conv, training-mode BN, MaxPool, depthwise conv, AveragePool, global pool, Gemm."""
    check_against_float64(small_cnn(), CNN_FEEDS, loss="cross_entropy", sample=4)


def test_batch_norm_uses_batch_statistics():
    """Running stats (here deliberately off) do not change a training step's loss."""
    model = small_cnn()
    for init in model.graph.initializer:
        if init.name.endswith("running_mean"):
            init.CopyFrom(_init(init.name, np.full(6, 5.0, np.float32)))
    losses = [session(build_training_step(lower(m)).to_onnx()).run(["loss"], CNN_FEEDS)[0]
              for m in (model, small_cnn())]
    assert np.isclose(losses[0], losses[1], rtol=1e-6)


# ---- optimizers -----------------------------------------------------------------------------
def _one_step(model, feeds, optimizer, **options):
    train = build_training_step(lower(model), loss="cross_entropy", optimizer=optimizer, **options)
    return train, dict(zip(train.outputs, session(train.to_onnx()).run(train.outputs, feeds)))


def test_optimizer_updates_follow_pytorch_formulas():
    lr = 0.1
    _, plain = _one_step(mlp(), MLP_FEEDS, "none")
    params = initial_values(mlp(), ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
    grads = {p: plain[f"{p}.grad"] for p in params}

    train, out = _one_step(mlp(), MLP_FEEDS, "sgd", lr=lr)
    assert train.outputs == ["loss"] + [f"{p}.updated" for p in params]
    for p in params:
        np.testing.assert_allclose(out[f"{p}.updated"], params[p] - lr * grads[p], rtol=1e-12)

    train, out = _one_step(mlp(), MLP_FEEDS, "momentum", lr=lr, momentum=0.5)
    for p in params:   # first step: the buffer starts at zero, so it becomes the gradient
        np.testing.assert_allclose(out[f"{p}.momentum_buffer.updated"], grads[p], rtol=1e-12)
        np.testing.assert_allclose(out[f"{p}.updated"], params[p] - lr * grads[p], rtol=1e-12)

    train, out = _one_step(mlp(), MLP_FEEDS, "adam", lr=lr, betas=(0.8, 0.9), eps=1e-3)
    assert train.outputs[:5] == ["loss", "fc1.weight.updated", "fc1.weight.exp_avg.updated",
                                 "fc1.weight.exp_avg_sq.updated", "fc1.weight.step.updated"]
    for p in params:
        g = grads[p]
        m, v = 0.2 * g, 0.1 * g * g
        expected = params[p] - lr / 0.2 * m / (np.sqrt(v) / np.sqrt(0.1) + 1e-3)
        np.testing.assert_allclose(out[f"{p}.exp_avg.updated"], m, rtol=1e-12)
        np.testing.assert_allclose(out[f"{p}.exp_avg_sq.updated"], v, rtol=1e-12)
        assert out[f"{p}.step.updated"] == 1
        np.testing.assert_allclose(out[f"{p}.updated"], expected, rtol=1e-10)


def test_adam_second_step_uses_the_step_count():
    """Two Adam steps fed back through the states equal the formula unrolled twice."""
    losses = train_losses(mlp(), MLP_FEEDS, steps=2, loss="cross_entropy", optimizer="adam", lr=0.05)
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_mlp_loss_falls_over_20_steps(optimizer):
    lr = {"sgd": 0.5, "momentum": 0.2, "adam": 0.05}[optimizer]
    losses = train_losses(mlp(), MLP_FEEDS, steps=20, loss="cross_entropy", optimizer=optimizer, lr=lr)
    assert losses[-1] < 0.5 * losses[0]
    assert all(np.isfinite(losses))


def test_cnn_loss_falls_over_20_sgd_steps():
    losses = train_losses(small_cnn(), CNN_FEEDS, steps=20, loss="cross_entropy", optimizer="sgd", lr=0.1)
    assert losses[-1] < 0.5 * losses[0]


def test_sequence_model_loss_falls_over_20_sgd_steps():
    losses = train_losses(sequence_model(), SEQ_FEEDS, steps=20, loss="cross_entropy", optimizer="sgd", lr=0.5)
    assert losses[-1] < 0.5 * losses[0]


# ---- structure ------------------------------------------------------------------------------
def _roles(graph):
    return json.loads(graph.metadata[GRAD_ROLES_KEY])


def test_phases_are_in_framework_order_and_the_graph_is_valid_onnx():
    train = build_training_step(lower(small_cnn()), optimizer="momentum")
    order = {"forward": 0, "loss": 1, "backward": 2, "update": 3}
    phases = [order[op.phase] for op in train.ops]
    assert phases == sorted(phases) and set(phases) == {0, 1, 2, 3}
    assert train.is_topological()
    model = train.to_onnx()
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain for o in model.opset_import} == {""} and model.opset_import[0].version == 17
    assert all(n.domain == "" for n in model.graph.node)
    # kinds, phases and roles survive the round trip through ONNX
    back = Graph.from_onnx(model)
    assert [op.phase for op in back.ops] == [op.phase for op in train.ops]
    assert {n: t.kind for n, t in back.tensors.items()} == {n: t.kind for n, t in train.tensors.items()}
    assert _roles(back) == _roles(train)


def test_backward_follows_the_forward_in_reverse():
    train = build_training_step(lower(small_cnn()))
    forward = [op.name for op in train.ops if op.phase == "forward"]
    roles = _roles(train)
    layers = [roles[op.name]["layer"] for op in train.ops if op.name in roles]
    first_seen = list(dict.fromkeys(layers))
    assert first_seen == sorted(first_seen, key=lambda name: -forward.index(name))


def test_tensor_kinds():
    train = build_training_step(lower(small_cnn()), optimizer="adam")
    kinds = {n: t.kind for n, t in train.tensors.items()}
    # batch statistics normalise; the running ones are updated as PyTorch's train mode does
    assert kinds["bn1.running_mean"] == "buffer" and kinds["bn1.running_mean.updated"] == "output"
    assert kinds["memsched.lr"] == kinds["memsched.beta1"] == "hyperparameter"
    assert kinds["conv1.weight"] == "parameter" and kinds["loss"] == "output"
    assert kinds["conv1.weight.grad"] == "param_grad"
    assert kinds["conv1.weight.exp_avg"] == "optimizer_state" and kinds["conv1.weight.step"] == "optimizer_state"
    assert kinds["conv1.weight.updated"] == "output" and kinds["logits"] == "activation"
    assert kinds["labels"] == "input"
    backward = {t for op in train.ops if op.phase == "backward" for t in op.present_outputs}
    # the backward makes gradients, and activations it derives again instead of keeping them
    assert {kinds[t] for t in backward if ".rederived" not in t} == {"gradient", "param_grad"}
    assert {kinds[t] for t in backward if ".rederived" in t} <= {"activation"}
    for t in train.tensors.values():
        if t.kind == "optimizer_state":
            assert not numpy_helper.to_array(t.data).any()


def test_dw_and_dx_are_separate_ops_for_every_layer():
    train = build_training_step(lower(small_cnn()), optimizer="sgd")
    roles = _roles(train)
    by_layer: dict[str, dict[str, set]] = {}
    for op in train.ops:
        role = roles.get(op.name)
        if op.phase == "backward" and role:
            by_layer.setdefault(role["layer"], {}).setdefault(role["role"], set()).add(role["param"])
    # only a norm's dy * xhat and its two sums are shared: computed once, they feed both the
    # scale (sum of dy * xhat), the bias (sum of dy) and the input gradient (xhat itself comes
    # from the forward pass: each BN feeds a ReLU, passes.training.bn_relu)
    assert {layer for layer, r in by_layer.items() if "shared" in r} == {"bn1", "bn2"}
    shared = [op.op_type for op in train.ops if roles.get(op.name, {}).get("role") == "shared"]
    assert sorted(shared) == ["Mul", "Mul", "ReduceSum", "ReduceSum", "ReduceSum", "ReduceSum"]
    assert by_layer["conv2"] == {"dX": {"conv2.weight"}, "dW": {"conv2.weight", "conv2.bias"}}
    assert by_layer["bn1"] == {"dX": {"bn1.weight"}, "dW": {"bn1.weight", "bn1.bias"},
                               "shared": {"bn1.weight"}}
    assert by_layer["fc"] == {"dX": {"fc.weight"}, "dW": {"fc.weight", "fc.bias"}}
    assert by_layer["conv1"] == {"dW": {"conv1.weight"}}   # the input image needs no gradient
    conv_dw = [op for op in train.ops if roles.get(op.name) == {"role": "dW", "layer": "conv1",
                                                                  "param": "conv1.weight"}]
    assert conv_dw[-1].outputs == ["conv1.weight.grad"]
    statistics = [op for op in train.ops if "/running_statistics/" in op.name]
    updates = [op for op in train.ops if op.phase == "update" and op not in statistics]
    assert {roles[op.name]["param"] for op in updates} == set(training_info(train)["parameters"])
    assert all(roles[op.name]["role"] == "update" for op in updates)
    # BatchNorm's running statistics are updated last, in phase update, with no grad role
    assert train.ops[-len(statistics):] == statistics and all(op.phase == "update" for op in statistics)
    assert not any(op.name in roles for op in statistics)


def test_default_schedule_is_valid_for_the_memory_model():
    train = build_training_step(lower(mlp()), optimizer="sgd")
    profile = analyze(train, default_schedule(train))
    assert profile.peak_bytes > 0


# ---- trainable parameters and errors --------------------------------------------------------
def test_trainable_parameters_exclude_buffers_scalars_and_frozen():
    train = build_training_step(lower(small_cnn()), freeze=["bn*", "conv1.*"])
    params = training_info(train)["parameters"]
    assert params == ["conv2.weight", "conv2.bias", "fc.weight", "fc.bias"]
    buffers = [f"{bn}.running_{s}.updated" for bn in ("bn1", "bn2") for s in ("mean", "var")]
    assert train.outputs == ["loss"] + [f"{p}.grad" for p in params] + [b for b in buffers if b in train.tensors]
    assert not any(op.op_type == "ConvTranspose" and op.phase == "backward" and "conv1" in op.name
                   for op in train.ops)


def test_freeze_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(UserError, match="--freeze 'nope' matches no trainable parameter"):
        build_training_step(lower(mlp()), freeze=["nope"])


def test_ops_without_a_gradient_rule_are_all_named():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Sin", ["w"], ["a"], name="sin1"),
             helper.make_node("Cos", ["a"], ["b"], name="cos1"),
             helper.make_node("Sin", ["b"], ["c"], name="sin2"),
             helper.make_node("Pad", ["c", "pads"], ["d"], name="reflect", mode="reflect"),
             helper.make_node("ReduceSum", ["d"], ["out"], keepdims=0)]
    graph = helper.make_graph(nodes, "bad", [], [helper.make_tensor_value_info("out", FLOAT, [])],
                              [_init("w", rng.standard_normal((3, 3)).astype(np.float32)),
                               _init("pads", np.array([0, 1, 0, 1], dtype=np.int64))])
    with pytest.raises(UserError) as err:
        build_training_step(lower(make_model(graph)), loss="output")
    message = str(err.value)
    assert "Cos (node 'cos1')" in message and "Sin (nodes 'sin1', 'sin2')" in message
    assert "Pad node 'reflect': mode 'reflect' is not supported" in message


@pytest.mark.parametrize("options, message", [
    ({"loss": "hinge"}, "unknown loss 'hinge'"),
    ({"optimizer": "lbfgs"}, "unknown optimizer 'lbfgs'"),
    ({"lr": -1.0}, "learning rate must be a positive number"),
    ({"loss": "output"}, "needs a model whose output is a scalar loss"),
    ({"freeze": ["*"]}, "no trainable parameter that reaches its output .all are frozen"),
])
def test_bad_options(options, message):
    with pytest.raises(UserError, match=message):
        build_training_step(lower(mlp()), **options)


def test_old_opset_is_refused():
    with pytest.raises(UserError, match="opset 11"):
        build_training_step(lower(mlp()).replace(opset_imports={"": 11}))


def test_shared_parameter_gets_one_accumulated_gradient():
    """A weight used twice (tied embeddings) gets the sum of both contributions."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["w", "w"], ["a"], name="square"),
             helper.make_node("Mul", ["a", "w"], ["b"], name="again"),
             helper.make_node("ReduceSum", ["b"], ["out"], keepdims=0)]
    graph = helper.make_graph(nodes, "tied", [], [helper.make_tensor_value_info("out", DOUBLE, [])],
                              [_init("w", rng.standard_normal((3, 3)))])
    train = check_gradients(make_model(graph))
    assert train.outputs == ["loss", "w.grad"]


def test_cross_entropy_over_segmentation_maps_uses_the_channel_axis():
    """[N, C, H, W] logits: classes on axis 1, labels [N, H, W], mean over every pixel."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w"], ["logits"], name="head", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "seg", [helper.make_tensor_value_info("x", FLOAT, [2, 2, 3, 4])],
                              [helper.make_tensor_value_info("logits", FLOAT, [2, 3, 3, 4])],
                              [_init("w", rng.standard_normal((3, 2, 3, 3)).astype(np.float32))])
    model = make_model(graph)
    feeds = {"x": rng.standard_normal((2, 2, 3, 4)).astype(np.float32),
             "labels": rng.integers(0, 3, (2, 3, 4))}
    check_against_float64(model, feeds, loss="cross_entropy", sample=6)
    logits = session(model).run(None, {"x": feeds["x"]})[0].astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expected = -np.take_along_axis(log_probs, feeds["labels"][:, None], 1).mean()
    train = build_training_step(lower(model))
    assert train.tensors["labels"].shape == (2, 3, 4)
    assert np.isclose(session(train.to_onnx()).run(["loss"], feeds)[0], expected, rtol=1e-5)


def test_read_running_statistics_follow_onnx_training_mode():
    """A training-mode BN whose running mean/var some op reads gets them computed (ONNX's
    definition, matched by ONNX Runtime's own training-mode BatchNormalization); as in
    PyTorch, no gradient flows through them."""
    rng = np.random.default_rng(7)
    f = np.float32
    bn = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], name="bn",
                          training_mode=1, momentum=0.8)
    nodes = [helper.make_node("Mul", ["x0", "w"], ["x"], name="scale"), bn,
             helper.make_node("ReduceSum", ["rm"], ["rm_sum"], keepdims=0),
             helper.make_node("ReduceSum", ["rv"], ["rv_sum"], keepdims=0),
             helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["y_sum"], keepdims=0),
             helper.make_node("Sum", ["y_sum", "rm_sum", "rv_sum"], ["out"])]
    inits = [_init("w", rng.standard_normal((1, 3, 1, 1)).astype(f)), _init("s", np.ones(3, f)),
             _init("b", np.zeros(3, f)), _init("m", rng.standard_normal(3).astype(f)),
             _init("v", rng.random(3).astype(f) + 0.5)]
    weight = rng.standard_normal((4, 3, 2, 2)).astype(f)
    nodes.insert(0, helper.make_node("Constant", [], ["r"], value=_init("r", weight)))
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x0", FLOAT, [4, 3, 2, 2])],
                              [helper.make_tensor_value_info("out", FLOAT, [])], inits)
    model = make_model(graph)
    feeds = {"x0": rng.standard_normal((4, 3, 2, 2)).astype(f)}
    expected = session(model).run(None, feeds)[0]
    loss, grad = session(build_training_step(lower(model), loss="output").to_onnx()).run(["loss", "w.grad"], feeds)
    assert np.isclose(loss, expected, rtol=1e-5)
    del graph.node[3:]
    graph.node.extend([helper.make_node("Mul", ["y", "r"], ["yr"]),
                       helper.make_node("ReduceSum", ["yr"], ["out"], keepdims=0)])
    without, = session(build_training_step(lower(make_model(graph)), loss="output").to_onnx()).run(["w.grad"], feeds)
    assert np.abs(grad).max() > 1e-3
    np.testing.assert_allclose(grad, without, rtol=1e-5)


def test_linear_behind_a_transpose_makes_no_transposed_copy_of_its_weight():
    """MatMul(x, Transpose(W)) (a Linear in a training export): the forward runs Gemm(x rows, W,
    transB=1), dX = dy @ W and dW = dy^T @ x, so no op makes a transposed copy of W or of its
    gradient, whatever x's rank; a Transpose also read otherwise stays. Gradients match central
    differences."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Transpose", ["w2"], ["w2t"], name="t2"),
             helper.make_node("MatMul", ["a", "w2t"], ["logits3"], name="mm2"),
             helper.make_node("Transpose", ["w3"], ["w3t"], name="t3"),
             helper.make_node("Reshape", ["logits3", "rows"], ["flat"], name="flatten"),
             helper.make_node("MatMul", ["flat", "w3t"], ["y"], name="mm3"),
             helper.make_node("ReduceSum", ["w3t", "one"], ["w3s"], name="w3sum", keepdims=0),
             helper.make_node("Transpose", ["w4"], ["w4t"], name="t4"),
             helper.make_node("MatMul", ["y", "w4t"], ["y4"], name="mm4"),   # 2-D x: one Gemm
             helper.make_node("Add", ["y4", "w3s"], ["logits"], name="shift")]
    graph = helper.make_graph(nodes, "linear_t", [helper.make_tensor_value_info("x", DOUBLE, [2, 3, 4])],
                              [helper.make_tensor_value_info("logits", DOUBLE, [6, 5])],
                              [_init("w", rng.standard_normal((6, 4))), _init("w2", rng.standard_normal((5, 6))),
                               _init("w3", rng.standard_normal((5, 5))), _init("w4", rng.standard_normal((5, 5))),
                               numpy_helper.from_array(np.array([6, 5], dtype=np.int64), "rows"),
                               numpy_helper.from_array(np.array([0], dtype=np.int64), "one")])
    feeds = {"x": rng.standard_normal((2, 3, 4)), "labels": np.array([0, 4, 2, 1, 3, 0], dtype=np.int64)}
    train = check_gradients(make_model(graph), feeds, loss="cross_entropy")
    forward = {op.name: op for op in train.ops if op.phase == "forward"}
    assert not {"t", "t2", "t4"} & set(forward) and "t3" in forward   # w3t is read by w3sum too
    assert forward["mm2"].op_type == "Reshape" and forward["mm3"].op_type == "MatMul"
    # the Add of a [5] vector to mm4's product is its bias: the Gemm takes it as C, no Add runs
    assert forward["mm4"].op_type == "Gemm" and forward["mm4"].inputs == ["y", "w4", "w3s"]
    assert "shift" not in forward and forward["mm4"].outputs == ["logits"]
    gemms = [op for op in train.ops if op.phase == "forward" and op.op_type == "Gemm"]
    assert sorted(op.inputs[1] for op in gemms) == ["w", "w2", "w4"]
    assert all(op.attributes["transB"] == 1 for op in gemms)
    assert not {"wt", "w2t", "w4t"} & {t for op in train.ops for t in op.inputs}
    # nor backward: the MatMul rule gives dW in W's layout (dy^T @ x), and the Transpose passes it on
    assert not [op for op in train.ops if op.op_type == "Transpose" and train.tensors[op.outputs[0]].shape in
                {(6, 4), (4, 6), (5, 6), (6, 5)}]
    assert {train.producer[f"{w}.grad"].op_type for w in ("w", "w2", "w4")} == {"Gemm"}   # named, not copied


def test_linear_bias_add_runs_inside_the_gemm():
    """MatMul(x, Transpose(W)) then Add(bias, .) (nn.Linear on [N, L, d] as exported): the forward
    Gemm takes the bias as C and writes the Add's output through its Reshape, so no elementwise
    pass over the product adds it. A bias of another size, or a product read twice, keeps its
    Add. Gradients (x, W and both biases) match central differences."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"], name="mm"),
             helper.make_node("Add", ["b", "h"], ["hb"], name="bias"),          # bias first, as exported
             helper.make_node("Tanh", ["hb"], ["a"], name="act"),
             helper.make_node("Transpose", ["w2"], ["w2t"], name="t2"),
             helper.make_node("MatMul", ["a", "w2t"], ["y"], name="mm2"),
             helper.make_node("Add", ["y", "b2"], ["z"], name="bias2"),         # [1, 5]: not a 1-D bias
             helper.make_node("Transpose", ["w3"], ["w3t"], name="t3"),
             helper.make_node("MatMul", ["z", "w3t"], ["u"], name="mm3"),
             helper.make_node("Add", ["u", "b3"], ["v"], name="bias3"),
             helper.make_node("Add", ["v", "u"], ["out"], name="twice"),        # u read twice: no fold
             helper.make_node("Reshape", ["out", "rows"], ["logits"], name="flatten")]
    graph = helper.make_graph(nodes, "linear_bias", [helper.make_tensor_value_info("x", DOUBLE, [2, 3, 4])],
                              [helper.make_tensor_value_info("logits", DOUBLE, [6, 5])],
                              [_init("w", rng.standard_normal((6, 4))), _init("b", rng.standard_normal(6)),
                               _init("w2", rng.standard_normal((5, 6))), _init("b2", rng.standard_normal((1, 5))),
                               _init("w3", rng.standard_normal((5, 5))), _init("b3", rng.standard_normal(5)),
                               numpy_helper.from_array(np.array([6, 5], dtype=np.int64), "rows")])
    feeds = {"x": rng.standard_normal((2, 3, 4)), "labels": np.array([0, 4, 2, 1, 3, 0], dtype=np.int64)}
    train = check_gradients(make_model(graph), feeds, loss="cross_entropy")
    forward = {op.name: op for op in train.ops if op.phase == "forward"}
    assert "bias" not in forward and forward["mm"].op_type == "Reshape" and forward["mm"].outputs == ["hb"]
    gemm = train.producer[forward["mm"].inputs[0]]
    assert gemm.op_type == "Gemm" and gemm.inputs[1:] == ["w", "b"] and gemm.attributes["transB"] == 1
    assert "h" not in train.tensors                                   # the product without its bias is never made
    assert {"bias2", "bias3"} <= set(forward)                          # kept: a [1, 5] shift; a product read twice
    assert {train.producer[f"{b}.grad"].op_type for b in ("b", "b3")} == {"ReduceSum"}


def test_linear_takes_a_scalar_scale_of_its_input_as_alpha():
    """BERT's FFN: GELU (x * (erf(x / sqrt2) + 1) * 0.5; tanh here, which has a double kernel) then
    a Linear. The closing * 0.5 is read
    only by the Linear's MatMul, so its Gemm reads x * (erf + 1) with alpha 0.5 (and the bias as C):
    the scaled tensor is never made, forward or backward, and dW = 0.5 * dy^T @ m reads the
    unscaled product. A scale read twice stays. Gradients match central differences."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"], name="mm"),
             helper.make_node("Div", ["h", "sqrt2"], ["d"], name="div"),
             helper.make_node("Tanh", ["d"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["a"], name="add1"),
             helper.make_node("Mul", ["h", "a"], ["m"], name="mul"),
             helper.make_node("Mul", ["m", "half"], ["g"], name="half_of"),
             helper.make_node("Transpose", ["w2"], ["w2t"], name="t2"),
             helper.make_node("MatMul", ["g", "w2t"], ["y"], name="mm2"),
             helper.make_node("Add", ["b2", "y"], ["z"], name="bias2"),
             helper.make_node("Mul", ["z", "half"], ["s"], name="scale_twice"),   # read by two ops: kept
             helper.make_node("Transpose", ["w3"], ["w3t"], name="t3"),
             helper.make_node("MatMul", ["s", "w3t"], ["u"], name="mm3"),
             helper.make_node("Add", ["u", "s"], ["logits"], name="skip")]
    graph = helper.make_graph(nodes, "linear_scale", [helper.make_tensor_value_info("x", DOUBLE, [6, 4])],
                              [helper.make_tensor_value_info("logits", DOUBLE, [6, 5])],
                              [_init("w", rng.standard_normal((8, 4))), _init("w2", rng.standard_normal((5, 8))),
                               _init("b2", rng.standard_normal(5)), _init("w3", rng.standard_normal((5, 5))),
                               _init("sqrt2", np.array(np.sqrt(2.0))), _init("one", np.array(1.0)),
                               _init("half", np.array(0.5))])
    feeds = {"x": rng.standard_normal((6, 4)), "labels": np.array([0, 4, 2, 1, 3, 0], dtype=np.int64)}
    train = check_gradients(make_model(graph), feeds, loss="cross_entropy")
    forward = {op.name: op for op in train.ops if op.phase == "forward"}
    assert "half_of" not in forward and "g" not in train.tensors
    gemm = forward["mm2"]
    assert gemm.op_type == "Gemm" and gemm.inputs == ["m", "w2", "b2"] and gemm.attributes["alpha"] == 0.5
    dw = train.producer["w2.grad"]
    assert dw.op_type == "Gemm" and "m" in dw.inputs and dw.attributes["alpha"] == 0.5
    assert "scale_twice" in forward and forward["mm3"].inputs[0] == "s" and "alpha" not in forward["mm3"].attributes


def test_attention_scale_runs_inside_the_query_gemm():
    """scores = q @ k^T / c (a BERT export's attention): the query Linear's Gemm scales by 1/c
    (alpha, and beta for its bias), q's Reshape and Transpose carry the scaled values, the
    score MatMul writes the Div's output, and no Div runs forward or backward. Every gradient,
    the query's weight and bias among them, matches central differences (c = 3: not a power
    of two, so the fold rounds differently, within the check's tolerance)."""
    rng = np.random.default_rng(4)

    def linear(name, x, out):
        return [helper.make_node("Transpose", [f"w{name}"], [f"w{name}t"], name=f"t{name}", perm=[1, 0]),
                helper.make_node("MatMul", [x, f"w{name}t"], [f"{name}0"], name=f"mm{name}"),
                helper.make_node("Add", [f"b{name}", f"{name}0"], [out], name=f"bias{name}")]

    nodes = [*linear("q", "x", "q"), *linear("k", "x", "k"), *linear("v", "x", "v"),
             helper.make_node("Reshape", ["q", "heads"], ["qh"], name="qr"),
             helper.make_node("Transpose", ["qh"], ["qt"], name="qt", perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["k", "heads"], ["kh"], name="kr"),
             helper.make_node("Transpose", ["kh"], ["kt"], name="kt", perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["v", "heads"], ["vh"], name="vr"),
             helper.make_node("Transpose", ["vh"], ["vt"], name="vt", perm=[0, 2, 1, 3]),
             helper.make_node("MatMul", ["qt", "kt"], ["scores"], name="scores"),
             helper.make_node("Div", ["scores", "c"], ["scaled"], name="scale"),
             helper.make_node("Softmax", ["scaled"], ["probs"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["probs", "vt"], ["ctx"], name="ctx"),
             helper.make_node("Transpose", ["ctx"], ["ctxt"], name="ctxt", perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["ctxt", "rows"], ["flat"], name="flat"),
             helper.make_node("Transpose", ["wo"], ["wot"], name="to", perm=[1, 0]),
             helper.make_node("MatMul", ["flat", "wot"], ["logits"], name="mmo")]
    inits = [_init(f"w{n}", rng.standard_normal((4, 4))) for n in "qkv"] + \
            [_init(f"b{n}", rng.standard_normal(4)) for n in "qkv"] + \
            [_init("wo", rng.standard_normal((5, 4))), _init("c", np.array(3.0)),
             numpy_helper.from_array(np.array([2, 3, 2, 2], dtype=np.int64), "heads"),
             numpy_helper.from_array(np.array([6, 4], dtype=np.int64), "rows")]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", DOUBLE, [2, 3, 4])],
                              [helper.make_tensor_value_info("logits", DOUBLE, [6, 5])], inits)
    feeds = {"x": rng.standard_normal((2, 3, 4)), "labels": np.array([0, 4, 2, 1, 3, 0], dtype=np.int64)}
    train = check_gradients(make_model(graph), feeds, loss="cross_entropy")
    assert [op.name for op in train.ops if op.op_type == "Div"] == ["loss/grad/Div"]   # the loss's mean only
    forward = {op.name: op for op in train.ops if op.phase == "forward"}
    query = train.producer[forward["mmq"].inputs[0]]
    assert query.op_type == "Gemm" and query.attributes["alpha"] == query.attributes["beta"] == 1 / 3
    assert all("alpha" not in train.producer[forward[f"mm{n}"].inputs[0]].attributes for n in "kv")
    assert forward["scores"].outputs == ["scaled"] and "scores" not in train.tensors


def test_conv_weight_gradient_at_batch_one_moves_no_data():
    """At batch 1, [N, C, ...] -> [C, N, ...] is a Reshape (a view), not a Transpose copy: the
    only Transposes left in a conv's backward are of weight-sized tensors (dW's own layout)."""
    def transposed_bytes(batch):
        train = build_training_step(lower(small_cnn(batch=batch)), optimizer="sgd")
        return {train.tensors[op.inputs[0]].nbytes for op in train.ops
                if op.phase == "backward" and op.op_type == "Transpose" and op.name.startswith("conv")}

    weights = {6 * 3 * 3 * 3 * 4, 6 * 1 * 3 * 3 * 4}
    assert transposed_bytes(1) <= weights
    assert not transposed_bytes(2) <= weights


@pytest.mark.parametrize("shape, weight, by_sample", [((2, 3, 8, 8), (4, 3, 3, 3), True),
                                                      ((2, 16, 2, 2), (16, 16, 3, 3), False)])
def test_conv_weight_gradient_by_sample_where_it_is_smaller(shape, weight, by_sample):
    """Where batch x the weight is smaller than X and dY together, dW is one Conv grouped by
    sample over views of X and dY, summed over the batch: no Transpose in the backward at all;
    elsewhere X and dY are transposed. Gradients match finite differences either way."""
    rng = np.random.default_rng(3)
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1], strides=[1, 1])
    out_shape = [shape[0], weight[0], shape[2], shape[3]]
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", FLOAT, out_shape)],
                              [_init("w", (rng.standard_normal(weight) * 0.3).astype(np.float32))])
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "targets": rng.standard_normal(out_shape).astype(np.float32)}
    model = make_model(graph)
    check_against_float64(model, feeds, loss="mse", sample=4)
    train = build_training_step(lower(model), loss="mse", optimizer="sgd")
    backward = [op for op in train.ops if op.phase == "backward"]
    convs = [op for op in backward if op.op_type == "Conv"]
    assert len(convs) == 1
    if by_sample:
        assert not any(op.op_type == "Transpose" for op in backward)
        assert convs[0].attributes["group"] == shape[0] and len(train.tensors[convs[0].inputs[0]].shape) == 5
    else:
        transposed = {train.tensors[op.inputs[0]].shape for op in backward if op.op_type == "Transpose"}
        assert tuple(shape) in transposed


@pytest.mark.parametrize("optimizer, taken", [("sgd", "fc1.weight.grad"), ("sgd", "fc2.bias.updated"),
                                              ("adam", "fc1.weight.exp_avg")])
def test_a_model_using_a_name_the_step_needs_is_refused(optimizer, taken):
    """A tensor of the model named as the step names a gradient, an optimizer state or an
    updated weight would be overwritten: one clear error instead."""
    model = mlp()
    model.graph.node[1].output[0] = taken          # the Relu's output
    model.graph.node[2].input[0] = taken
    with pytest.raises(UserError, match=f"already has tensors named '{taken}'"):
        build_training_step(lower(model), optimizer=optimizer)
