"""Guards found by the bad-input and fault audit: outputs, external data, rich markup, validation, plans."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memsched.cli.options import attach_negative_values, positive_seconds
from memsched import frontend, hardware, onnx_utils
from memsched.cost import CostTable
from memsched.emit import read_plan, write_plan
from memsched.errors import UserError
from memsched.outputs import TEMP_TAG, check_outputs, remove_stale_temporaries
from memsched.units import parse_bytes, parse_percent
from tests.planbuild import edit_plan_metadata, mlp_train_graph, swap_plan

from .conftest import ROOT, run_cli
from .graphs import if_capture_model, loop_model, mlp_model, scan_model


def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The process failed with exit 1 and one `memsched: error:` line holding every fragment."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsched: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def temporaries(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if TEMP_TAG in n)


# ---- 4, 11: outputs are checked before work ----------------------------------------------------------------
def test_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path):
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    before = model.read_bytes()
    one_line_error(run_cli("train-graph", model, "-o", model), "is the input")
    one_line_error(run_cli("profile", model, "-o", tmp_path / "." / "m.onnx"), "is the input")
    os.link(model, tmp_path / "hard.onnx")          # a hard link is the same file under another name
    one_line_error(run_cli("train-graph", model, "-o", tmp_path / "hard.onnx"), "is the input")
    assert model.read_bytes() == before


def test_an_output_naming_the_inputs_external_data_is_refused_and_the_data_kept(tmp_path):
    """The weights of a model kept in an external-data file are an input too: `-o weights.bin`
    would leave the model truncated, or with the bytes of the step as its weights."""
    import onnx

    model = tmp_path / "m.onnx"
    onnx.save(mlp_model(), model, save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    data = tmp_path / "weights.bin"
    before = data.read_bytes()
    for args in (("compile", model, "--train", "-o", data), ("compile", model, "--train", "--report", data),
                 ("profile", model, "-o", data), ("train-graph", model, "-o", data)):
        one_line_error(run_cli(*args), "is the external data of the input", "weights.bin")
    assert data.read_bytes() == before
    assert run_cli("inspect", model).returncode == 0


def test_fifo_and_directory_outputs_are_refused_and_left_as_they_are(tmp_path):
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_error(run_cli("train-graph", model, "-o", fifo), "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    one_line_error(run_cli("models", "export", "mlp", "-o", tmp_path), "is a directory")
    with pytest.raises(UserError, match="not a regular file"):
        onnx_utils.write_text_atomic(fifo, "x")        # the writers refuse it too, whoever calls them
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_bad_output_is_found_before_the_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # the model does not exist: the output is checked first, so the error names the output
    one_line_error(run_cli("train-graph", tmp_path / "missing.onnx", "-o", blocker / "out.onnx"),
                   "cannot write -o", "Not a directory")
    one_line_error(run_cli("tune-batch", "mlp", "--plot", tmp_path, "--max-batch", "2"), "--plot", "is a directory")
    one_line_error(run_cli("report", tmp_path / "missing.onnx", "--html", tmp_path), "--html", "is a directory")


def test_check_outputs_names_the_option_and_refuses_two_options_on_one_path(tmp_path):
    check_outputs({"-o": tmp_path / "a.onnx", "--report": None}, [tmp_path / "missing.onnx"])
    with pytest.raises(UserError, match="-o and --report both name"):
        check_outputs({"-o": tmp_path / "a", "--report": tmp_path / "." / "a"})


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_honour_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        text = onnx_utils.write_text_atomic(tmp_path / "t.json", "{}")
        model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(text).st_mode) == mode
    assert stat.S_IMODE(os.stat(model).st_mode) == mode


# ---- 5: the external-data save path ------------------------------------------------------------------------
@pytest.mark.parametrize("from_its_folder", [False, True])
def test_big_model_path_pairs_each_model_with_its_own_data(tmp_path, monkeypatch, from_its_folder):
    """Also run from the output's own folder, where onnx looks for an existing data file."""
    monkeypatch.setattr(onnx_utils, "INLINE_BYTES", 16)      # take the data-file path with a small model
    if from_its_folder:
        monkeypatch.chdir(tmp_path)
    path = tmp_path / "m.onnx"
    for width in (512, 1024, 8, 2048):        # width 8: every tensor under the threshold, no data file
        onnx_utils.save_model_atomic(mlp_model(width=width), path)
        data = [n for n in os.listdir(tmp_path) if n.endswith(".data")]
        assert len(data) == (width > 8) and not temporaries(tmp_path)   # the replaced model's data file is gone
    stored = onnx.load(str(path), load_external_data=False).graph.initializer[0]
    assert stored.data_location == TensorProto.EXTERNAL and stored.external_data[0].value == data[0]
    loaded = onnx.load(str(path))
    assert numpy_helper.to_array(loaded.graph.initializer[0]).shape == (4, 2048)


