"""Cheap forward values derived again in the backward pass instead of kept from the forward.

A layer's weight gradient reads the layer's input: dW = x^T dY. Where x is the output of a
cheap elementwise op or a LayerNormalization whose own inputs the backward pass keeps anyway
(for their own gradients), keeping x as well from the forward pass to the backward pass holds
one more activation-sized tensor for nothing. This pass re-derives such an x right before its
first backward reader, from the kept inputs, and lets those readers read the copy: the
original dies once the forward has used it, and the copy is a transient of a few elementwise
ops. It is what torch.compile's min-cut partitioner does with pointwise ops, at any memory
budget; in eager PyTorch every x is kept.

In a transformer the GELU output (the input of the second feed-forward Linear: batch x seq x
4 hidden) is derived again from the GELU input, which GELU's backward keeps, and each
LayerNorm output (the input of the next attention block's or feed-forward block's Linears)
from the LayerNorm input and its mean and inverse deviation, which LayerNorm's backward keeps:
BERT-base keeps three tensors of batch x seq x hidden fewer per layer, 226 MB at 8 x 128.

A value x qualifies (`_derivation`) when its producer is a forward op of REDERIVABLE type that
draws no random number, x is no graph output, and each input of that producer is an
initializer or a constant, a tensor the backward pass reads at or after x's first backward reader (so it is
alive there anyway), or itself qualifies (a chain of at most MAX_CHAIN ops, such as a GELU
written out in primitive ops). A tensor some derivation reads as kept is never derived again
itself. The copies are bitwise the forward's values (the same ops on the same tensors), so
the gradients do not change. The step is rewritten only where that lowers its peak in its own
order: where parameters and gradients make the peak (a small batch), the copies would only
add work.
"""
from __future__ import annotations

import dataclasses

from memsched.ir import Graph, Op, Tensor
from memsched.memory import analyze
from memsched.ops import ELEMENTWISE_OPS, VIEW_OPS, draws_random
from memsched.schedule import default_schedule

# elementwise ops, LayerNormalization, and the shape views between them and the layer reading them
REDERIVABLE = (ELEMENTWISE_OPS - {"Dropout"}) | {"LayerNormalization"} | VIEW_OPS
MAX_CHAIN = 10     # forward ops re-run for one value (a GELU written out: 5 for erf, 8 for tanh)


def rederive_in_backward(graph: Graph) -> Graph:
    """`graph` (a training step) with every qualifying value (module doc) derived again right
    before its first backward reader; the graph itself where none qualifies."""
    ops = graph.ops
    producer = graph.producer
    backward_reads: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        if op.phase == "backward":
            for t in dict.fromkeys(op.present_inputs):
                backward_reads.setdefault(t, []).append(i)
    outputs = set(graph.outputs)
    candidates = sorted((t for t in backward_reads if _qualifies_as_value(graph, t, outputs)),
                        key=lambda t: (-graph.tensors[t].nbytes, backward_reads[t][0]))
    chosen: dict[str, list[Op]] = {}      # value -> the forward ops that derive it, in order
    anchors: set[str] = set()             # tensors some derivation reads as kept
    for t in candidates:
        if t in anchors:
            continue
        at = backward_reads[t][0]
        found = _derivation(graph, t, at, backward_reads, set(chosen), outputs)
        if found is None:
            continue
        chain, kept = found
        if kept & set(chosen):
            continue
        chosen[t] = chain
        anchors |= kept
    if not chosen:
        return graph
    derived = _emit(graph, chosen, backward_reads, producer)
    return derived if _peak(derived) < _peak(graph) else graph


def _peak(graph: Graph) -> int:
    """The peak of `graph` in its own order (the memory model, no in-place reuse)."""
    return analyze(graph, default_schedule(graph)).peak_bytes


def _qualifies_as_value(graph: Graph, t: str, outputs: set[str]) -> bool:
    op = graph.producer.get(t)
    return (op is not None and op.phase == "forward" and op.op_type in REDERIVABLE and not op.domain
            and op.outputs[0] == t and not draws_random(op) and t not in outputs and graph.tensors[t].nbytes > 0)


def _derivation(graph: Graph, t: str, at: int, backward_reads: dict[str, list[int]], derived: set[str],
                outputs: set[str]) -> tuple[list[Op], set[str]] | None:
    """(the forward ops that derive `t` again, in forward order; the tensors they read as
    kept) where `t` can be derived at op index `at` from kept tensors, else None."""
    chain: list[Op] = []
    kept: set[str] = set()

    def visit(name: str) -> bool:
        op = graph.producer[name]
        if op in chain:
            return True
        if len(chain) >= MAX_CHAIN:
            return False
        for u in op.present_inputs:
            tensor = graph.tensors[u]
            if tensor.is_static or tensor.kind == "constant" or u in graph.inputs:
                continue
            if u not in derived and backward_reads.get(u, [-1])[-1] >= at:
                kept.add(u)
                continue
            if not _qualifies_as_value(graph, u, outputs) or not visit(u):
                return False
        chain.append(op)
        return True

    if not visit(t) or all(op.op_type in VIEW_OPS for op in chain):   # a view of a kept tensor costs nothing
        return None
    return chain, kept


def _emit(graph: Graph, chosen: dict[str, list[Op]], backward_reads: dict[str, list[int]],
          producer: dict[str, Op]) -> Graph:
    """The graph with each chosen value's chain cloned right before its first backward reader
    and every backward reader reading the clone."""
    taken = set(graph.tensors) | {op.name for op in graph.ops}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        return name

    tensors = dict(graph.tensors)
    before: dict[int, list[Op]] = {}      # op index -> clones emitted right before it
    renamed: dict[int, dict[str, str]] = {}   # backward op index -> {value: its clone}
    for t, chain in chosen.items():
        at = backward_reads[t][0]
        copies: dict[str, str] = {}
        for op in chain:
            outs = [op.outputs[0]]       # a LayerNormalization's statistics are not needed again
            new_outs = [fresh(f"{o}.rederived") for o in outs]
            for o, n in zip(outs, new_outs):
                tensors[n] = Tensor(n, graph.tensors[o].shape, graph.tensors[o].dtype, "activation")
                copies[o] = n
            clone = dataclasses.replace(op, name=fresh(f"{op.name}/rederived"), phase="backward",
                                        inputs=[copies.get(u, u) for u in op.inputs], outputs=new_outs,
                                        attributes=dict(op.attributes))
            before.setdefault(at, []).append(clone)
        for i in backward_reads[t]:
            renamed.setdefault(i, {})[t] = copies[t]
    ops: list[Op] = []
    for i, op in enumerate(graph.ops):
        ops.extend(before.get(i, []))
        if i in renamed:
            op = dataclasses.replace(op, inputs=[renamed[i].get(u, u) for u in op.inputs])
        ops.append(op)
    return graph.replace(ops=ops, tensors=tensors)
