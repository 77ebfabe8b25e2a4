"""Drop the forward graph's no-op nodes before the training step is built from it.

An Identity, and a Dropout that drops nothing -- no training_mode input or a constant false
one (every inference-style export), or a constant ratio of 0 -- pass their input through
unchanged. Kept in the step, each is a real copy of its input in the forward pass, and its
output is one more tensor the backward pass may hold (BERT-base's eval-form Dropouts cost
75,497,472 B of peak): `drop_no_ops` reads the input wherever the output was read instead.

A node stays where its output is a graph output that cannot take the name over (its input
is a graph input, an initializer or another graph output), and a Dropout stays where its
mask output is read. Constant nodes that fed only dropped nodes go with them.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from onnx import numpy_helper

from memsched.ir import Graph, Op, tensor_value


def drop_no_ops(graph: Graph) -> Graph:
    """`graph` without its Identity nodes and identity Dropouts (see the module doc); the
    same Graph object where there is none."""
    dropped: list[Op] = []
    rename: dict[str, str] = {}    # tensor -> the tensor read instead
    outputs = list(graph.outputs)
    for op in graph.ops:
        if not _is_no_op(graph, op):
            continue
        x, y = _resolve(rename, op.inputs[0]), op.outputs[0]
        if y not in outputs:
            rename[y] = x
        elif x in graph.producer and x not in outputs and x not in graph.inputs:
            rename[x] = y          # the producer writes the graph output itself
        else:
            continue
        dropped.append(op)
    if not dropped:
        return graph
    names = {op.name for op in dropped}
    fed = {t for op in dropped for t in op.present_inputs[1:]}
    ops = []
    for op in graph.ops:
        if op.name in names or (op.op_type == "Constant" and _feeds_only(graph, op, names, fed)):
            continue
        ops.append(dataclasses.replace(op, inputs=[_resolve(rename, t) if t else t for t in op.inputs],
                                       outputs=[_resolve(rename, t) if t else t for t in op.outputs]))
    used = set(graph.inputs) | set(outputs) | {t for op in ops for t in op.present_inputs + op.present_outputs}
    tensors = {n: t for n, t in graph.tensors.items() if n in used or (t.is_static and n not in fed)}
    return graph.replace(ops=ops, tensors=tensors, outputs=outputs)


def _resolve(rename: dict[str, str], name: str) -> str:
    while name in rename:
        name = rename[name]
    return name


def _feeds_only(graph: Graph, op: Op, dropped: set[str], fed: set[str]) -> bool:
    return all(t in fed and t not in graph.outputs and all(c.name in dropped for c in graph.consumers.get(t, []))
               for t in op.present_outputs)


def _is_no_op(graph: Graph, op: Op) -> bool:
    if op.domain not in ("", "ai.onnx") or not op.inputs or not op.inputs[0]:
        return False
    if op.op_type == "Identity":
        return True
    if op.op_type != "Dropout":
        return False
    if len(op.outputs) > 1 and op.outputs[1] and (graph.consumers.get(op.outputs[1]) or op.outputs[1] in graph.outputs):
        return False
    training = _constant(graph, op.inputs[2]) if len(op.inputs) > 2 and op.inputs[2] else np.asarray(False)
    ratio = _constant(graph, op.inputs[1]) if len(op.inputs) > 1 and op.inputs[1] else np.asarray(0.5)
    if training is not None and not bool(training):
        return True
    return ratio is not None and float(ratio) == 0.0


def _constant(graph: Graph, name: str) -> np.ndarray | None:
    """The value of a scalar known before running (an initializer or a Constant node), else None."""
    t = graph.tensors.get(name)
    if t is None or name in graph.inputs:
        return None
    if t.is_static:
        return tensor_value(t, graph.base_dir)
    producer = graph.producer.get(name)
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return numpy_helper.to_array(producer.attributes["value"])
    return None
