"""The float32 training step against the same step in float64 (memsched.numerics): every
bundled model and the GoogLeNet-style graph within 1e-3 per parameter, at small sizes, with
trained-like norm parameters (scale and shift jittered: at init, scale 1 and shift 0 make some
gradients cancel to ~1e-6 of their terms by symmetry, which no float32 step resolves), the
float64 run on the float32 run's branch decisions (ReLU masks, argmaxes: see
`numerics.decisions`); and the check itself catches an unstable formulation, a branch taken
differently and a zero gradient that is not zero in the float64 run."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import models
from memsched import numerics
from memsched.frontend import lower
from memsched.ort import make_session
from memsched.step_info import step_info
from memsched.onnx_utils import make_model
from memsched.models.cnn import googlenet
from memsched.passes.training import build_training_step
from tests.test_autodiff_models import TRANSFORMER, _batch

AGREE = 1e-3
TINY_CNN = dict(batch=2, size=32, classes=10)
SMALL_CNN = dict(batch=4, size=64, classes=10)   # BatchNorm over >= 16 values at ResNet's last stage
CASES = {
    "mlp": (lambda: models.build("mlp", batch=4, size=8, hidden=(16, 8)), False),
    "bert-base": (lambda: models.build("bert-base", **TRANSFORMER), False),
    "gpt2": (lambda: models.build("gpt2", **TRANSFORMER), False),
    "vgg16": (lambda: models.build("vgg16", hidden=64, **TINY_CNN), True),
    "resnet18": (lambda: models.build("resnet18", **SMALL_CNN), True),
    "resnet50": (lambda: models.build("resnet50", **SMALL_CNN), True),
    "mobilenetv2": (lambda: models.build("mobilenetv2", width=0.25, **SMALL_CNN), True),
    "unet2d": (lambda: models.build("unet2d", batch=1, size=32, width=4, depth=2), True),
    "unet3d": (lambda: models.build("unet3d", batch=1, size=16, width=4, depth=2), True),
    "googlenet-style": (lambda: googlenet(batch=2, size=64, classes=10, width=0.25), True),
    "dcgan-generator": (lambda: models.build("dcgan-generator", batch=4, size=16, nz=8, ngf=4), False),
    "dcgan-discriminator": (lambda: models.build("dcgan-discriminator", batch=4, size=16, ndf=4), False),
}
LOSSES = {"dcgan-generator": "mse", "dcgan-discriminator": "bce_with_logits"}   # the rest: cross_entropy


def jittered(model: onnx.ModelProto, seed: int = 1) -> onnx.ModelProto:
    """Norm scales and shifts (1-D float parameters) moved off 1 and 0, as training leaves them."""
    rng = np.random.default_rng(seed)
    for init in model.graph.initializer:
        if init.name.endswith((".weight", ".bias")) and len(init.dims) == 1 and init.data_type == TensorProto.FLOAT:
            value = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(value + 0.2 * rng.standard_normal(value.shape).astype(np.float32),
                                                  init.name))
    return model


def test_every_bundled_model_has_a_case():
    assert set(models.NAMES) <= set(CASES)


@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=[pytest.mark.slow] if slow else [])
                                  for n, (_, slow) in CASES.items()])
def test_float32_step_is_within_1e3_of_float64(name):
    model = jittered(CASES[name][0]())
    loss = LOSSES.get(name, "cross_entropy")
    step = build_training_step(lower(model), loss=loss, optimizer="none")
    rows = numerics.check(step, _batch(model, loss=loss))
    assert len(rows) == len(step_info(step).parameters)     # every parameter's gradient
    assert rows == sorted(rows, key=lambda r: -r.error)
    assert rows[0].error < AGREE, numerics.format_rows(rows, 5)


@pytest.mark.slow
@pytest.mark.parametrize("build", [
    pytest.param(lambda: googlenet(batch=8, size=160, classes=10, width=0.25), id="googlenet-style"),
    pytest.param(lambda: models.build("mobilenetv2", batch=8, size=160, classes=10, width=0.25), id="mobilenetv2")])
def test_at_160_pixels_batch_8_the_step_is_within_1e3(build):
    """Larger maps: more values per BatchNorm channel (8 x 80 x 80 in the first), longer
    sums in every weight gradient."""
    model = jittered(build())
    step = build_training_step(lower(model), loss="cross_entropy", optimizer="none")
    rows = numerics.check(step, _batch(model))
    assert rows[0].error < AGREE, numerics.format_rows(rows, 5)


def _norm_model(shape) -> onnx.ModelProto:
    """input -> BatchNormalization -> GlobalAveragePool -> Flatten: class logits [N, C]."""
    channels = shape[1]
    inits = [numpy_helper.from_array(np.full(channels, v, np.float32), n)
             for n, v in (("bn.weight", 1.5), ("bn.bias", 0.25), ("bn.running_mean", 0.0), ("bn.running_var", 1.0))]
    nodes = [helper.make_node("BatchNormalization", ["x", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                              ["y"], name="bn", epsilon=1e-5),
             helper.make_node("GlobalAveragePool", ["y"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["logits"])]
    graph = helper.make_graph(nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [shape[0], channels])],
                              inits)
    return make_model(graph, opset=17)


def test_batch_norm_statistics_are_float32_accurate_over_a_large_map():
    """1 / std of a BatchNorm over 8 x 128 x 128 values per channel within 1e-6 of float64
    (a sum of squares accumulated one element after another is off by ~1e-5 here)."""
    shape = (8, 2, 128, 128)
    x = (3 + np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
    step = build_training_step(lower(_norm_model(shape)), loss="cross_entropy", optimizer="none")
    (inv_std,) = [op.outputs[0] for op in step.ops if op.op_type == "Reciprocal" and op.phase == "forward"]
    session = make_session(step.replace(outputs=[inv_std]).to_onnx(), "cpu", 0)
    got = session.run([inv_std], {"x": x, "labels": np.zeros(8, np.int64)})[0]
    wide = x.astype(np.float64)
    want = 1 / np.sqrt(wide.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    assert np.abs(got / want - 1).max() < 1e-6


def test_gradients_zero_in_exact_arithmetic_are_zero_in_the_float64_run():
    """A BatchNorm bias ahead of a 1x1 convolution and another BatchNorm has a zero gradient.
    The float64 run makes it ~1e-18 of the largest gradient (means divide by their count:
    a Mul by 1 / 1152 rounded to float32 left ~1e-8), so the check tells it apart."""
    model = jittered(models.build("mobilenetv2", batch=2, size=48, classes=10, width=0.25))
    step = build_training_step(lower(model), loss="cross_entropy", optimizer="none")
    rows = numerics.check(step, _batch(model))
    top = max(r.scale for r in rows)
    zero = [r for r in rows if r.param.endswith(("conv.3.bias", "features.1.conv.2.bias"))]   # each block's last BN
    assert len(zero) == 17 and all(r.zero and r.scale < 1e-15 * top for r in zero)
    assert rows[0].error < AGREE, numerics.format_rows(rows, 5)


def _kink_step():
    """logits = Relu(x * w + b) with one element exactly 0 in float32 (x * w rounds the
    2^-24 away) and 2^-24 in exact arithmetic: the two runs' ReLU masks differ there."""
    u = 2.0 ** -12
    inits = [numpy_helper.from_array(np.array([1 + u, 0.7, 1.3], np.float32), "w"),
             numpy_helper.from_array(np.array([-(1 + 2 * u), 0.2, 0.1], np.float32), "b")]
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["logits"])]
    graph = helper.make_graph(nodes, "kink", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3])], inits)
    step = build_training_step(lower(make_model(graph, opset=17)), loss="cross_entropy", optimizer="none")
    feeds = {"x": np.array([[1 + u, 2, 0.5], [1.5, -1, 3]], np.float32), "labels": np.array([1, 2], np.int64)}
    return step, feeds


