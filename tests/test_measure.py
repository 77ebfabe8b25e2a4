"""Measured costs: per-op ONNX Runtime timing, and the calibrated cpu profile."""
from __future__ import annotations

import pytest

from memsched import frontend, hardware
from memsched.cost import OP_CLASSES, op_time
from memsched.measure import profile_graph, single_op_model
from memsched.schedule import Plan
from memsched.simulate import simulate

from .graphs import mlp_model, reshape_model
from .simgraphs import chain


def test_every_op_is_timed_and_identical_ops_share_one_session():
    g = chain()                       # four Relus of the same shape, one Add
    table = profile_graph(g, repeats=3)
    assert set(table.times) == {op.name for op in g.ops}
    assert all(t > 0 for t in table.times.values())
    assert table.meta["timed_ops"] == 2 and table.meta["provider"] == "CPUExecutionProvider"
    assert len({table.times[n] for n in ("A", "B", "C1", "C2")}) == 1
    # the simulator prices the default plan as the sum of the measured op times
    sim = simulate(Plan.initial(g), costs=table)
    assert sim.step_time == pytest.approx(table.total(), rel=1e-12) and sim.cost_source == "measured"


def test_shape_arithmetic_runs_on_real_values():
    g = frontend.lower(reshape_model())           # Shape -> Gather -> Concat -> Reshape needs real values
    table = profile_graph(g, repeats=2)
    assert set(table.times) == {op.name for op in g.ops}


def test_single_op_model_embeds_parameters_as_initializers():
    g = frontend.lower(mlp_model())
    model, feeds = single_op_model(g.ops[0], g)
    assert feeds == ["x"] and [i.name for i in model.graph.initializer] == ["W1"]


def test_bundled_cpu_profile_is_calibrated_for_every_class_it_prices():
    cpu = hardware.load("cpu")
    priced = set(cpu.op_class_flops) | set(cpu.op_class_bandwidth)
    assert {"conv", "conv_grouped", "gemm"} <= set(cpu.op_class_flops)
    assert priced >= set(OP_CLASSES) - {"shape", "other"}
    g = frontend.lower(mlp_model())
    assert op_time(g.ops[0], g, cpu) > cpu.launch_overhead


@pytest.mark.slow
def test_calibrated_roofline_reproduces_its_microbenchmarks():
    import statistics

    from memsched.measure import calibrate

    hw, rows = calibrate(repeats=5)
    assert hw.name == "cpu" and len(rows) >= 20
    for cls in {r["class"] for r in rows}:
        mine = [r for r in rows if r["class"] == cls]
        ratios = [(max(r["flops"] / hw.flops_for(cls, "float32"), r["bytes"] / hw.bandwidth_for(cls))
                   + hw.launch_overhead) / r["seconds"] for r in mine]
        assert 0.8 < statistics.median(ratios) < 1.25, (cls, ratios)
