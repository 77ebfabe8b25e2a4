"""External data must hold the values its tensor declares: a short file, a negative or
non-numeric offset and a `length` that disagrees with the shape are one line at load, for
every command, and a tensor without a length is read as exactly its own bytes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched import frontend
from memsched.errors import UserError

from .conftest import run_cli
from .graphs import make_model
from .test_reliability import one_line_error

WEIGHT = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100    # 512 bytes
NEEDED = "512 bytes"


def _gemm_model(folder, data: bytes, entries: dict[str, str]):
    """x[2,16] -> Gemm(fc1.weight[8,16] external, transB) -> y[2,8], its weight's external-data
    entries `entries` and the file they name holding `data`; the model's path."""
    weight = numpy_helper.from_array(WEIGHT, "fc1.weight")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    bias = numpy_helper.from_array(np.zeros(8, np.float32), "fc1.bias")
    node = helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["y"], name="fc1", transB=1)
    graph = helper.make_graph([node], "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [weight, bias])
    (folder / entries.get("location", "w.bin")).write_bytes(data)
    path = folder / "model.onnx"
    path.write_bytes(make_model(graph).SerializeToString())
    return path


def _commands(path, tmp_path):
    """Each command that loads the model, with the options it needs."""
    out = tmp_path / "out.onnx"
    return {
        "inspect": ("inspect", path),
        "compile": ("compile", path, "--train", "--optimizer", "sgd", "--time-limit", "5", "-o", out),
        "train-graph": ("train-graph", path, "--optimizer", "sgd", "-o", out),
        "check-numerics": ("check-numerics", path),
    }


@pytest.mark.parametrize("command", ["inspect", "compile", "train-graph", "check-numerics"])
def test_a_short_external_file_is_one_line_for_every_command(tmp_path, command):
    path = _gemm_model(tmp_path, b"\0" * 100, {"location": "short.bin", "offset": "0", "length": "512"})
    one_line_error(run_cli(*_commands(path, tmp_path)[command]),
                   "'fc1.weight'", NEEDED, "'short.bin'", "at offset 0", "holds 100")
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("entries", [
    {"location": "short.bin"},                                        # no offset, no length
    {"location": "short.bin", "offset": "0"},
    {"location": "short.bin", "offset": "450", "length": "512"},     # the file is long enough, but not from there
])
def test_a_short_external_file_is_refused_by_load(tmp_path, entries):
    path = _gemm_model(tmp_path, b"\0" * (100 if len(entries) < 3 else 600), entries)
    with pytest.raises(UserError) as caught:
        frontend.load(path)
    message = str(caught.value)
    assert "\n" not in message and "'fc1.weight'" in message and NEEDED in message, message
    assert "'short.bin'" in message


@pytest.mark.parametrize("command", ["inspect", "compile", "train-graph", "check-numerics"])
@pytest.mark.parametrize("offset", ["-5", "abc", "1.5"])
def test_a_negative_or_non_numeric_offset_is_one_line(tmp_path, command, offset):
    path = _gemm_model(tmp_path, WEIGHT.tobytes(), {"location": "w.bin", "offset": offset, "length": "512"})
    line = one_line_error(run_cli(*_commands(path, tmp_path)[command]),
                          "'fc1.weight'", f"offset '{offset}'", "'w.bin'", "non-negative")
    assert "internal error" not in line


@pytest.mark.parametrize("length", ["100", "513", "1024", "-512"])
def test_a_length_that_disagrees_with_the_shape_is_one_line(tmp_path, length):
    path = _gemm_model(tmp_path, WEIGHT.tobytes() * 2, {"location": "w.bin", "offset": "0", "length": length})
    expected = ("non-negative",) if length.startswith("-") else ("8x16", NEEDED, f"length {int(length):,}")
    one_line_error(run_cli("inspect", path), "'fc1.weight'", "'w.bin'", *expected)
    with pytest.raises(UserError):
        frontend.load(path)


@pytest.mark.parametrize("entries, data", [
    ({"location": "w.bin", "offset": "0", "length": "512"}, WEIGHT.tobytes()),
    ({"location": "w.bin"}, WEIGHT.tobytes()),
    ({"location": "w.bin", "offset": "64", "length": "512"}, b"\1" * 64 + WEIGHT.tobytes() + b"\2" * 32),
])
def test_external_data_that_fits_loads_with_its_values(tmp_path, entries, data):
    path = _gemm_model(tmp_path, data, entries)
    graph = frontend.load(path)
    assert graph.tensors["fc1.weight"].shape == (8, 16)
    weight = next(t for t in graph.to_onnx().graph.initializer if t.name == "fc1.weight")
    assert np.array_equal(numpy_helper.to_array(weight), WEIGHT)
    result = run_cli("inspect", path)
    assert result.returncode == 0, result.stderr


def test_a_tensor_without_a_length_is_read_as_its_own_bytes(tmp_path):
    """onnx's reader takes a tensor without a length to its file's end: with bytes after the
    weight (another tensor's, say), the weight written out would hold them too."""
    path = _gemm_model(tmp_path, b"\3" * 8 + WEIGHT.tobytes() + b"\4" * 40, {"location": "w.bin", "offset": "8"})
    out = tmp_path / "out.onnx"
    result = run_cli("train-graph", path, "--optimizer", "sgd", "-o", out)
    assert result.returncode == 0, result.stderr
    weight = next(t for t in onnx.load(str(out)).graph.initializer if t.name == "fc1.weight")
    assert len(weight.raw_data) == WEIGHT.nbytes
    assert np.array_equal(numpy_helper.to_array(weight), WEIGHT)


def test_stored_bytes_pack_sub_byte_types_and_know_no_size_for_strings():
    """The bytes an initializer's raw data takes (`dtypes.stored_bytes`, the rule both the load's
    extent check and the plan reader's size check use): 4- and 2-bit types packed, rounded up."""
    from memsched import dtypes

    assert dtypes.stored_bytes(TensorProto.FLOAT, 5) == 20
    assert dtypes.stored_bytes(TensorProto.INT4, 5) == 3 and dtypes.stored_bytes(TensorProto.UINT2, 5) == 2
    assert dtypes.stored_bytes(TensorProto.STRING, 5) is None and dtypes.stored_bytes(0, 5) is None