def test_the_float64_run_takes_the_float32_runs_branch():
    step, feeds = _kink_step()
    assert len(numerics.decisions(step)) == 1   # the ReLU's mask
    own = numerics.check(step, feeds, pin=False)
    pinned = numerics.check(step, feeds)
    assert own[0].error > 0.1 > AGREE > 1e-5 > pinned[0].error


def test_updates_are_compared_where_the_step_has_an_optimizer():
    model = jittered(CASES["mlp"][0]())
    step = build_training_step(lower(model), loss="cross_entropy", optimizer="sgd", lr=0.1)
    rows = numerics.check(step, _batch(model))
    assert {r.compared for r in rows} == {"update"} and len(rows) == 6
    assert rows[0].error < AGREE


def _variance_step(stable: bool) -> onnx.ModelProto:
    """A stand-in training step whose 'gradient' of w is w * var(x), var by two passes or as
    E[x^2] - E[x]^2 (cancels: x has mean 1000 and spread 1)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=1)]
    if stable:
        nodes += [helper.make_node("Sub", ["x", "m"], ["c"]), helper.make_node("Mul", ["c", "c"], ["c2"]),
                  helper.make_node("ReduceMean", ["c2"], ["v"], keepdims=0)]
    else:
        nodes += [helper.make_node("Mul", ["x", "x"], ["x2"]),
                  helper.make_node("ReduceMean", ["x2"], ["e2"], keepdims=0),
                  helper.make_node("Mul", ["m", "m"], ["m2"]), helper.make_node("Reshape", ["m2", "scalar"], ["m2s"]),
                  helper.make_node("Sub", ["e2", "m2s"], ["v"])]
    nodes += [helper.make_node("Mul", ["w", "v"], ["w.grad"]),
              helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(np.linspace(1, 2, 4).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(0, np.int64), "scalar")]
    graph = helper.make_graph(nodes, "var", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("w.grad", TensorProto.FLOAT, [4])], inits)
    return make_model(graph, opset=17)


def test_the_check_catches_a_cancelling_variance():
    x = (1000 + np.random.default_rng(0).standard_normal(4096)).astype(np.float32)
    unstable = numerics.check(lower(_variance_step(False)), {"x": x})
    stable = numerics.check(lower(_variance_step(True)), {"x": x})
    assert [r.param for r in unstable] == ["w"]
    assert unstable[0].error > 1e-2 > AGREE > 1e-5 > stable[0].error


def test_double_graph_keeps_layer_norm_statistics_in_float64():
    step = build_training_step(lower(CASES["bert-base"][0]()), loss="cross_entropy", optimizer="none")
    double = numerics.double_graph(step)
    assert not any(op.op_type == "LayerNormalization" for op in double.ops)
    floats = {t.dtype for t in double.tensors.values() if t.dtype in numerics.FLOAT_TYPES}
    assert floats == {TensorProto.DOUBLE}


@pytest.mark.parametrize("group, stride, dilation, pads, output_padding",
                         [(1, 1, 1, [1, 1, 1, 1], [0, 0]), (1, 2, 2, [0, 1, 1, 0], [1, 1]), (2, 2, 1, [1] * 4, [1, 0])])
def test_conv_transpose_matches_the_reference(group, stride, dilation, pads, output_padding):
    """numerics.conv_transpose against ONNX's reference ConvTranspose, one group at a time."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(3 * group)
    got = numerics.conv_transpose(x, w, b, group=group, strides=[stride] * 2, dilations=[dilation] * 2, pads=pads,
                                  output_padding=output_padding)
    per = 4 // group
    for g in range(group):
        node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[stride] * 2,
                                dilations=[dilation] * 2, pads=pads, output_padding=output_padding)
        model = helper.make_model(helper.make_graph(
            [node], "ct", [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in "xwb"],
            [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)]),
            opset_imports=[helper.make_opsetid("", 17)])
        want = ReferenceEvaluator(model).run(None, {"x": x[:, g * per:(g + 1) * per], "w": w[g * per:(g + 1) * per],
                                                    "b": b[g * 3:(g + 1) * 3]})[0]
        np.testing.assert_allclose(got[:, g * 3:(g + 1) * 3], want, rtol=1e-12, atol=1e-12)