def test_concurrent_big_writes_leave_a_model_that_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_utils, "INLINE_BYTES", 16)
    path = tmp_path / "m.onnx"
    errors = []

    def write(width):
        try:
            for _ in range(5):
                onnx_utils.save_model_atomic(mlp_model(width=width), path)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)
    threads = [threading.Thread(target=write, args=(w,)) for w in (512, 1024, 2048)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    loaded = onnx.load(str(path))        # loads its external data: the file it names exists, whole
    w1 = numpy_helper.to_array(loaded.graph.initializer[0])
    assert w1.shape[1] in (512, 1024, 2048)
    assert np.array_equal(w1, numpy_helper.to_array(mlp_model(width=w1.shape[1]).graph.initializer[0]))
    assert not temporaries(tmp_path)


# ---- 13: signals and stale temporaries ---------------------------------------------------------------------
SLOW_EXPORT = """
import sys, time
sys.path.insert(0, {root!r})
import onnx
from memsched import cli
def slow(model, path, *args, **kwargs):
    open(path, "wb").write(b"x" * 1000)
    print("writing", flush=True)
    for _ in range(1200):     # a write runs Python between its chunks: a signal that another
        time.sleep(0.05)      # thread received is handled there, as it is here between sleeps
onnx.save_model = slow
sys.exit(cli.main(["models", "export", "mlp", "-o", {out!r}]))
"""


def _start_slow_export(out) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_EXPORT.format(root=str(ROOT), out=str(out))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_sigterm_while_writing_removes_the_temporary(tmp_path):
    proc = _start_slow_export(tmp_path / "m.onnx")
    assert temporaries(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and err.strip() == "memsched: terminated"
    assert os.listdir(tmp_path) == []


def test_sigkill_leftovers_are_removed_by_the_next_write(tmp_path):
    proc = _start_slow_export(tmp_path / "m.onnx")
    proc.kill()
    proc.communicate(timeout=30)
    left = temporaries(tmp_path)
    assert len(left) == 1 and f"-{proc.pid}-" in left[0]
    onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    assert temporaries(tmp_path) == [] and os.listdir(tmp_path) == ["m.onnx"]


def test_only_stale_temporaries_are_removed(tmp_path):
    live_recent = tmp_path / f".m.onnx{TEMP_TAG}{os.getpid()}-a.tmp"
    live_old = tmp_path / f".m.onnx{TEMP_TAG}{os.getpid()}-b.tmp"
    other_output = tmp_path / f".n.onnx{TEMP_TAG}99999999-c.tmp"
    for p in (live_recent, live_old, other_output):
        p.write_text("")
    os.utime(live_old, (time.time() - 7200, time.time() - 7200))
    removed = remove_stale_temporaries(tmp_path / "m.onnx")
    assert removed == [live_old]
    assert live_recent.exists() and other_output.exists()


# ---- 8: names are not markup -------------------------------------------------------------------------------
def _markup_model():
    model = mlp_model()
    model.graph.name = "[/]"
    for node in model.graph.node:
        node.name = "[link=http://example.com]click[/link]" if node.name == "fc1" else node.name
        node.output[:] = ["[bold]h[/bold]" if t == "h" else t for t in node.output]
        node.input[:] = ["[bold]h[/bold]" if t == "h" else t for t in node.input]
    return model


def test_names_with_markup_print_literally(tmp_path):
    folder = tmp_path / "[bold]dir"
    model = onnx_utils.save_model_atomic(_markup_model(), folder / "m.onnx")
    result = run_cli("inspect", model)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[/]:") and "[bold]h[/bold]" in result.stdout
    result = run_cli("profile", model, "-o", folder / "c.json", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    assert "[/]:" in result.stdout and "[link=http://example.com]click[/link]" in result.stdout
    assert f"written to {folder / 'c.json'}" in result.stdout.replace("\n", "")
    assert "\x1b]8;" not in result.stdout        # no terminal hyperlink


# ---- 9: external data stays in the model's folder ----------------------------------------------------------
def _external_model(folder, location: str):
    model = mlp_model()
    init = model.graph.initializer[0]
    nbytes = len(init.raw_data)
    init.ClearField("raw_data")
    init.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(nbytes))):
        init.external_data.add(key=key, value=value)
    folder.mkdir(exist_ok=True)
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("location, message", [
    ("../secret.bin", "outside the model's folder"),
    ("sub/../../secret.bin", "outside the model's folder"),
    ("{abs}", "an absolute path"),
    ("{abs_missing}", "an absolute path"),
    ("link.bin", "through a symlink"),
])
@pytest.mark.parametrize("command", ["inspect", "simulate", "train-graph", "tune-batch"])
def test_external_data_outside_the_folder_is_refused_before_a_stat(tmp_path, location, message, command):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 4096)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "link.bin").symlink_to(secret)
    path = _external_model(folder, location.format(abs=secret, abs_missing=tmp_path / "nothing.bin"))
    extra = {"train-graph": ["-o", tmp_path / "t.onnx"], "tune-batch": ["--max-batch", "2"]}.get(command, [])
    line = one_line_error(run_cli(command, path, *extra), message)
    assert "4096" not in line and "not found" not in line and "truncated" not in line


def test_external_data_in_a_subfolder_is_fine(tmp_path):
    folder = tmp_path / "model"
    path = _external_model(folder, "weights/w1.bin")
    (folder / "weights").mkdir()
    (folder / "weights" / "w1.bin").write_bytes(mlp_model().graph.initializer[0].raw_data)
    assert frontend.load(path).tensors["W1"].shape == (4, 4)


# ---- 10: IR < 4 models -------------------------------------------------------------------------------------
def test_ir3_model_with_initializers_as_inputs_compiles_and_runs(tmp_path):
    model = mlp_model()
    model.ir_version = 3
    model.opset_import[0].version = 8
    model.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                             for i in model.graph.initializer)
    path = tmp_path / "ir3.onnx"
    onnx.save(model, str(path))
    graph = frontend.load(path)
    assert graph.inputs == ["x"] and graph.tensors["W1"].kind == "parameter"
    assert run_cli("compile", path, "-o", tmp_path / "s.onnx").returncode == 0
    result = run_cli("run", tmp_path / "s.onnx", "--check")
    assert result.returncode == 0, result.stderr
    assert "passed" in result.stdout


