"""GELU, LayerNorm and softmax written out in primitive ops are fused before the training
step is built (passes.training.fuse): the step keeps fewer bytes for its backward pass and its
gradients are those of the step built op by op, to float32 rounding."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import models
from memsched import numerics
from memsched.frontend import lower
from memsched.memory import validate
from memsched.onnx_utils import make_model
from memsched.schedule import Plan
from memsched.passes.training import build_training_step, builder
from memsched.passes.training.fuse import fuse_patterns
from tests.gradcheck import check_against_float64, session, training_info

TINY = dict(batch=2, seq=8, layers=1, hidden=32, heads=2, vocab=50, max_positions=16)
ROWS, WIDTH = 6, 16
AGREE = 1e-5   # relative: max |fused - unfused| / max |unfused|


def _peak(step) -> int:
    return validate(Plan.initial(step)).peak_bytes


def _grads(step, feeds) -> dict[str, np.ndarray]:
    names = [f"{p}.grad" for p in training_info(step)["parameters"]]
    return dict(zip(names, session(step.to_onnx()).run(names, feeds)))


def _assert_same_gradients(graph, feeds, loss, fused=None):
    """The fused step's (built from `graph` unless given) and the unfused step's gradients
    agree to AGREE; returns both steps."""
    fused = fused or build_training_step(graph, loss=loss, optimizer="none")
    plain = build_training_step(graph, loss=loss, optimizer="none", fuse=False)
    got, want = _grads(fused, feeds), _grads(plain, feeds)
    assert got.keys() == want.keys()
    for name in want:
        scale = float(np.abs(want[name]).max())
        assert scale > 0, name
        error = float(np.abs(got[name] - want[name]).max()) / scale
        assert error < AGREE, (name, error)
    return fused, plain


def _backward_reads(step) -> set[str]:
    """The forward tensors the backward ops read."""
    forward = {t for op in step.ops if op.phase == "forward" for t in op.present_outputs}
    return {t for op in step.ops if op.phase == "backward" for t in op.present_inputs if t in forward}


# ---- the bundled transformers ---------------------------------------------------------------
@pytest.mark.parametrize("name, anchor", [("bert-base", "Erf"), ("gpt2", "Tanh")])
def test_transformer_gelu_is_fused_and_keeps_only_its_input(name, anchor, monkeypatch):
    """BERT's exact GELU and GPT-2's gelu_new become one Gelu each: the backward reads the
    GELU's input, not x / sqrt2, erf + 1 (or the tanh form's intermediates), the peak falls
    and the gradients are unchanged."""
    model = models.build(name, **TINY)
    graph = lower(model)
    fused_graph, fusions = fuse_patterns(graph)
    gelus = [f for f in fusions.values() if f.op.op_type == "Gelu"]
    assert len(gelus) == TINY["layers"]
    assert gelus[0].op.attributes["approximate"] == ("none" if anchor == "Erf" else "tanh")
    assert len(fused_graph.ops) < len(graph.ops)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, TINY["vocab"], (TINY["batch"], TINY["seq"])),
             "labels": rng.integers(0, 2 if name == "bert-base" else TINY["vocab"],
                                    (TINY["batch"],) if name == "bert-base" else (TINY["batch"], TINY["seq"]))}
    fused, plain = _assert_same_gradients(graph, feeds, "cross_entropy")
    gelu = gelus[0]
    intermediates = {t for op in gelu.ops for t in op.outputs} - set(gelu.op.outputs)
    assert _backward_reads(plain) & intermediates
    assert not _backward_reads(fused) & intermediates
    assert gelu.op.inputs[0] in _backward_reads(fused)
    with monkeypatch.context() as m:     # the fusion alone: no layer input derived again
        m.setattr(builder, "rederive_in_backward", lambda step: step)
        assert _peak(build_training_step(graph, optimizer="sgd")) < _peak(
            build_training_step(graph, optimizer="sgd", fuse=False))
    assert max(row.error for row in numerics.check(fused)) < 1e-4


# ---- small models of each pattern -----------------------------------------------------------
def _const(nodes, name, value):
    nodes.append(helper.make_node("Constant", [], [name], name=f"const_{name}",
                                  value=numpy_helper.from_array(np.asarray(value, np.float32), name)))
    return name


def _model(body, opset: int = 17, width: int = WIDTH) -> onnx.ModelProto:
    """x [ROWS, WIDTH] @ w1 -> h; body(nodes, h) -> z [ROWS, width]; loss sum(z * r) with a fixed
    random r. `body` appends its nodes and returns z's name."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((ROWS, width)).astype(np.float32), "r")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1")]
    z = body(nodes, inits, "h")
    nodes += [helper.make_node("Mul", [z, "r"], ["weighted"], name="weigh"),
              helper.make_node("ReduceSum", ["weighted"], ["total"], name="total", keepdims=0)]
    graph = helper.make_graph(nodes, "pattern", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])], inits)
    return make_model(graph, opset=opset)


