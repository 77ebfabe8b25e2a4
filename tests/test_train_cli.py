"""`memsched train` as a user runs it: digits written by `memsched models digits`, the bundled
MLP compiled at a budget, trained, checkpointed, stopped with Ctrl-C, resumed, and its saved
model run by a plain ONNX Runtime session; every bad input one line and exit 1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from .conftest import ROOT, run_cli
from .test_reliability import one_line_error

pytest.importorskip("sklearn")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    assert run_cli("models", "digits", "-o", folder).returncode == 0
    assert run_cli("models", "export", "mlp", "-o", folder / "mlp.onnx", "--batch", "64", "--size", "8").returncode == 0
    compiled = run_cli("compile", folder / "mlp.onnx", "--train", "--optimizer", "momentum", "--lr", "0.05",
                       "--budget", "60%", "--time-limit", "10", "-o", folder / "plan.onnx")
    assert compiled.returncode == 0, compiled.stderr
    return folder


def json_lines(result) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return lines[:-1], lines[-1]["summary"]


def test_train_writes_a_model_plain_onnx_runtime_runs(setup, tmp_path):
    import onnxruntime as ort

    model, checkpoint = tmp_path / "trained.onnx", tmp_path / "ck.safetensors"
    done = run_cli("train", setup / "plan.onnx", "--data", setup / "train.npz", "--val", setup / "test.npz",
                   "--epochs", "15", "--shuffle", "--lr-schedule", "cosine", "--save", model, "--checkpoint",
                   checkpoint, "--json")
    assert done.returncode == 0, done.stderr
    steps, summary = json_lines(done)
    assert len(steps) == summary["steps"] == 15 * (1437 // 64)
    assert {"step", "epoch", "loss", "lr", "seconds"} <= set(steps[0])
    assert steps[0]["lr"] == 0.05 and steps[-1]["lr"] < 0.001            # cosine down to 0
    assert steps[-1]["loss"] < 0.1 < steps[0]["loss"]
    assert len(summary["validation"]) == 15 and summary["validation"][-1]["val_accuracy"] >= 0.97
    assert set(summary["written"]) == {"checkpoint", "model", "plot"}
    assert 'xmlns="http://www.w3.org/2000/svg"' in (tmp_path / "ck.safetensors.loss.svg").read_text()
    test = np.load(setup / "test.npz")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": test["input"]})[0]          # the whole test set: the batch is symbolic
    accuracy = float((logits.argmax(1) == test["labels"]).mean())
    assert accuracy == pytest.approx(summary["validation"][-1]["val_accuracy"]) and accuracy >= 0.97


def test_a_resumed_run_gives_the_losses_of_an_uninterrupted_one(setup, tmp_path):
    common = ("--data", setup / "train.npz", "--shuffle", "--seed", "3", "--json")
    whole = run_cli("train", setup / "plan.onnx", *common, "--epochs", "2")
    first = run_cli("train", setup / "plan.onnx", *common, "--epochs", "1", "--checkpoint", tmp_path / "ck.st")
    rest = run_cli("train", setup / "plan.onnx", *common, "--epochs", "2", "--resume", tmp_path / "ck.st")
    assert whole.returncode == first.returncode == rest.returncode == 0, rest.stderr
    losses = [s["loss"] for s in json_lines(first)[0] + json_lines(rest)[0]]
    assert losses == [s["loss"] for s in json_lines(whole)[0]]
    assert json_lines(rest)[0][0]["step"] == 1437 // 64            # the step count goes on
    other = run_cli("train", setup / "plan.onnx", "--data", setup / "train.npz", "--epochs", "2", "--resume",
                    tmp_path / "ck.st")
    one_line_error(other, "written by a run with shuffle True and seed 3")
    done = run_cli("train", setup / "plan.onnx", *common, "--epochs", "2", "--resume", tmp_path / "ck.st")
    again = run_cli("train", setup / "plan.onnx", "--data", setup / "train.npz", "--shuffle", "--seed", "3",
                    "--epochs", "1", "--resume", tmp_path / "ck.st")
    assert done.returncode == again.returncode == 0 and "nothing to train" in again.stdout


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(setup, tmp_path):
    checkpoint = tmp_path / "ck.safetensors"
    process = subprocess.Popen([sys.executable, "-m", "memsched", "train", str(setup / "plan.onnx"), "--data",
                                str(setup / "train.npz"), "--epochs", "100000", "--checkpoint", str(checkpoint),
                                "--save", str(tmp_path / "model.onnx"), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for _ in range(3):                    # a few steps run first
        assert process.stdout.readline()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["stopped"] and summary["written"]["checkpoint"] == str(checkpoint)
    assert "model" not in summary["written"] and not (tmp_path / "model.onnx").exists()
    resumed = run_cli("train", setup / "plan.onnx", "--data", setup / "train.npz", "--epochs", "1", "--resume",
                      checkpoint, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]          # no temporaries left


def test_every_bad_input_is_one_line(setup, tmp_path):
    np.savez(tmp_path / "nolabels.npz", input=np.zeros((64, 1, 8, 8), np.float32))
    np.savez(tmp_path / "shape.npz", input=np.zeros((64, 1, 9, 9), np.float32), labels=np.zeros(64, np.int64))
    np.savez(tmp_path / "counts.npz", input=np.zeros((64, 1, 8, 8), np.float32), labels=np.zeros(60, np.int64))
    np.savez(tmp_path / "dtype.npz", input=np.zeros((64, 1, 8, 8), np.complex64), labels=np.zeros(64, np.int64))
    np.savez(tmp_path / "few.npz", input=np.zeros((10, 1, 8, 8), np.float32), labels=np.zeros(10, np.int64))
    (tmp_path / "junk.npz").write_text("not a zip")
    np.save(tmp_path / "one.npy", np.zeros((64, 1, 8, 8), np.float32))
    os.replace(tmp_path / "one.npy", tmp_path / "one.npz")      # one array, named as an archive
    np.savez(tmp_path / "labels.npz", input=np.zeros((64, 1, 8, 8), np.float32), labels=np.arange(64) % 11)
    plan, data = setup / "plan.onnx", setup / "train.npz"
    cases = [
        (("--data", tmp_path / "missing.npz"), "no such data file"),
        (("--data", tmp_path / "junk.npz"), "is not a readable .npz file"),
        (("--data", tmp_path / "one.npz"), "holds one array (a .npy file)"),
        (("--data", tmp_path / "nolabels.npz"), "has no array 'labels'"),
        (("--data", tmp_path / "shape.npz"), "holds samples of shape (1, 9, 9)"),
        (("--data", tmp_path / "counts.npz"), "different numbers of samples"),
        (("--data", tmp_path / "dtype.npz"), "'input' is complex64; the step needs float32"),
        (("--data", tmp_path / "few.npz"), "make no full batch of 64"),
        (("--data", data, "--lr-schedule", "sawtooth"), "unknown learning-rate schedule 'sawtooth'"),
        (("--data", data, "--epochs", "0"), "--epochs must be at least 1"),
        (("--data", data, "--lr", "-1"), "--lr must be a positive number"),
        (("--data", data, "--resume", tmp_path / "missing.st"), "no such checkpoint"),
        (("--data", data, "--resume", data), "not a readable safetensors file"),
        (("--data", data, "--init", tmp_path / "missing.onnx"), "no such weights file"),
        (("--data", data, "--shuffle", "--seed", "-1"), "--seed must be 0 or more"),
        (("--data", tmp_path / "labels.npz"), "the labels must lie in 0..9"),
    ]
    for args, message in cases:
        one_line_error(run_cli("train", plan, *args), message)
    one_line_error(run_cli("train", setup / "mlp.onnx", "--data", data), "holds no memsched plan")
    padded = run_cli("train", plan, "--data", tmp_path / "few.npz", "--last", "pad", "--json")
    assert padded.returncode == 0 and json_lines(padded)[1]["steps"] == 1


@pytest.mark.slow
def test_two_ranks_train_as_one_on_the_whole_batch(setup, tmp_path):
    """`--workers 2` on a plan compiled with --data-parallel 2: each rank takes its own half of
    every batch (DistributedSampler's split), the averaged gradients are the whole batch's, so
    the trained weights are one process's on the whole batches, within float rounding."""
    import onnx
    from onnx import numpy_helper

    pytest.importorskip("torch")
    compiled = run_cli("compile", setup / "mlp.onnx", "--train", "--optimizer", "momentum", "--lr", "0.05",
                       "--data-parallel", "2", "--time-limit", "10", "-o", tmp_path / "dp.onnx")
    assert compiled.returncode == 0, compiled.stderr
    common = ("--data", setup / "train.npz", "--epochs", "2", "--shuffle", "--json")
    two = run_cli("train", tmp_path / "dp.onnx", *common, "--workers", "2", "--save", tmp_path / "two.onnx")
    one = run_cli("train", setup / "plan.onnx", *common, "--save", tmp_path / "one.onnx")
    assert two.returncode == one.returncode == 0, two.stderr
    steps, summary = json_lines(two)
    assert summary["workers"] == 2 and len(steps) == summary["steps"] == 2 * (1437 // 64)
    weights = [{i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / f"{n}.onnx").graph.initializer}
               for n in ("two", "one")]
    assert set(weights[0]) == set(weights[1])
    for name, value in weights[1].items():
        assert np.abs(weights[0][name] - value).max() <= 1e-4 * max(1.0, np.abs(value).max()), name
    one_line_error(run_cli("train", setup / "plan.onnx", "--data", setup / "train.npz", "--workers", "2"),
                   "compiled for one worker")
