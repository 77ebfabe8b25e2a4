"""`memsched run PLAN --check --against MODEL`: the plan is compared with the step rebuilt from
the user's original model (its own weights, the plan's training options), not only with itself."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from memsched import onnx_utils
from memsched.emit import read_plan
from memsched.passes.rebuild import model_step
from memsched.errors import UserError

from tests.planbuild import edit_plan_metadata

from .conftest import run_cli
from .graphs import loop_model, mlp_model
from .test_reliability import one_line_error

TRAINING_KEY = "memsched.training"


def _compiled(tmp_path, model, *args: str):
    """`compile MODEL ARGS -o plan.onnx` (exit 0): the plan's path."""
    plan = tmp_path / "plan.onnx"
    compiled = run_cli("compile", model, *args, "-o", plan, "--time-limit", "10")
    assert compiled.returncode == 0, compiled.stderr
    return plan


def _against(plan, model, *extra: str) -> dict:
    """`run PLAN --check --against MODEL --json` exits 0: its check."""
    ran = run_cli("run", plan, "--check", "--against", model, "--json", *extra)
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)["check"]


def _edit(path, edit) -> None:
    model = onnx.load(str(path))
    edit(model)
    onnx.save_model(model, str(path))


def _scale(name: str, factor: float):
    def scale(model):
        init = next(i for i in model.graph.initializer if i.name == name)
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), name))
    return scale


def _edit_training(key: str, value):
    """An edit of the plan's `memsched.training` options (model metadata, outside the graph digest)."""
    def edit(model):
        prop = next(p for p in model.metadata_props if p.key == TRAINING_KEY)
        prop.value = json.dumps({**json.loads(prop.value), key: value})
    return edit


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The bundled mlp (batch 4) and its training-step plan (sgd, lr 0.01; fused updates)."""
    folder = tmp_path_factory.mktemp("mlp")
    model = folder / "mlp.onnx"
    exported = run_cli("models", "export", "mlp", "--batch", "4", "-o", model)
    assert exported.returncode == 0, exported.stderr
    return model, _compiled(folder, model, "--train")


def test_compiled_mlp_plan_passes_against_its_model(mlp, tmp_path):
    model, plan = mlp
    check = _against(plan, model, "--steps", "2")
    against = check["against"]
    assert against["passed"] and against["model"] == str(model) and against["steps"] == 2
    assert set(against["per_output"]) == set(read_plan(plan).graph.outputs)
    assert against["tolerance"] == 1e-4
    text = run_cli("run", plan, "--check", "--against", model)
    assert text.returncode == 0, text.stderr
    assert "rebuilt from" in text.stdout and "passed" in text.stdout
    assert json.loads(run_cli("run", plan, "--check", "--json").stdout)["check"]["against"] is None


def test_plan_against_a_model_with_other_weights_fails(mlp, tmp_path):
    model, plan = mlp
    other = tmp_path / "other.onnx"
    onnx_utils.save_model_atomic(onnx.load(str(model)), other)
    _edit(other, _scale("fc2.weight", 1.5))
    one_line_error(run_cli("run", plan, "--check", "--against", other), "check failed",
                   f"rebuilt from {other}", "tolerance 0.0001")


def test_plan_with_scaled_weights_passes_its_own_check_but_not_against_the_model(mlp, tmp_path):
    """Large tensors' values are outside the graph digest: only the model tells the scaling."""
    model, plan = mlp
    edited = tmp_path / "edited.onnx"
    onnx_utils.save_model_atomic(onnx.load(str(plan)), edited)
    _edit(edited, _scale("fc1.weight", 1.01))
    assert run_cli("run", edited, "--check").returncode == 0
    one_line_error(run_cli("run", edited, "--check", "--against", model), "check failed")


def test_plan_with_an_edited_op_and_a_new_digest_fails_against_the_model(mlp, tmp_path):
    """A plan with Relu turned into Sigmoid and its digest computed again agrees with itself;
    the model shows the edit."""
    model, plan = mlp
    edited = tmp_path / "edited.onnx"
    onnx_utils.save_model_atomic(onnx.load(str(plan)), edited)

    def sigmoid(model):
        next(n for n in model.graph.node if n.op_type == "Relu").op_type = "Sigmoid"
    _edit(edited, sigmoid)
    edit_plan_metadata(edited, lambda doc: None, reseal=True)
    assert run_cli("run", edited, "--check").returncode == 0
    one_line_error(run_cli("run", edited, "--check", "--against", model), "check failed", "output 'loss'")


@pytest.mark.parametrize("key, value, message", [
    ("lr", 0.05, "check failed"),                                # the update nodes use 0.01
    ("optimizer", "momentum", "which the plan lacks"),           # momentum buffers are outputs of its step
    ("loss", "mse", "input 'targets', which the plan lacks"),
])
def test_plan_whose_step_was_built_with_other_options_is_caught(mlp, tmp_path, key, value, message):
    model, plan = mlp
    edited = tmp_path / "edited.onnx"
    onnx_utils.save_model_atomic(onnx.load(str(plan)), edited)
    _edit(edited, _edit_training(key, value))
    one_line_error(run_cli("run", edited, "--check"), "no longer matches")     # the digest sees the edit
    edit_plan_metadata(edited, lambda doc: None, reseal=True)     # a deliberate tamperer reseals it
    assert run_cli("run", edited, "--check").returncode == 0      # the plan still agrees with itself
    one_line_error(run_cli("run", edited, "--check", "--against", model), message)


