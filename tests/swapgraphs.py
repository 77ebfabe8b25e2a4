"""Graphs for the swap planner's tests: hand-sized chains (exact times on simgraphs.hardware)
and random training-shaped MLP steps (forward chain, mirrored backward reading the forward
activations, SGD updates at the end)."""
from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from memsched import frontend
from memsched.hardware import Hardware
from memsched.onnx_utils import make_model

from .simgraphs import hardware, lower


def relu_chain():
    """x->A->a, a->B->b, b->C->c, c->D->d, (c,d)->E->e, e->F->f, f->G->g, (a,g)->H->out.

    1024 bytes per tensor; on simgraphs.hardware a Relu takes 2 s, an Add 3 s (18 s in all).
    Device bytes per step: 2048 2048 3072 3072 4096 3072 3072 3072: `a` idles from B to H,
    across the peak at E."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="A"),
             helper.make_node("Relu", ["a"], ["b"], name="B"),
             helper.make_node("Relu", ["b"], ["c"], name="C"),
             helper.make_node("Relu", ["c"], ["d"], name="D"),
             helper.make_node("Add", ["c", "d"], ["e"], name="E"),
             helper.make_node("Relu", ["e"], ["f"], name="F"),
             helper.make_node("Relu", ["f"], ["g"], name="G"),
             helper.make_node("Add", ["a", "g"], ["out"], name="H")]
    return lower(nodes, ["x"], ["out"])


def weight_chain(deep: bool = False):
    """A: a = Relu(w) of a weight w, B..E as in relu_chain, H: h = a + e, I: out = h * w.

    Device bytes per step: 2048 3072 4096 4096 5120 4096 3072 (17 s in all). At E either `a`
    (idle from B to H) or `w` (idle from A to I) must be off the device; w is resident where
    H needs `a`, so recomputing `a` costs one Relu (2 s).
    deep: A0: m = Relu(w) first and A: a = Relu(m): 2048 3072 3072 4096 4096 5120 4096 3072
    (19 s); rebuilding `a` before H replays A0 and A (4 s), m living only while they run."""
    head = [helper.make_node("Relu", ["w"], ["m"], name="A0"), helper.make_node("Relu", ["m"], ["a"], name="A")] \
        if deep else [helper.make_node("Relu", ["w"], ["a"], name="A")]
    nodes = head + [helper.make_node("Relu", ["a"], ["b"], name="B"),
                    helper.make_node("Relu", ["b"], ["c"], name="C"),
                    helper.make_node("Relu", ["c"], ["d"], name="D"),
                    helper.make_node("Add", ["c", "d"], ["e"], name="E"),
                    helper.make_node("Add", ["a", "e"], ["h"], name="H"),
                    helper.make_node("Mul", ["h", "w"], ["out"], name="I")]
    return lower(nodes, [], ["out"], initializers=["w"])


def weights_only():
    """y_i = y_{i-1} * w_i for four 1024-byte weights: the weights alone hold 4096 bytes."""
    nodes = [helper.make_node("Mul", ["x" if i == 1 else f"y{i - 1}", f"w{i}"], [f"y{i}"], name=f"M{i}")
             for i in range(1, 5)]
    return lower(nodes, ["x"], ["y4"], initializers=[f"w{i}" for i in range(1, 5)])


def with_tiers(hw: Hardware, dram: int | None = None, nvdimm: int | None = None) -> Hardware:
    """`hw` with other host tier capacities."""
    tiers = dict(hw.tiers)
    if dram is not None:
        tiers["dram"] = dataclasses.replace(tiers["dram"], capacity=dram)
    if nvdimm is not None:
        tiers["nvdimm"] = dataclasses.replace(tiers["nvdimm"], capacity=nvdimm)
    return dataclasses.replace(hw, tiers=tiers)


def training_mlp(widths: list[int], batch: int = 2):
    """One SGD step of an MLP: m_i = h_i W_i, h_{i+1} = Relu(m_i); backward from g = h_L:
    dm_i = g_{i+1} * h_{i+1} (reads the activation), dW_i = h_i^T dm_i, g_i = dm_i W_i^T;
    then W_i.updated = W_i - dW_i for every layer, all at the end (the framework order)."""
    rng = np.random.default_rng(0)
    layers = len(widths) - 1
    inits = [numpy_helper.from_array(rng.standard_normal((widths[i], widths[i + 1])).astype(np.float32), f"W{i}")
             for i in range(layers)]
    nodes = []
    for i in range(layers):
        h = "x" if i == 0 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"], name=f"fc{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"h{i + 1}"], name=f"relu{i}"))
    grad = f"h{layers}"
    for i in reversed(range(layers)):
        h = "x" if i == 0 else f"h{i}"
        nodes.append(helper.make_node("Mul", [grad, f"h{i + 1}"], [f"dm{i}"], name=f"relu{i}_grad"))
        nodes.append(helper.make_node("Transpose", [h], [f"{h}T"], name=f"fc{i}_hT", perm=[1, 0]))
        nodes.append(helper.make_node("MatMul", [f"{h}T", f"dm{i}"], [f"dW{i}"], name=f"fc{i}_dW"))
        if i > 0:
            nodes.append(helper.make_node("Transpose", [f"W{i}"], [f"W{i}T"], name=f"fc{i}_WT", perm=[1, 0]))
            nodes.append(helper.make_node("MatMul", [f"dm{i}", f"W{i}T"], [f"g{i}"], name=f"fc{i}_dX"))
            grad = f"g{i}"
    for i in range(layers):
        nodes.append(helper.make_node("Sub", [f"W{i}", f"dW{i}"], [f"W{i}.updated"], name=f"sgd{i}"))
    outputs = [helper.make_tensor_value_info(f"W{i}.updated", TensorProto.FLOAT, [widths[i], widths[i + 1]])
               for i in range(layers)]
    graph = helper.make_graph(nodes, "mlp_step", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                [batch, widths[0]])],
                              outputs, inits)
    return frontend.lower(make_model(graph))


def toy_hardware(dram: int = 1 << 30, nvdimm: int = 1 << 30) -> Hardware:
    """simgraphs.hardware with a 10 ms link latency and the given host tier capacities."""
    return with_tiers(hardware(latency=0.01), dram, nvdimm)


__all__ = ["relu_chain", "weight_chain", "weights_only", "training_mlp", "with_tiers", "toy_hardware"]
