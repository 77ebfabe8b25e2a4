"""tune-batch: the search's choices equal brute force on a small model."""
from __future__ import annotations

import dataclasses
import json

import pytest

from memsched import models
from memsched.errors import BudgetError, UserError
from memsched.hardware import load
from memsched.onnx_utils import save_model_atomic
from memsched.passes.pipeline import compile as compile_plan
from memsched.deadline import Deadline, unlimited
from memsched.passes.tune import compile_time_limit, graph_builder, search_largest, tune_batch

from .conftest import run_cli

SETS = {"none": (), "reuse": ("reuse",)}


def tiny_gpu(mib: float):
    return dataclasses.replace(load("v100-16gb"), device_memory=int(mib * 2**20), name="tiny")


def test_search_largest_is_exact_on_monotone_predicates():
    for boundary in (1, 2, 3, 7, 8, 9, 100, 1023, 1024):
        calls = []
        assert search_largest(lambda b: calls.append(b) or b <= boundary, 4096) == boundary
        assert len(calls) <= 2 * boundary.bit_length() + 2
    assert search_largest(lambda b: False) is None
    assert search_largest(lambda b: True, 50) == 50


def test_tune_batch_matches_brute_force():
    """Every batch from 1 to past the boundary compiled one by one: same largest and fastest batch."""
    hw = tiny_gpu(2.2)
    build = graph_builder("mlp")
    result = tune_batch(build, hardware=hw, strategy_sets=SETS, time_limit=4, deadline=unlimited())
    assert result.complete == {"none": True, "reuse": True}
    assert result.largest["none"] is None  # the baseline keeps every gradient: 3.07 MB even at batch 1
    unplanned = compile_plan(build(1), train=True, hardware=hw, strategies=())
    assert not unplanned.report["plan"]["peak_bytes"] <= hw.device_memory
    rows = {}
    for b in range(1, result.largest["reuse"] + 6):
        report = compile_plan(build(b), train=True, hardware=hw, strategies=("reuse",),
                              time_limit=compile_time_limit(4)).report
        rows[b] = (report["plan"]["peak_bytes"] <= hw.device_memory, report["plan"]["step_time_s"] / b)
    fits = [b for b, (ok, _) in rows.items() if ok]
    assert fits == list(range(1, max(fits) + 1)) and result.largest["reuse"] == max(fits)
    fastest = min(fits, key=lambda b: (rows[b][1], -b))
    assert result.best["reuse"]["batch"] == fastest
    assert result.best["reuse"]["time_per_sample_s"] == pytest.approx(rows[fastest][1], rel=1e-12)


def test_the_deadline_ends_the_search_and_keeps_what_fitted():
    """The search stops where its deadline falls (here: stopped as the fourth compile is
    announced, as a clock would) and says so; the largest batch is then the largest seen to fit."""
    hw = tiny_gpu(2.2)
    deadline = Deadline(None)
    compiles = []

    def say(message):
        compiles.append(message)
        if len(compiles) == 4:
            deadline.stop()
    result = tune_batch(graph_builder("mlp"), hardware=hw, strategy_sets=SETS, time_limit=20, deadline=deadline,
                        progress=say)
    assert result.complete == {"none": True, "reuse": False} and len(result.rows) == 3
    assert compiles[0] == "none: batch 1" and compiles[1] == "reuse: batch 1"
    assert result.largest["reuse"] == max(r["batch"] for r in result.rows if r["fits"]) == 2
    assert result.to_dict()["complete"] == {"none": True, "reuse": False}     # batch 1 did not fit: none is done


def test_tune_batch_cli(tmp_path):
    plot = tmp_path / "curve.svg"
    result = run_cli("tune-batch", "mlp", "--strategies", "none", "--strategies", "reuse", "--budget", "2.2MiB",
                     "--json", "--plot", plot)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out["largest_batch"]) == {"none", "reuse"} and out["best_overall"]["fits"]
    assert plot.read_text().startswith("<svg")
    fixed = save_model_atomic(models.build("mlp", batch=4), tmp_path / "fixed.onnx")
    result = run_cli("tune-batch", fixed)
    assert result.returncode == 1 and "fixed batch size" in result.stderr
    result = run_cli("tune-batch", "mlp", "--budget", "50%")
    assert result.returncode == 1 and "absolute budget" in result.stderr


def test_measure_runs_the_chosen_batch_with_the_executor():
    result = run_cli("tune-batch", "mlp", "--hardware", "cpu", "--budget", "2.2MiB", "--strategies", "reuse",
                     "--measure", "--time-limit", "600", "--json")
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)["best"]["reuse"]
    measured = best["measured"]
    assert measured["provider"] == "CPUExecutionProvider"
    assert measured["peak_bytes"] == measured["planned_peak_bytes"] == best["peak_bytes"]
    assert measured["time_per_sample_s"] > 0


def test_no_batch_that_fits_is_a_budget_error_naming_the_smallest_that_works():
    """Where no batch fits under any set, the search ends in exit 3 (a BudgetError) naming the
    smallest peak a batch of 1 reached; with that as the budget, batch 1 fits."""
    build = graph_builder("mlp")
    with pytest.raises(BudgetError, match="no batch size fits") as caught:
        tune_batch(build, hardware=tiny_gpu(0.5), strategy_sets=SETS, time_limit=4, deadline=unlimited(),
                   max_batch=4)
    smallest = caught.value.smallest_feasible_bytes
    assert smallest is not None and smallest > 0.5 * 2**20
    fitting = tune_batch(build, hardware=tiny_gpu(smallest / 2**20), strategy_sets=SETS, time_limit=4,
                         deadline=unlimited(), max_batch=1)
    assert fitting.largest["reuse"] == 1
    result = run_cli("tune-batch", "mlp", "--time-limit", "5", "--max-batch", "2", "--budget", "1B")
    assert result.returncode == 3 and result.stderr.count("\n") == 1 and "batch 1 needs at least" in result.stderr


def test_a_limit_that_ends_before_any_batch_is_said_so():
    """A deadline already past before the first compile is no claim that nothing fits."""
    with pytest.raises(UserError, match="before a batch was planned"):
        tune_batch(graph_builder("mlp"), hardware=tiny_gpu(4), strategy_sets=SETS, time_limit=4,
                   deadline=Deadline(0.0))