# ---- 12: validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["0", "0.5", "0GiB", "2000000EiB", "99999999999TiB"])
def test_sizes_must_be_at_least_a_byte_and_at_most_an_exbibyte(text):
    with pytest.raises(UserError):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["inf%", "nan%", "0%", "-5%", "1e30%", "101%", "x%", "４０%"])
def test_bad_percentages_are_refused(text):
    with pytest.raises(UserError, match="percentage"):
        parse_percent(text)


def test_good_sizes_and_percentages():
    assert parse_bytes("1") == 1 and parse_bytes("12GiB") == 12 * 2**30
    assert parse_percent("40%") == 0.4 and parse_percent("100%") == 1.0


@pytest.mark.parametrize("command", [["remat", "g.json", "--budget-fraction", "0.5"], ["tune-batch", "mlp"]])
@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf"])
def test_time_limits_must_be_finite_and_positive(text, command):
    with pytest.raises(UserError, match="time limit"):
        positive_seconds(text)
    one_line_error(run_cli(*command, f"--time-limit={text}"), f"time limit '{text}' must be a finite number")


def test_time_limit_that_is_not_a_number_is_a_usage_error():
    one_line_error(run_cli("tune-batch", "mlp", "--time-limit", "abc"),
                   "argument --time-limit: 'abc' is not a number of seconds", "memsched tune-batch --help")


FORGED = "\nTraceback (most recent call last):\x1b[2J"      # a newline, a forged line, a screen clear


def _model_named(path, node_name: str, weight_name: str, domain: str = ""):
    """A one-MatMul model (or, with `domain`, one op of that domain) with the names given."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    weight = numpy_helper.from_array(np.ones((3, 4), np.float32), weight_name)
    node = helper.make_node("Frob" if domain else "MatMul", ["x", weight_name], ["y"], name=node_name, domain=domain)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y], [weight]), opset_imports=opsets,
                                ir_version=8), str(path))
    return path


def test_names_with_control_characters_stay_on_their_line(tmp_path):
    """A name from a model that holds a newline or a terminal escape is printed escaped, in an
    error line and in a table: it cannot split the line, forge a traceback or clear the screen."""
    bad = _model_named(tmp_path / "bad.onnx", f"evil{FORGED}", "w", domain="x.evil")
    line = one_line_error(run_cli("inspect", bad), "unsupported op 'Frob'", "evil\\nTraceback", "\\x1b[2J")
    assert "\x1b" not in line
    result = run_cli("inspect", _model_named(tmp_path / "ok.onnx", f"mm{FORGED}", f"w{FORGED}"))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "Traceback (most" in result.stdout
    assert not any(line.startswith("Traceback") for line in result.stdout.splitlines())


@pytest.mark.parametrize("given", [("--lr", "0.1"), ("--optimizer", "adam"), ("--freeze", "fc1.*"),
                                   ("--weight-decay", "0.01")])
def test_training_options_without_train_are_refused(tmp_path, given):
    """A training option without --train would plan the forward pass and ignore it: one line."""
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    for command in (("compile", model, "-o", tmp_path / "p.onnx"), ("simulate", model)):
        one_line_error(run_cli(*command, *given), f"{given[0]} is an option of the training step; add --train")
    assert not (tmp_path / "p.onnx").exists()


def test_bucket_size_without_data_parallel_is_refused(tmp_path):
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    one_line_error(run_cli("compile", model, "--train", "--bucket-mb", "5"), "add --data-parallel N")


def test_compile_writes_its_plan_and_report_together_or_neither(tmp_path, monkeypatch, capsys):
    """Where the report or the plan cannot be written (a full disk), neither is put in place
    and no temporary is left: the command's outputs land together."""
    from memsched import cli, emit

    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    out = tmp_path / "out"
    finish = onnx_utils.finish_mode

    def full_for_reports(tmp):
        if "r.html" in str(tmp):
            raise OSError(28, "No space left on device")
        finish(tmp)

    def full_disk(plan, path):
        raise onnx_utils.write_error(path, OSError(28, "No space left on device"))

    for target, fake in ((onnx_utils, full_for_reports), (emit, full_disk)):
        monkeypatch.setattr(target, "finish_mode" if target is onnx_utils else "write_plan", fake)
        assert cli.main(["compile", str(model), "-o", str(out / "p.onnx"), "--report", str(out / "r.html")]) == 1
        assert "No space left on device" in capsys.readouterr().err
        assert os.listdir(out) == []
        monkeypatch.undo()
    assert cli.main(["compile", str(model), "-o", str(out / "p.onnx"), "--report", str(out / "r.html")]) == 0
    assert sorted(os.listdir(out)) == ["p.onnx", "r.html"]