def _feeds():
    return {"x": np.random.default_rng(2).standard_normal((ROWS, WIDTH)).astype(np.float32) * 0.5}


def _gelu_torch(nodes, inits, h, divisor: float = math.sqrt(2)):
    """torch.onnx's gelu: h * (erf(h / sqrt2) + 1) * 0.5 (with another `divisor`, not a GELU)."""
    nodes += [helper.make_node("Div", [h, _const(nodes, "divisor", divisor)], ["g_div"], name="g_div"),
              helper.make_node("Erf", ["g_div"], ["g_erf"], name="g_erf"),
              helper.make_node("Add", ["g_erf", _const(nodes, "one", 1.0)], ["g_add"], name="g_add"),
              helper.make_node("Mul", [h, "g_add"], ["g_mul"], name="g_mul"),
              helper.make_node("Mul", ["g_mul", _const(nodes, "half", 0.5)], ["g"], name="g_half")]
    return "g"


def _gelu_halved_first(nodes, inits, h):
    """0.5 * h * (1 + erf(h * 0.70710678)): the products and the sum the other way round."""
    nodes += [helper.make_node("Mul", [_const(nodes, "half", 0.5), h], ["g_half"], name="g_half"),
              helper.make_node("Mul", [h, _const(nodes, "rsqrt2", 1 / math.sqrt(2))], ["g_arg"], name="g_arg"),
              helper.make_node("Erf", ["g_arg"], ["g_erf"], name="g_erf"),
              helper.make_node("Add", [_const(nodes, "one", 1.0), "g_erf"], ["g_add"], name="g_add"),
              helper.make_node("Mul", ["g_half", "g_add"], ["g"], name="g_mul")]
    return "g"


def _gelu_tanh_torch(nodes, inits, h):
    """torch.onnx's gelu(approximate='tanh'): 0.5 * (h * (1 + tanh(c * (h + k * h * (h * h)))))."""
    nodes += [helper.make_node("Mul", [h, h], ["g_sq"], name="g_sq"),
              helper.make_node("Mul", [h, "g_sq"], ["g_cube"], name="g_cube"),
              helper.make_node("Mul", [_const(nodes, "kappa", 0.044715), "g_cube"], ["g_k"], name="g_k"),
              helper.make_node("Add", [h, "g_k"], ["g_in"], name="g_in"),
              helper.make_node("Mul", [_const(nodes, "beta", math.sqrt(2 / math.pi)), "g_in"], ["g_u"], name="g_u"),
              helper.make_node("Tanh", ["g_u"], ["g_t"], name="g_t"),
              helper.make_node("Add", [_const(nodes, "one", 1.0), "g_t"], ["g_add"], name="g_add"),
              helper.make_node("Mul", [h, "g_add"], ["g_mul"], name="g_mul"),
              helper.make_node("Mul", [_const(nodes, "half", 0.5), "g_mul"], ["g"], name="g_half")]
    return "g"


def _not_gelu(nodes, inits, h):
    """h * (erf(h / 2) + 1) * 0.5: the erf's scale is not 1 / sqrt2."""
    return _gelu_torch(nodes, inits, h, divisor=2.0)


