"""Training-shaped test graphs for the recompute planner (used by tests and bench).

Each generator builds a forward DAG, then `training_problem` mirrors it: a loss reads the
forward sinks, every forward node v gets a backward node "d:v" that reads v's output and the
gradients of v's forward consumers (the loss for forward sinks). The order is the forward
order, the loss, then the backward nodes in reverse. Sizes are multiples of 4 KiB, costs are
in milliseconds; everything is drawn from a seeded numpy generator, so a seed is a graph.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from memsched.passes.recompute.dag import RematProblem, make_problem

PAGE = 4096
MIB_PAGES = 256   # pages in a MiB


def training_problem(forward: nx.DiGraph, backward_factor: float = 2.0, pinned_bytes: int = 0,
                     loss_bytes: int = PAGE) -> RematProblem:
    """Mirror a forward DAG (nodes with `cost`, `size`, optional `rank` to order ties) into
    forward + loss + backward."""
    order = list(nx.lexicographical_topological_sort(forward, key=lambda v: forward.nodes[v].get("rank", 0)))
    graph = nx.DiGraph()
    for v in order:
        graph.add_node(v, cost=forward.nodes[v]["cost"], size=forward.nodes[v]["size"])
    graph.add_edges_from(forward.edges)
    sinks = [v for v in order if forward.out_degree(v) == 0]
    graph.add_node("loss", cost=min(graph.nodes[v]["cost"] for v in sinks), size=loss_bytes)
    for v in sinks:
        graph.add_edge(v, "loss")
    for v in reversed(order):
        grad = f"d:{v}"
        graph.add_node(grad, cost=backward_factor * forward.nodes[v]["cost"], size=forward.nodes[v]["size"])
        graph.add_edge(v, grad)
        for w in forward.successors(v):
            graph.add_edge(f"d:{w}", grad)
        if forward.out_degree(v) == 0:
            graph.add_edge("loss", grad)
    full_order = order + ["loss"] + [f"d:{v}" for v in reversed(order)]
    return make_problem(graph, full_order, pinned_bytes)


def _add(forward: nx.DiGraph, name: str, inputs, cost: float, size_pages: int) -> str:
    forward.add_node(name, cost=round(float(cost), 3), size=int(max(1, size_pages)) * PAGE,
                     rank=forward.number_of_nodes())
    forward.add_edges_from((u, name) for u in inputs)
    return name


def chain(layers: int, seed: int = 0) -> RematProblem:
    """An MLP-like chain of `layers` forward ops (2 * layers + 1 nodes in all)."""
    rng = np.random.default_rng(seed)
    forward = nx.DiGraph()
    prev = []
    for i in range(layers):
        prev = [_add(forward, f"f{i}", prev, rng.uniform(1, 10), rng.integers(1, 9) * MIB_PAGES)]
    return training_problem(forward)


def unet(depth: int = 4, convs: int = 2, seed: int = 0) -> RematProblem:
    """A U-Net: `depth` levels of `convs` conv+relu pairs, pooling down, upsampling back up,
    each decoder level concatenating the encoder level's skip connection."""
    rng = np.random.default_rng(seed)
    forward = nx.DiGraph()
    base = 32 * MIB_PAGES

    def block(prefix: str, x: list, pages: int) -> list:
        for c in range(convs):
            conv = _add(forward, f"{prefix}.conv{c}", x, rng.uniform(4, 8), pages)
            x = [_add(forward, f"{prefix}.relu{c}", [conv], rng.uniform(0.2, 0.5), pages)]
        return x

    x, skips = [], []
    for level in range(depth):
        pages = base >> level
        x = block(f"enc{level}", x, pages)
        skips.append(x[0])
        x = [_add(forward, f"enc{level}.pool", x, rng.uniform(0.3, 0.6), pages // 4 or 1)]
    x = block("mid", x, base >> depth)
    for level in reversed(range(depth)):
        pages = base >> level
        up = _add(forward, f"dec{level}.up", x, rng.uniform(1, 2), pages)
        cat = _add(forward, f"dec{level}.cat", [up, skips[level]], rng.uniform(0.2, 0.4), 2 * pages)
        x = block(f"dec{level}", [cat], pages)
    _add(forward, "head", x, rng.uniform(1, 2), base // 8)
    return training_problem(forward)


def resnet(stages=(3, 4, 6, 3), seed: int = 0) -> RematProblem:
    """A ResNet of bottleneck blocks (conv/bn/relu x3, add, relu; a projection where the
    shape changes); stages=(3, 4, 6, 3) is ResNet-50's layout (~330 nodes in all)."""
    rng = np.random.default_rng(seed)
    forward = nx.DiGraph()
    pages = 24 * MIB_PAGES

    def conv_bn(name: str, x: list, p: int, relu: bool = True) -> list:
        conv = _add(forward, f"{name}.conv", x, rng.uniform(3, 9), p)
        out = _add(forward, f"{name}.bn", [conv], rng.uniform(0.3, 0.8), p)
        if relu:
            out = _add(forward, f"{name}.relu", [out], rng.uniform(0.1, 0.4), p)
        return [out]

    x = conv_bn("stem", [], pages)
    x = [_add(forward, "stem.pool", x, rng.uniform(0.2, 0.5), pages // 4)]
    pages //= 4
    for s, blocks in enumerate(stages):
        out_pages = pages * 4 if s == 0 else pages * 2
        for b in range(blocks):
            name = f"s{s}b{b}"
            shortcut = x
            if b == 0:
                shortcut = conv_bn(f"{name}.proj", x, out_pages, relu=False)
            y = conv_bn(f"{name}.a", x, out_pages // 4)
            y = conv_bn(f"{name}.b", y, out_pages // 4)
            y = conv_bn(f"{name}.c", y, out_pages, relu=False)
            added = _add(forward, f"{name}.add", y + shortcut, rng.uniform(0.2, 0.5), out_pages)
            x = [_add(forward, f"{name}.relu", [added], rng.uniform(0.1, 0.4), out_pages)]
        pages = out_pages // 2 if s < len(stages) - 1 else out_pages
    pool = _add(forward, "avgpool", x, rng.uniform(0.2, 0.5), MIB_PAGES // 4)
    _add(forward, "fc", [pool], rng.uniform(0.5, 1.0), 1)
    return training_problem(forward)


def random_layered(nodes: int, seed: int = 0, max_width: int = 4, max_inputs: int = 3) -> RematProblem:
    """A random layered training graph of about `nodes` nodes: the forward part has
    (nodes - 1) // 2 ops in layers of 1..max_width; each op reads 1..max_inputs outputs,
    mostly from the previous layer, sometimes from up to 4 layers back."""
    rng = np.random.default_rng(seed)
    forward = nx.DiGraph()
    total = max(1, (nodes - 1) // 2)
    layers: list[list[str]] = []
    count = 0
    while count < total:
        width = int(min(rng.integers(1, max_width + 1), total - count))
        layer = []
        for _ in range(width):
            inputs = set()
            if layers:
                for _ in range(int(rng.integers(1, max_inputs + 1))):
                    back = 1 + int(rng.integers(0, min(4, len(layers)))) if rng.random() < 0.3 else 1
                    pool = layers[-back]
                    inputs.add(pool[int(rng.integers(0, len(pool)))])
            layer.append(_add(forward, f"n{count}", sorted(inputs), rng.uniform(1, 10),
                              rng.integers(1, 17) * MIB_PAGES))
            count += 1
        layers.append(layer)
    return training_problem(forward)


def linearized(nodes: int, seed: int = 0, skips: int = 4) -> RematProblem:
    """A random linearised training graph of about `nodes` nodes, the shape of Moccasin's RLG
    graphs: the forward part is a chain of (nodes - 1) // 2 ops, op i reading op i-1 and
    `skips` skip connections from ops drawn uniformly from those before i-1 (repeats merge).
    Long skips keep forward outputs, and in the backward part the gradients of their readers,
    live across much of the step, so a budget of 0.8 x the no-recomputation peak needs
    recomputation of gradients as well as of forward outputs."""
    rng = np.random.default_rng(seed)
    forward = nx.DiGraph()
    total = max(1, (nodes - 1) // 2)
    names: list[str] = []
    for i in range(total):
        inputs = set(names[-1:])
        if i >= 2:
            inputs.update(names[int(rng.integers(0, i - 1))] for _ in range(skips))
        names.append(_add(forward, f"n{i}", sorted(inputs), rng.uniform(1, 10), rng.integers(1, 17) * MIB_PAGES))
    return training_problem(forward)
