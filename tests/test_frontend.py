"""The front end: round trips without loss, and one clear line for every kind of bad input."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from memsched import frontend
from memsched.errors import UserError
from memsched.ir import Graph
from memsched.onnx_utils import checkable_view, make_model, save_model_atomic

from .conftest import run_cli
from .graphs import mlp_model, reshape_model


def ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("build", [mlp_model, reshape_model, lambda: mlp_model(width=512)])
def test_round_trip_is_lossless(tmp_path, build):
    path = save_model_atomic(build(), tmp_path / "m.onnx")
    graph = frontend.load(path)
    emitted = graph.to_onnx()
    onnx.checker.check_model(emitted, full_check=True)
    x = np.random.default_rng(1).standard_normal(graph.tensors["x"].shape).astype(np.float32)
    for a, b in zip(ort_run(onnx.load(str(path)), {"x": x}), ort_run(emitted, {"x": x})):
        assert a.shape == b.shape and np.array_equal(a, b)
    again = Graph.from_onnx(emitted)
    assert [(o.name, o.op_type, o.inputs, o.outputs, o.attributes) for o in again.ops] == \
        [(o.name, o.op_type, o.inputs, o.outputs, o.attributes) for o in graph.ops]
    assert {n: (x.shape, x.dtype, x.kind) for n, x in again.tensors.items()} == \
        {n: (x.shape, x.dtype, x.kind) for n, x in graph.tensors.items()}


def test_shape_inference_and_the_checker_see_no_weight_values():
    """Both serialize what they are given: weights go to them as typed inputs, integer
    initializers (shapes for data propagation) and small ones stay."""
    model = mlp_model(width=512)
    view = checkable_view(model)
    assert [i.name for i in view.graph.initializer] == []
    assert {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in view.graph.input} == \
        {"x": [2, 4], "W1": [4, 512], "W2": [512, 3]}
    small = mlp_model()                # weights of 64 and 48 bytes: nothing to leave out
    assert checkable_view(small) is small


def test_a_weight_holding_fewer_values_than_its_shape_is_one_line(tmp_path):
    model = mlp_model(width=512)
    weight = model.graph.initializer[0]
    weight.raw_data = weight.raw_data[: len(weight.raw_data) // 2]
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UserError, match=r"initializer 'W1' declares shape 4x512 \(8,192 bytes\) but holds "
                                        r"4,096 bytes; the file is damaged"):
        frontend.load(path)


@pytest.mark.parametrize("stray", [1, 3])
def test_a_weight_with_stray_bytes_is_one_line(tmp_path, stray):
    """A few bytes past the last whole value are damage too (counting whole values missed them)."""
    model = mlp_model(width=512)
    model.graph.initializer[0].raw_data += b"\0" * stray
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UserError, match=rf"declares shape 4x512 \(8,192 bytes\) but holds {8192 + stray:,} bytes"):
        frontend.load(path)


def test_kinds_and_phases_survive_the_round_trip(tmp_path):
    graph = frontend.load(save_model_atomic(mlp_model(), tmp_path / "m.onnx"))
    graph.tensors["h"].kind = "gradient"
    graph.ops[1].phase = "backward"
    again = Graph.from_onnx(graph.to_onnx())
    assert again.tensors["h"].kind == "gradient" and again.ops[1].phase == "backward"
    assert again.tensors["W1"].kind == "parameter" and again.ops[0].phase == "forward"


def test_shape_arithmetic_and_missing_output_shapes_are_inferred(tmp_path):
    graph = frontend.load(save_model_atomic(reshape_model(), tmp_path / "m.onnx"))
    assert graph.tensors["flat"].shape == (2, 12)
    assert graph.tensors["y"].shape == (2, 12)  # the graph output was declared without a shape
    assert graph.tensors["s"].kind == "activation" and graph.tensors["minus1"].kind == "constant"


def test_symbolic_dims_bind(tmp_path):
    path = save_model_atomic(mlp_model(batch="batch"), tmp_path / "m.onnx")
    graph = frontend.load(path, {"batch": 8})
    assert graph.tensors["x"].shape == (8, 4) and graph.tensors["y"].shape == (8, 3)
    with pytest.raises(UserError, match="unbound symbolic dimension 'batch'; pass --dim batch=VALUE"):
        frontend.load(path)
    with pytest.raises(UserError, match="no symbolic dimension named seq"):
        frontend.load(path, {"batch": 8, "seq": 3})


def test_model_over_2gb_with_external_data(tmp_path):
    """A 2.25 GB initializer in an external file (sparse on disk): loads and inspects without reading it."""
    rows = 9 * 2**28 // 4 // 64  # 2.25 GiB of float32 in a [rows, 64] weight
    init = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[rows, 64])
    init.data_location = TensorProto.EXTERNAL
    nbytes = rows * 64 * 4
    for key, value in (("location", "big.onnx.data"), ("offset", "0"), ("length", str(nbytes))):
        init.external_data.add(key=key, value=value)
    with open(tmp_path / "big.onnx.data", "wb") as f:
        f.truncate(nbytes)
    graph = helper.make_graph([helper.make_node("Gather", ["W", "idx"], ["y"], name="embed", axis=0)], "big",
                              [helper.make_tensor_value_info("idx", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], [init])
    onnx.save_model(make_model(graph), str(tmp_path / "big.onnx"))
    loaded = frontend.load(tmp_path / "big.onnx")
    assert loaded.tensors["W"].nbytes == nbytes > 2**31
    result = run_cli("inspect", tmp_path / "big.onnx", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["parameter_bytes"] == nbytes
    os.unlink(tmp_path / "big.onnx.data")
    result = run_cli("inspect", tmp_path / "big.onnx")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"memsched: error: external data file 'big.onnx.data' for initializer 'W' "
                                     f"not found next to the model in {tmp_path}")


def _bad_files(tmp_path):
    good = tmp_path / "good.onnx"
    save_model_atomic(mlp_model(), good)
    data = good.read_bytes()
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.onnx").write_text("this is a readme, not a model\n" * 20)
    (tmp_path / "adir").mkdir()
    custom = mlp_model()
    custom.graph.node[1].domain = "com.example"
    custom.opset_import.append(helper.make_opsetid("com.example", 1))
    save_model_atomic(custom, tmp_path / "custom.onnx")
    save_model_atomic(mlp_model(batch="batch"), tmp_path / "symbolic.onnx")
    return {
        "missing": (tmp_path / "nope.onnx", "no such file"),
        "directory": (tmp_path / "adir", "is a directory"),
        "empty": (tmp_path / "empty.onnx", "is empty"),
        "truncated": (tmp_path / "truncated.onnx", "not a readable ONNX model"),
        "text": (tmp_path / "text.onnx", "not"),
        "custom op": (tmp_path / "custom.onnx", "unsupported op 'Relu' from domain 'com.example' at node 'relu'"),
        "unbound dim": (tmp_path / "symbolic.onnx", "pass --dim batch=VALUE"),
    }


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "truncated", "text", "custom op",
                                  "unbound dim"])
def test_bad_input_is_one_line_exit_1(tmp_path, case):
    path, expected = _bad_files(tmp_path)[case]
    result = run_cli("inspect", path)
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsched: error:") and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_bad_dim_option_is_a_user_error(tmp_path):
    path = save_model_atomic(mlp_model(batch="batch"), tmp_path / "m.onnx")
    result = run_cli("inspect", path, "--dim", "batch=zero")
    assert result.returncode == 1 and "write NAME=VALUE" in result.stderr


def test_a_negative_dimension_and_a_non_ascii_dim_value_are_refused(tmp_path):
    """An input declared [-3, 8] is no shape; '--dim N=²' is no number (str.isdigit says it is)."""
    import onnx
    from onnx import TensorProto, helper

    from memsched.errors import UserError
    from memsched.frontend import load, parse_dims

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-3, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "negative.onnx")
    with pytest.raises(UserError, match=r"tensor '.' has a negative dimension \(shape \[-3, 8\]\)"):
        load(tmp_path / "negative.onnx")
    for text in ("N=²", "N=１２", "N=0", "N=-1"):
        with pytest.raises(UserError, match="cannot read --dim"):
            parse_dims([text])
    assert parse_dims(["N=12"]) == {"N": 12}


def _conv_model(op_type: str, group: int, channels: int = 3, kernel_shape=(6, 1, 3, 3)) -> onnx.ModelProto:
    weight = helper.make_tensor("W", TensorProto.FLOAT, kernel_shape, np.ones(kernel_shape, np.float32).ravel())
    graph = helper.make_graph([helper.make_node(op_type, ["x", "W"], ["y"], group=group)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, channels, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    return make_model(graph)


@pytest.mark.parametrize("op_type, group, kernel_shape", [
    ("Conv", 0, (6, 3, 3, 3)),            # the backward divided by it
    ("Conv", 7, (6, 1, 3, 3)),            # 7 groups of 3 channels: ONNX Runtime fails at run time
    ("Conv", 3, (6, 3, 3, 3)),            # the kernel holds all channels, not a third
    ("ConvTranspose", 0, (3, 2, 3, 3)),
    ("ConvTranspose", 2, (3, 2, 3, 3)),   # 3 channels in 2 groups
])
def test_a_convolution_whose_groups_do_not_divide_its_channels_is_one_line(tmp_path, op_type, group, kernel_shape):
    path = save_model_atomic(_conv_model(op_type, group, kernel_shape=kernel_shape), tmp_path / "conv.onnx")
    with pytest.raises(UserError, match=rf"{op_type} node .* has group={group}(;| for 3 input channels)"):
        frontend.load(path)


@pytest.mark.parametrize("op_type, shapes, message", [
    ("MatMul", ([2, 3], [4, 5], [2, 5]), "MatMul.*Incompatible dimensions for matrix multiplication"),
    ("Add", ([2, 3], [4, 5], [2, 3]), "Add.*Incompatible dimensions"),
])
def test_ops_whose_operands_do_not_compose_are_refused_at_load(tmp_path, op_type, shapes, message):
    """A graph whose declared shapes no run could have (it would be planned by its declared
    shapes, then fail in ONNX Runtime) is refused in one line naming the op."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node(op_type, ["x", "y"], ["z"])], "g",
                              [vi("x", TensorProto.FLOAT, shapes[0]), vi("y", TensorProto.FLOAT, shapes[1])],
                              [vi("z", TensorProto.FLOAT, shapes[2])])
    path = save_model_atomic(make_model(graph), tmp_path / "bad.onnx")
    with pytest.raises(UserError, match=f"shape inference failed: .*{message}"):
        frontend.load(path)


