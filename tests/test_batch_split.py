"""Batch split (passes.rewrites.batch_split): the per-sample front of a network runs in micro-batches.

The hand-made model: x (4, 2, 8, 8) float32 -> Conv 3x3 (W (3, 2, 3, 3) 216 B, bias 12 B)
-> z (4, 3, 8, 8) 3,072 B -> Relu a 3,072 B -> MaxPool 2x2 p (4, 3, 4, 4) 768 B -> Flatten
f (4, 48) 768 B -> Gemm (W (5, 48) 960 B, bias 20 B) -> logits (4, 5). The front (Conv to
Flatten) makes 7,680 B of activations beside 1,208 B of parameters; the Gemm's parameters
(980 B) outweigh its batch tensors (768 + 80 B), so it stays whole.
"""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import views
from memsched.deadline import unlimited
from memsched.runtime import run_plan
from memsched.frontend import lower
from memsched.memory import validate
from memsched.onnx_utils import MEMSCHED_DOMAIN
from memsched.ops import CHUNKED_BATCH_NORM
from memsched.onnx_utils import save_model_atomic
from memsched.schedule import Plan
from memsched.passes.rewrites.batch_split import SPLIT_KEY, chunk_count, split_batch, split_training_step
from memsched.passes.rewrites.batch_split import given_graph
from memsched.passes.pipeline import compile, step_builder
from memsched.passes.placement import place_pass

from .conftest import run_cli

BUILD = step_builder(lr=0.1)
ALL = "order,reuse,recompute,swap"