def test_running_out_of_memory_is_one_line(monkeypatch, capsys):
    """A model or data file that claims more than the machine holds ends in one line, exit 1."""
    from memsched import cli
    from memsched.cli.commands import inspect

    def exhausted(args):
        raise MemoryError

    monkeypatch.setattr(inspect, "run", exhausted)
    assert cli.main(["inspect", "model.onnx"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memsched: error: out of memory")


def test_time_limit_accepts_positive_seconds():
    assert positive_seconds("0.5") == 0.5


def test_a_negative_value_after_its_option_is_read_as_its_value(tmp_path):
    """argparse would take '-5%' for an option ("expected one argument")."""
    assert attach_negative_values(["compile", "m.onnx", "--budget", "-5%", "--lr", "-1e-3", "-o", "p.onnx"]) == \
        ["compile", "m.onnx", "--budget=-5%", "--lr=-1e-3", "-o", "p.onnx"]
    assert attach_negative_values(["--budget=-5%", "-o", "p.onnx"]) == ["--budget=-5%", "-o", "p.onnx"]
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    one_line_error(run_cli("compile", model, "--budget", "-5%"), "budget '-5%' must be a percentage above 0%")


@pytest.mark.parametrize("command, option", [
    (["tune-batch", "resnet18", "--size"], "--size"), (["tune-batch", "bert-base", "--seq"], "--seq"),
    (["tune-batch", "mlp", "--max-batch"], "--max-batch"),
    (["models", "export", "mlp", "-o", "{tmp}/x.onnx", "--batch"], "--batch"),
])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_sizes_and_counts_below_one_are_one_line(tmp_path, command, option, value):
    command = [part.format(tmp=tmp_path) for part in command]
    one_line_error(run_cli(*command, value), f"{option} '{value}' must be a whole number of at least 1")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("key, value, message", [
    ("device_memory", "0", "device_memory': size '0' must be at least 1 byte"),
    ("device_memory", "1e3", "cannot read '1e3' as a size"),
    ("link_latency", math.inf, "finite"),
    ("link_latency", 1e300, "seconds from 0 to"),
    ("link_h2d", 1e-300, "must be positive"),
    ("memory_bandwidth", math.nan, "finite"),
])
def test_hardware_numbers_are_finite_and_in_range(key, value, message):
    base = hardware.load("v100-16gb").to_dict()
    with pytest.raises(UserError, match=message):
        hardware.from_dict({**base, key: value})


def test_hardware_file_with_infinity_is_one_line(tmp_path):
    profile = {**hardware.load("v100-16gb").to_dict(), "launch_overhead": math.inf}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile))       # json writes Infinity, which json.loads reads back
    one_line_error(run_cli("hardware", "show", path), "launch_overhead", "finite")


@pytest.mark.parametrize("value", ["0.1", -1.0, math.nan, math.inf, True, None])
def test_cost_tables_with_bad_times_are_refused(tmp_path, value):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": "memsched-costs", "version": 1, "times": {"fc1": value}}))
    with pytest.raises(UserError, match=r"times\['fc1'\] must be seconds"):
        CostTable.load(path)
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    one_line_error(run_cli("simulate", model, "--costs", path), "fc1")


def test_a_cost_table_of_another_version_is_refused(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": "memsched-costs", "version": 99, "times": {"fc1": 0.1}}))
    with pytest.raises(UserError, match="version 99"):
        CostTable.load(path)


@pytest.mark.parametrize("command", [("check-numerics", "{model}", "--top", "-1"),
                                     ("report", "{model}", "--data-parallel", "0"),
                                     ("profile", "{model}", "-o", "{out}", "--repeats", "0"),
                                     ("hardware", "calibrate", "-o", "{out}", "--repeats", "0")])
def test_counts_below_one_are_refused_before_any_work(tmp_path, command):
    """A count of rows, workers or timed runs below 1 is one line, not a quiet slice or a
    division by zero; nothing is written."""
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    out = tmp_path / "out.json"
    args = [part.format(model=model, out=out) for part in command]
    one_line_error(run_cli(*args), "must be a whole number of at least 1")
    assert not out.exists()


# ---- 14 ----------------------------------------------------------------------------------------------------
def test_zero_op_model_says_what_is_wrong(tmp_path):
    graph = helper.make_graph([], "empty", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])])
    path = tmp_path / "empty.onnx"
    onnx.save(onnx_utils.make_model(graph), str(path))
    line = one_line_error(run_cli("inspect", path), "has no ops")
    assert "not an ONNX model" not in line


def test_a_model_without_outputs_is_refused(tmp_path):
    """A graph that names no outputs computes nothing: compiling it would plan dead ops."""
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [])
    path = tmp_path / "no_outputs.onnx"
    onnx.save(onnx_utils.make_model(graph), str(path))
    for command in (("inspect", path), ("compile", path, "-o", tmp_path / "p.onnx")):
        one_line_error(run_cli(*command), "names no outputs")
    assert not (tmp_path / "p.onnx").exists()


def test_a_device_is_no_model_and_a_huge_dim_no_size():
    one_line_error(run_cli("inspect", "/dev/zero"), "is not a regular file")
    with pytest.raises(UserError, match="at most 1,099,511,627,776"):
        frontend.parse_dims(["N=99999999999999999999"])
    assert frontend.parse_dims(["N=1099511627776"]) == {"N": 2 ** 40}


def _cuda_usable() -> bool:
    from memsched.ort import resolve_device

    return resolve_device("cuda")[0] == "cuda"


@pytest.mark.skipif(_cuda_usable(), reason="CUDA works here: there is no fallback to refuse")
def test_cuda_without_cuda_fails_unless_fallback_is_allowed(tmp_path):
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    assert run_cli("compile", model, "-o", tmp_path / "s.onnx").returncode == 0
    one_line_error(run_cli("run", tmp_path / "s.onnx", "--device", "cuda"), "cannot run on cuda", "--allow-fallback")
    result = run_cli("run", tmp_path / "s.onnx", "--device", "cuda", "--allow-fallback")
    assert result.returncode == 0 and "asked for cuda" in result.stdout
    line = one_line_error(run_cli("profile", model, "-o", tmp_path / "c.json", "--device", "cuda"))
    assert "\x1b[" not in line


@pytest.fixture
def plan_file(tmp_path):
    return write_plan(swap_plan(mlp_train_graph()), tmp_path / "plan.onnx")


