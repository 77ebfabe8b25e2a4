"""BatchNormalization + activation stored once: a conv -> BN -> ReLU keeps one activation-sized
tensor for the backward pass, not two.

Differentiated layer by layer, a conv -> BN -> ReLU (ReLU6, exported as Clip, alike) holds two
tensors from the forward pass to the backward pass, as PyTorch does: the BN input c (BN's
backward normalises it again) and the activation's output r (its mask, and the input of the
next layer's weight gradient); a Clip's mask reads its input b, the BN output, a third. This
module keeps only x^ = (c - mean) * inv_std (the idea of in-place activated BatchNorm, Rota
Bulo et al. 2018):

- BN's forward (rules_nn) computes b = x^ * scale + bias from x^, and its backward reads x^ as
  it is: c dies as soon as the forward has normalised it;
- `passes.training.rederive` then derives b' = x^ * scale + bias and r' = act(b') again right
  before the first backward op that reads b or r, and has every backward reader (the
  activation's mask, the next Conv's weight gradient, ...) read them instead: r and b die
  once the forward ops that read them have run, and the derived pair is a transient of a few
  elementwise ops.

x^ rather than b, which in-place activated BatchNorm keeps: recovering x^ from b divides by the
scale, (b - bias) / scale, which loses precision where |scale| is small against |bias| and
everything at scale 0 (that channel's scale gradient sum(dy * x^) would be lost); keeping x^
puts no condition on the parameters' values, BN's backward reads exactly what it read before,
and the derived b' is bitwise the forward's b (the same Mul and Add of the same tensors), so
the derived masks are the forward's.

The pattern (`stored_once`): a BatchNormalization whose gradient is taken, whose input is
produced by an op and read by this BN alone (a graph input, or an input that other ops keep
alive, would stay alive anyway, and x^ would be one more tensor), whose output 0 is read by
exactly one op, a Relu or a Clip (whose bounds the recomputation reads too), and neither
output is a graph output. A residual BN (b + identity -> Relu, ResNet's block ends) does not
match: an Add reads b, and the activation's input is the sum. Every other graph is built as
before.
"""
from __future__ import annotations

from memsched.ir import Graph, Op
from memsched.ops import MASK_ACTIVATIONS, is_batch_norm, is_chunked_batch_norm

_KEY = "bn_relu"


def stored_once(em) -> dict[str, Op]:
    """{BatchNormalization op name: the activation op it feeds} for every BN of the source
    graph that matches the pattern (module doc), made once per training step."""
    if _KEY not in em.analyses:
        em.analyses[_KEY] = find_pairs(em.source)
    return em.analyses[_KEY]


def find_pairs(graph: Graph) -> dict[str, Op]:
    """{BN op name: activation op} for the BN -> activation pairs of `graph` (module doc); a
    batch split's CHUNKED_BATCH_NORM pairs where each chunk does (its first chunk's activation)."""
    outputs = set(graph.outputs)
    pairs = {}
    for op in graph.ops:
        if is_batch_norm(op):
            chunks = [(op.inputs[0], op.outputs[0])]
        elif is_chunked_batch_norm(op):
            chunks = list(zip(op.inputs, op.outputs))
        else:
            continue
        acts = [_activation(graph, c, b, outputs) for c, b in chunks]
        if all(acts):
            pairs[op.name] = acts[0]
    return pairs


def _activation(graph: Graph, c: str, b: str, outputs: set[str]) -> Op | None:
    """The activation a BN reading `c` and writing `b` feeds, where the pair matches the pattern."""
    if c not in graph.producer or c in outputs or len(graph.consumers.get(c, [])) != 1:
        return None
    readers = graph.consumers.get(b, [])
    if b in outputs or len(readers) != 1 or readers[0].domain not in ("", "ai.onnx"):
        return None
    act = readers[0]
    if act.op_type not in MASK_ACTIVATIONS or act.inputs[0] != b or act.outputs[0] in outputs:
        return None
    return act
