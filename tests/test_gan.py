"""GAN training (issue 33): the DCGAN iteration as one graph (passes.training.gan), binary
cross-entropy with logits, the ConvTranspose gradient over its geometries, and the iteration
planned by compile and run by the executor.

Small configuration for the fast tests: 16x16 images, nz=8, ngf=ndf=4, batch 4 (gradients)
or 8 (training); DCGAN at 64x64 and batch 64 in the slow ones."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from memsched import models
from memsched.cost import op_cost
from memsched.deadline import unlimited
from memsched.errors import UserError
from memsched.runtime import run_plan
from memsched.frontend import lower
from memsched.onnx_utils import make_model
from memsched.passes.training import TRAINING_KEY
from memsched.passes.training.gan import build_gan_step
from memsched.passes.pipeline import compile as compile_plan
from memsched.cli import main
from tests.conftest import run_cli
from tests.gradcheck import check_gradients, initial_values, one_op_model, session, to_double, with_inputs

SMALL = dict(size=16)
G_SMALL, D_SMALL = dict(nz=8, ngf=4, **SMALL), dict(ndf=4, **SMALL)


def pair(batch: int, double: bool = False, **options):
    """(generator, discriminator) as ONNX models at the small configuration."""
    g = models.build("dcgan-generator", batch=batch, **{**G_SMALL, **options.get("g", {})})
    d = models.build("dcgan-discriminator", batch=batch, **{**D_SMALL, **options.get("d", {})})
    return (to_double(g), to_double(d)) if double else (g, d)


def batch_feeds(step, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """z ~ N(0, 1), real images in [-1, 1] (a generator's Tanh range)."""
    rng = np.random.default_rng(seed)
    z, real = (step.tensors[name].shape for name in ("z", "real"))
    return {"z": rng.standard_normal(z).astype(dtype), "real": rng.uniform(-1, 1, real).astype(dtype)}


# ---- the loss ---------------------------------------------------------------------------------
def _logit_model(values: np.ndarray) -> onnx.ModelProto:
    """logits = a * b, both trainable float64 [5, 3]."""
    inits = [numpy_helper.from_array(values, "a"), numpy_helper.from_array(np.full_like(values, 1.5), "b")]
    graph = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["logits"], name="mul")], "logits", [],
                              [helper.make_tensor_value_info("logits", TensorProto.DOUBLE, list(values.shape))], inits)
    return make_model(graph, opset=17)


def test_bce_with_logits_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    feeds = {"targets": rng.random((5, 3))}     # soft labels: every y in [0, 1], not only 0 and 1
    check_gradients(_logit_model(rng.standard_normal((5, 3)) * 3), feeds, loss="bce_with_logits")


def test_bce_with_logits_is_stable_at_large_logits():
    """|x| = 400: exp(x) overflows float64, the stable form does not; the loss is the exact
    softplus(x) - x * y, the gradient sigmoid(x) - y over the count."""
    x = np.array([[-400.0, -30.0, 0.0], [1e-3, 30.0, 400.0]])
    y = np.array([[0.0, 1.0, 0.5], [1.0, 0.0, 1.0]])
    model = _logit_model(x / 1.5)
    from memsched.passes.training import build_training_step
    step = build_training_step(lower(model), loss="bce_with_logits", optimizer="none")
    loss, grad = session(step.to_onnx()).run(["loss", "a.grad"], {"targets": y})
    expected = np.mean(np.logaddexp(0, x) - x * y)
    assert np.isfinite(loss) and loss == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(grad, 1.5 * (1 / (1 + np.exp(-x)) - y) / x.size, rtol=1e-12, atol=1e-15)


# ---- ConvTranspose --------------------------------------------------------------------------
def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