def _edit_model(path, edit) -> None:
    model = onnx.load(str(path))
    edit(model)
    onnx.save_model(model, str(path))


def _drop_an_output(model):
    del model.graph.output[1]


def _stretch_a_tensor(model):
    info = next(vi for vi in model.graph.value_info if len(vi.type.tensor_type.shape.dim) == 2)
    info.type.tensor_type.shape.dim[1].dim_value += 1


@pytest.mark.parametrize("edit, message", [(_drop_an_output, "declares no shape for tensor"),
                                           (_stretch_a_tensor, "is not consistent: .*differ")])
def test_a_resealed_graph_edit_is_one_line_everywhere(plan_file, edit, message):
    """A deliberate tamperer who edits the graph and reseals the digest still meets a check:
    the ops' shapes must follow from their inputs, and every tensor must have one."""
    _edit_model(plan_file, edit)
    edit_plan_metadata(plan_file, lambda doc: None, reseal=True)
    for command in (["report", plan_file], ["run", plan_file, "--check"]):
        assert re.search(message, one_line_error(run_cli(*command), "was it edited by hand?"))


def test_plan_with_a_reshaped_initializer_is_refused(plan_file):
    def reshape(model):
        init = next(i for i in model.graph.initializer if i.name == "W1")
        init.dims[:] = [init.dims[0] * 2, init.dims[1]]
    _edit_model(plan_file, reshape)
    one_line_error(run_cli("report", plan_file), "initializer 'W1'", "declares shape")


def _set(key, value):
    return lambda doc: doc.__setitem__(key, value)


@pytest.mark.parametrize("edit, message", [
    (_set("budget", "abc"), "malformed 'budget'"), (_set("budget", [1]), "malformed 'budget'"),
    (_set("budget", -4), "malformed 'budget'"), (_set("on_host", ["nosuch"]), "names tensor 'nosuch'"),
    (_set("on_host", "W1"), "malformed 'on_host'"),
    (_set("opset_imports", {"": "17"}), "malformed 'opset_imports'"), (_set("notes", "x"), "malformed 'notes'"),
    (_set("schedule", [["compute", 7, None, "compute"]]), "malformed 'schedule'"),
    (_set("offsets", [["a", 0, -64]]), "malformed 'offsets'"),
    (_set("outputs", ["loss", "nosuch"]), "names tensor 'nosuch'"),
    (lambda doc: doc.pop("renamed"), "has no 'renamed'"),
    (lambda doc: doc["graph_order"].reverse(), "before the op that makes its input"),
    (_set("budget", 10 ** 400), "malformed 'budget'"),
])
def test_plan_metadata_of_the_wrong_type_is_one_line_naming_the_field(plan_file, edit, message):
    edit_plan_metadata(plan_file, edit, reseal=True)
    with pytest.raises(UserError, match=message):
        read_plan(plan_file)


@pytest.mark.parametrize("key, first", [("memsched.kinds", "metadata 'memsched.kinds'"),
                                        ("memsched.phases", "no longer matches")])     # the digest seals phases
def test_plan_with_garbage_kinds_or_phases_is_one_line(plan_file, key, first):
    def garble(model):
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, key: "{not json"})
    _edit_model(plan_file, garble)
    one_line_error(run_cli("report", plan_file), first)
    if first == "no longer matches":
        edit_plan_metadata(plan_file, lambda doc: None, reseal=True)
    one_line_error(run_cli("report", plan_file), f"metadata '{key}'")


def test_plan_whose_swapout_tier_disagrees_is_refused(plan_file):
    def retier(model):
        node = next(n for n in model.graph.node if n.op_type == "SwapOut")
        node.attribute[0].s = b"nvdimm" if node.attribute[0].s == b"dram" else b"dram"
    _edit_model(plan_file, retier)
    one_line_error(run_cli("report", plan_file), "no longer matches")
    edit_plan_metadata(plan_file, lambda doc: None, reseal=True)     # as a deliberate tamperer would
    one_line_error(run_cli("report", plan_file), "says tier")


def test_plan_whose_graph_was_edited_is_refused(plan_file):
    _edit_model(plan_file, lambda model: None)     # loaded and saved again unchanged: the digest still matches
    read_plan(plan_file)

    def consistent_resize(model):        # a shape edit that keeps the data consistent: only the digest sees it
        init = next(i for i in model.graph.initializer if i.name == "W1")
        array = numpy_helper.to_array(init)
        init.CopyFrom(numpy_helper.from_array(np.concatenate([array, array]), "W1"))
    _edit_model(plan_file, consistent_resize)
    for command in ("report", "run"):
        one_line_error(run_cli(command, plan_file), "no longer matches")


def test_digest_survives_the_external_data_save(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_utils, "INLINE_BYTES", 16)
    plan = swap_plan(mlp_train_graph(hidden=64))      # W1 is 1.5 KB: past the external-data threshold
    path = write_plan(plan, tmp_path / "plan.onnx")
    assert any(n.endswith(".data") for n in os.listdir(tmp_path))
    assert read_plan(path).schedule == plan.schedule


# ---- 3: control flow -----------------------------------------------------------------------------------------
def _saved(model, path):
    return onnx_utils.save_model_atomic(model, path)


