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

In a CNN whose BatchNorm keeps its normalised input x^ (`bn_relu`), the BN output and its
ReLU are derived again from x^; where a BN keeps its input, from that input and the batch
statistics. Either way one activation-sized tensor per conv -> BN -> ReLU stays, where
PyTorch keeps two.

A value x qualifies (`_derivation`) when its producer is a forward op of a REDERIVABLE_OPS type (memsched.ops) that
draws no random number, x is no graph output, and each input of that producer is an
initializer or a constant, a tensor the backward pass reads at or after x's first backward
reader (so it is alive there anyway), or itself qualifies (a chain of at most MAX_CHAIN ops,
such as a GELU written out in primitive ops). Two ways of choosing are tried: derive such an
input too wherever it can be (then only what the backward keeps for its own use stays), or
read every input the backward keeps as kept; a tensor some derivation reads as kept is never
derived again itself. The copies are bitwise the forward's values (the same ops on the same
tensors), so the gradients do not change. The step is rewritten, the better way, only where
that lowers its peak in its own order: where parameters and gradients make the peak (a small
batch), the copies would only add work.
"""
from __future__ import annotations

import dataclasses

from memsched.ir import Graph, Op, Tensor
from memsched.memory import analyze
from memsched.ops import REDERIVABLE_OPS, draws_random, is_view
from memsched.schedule import default_schedule

MAX_CHAIN = 10     # forward ops re-run for one value (a GELU written out: 5 for erf, 8 for tanh)
# how deep a derivation looks back through the forward: a chain of 1,200 cheap ops otherwise
# recursed past Python's limit (each op appends itself only once its inputs are derived)
MAX_DEPTH = 4 * MAX_CHAIN


def rederive_in_backward(graph: Graph) -> Graph:
    """`graph` (a training step) with every qualifying value (module doc) derived again right
    before its first backward reader; the graph itself where none qualifies."""
    ops = graph.ops
    backward_reads: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        if op.phase == "backward":
            for t in dict.fromkeys(op.present_inputs):
                backward_reads.setdefault(t, []).append(i)
    outputs = set(graph.outputs)
    candidates = sorted((t for t in backward_reads if _qualifies_as_value(graph, t, outputs)),
                        key=lambda t: (-graph.tensors[t].nbytes, backward_reads[t][0]))
    best, peak = graph, None
    for derive_inputs in (True, False):     # the second only where strictly lower
        chosen = _choose(graph, candidates, backward_reads, outputs, derive_inputs)
        if chosen:
            derived = _emit(graph, chosen, backward_reads)
            derived_peak = _peak(derived)
            peak = _peak(graph) if peak is None else peak     # judged only where there is a rewrite
            if derived_peak < peak:
                best, peak = derived, derived_peak
    return best


def _choose(graph: Graph, candidates: list[str], backward_reads: dict[str, list[int]], outputs: set[str],
            derive_inputs: bool) -> dict[str, list[Op]]:
    """{value: the forward ops that derive it, in order} for the candidates, largest first,
    that `_derivation` can derive without a tensor another derivation reads as kept."""
    chosen: dict[str, list[Op]] = {}
    anchors: set[str] = set()             # tensors some derivation reads as kept: they stay kept
    for t in candidates:
        if t in anchors:
            continue
        found = _derivation(graph, t, backward_reads[t][0], backward_reads, anchors, set(chosen), outputs,
                            derive_inputs)
        if found is None or found[1] & set(chosen):
            continue
        chosen[t], kept = found
        anchors |= kept
    return chosen


def _peak(graph: Graph) -> int:
    """The peak of `graph` in its own order (the memory model, no in-place reuse)."""
    return analyze(graph, default_schedule(graph)).peak_bytes


def _qualifies_as_value(graph: Graph, t: str, outputs: set[str]) -> bool:
    op = graph.producer.get(t)
    return (op is not None and op.phase == "forward" and op.op_type in REDERIVABLE_OPS and not op.domain
            and op.outputs[0] == t and not draws_random(op) and t not in outputs and graph.tensors[t].nbytes > 0)


def _derivation(graph: Graph, t: str, at: int, backward_reads: dict[str, list[int]], anchors: set[str],
                derived: set[str], outputs: set[str], derive_inputs: bool) -> tuple[list[Op], set[str]] | None:
    """(the forward ops that derive `t` again, in forward order; the tensors they read as
    kept) where `t` can be derived at op index `at`, else None. An input the backward keeps
    anyway is read as kept; with `derive_inputs`, an input that can itself be derived is
    derived first (unless another derivation reads it as kept), so that only what the backward
    keeps for its own use stays (a BN output under its ReLU, both derived from x^)."""
    chain: list[Op] = []
    kept: set[str] = set()

    def visit(name: str, depth: int = 0) -> bool:
        op = graph.producer[name]
        if op in chain:
            return True
        if len(chain) >= MAX_CHAIN or depth > MAX_DEPTH:
            return False
        for u in op.present_inputs:
            tensor = graph.tensors[u]
            if tensor.is_static or tensor.kind == "constant" or u in graph.inputs:
                continue
            if derive_inputs and u not in anchors and _qualifies_as_value(graph, u, outputs):
                mark, before = len(chain), set(kept)
                if visit(u, depth + 1):
                    continue
                del chain[mark:]
                kept.intersection_update(before)
            if u not in derived and backward_reads.get(u, [-1])[-1] >= at:      # alive at `at` anyway
                kept.add(u)
                continue
            if derive_inputs or not _qualifies_as_value(graph, u, outputs) or not visit(u, depth + 1):
                return False
        chain.append(op)
        return True

    if not visit(t) or all(is_view(op) for op in chain):   # a view of a kept tensor costs nothing
        return None
    return chain, kept


def _emit(graph: Graph, chosen: dict[str, list[Op]], backward_reads: dict[str, list[int]]) -> Graph:
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
    copies: dict[str, str] = {}           # value -> its clone, shared by the derivations after it
    for t, chain in sorted(chosen.items(), key=lambda item: backward_reads[item[0]][0]):
        at = backward_reads[t][0]
        for op in chain:
            out = op.outputs[0]           # a LayerNormalization's statistics are not needed again
            if out in copies:
                continue
            copies[out] = fresh(f"{out}.rederived")
            tensors[copies[out]] = Tensor(copies[out], graph.tensors[out].shape, graph.tensors[out].dtype, "activation")
            clone = dataclasses.replace(op, name=fresh(f"{op.name}/rederived"), phase="backward",
                                        inputs=[copies.get(u, u) for u in op.inputs], outputs=[copies[out]],
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
