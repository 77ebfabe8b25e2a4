"""The executor's footprint beyond its arena: kernels' scratch comes from one arena shared by
every session (ONNX Runtime's environment allocator), reserved once and reused by every step,
so a step after the first neither maps nor faults in a kernel's scratch again."""
from __future__ import annotations

import resource

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from memsched.runtime import run_plan
from memsched.ort import bound_options, session_options
from tests.planbuild import lower_graph, order_plan

PAGE = resource.getpagesize()


def _big_scratch_plan():
    """One 3x3 ConvTranspose (a Conv's input gradient) whose column buffer (64 * 9 * 128 * 128
    floats, 36 MiB) is larger than any malloc threshold, so without a kept arena it is a fresh
    mapping, faulted in, on every run."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32), "w")
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="convt", pads=[1, 1, 1, 1])]
    graph = lower_graph(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [1, 64, 128, 128])],
                        [helper.make_tensor_value_info("y", TP.FLOAT, [1, 64, 128, 128])], [weight], "convt")
    return order_plan(graph), 64 * 9 * 128 * 128 * 4


def test_bound_sessions_take_scratch_from_the_shared_arena():
    options = bound_options(1)
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    assert not options.enable_cpu_mem_arena and not options.enable_mem_pattern
    assert session_options(1).enable_cpu_mem_arena      # the reference is a plain session with its own arena


def test_later_steps_do_not_fault_kernel_scratch_in_again():
    plan, scratch = _big_scratch_plan()
    faults = []

    def progress(done, total):
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    result = run_plan(plan, steps=4, threads=1, progress=progress)
    assert result.sessions == 1 and result.ops == 1
    later = max(b - a for a, b in zip(faults, faults[1:]))     # page faults of each step after the first
    assert later * PAGE < scratch / 4, f"{later} page faults in a step after the first"
