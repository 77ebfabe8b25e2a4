"""`memsched train-graph`: writes a checked, runnable training step; one-line errors."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memsched.onnx_utils import make_model
from tests.conftest import run_cli
from tests.gradcheck import session
from tests.test_autodiff_training import mlp


def _symbolic_mlp(tmp_path):
    model = mlp()
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "batch"
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    return path


def test_train_graph_writes_a_checked_runnable_step(tmp_path):
    out = tmp_path / "sub" / "train.onnx"
    result = run_cli("train-graph", _symbolic_mlp(tmp_path), "-o", out, "--dim", "batch=4",
                     "--optimizer", "momentum", "--lr", "0.1", "--freeze", "fc1.bias", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["output"] == str(out) and summary["optimizer"] == "momentum" and summary["lr"] == 0.1
    assert summary["trainable_parameters"] == 3 and summary["inputs"] == {"x": [4, 5], "labels": [4]}
    assert set(summary["phases"]) == {"forward", "loss", "backward", "update"}
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    outputs = [o.name for o in model.graph.output]
    assert outputs == ["loss", "fc1.weight.updated", "fc1.weight.momentum_buffer.updated", "fc2.weight.updated",
                       "fc2.weight.momentum_buffer.updated", "fc2.bias.updated", "fc2.bias.momentum_buffer.updated"]
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 5)), "labels": np.array([0, 1, 2, 0])}
    loss, *_ = session(model).run(None, feeds)
    assert np.isfinite(loss)
    assert list(tmp_path.glob("sub/.*")) == []     # no temp files left behind


def test_train_graph_prints_a_summary(tmp_path):
    result = run_cli("train-graph", _symbolic_mlp(tmp_path), "-o", tmp_path / "t.onnx", "--dim", "batch=2")
    assert result.returncode == 0, result.stderr
    assert "4 trainable parameters" in result.stdout and "wrote" in result.stdout


def test_unsupported_ops_fail_in_one_line_before_writing(tmp_path):
    nodes = [helper.make_node("Sin", ["x", ], ["a"], name="s"),
             helper.make_node("MatMul", ["a", "w"], ["b"], name="mm"),
             helper.make_node("Cos", ["b"], ["y"], name="c")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
                              [numpy_helper.from_array(np.ones((3, 2), np.float32), "w")])
    path = tmp_path / "bad.onnx"
    onnx.save(make_model(graph), path)
    out = tmp_path / "out.onnx"
    result = run_cli("train-graph", path, "-o", out, "--loss", "mse")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "no gradient rule for Cos (node 'c')" in result.stderr
    assert "Sin" not in result.stderr      # it only touches the input: no gradient needed
    assert not out.exists()


def test_bad_model_and_options(tmp_path):
    result = run_cli("train-graph", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx")
    assert result.returncode == 1 and "no such file" in result.stderr
    result = run_cli("train-graph", _symbolic_mlp(tmp_path), "-o", tmp_path / "o.onnx", "--dim", "batch=2",
                     "--lr", "0")
    assert result.returncode == 1 and "learning rate must be a positive number" in result.stderr
    result = run_cli("train-graph", _symbolic_mlp(tmp_path), "-o", tmp_path / "o.onnx", "--optimizer", "rmsprop")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "'rmsprop'" in result.stderr
    assert not (tmp_path / "o.onnx").exists()
