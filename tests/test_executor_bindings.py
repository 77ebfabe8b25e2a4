"""How the executor binds values and judges a run, checked on the CPU: the integer constants
read from host arrays (the CUDA provider reads shape-like inputs on the host), the test for
nodes ONNX Runtime added to a segment, and the scaled tolerance of a check on CUDA."""
from __future__ import annotations

import ctypes
import inspect

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from memsched import ort
from memsched.runtime import check, device, program, run
from memsched import cuda
from memsched.ir import Graph
from tests.planbuild import cnn_graph, mlp_train_graph, order_plan, strategy_plans


def _shape_graph() -> Graph:
    """x[2,3] -> Unsqueeze(axes from a Constant) -> Reshape(shape from Shape) -> Gather(0-d index)
    -> y; plus an integer initializer the step updates, and one the caller feeds."""
    nodes = [
        helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
        helper.make_node("Shape", ["x"], ["s"], start=1),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Reshape", ["u", "flat"], ["r"]),
        helper.make_node("Gather", ["r", "k"], ["y"], axis=1),
        helper.make_node("Add", ["step", "one"], ["step.updated"]),
        helper.make_node("Identity", ["given"], ["given_out"]),
    ]
    inits = [numpy_helper.from_array(np.array([2, 3], np.int64), "flat"),
             numpy_helper.from_array(np.array(1, np.int64), "k"),
             numpy_helper.from_array(np.array(0, np.int64), "step"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([7], np.int32), "given")]
    g = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2]),
                           helper.make_tensor_value_info("s", TP.INT64, [1]),
                           helper.make_tensor_value_info("n", TP.INT64, []),
                           helper.make_tensor_value_info("step.updated", TP.INT64, []),
                           helper.make_tensor_value_info("given_out", TP.INT32, [1])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return Graph.from_onnx(onnx.shape_inference.infer_shapes(model))


def test_host_constants_are_the_values_fixed_for_the_step():
    graph = _shape_graph()
    values = program.host_constants(graph, {"given": np.array([5], np.int32)})
    assert set(values) == {"axes", "s", "n", "flat", "k", "one"}   # not the updated step, not a feed
    assert values["axes"].tolist() == [1] and values["axes"].dtype == np.int64
    assert values["s"].tolist() == [3]                              # Shape's start=1
    assert values["n"].shape == () and int(values["n"]) == 6        # a 0-d value stays 0-d
    assert values["k"].shape == () and values["flat"].tolist() == [2, 3]


def test_constants_read_from_host_need_no_write_and_end_no_segment():
    """A float Constant is read from the host too; its write into the arena is dropped, so a
    Constant placed where a dead tensor was no longer ends the segment: one session."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.full((2, 3), 2, np.float32))),
             helper.make_node("Mul", ["b", "c"], ["y"])]
    g = helper.make_graph(nodes, "consts", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    graph = Graph.from_onnx(onnx.shape_inference.infer_shapes(model))
    assert program.host_constants(graph, {})["c"].tolist() == [[2.0] * 3] * 2
    plan = order_plan(graph)
    result = run.run_plan(plan, steps=2, check=True, inputs={"x": np.ones((2, 3), np.float32)})
    assert result.check["passed"] and result.check["bit_identical"] and result.sessions == 1
    assert result.outputs["y"].tolist() == [[-2.0] * 3] * 2


def test_a_run_reading_host_constants_equals_the_plain_run():
    graph = _shape_graph()
    plan = order_plan(graph)
    result = run.run_plan(plan, steps=2, check=True, inputs={"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    assert result.check["passed"] and result.check["bit_identical"]
    assert result.outputs["y"].tolist() == [1.0, 4.0]


def test_added_nodes_are_seen_in_the_saved_graph(tmp_path):
    model = ort.one_op_model("Relu")
    model.graph.node[0].name = "n0"
    saved = str(tmp_path / "segment.onnx")
    ort.bound_session(model.SerializeToString(), 1, "cpu", None, saved)
    assert device.adds_no_nodes(saved, {"n0"})
    assert not device.adds_no_nodes(saved, {"n0", "n1"})             # a node of ours went missing
    assert not device.adds_no_nodes(str(tmp_path / "absent.onnx"), {"n0"})   # nothing saved: nothing assumed


def test_cuda_check_scales_the_difference_by_the_output():
    def step(diff, scale):
        return {"w": {"max_abs_diff": diff, "bit_identical": False, "scale": scale}}

    assert check.check_summary([step(5e-4, 10.0)], exact=False)["passed"]          # 5e-5 of its scale
    assert not check.check_summary([step(5e-4, 1.0)], exact=False)["passed"]
    assert not check.check_summary([step(5e-4, 10.0)], exact=True)["passed"]       # CPU: bits or nothing
    compared = check.compare_outputs({"w": np.array([0.0, 20.0], np.float32)},
                                        {"w": np.array([0.0, -30.0], np.float32)})
    assert compared["w"]["scale"] == 30.0 and compared["w"]["max_abs_diff"] == 50.0


def test_copy_waits_hold_when_copies_land_as_late_as_cuda_allows(monkeypatch):
    """On CUDA a swap copy runs on its own stream and is only known to be done once waited
    for. Emulated on the CPU at its worst -- each copy's bytes move only when its event is
    waited for, and segments are cut at waits as on CUDA -- every swapping plan still equals
    the plain run bit for bit: no op reads a swapped-in tensor, and no op overwrites a
    swapped-out one, before the copy's wait."""
    pending: dict[int, tuple] = {}

    def land(rt, event):
        kind, lo, hi, store = pending.pop(event)
        if kind == "out":
            store[:] = rt.arena[lo:hi]
        else:
            rt.arena[lo:hi] = store

    def wait(rt, events):
        for event in events:
            if event in pending:
                land(rt, event)

    def wait_all(rt):
        for event in sorted(pending):
            land(rt, event)

    issued = []

    def later(kind):
        def copy(rt, lo, hi, store, event):
            pending[event] = (kind, lo, hi, store)
            issued.append(event)
        return copy

    synchronize = device.Runtime.synchronize
    monkeypatch.setattr(device.Runtime, "copy_out", later("out"))
    monkeypatch.setattr(device.Runtime, "copy_in", later("in"))
    monkeypatch.setattr(device.Runtime, "wait", wait)
    monkeypatch.setattr(device.Runtime, "wait_all", wait_all)
    monkeypatch.setattr(device.Runtime, "synchronize", lambda rt: (wait_all(rt), synchronize(rt)))
    items = program._items

    def as_on_cuda(actions, graph, split, order, hooks, unwritten=frozenset(), copy_base=None):
        return items(actions, graph, True, order, hooks, unwritten)        # copies as steps of their own

    monkeypatch.setattr(program, "_items", as_on_cuda)
    for graph in (mlp_train_graph(), cnn_graph()):
        plan = strategy_plans(graph)["swap"]
        assert any(step.kind == "swap_in" for step in plan.schedule)
        issued.clear()
        result = run.run_plan(plan, steps=2, check=True)
        assert result.check["passed"] and result.check["bit_identical"] and not pending
        assert issued, "no copy ran as a step of its own"