def cnn(batch: int = 4, front: str = "", pool_indices: bool = False):
    """The module docstring's model; `front`: "bn" puts a BatchNormalization on batch statistics
    after the Conv ("bn-running": one with its running statistics as outputs), "batch-bias"
    adds an initializer with a batch-sized leading axis to z."""
    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    inits = [init("conv.weight", (3, 2, 3, 3)), init("conv.bias", (3,)), init("fc.weight", (5, 48)),
             init("fc.bias", (5,))]
    nodes = [helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["z0" if front else "z"], name="conv",
                              pads=[1, 1, 1, 1])]
    if front in ("bn", "bn-running"):   # the second with its running statistics as outputs too
        inits += [init("bn.scale", (3,)), init("bn.b", (3,)), init("bn.mean", (3,)),
                  numpy_helper.from_array(np.ones(3, np.float32), "bn.var")]
        running = front == "bn-running"
        nodes.append(helper.make_node("BatchNormalization", ["z0", "bn.scale", "bn.b", "bn.mean", "bn.var"],
                                      ["z", "bn.mean.out", "bn.var.out"] if running else ["z"], name="bn",
                                      training_mode=int(running)))
    elif front == "batch-bias":
        inits.append(init("shift", (batch, 3, 8, 8)))
        nodes.append(helper.make_node("Add", ["z0", "shift"], ["z"], name="shift_add"))
    pool_out = ["p", "p_indices"] if pool_indices else ["p"]
    nodes += [helper.make_node("Relu", ["z"], ["a"], name="relu"),
              helper.make_node("MaxPool", ["a"], pool_out, name="pool", kernel_shape=[2, 2], strides=[2, 2]),
              helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
              helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 5])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 8, 8])],
                              outputs, inits)
    return lower(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def test_the_per_sample_front_runs_once_per_chunk():
    split, region = split_batch(cnn(), 3)
    assert region == ["conv", "relu", "pool", "flatten"]
    assert [op.name for op in split.ops] == [
        "x/SplitBatch", *[f"{op}/chunk{i}" for i in range(3) for op in region], "f/ConcatBatch", "fc"]
    assert [split.tensors[f"z/chunk{i}"].shape for i in range(3)] == [(2, 3, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8)]
    assert split.op_by_name["f/ConcatBatch"].attributes == {"axis": 0}
    assert "z" not in split.tensors and split.tensors["f"].shape == (4, 48)     # only f is made whole again


def test_the_split_model_computes_what_the_model_does():
    forward = cnn()
    split, _ = split_batch(forward, 2)
    x = np.random.default_rng(1).standard_normal((4, 2, 8, 8)).astype(np.float32)
    outputs = [ort.InferenceSession(g.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
               .run(["logits"], {"x": x})[0] for g in (forward, split)]
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("front, pool_indices, region", [
    ("bn-running", False, ["conv"]),               # running statistics as outputs are not split
    ("batch-bias", False, ["conv"]),               # a batch-sized initializer reaches across samples
    ("", True, ["conv", "relu"]),                  # MaxPool's indices count over the whole batch
])
def test_ops_that_couple_samples_end_the_front(front, pool_indices, region):
    assert split_batch(cnn(front=front, pool_indices=pool_indices), 2)[1] == region


def test_nothing_splits_at_batch_one_or_into_more_chunks_than_samples():
    forward = cnn(batch=1)
    assert split_batch(forward, 2) == (forward, [])
    assert split_batch(cnn(), 5)[1] == []
    assert chunk_count(forward, 2000) == 1


# The front makes 7,680 B beside 1,208 B of parameters; its largest working set is the Relu's
# z and a, 6,144 B: in chunks, it takes half the room beside the parameters or less.
@pytest.mark.parametrize("budget, chunks", [(9000, 1), (8000, 2), (5000, 4), (1208, 0)])
def test_the_chunks_leave_each_op_half_the_room_beside_the_parameters(budget, chunks):
    # 7,680 B of front activations; free = budget - 1,208 B of parameters
    assert chunk_count(cnn(), budget) == chunks


def test_no_split_where_no_op_crowds_the_room_beside_the_parameters():
    """The small U-Net makes 6,520,832 B of activations beside 30,856 B of parameters; its
    largest working set (a Concat of two 262,144 B maps into 524,288 B) is 1,048,576 B. Below
    the activations, it splits only once that set takes three quarters of the room."""
    from memsched import models

    forward = lower(models.build("unet2d", batch=4, size=64, width=4, depth=2))
    params, largest = 30856, 1048576
    assert chunk_count(forward, params + 6520832) == 1                 # everything fits
    assert chunk_count(forward, params + 6520831) == 1                 # the largest takes 16 %
    assert chunk_count(forward, params + largest * 4 // 3 + 2) == 1    # just under 75 %
    assert chunk_count(forward, params + largest * 4 // 3 - 2) == 2    # just over: halved
    assert chunk_count(forward, params + largest) == 2


def test_a_split_step_runs_like_the_step_as_given():
    forward = cnn()
    given = BUILD(forward)
    step = split_training_step(forward, given, BUILD, 2)
    assert SPLIT_KEY in step.metadata
    assert [op.name for op in given_graph(step).ops] == [op.name for op in given.ops]
    # each chunk's weight gradient is its own, summed for the update
    assert {"conv/chunk0/grad/Conv", "conv/chunk1/grad/Conv"} <= {op.name.rsplit("_", 1)[0] for op in step.ops
                                                                 if op.op_type == "Conv"}
    assert (validate(Plan.initial(given)).peak_bytes, validate(Plan.initial(step)).peak_bytes) == (15264, 12224)
    run = run_plan(place_pass(Plan.initial(step), 5), steps=2, check=True, given=given_graph(step))
    assert run.check["given"]["passed"] and run.check["given"]["max_abs_diff"] < 1e-5   # the sums round in pieces


def test_a_batchnorm_joins_the_front_as_one_node_over_every_chunk():
    split, region = split_batch(cnn(front="bn"), 2)
    assert region == ["conv", "bn", "relu", "pool", "flatten"]
    assert [op.name for op in split.ops] == [
        "x/SplitBatch", "conv/chunk0", "conv/chunk1", "bn/chunks", "relu/chunk0", "pool/chunk0", "flatten/chunk0",
        "relu/chunk1", "pool/chunk1", "flatten/chunk1", "f/ConcatBatch", "fc"]
    bn = split.op_by_name["bn/chunks"]
    assert (bn.domain, bn.op_type) == (MEMSCHED_DOMAIN, CHUNKED_BATCH_NORM)
    assert bn.inputs == ["z0/chunk0", "z0/chunk1", "bn.scale", "bn.b", "bn.mean", "bn.var"]
    assert bn.outputs == ["z/chunk0", "z/chunk1"]


def test_a_split_batchnorm_trains_as_the_whole_batch_does():
    """The step normalises every chunk with the whole batch's statistics: its loss, updated
    weights and running statistics are the step's as given; the ReLU under it makes each chunk
    keep its normalised input alone (bn_relu)."""
    forward = cnn(front="bn")
    given = BUILD(forward)
    step = split_training_step(forward, given, BUILD, 2)
    assert step.outputs == given.outputs and {"bn.mean.updated", "bn.var.updated"} <= set(step.outputs)
    assert [t for t in step.tensors if t.startswith("bn/chunks/Mul") and t.endswith("_output_0")
            and any(op.phase == "backward" and t in op.inputs for op in step.ops)]    # x^_i kept
    run = run_plan(place_pass(Plan.initial(step), 5), steps=2, check=True, given=given_graph(step))
    assert run.check["given"]["passed"] and run.check["given"]["max_abs_diff"] < 1e-5, run.check["given"]
    assert set(run.check["given"]["per_output"]) == set(given.outputs)


@pytest.mark.parametrize("name, options", [("unet2d", dict(batch=4, size=64, width=4, depth=2)),
                                           ("resnet18", dict(batch=8, size=48))])
def test_a_bundled_network_splits_through_its_batchnorms_and_trains_as_given(name, options):
    """Through BatchNorms, skip concatenations and residual adds: the U-Net's region is the
    whole network; the ResNet's ends where its weights outweigh its activations (layer 2),
    and its split step, whose parameters are read first in another order (a block's
    downsample before its second BN), gives the outputs of the step as given in their order."""
    from memsched import models

    forward = lower(models.build(name, **options))
    given = BUILD(forward)
    _, region = split_batch(forward, 2)
    norms = [op.name for op in forward.ops if op.op_type == "BatchNormalization"]
    assert len(set(norms) & set(region)) >= (len(norms) if name == "unet2d" else 6)
    step = split_training_step(forward, given, BUILD, 2)
    assert step is not None and step.outputs == given.outputs
    run = run_plan(place_pass(Plan.initial(step), 5), steps=1, check=True, given=given_graph(step))
    assert run.check["given"]["passed"], run.check["given"]


def _dense_bn(batch: int = 4):
    """x (batch, 6) float64 -> Gemm (5) -> BatchNormalization (training) -> Relu -> Gemm (3):
    ONNX Runtime's CPU runs it in float64 (it has no float64 Conv)."""
    rng = np.random.default_rng(3)

    def init(name, *shape, low=None):
        value = rng.uniform(0.5, 1.5, shape) if low else rng.standard_normal(shape)
        return numpy_helper.from_array(value.astype(np.float64), name)

    inits = [init("w1", 5, 6), init("b1", 5), init("scale", 5, low=True), init("shift", 5), init("mean", 5),
             init("var", 5, low=True), init("w2", 3, 5), init("b2", 3)]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("BatchNormalization", ["h", "scale", "shift", "mean", "var"], ["n"], name="bn"),
             helper.make_node("Relu", ["n"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["logits"], name="fc2", transB=1)]
    graph = helper.make_graph(nodes, "dense_bn", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [batch, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.DOUBLE, [batch, 3])], inits)
    return lower(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def test_the_chunked_batchnorm_gradient_is_the_central_difference():
    """The gradient rule of ChunkedBatchNormalization, as every rule is checked: in float64,
    every parameter's gradient of the split step (batch 5 in chunks of 3 and 2) against central
    differences of its own loss."""
    from memsched.passes.training import build_training_step
    from tests.gradcheck import check_step_gradients, training_info

    def build(forward):
        return build_training_step(forward, optimizer="none")

    forward = _dense_bn(batch=5)
    step = split_training_step(forward, build(forward), build, 2)
    assert any(op.name.startswith("bn/chunks/grad/") for op in step.ops) and "fc1/chunk1" in step.op_by_name
    assert set(training_info(step)["parameters"]) == {"w1", "b1", "scale", "shift", "w2", "b2"}
    feeds = {"x": np.random.default_rng(2).standard_normal((5, 6)), "labels": np.array([0, 2, 1, 2, 0], np.int64)}
    check_step_gradients(step, feeds)


def test_the_split_steps_gradients_agree_with_its_float64_run():
    """The chunked BatchNorm's gradient against the same step in float64 (memsched.numerics),
    BatchNorm parameters jittered off their initial 1 and 0: every parameter's gradient within
    1e-3, as every bundled model's step is."""
    from memsched import models, numerics
    from memsched.passes.training import build_training_step
    from tests.test_numerics import jittered

    def build(forward):
        return build_training_step(forward, optimizer="none")

    forward = lower(jittered(models.build("unet2d", batch=4, size=64, width=4, depth=2)))
    step = split_training_step(forward, build(forward), build, 2)
    rows = numerics.check(step)
    assert len(rows) == len(json.loads(step.metadata["memsched.training"])["parameters"])
    assert rows[0].error < 1e-3, numerics.format_rows(rows, 5)


def test_synchronised_batchnorm_finds_the_split_batchnorm_statistics():
    from memsched.data_parallel import batch_statistics

    forward = cnn(front="bn")
    step = split_training_step(forward, BUILD(forward), BUILD, 2)
    record = json.loads(step.metadata["memsched.batch_statistics"])
    assert list(record) == ["bn/chunks"] and len(record["bn/chunks"]["forward"]) == 2
    assert len(record["bn/chunks"]["backward"]) == 2 and len(batch_statistics(step)) == 4


# The step as given reaches 5,984 B at best; in micro-batches (three at this budget: each op
# then takes half the room beside the parameters or less) its plans place below it: 5,980 B is
# the most room below the step as given.
SPLIT_BUDGET = 5980


def test_compile_plans_micro_batches_where_the_step_as_given_cannot_fit(capsys):
    forward = cnn()
    result = compile(forward, train=True, lr=0.1, strategies=ALL, budget=SPLIT_BUDGET, time_limit=2,
                     deadline=unlimited())
    note = result.plan.notes["batch_split"]
    assert note["chosen"] and note["chunks"] == chunk_count(forward, SPLIT_BUDGET) == 3
    assert note["step_time_s"]["given"] is None
    assert "cannot be met" in note["errors"]["given"]
    assert result.report["plan"]["micro_batches"] == 3
    assert result.report["plan"]["arena_bytes"] <= SPLIT_BUDGET and result.report["plan"]["peak_bytes"] <= SPLIT_BUDGET
    assert [op.name for op in result.baseline.graph.ops] == [op.name for op in BUILD(forward).ops]
    run = run_plan(result.plan, steps=2, check=True, given=given_graph(result.plan.graph))
    assert run.check["given"]["passed"]
    views.print_compile(json.loads(json.dumps(result.report)))
    assert "planned in 3 micro-batches: step as given no fit, in micro-batches +" in capsys.readouterr().out


def test_compile_keeps_the_step_whole_where_it_fits_as_it_is():
    result = compile(cnn(), train=True, lr=0.1, strategies=ALL, budget=9000, time_limit=2)
    assert "batch_split" not in result.plan.notes and result.report["plan"]["micro_batches"] == 1


def test_a_gemm_joins_the_front_once_its_batch_tensors_outweigh_its_weights():
    # batch 16: f (16, 48) 3,072 B + logits 320 B against 980 B of weight and bias
    split, region = split_batch(cnn(batch=16), 2)
    assert region == ["conv", "relu", "pool", "flatten", "fc"]
    assert split.ops[-1].name == "logits/ConcatBatch" and split.outputs == ["logits"]


@pytest.mark.slow     # 30 s of compile; test_compile_plans_micro_batches_... covers the plan in the fast suite
def test_the_cli_compiles_micro_batches_and_runs_them_against_the_step_as_given(tmp_path):
    model, scheduled = tmp_path / "cnn.onnx", tmp_path / "scheduled.onnx"
    save_model_atomic(cnn().to_onnx(), model)
    result = run_cli("compile", model, "--train", "--lr", "0.1", "--budget", f"{SPLIT_BUDGET}B", "--strategies", ALL,
                     "--time-limit", "30", "-o", scheduled, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["micro_batches"] == 3
    run = run_cli("run", scheduled, "--check", "--json")
    assert run.returncode == 0, run.stderr
    check = json.loads(run.stdout)["check"]
    assert check["passed"] and check["given"]["passed"] and check["given"]["max_abs_diff"] < 1e-5