def test_a_plan_edited_only_in_its_metadata_is_refused(mlp, tmp_path):
    """A parameter dropped from the plan's outputs and from its trained list, the graph
    untouched: multi-step runs would never train it. The digest covers both."""
    model, plan = mlp
    edited = tmp_path / "edited.onnx"
    onnx_utils.save_model_atomic(onnx.load(str(plan)), edited)

    def untrain(model):
        prop = next(p for p in model.metadata_props if p.key == TRAINING_KEY)
        info = json.loads(prop.value)
        info["parameters"] = [name for name in info["parameters"] if name != "fc3.bias"]
        prop.value = json.dumps(info)
    _edit(edited, untrain)
    edit_plan_metadata(edited, lambda doc: doc["outputs"].remove("fc3.bias.updated"))
    for args in (["report", edited], ["run", edited, "--check"], ["run", edited, "--check", "--against", model]):
        one_line_error(run_cli(*args), "no longer matches")


def test_a_plan_is_no_witness_of_itself(mlp):
    _, plan = mlp
    one_line_error(run_cli("run", plan, "--check", "--against", plan), "is a memsched plan")


def test_malformed_training_options_are_one_line(mlp, tmp_path):
    model, plan = mlp
    edited = tmp_path / "edited.onnx"
    onnx_utils.save_model_atomic(onnx.load(str(plan)), edited)
    _edit(edited, _edit_training("lr", "fast"))
    edit_plan_metadata(edited, lambda doc: None, reseal=True)
    one_line_error(run_cli("run", edited, "--check", "--against", model), "memsched.training", "'lr'")


def test_frozen_parameters_are_frozen_again(mlp, tmp_path):
    model, _ = mlp
    plan = _compiled(tmp_path, model, "--train", "--freeze", "fc1.*", "--optimizer", "adam", "--lr", "0.001")
    check = _against(plan, model)
    assert check["against"]["passed"]
    assert not any(name.startswith("fc1.") for name in check["against"]["per_output"])


def test_frozen_before_control_flow_is_frozen_again(tmp_path):
    """With every parameter trained the step cannot be built (a gradient through the Loop); the
    rebuild freezes what the plan does not train."""
    model = onnx_utils.save_model_atomic(loop_model(), tmp_path / "loop.onnx")
    plan = _compiled(tmp_path, model, "--train", "--freeze", "W")
    assert set(_against(plan, model)["against"]["per_output"]) == {"loss", "W2.updated"}


def test_forward_plan_with_a_symbolic_batch_passes_and_other_weights_fail(tmp_path):
    model = tmp_path / "mlp.onnx"
    onnx_utils.save_model_atomic(mlp_model(batch="N", width=8), model)
    plan = _compiled(tmp_path, model, "--dim", "N=3")
    check = _against(plan, model)
    assert check["against"]["passed"] and list(check["against"]["per_output"]) == ["y"]
    _edit(model, _scale("W2", 2.0))
    one_line_error(run_cli("run", plan, "--check", "--against", model), "check failed", "output 'y'")


def test_model_with_other_inputs_or_shapes_is_one_line(mlp, tmp_path):
    _, plan = mlp
    narrow = tmp_path / "narrow.onnx"
    onnx_utils.save_model_atomic(mlp_model(batch=4), narrow)
    one_line_error(run_cli("run", plan, "--check", "--against", narrow), "has input 'x', which the plan does not")
    forward = _compiled(tmp_path, narrow)
    wide = tmp_path / "wide.onnx"
    onnx_utils.save_model_atomic(mlp_model(batch=4, width=8), wide)
    assert _against(forward, narrow)["against"]["passed"]
    with pytest.raises(UserError, match="has input 'x' of shape"):
        model_step(read_plan(forward), onnx_utils.save_model_atomic(mlp_model(batch=5), tmp_path / "b5.onnx"))
    one_line_error(run_cli("run", forward, "--check", "--against", wide), "check failed")


def test_against_needs_check_and_an_existing_model(mlp, tmp_path):
    model, plan = mlp
    one_line_error(run_cli("run", plan, "--against", model), "give --check")
    one_line_error(run_cli("run", plan, "--check", "--against", tmp_path / "missing.onnx"), "no such file")


def test_a_step_that_diverges_never_passes_its_check(tmp_path):
    """Two runs that agree on NaN agree on nothing: a step whose outputs are not finite fails."""
    import numpy as np

    from memsched.runtime.check import check_summary, compare_outputs

    same = {"w.updated": np.array([np.nan, 1.0], np.float32), "loss": np.array(np.inf, np.float32)}
    summary = check_summary([compare_outputs(same, {k: v.copy() for k, v in same.items()})], exact=True)
    assert summary["bit_identical"] and not summary["passed"] and summary["non_finite"] == ["loss", "w.updated"]
    fine = {"w.updated": np.array([0.5, 1.0], np.float32)}
    assert check_summary([compare_outputs(fine, dict(fine))], exact=True)["passed"]