class _HostCuda:
    """cuda.CudaStreams over host memory, refusing what CUDA leaves undefined (a device-to-
    device copy between overlapping ranges): each copy is a memmove, done when it returns."""

    def __init__(self):
        self.kinds = []
        self.compute = ctypes.c_void_p()        # no stream: the sessions run on the CPU

    def copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self.kinds.append(kind)
        if kind == cuda.CudaStreams.D2D:
            assert dst + nbytes <= src or src + nbytes <= dst, "cudaMemcpy between overlapping ranges"
        ctypes.memmove(dst, src, nbytes)

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int, event: int) -> None:
        self.copy(dst, src, nbytes, kind)

    def memset(self, ptr: int, byte: int, nbytes: int) -> None:
        ctypes.memset(ptr, byte, nbytes)

    # every copy is done when it returns, as in the host arena: nothing to wait for or free
    wait, synchronize, pinned, close = (device.HostArena.wait, device.HostArena.synchronize,
                                        device.HostArena.pinned, device.HostArena.close)


class _HostBuffer:
    """A device allocation as the CUDA arena sees one (ONNX Runtime's OrtValue), in host memory."""

    def __init__(self, nbytes: int):
        self.array = device.HostArena(nbytes).bytes

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def tensor_size_in_bytes(self) -> int:
        return self.array.nbytes


def _cuda_arena_on_the_host(nbytes: int) -> cuda.CudaArena:
    return cuda.CudaArena(_HostBuffer(nbytes), nbytes, _HostCuda())


def test_a_move_between_overlapping_arena_ranges_on_cuda_goes_through_the_host():
    """Between steps an update moves to where its tensor starts; the two ranges may overlap
    (GPT-2's step at 60% on an H200 moved a weight 0.1 off), and a device-to-device copy of
    overlapping ranges is undefined, so such a move goes through the host."""
    arena = _cuda_arena_on_the_host(64)
    with device.Runtime("cpu", 64, 1, None, arena=arena) as rt:
        host = arena.buffer.array
        host[:] = np.arange(64, dtype=np.uint8)
        rt.put(("arena", 0, 32), ("arena", 16, 48))            # overlapping: through the host
        assert host[:32].tolist() == list(range(16, 48))
        assert cuda.CudaStreams.D2D not in arena.streams.kinds
        rt.put(("arena", 48, 64), ("arena", 0, 16))            # apart: one device copy
        assert host[48:].tolist() == list(range(16, 32))
        assert arena.streams.kinds[-1] == cuda.CudaStreams.D2D


def test_the_cuda_arena_runs_a_swapping_plan_as_the_host_arena_does(monkeypatch):
    """Every byte the executor moves on CUDA goes through cuda.CudaArena: with its copies done
    over host memory (the sessions on the CPU, bound in its buffer), a swapping plan's checked
    run equals the plain run bit for bit, and its copies went both ways and by the device."""
    made = []

    def arena(device_name, nbytes):
        made.append(_cuda_arena_on_the_host(nbytes))
        return made[-1]

    monkeypatch.setattr(device, "make_arena", arena)
    plan = strategy_plans(mlp_train_graph())["swap"]
    result = run.run_plan(plan, steps=2, check=True)
    assert result.check["passed"] and result.check["bit_identical"]
    kinds = set(made[0].streams.kinds)
    assert {cuda.CudaStreams.H2D, cuda.CudaStreams.D2H} <= kinds


def test_a_checked_run_asks_every_session_and_the_reference_for_float32_kernels(monkeypatch):
    seen = []

    def recording(make):
        def wrapped(*args, **kwargs):
            bound = inspect.signature(make).bind(*args, **kwargs)
            bound.apply_defaults()
            seen.append(bound.arguments["tf32"])
            return make(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(device, "bound_session", recording(ort.bound_session))
    monkeypatch.setattr(check, "reference_session", recording(ort.reference_session))
    plan = order_plan(mlp_train_graph())
    run.run_plan(plan, steps=1, check=True)
    assert len(seen) >= 2 and not any(seen)
    seen.clear()
    run.run_plan(plan, steps=1)
    assert seen and all(seen)
