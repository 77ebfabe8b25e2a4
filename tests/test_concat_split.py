"""Concat split (passes.rewrites.concat_split): a Conv over a channel Concat becomes one Conv per part.

The hand-made model: x (1, 2, 4, 4) float32 (128 B) feeds two 1x1 Conv + Relu branches, a
(1, 3, 4, 4) = 192 B and b (1, 5, 4, 4) = 320 B, concatenated on the channels into c
(1, 8, 4, 4) = 512 B, read only by the head Conv (W (2, 8, 1, 1), bias 2) whose output
(1, 2, 4, 4) is the logits. Split, the head is Conv(a, W[:, :3]) + Conv(b, W[:, 3:]).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched.runtime import run_plan
from memsched.frontend import lower
from memsched.memory import analyze_plan, validate
from memsched.schedule import Plan
from memsched.passes.training import build_training_step
from memsched.passes.rewrites.batch_split import given_graph
from memsched.passes.rewrites.concat_split import (SPLIT_KEY, VARIANT, reuse_variants, split_concat_convs,
                                                   split_training_step, split_upsamplings, unsplit_graph)
from memsched.passes.pipeline import baseline_of, compile, training_steps
from memsched.passes.reuse import GRAD_ROLES_KEY, layer_groups, reuse_pass


def concat_model(axis: int = 1, second_reader: bool = False, group: int = 1, batch: int = 1):
    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    inits = [init("wa", (3, 2, 1, 1)), init("wb", (5, 2, 1, 1)), init("head.weight", (2, 8 // group, 1, 1)),
             init("head.bias", (2,))]
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["za"], name="conv_a"),
        helper.make_node("Relu", ["za"], ["a"], name="relu_a"),
        helper.make_node("Conv", ["x", "wb"], ["zb"], name="conv_b"),
        helper.make_node("Relu", ["zb"], ["b"], name="relu_b"),
        helper.make_node("Concat", ["a", "b"], ["c"], name="concat", axis=axis),
        helper.make_node("Conv", ["c", "head.weight", "head.bias"], ["logits"], name="head", group=group),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 2, 4, 4])]
    if second_reader:
        nodes.append(helper.make_node("Relu", ["c"], ["c_relu"], name="second"))
        outputs.append(helper.make_tensor_value_info("c_relu", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 4, 4])
    graph = helper.make_graph(nodes, "concat", [x], outputs, inits)
    return lower(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def build(forward):
    return build_training_step(forward, loss="cross_entropy", optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("axis", [1, -3])
def test_the_head_conv_is_split_over_the_concat_parts(axis):
    forward = concat_model(axis=axis)
    split, convs = split_concat_convs(forward)
    assert convs == ["head"]
    assert [op.name for op in split.ops] == ["conv_a", "relu_a", "conv_b", "relu_b", "head/SplitWeight",
                                             "head/part0", "head/part1", "head/Sum1"]
    assert "c" not in split.tensors and "concat" not in split.op_by_name
    sizes = split.op_by_name["head/SplitWeight"]
    assert sizes.inputs[0] == "head.weight" and sizes.attributes == {"axis": 1}
    assert numpy_helper.to_array(split.tensors[sizes.inputs[1]].data).tolist() == [3, 5]
    assert split.tensors["head.weight/part0"].shape == (2, 3, 1, 1)
    assert split.tensors["head.weight/part1"].shape == (2, 5, 1, 1)
    # the bias is added once, by the first part; the Sum writes the Conv's own output
    assert split.op_by_name["head/part0"].inputs == ["a", "head.weight/part0", "head.bias"]
    assert split.op_by_name["head/part1"].inputs == ["b", "head.weight/part1"]
    assert split.op_by_name["head/Sum1"].outputs == ["logits"]


@pytest.mark.parametrize("case", [dict(second_reader=True), dict(group=2)])
def test_no_split_where_the_concat_must_exist_or_the_conv_is_grouped(case):
    forward = concat_model(**case)
    assert split_concat_convs(forward) == (forward, [])
    assert reuse_variants(forward, build(forward), build) == {}


def test_the_split_training_step_gives_back_the_step_as_given():
    forward = concat_model()
    given = build(forward)
    split = split_training_step(forward, given, build)
    assert json.loads(split.metadata[SPLIT_KEY])["convs"] == ["head"]
    # each part's input gradient: a Conv by its weight part transposed (1x1, stride 1)
    dx = split.op_by_name["head/part1/grad/Conv"]
    swap = split.producer[dx.inputs[1]]
    assert "c" not in split.tensors and swap.op_type == "Transpose"
    # the backward reads weight parts split off again, not the forward's (held across the step)
    assert swap.inputs[0] == "head.weight/part1/backward"
    assert split.op_by_name["head/SplitWeight/backward"].phase == "backward"
    # each part is a layer of the weight for the dW/dX rule: its weight gradient dW, its input gradient dX
    roles = json.loads(split.metadata[GRAD_ROLES_KEY])
    assert roles["head/part1/grad/Conv_1"] == {"role": "dW", "layer": "head/part1", "param": "head.weight"}
    assert roles["head/part1/grad/Conv"] == roles[swap.name] == \
        {"role": "dX", "layer": "head/part1", "param": "head.weight"}
    groups = [g for g in layer_groups(split) if g.dx and "head/part" in g.dx[0].name]
    # the weight's group per part, and the bias's with the part that adds it
    assert sorted(g.dx[-1].name for g in groups) == ["head/part0/grad/Conv"] * 2 + ["head/part1/grad/Conv"]
    assert all(g.x_bytes > g.w_bytes for g in groups)      # conv-like: dW first
    back = unsplit_graph(split)
    assert [(op.name, op.op_type, op.inputs, op.outputs, op.attributes, op.phase) for op in back.ops] == \
        [(op.name, op.op_type, op.inputs, op.outputs, op.attributes, op.phase) for op in given.ops]
    assert set(back.tensors) == set(given.tensors)
    assert all((back.tensors[n].shape, back.tensors[n].kind, back.tensors[n].data) ==
               (t.shape, t.kind, t.data) for n, t in given.tensors.items())
    assert back.metadata == given.metadata and json.loads(back.metadata[GRAD_ROLES_KEY])
    assert given_graph(given) is given


def test_reuse_picks_the_split_step_and_the_concat_gradient_never_exists():
    forward = concat_model()
    given, variants = training_steps(forward, loss="cross_entropy", optimizer="sgd", lr=0.1)
    assert list(variants) == [VARIANT]
    base = Plan.initial(given)
    plan = reuse_pass(base, variants=variants)
    notes = plan.notes["reuse"]
    assert notes["variant"] == VARIANT and notes["order"] == "concat-split, updates-in-backward"
    assert notes["candidate_peaks"] == {"given": 2396, "updates-in-backward": 2396, "dw-dx-rule": 2204,
                                        "concat-split, given": 1956, "concat-split, updates-in-backward": 1956,
                                        "concat-split, dw-dx-rule": 1972}
    # on the step as given the peak is where the concat's gradient dc (512 B) stands beside
    # both its slices (192 + 320): 1,024 B of gradients; split, each part's input gradient comes
    # from its own Conv and dc never exists: 248 B less
    alone = reuse_pass(base)
    before, after = analyze_plan(alone), validate(plan)
    assert (before.peak_bytes, after.peak_bytes) == (2204, 1956)
    assert alone.schedule[before.peak_step].target == "concat/grad/Slice_1"
    assert before.kinds_at(before.peak_step)["gradient"] == 512 + 192 + 320
    live = {r.tensor: r.nbytes for r in after.live_at(after.peak_step) if r.kind == "gradient"}
    assert live["head/part0/grad/Conv_output_0"] == 192
    assert live["head/part1/grad/Conv_output_0"] == 320
    assert max(live.values()) == 320
    assert not any(op.op_type == "Concat" and op.phase == "forward" for op in plan.graph.ops)


def test_a_split_plan_runs_like_the_step_as_given():
    forward = concat_model(batch=2)
    result = compile(forward, train=True, lr=0.1, strategies="order,reuse", time_limit=2)
    plan = result.plan
    assert plan.notes["reuse"]["variant"] == VARIANT
    given = build_training_step(forward, loss="cross_entropy", optimizer="sgd", lr=0.1)
    # the baseline and the report are the step as given
    assert [op.name for op in result.baseline.graph.ops] == [op.name for op in given.ops]
    assert [op.name for op in baseline_of(plan).graph.ops] == [op.name for op in given.ops]
    assert result.report["graph"]["ops"] == len(given.ops)
    run = run_plan(plan, steps=2, check=True, given=given_graph(plan.graph))
    assert run.check["passed"] and run.check["bit_identical"]       # against the emitted (split) step
    assert run.check["given"]["passed"] and 0 < run.check["given"]["max_abs_diff"] < 1e-5   # rounding only


def upsampling_model(bias: bool = False, second_reader: bool = False, batch: int = 1):
    """x (batch, 2, 4, 4) -> a 1x1 Conv + Relu skip s (3 channels); a 2x2 MaxPool of s then a
    stride-2 ConvTranspose (W (3, 6, 2, 2)) up to u (6 channels, twice the skip's width);
    Concat(s, u) read only by the head Conv (W (2, 9, 1, 1), bias 2)."""
    rng = np.random.default_rng(1)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    inits = [init("ws", (3, 2, 1, 1)), init("up.weight", (3, 6, 2, 2)), init("head.weight", (2, 9, 1, 1)),
             init("head.bias", (2,))] + ([init("up.bias", (6,))] if bias else [])
    nodes = [
        helper.make_node("Conv", ["x", "ws"], ["zs"], name="conv_s"),
        helper.make_node("Relu", ["zs"], ["s"], name="relu_s"),
        helper.make_node("MaxPool", ["s"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("ConvTranspose", ["p", "up.weight"] + (["up.bias"] if bias else []), ["u"], name="up",
                         kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Concat", ["s", "u"], ["c"], name="concat", axis=1),
        helper.make_node("Conv", ["c", "head.weight", "head.bias"], ["logits"], name="head"),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 2, 4, 4])]
    if second_reader:
        nodes.append(helper.make_node("Relu", ["u"], ["u_relu"], name="second"))
        outputs.append(helper.make_tensor_value_info("u_relu", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "upsampling", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  [batch, 2, 4, 4])], outputs, inits)
    return lower(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def test_an_upsampling_into_the_concat_is_cut_into_pieces_no_wider_than_the_skip():
    forward = upsampling_model()
    pieces, names = split_upsamplings(forward)
    assert names == ["up"] and "u" not in pieces.tensors
    assert [op.op_type for op in pieces.ops if op.name.startswith("up")] == ["Split", "ConvTranspose", "ConvTranspose"]
    assert pieces.tensors["up.weight/part0"].shape == pieces.tensors["up.weight/part1"].shape == (3, 3, 2, 2)
    assert pieces.op_by_name["concat"].inputs == ["s", "u/part0", "u/part1"]
    split, convs = split_concat_convs(forward)
    assert convs == ["up", "head"]
    assert [op.inputs[0] for op in split.ops if op.name.startswith("head/part")] == ["s", "u/part0", "u/part1"]
    assert "c" not in split.tensors and "u" not in split.tensors


@pytest.mark.parametrize("case", [dict(bias=True), dict(second_reader=True)])
def test_no_upsampling_split_with_a_bias_or_a_second_reader(case):
    forward = upsampling_model(**case)
    assert split_upsamplings(forward) == (forward, [])
    assert split_concat_convs(forward)[1] == ["head"]      # the head is still split over s and u


def test_an_upsampling_split_step_gives_back_the_step_as_given_and_runs_like_it():
    forward = upsampling_model(batch=2)
    given = build(forward)
    split = split_training_step(forward, given, build)
    assert json.loads(split.metadata[SPLIT_KEY])["convs"] == ["up", "head"]
    # the backward reads the upsampling's weight pieces split off again, like the head's parts
    assert split.op_by_name["up/SplitWeight/backward"].phase == "backward"
    assert "u" not in split.tensors and "u/part1/grad" not in split.tensors
    back = unsplit_graph(split)
    assert [(op.name, op.inputs, op.outputs) for op in back.ops] == [(op.name, op.inputs, op.outputs)
                                                                     for op in given.ops]
    result = compile(forward, train=True, lr=0.1, strategies="order,reuse", time_limit=2)
    assert result.plan.notes["reuse"]["variant"] == VARIANT
    run = run_plan(result.plan, steps=2, check=True, given=given_graph(result.plan.graph))
    assert run.check["passed"] and run.check["given"]["passed"]
    assert run.check["given"]["max_abs_diff"] < 1e-5
