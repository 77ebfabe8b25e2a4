"""`memsched inspect`: the summary's figures, in JSON and as a table."""
from __future__ import annotations

import json

from memsched.onnx_utils import save_model_atomic

from .conftest import run_cli
from .graphs import mlp_model


def test_inspect_json_figures(tmp_path):
    path = save_model_atomic(mlp_model(batch=2, width=5), tmp_path / "m.onnx")
    result = run_cli("inspect", path, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["ops"] == 3 and summary["tensors"] == 6
    assert summary["op_types"] == {"MatMul": 2, "Relu": 1}
    assert summary["parameters"] == 4 * 5 + 5 * 3
    assert summary["parameter_bytes"] == 140
    # step 1 (relu): h 40 + a 40 + W1 80 + W2 60 = 220; step 0: x 32 + h 40 + 140 = 212; step 2: a 40 + y 24 + 140
    assert summary["peak_bytes"] == 220 and summary["peak_op"] == "relu"
    assert summary["largest_tensors"][0] == {"name": "W1", "shape": [4, 5], "dtype": "float32",
                                             "kind": "parameter", "bytes": 80}


def test_inspect_table(tmp_path):
    path = save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    result = run_cli("inspect", path)
    assert result.returncode == 0, result.stderr
    assert "peak (default order)" in result.stdout and "largest tensors" in result.stdout
    assert "MatMul" in result.stdout


def test_usage_errors_are_one_line_and_exit_1():
    """A missing argument, an unknown option or command: one line that names the command's
    --help, exit 1 (argparse's usage block and exit 2 are not what a user gets)."""
    for args, fragment in ((("inspect",), "memsched inspect --help"), (("inspect", "m.onnx", "--bogus"), "--bogus"),
                           (("frobnicate",), "'frobnicate'")):
        result = run_cli(*args)
        assert result.returncode == 1 and result.stdout == "", result
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("memsched: error: ")
        assert fragment in result.stderr