_rng = np.random.default_rng(5)
CONV_TRANSPOSE = {    # beyond tests/test_autodiff_rules.py's cases: each geometry the rule claims
    "dcgan-first": ([f32(_rng, 3, 5, 1, 1), f32(_rng, 5, 4, 4, 4)], {}),
    "dcgan-up": ([f32(_rng, 3, 4, 3, 3), f32(_rng, 4, 2, 4, 4)], {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "auto-pad-valid": ([f32(_rng, 2, 3, 3, 3), f32(_rng, 3, 2, 3, 3)], {"auto_pad": "VALID", "strides": [2, 2]}),
    "group-output-padding": ([f32(_rng, 2, 4, 3, 3), f32(_rng, 4, 3, 3, 3), f32(_rng, 6)],
                             {"group": 2, "strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 2]}),
    "depthwise-dilation-output-padding": ([f32(_rng, 2, 4, 3, 3), f32(_rng, 4, 1, 2, 2)],
                                          {"group": 4, "strides": [2, 2], "dilations": [2, 1],
                                           "output_padding": [1, 1]}),
    "1d-output-padding": ([f32(_rng, 2, 3, 5), f32(_rng, 3, 2, 3), f32(_rng, 2)],
                          {"strides": [3], "pads": [1, 2], "output_padding": [2]}),
    "weight-grad-by-sample": ([f32(_rng, 16, 2, 3, 3), f32(_rng, 2, 3, 2, 2)], {"strides": [2, 2]}),
    "3d-output-padding": ([f32(_rng, 1, 2, 2, 3, 2), f32(_rng, 2, 2, 3, 2, 2)],
                          {"strides": [2, 2, 1], "pads": [1, 0, 0, 0, 1, 0], "output_padding": [1, 1, 0]}),
}


@pytest.mark.parametrize("case", sorted(CONV_TRANSPOSE))
def test_conv_transpose_gradients_match_finite_differences(case):
    inputs, attrs = CONV_TRANSPOSE[case]
    check_gradients(one_op_model("ConvTranspose", inputs, attrs), rtol=2e-3, atol=2e-3, eps=1e-2)


def test_conv_transpose_costs_the_convolution_over_its_input():
    """A strided ConvTranspose does the multiply-adds of its adjoint Conv (its dX in the
    backward, over the output, same weight), not those of a conv over the zero-stuffed grid,
    which would count every output pixel against C_in / group * prod(kernel) weights."""
    g, d = pair(4)
    step = build_gan_step(lower(g), lower(d))
    ups = [op for op in step.ops if op.op_type == "ConvTranspose" and op.phase == "forward"]
    adjoints = {op.inputs[1]: op for op in step.ops if op.op_type == "Conv" and op.phase == "backward"}
    assert len(ups) == 3 and sum(up.inputs[1] in adjoints for up in ups) == 2    # z needs no gradient
    for up in ups[1:]:
        adjoint = adjoints[up.inputs[1]]
        x, w, y = (step.tensors[t] for t in (up.inputs[0], up.inputs[1], up.outputs[0]))
        assert op_cost(up, step).flops == op_cost(adjoint, step).flops == 2 * x.numel * w.numel // w.shape[0]
        assert up.attributes["strides"] == [2, 2]
        assert 4 * op_cost(up, step).flops == 2 * y.numel * w.shape[0] * int(np.prod(w.shape[2:]))   # zero-stuffed


# ---- the iteration's structure ---------------------------------------------------------------
def test_gan_step_is_one_graph_of_standard_ops():
    g, d = pair(4)
    step = build_gan_step(lower(g), lower(d), optimizer="momentum", lr=0.05)
    proto = step.to_onnx()
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version <= 21 and proto.ir_version <= 10
    assert {op.domain for op in step.ops} == {""}
    info = json.loads(step.metadata[TRAINING_KEY])
    d_params, g_params = info["gan"]["discriminator"], info["gan"]["generator"]
    assert info["parameters"] == d_params + g_params and info["optimizer"] == "momentum"
    assert sum(step.tensors[p].numel for p in d_params) == models.count_parameters(d)
    assert sum(step.tensors[p].numel for p in g_params) == models.count_parameters(g)
    assert step.inputs == ["z", "real"]
    assert step.outputs == ["loss_D", "loss_G"] + [f"{p}{s}.updated" for p in d_params + g_params
                                                   for s in ("", ".momentum_buffer")]
    # G's forward runs once; D runs three times, the third on D's updated weights
    forward = [op for op in step.ops if op.phase == "forward"]
    assert sum(op.op_type == "ConvTranspose" for op in forward) == 3
    convs = [op for op in forward if op.op_type == "Conv"]
    kernels = [p for p in d_params if len(step.tensors[p].shape) == 4]
    assert [op.inputs[1] for op in convs] == kernels * 2 + [f"{p}.updated" for p in kernels]
    # D's step: no gradient reaches G (fake is a constant); G's: none for D' (only through it)
    names = [op.name for op in step.ops]
    last_d_update = max(i for i, op in enumerate(step.ops) if op.phase == "update" and op.name.startswith("D/"))
    first_g_grad = min(i for i, op in enumerate(step.ops) if op.phase == "backward" and op.name.startswith("G/"))
    assert last_d_update < first_g_grad
    assert not any(t.endswith(".updated.grad") for t in step.tensors)
    grads = [t for t in step.tensors if t.endswith(".grad")]
    assert sorted(grads) == sorted(f"{p}.grad" for p in d_params + g_params)
    phases = [step.ops[0].phase]
    for op in step.ops[1:]:
        if op.phase != phases[-1]:
            phases.append(op.phase)
    assert phases == ["forward", "loss", "backward", "update"] * 2, names[:3]


@pytest.mark.parametrize("options, message", [
    (dict(d=dict(size=32)), "is not what the discriminator takes"),
    (dict(g=dict(nc=1)), "is not what the discriminator takes"),
])
def test_a_pair_that_does_not_fit_is_refused_in_one_line(options, message):
    g, d = pair(4, **options)
    with pytest.raises(UserError, match=message) as error:
        build_gan_step(lower(g), lower(d))
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="choose --optimizer"):
        build_gan_step(*(lower(m) for m in pair(4)), optimizer="none")


# ---- the iteration's numbers -----------------------------------------------------------------
def _cut_updated(proto: onnx.ModelProto, d_params: list[str]) -> tuple[onnx.ModelProto, list[str]]:
    """The step with D's updated weights, as G's phase reads them, made inputs `<p>.frozen`:
    then loss_G is a function of G's parameters alone, as the alternating scheme treats it."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    frozen = {f"{p}.updated": f"{p}.frozen" for p in d_params}
    for node in copy.graph.node:
        node.input[:] = [frozen.get(t, t) for t in node.input]
    shapes = {t.name: list(t.dims) for t in copy.graph.initializer}
    for p in d_params:
        copy.graph.input.append(helper.make_tensor_value_info(f"{p}.frozen", TensorProto.DOUBLE, shapes[p]))
    return copy, list(frozen.values())


def _directional_check(probe, feeds, values, grads, rng, eps=1e-6):
    """d loss along one direction (half the gradient, half random) = <gradient, direction>."""
    def unit(vectors):
        norm = np.sqrt(sum((v * v).sum() for v in vectors.values()))
        return {p: v / norm for p, v in vectors.items()}

    along, noise = unit(grads), unit({p: rng.standard_normal(v.shape) for p, v in values.items()})
    direction = unit({p: along[p] + noise[p] for p in values})

    def loss_at(scale):
        return float(probe.run(None, {**feeds, **{p: values[p] + scale * direction[p] for p in values}})[0])

    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = sum(float((grads[p] * direction[p]).sum()) for p in values)
    assert analytic == pytest.approx(numeric, rel=1e-6)
    return analytic


def test_gan_iteration_gradients_match_finite_differences():
    """In float64 (ONNX's reference evaluator): D's update is -lr times the gradient of loss_D
    (real and fake) in D's weights, G's update -lr times the gradient of loss_G in G's weights
    through D's updated weights, each against central differences of the step's own loss."""
    lr = 0.5
    g, d = pair(4, double=True)
    step = build_gan_step(lower(g), lower(d), optimizer="sgd", lr=lr)
    proto = step.to_onnx()
    info = json.loads(step.metadata[TRAINING_KEY])
    d_params, g_params = info["gan"]["discriminator"], info["gan"]["generator"]
    feeds = batch_feeds(step, dtype=np.float64)
    results = dict(zip(step.outputs, ReferenceEvaluator(proto).run(step.outputs, feeds)))
    values = initial_values(proto, d_params + g_params)
    grads = {p: (values[p] - results[f"{p}.updated"]) / lr for p in d_params + g_params}
    assert all(np.abs(grads[p]).max() > 0 for p in grads)
    rng = np.random.default_rng(0)
    probe_d = ReferenceEvaluator(with_inputs(proto, d_params, outputs=["loss_D"]))
    _directional_check(probe_d, feeds, {p: values[p] for p in d_params}, {p: grads[p] for p in d_params}, rng)
    cut, frozen = _cut_updated(proto, d_params)
    probe_g = ReferenceEvaluator(with_inputs(cut, g_params, outputs=["loss_G"]))
    held = {f: results[f"{p}.updated"] for p, f in zip(d_params, frozen)}
    assert float(probe_g.run(None, {**feeds, **held, **{p: values[p] for p in g_params}})[0]) == results["loss_G"]
    _directional_check(probe_g, {**feeds, **held}, {p: values[p] for p in g_params},
                       {p: grads[p] for p in g_params}, rng)
    # float32 in ONNX Runtime computes the same iteration
    g32, d32 = pair(4)
    step32 = build_gan_step(lower(g32), lower(d32), optimizer="sgd", lr=lr)
    losses = session(step32.to_onnx()).run(["loss_D", "loss_G"], batch_feeds(step32))
    np.testing.assert_allclose(losses, [results["loss_D"], results["loss_G"]], rtol=1e-5)


def _iterate(step, feeds, carried: list[str], steps: int) -> list[tuple[float, float]]:
    """Run `steps` iterations on one batch, feeding back only the `carried` parameters'
    updates (the others stay as they are); (loss_D, loss_G) of each."""
    proto = step.to_onnx()
    values = initial_values(proto, carried)
    run = session(with_inputs(proto, carried))
    names = ["loss_D", "loss_G"] + [f"{p}.updated" for p in carried]
    losses = []
    for _ in range(steps):
        out = dict(zip(names, run.run(names, {**feeds, **values})))
        losses.append((float(out["loss_D"]), float(out["loss_G"])))
        values = {p: out[f"{p}.updated"] for p in carried}
    return losses


def test_each_network_learns_against_the_other_held_fixed():
    """On one batch: with G held, D's loss falls step by step; with D held, G's loss falls."""
    g, d = pair(8)
    step = build_gan_step(lower(g), lower(d), optimizer="sgd", lr=0.05)
    info = json.loads(step.metadata[TRAINING_KEY])
    feeds = batch_feeds(step)
    d_losses = [loss_d for loss_d, _ in _iterate(step, feeds, info["gan"]["discriminator"], 6)]
    assert all(b < a for a, b in zip(d_losses, d_losses[1:])) and d_losses[-1] < 0.7 * d_losses[0], d_losses
    g_losses = [loss_g for _, loss_g in _iterate(step, feeds, info["gan"]["generator"], 6)]
    assert all(b < a for a, b in zip(g_losses, g_losses[1:])) and g_losses[-1] < 0.95 * g_losses[0], g_losses


# ---- planned and run -------------------------------------------------------------------------
def _plan_and_run(step, time_limit: float):
    """Plan under deterministic limits alone (no wall-clock deadline: a loaded machine cuts
    nothing short), then run and check."""
    result = compile_plan(step, budget="50%", time_limit=time_limit, deadline=unlimited())
    assert result.profile.peak_bytes <= result.report["budget_bytes"] < result.baseline_profile.peak_bytes
    run = run_plan(result.plan, steps=2, check=True, threads=1)
    assert run.check["passed"] and run.check["bit_identical"]
    return result


def test_compile_fits_the_small_gan_step_in_half_and_it_runs_bit_identical():
    g, d = pair(8)
    _plan_and_run(build_gan_step(lower(g), lower(d)), time_limit=2)


def test_cli_train_graph_gan(tmp_path):
    g, d = pair(4)
    paths = [tmp_path / "g.onnx", tmp_path / "d.onnx"]
    for model, path in zip((g, d), paths):
        onnx.save(model, path)
    out = tmp_path / "gan.onnx"
    result = run_cli("train-graph", "--gan", *paths, "-o", out, "--optimizer", "adam", "--lr", "2e-4", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["loss"], summary["optimizer"], summary["lr"]) == ("bce_with_logits", "adam", 2e-4)
    assert summary["inputs"] == {"z": [4, 8, 1, 1], "real": [4, 3, 16, 16]}
    assert summary["parameters"] == models.count_parameters(g) + models.count_parameters(d)
    onnx.checker.check_model(onnx.load(out))
    result = run_cli("train-graph", paths[0], "--gan", *paths, "-o", tmp_path / "x.onnx")
    assert result.returncode == 1 and "takes no MODEL" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--gan", "g.onnx", "d.onnx", "--loss", "mse"], "takes no MODEL, --freeze or --loss"),
    (["--gan", "g.onnx", "d.onnx", "--freeze", "main.*"], "takes no MODEL, --freeze or --loss"),
    ([], "give a MODEL.onnx, or --gan G.onnx D.onnx"),
])
def test_cli_train_graph_refuses_mixed_requests(argv, message, capsys):
    assert main(["train-graph", *argv, "-o", "out.onnx"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memsched: error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_dcgan_at_64_pixels_batch_64_fits_half_and_runs_bit_identical():
    """The paper's DCGAN: the iteration at batch 64 planned into half its baseline peak."""
    g, d = (lower(models.build(name, batch=64)) for name in ("dcgan-generator", "dcgan-discriminator"))
    step = build_gan_step(g, d)
    assert len(step.inputs) == 2 and step.tensors["real"].shape == (64, 3, 64, 64)
    _plan_and_run(step, time_limit=60)


def test_the_cli_offers_every_loss_the_builder_has():
    from memsched.cli import options
    from memsched.passes.training.loss import LOSSES

    assert sorted(options.LOSSES) == sorted(LOSSES)