def test_check_numerics_cli_names_the_worst_parameters(tmp_path):
    """`memsched check-numerics` builds the training step, runs it in float32 and float64 and
    prints the worst parameters first (JSON: every row's error, sorted)."""
    import json

    from .conftest import run_cli

    path = tmp_path / "mlp.onnx"
    assert run_cli("models", "export", "mlp", "-o", path, "--batch", "4").returncode == 0
    proc = run_cli("check-numerics", path, "--top", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    errors = [row["error"] for row in report["rows"]]
    assert len(errors) == 3 and errors == sorted(errors, reverse=True) and report["worst"]["error"] == errors[0]
    assert 0 < errors[0] < 1e-3 and report["branches"] == "float32's"
    strict = json.loads(run_cli("check-numerics", path, "--strict", "--json").stdout)
    assert strict["branches"] == "own" and strict["worst"]["error"] < 1e-3


def _if_model() -> onnx.ModelProto:
    """x @ W, times an If's constant branch (a float tensor made inside the subgraph)."""
    def branch(name: str, value: float) -> onnx.GraphProto:
        node = helper.make_node("Constant", [], [f"{name}_out"],
                                value=numpy_helper.from_array(np.full(4, value, np.float32)))
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [4])
        return helper.make_graph([node], name, [], [out])

    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("If", ["cond"], ["s"], name="if", then_branch=branch("then", 2.0),
                              else_branch=branch("else", 3.0)),
             helper.make_node("Mul", ["h", "s"], ["y"], name="mul")]
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [weight, numpy_helper.from_array(np.array(True), "cond")])
    return make_model(graph)


def test_an_if_whose_branches_make_float_constants_runs_in_float64():
    """The float64 run widens the If's branches too (their outputs, constants and casts), so
    the step with an If whose branches make float values is compared, not refused by ONNX
    Runtime ('expected tensor(double)')."""
    step = build_training_step(lower(_if_model()), loss="mse")
    rows = numerics.check(step)
    assert [r.param for r in rows] == ["W"] and rows[0].error < 1e-6 and rows[0].scale > 0


def test_a_step_larger_than_the_host_is_one_line_before_any_run(monkeypatch):
    """Before either run allocates, the step's peak (twice, for the float64 run) is held
    against the host's memory: a step past it is one line, not ONNX Runtime's allocator error."""
    from memsched import measure
    from memsched.errors import UserError

    step = build_training_step(lower(_if_model()), loss="mse")
    monkeypatch.setattr(measure, "host_memory_bytes", lambda: 64)
    with pytest.raises(UserError, match="the float64 check of the step needs .* this host has"):
        numerics.check(step)