def _compiles_and_runs(model, tmp_path, *args: str) -> None:
    """`compile MODEL ARGS -o plan.onnx` exits 0 and `run plan.onnx --check` passes."""
    plan = tmp_path / "plan.onnx"
    compiled = run_cli("compile", model, *args, "-o", plan, "--time-limit", "10")
    assert compiled.returncode == 0, compiled.stderr
    ran = run_cli("run", plan, "--check", "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["check"]["passed"]


@pytest.mark.parametrize("model, node, captured", [(if_capture_model, "If node 'branch'", "'Wa'"),
                                                   (lambda: loop_model(capture=True), "Loop node 'loop'", "'W2'")])
def test_control_flow_that_captures_main_graph_tensors_is_refused(tmp_path, model, node, captured):
    path = _saved(model(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    for args in (("train-graph", path, "-o", out), ("compile", path, "--train", "-o", out),
                 ("compile", path, "-o", out), ("inspect", path)):
        one_line_error(run_cli(*args), node, "(control flow)", captured)
    assert not out.exists()


def test_autodiff_refuses_captures_in_a_graph_that_skipped_the_front_end():
    from memsched.ir import Graph
    from memsched.passes.training import build_training_step

    graph = Graph.from_onnx(onnx.shape_inference.infer_shapes(if_capture_model()))
    with pytest.raises(UserError, match=r"cannot differentiate through If node 'branch' \(control flow\).*'Wa'"):
        build_training_step(graph)


def test_control_flow_on_the_gradient_path_is_refused_unless_frozen_before_it(tmp_path):
    path = _saved(loop_model(), tmp_path / "loop.onnx")
    for args in (("train-graph", path, "-o", tmp_path / "t.onnx"), ("compile", path, "--train")):
        one_line_error(run_cli(*args), "cannot differentiate through Loop node 'loop' (control flow)", "--freeze")
    _compiles_and_runs(path, tmp_path, "--train", "--freeze", "W")      # W2 after the loop still trains
    described = run_cli("train-graph", path, "--freeze", "W", "-o", tmp_path / "t.onnx", "--json")
    assert json.loads(described.stdout)["trainable_parameters"] == 1


@pytest.mark.parametrize("model", [loop_model, scan_model])
def test_control_flow_reading_only_its_inputs_compiles_and_runs_forward(tmp_path, model):
    _compiles_and_runs(_saved(model(), tmp_path / "m.onnx"), tmp_path)


# ---- 6: measured costs for rewritten ops ----------------------------------------------------------------------
@pytest.mark.slow
def test_profile_then_compile_with_the_costs_prices_the_fused_updates(tmp_path):
    model, costs, plan = tmp_path / "m.onnx", tmp_path / "costs.json", tmp_path / "plan.onnx"
    assert run_cli("models", "export", "mlp", "-o", model, "--batch", "8").returncode == 0
    profiled = run_cli("profile", model, "--train", "-o", costs)
    assert profiled.returncode == 0, profiled.stderr
    compiled = run_cli("compile", model, "--train", "--costs", costs, "-o", plan, "--json")
    assert compiled.returncode == 0, compiled.stderr
    table = CostTable.load(costs)
    graph = read_plan(plan).graph
    fused = [op.name for op in graph.ops if op.name.endswith("/FusedGemm")]
    assert fused, "the plan fuses no update: nothing here tests the fallback"
    pricing = table.pricing(graph)
    assert json.loads(compiled.stdout)["costs"] == pricing      # the report says how each op was priced
    # the fused Gemms are priced from the ops they replace; the lr scalings before them, glue the
    # rewrite added, by the roofline of the table's device
    scales = [op.name for op in graph.ops if op.name.endswith("/FusedScale")]
    assert pricing["source"] == "table" and sorted(pricing["roofline"]) == sorted(scales)
    assert sorted(pricing["from_sources"]) == sorted(fused)
    assert pricing["ops"]["name"] + pricing["ops"]["sources"] + len(scales) == len(graph.ops)
    for name in fused:       # the dW Gemm and the update ops it replaces, timed in the table
        sources = pricing["from_sources"][name]
        assert any("/grad/" in s for s in sources) and any("/update/" in s for s in sources)
        assert table.time(graph.op_by_name[name], graph) == pytest.approx(sum(table.times[s] for s in sources))


def test_split_and_micro_batch_copies_take_their_share_of_the_op_they_were_made_from():
    from memsched.passes.rewrites.batch_split import split_training_step as batch_split
    from memsched.passes.rewrites.concat_split import split_training_step as concat_split
    from tests.test_batch_split import BUILD, cnn
    from tests.test_concat_split import build, concat_model

    forward = cnn()
    given = BUILD(forward)
    step = batch_split(forward, given, BUILD, 2)
    table = CostTable({op.name: 1e-6 * (i + 1) for i, op in enumerate(given.ops)}, meta={"device": "cuda"})
    for name in ("conv/chunk0", "conv/chunk1/grad/Conv"):   # two equal chunks: half the FLOPs each
        source = name.replace("/chunk0", "").replace("/chunk1", "")
        assert table.priced(step.op_by_name[name], step) == (pytest.approx(table.times[source] / 2), "sources",
                                                             [source])
    seconds, how, where = table.priced(step.op_by_name["x/SplitBatch"], step)     # glue: no source
    assert how == "roofline" and where == ["v100-16gb"] and seconds > 0

    forward = concat_model()
    given = build(forward)
    step = concat_split(forward, given, build)
    table = CostTable({op.name: 1e-6 for op in given.ops}, meta={"device": "cpu"})
    parts = [table.priced(step.op_by_name[f"head/part{i}"], step) for i in range(2)]
    assert [how for _, how, _ in parts] == ["sources", "sources"]
    assert sum(seconds for seconds, _, _ in parts) == pytest.approx(1e-6)      # 3 and 5 of the 8 channels
    assert table.pricing(step)["roofline"]["head/Sum1"] == table.fallback_hardware().name
    with pytest.raises(UserError, match="no time for op 'head'"):           # an op no rewrite made
        CostTable({}).time(given.op_by_name["head"], given)


def test_the_size_bound_is_never_below_what_the_model_serializes_to():
    """save_model_atomic decides external data by `serialized_bound`, counted without encoding
    the weights: it must never undercount, whatever form the tensors take."""
    model = mlp_model(width=512)                                   # raw_data weights
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [64, 64], [-1.5] * 4096)
    assert typed.float_data and not typed.raw_data
    model.graph.initializer.append(typed)                          # a weight in float_data
    model.graph.initializer.append(numpy_helper.from_array(np.arange(4000, dtype=np.int64) * 10**12, "big_ints"))
    model.graph.node.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
        np.ones((32, 32), np.float32), "c_value")))               # a tensor in an attribute
    assert onnx_utils.serialized_bound(model) >= model.ByteSize()
    assert not onnx_utils._past_inline_limit(model)


