"""Hand-written graphs for the planning-pass tests: exact byte sizes, training-shaped.

Every tensor is a uint8 vector, so a tensor of N bytes has shape (N,) and the figures in
the tests are plain sums. Initializer-backed tensors (parameters, the learning rate) carry a
header-only TensorProto: static for the memory model, no data to build.
"""
from __future__ import annotations

import random

from onnx import TensorProto

from memsched.ir import Graph, Op, Tensor


class GraphBuilder:
    """Collects tensors and ops in order; `graph()` returns the Graph (stored order = order added)."""

    def __init__(self, name: str = "test"):
        self.name = name
        self.ops: list[Op] = []
        self.tensors: dict[str, Tensor] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []

    def input(self, name: str, nbytes: int) -> str:
        self.tensors[name] = Tensor(name, (nbytes,), TensorProto.UINT8, "input")
        self.inputs.append(name)
        return name

    def static(self, name: str, nbytes: int, kind: str = "parameter") -> str:
        header = TensorProto(name=name, data_type=TensorProto.UINT8, dims=[nbytes])
        self.tensors[name] = Tensor(name, (nbytes,), TensorProto.UINT8, kind, header)
        return name

    def op(self, name: str, op_type: str, inputs: list[str], outputs: list[tuple[str, int]],
           phase: str = "forward", kind: str = "activation") -> list[str]:
        """Add an op; `outputs` are (name, bytes); returns the output names."""
        for out, nbytes in outputs:
            self.tensors[out] = Tensor(out, (nbytes,), TensorProto.UINT8, kind)
        self.ops.append(Op(name, op_type, list(inputs), [o for o, _ in outputs], phase=phase))
        return [o for o, _ in outputs]

    def output(self, name: str) -> None:
        self.outputs.append(name)
        if self.tensors[name].kind == "activation":
            self.tensors[name].kind = "output"

    def graph(self) -> Graph:
        return Graph(self.ops, self.tensors, self.inputs, self.outputs, self.name)


def training_chain(layers: list[tuple[int, int]], input_bytes: int, dx_first: bool = False,
                   relu: bool = True, name: str = "chain") -> Graph:
    """A training step of a chain of weighted layers, in the order a framework emits it.

    layers[i] = (output bytes of layer i, weight bytes of layer i). Forward: z_i =
    MatMul(x_i, W_i), x_{i+1} = Relu(z_i). Loss: ReduceSum of the last z, and its seed
    gradient. Backward, last layer first: dz_i = Mul(dx_{i+1}, x_{i+1}) (the ReLU mask),
    dW_i = MatMul(x_i, dz_i), dx_i = MatMul(dz_i, W_i) (not for the first layer); dW before
    dX unless `dx_first`. SGD update at the end: s_i = Mul(lr, dW_i), W_i.updated = Sub(W_i, s_i).
    """
    b = GraphBuilder(name)
    x = b.input("x0", input_bytes)
    lr = b.static("lr", 4, "constant")
    sizes = [input_bytes]
    for i, (out_bytes, w_bytes) in enumerate(layers):
        w = b.static(f"W{i}", w_bytes)
        (z,) = b.op(f"fwd{i}", "MatMul", [x, w], [(f"z{i}", out_bytes)])
        last = i == len(layers) - 1
        if relu and not last:
            (x,) = b.op(f"relu{i}", "Relu", [z], [(f"x{i + 1}", out_bytes)])
        else:
            x = z
        sizes.append(out_bytes)
    (loss,) = b.op("loss", "ReduceSum", [x], [("loss", 4)], phase="loss")
    b.output(loss)
    (grad,) = b.op("loss_grad", "Expand", [loss], [(f"dx{len(layers)}", sizes[-1])], phase="loss",
                   kind="gradient")
    for i in reversed(range(len(layers))):
        last = i == len(layers) - 1
        if relu and not last:
            (dz,) = b.op(f"relu_grad{i}", "Mul", [grad, f"x{i + 1}"], [(f"dz{i}", sizes[i + 1])],
                         phase="backward", kind="gradient")
        else:
            dz = grad
        x_in = "x0" if i == 0 else (f"x{i}" if relu else f"z{i - 1}")
        dw = [f"dW_op{i}", "MatMul", [x_in, dz], [(f"dW{i}", layers[i][1])]]
        dx = [f"dX_op{i}", "MatMul", [dz, f"W{i}"], [(f"dx{i}", sizes[i])]]
        steps = [(dw, "param_grad")] + ([(dx, "gradient")] if i > 0 else [])
        if dx_first:
            steps.reverse()
        for (op_name, op_type, inputs, outputs), kind in steps:
            b.op(op_name, op_type, inputs, outputs, phase="backward", kind=kind)
        grad = f"dx{i}"
    for i, (_, w_bytes) in enumerate(layers):
        (s,) = b.op(f"sgd_scale{i}", "Mul", [lr, f"dW{i}"], [(f"s{i}", w_bytes)], phase="update",
                    kind="gradient")
        (new,) = b.op(f"sgd{i}", "Sub", [f"W{i}", s], [(f"W{i}.updated", w_bytes)], phase="update")
        b.output(new)
    return b.graph()


def random_dag(seed: int, n_ops: int, max_bytes: int = 1000) -> Graph:
    """A random DAG: each op reads one to three earlier tensors and writes one or two.

    Op types mix in-place-capable elementwise ops with others; some outputs are graph outputs,
    some ops are update-phase ops on a parameter of the same size (so in-place updates occur).
    """
    rnd = random.Random(seed)
    b = GraphBuilder(f"random{seed}")
    pool = [b.input("in0", rnd.randint(1, max_bytes))]
    params = [b.static(f"p{i}", rnd.randint(1, max_bytes)) for i in range(rnd.randint(0, 2))]
    produced: list[str] = []
    for k in range(n_ops):
        if params and rnd.random() < 0.15:
            p = rnd.choice(params)
            size = b.tensors[p].nbytes
            src = rnd.choice(pool + produced)
            b.op(f"u{k}", "Sub", [p, src], [(f"t{k}", size)], phase="update")
            produced.append(f"t{k}")
            continue
        arity = rnd.randint(1, 3)
        inputs = rnd.sample(pool + produced + params, min(arity, len(pool + produced + params)))
        op_type = rnd.choice(["Relu", "Add", "Mul", "MatMul", "Conv", "Concat"])
        same = b.tensors[inputs[0]].nbytes
        outs = []
        for j in range(1 if rnd.random() < 0.8 else 2):
            size = same if op_type in ("Relu", "Add", "Mul") and j == 0 else rnd.randint(1, max_bytes)
            outs.append((f"t{k}_{j}", size))
        produced.extend(b.op(f"op{k}", op_type, inputs, outs))
    consumed = {t for op in b.ops for t in op.inputs}
    for t in produced:
        if t not in consumed or rnd.random() < 0.1:
            b.output(t)
    return b.graph()
