"""A checkpoint's metadata and an --init weights file are checked as they are read: a real
checkpoint of the bundled MLP (sgd, 22 steps of digits) with one metadata field edited at a
time is refused in one line that names the file and the field, with nothing loaded; weights
for --init must be every parameter and buffer of the step and nothing else, as PyTorch's
`load_state_dict(strict=True)`. The untampered checkpoint and weights still load, so every
refusal here is the edit's."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from memsched.emit import read_plan
from memsched.errors import UserError
from memsched.runtime import Trainer
from memsched.runtime.train_loop import FitOptions, fit

from .conftest import run_cli
from .test_reliability import one_line_error

pytest.importorskip("sklearn")
safetensors = pytest.importorskip("safetensors")

STEPS = 1437 // 64                  # one epoch of digits' training split at the plan's batch of 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A folder with digits (train.npz), the MLP's sgd plan (plan.onnx), the MLP (mlp.onnx) and
    the checkpoint (ck.safetensors) of one epoch, written by `memsched train`."""
    folder = tmp_path_factory.mktemp("checks")
    assert run_cli("models", "digits", "-o", folder).returncode == 0
    assert run_cli("models", "export", "mlp", "-o", folder / "mlp.onnx", "--batch", "64", "--size", "8").returncode == 0
    compiled = run_cli("compile", folder / "mlp.onnx", "--train", "--optimizer", "sgd", "--time-limit", "10",
                       "-o", folder / "plan.onnx")
    assert compiled.returncode == 0, compiled.stderr
    trained = run_cli("train", folder / "plan.onnx", "--data", folder / "train.npz", "--threads", "1",
                      "--checkpoint", folder / "ck.safetensors")
    assert trained.returncode == 0, trained.stderr
    return folder


@pytest.fixture(scope="module")
def plan(setup):
    return read_plan(setup / "plan.onnx")


@pytest.fixture(scope="module")
def train(setup):
    return dict(np.load(setup / "train.npz"))


def read(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata())


def tampered(setup, folder, key, value=None, tensors=None):
    """A copy of the checkpoint with metadata field `key` set to `value` (removed for None) or
    with `tensors` in place of its own."""
    from safetensors.numpy import save_file

    state, metadata = read(setup / "ck.safetensors")
    if value is None:
        metadata.pop(key, None)
    else:
        metadata[key] = value
    path = folder / "bad.safetensors"
    save_file(state if tensors is None else tensors, str(path), metadata=metadata)
    return path


def refused(call, *fragments) -> str:
    """`call()` raises a one-line UserError holding every fragment; its message."""
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_checkpoint_holds_the_fields_checked_here(setup):
    """The fields tampered below are the ones `memsched train` writes (a new one is tested too)."""
    metadata = read(setup / "ck.safetensors")[1]
    assert set(metadata) == {"format", "step", "optimizer", "hyperparameters", "extra.epoch", "extra.batch",
                             "extra.shuffle", "extra.seed", "extra.last", "extra.world"}
    assert metadata["step"] == str(STEPS) and json.loads(metadata["hyperparameters"]) == {"lr": 0.01}


def test_an_untampered_checkpoint_resumes(setup, plan, train):
    with Trainer(plan, threads=1) as trainer:
        assert trainer.load_checkpoint(setup / "ck.safetensors")["epoch"] == "1"
        assert trainer.step_count == STEPS and trainer.hyperparameters == {"lr": 0.01}
    with Trainer(plan, threads=1) as trainer:
        done = fit(trainer, train, FitOptions(epochs=2, resume=str(setup / "ck.safetensors")))
        assert (done.first_step, done.steps, trainer.step_count) == (STEPS, STEPS, 2 * STEPS)


