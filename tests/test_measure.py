"""Measured costs: per-op ONNX Runtime timing, and the calibrated cpu profile."""
from __future__ import annotations

import pytest

from memsched import frontend, hardware
from memsched.cost import OP_CLASSES, op_time, profile_class
from memsched.measure import profile_graph, single_op_model
from memsched.schedule import Plan
from memsched.simulate import simulate

from .graphs import mlp_model, reshape_model
from .planbuild import SMALL_MODELS, training_graph
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


def test_an_op_is_timed_as_the_executor_runs_it():
    """Parameters are fed like every other tensor (the executor binds them in its arena: no
    initializer, nothing prepacked), in a session made with the executor's options."""
    import onnxruntime as ort

    from memsched.ort import OPTIMIZATION, op_session

    g = frontend.lower(mlp_model())
    model, feeds = single_op_model(g.ops[0], g)
    assert feeds == [n for n in g.ops[0].inputs if n] and "W1" in feeds and not model.graph.initializer
    session = op_session(model, "cpu", 1)
    options = session.get_session_options()
    assert options.graph_optimization_level == getattr(ort.GraphOptimizationLevel, OPTIMIZATION)
    assert not options.enable_cpu_mem_arena


def test_bundled_cpu_profile_prices_every_class_by_a_fitted_line():
    cpu = hardware.load("cpu")
    for cls in set(OP_CLASSES) - {"shape", "other"}:
        assert profile_class(cls, cpu) in cpu.op_class_overhead, cls
    assert {"conv", "conv_wgrad", "conv_grouped", "gemm", "matmul_batched"} <= set(cpu.op_class_flops)
    g = frontend.lower(mlp_model())
    assert op_time(g.ops[0], g, cpu) > 0


@pytest.mark.slow
def test_calibrate_fits_the_rows_it_returns():
    from onnx import TensorProto, helper

    from memsched.cost import fit_class_costs
    from memsched.measure import calibrate
    from memsched.onnx_utils import make_model

    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1 << 18])  # noqa: E731
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    reference = frontend.lower(make_model(helper.make_graph(nodes, "chain", [vi("x")], [vi("y")])))
    hw, rows = calibrate(repeats=3, references=[reference])
    mine = [r for r in rows if r["source"] == "chain"]
    assert sorted(r["op"] for r in mine) == ["Add", "Neg", "Relu"] and all(r["ops"] == 1 for r in mine)
    fit = fit_class_costs(rows)
    assert hw.op_class_overhead == {cls: line["overhead"] for cls, line in fit.items()}
    assert hw.op_class_bandwidth == {cls: line["bandwidth"] for cls, line in fit.items() if "bandwidth" in line}
    assert hw.op_class_flops == {cls: line["flops"] for cls, line in fit.items() if "flops" in line}


def test_dram_reads_follow_lru_reuse_distance_over_arena_buffers():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from memsched.measure import dram_reads
    from memsched.onnx_utils import make_model

    # A: a = x * W1; B: b = a * W2 (W2 is 8 KiB); C: c = sum(b); D: d = c * W1 -- W1 again
    inits = [numpy_helper.from_array(np.ones(256, np.float32), "W1"),
             numpy_helper.from_array(np.ones((8, 256), np.float32), "W2"),
             numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("Mul", ["x", "W1"], ["a"], name="A"),
             helper.make_node("Mul", ["a", "W2"], ["b"], name="B"),
             helper.make_node("ReduceSum", ["b", "axes"], ["c"], name="C", keepdims=0),
             helper.make_node("Mul", ["c", "W1"], ["d"], name="D")]
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    g = frontend.lower(make_model(helper.make_graph(nodes, "reuse", [vi("x", [256])], [vi("d", [256])], inits)))
    # a 4 KiB cache: D's working set fits, but W2 (8 KiB) went through since D's W1 was last read
    assert dram_reads(g, 4096) == {"A": 0, "B": 0, "C": 0, "D": 1024}
    assert dram_reads(g, 64 * 1024) == {"A": 0, "B": 0, "C": 0, "D": 0}


def test_ops_of_one_signature_share_a_session_whatever_tensor_fills_each_input():
    """x * x and a * b have one signature: the shared session is fed per input slot, so the
    second runs (it used to miss an input) and computes its own product."""
    import numpy as np
    from onnx import TensorProto, helper

    from memsched.onnx_utils import make_model

    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [8])  # noqa: E731
    for first, second in ((["x", "x"], ["a", "x"]), (["a", "x"], ["x", "x"])):
        nodes = [helper.make_node("Neg", ["x"], ["a"], name="neg"),
                 helper.make_node("Mul", first, ["p"], name="first"),
                 helper.make_node("Mul", second, ["q"], name="second"),
                 helper.make_node("Add", ["p", "q"], ["y"], name="add")]
        g = frontend.lower(make_model(helper.make_graph(nodes, "square", [vi("x")], [vi("y")])))
        model, feeds = single_op_model(g.op_by_name["first"], g)
        assert feeds == first and len(model.graph.input) == 2
        table = profile_graph(g, repeats=1, threads=1)
        assert table.meta["timed_ops"] == 3 and set(table.times) == {"neg", "first", "second", "add"}
    assert np.isfinite(list(table.times.values())).all()


SLOW_PROFILES = ("vgg16", "resnet50", "unet3d", "mobilenetv2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PROFILES else n
                                  for n in sorted(SMALL_MODELS)])
def test_every_bundled_training_step_profiles(name):
    """`memsched profile MODEL --train` on every bundled model: each op of the step is timed."""
    graph = training_graph(name)
    table = profile_graph(graph, repeats=1, threads=1)
    assert set(table.times) == {op.name for op in graph.ops}
    assert all(t >= 0 for t in table.times.values())


@pytest.mark.slow
def test_cli_profile_train_on_bert(cli, tmp_path):
    import json

    model = tmp_path / "bert.onnx"
    assert cli("models", "export", "bert-base", "-o", model, "--batch", "1", "--seq", "16", "--layers", "1"
               ).returncode == 0
    proc = cli("profile", model, "--train", "-o", tmp_path / "costs.json", "--repeats", "1", "--threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ops"] > report["timed_ops"] > 0 and report["total_s"] > 0


def test_process_memory_reports_bytes_or_says_it_cannot():
    """Growth is bytes from /proc (never negative), or None everywhere when unavailable. How
    much a block adds depends on what the allocator kept from earlier tests, so no amount is
    asserted here (bench/bench_footprint.py compares amounts in fresh processes)."""
    import numpy as np

    from memsched.measure import ProcessMemory

    memory = ProcessMemory()
    block = np.ones(8 * 2**20, np.uint8)
    figures = (memory.start, memory.current(), memory.peak(), memory.growth())
    if memory.available:
        assert all(isinstance(f, int) and f >= 0 for f in figures)
        assert memory.peak() >= memory.current() and memory.peak() - memory.start == memory.growth()
        # the block is anonymous memory: file-backed pages grow by far less than it (library code)
        assert memory.file_growth() is None or memory.file_growth() < 2**20
    else:
        assert figures == (None, None, None, None) and memory.file_growth() is None
    assert block.sum() == 8 * 2**20
