"""Embedding updates without a dense gradient: SGD and momentum scatter-add the batch's rows
straight into the table (passes.reuse.fuse_updates); Adam keeps the dense gradient.

The model is an embedding lookup with repeated ids, a mean over the sequence and a Linear
head: the dense update of the table is W - lr * ScatterND(zeros, ids, dy, add), the fused one
ScatterND(W, ids, -lr * dy, add).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched.runtime import run
from memsched.frontend import lower
from memsched.memory import analyze_plan
from memsched.onnx_utils import make_model
from memsched.schedule import Plan
from memsched.passes.training import build_training_step
from memsched.passes.reuse import fuse_updates, reuse_pass, unfused_graph
from tests.conftest import run_cli

from .planbuild import place

VOCAB, DIM, BATCH, SEQ, CLASSES = 1000, 8, 3, 7, 4
TABLE = "emb.weight"


def embedding_step(optimizer: str = "sgd", lr: float = 0.1):
    rng = np.random.default_rng(1)
    table = numpy_helper.from_array(rng.standard_normal((VOCAB, DIM)).astype(np.float32), TABLE)
    head = numpy_helper.from_array((rng.standard_normal((CLASSES, DIM)) * 0.3).astype(np.float32), "fc.weight")
    nodes = [helper.make_node("Gather", [TABLE, "ids"], ["rows"], name="emb", axis=0),
             helper.make_node("ReduceMean", ["rows"], ["pooled"], name="pool", axes=[1], keepdims=0),
             helper.make_node("Gemm", ["pooled", "fc.weight"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                                 [BATCH, SEQ])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, CLASSES])],
                              [table, head])
    return build_training_step(lower(make_model(graph)), optimizer=optimizer, lr=lr)


def feeds():
    ids = np.array([[3, 3, 3, 9, 0, 999, 3], [9, 9, 1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7, 7]], np.int64)
    return {"ids": ids, "labels": np.array([0, 3, 1], np.int64)}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_the_scatter_add_update_equals_the_dense_update(optimizer):
    graph = embedding_step(optimizer)
    fused_graph, fused = fuse_updates(graph)
    assert fused == [TABLE, "fc.weight"]
    maker = fused_graph.producer[f"{TABLE}.updated" if optimizer == "sgd" else f"{TABLE}.momentum_buffer.updated"]
    assert maker.op_type == "ScatterND" and maker.phase == "update"
    # no tensor of the table's size but the table, its update and (momentum) its buffer
    table_bytes = graph.tensors[TABLE].nbytes
    big = {t.name for t in fused_graph.tensors.values() if t.nbytes == table_bytes}
    assert big == {TABLE, f"{TABLE}.updated"} | ({f"{TABLE}.momentum_buffer", f"{TABLE}.momentum_buffer.updated",
                                                 f"{TABLE}/update/Mul_output_0", f"{TABLE}/update/Mul_1_output_0"}
                                                if optimizer == "momentum" else set())
    # two steps (momentum's second reads a non-zero buffer), ids repeated within and across rows
    runs = {}
    for name, g in (("dense", graph), ("fused", fused_graph)):
        plan = place(Plan.initial(g))
        runs[name] = run.run_plan(plan, steps=2, check=True, inputs=feeds())
        assert runs[name].check["passed"]
    for output in graph.outputs:
        np.testing.assert_allclose(runs["fused"].outputs[output], runs["dense"].outputs[output], rtol=1e-6, atol=1e-7)
    untouched = sorted(set(range(VOCAB)) - set(feeds()["ids"].ravel()))
    table = numpy_helper.to_array(graph.tensors[TABLE].data)
    # rows no id names are left as they were (SGD: exactly; momentum: its buffer stays zero)
    np.testing.assert_array_equal(runs["fused"].outputs[f"{TABLE}.updated"][untouched], table[untouched])
    assert unfused_graph(fused_graph).outputs == graph.outputs


def test_the_fused_embedding_update_takes_the_table_in_place_and_adam_keeps_the_dense_gradient():
    graph = embedding_step("sgd")
    plan = reuse_pass(Plan.initial(graph))
    assert plan.notes["reuse"]["fused_updates"] == 2 and plan.aliases[f"{TABLE}.updated"] == TABLE
    table_bytes = graph.tensors[TABLE].nbytes
    # the dense step holds W, its gradient's zeros and the scattered gradient at once; the plan W alone
    assert analyze_plan(Plan.initial(graph)).peak_bytes >= 3 * table_bytes
    profile = analyze_plan(plan)
    assert [(r.tensor, r.shares_with) for r in profile.residencies if r.nbytes == table_bytes] == \
        [(TABLE, None), (f"{TABLE}.updated", (TABLE, 0))]
    assert profile.peak_bytes < table_bytes + 2048
    adam = embedding_step("adam")
    assert fuse_updates(adam) == (adam, [])


def test_a_tiny_bert_compiles_at_half_its_baseline_and_runs_checked(tmp_path):
    # the word embeddings (30,522 x 128 floats: 15,627,264 B) are most of the parameters; a dense
    # gradient beside them would not fit in half the baseline
    from memsched import models
    from memsched.onnx_utils import save_model_atomic

    model = save_model_atomic(models.build("bert-base", batch=2, seq=32, layers=2, hidden=128, heads=2),
                              tmp_path / "bert.onnx")
    plan = tmp_path / "plan.onnx"
    compiled = run_cli("compile", model, "--train", "--hardware", "cpu", "--budget", "50%", "-o", plan,
                       "--time-limit", "20", "--json")
    assert compiled.returncode == 0, compiled.stderr
    ran = run_cli("run", plan, "--check")
    assert ran.returncode == 0, ran.stderr
    import json

    report = json.loads(compiled.stdout)
    assert report["plan"]["peak_bytes"] <= report["budget_bytes"] == report["baseline"]["peak_bytes"] // 2
    assert onnx.load(plan).graph.output[0].name == "loss"