@pytest.mark.parametrize("op_type, group, channels, kernel_shape", [
    ("Conv", 3, 3, (6, 1, 3, 3)), ("Conv", 1, 3, (6, 3, 3, 3)), ("Conv", 2, 4, (6, 2, 3, 3)),
    ("ConvTranspose", 3, 3, (3, 2, 3, 3)), ("ConvTranspose", 1, 3, (3, 5, 3, 3)),
])
def test_valid_groups_load(tmp_path, op_type, group, channels, kernel_shape):
    path = save_model_atomic(_conv_model(op_type, group, channels, kernel_shape), tmp_path / "conv.onnx")
    frontend.load(path)


@pytest.mark.parametrize("shape, message", [
    ([2 ** 62, 2], "holds more than 256 TiB"),
    ([1] * 41, "has 41 dimensions; memsched handles at most 32"),
])
def test_a_tensor_too_large_or_of_too_many_dimensions_is_one_line(tmp_path, shape, message):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    path = save_model_atomic(make_model(graph), tmp_path / "big.onnx")
    with pytest.raises(UserError, match=message):
        frontend.load(path)
    assert "internal error" not in run_cli("inspect", path).stderr


@pytest.mark.parametrize("key, value", [("memsched.kinds", "[1]"), ("memsched.kinds", "{not json"),
                                        ("memsched.kinds", '{"W1": "weightish"}'), ("memsched.kinds", "[" * 100000),
                                        ("memsched.phases", '{"a": 3}')])