def test_thread_counts_beyond_the_cores_are_one_line(tmp_path):
    """ONNX Runtime starts every thread it is asked for: 5,000 never finished a step."""
    import os as _os

    cores = len(_os.sched_getaffinity(0))
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    plan = tmp_path / "plan.onnx"
    assert run_cli("compile", model, "--train", "-o", plan, "--time-limit", "5").returncode == 0
    for threads in ("5000", "-1"):
        one_line_error(run_cli("run", plan, "--threads", threads), f"--threads must be 0 (every core) to {cores}")
    one_line_error(run_cli("profile", model, "-o", tmp_path / "c.json", "--threads", "100000"), "--threads must be")
    assert run_cli("run", plan, "--threads", str(cores)).returncode == 0


# ---- a full disk and unreadable files -------------------------------------------------------------------------
# runs the CLI with `open` patched: writes into FOLDER fail as a full disk fails (ENOSPC, no file
# named), reads of files in FOLDER as an unreadable file does (these tests run as root, whom no
# permission bit stops)
FAULTY_DISK = """
import builtins, errno, io, sys
sys.path.insert(0, {root!r})
folder, fault, argv = {folder!r}, {fault!r}, {argv!r}
real_open = builtins.open
class FullDisk:
    def __init__(self, f): self.f = f
    def write(self, data): raise OSError(errno.ENOSPC, "No space left on device")
    def __getattr__(self, name): return getattr(self.f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()
def faulty_open(file, mode="r", *args, **kwargs):
    inside = isinstance(file, (str, bytes)) or hasattr(file, "__fspath__")
    inside = inside and str(file).startswith(folder)
    writes = any(c in mode for c in "wax+")
    if inside and not writes and fault == "unreadable":
        raise PermissionError(errno.EACCES, "Permission denied", str(file))
    f = real_open(file, mode, *args, **kwargs)
    return FullDisk(f) if inside and writes and fault == "full" else f
builtins.open = io.open = faulty_open          # pathlib opens through io.open
from memsched import cli
sys.exit(cli.main(argv))
"""


def _faulty_run(folder, fault: str, *argv) -> subprocess.CompletedProcess:
    code = FAULTY_DISK.format(root=str(ROOT), folder=str(folder), fault=fault, argv=[str(a) for a in argv])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    """A model and its compiled plan, outside the folders the faults touch."""
    folder = tmp_path_factory.mktemp("inputs")
    model = onnx_utils.save_model_atomic(mlp_model(), folder / "m.onnx")
    assert run_cli("compile", model, "--train", "--loss", "mse", "-o", folder / "plan.onnx").returncode == 0
    return model, folder / "plan.onnx"


@pytest.mark.parametrize("command", [
    ["compile", "{model}", "--train", "--loss", "mse", "-o", "{out}/plan.onnx"],
    ["compile", "{model}", "--train", "--loss", "mse", "--json", "-o", "{out}/plan.onnx"],
    ["train-graph", "{model}", "--loss", "mse", "-o", "{out}/step.onnx"],
    ["report", "{plan}", "--html", "{out}/report.html"],
    ["tune-batch", "mlp", "--time-limit", "20", "--max-batch", "4", "--plot", "{out}/batch.svg"],
    ["profile", "{model}", "--repeats", "1", "-o", "{out}/costs.json"],
])
def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tmp_path, mlp_files, command):
    model, plan = mlp_files
    out = tmp_path / "out"
    out.mkdir()
    argv = [part.format(model=model, plan=plan, out=out) for part in command]
    line = one_line_error(_faulty_run(out, "full", *argv), "cannot write", "No space left on device")
    assert str(out) in line
    assert os.listdir(out) == []


@pytest.mark.parametrize("command", [["inspect", "{model}"], ["compile", "{model}", "--train", "--loss", "mse"],
                                     ["run", "{plan}"], ["report", "{plan}"], ["hardware", "show", "{folder}/hw.json"],
                                     ["simulate", "{model}", "--costs", "{folder}/costs.json"]])
def test_an_unreadable_input_is_one_line_naming_it(tmp_path, mlp_files, command):
    model, plan = mlp_files
    for name in ("hw.json", "costs.json"):       # there to be unreadable: the fault stops every read
        (model.parent / name).write_text("{}")
    argv = [part.format(model=model, plan=plan, folder=model.parent) for part in command]
    line = one_line_error(_faulty_run(model.parent, "unreadable", *argv), "Permission denied")
    assert str(model.parent) in line


