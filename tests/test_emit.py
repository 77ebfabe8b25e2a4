"""The scheduled-graph emitter: a valid ONNX file that reads back as the same Plan."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest

from memsched import hardware as hardware_mod
from memsched.emit import FORMAT_VERSION, PLAN_KEY, plan_to_onnx, read_plan, write_plan
from memsched.errors import ScheduleError, UserError
from memsched.ir import tensor_value
from memsched.memory import analyze_plan, check_placement, validate
from memsched.onnx_utils import MEMSCHED_DOMAIN
from memsched.schedule import Plan, free
from tests.planbuild import all_plans, cnn_graph, edit_plan_metadata, mlp_train_graph, order_plan

MLP = mlp_train_graph()
PLANS = all_plans(MLP)


def _op_fields(graph):
    return [(op.name, op.op_type, op.domain, op.inputs, op.outputs, op.phase,
             {k: (v.SerializeToString() if hasattr(v, "SerializeToString") else v) for k, v in op.attributes.items()})
            for op in graph.ops]


def _tensor_fields(graph):
    return {name: (t.shape, t.dtype, t.kind, None if t.data is None else tensor_value(t).tobytes())
            for name, t in graph.tensors.items()}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_round_trip_gives_the_same_plan(tmp_path, name):
    plan = dataclasses.replace(PLANS[name], budget=10_000, notes={"order": {"status": "heuristic", "n": np.int64(3)}})
    back = read_plan(write_plan(plan, tmp_path / "scheduled.onnx"))
    assert back.schedule == plan.schedule
    assert back.offsets == plan.offsets
    assert back.aliases == plan.aliases
    assert back.on_host == plan.on_host
    assert back.budget == 10_000
    assert back.notes == {"order": {"status": "heuristic", "n": 3}}
    assert _op_fields(back.graph) == _op_fields(plan.graph)
    assert _tensor_fields(back.graph) == _tensor_fields(plan.graph)
    assert (back.graph.inputs, back.graph.outputs) == (plan.graph.inputs, plan.graph.outputs)
    assert back.graph.opset_imports == plan.graph.opset_imports
    before, after = analyze_plan(plan), analyze_plan(back)
    assert np.array_equal(before.live_bytes, after.live_bytes)
    assert before.peak_bytes == after.peak_bytes
    assert check_placement(before, plan.offsets) == check_placement(after, back.offsets)


def test_cnn_with_attributes_round_trips(tmp_path):
    plan = order_plan(cnn_graph())
    back = read_plan(write_plan(plan, tmp_path / "cnn.onnx"))
    assert _op_fields(back.graph) == _op_fields(plan.graph)
    assert back.offsets == plan.offsets


@pytest.mark.parametrize("name", sorted(PLANS))
def test_emitted_file_is_valid_onnx_in_schedule_order(tmp_path, name):
    plan = PLANS[name]
    path = write_plan(plan, tmp_path / "scheduled.onnx")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert {(i.domain, i.version) for i in model.opset_import} >= {("", 17), (MEMSCHED_DOMAIN, 1)}
    events = [s for s in plan.schedule if s.kind != "free"]
    assert len(model.graph.node) == len(events)
    for step, node in zip(events, model.graph.node):
        if step.kind == "compute":
            assert node.name == step.target and node.domain == ""
        elif step.kind == "recompute":
            assert node.name.startswith(f"{step.target}.recompute") and node.domain == ""
        else:
            assert node.domain == MEMSCHED_DOMAIN
            assert node.op_type == {"swap_out": "SwapOut", "swap_in": "SwapIn"}[step.kind]
            assert onnx.helper.get_attribute_value(node.attribute[0]) == step.tier.encode()
    produced = [o for n in model.graph.node for o in n.output if o]
    assert len(produced) == len(set(produced)), "the emitted graph must stay SSA"


def test_recomputed_and_swapped_tensors_are_renamed_for_their_later_readers(tmp_path):
    model = plan_to_onnx(PLANS["swap"])
    nodes = {n.name: n for n in model.graph.node}
    assert list(nodes["a.swap_out1"].input) == ["a"] and list(nodes["a.swap_out1"].output) == ["a.host1"]
    assert list(nodes["a.swap_in1"].input) == ["a.host1"] and list(nodes["a.swap_in1"].output) == ["a.swap_in1"]
    assert list(nodes["relu.recompute1"].input) == ["a.swap_in1"]
    assert list(nodes["rT"].input) == ["r.recompute1"]          # backward reads the replay
    assert list(nodes["mask"].input)[0] == "a.swap_in1"
    assert list(nodes["b2.swap_in1"].input) == ["b2"]           # starts on the host: reads the initializer
    assert "b2" in {i.name for i in model.graph.initializer}
    doc = json.loads({p.key: p.value for p in model.metadata_props}[PLAN_KEY])
    assert doc["version"] == FORMAT_VERSION
    assert doc["renamed"]["r.recompute1"] == "r" and doc["clones"]["relu.recompute1"] == "relu"
    assert ["free", "h", None, "compute"] in doc["schedule"]
    assert [s for s in doc["schedule"] if s[0] == "swap_out"][0][3] == "d2h"


@pytest.mark.parametrize("hardware", [None, "v100-16gb", hardware_mod.load("a100-40gb"),
                                      dataclasses.replace(hardware_mod.load("v100-16gb"), name="my-box",
                                                          device_memory=123_456_789)])
def test_plan_without_offsets_and_its_hardware(tmp_path, hardware):
    plan = dataclasses.replace(Plan.initial(MLP), hardware=hardware)
    back = read_plan(write_plan(plan, tmp_path / "p.onnx"))
    expected = hardware_mod.load(hardware) if isinstance(hardware, str) else hardware    # a preset's name: the preset
    assert back.offsets is None and back.hardware == expected and back.schedule == plan.schedule


def test_hand_edited_early_free_is_caught_naming_the_tensor(tmp_path):
    path = write_plan(PLANS["order"], tmp_path / "scheduled.onnx")
    # free r right after its forward use (mm2), although rT reads it in backward
    edit_plan_metadata(path, lambda doc: doc["schedule"].insert(
        [s[1] for s in doc["schedule"]].index("mm2") + 1, ["free", "r", None, "compute"]), reseal=True)
    plan = read_plan(path)
    assert free("r") in plan.schedule
    with pytest.raises(ScheduleError, match="tensor 'r' is read by op 'rT'.*not resident"):
        validate(plan)


def test_not_a_plan(tmp_path):
    path = tmp_path / "plain.onnx"
    onnx.save_model(MLP.to_onnx(), str(path))
    with pytest.raises(UserError, match="holds no memsched plan"):
        read_plan(path)
    with pytest.raises(UserError, match="no such file"):
        read_plan(tmp_path / "missing.onnx")


@pytest.mark.parametrize("edit, message", [
    (lambda doc: doc.update(version=99), "format version 99"),
    (lambda doc: doc.pop("schedule"), "has no 'schedule'"),
    (lambda doc: doc["schedule"].__setitem__(slice(0, 2), doc["schedule"][1::-1]), "does not match its nodes"),
    (lambda doc: doc["schedule"].append(["compute", "ghost", None, "compute"]), "nodes"),
])
def test_broken_metadata_is_a_user_error(tmp_path, edit, message):
    path = write_plan(PLANS["swap"], tmp_path / "scheduled.onnx")
    edit_plan_metadata(path, edit, reseal=True)     # resealed: the checks behind the digest answer
    with pytest.raises(UserError, match=message):
        read_plan(path)


def test_metadata_that_is_not_json(tmp_path):
    model = plan_to_onnx(PLANS["order"])
    for prop in model.metadata_props:
        if prop.key == PLAN_KEY:
            prop.value = "{not json"
    path = tmp_path / "bad.onnx"
    onnx.save_model(model, str(path))
    with pytest.raises(UserError, match="not valid JSON"):
        read_plan(path)


def test_emitting_an_unknown_op_is_a_schedule_error():
    ghost = dataclasses.replace(PLANS["order"].schedule[0], target="ghost")
    plan = dataclasses.replace(PLANS["order"], schedule=PLANS["order"].schedule + [ghost])
    with pytest.raises(ScheduleError, match="'ghost'"):
        plan_to_onnx(plan)


@pytest.mark.parametrize("folder_named", [True, False])
def test_a_plan_of_a_model_with_external_weights_gets_its_own_data_file(tmp_path, monkeypatch, folder_named):
    """The weights are copied from the model's data file into the plan's own, chunk by chunk
    (never all in memory): the plan runs, and matches a plain run, with the model gone. A
    graph that names no folder reads its data from the working directory."""
    import os

    from memsched import models
    from memsched import onnx_utils
    from memsched.runtime import run_plan
    from memsched.passes.pipeline import compile as compile_plan

    monkeypatch.setattr(onnx_utils, "COPY_CHUNK", 1000)        # several chunks per weight
    source = tmp_path / "model"
    source.mkdir()
    onnx.save_model(models.build("mlp"), str(source / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.bin", size_threshold=64)
    plan = compile_plan(str(source / "m.onnx"), train=True, strategies="order,reuse", time_limit=3).plan
    if not folder_named:
        plan = dataclasses.replace(plan, graph=plan.graph.replace(base_dir=None))
        monkeypatch.chdir(source)
    out = write_plan(plan, tmp_path / "plan" / "s.onnx")
    names = sorted(os.listdir(out.parent))
    assert len(names) == 2 and names[0] == "s.onnx" and names[1].startswith("s.onnx.")
    stored = onnx.load(str(out), load_external_data=False)
    assert {e.value for t in stored.graph.initializer for e in t.external_data if e.key == "location"} == {names[1]}
    for name in os.listdir(source):
        os.remove(source / name)
    result = run_plan(read_plan(out), steps=2, check=True)
    assert result.check["passed"] and result.check["bit_identical"]


def test_a_plan_names_a_preset_never_a_path(tmp_path):
    """The plan's hardware entry is a profile or a preset's name: '/etc/passwd' there is
    refused without opening it (a plan could probe which paths exist), a preset name reads."""
    path = write_plan(order_plan(mlp_train_graph()), tmp_path / "plan.onnx")
    for name, spec in (("probe", "/etc/passwd"), ("missing", str(tmp_path / "nosuch.json"))):
        edit_plan_metadata(path, lambda doc, spec=spec: doc.__setitem__("hardware", spec))
        with pytest.raises(UserError, match="which is no preset"):
            read_plan(path)
    edit_plan_metadata(path, lambda doc: doc.__setitem__("hardware", "h200"))
    assert read_plan(path).hardware.name == hardware_mod.load("h200").name
    edit_plan_metadata(path, lambda doc: doc.pop("hardware"), reseal=True)
    with pytest.raises(UserError, match="is malformed: it has no field 'hardware'$"):
        read_plan(path)
