"""Hand-built graphs, hardware and cost tables with round numbers, so simulated times are exact."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from memsched import frontend
from memsched.cost import CostTable
from memsched.hardware import Hardware, HostTier
from memsched.onnx_utils import make_model

N = 256          # floats per tensor: 1024 bytes


def lower(nodes, inputs, outputs, initializers=()):
    """Lower a graph of float32 [N] tensors made with onnx.helper."""
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [N])  # noqa: E731
    graph = helper.make_graph(nodes, "hand", [vi(n) for n in inputs], [vi(n) for n in outputs],
                              [numpy_helper.from_array(np.ones(N, np.float32), name) for name in initializers])
    return frontend.lower(make_model(graph))


def chain():
    """A(x)->a, B(a)->b, C1(b)->c1, C2(c1)->c2, D(a, c2)->out: `a` is needed again at the end."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="A"),
             helper.make_node("Relu", ["a"], ["b"], name="B"),
             helper.make_node("Relu", ["b"], ["c1"], name="C1"),
             helper.make_node("Relu", ["c1"], ["c2"], name="C2"),
             helper.make_node("Add", ["a", "c2"], ["out"], name="D")]
    return lower(nodes, ["x"], ["out"])


def hardware(link=1024.0, latency=0.0, nvdimm_capacity=1 << 20) -> Hardware:
    """1024 B/s each way (a 1024-byte tensor moves in 1 s); DRAM faster than the link; NVDIMM
    reads at the link rate, writes at half of it and adds 0.25 s latency."""
    return Hardware(name="hand", device_memory=1 << 20, peak_flops={"float32": 1024.0}, memory_bandwidth=1024.0,
                    launch_overhead=0.0, link_h2d=link, link_d2h=link, link_latency=latency,
                    tiers={"dram": HostTier(1 << 20, 2048.0, 2048.0, 0.0),
                           "nvdimm": HostTier(nvdimm_capacity, 1024.0, 512.0, 0.25)})


def costs(**seconds) -> CostTable:
    return CostTable(dict(seconds))
