"""Tiny hand-written ONNX graphs for tests (exact byte figures are easy to work out by hand)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from memsched.onnx_utils import make_model
import random
from onnx import TensorProto
from memsched.ir import Graph, Op, Tensor


def mlp_model(batch: int | str = 2, width: int = 4) -> "onnx.ModelProto":
    """x[b,4] -> MatMul W1[4,w] -> Relu -> MatMul W2[w,3] -> y[b,3]."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, width)).astype(np.float32), "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((width, 3)).astype(np.float32), "W2")
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "W2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])], [w1, w2])
    return make_model(graph)


def reshape_model() -> "onnx.ModelProto":
    """Shape arithmetic as torch exports it: Shape -> Gather -> Unsqueeze -> Concat -> Reshape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Constant", [], ["zero"], name="c0", value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="unsq"),
        helper.make_node("Constant", [], ["minus1"], name="c1",
                         value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Concat", ["n1", "minus1"], ["newshape"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "newshape"], ["flat"], name="reshape"),
        helper.make_node("Dropout", ["flat"], ["d"], name="dropout"),
        helper.make_node("Identity", ["d"], ["y"], name="identity"),
    ]
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    graph = helper.make_graph(nodes, "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [axes])
    return make_model(graph)

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