BAD_FIELDS = [
    ("step", "-1", "holds step '-1'; a step count is a whole number >= 0"),
    ("step", "{garbage", "holds step '{garbage'; a step count"),
    ("step", "1.5", "holds step '1.5'"),
    ("step", "9" * 30, "a whole number from 0 to 9223372036854775807"),
    ("step", None, "has no 'step' in its metadata"),
    ("extra.epoch", "-1", "holds extra.epoch '-1'; an epoch count is a whole number >= 0"),
    ("extra.epoch", "{garbage", "holds extra.epoch '{garbage'"),
    ("extra.batch", "-1", "holds extra.batch '-1'; a batch number is a whole number >= 0"),
    ("extra.batch", "{garbage", "holds extra.batch '{garbage'"),
    ("extra.batch", str(STEPS), f"holds extra.batch '{STEPS}'; an epoch of this data has {STEPS} batches"),
    ("extra.seed", "x", "holds extra.seed 'x'; a seed is a whole number >= 0"),
    ("extra.world", "0", "holds extra.world '0'; a worker count is a whole number >= 1"),
    ("extra.shuffle", "maybe", "holds extra.shuffle 'maybe'; it is one of True, False"),
    ("extra.last", "x\ny", "holds extra.last 'x\\ny'; it is one of drop, pad"),
    ("hyperparameters", "{garbage", "holds hyperparameters '{garbage'; they are a JSON object"),
    ("hyperparameters", "-1", "holds hyperparameters '-1'"),
    ("hyperparameters", '{"lr": -1}', "finite numbers >= 0"),
    ("hyperparameters", '{"lr": NaN}', "finite numbers >= 0"),
    ("hyperparameters", '{"lr": true}', "finite numbers >= 0"),
    ("hyperparameters", '{"LR": 0.01}', "holds hyperparameters 'LR'; this step's are 'lr'"),
    ("hyperparameters", None, "has no 'hyperparameters' in its metadata"),
    ("optimizer", "x\ny", "holds optimizer 'x\\ny'; an optimizer is one of"),
    ("optimizer", "adam", "a checkpoint of a step with optimizer adam; this plan's optimizer is sgd"),
    ("format", "memsched-checkpoint-0", "is not a memsched checkpoint"),
]


@pytest.mark.parametrize("key, value, message", BAD_FIELDS, ids=[f"{k}={v!r}" for k, v, _ in BAD_FIELDS])
def test_each_bad_metadata_field_is_one_line_and_nothing_is_loaded(setup, plan, train, tmp_path, key, value,
                                                                   message):
    path = tampered(setup, tmp_path, key, value)
    with Trainer(plan, threads=1) as trainer:
        before = trainer.state_dict()
        refused(lambda: fit(trainer, train, FitOptions(epochs=3, resume=str(path))), str(path), message)
        assert trainer.step_count == 0 and trainer.hyperparameters == {"lr": 0.01}      # nothing was loaded
        assert all(np.array_equal(value, before[name]) for name, value in trainer.state_dict().items())
        if not key.startswith("extra."):                                   # the Trainer's own fields
            refused(lambda: trainer.load_checkpoint(path), str(path), message)


def test_a_checkpoint_without_a_tensor_of_the_step_is_refused(setup, plan, tmp_path):
    state, _ = read(setup / "ck.safetensors")
    del state["fc2.bias"]
    path = tampered(setup, tmp_path, "step", str(STEPS), tensors=state)
    with Trainer(plan, threads=1) as trainer:
        refused(lambda: trainer.load_checkpoint(path), "has no 'fc2.bias': it is a checkpoint of another model")
        state["a\nb"] = np.zeros(2, np.float32)
        state["fc2.bias"] = read(setup / "ck.safetensors")[0]["fc2.bias"]
        path = tampered(setup, tmp_path, "step", str(STEPS), tensors=state)
        refused(lambda: trainer.load_checkpoint(path), "'a\\nb' is no parameter")


@pytest.mark.parametrize("key, value, message", [
    ("extra.epoch", "-1", "holds extra.epoch '-1'; an epoch count is a whole number >= 0"),
    ("step", "-1", "holds step '-1'; a step count is a whole number >= 0"),
    ("hyperparameters", "{garbage", "holds hyperparameters '{garbage'"),
    ("extra.batch", "-1", "holds extra.batch '-1'; a batch number"),
])
def test_train_resume_with_a_bad_field_exits_1_in_one_line(setup, tmp_path, key, value, message):
    path = tampered(setup, tmp_path, key, value)
    done = run_cli("train", setup / "plan.onnx", "--data", setup / "train.npz", "--threads", "1", "--epochs", "3",
                   "--resume", path)
    one_line_error(done, str(path), message)