def test_garbage_memsched_metadata_in_a_model_is_one_line_naming_the_field(tmp_path, key, value):
    model = mlp_model()
    helper.set_model_props(model, {key: value})
    path = save_model_atomic(model, tmp_path / "m.onnx")
    with pytest.raises(UserError, match=f"the model's metadata '{key}' is not a JSON object"):
        frontend.load(path)


def _nonzero_model(n: int) -> onnx.ModelProto:
    """x[n] -> NonZero -> Transpose: a shape only a run knows."""
    nodes = [helper.make_node("NonZero", ["x"], ["idx"], name="nz"),
             helper.make_node("Transpose", ["idx"], ["y"], name="t")]
    graph = helper.make_graph(nodes, "nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    return make_model(graph)


def test_the_shape_probe_runs_small_models_only(monkeypatch):
    """A shape only a run knows is probed on zeros where the model is small; past
    PROBE_MAX_BYTES of shaped tensors the probe is not run (it would fill the host) and the
    unknown shape is one line naming the limit. (The limit is patched down: a real one is GiBs.)"""
    graph = frontend.lower(_nonzero_model(1000))
    assert graph.tensors["y"].shape == (0, 1)                         # zeros have no non-zero
    monkeypatch.setattr(frontend, "PROBE_MAX_BYTES", 3999)           # x alone is 4,000 bytes

    def refuse(*args, **kwargs):
        raise AssertionError("the probe ran past its limit")
    monkeypatch.setattr("memsched.ort.probe_session", refuse)
    with pytest.raises(UserError, match=r"tensor 'idx' .* is unknown after shape inference \(and a probe run"):
        frontend.lower(_nonzero_model(1000))


def _chain(nodes, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return make_model(graph, opset=opset)


@pytest.mark.parametrize("nodes, message", [
    ([helper.make_node("Relu", ["b"], ["a"], name="n1"), helper.make_node("Relu", ["a"], ["b"], name="n2"),
      helper.make_node("Add", ["x", "b"], ["y"], name="n3")], r"the graph has a cycle: 'n\d' -> 'n\d' -> 'n\d'"),
    ([helper.make_node("Relu", ["a"], ["y"], name="late"), helper.make_node("Relu", ["x"], ["a"], name="early")],
     "node 'late' reads 'a' before node 'early' makes it"),
    ([helper.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[2, 2], strides=[0, 1])],
     r"MaxPool node 'pool' has strides=\[0, 1\]; each must be at least 1"),
    ([helper.make_node("Add", ["x", ""], ["y"], name="add")],
     r"Add node 'add' leaves its required input 1 \('B'\) empty"),
])
def test_cycles_strides_and_empty_inputs_are_named(nodes, message):
    """What ONNX's checker reported as "Field 'shape' of 'type' is required but missing" or cut
    mid-sentence is named here, before it."""
    with pytest.raises(UserError, match=message):
        frontend.lower(_chain(nodes))


def test_a_message_ending_in_a_colon_keeps_its_next_line():
    from memsched.errors import first_line

    assert first_line(ValueError("however input 'y' of node:\nname: n2 OpType: Relu\nmore")) == \
        "however input 'y' of node: name: n2 OpType: Relu"
    assert first_line(ValueError("one line\nframes")) == "one line"


def _string_input_model() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "strings",
                              [helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                              [helper.make_tensor_value_info("t", TensorProto.STRING, [2])])
    return make_model(graph)


def _cast_to_strings_model() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["s"], to=TensorProto.STRING),
                               helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)], "cast",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return make_model(graph)