def _gelu_erf_read_twice(nodes, inits, h):
    """torch's gelu, plus its erf added to the result: the erf is no intermediate."""
    _gelu_torch(nodes, inits, h)
    nodes.append(helper.make_node("Add", ["g", "g_erf"], ["g_plus"], name="g_plus"))
    return "g_plus"


def _layer_norm_decomposed(nodes, inits, h, bias: bool = True):
    """torch.onnx's layer_norm below opset 17, with the opset's ReduceMean axes."""
    inits += [numpy_helper.from_array(np.linspace(0.5, 1.5, WIDTH).astype(np.float32), "ln.weight"),
              numpy_helper.from_array(np.linspace(-0.2, 0.3, WIDTH).astype(np.float32), "ln.bias")]
    nodes += [helper.make_node("ReduceMean", [h], ["ln_mean"], name="ln_mean", axes=[-1]),
              helper.make_node("Sub", [h, "ln_mean"], ["ln_d"], name="ln_d"),
              helper.make_node("Pow", ["ln_d", _const(nodes, "two", 2.0)], ["ln_sq"], name="ln_sq"),
              helper.make_node("ReduceMean", ["ln_sq"], ["ln_var"], name="ln_var", axes=[-1]),
              helper.make_node("Add", ["ln_var", _const(nodes, "eps", 1e-5)], ["ln_ve"], name="ln_ve"),
              helper.make_node("Sqrt", ["ln_ve"], ["ln_std"], name="ln_std"),
              helper.make_node("Div", ["ln_d", "ln_std"], ["ln_xhat"], name="ln_xhat"),
              helper.make_node("Mul", ["ln_xhat", "ln.weight"], ["ln_scaled"], name="ln_scale")]
    if not bias:
        return "ln_scaled"
    nodes.append(helper.make_node("Add", ["ln_scaled", "ln.bias"], ["ln_out"], name="ln_bias"))
    return "ln_out"


def _softmax_decomposed(nodes, inits, h, peak: bool = True):
    """exp(h - max(h)) / sum(exp(h - max(h))) over the last axis (opset 13's ReduceSum axes input)."""
    axes = "axes"
    inits.append(numpy_helper.from_array(np.asarray([1], np.int64), axes))
    x = h
    if peak:
        nodes += [helper.make_node("ReduceMax", [h], ["sm_max"], name="sm_max", axes=[1]),
                  helper.make_node("Sub", [h, "sm_max"], ["sm_shift"], name="sm_shift")]
        x = "sm_shift"
    nodes += [helper.make_node("Exp", [x], ["sm_exp"], name="sm_exp"),
              helper.make_node("ReduceSum", ["sm_exp", axes], ["sm_sum"], name="sm_sum"),
              helper.make_node("Div", ["sm_exp", "sm_sum"], ["sm"], name="sm_div")]
    return "sm"


def _softmax_no_max(nodes, inits, h):
    return _softmax_decomposed(nodes, inits, h, peak=False)