def weights_file(setup, folder, drop=(), add=()):
    """The checkpoint's tensors less `drop` and with zeros under the names in `add`, as a plain
    safetensors file."""
    from safetensors.numpy import save_file

    state = {name: value for name, value in read(setup / "ck.safetensors")[0].items() if name not in drop}
    state.update({name: np.zeros(3, np.float32) for name in add})
    path = folder / "weights.safetensors"
    save_file(state, str(path))
    return path


def test_init_refuses_weights_that_lack_a_parameter_or_hold_another_tensor(setup, tmp_path):
    common = ("--data", setup / "train.npz", "--threads", "1")
    missing = weights_file(setup, tmp_path, drop=("fc1.weight",))
    one_line_error(run_cli("train", setup / "plan.onnx", *common, "--init", missing), str(missing),
                   "missing 1 of the step's 6 parameters and buffers: 'fc1.weight'")
    extra = weights_file(setup, tmp_path, add=("<script>x</script>", "a\nb"))
    one_line_error(run_cli("train", setup / "plan.onnx", *common, "--init", extra),
                   "2 tensors the step does not have: '<script>x</script>', 'a\\nb'")
    for whole in (setup / "ck.safetensors", setup / "mlp.onnx"):        # a checkpoint's states are left out
        done = run_cli("train", setup / "plan.onnx", *common, "--init", whole)
        assert done.returncode == 0, done.stderr


def test_load_weights_is_strict_unless_asked_not_to_be(setup, plan):
    state = read(setup / "ck.safetensors")[0]
    with Trainer(plan, threads=1) as trainer:
        names = [f"p{i}" for i in range(5)]
        message = refused(lambda: trainer.load_weights({**state, **{n: np.zeros(1) for n in names}}),
                          "the given weights are not this step's",
                          "5 tensors the step does not have: 'p0', 'p1', 'p2' and 2 more")
        assert "missing" not in message
        subset = {name: value for name, value in state.items() if name.startswith("fc3.")}
        refused(lambda: trainer.load_weights(subset), "missing 4 of the step's 6 parameters and buffers")
        assert trainer.state_dict()["fc3.bias"].tolist() != state["fc3.bias"].tolist()     # nothing loaded
        assert trainer.load_weights(subset, strict=False) == ["fc3.bias", "fc3.weight"]
        assert np.array_equal(trainer.state_dict()["fc3.bias"], state["fc3.bias"])
        assert trainer.load_weights({**state, "fc1.weight.exp_avg": state["fc1.weight"]}) == sorted(state)


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_nothing(plan, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error, the OS's reason inside: it becomes
    'cannot write PATH: No space left on device', and no temporary is left."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(UserError, match=r"^cannot write .*ck\.safetensors: No space left on device$"):
        Trainer(plan, threads=1).save_checkpoint(tmp_path / "ck.safetensors")
    assert os.listdir(tmp_path) == []


def test_the_trained_model_and_its_loss_curve_land_together(plan, train, tmp_path, monkeypatch):
    """Where the loss curve or the trained model cannot be written (a full disk), neither is
    put in place and no temporary is left; otherwise both are written."""
    from memsched import onnx_utils
    from memsched.runtime import train_loop

    finish = onnx_utils.finish_mode

    def full_for_curves(tmp):
        if "loss.svg" in str(tmp):
            raise OSError(28, "No space left on device")
        finish(tmp)

    def full_disk(step, state, path):
        raise onnx_utils.write_error(path, OSError(28, "No space left on device"))

    options = FitOptions(save=str(tmp_path / "model.onnx"), plot=str(tmp_path / "loss.svg"))
    for target, name, fake in ((onnx_utils, "finish_mode", full_for_curves),
                               (train_loop, "export_inference", full_disk)):
        monkeypatch.setattr(target, name, fake)
        with Trainer(plan, threads=1) as trainer, pytest.raises(UserError, match="No space left on device"):
            fit(trainer, train, options)
        assert os.listdir(tmp_path) == []
        monkeypatch.undo()
    with Trainer(plan, threads=1) as trainer:
        done = fit(trainer, train, options)
    assert set(done.written) == {"model", "plot"} and sorted(os.listdir(tmp_path)) == ["loss.svg", "model.onnx"]
