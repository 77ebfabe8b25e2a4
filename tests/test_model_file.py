"""memsched.model_file: a large model's weights are read where they lie in its file."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import load_external_data_for_model

from memsched import frontend, model_file, models
from memsched.emit import read_plan, write_plan
from memsched.errors import UserError
from memsched.runtime import run_plan
from memsched.onnx_utils import is_weight
from memsched.passes.pipeline import compile as compile_plan


@pytest.fixture
def in_place(monkeypatch):
    """Every file counts as large: the small bundled MLP takes the in-place path."""
    monkeypatch.setattr(model_file, "SMALL_MODEL_BYTES", 0)


def _saved(tmp_path, model=None):
    path = tmp_path / "m.onnx"
    onnx.save_model(model or models.build("mlp"), str(path))
    return path


def test_weights_become_references_into_the_file_and_read_back_the_same(tmp_path, in_place):
    path = _saved(tmp_path)
    plain = onnx.load(str(path))
    read = model_file.read(path)
    weights = [t for t in plain.graph.initializer if is_weight(t)]
    assert weights and len(weights) < len(plain.graph.initializer)     # the MLP has shape tensors too
    for tensor in read.graph.initializer:
        where = {e.key: e.value for e in tensor.external_data}
        if any(w.name == tensor.name for w in weights):
            assert tensor.data_location == TensorProto.EXTERNAL and where["location"] == "m.onnx"
            assert not tensor.raw_data
        else:
            assert tensor.data_location != TensorProto.EXTERNAL and not where
    load_external_data_for_model(read, str(tmp_path))
    for mine, theirs in zip(read.graph.initializer, plain.graph.initializer, strict=True):
        assert (mine.name, list(mine.dims), mine.data_type) == (theirs.name, list(theirs.dims), theirs.data_type)
        np.testing.assert_array_equal(numpy_helper.to_array(mine), numpy_helper.to_array(theirs))
    for model in (read, plain):
        del model.graph.initializer[:]
    assert read.SerializeToString() == plain.SerializeToString()      # every other field as it was


def test_a_planned_step_of_an_in_place_model_runs_and_matches_a_plain_run_with_the_model_gone(tmp_path, in_place):
    path = _saved(tmp_path)
    plain = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    plan = compile_plan(str(path), train=True, strategies="order,reuse", time_limit=3).plan
    out = write_plan(plan, tmp_path / "plan" / "s.onnx")
    stored = onnx.load(str(out))          # its own data file, beside it
    for tensor in stored.graph.initializer:
        if tensor.name in plain:
            np.testing.assert_array_equal(numpy_helper.to_array(tensor), plain[tensor.name])
    os.remove(path)
    result = run_plan(read_plan(out), steps=2, check=True)
    assert result.check["passed"] and result.check["bit_identical"]


def test_a_weight_with_stray_bytes_is_still_refused(tmp_path, in_place):
    model = models.build("mlp")
    weight = next(t for t in model.graph.initializer if is_weight(t))
    weight.raw_data = weight.raw_data + b"\x00\x01"
    with pytest.raises(UserError, match="holds"):
        frontend.load(_saved(tmp_path, model))


def test_an_unusual_file_is_parsed_by_onnx_as_before(tmp_path, in_place):
    """A graph in two pieces (protobuf merges them) and a truncated file: onnx.load reads the
    first and refuses the second, as without the in-place path."""
    path = _saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + bytes([7 << 3 | 2, 0]))          # a second, empty graph field
    read = model_file.read(path)
    assert read.SerializeToString() == onnx.load(str(path)).SerializeToString()
    assert not any(t.data_location == TensorProto.EXTERNAL for t in read.graph.initializer)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable ONNX model"):
        frontend.load(path)


def test_outputs_are_checked_against_a_model_read_in_place(tmp_path, in_place):
    """`check_outputs` reads the model as the front end does: an output over its data file, or
    over the model itself, is still refused, naming which."""
    from memsched.outputs import check_outputs

    path = tmp_path / "m.onnx"
    onnx.save_model(models.build("mlp"), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.bin", size_threshold=100_000)        # the large weight external, the rest inline
    with pytest.raises(UserError, match="external data of the input"):
        check_outputs({"-o": tmp_path / "m.bin"}, [path])
    with pytest.raises(UserError, match="is the input"):
        check_outputs({"-o": path}, [path])
