"""Fuzz: random small float models (tests.graphs.random_onnx_model) through the whole CLI.

Each seed's model is compiled as a training step at 70 % and 40 % of its baseline peak
(`compile --train -o plan.onnx --time-limit 10 --budget B --json`) and, where a plan fits, run
against plain ONNX Runtime (`run plan.onnx --check`). Every command runs in its own process,
so a native abort fails the test instead of killing pytest. Required: exit 0 or 3 (a budget
that cannot be met), never a traceback or a signal; exit 0 means a plan whose arena is within
the budget, and its check passes; exit 3 means one `memsched: error:` line and no plan file.
"""
from __future__ import annotations

import json

import pytest

from memsched.onnx_utils import save_model_atomic

from .conftest import run_cli
from .graphs import random_onnx_model

BUDGETS = ("70%", "40%")
SLOW_SEEDS = tuple(range(23))
BATCH = 64      # activations outweigh the few hundred bytes of weights, so most budgets can be met


def compile_and_check(folder, seed: int, budget: str) -> int:
    """Compile seed `seed`'s model at `budget`, check what came back; returns compile's exit code."""
    model = save_model_atomic(random_onnx_model(seed, batch=BATCH), folder / f"fuzz{seed}.onnx")
    plan = folder / f"plan{seed}-{budget.rstrip('%')}.onnx"
    command = ("compile", model, "--train", "-o", plan, "--time-limit", "10", "--budget", budget, "--json")
    where = f"seed {seed}: memsched {' '.join(map(str, command))}"
    compiled = run_cli(*command, timeout=120)
    assert compiled.returncode in (0, 3), (where, compiled.returncode, compiled.stderr[-3000:])
    assert "Traceback" not in compiled.stderr, (where, compiled.stderr[-3000:])
    if compiled.returncode == 3:
        lines = compiled.stderr.strip().splitlines()
        assert lines and lines[-1].startswith("memsched: error: "), (where, compiled.stderr)
        assert not plan.exists(), where
        return 3
    report = json.loads(compiled.stdout)
    assert report["plan"]["arena_bytes"] <= report["budget_bytes"], (where, report["plan"], report["budget_bytes"])
    ran = run_cli("run", plan, "--check", "--json", timeout=120)
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, (where, ran.returncode, ran.stderr[-3000:])
    check = json.loads(ran.stdout)["check"]
    assert check["passed"], (where, check)
    return 0


def test_a_random_model_compiles_within_the_budget_and_runs(tmp_path):
    """Seed 2's plan fits at 70%: the compile, run and check paths are exercised (every seed at
    every budget runs under -m slow)."""
    assert compile_and_check(tmp_path, 2, "70%") == 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_more_random_models_compile_within_the_budget_and_run(tmp_path, seed):
    for budget in BUDGETS:
        compile_and_check(tmp_path, seed, budget)


def test_the_generator_is_seeded_and_makes_valid_models():
    import onnx

    for seed in range(20):
        model = random_onnx_model(seed)
        onnx.checker.check_model(model, full_check=True)
        assert model.SerializeToString() == random_onnx_model(seed).SerializeToString()
        assert model.opset_import[0].version == 17 and model.ir_version == 8
        weights = [i.name for i in model.graph.initializer if i.name.startswith("W")]
        assert 2 <= len(weights) <= 3
        assert {n.op_type for n in model.graph.node} <= {"Add", "Mul", "Relu", "MatMul", "Sigmoid", "Tanh",
                                                          "Identity"}
