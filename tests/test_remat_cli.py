"""`memsched remat GRAPH.json --budget-fraction F`: JSON keys, exit codes, one-line errors."""
from __future__ import annotations

import json

from memsched.passes.recompute import dag as remat
from memsched.passes.recompute import graphs

from .conftest import run_cli
from .test_remat import independent_check, tables

REMAT_KEYS = {"nodes", "budget_bytes", "peak_bytes", "total_cost", "overhead", "seconds", "status", "schedule"}


def write_graph(tmp_path, problem) -> str:
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(remat.to_node_link(problem)))
    return str(path)


def assert_one_line_error(result, code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and lines[0].startswith("memsched: error:")
    return lines[0]


def test_remat_json(tmp_path):
    problem = graphs.resnet((1, 1), seed=1)
    result = run_cli("remat", write_graph(tmp_path, problem), "--budget-fraction", "0.8", "--time-limit", "3",
                     "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert REMAT_KEYS <= set(out)
    assert out["nodes"] == problem.n
    assert out["budget_bytes"] == remat.budget_from_fraction(problem, 0.8)
    assert out["status"] in ("optimal", "feasible", "heuristic")
    inputs, size = tables(problem)
    valid, peak, reason = independent_check(inputs, size, 0, out["schedule"])
    assert valid, reason
    assert peak == out["peak_bytes"] <= out["budget_bytes"]
    cost = dict(zip(problem.ids, problem.cost))
    assert abs(sum(cost[v] for v in out["schedule"]) - out["total_cost"]) < 1e-6
    assert abs(out["overhead"] - (out["total_cost"] / problem.base_cost - 1)) < 1e-9
    assert len(out["schedule"]) > problem.n    # 0.8 of the peak needs recomputation


def test_remat_table(tmp_path):
    result = run_cli("remat", write_graph(tmp_path, graphs.chain(8)), "--budget-fraction", "0.9",
                     "--time-limit", "2")
    assert result.returncode == 0, result.stderr
    assert "methods" in result.stdout and "greedy" in result.stdout and "recomputations" in result.stdout


def test_remat_infeasible_budget_exits_3_naming_the_smallest_budget(tmp_path):
    problem = graphs.chain(8)
    result = run_cli("remat", write_graph(tmp_path, problem), "--budget-fraction", "0.01", "--time-limit", "2")
    line = assert_one_line_error(result, 3)
    assert "smallest budget found is" in line
    smallest = int(line.split("smallest budget found is ")[1].split()[0])
    assert smallest >= remat.memory_lower_bound(problem)


def test_remat_user_errors_exit_1(tmp_path):
    assert "no such node-link graph" in assert_one_line_error(
        run_cli("remat", tmp_path / "missing.json", "--budget-fraction", "0.8"), 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    message = assert_one_line_error(run_cli("remat", bad, "--budget-fraction", "0.8"), 1)
    assert "not a readable node-link graph" in message
    cyclic = tmp_path / "cyclic.json"
    cyclic.write_text(json.dumps({"nodes": [{"id": 0, "cost_cpu": 1, "cost_ram": 4},
                                            {"id": 1, "cost_cpu": 1, "cost_ram": 4}],
                                  "links": [{"source": 0, "target": 1}, {"source": 1, "target": 0}]}))
    assert "cycle" in assert_one_line_error(run_cli("remat", cyclic, "--budget-fraction", "0.8"), 1)
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps({"nodes": [{"id": 0, "cost_cpu": 1, "cost_ram": 4}],
                                 "links": [{"source": 0, "target": 99}]}))
    assert "names node 99, which the 'nodes' list does not hold" in assert_one_line_error(
        run_cli("remat", stray, "--budget-fraction", "0.8"), 1)
    good = write_graph(tmp_path, graphs.chain(3))
    assert "fraction" in assert_one_line_error(run_cli("remat", good, "--budget-fraction", "0"), 1)
    for fraction in ("1e308", "2", "1.0000001", "nan"):
        assert "at most 1" in assert_one_line_error(run_cli("remat", good, "--budget-fraction", fraction), 1)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"nodes": [], "links": []}))
    assert "no nodes" in assert_one_line_error(run_cli("remat", empty, "--budget-fraction", "0.8"), 1)
    assert "time limit" in assert_one_line_error(
        run_cli("remat", good, "--budget-fraction", "0.9", "--time-limit", "0"), 1)


def test_remat_usage_errors_are_one_line(tmp_path):
    good = write_graph(tmp_path, graphs.chain(3))
    for args, fragment in (((), "--budget-fraction"), (("--budget-fraction", "lots"), "'lots'")):
        result = run_cli("remat", good, *args)
        assert result.returncode == 1 and result.stderr.count("\n") == 1 and fragment in result.stderr


def test_a_fifo_or_a_device_is_no_graph(tmp_path):
    """A FIFO blocked `remat` forever and /dev/zero read until memory ran out."""
    import os

    from .test_reliability import one_line_error

    fifo = tmp_path / "graph.json"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path):
        one_line_error(run_cli("remat", path, "--budget-fraction", "0.5", timeout=60), "not a regular file")
