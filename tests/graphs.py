"""Tiny hand-written ONNX graphs for tests (exact byte figures are easy to work out by hand)."""
from __future__ import annotations

import random

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memsched.ir import Graph, Op, Tensor
from memsched.onnx_utils import make_model


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


def conv_relu_conv(inp: int, mid: int, out: int) -> Graph:
    """in(inp) -conv-> a(mid) -relu-> r(mid) -head-> y(out, the output): the smallest graph
    with an op that may run in place (the Relu over `a`)."""
    g = GraphBuilder()
    g.input("in", inp)
    g.op("conv", "Conv", ["in"], [("a", mid)])
    g.op("relu", "Relu", ["a"], [("r", mid)])
    g.op("head", "Conv", ["r"], [("y", out)])
    g.output("y")
    return g.graph()


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


def _opset17(nodes, name, inputs, outputs, initializers) -> "onnx.ModelProto":
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def if_capture_model() -> "onnx.ModelProto":
    """x[2,4] -> MatMul W1 -> h; an If on sum(x) > 0 whose branches compute MatMul(h, Wa) or
    MatMul(h, Wb): both read h, Wa and Wb from the main graph (implicit captures), so the If's
    only listed input is its condition. Three trainable weights, two of them seen only inside."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("W1", (4, 4)), ("Wa", (4, 3)), ("Wb", (4, 3)))]
    inits.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))

    def branch(name: str, weight: str) -> "onnx.GraphProto":
        return helper.make_graph([helper.make_node("MatMul", ["h", weight], [f"y_{name}"], name=f"{name}_mm")],
                                 name, [], [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [2, 3])])

    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
             helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=branch("then", "Wa"),
                              else_branch=branch("else", "Wb"))]
    return _opset17(nodes, "if_capture", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)


def loop_model(capture: bool = False) -> "onnx.ModelProto":
    """x[2,4] -> MatMul W -> h -> Loop (3 trips of v = Tanh(v * 0.5), reading only its listed
    inputs, or with `capture` also adding W2 from the main graph) -> MatMul W2 -> y[2,3]."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("W", (4, 4)), ("W2", (4, 3)))]
    inits += [numpy_helper.from_array(np.array(3, np.int64), "trips"),
              numpy_helper.from_array(np.array(True), "go")]
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    body_nodes = [helper.make_node("Identity", ["go_in"], ["go_out"], name="body_go"),
                  helper.make_node("Mul", ["v", "half"], ["v_half"], name="body_mul"),
                  helper.make_node("Tanh", ["v_half"], ["v_out" if not capture else "v_tanh"], name="body_tanh")]
    if capture:
        body_nodes.append(helper.make_node("ReduceSum", ["W2"], ["w_sum"], name="body_wsum", keepdims=0))
        body_nodes.append(helper.make_node("Add", ["v_tanh", "w_sum"], ["v_out"], name="body_add"))
    body = helper.make_graph(body_nodes, "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("go_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 4])],
                             [helper.make_tensor_value_info("go_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [2, 4])], [half])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
             helper.make_node("Loop", ["trips", "go", "h"], ["looped"], name="loop", body=body),
             helper.make_node("MatMul", ["looped", "W2"], ["y"], name="head")]
    return _opset17(nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)


def scan_model() -> "onnx.ModelProto":
    """x[5,4] -> Relu -> Scan over its rows keeping a running sum s[4] (the body reads only its
    listed inputs) -> the final sum and the per-row sums [5,4] -> Add -> y[5,4]."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "row"], ["s_out"], name="body_add"),
         helper.make_node("Identity", ["s_out"], ["row_out"], name="body_copy")],
        "scan_body", [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [4]),
                      helper.make_tensor_value_info("row", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("row_out", TensorProto.FLOAT, [4])])
    start = numpy_helper.from_array(np.zeros(4, np.float32), "start")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Scan", ["start", "r"], ["total", "running"], name="scan", body=body,
                              num_scan_inputs=1),
             helper.make_node("Add", ["running", "total"], ["y"], name="add")]
    return _opset17(nodes, "scan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 4])], [start])


FUZZ_UNARY = ("Relu", "Sigmoid", "Tanh")


def random_onnx_model(seed: int, batch: int = 4) -> "onnx.ModelProto":
    """A seeded random float model of Add/Mul/Relu/Sigmoid/Tanh/MatMul (opset 17, IR 8) with 2 or
    3 MatMul weights: a chain or a DAG (ops read any earlier tensor of a matching shape; some
    results are left unread, a few Adds take a bias initializer). The last weight's MatMul makes
    the classes (and an elementwise op may follow it), so y[batch, classes] always reaches a weight."""
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    pool = [("x", rnd.randint(3, 12))]      # (tensor, features); every tensor is [batch, features]
    inits, nodes = [], []
    dag = rnd.random() < 0.6

    def pick(features: int | None = None, last: bool = False) -> tuple[str, int]:
        choices = [p for p in (pool if dag and not last else pool[-1:]) if features is None or p[1] == features]
        return rnd.choice(choices) if choices else pool[-1]

    def add(op_type: str, inputs: list[str], features: int) -> None:
        out = f"t{len(nodes)}"
        nodes.append(helper.make_node(op_type, inputs, [out], name=f"{op_type.lower()}{len(nodes)}"))
        pool.append((out, features))

    def matmul(out_features: int) -> None:
        src, features = pick()
        name = f"W{sum(i.name.startswith('W') for i in inits)}"
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((features, out_features)) / np.sqrt(features)).astype(np.float32), name))
        add("MatMul", [src, name], out_features)

    def elementwise(last: bool = False) -> None:
        """One elementwise op; `last`: on the newest tensor (the chain goes on from it)."""
        a, features = pick(last=last)
        if rnd.random() < 0.5:
            add(rnd.choice(FUZZ_UNARY), [a], features)
        elif rnd.random() < 0.25:
            bias = f"b{len(inits)}"
            inits.append(numpy_helper.from_array((rng.standard_normal(features) * 0.1).astype(np.float32), bias))
            add(rnd.choice(("Add", "Mul")), [a, bias], features)
        else:
            add(rnd.choice(("Add", "Mul")), [a, pick(features)[0]], features)

    hidden = rnd.randint(1, 2)              # weights before the last
    kinds = ["matmul"] * hidden + ["elementwise"] * rnd.randint(1, 6)
    rnd.shuffle(kinds)
    for kind in kinds:
        matmul(rnd.randint(3, 12)) if kind == "matmul" else elementwise()
    matmul(rnd.randint(2, 6))
    if rnd.random() < 0.5:
        elementwise(last=True)
    out, classes = pool[-1]
    nodes.append(helper.make_node("Identity", [out], ["y"], name="output"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, pool[0][1]])]
    return _opset17(nodes, f"fuzz{seed}", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                 [batch, classes])], inits)
