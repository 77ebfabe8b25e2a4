"""The hardware, profile and simulate commands, as a user runs them."""
from __future__ import annotations

import json

import pytest

from memsched.onnx_utils import save_model_atomic

from .conftest import run_cli
from .graphs import mlp_model


def test_hardware_list_and_show_json():
    result = run_cli("hardware", "list", "--json")
    assert result.returncode == 0, result.stderr
    names = [p["name"] for p in json.loads(result.stdout)["profiles"]]
    assert names == ["v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"]
    result = run_cli("hardware", "show", "h100-80gb", "--json")
    shown = json.loads(result.stdout)
    assert shown["memory_bandwidth"] == 3.35e12 and shown["tiers"]["nvdimm"]["read_bw"] == 38e9


def test_show_prints_a_profile_file_that_loads_back(tmp_path):
    result = run_cli("hardware", "show", "v100-32gb", "--json")
    path = tmp_path / "mine.json"
    path.write_text(result.stdout)
    again = run_cli("hardware", "show", path, "--json")
    assert again.returncode == 0 and json.loads(again.stdout) == json.loads(result.stdout)
    table = run_cli("hardware", "show", "cpu")
    assert table.returncode == 0 and "calibrated op classes" in table.stdout


@pytest.mark.parametrize("args, message", [
    (("hardware", "show", "tpu-v9"), "unknown hardware 'tpu-v9'"),
    (("hardware", "show", "missing.toml"), "no such hardware profile"),
    (("profile", "missing.onnx", "-o", "c.json"), "no such file"),
])
def test_bad_input_is_one_line(args, message):
    result = run_cli(*args)
    assert result.returncode == 1 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_profile_then_simulate_with_the_table(tmp_path):
    model = save_model_atomic(mlp_model(batch=64, width=256), tmp_path / "m.onnx")
    costs = tmp_path / "costs.json"
    result = run_cli("profile", model, "-o", costs, "--repeats", "3", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["ops"] == 3 and summary["path"] == str(costs)
    table = json.loads(costs.read_text())
    result = run_cli("simulate", model, "--costs", costs, "--json")
    assert result.returncode == 0, result.stderr
    sim = json.loads(result.stdout)
    assert sim["cost_source"] == "measured" and sim["stall_s"] == 0.0
    assert sim["step_time_s"] == pytest.approx(sum(table["times"].values()), rel=1e-12)
    # peak bytes are the memory model's, exact: at relu h + a (64x256 floats each) + W1 + W2
    assert sim["peak_bytes"] == sim["model_peak_bytes"] == 2 * 65536 + 4096 + 3072
    roofline = json.loads(run_cli("simulate", model, "--hardware", "a100-80gb", "--json").stdout)
    assert roofline["cost_source"] == "roofline" and roofline["hardware"] == "a100-80gb"
    assert [e["label"] for e in roofline["events"]] == ["fc1", "relu", "fc2"]


def test_calibrate_rejects_an_unknown_reference_before_measuring(tmp_path):
    result = run_cli("hardware", "calibrate", "-o", tmp_path / "cpu.json", "--references", "alexnet")
    assert result.returncode == 1 and "no reference size for 'alexnet'" in result.stderr
    assert not (tmp_path / "cpu.json").exists()


def test_reference_training_steps_are_built_small():
    from memsched.passes.calibration import reference_graphs

    graph, = reference_graphs(["mlp"])
    assert graph.name == "mlp-train" and {op.phase for op in graph.ops} >= {"forward", "backward", "update"}


def _options(parser, path=()):
    """(command path, action) for every option of every command and action of `parser`."""
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings:
            yield path, action


def test_an_option_means_one_thing_with_one_default_in_every_command(tmp_path):
    """`--hardware` is the planning preset wherever a model is planned or simulated and the
    plan's wherever a plan is read; `--threads` is 0 (every core) but where kernels are timed;
    `memsched simulate` prices a model's step on the same profile as `memsched compile`'s baseline."""
    from memsched.cli.options import build_parser
    from memsched.hardware import PLANNING_PROFILE

    defaults = {}
    for path, action in _options(build_parser()):
        if action.dest in ("hardware", "threads"):
            defaults[(action.dest, " ".join(path))] = action.default
    assert {c for (dest, c), d in defaults.items() if dest == "hardware" and d is None} == {"report", "run"}
    assert {d for (dest, c), d in defaults.items() if dest == "hardware"} == {PLANNING_PROFILE, None}
    assert {c: d for (dest, c), d in defaults.items() if dest == "threads" and d != 0} == {"hardware calibrate": 1}
    model = tmp_path / "mlp.onnx"
    save_model_atomic(mlp_model(), model)
    simulated = json.loads(run_cli("simulate", model, "--json").stdout)
    assert simulated["hardware"] == PLANNING_PROFILE