def _sequence_model() -> onnx.ModelProto:
    nodes = [helper.make_node("SequenceConstruct", ["x", "x"], ["seq"], name="pack"),
             helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0, name="unpack")]
    graph = helper.make_graph(nodes, "sequence", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return make_model(graph)


def _weight_type_model(data_type: int) -> onnx.ModelProto:
    model = mlp_model()
    model.graph.initializer[0].data_type = data_type
    return model


def _recursive_function_model() -> onnx.ModelProto:
    model = mlp_model()
    call = helper.make_node("Again", ["a"], ["b"], domain="local")
    model.functions.append(helper.make_function("local", "Again", ["a"], ["b"], [call],
                                                [helper.make_opsetid("", 17)]))
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node.append(helper.make_node("Again", ["logits"], ["again"], domain="local"))
    return model


@pytest.mark.parametrize("make, message", [
    (_string_input_model, "tensor 's' holds strings"), (_cast_to_strings_model, "tensor 's' holds strings"),
    (_sequence_model, "SequenceConstruct node 'pack' makes or reads sequences"),
    (lambda: _weight_type_model(0), "has element type 0, which ONNX does not define"),
    (lambda: _weight_type_model(999), "has element type 999, which ONNX does not define"),
    (_recursive_function_model, "its local functions cannot be inlined"),
])
def test_values_memsched_cannot_plan_are_one_line(tmp_path, make, message):
    """Strings, sequences, element types ONNX does not define and local functions that call
    themselves: `inspect` (every command's front end) says so in one line, exit 1."""
    path = tmp_path / "m.onnx"
    path.write_bytes(make().SerializeToString())
    result = run_cli("inspect", path)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("memsched: error: ") and message in result.stderr, result.stderr