# case -> (pattern, the op it becomes, attributes of that op, a pattern of the same function the
# step can be built from op by op (None: the pattern itself), central differences in float64)
CASES = {
    "gelu-torch": (_gelu_torch, "Gelu", dict(approximate="none"), None, False),
    "gelu-halved-first": (_gelu_halved_first, "Gelu", dict(approximate="none"), None, False),
    "gelu-tanh-torch": (_gelu_tanh_torch, "Gelu", dict(approximate="tanh"), None, True),
    "layer-norm": (_layer_norm_decomposed, "LayerNormalization", dict(axis=1), None, True),
    "layer-norm-no-bias": (lambda n, i, h: _layer_norm_decomposed(n, i, h, bias=False), "LayerNormalization",
                           dict(axis=1), None, True),
    "softmax": (_softmax_decomposed, "Softmax", dict(axis=1), _softmax_no_max, True),   # no ReduceMax rule
    "softmax-no-max": (_softmax_no_max, "Softmax", dict(axis=1), None, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pattern_is_fused_and_its_gradients_agree(case):
    """Each pattern becomes its one op; the step has fewer ops and keeps fewer bytes for the
    backward pass; its gradients agree with the op-by-op step's and (where ONNX's reference
    evaluator computes the float64 twin in float64: not Erf) its float64 twin's with central
    differences of the float64 loss."""
    body, op_type, attributes, reference, differences = CASES[case]
    model = _model(body)
    graph = lower(model)
    fused_graph, fusions = fuse_patterns(graph)
    assert [f.op.op_type for f in fusions.values()] == [op_type]
    fusion = next(iter(fusions.values()))
    assert {k: fusion.op.attributes[k] for k in attributes} == attributes
    assert len(fused_graph.ops) == len(graph.ops) - len(fusion.ops) + 1
    fused = build_training_step(graph, loss="output", optimizer="none")
    _, plain = _assert_same_gradients(lower(_model(reference)) if reference else graph, _feeds(), "output",
                                      fused=fused)
    kept = sum(fused.tensors[t].nbytes for t in _backward_reads(fused))
    assert kept < sum(plain.tensors[t].nbytes for t in _backward_reads(plain))
    if op_type != "Gelu":
        assert sum(op.op_type == op_type for op in fused.ops if op.phase == "forward") == 1
        assert len(fused.ops) < len(plain.ops)
    if differences:
        check_against_float64(model, _feeds(), loss="output", agree=1e-5)


def test_erf_gelu_gradient_matches_central_differences():
    """The fused torch-form GELU's weight gradient against float64 central differences of the
    same loss computed in numpy (math.erf in double precision)."""
    model = _model(_gelu_torch)
    step = build_training_step(lower(model), loss="output", optimizer="none")
    got = _grads(step, _feeds())["w1.grad"].astype(np.float64)
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    x = _feeds()["x"].astype(np.float64)
    erf = np.vectorize(math.erf)

    def loss(w1):
        h = x @ w1
        return float((h * (erf(h / math.sqrt(2)) + 1) * 0.5 * inits["r"]).sum())

    eps = 1e-6
    numeric = np.zeros_like(got)
    for index in np.ndindex(*got.shape):
        step_ = np.zeros_like(got)
        step_[index] = eps
        numeric[index] = (loss(inits["w1"] + step_) - loss(inits["w1"] - step_)) / (2 * eps)
    np.testing.assert_allclose(got, numeric, rtol=1e-4, atol=1e-5 * np.abs(numeric).max())


def test_layer_norm_of_an_older_opset_becomes_the_op():
    """A model of opset 13 (ReduceMean axes as an attribute, ReduceSum's as an input): the
    step, of opset 17, computes the decomposed LayerNorm with LayerNormalization."""
    graph = lower(_model(_layer_norm_decomposed, opset=13))
    fused, _ = _assert_same_gradients(graph, _feeds(), "output")
    assert fused.opset_imports[""] == 17
    assert [op.phase for op in fused.ops if op.op_type == "LayerNormalization"] in (
        ["forward"], ["forward", "backward"])     # the backward may derive its output again


def test_gelu_is_one_op_where_the_opset_has_it():
    """At opset 20 the fused GELU runs as ONNX's Gelu op; a Gelu node of the model keeps its
    backward from x alone, checked against central differences of its float64 twin."""
    graph = lower(_model(_gelu_torch, opset=20))
    fused, plain = _assert_same_gradients(graph, _feeds(), "output")
    assert [op.op_type for op in fused.ops if op.phase == "forward"].count("Gelu") == 1
    assert "Erf" not in [op.op_type for op in fused.ops if op.phase == "forward"]

    def native(nodes, inits, h):
        nodes.append(helper.make_node("Gelu", [h], ["g"], name="gelu", approximate="tanh"))
        return "g"

    check_against_float64(_model(native, opset=20), _feeds(), loss="output", agree=1e-5)


@pytest.mark.parametrize("body", [_not_gelu, _gelu_erf_read_twice])
def test_near_misses_are_not_fused(body):
    """A wrong constant, or an intermediate read outside the pattern, leaves the ops as they are."""
    graph = lower(_model(body))
    fused_graph, fusions = fuse_patterns(graph)
    assert fusions == {} and fused_graph is graph