# ---- hostile JSON and TOML -------------------------------------------------------------------------------------
HOSTILE = {"400 digits": "{\"x\": 1" + "0" * 400 + "}", "5,000 digits": "{\"x\": 1" + "0" * 5000 + "}",
           "nested 100,000 deep": "[" * 100000 + "]" * 100000, "not UTF-8": b"\xff\xfe{}"}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("suffix, command", [
    (".json", ["hardware", "show", "{path}"]), (".toml", ["hardware", "show", "{path}"]),
    (".json", ["remat", "{path}", "--budget-fraction", "0.5"]),
    (".json", ["simulate", "{model}", "--costs", "{path}"]),
])
def test_hostile_json_and_toml_are_one_line(tmp_path, content, suffix, command):
    """An integer past Python's digit limit, nesting past the recursion limit, bytes that are
    not text: OverflowError, ValueError, RecursionError and UnicodeDecodeError before."""
    path = tmp_path / f"doc{suffix}"
    if suffix == ".toml" and isinstance(content, str) and content.startswith("{"):
        content = "x = 1" + content.split("1", 1)[1].rstrip("}")        # the same integer in TOML
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    result = run_cli(*[part.format(path=path, model=model) for part in command])
    assert result.returncode == 1 and "internal error" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and str(path) in result.stderr, result.stderr


def test_a_hardware_number_past_a_float_is_refused():
    base = hardware.load("v100-16gb").to_dict()
    with pytest.raises(UserError, match="memory_bandwidth' must be a finite number"):
        hardware.from_dict({**base, "memory_bandwidth": 10 ** 400})     # float() of it: OverflowError


@pytest.mark.parametrize("key, value", [
    ("memsched.training", "[1]"), ("memsched.grad_roles", "{not json"),
    ("memsched.grad_roles", '{"fc1": {"role": "dW"}}'),
    ("memsched.fused_updates", '{"ops": [{}], "tensors": []}'), ("memsched.concat_split", "7"),
])
def test_memsched_metadata_a_model_should_not_hold_is_one_line_naming_the_field(tmp_path, key, value):
    """The keys the training-step builder and the rewrites write are read through one
    validating reader (memsched.step_info, ir.metadata_json): in a user's model, garbage there
    is one line naming the field, for compile without and with --train."""
    model = mlp_model()
    helper.set_model_props(model, {key: value})
    path = onnx_utils.save_model_atomic(model, tmp_path / "m.onnx")
    for train in ([], ["--train"]):
        result = run_cli("compile", path, *train)
        if result.returncode != 0:
            one_line_error(result, f"metadata '{key}'")
    one_line_error(run_cli("compile", path), f"metadata '{key}'")


@pytest.mark.parametrize("rank, world, message", [("0", "abc", "must be whole numbers"),
                                                  ("5", "2", "no rank of a world of 2")])
def test_a_rank_environment_that_is_no_rank_is_one_line(plan_file, monkeypatch, rank, world, message):
    """Under torchrun's variables, `run` reads RANK and WORLD_SIZE through the one checked
    reader before anything starts: a world size that is no number, or a rank outside the world."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    one_line_error(run_cli("run", plan_file), message)


@pytest.mark.parametrize("text, message", [('{"version": ' + "9" * 5000 + "}", "digits"),
                                           ("[" * 100000 + "]" * 100000, "nested too deeply")])
def test_a_plan_document_past_what_json_can_hold_is_one_line(plan_file, text, message):
    """A plan's metadata holding an integer past Python's digit limit, or nesting past what
    the parser walks, is one line (the same parse as hardware, cost and remat files)."""
    model = onnx.load(str(plan_file))
    for prop in model.metadata_props:
        if prop.key == "memsched.plan":
            prop.value = text
    onnx.save_model(model, str(plan_file))
    one_line_error(run_cli("report", plan_file), "is not valid JSON", message)


def test_a_learning_rate_past_any_step_is_one_line(tmp_path):
    """`--lr 1e39` overflowed float32 in the step's constants (a numpy warning, exit 0) and
    trained every parameter to inf: a learning rate of 1e6 or more is refused when the step is built."""
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    one_line_error(run_cli("compile", model, "--train", "--lr", "1e39"), "learning rate must be below 1e6")


def test_a_data_parallel_record_with_a_worker_count_in_words_is_one_line(plan_file):
    """A resealed record whose `workers` is the string "2" was "compiled for 2 workers, not 2"."""
    def record(model):
        value = json.dumps({"workers": "2", "bucket_bytes": 1024, "batch_inputs": [], "worker_batch": None})
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                            "memsched.data_parallel": value})
    _edit_model(plan_file, record)
    edit_plan_metadata(plan_file, lambda doc: None, reseal=True)
    one_line_error(run_cli("report", plan_file, "--data-parallel", "2"), "metadata 'memsched.data_parallel'")


def test_a_resealed_plan_with_garbage_grad_roles_is_one_line(tmp_path):
    """The report undoes a plan's fused updates to rebuild its baseline, reading the grad roles:
    garbage there, resealed, is one line naming the field (a field nothing reads is left alone)."""
    model = onnx_utils.save_model_atomic(mlp_model(), tmp_path / "m.onnx")
    plan = tmp_path / "plan.onnx"
    assert run_cli("compile", model, "--train", "-o", plan).returncode == 0
    assert any(p.key == "memsched.fused_updates" for p in onnx.load(str(plan)).metadata_props)

    def garble(model):
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                            "memsched.grad_roles": '{"x": 1}'})
    _edit_model(plan, garble)
    edit_plan_metadata(plan, lambda doc: None, reseal=True)
    one_line_error(run_cli("report", plan), "metadata 'memsched.grad_roles'")
