"""Cheap layer inputs derived again in the backward pass (passes.training.rederive): the
transformers' GELU and LayerNorm outputs are not kept for their weight gradients, the
gradients are bitwise those of the step that keeps them, and the baseline peak falls."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memsched import models
from memsched.frontend import lower
from memsched.memory import validate
from memsched.schedule import Plan
from memsched.passes.reuse import baseline_aliases
from memsched.passes.training import build_training_step, builder
from tests.gradcheck import session, training_info

# activations outweigh the parameters, as in training at scale (the pass rewrites only where the peak falls)
TINY = dict(batch=8, seq=32, layers=2, hidden=32, heads=2, vocab=50, max_positions=32)


def _baseline_peak(step) -> int:
    return validate(dataclasses.replace(Plan.initial(step), aliases=baseline_aliases(step))).peak_bytes


def _kept_step(graph, monkeypatch, **options):
    """The step built with every layer input kept (the pass turned off)."""
    with monkeypatch.context() as m:
        m.setattr(builder, "rederive_in_backward", lambda step: step)
        return build_training_step(graph, **options)


def _backward_reads(step) -> set[str]:
    return {t for op in step.ops if op.phase == "backward" for t in op.present_inputs}


@pytest.mark.parametrize("name", ["bert-base", "gpt2"])
def test_gelu_and_layernorm_outputs_are_derived_again_with_the_same_gradients(name, monkeypatch):
    graph = lower(models.build(name, **TINY))
    derived = build_training_step(graph, optimizer="none")
    kept = _kept_step(graph, monkeypatch, optimizer="none")
    clones = [op for op in derived.ops if op.name.endswith("/rederived")]
    by_type = {op.op_type for op in clones}
    assert "LayerNormalization" in by_type and ({"Erf"} if name == "bert-base" else {"Tanh"}) <= by_type
    assert all(op.phase == "backward" for op in clones)
    # the originals the clones stand in for are no longer read by the backward pass
    originals = {op.name.removesuffix("/rederived") for op in clones}
    replaced = {t for op in kept.ops if op.name in originals for t in op.outputs[:1]}
    assert replaced & _backward_reads(kept) and not replaced & _backward_reads(derived)
    # bitwise the same gradients: the clones are the same ops on the same tensors
    rng = np.random.default_rng(0)
    labels = (TINY["batch"],) if name == "bert-base" else (TINY["batch"], TINY["seq"])
    feeds = {"input_ids": rng.integers(0, TINY["vocab"], (TINY["batch"], TINY["seq"])),
             "labels": rng.integers(0, 2 if name == "bert-base" else TINY["vocab"], labels)}
    names = [f"{p}.grad" for p in training_info(derived)["parameters"]]
    got = session(derived.to_onnx()).run(names, feeds)
    want = session(kept.to_onnx()).run(names, feeds)
    for n, a, b in zip(names, got, want):
        assert np.array_equal(a, b), n
    assert _baseline_peak(build_training_step(graph, optimizer="sgd")) < _baseline_peak(
        _kept_step(graph, monkeypatch, optimizer="sgd"))


def test_bert_base_keeps_three_layer_inputs_fewer_per_layer(monkeypatch):
    """BERT-base at 8 x 128, sizes only: the GELU output (8 x 128 x 3072 floats) and the two
    LayerNorm outputs (8 x 128 x 768 each) of every layer are not kept."""
    graph = lower(models.build("bert-base", weights=False, batch=8, seq=128))
    derived = _baseline_peak(build_training_step(graph, optimizer="sgd"))
    kept = _baseline_peak(_kept_step(graph, monkeypatch, optimizer="sgd"))
    assert (kept, derived) == (1_157_745_960, 972_788_008)


def test_a_step_whose_peak_would_not_fall_is_left_as_it_is(monkeypatch):
    """At one sequence of 4 tokens BERT's peak is its parameters and gradients: copies would only add work."""
    graph = lower(models.build("bert-base", **dict(TINY, batch=1, seq=4)))
    step = build_training_step(graph, optimizer="sgd")
    assert not [op for op in step.ops if op.name.endswith("/rederived")]
    assert [op.name for op in step.ops] == [op.name for op in _kept_step(graph, monkeypatch, optimizer="sgd").ops]


def test_a_relu_over_a_gemm_is_kept():
    """An MLP's ReLU output could only be derived from the Gemm output before it, which the
    backward pass does not keep: the step keeps the ReLU output as it is."""
    step = build_training_step(lower(models.build("mlp", batch=4)), optimizer="sgd")
    assert not [op for op in step.ops if op.name.endswith("/rederived")]


def test_a_deep_chain_of_cheap_ops_builds_without_recursing_past_the_limit():
    """1,200 Relu/Tanh ops in a row: the derivation looks back at most MAX_DEPTH ops instead of
    recursing through the whole chain (a RecursionError before)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from memsched.frontend import lower
    from memsched.passes.training import build_training_step

    nodes = [helper.make_node("MatMul", ["x", "w"], ["h0"])]
    nodes += [helper.make_node("Tanh" if i % 2 else "Relu", [f"h{i}"], [f"h{i + 1}"]) for i in range(1200)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("h1200", TensorProto.FLOAT, [4, 8])],
                              [numpy_helper.from_array(np.ones((8, 8), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    step = build_training_step(lower(model), loss="mse", optimizer="sgd")
    assert step.outputs == ["loss", "w.updated"]
