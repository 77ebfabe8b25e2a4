"""The swap benchmark's search and summaries (the benchmark itself runs for minutes)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench_swap", Path(__file__).resolve().parent.parent / "bench" /
                                              "bench_swap.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("limit,step", [(1, 1), (7, 1), (100, 1), (1000, 1), (96, 8), (250, 8)])
def test_doubling_then_bisection_finds_the_largest(limit, step):
    calls = []

    def fits(size):
        calls.append(size)
        return {"size": size} if size <= limit else None

    size, result = bench.largest(fits, step, step)
    assert size == limit // step * step and result == {"size": size}
    assert all(c % step == 0 for c in calls) and len(calls) <= 2 * limit.bit_length() + 2


def test_search_can_start_from_a_known_size_and_stop_early():
    size, _ = bench.largest(lambda s: s if s <= 1000 else None, 1, 1, lo_known=100, tolerance=0.1)
    assert 900 <= size <= 1000
    assert bench.largest(lambda s: None, 1, 1) == (None, None)


def test_where_tensors_went_groups_by_destination():
    notes = {"tensors": [{"tensor": "a", "bytes": 10, "to": "dram", "how": "swap", "idle_steps": [1, 9]},
                         {"tensor": "a", "bytes": 10, "to": "dram", "how": "evict", "idle_steps": [9, 20]},
                         {"tensor": "b", "bytes": 30, "to": "nvdimm", "how": "swap", "idle_steps": [2, 8]},
                         {"tensor": "c", "bytes": 5, "to": "recompute", "how": "recompute", "idle_steps": [3, 7]}]}
    where = bench.where_tensors_went(notes)
    assert where["dram"]["tensors"] == 1 and where["dram"]["how"] == {"swap": 1, "evict": 1}
    assert where["nvdimm"]["bytes"] == 30 and where["recompute"]["largest"][0]["tensor"] == "c"


def test_the_nvdimm_check_runs_where_the_plan_is_meant_to_run(monkeypatch):
    """At the largest size within the overhead target; the largest that fits only where no
    size within the target swapped; the check halves the host bytes held there."""
    checked = []
    monkeypatch.setattr(bench, "bench_nvdimm", lambda name, size, hw, used, limit, held: checked.append(
        (name, size, held)) or {"size": size})
    swapped = {"largest": 1000, "swapped_bytes": {"dram": 5}, "host_peak_bytes": {"dram": 8, "nvdimm": 2}}
    larger = {"largest": 1500, "swapped_bytes": {"dram": 9}, "host_peak_bytes": {"dram": 20}}
    results = {"vgg16": {"within_target_overhead": {"largest": 400, "swapped_bytes": {}}, "full_plan": larger},
               "resnet50": {"within_target_overhead": swapped, "full_plan": larger}}
    assert bench.nvdimm_after(results, ["vgg16", "resnet50"], None, [], 1.0) == {"size": 1000}
    assert checked == [("resnet50", 1000, 10)]
    assert bench.nvdimm_after({"vgg16": results["vgg16"]}, ["vgg16"], None, [], 1.0) == {"size": 1500}
    assert bench.nvdimm_after({}, [], None, [], 1.0) is None


def test_nvdimm_alone_reads_model_and_size():
    assert bench._model_at("resnet50:1004") == ("resnet50", 1004)
    for bad in ("resnet50", "resnet:10", "resnet50:ten"):
        with pytest.raises(SystemExit):
            bench._model_at(bad)
