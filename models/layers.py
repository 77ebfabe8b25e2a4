"""Graph-building helpers shared by the model builders.

`GraphBuilder` collects the nodes and initializers of one ONNX graph and names them the
way torch.onnx.export (TorchScript exporter) does, so that downstream passes meet the names
and op patterns of real exports:

- parameters and buffers carry the module path: ``layer1.0.conv1.weight``,
  ``layer1.0.bn1.running_mean``;
- nodes are named by scope and op type, ``/layer1.0/conv1/Conv``, with ``_1``, ``_2`` for
  repeats in one scope; a node's outputs are ``<node name>_output_<i>``;
- scalars and shapes are ``Constant`` nodes, never initializers, so the initializers are
  exactly the model's parameters and buffers.

With ``weights=False`` the builder skips the random draws and emits initializers that
carry name, dtype and dims but no data: the same graph, cheap to count or plan with, but
not runnable (``onnx.checker`` rejects it).
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memsched.onnx_utils import make_model

DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}

BN_EPS = 1e-5
BN_MOMENTUM = 0.9   # ONNX momentum = 1 - torch momentum (0.1), as the exporter writes it


def count_parameters(model: onnx.ModelProto) -> int:
    """Trainable parameters: float initializers, less BN running mean/var (buffers).

    Reads only names, dtypes and dims, so it also works on ``weights=False`` graphs.
    """
    graph = model.graph
    buffers = {node.input[i] for node in graph.node if node.op_type == "BatchNormalization"
               for i in (3, 4)}
    return sum(math.prod(t.dims) for t in graph.initializer
               if t.data_type in _FLOAT_TYPES and t.name not in buffers)


def _scope_path(scope: str) -> str:
    """'layer1.0.conv1' -> '/layer1.0/conv1': an index is glued to its container, as torch does."""
    parts: list[str] = []
    for part in scope.split(".") if scope else []:
        if part.isdigit() and parts:
            parts[-1] += "." + part
        else:
            parts.append(part)
    return "".join("/" + p for p in parts)


class GraphBuilder:
    """One ONNX graph under construction: inputs, parameters, nodes, outputs."""

    def __init__(self, name: str, *, dtype: str = "float32", seed: int = 0,
                 weights: bool = True, bn_training: bool = False):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.np_dtype = np.dtype(dtype)
        self.elem_type = DTYPES[dtype]
        self.weights = weights
        self.bn_training = bn_training
        self.rng = np.random.default_rng(seed)
        # Fill the model's own graph in place: no copy of the weights at the end.
        self.model = make_model(onnx.GraphProto(name=name))
        self.graph = self.model.graph
        self._scope_uses: Counter[str] = Counter()
        self._stat_outputs: list[tuple[str, int]] = []   # training-mode BN running stats

    # -- graph interface -------------------------------------------------------------
    def input(self, name: str, shape: list[int], elem_type: int | None = None) -> str:
        self.graph.input.append(helper.make_tensor_value_info(
            name, self.elem_type if elem_type is None else elem_type, shape))
        return name

    def finish(self, output: str, shape: list[int]) -> onnx.ModelProto:
        """Declare `output` as the first graph output and return the finished model.

        Training-mode BN running statistics follow it as extra outputs; see `batch_norm`.
        """
        self.graph.output.append(helper.make_tensor_value_info(output, self.elem_type, shape))
        for name, channels in self._stat_outputs:
            self.graph.output.append(helper.make_tensor_value_info(name, self.elem_type,
                                                                   [channels]))
        return self.model

    def param(self, name: str, shape: list[int], *, std: float | None = None,
              bound: float | None = None, fill: float | None = None) -> str:
        """Add an initializer: N(0, std), U(-bound, bound) or the constant `fill`."""
        if sum(v is not None for v in (std, bound, fill)) != 1:
            raise ValueError("param needs exactly one of std, bound, fill")
        tensor = self.graph.initializer.add()
        tensor.name = name
        tensor.data_type = self.elem_type
        tensor.dims.extend(shape)
        if self.weights:
            if std is not None:
                data = self.rng.standard_normal(shape, dtype=np.float32)
                data *= std
            elif bound is not None:
                data = self.rng.random(shape, dtype=np.float32)
                data *= 2 * bound
                data -= bound
            else:
                data = np.full(shape, fill, dtype=np.float32)
            tensor.raw_data = data.astype(self.np_dtype, copy=False).tobytes()
        return name

    def op(self, op_type: str, scope: str, inputs: list[str], *, outputs: int = 1,
           out: str | None = None, **attrs):
        """Append a node; return its output name, or the list of them if `outputs` > 1.

        `out` renames the first output (the graph output 'logits').
        """
        base = f"{_scope_path(scope)}/{op_type}"
        uses = self._scope_uses[base]
        self._scope_uses[base] += 1
        name = base if uses == 0 else f"{base}_{uses}"
        names = [f"{name}_output_{i}" for i in range(outputs)]
        if out is not None:
            names[0] = out
        self.graph.node.append(helper.make_node(op_type, inputs, names, name=name, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, scope: str, value) -> str:
        """A Constant node; float values take the model's dtype, others keep theirs."""
        array = np.asarray(value)
        if array.dtype.kind == "f":
            array = array.astype(self.np_dtype)
        return self.op("Constant", scope, [], value=numpy_helper.from_array(array, name=""))

    def shape_const(self, scope: str, shape: list[int]) -> str:
        return self.const(scope, np.array(shape, dtype=np.int64))

    # -- batch norm ------------------------------------------------------------------
    def batch_norm(self, scope: str, x: str, channels: int, epsilon: float = BN_EPS) -> str:
        """BatchNormalization with torch's parameter and buffer names (torch's default
        epsilon 1e-5 unless given: torchvision's GoogLeNet uses 1e-3).

        Eval form (1 output) unless the builder has bn_training: then training_mode=1 with
        the updated running mean/var as outputs 1 and 2, which `finish` makes graph outputs.
        They must be graph outputs: onnxruntime 1.31 CPU merges identical initializers
        (gamma=1 with running_var=1, beta=0 with running_mean=0) and then writes the
        running statistics in place over them when those outputs are dangling, so the
        normalised output is wrong and changes from run to run.
        """
        inputs = [self.param(f"{scope}.weight", [channels], fill=1.0),
                  self.param(f"{scope}.bias", [channels], fill=0.0),
                  self.param(f"{scope}.running_mean", [channels], fill=0.0),
                  self.param(f"{scope}.running_var", [channels], fill=1.0)]
        if not self.bn_training:
            return self.op("BatchNormalization", scope, [x] + inputs,
                           epsilon=epsilon, momentum=BN_MOMENTUM)
        y, mean, var = self.op("BatchNormalization", scope, [x] + inputs, outputs=3,
                               epsilon=epsilon, momentum=BN_MOMENTUM, training_mode=1)
        self._stat_outputs += [(mean, channels), (var, channels)]
        return y


# -- layers used by more than one builder ----------------------------------------------
def he_std(fan: int) -> float:
    """Kaiming/He normal std for ReLU nets: sqrt(2 / fan)."""
    return math.sqrt(2.0 / fan)


def conv(b: GraphBuilder, scope: str, x: str, cin: int, cout: int, kernel: int, *,
         stride: int = 1, pad: int = 0, groups: int = 1, bias: bool = False,
         dims: int = 2, out: str | None = None) -> str:
    """Conv (2D or 3D) as torch exports nn.Conv2d/3d, He-normal weights over fan_out.

    fan_out is (cout / groups) * kernel volume: torchvision's kaiming_normal_(mode="fan_out")
    for ordinary convs, but per group for depthwise ones, where torch's count (all cout)
    shrinks MobileNetV2's signal to ~1e-10 at the logits under the default eval-form BN
    (fresh running stats do not renormalise).
    """
    fan_out = (cout // groups) * kernel ** dims
    inputs = [x, b.param(f"{scope}.weight", [cout, cin // groups] + [kernel] * dims,
                         std=he_std(fan_out))]
    if bias:
        inputs.append(b.param(f"{scope}.bias", [cout], fill=0.0))
    return b.op("Conv", scope, inputs, dilations=[1] * dims, group=groups,
                kernel_shape=[kernel] * dims, pads=[pad] * (2 * dims), strides=[stride] * dims,
                out=out)


def conv_transpose(b: GraphBuilder, scope: str, x: str, cin: int, cout: int, kernel: int, *,
                   stride: int, bias: bool, dims: int = 2) -> str:
    """ConvTranspose as torch exports nn.ConvTranspose2d/3d (weight [cin, cout, k...]).

    With kernel == stride every output pixel sees exactly `cin` inputs: He std over cin.
    """
    inputs = [x, b.param(f"{scope}.weight", [cin, cout] + [kernel] * dims, std=he_std(cin))]
    if bias:
        inputs.append(b.param(f"{scope}.bias", [cout], fill=0.0))
    return b.op("ConvTranspose", scope, inputs, dilations=[1] * dims, group=1,
                kernel_shape=[kernel] * dims, output_padding=[0] * dims,
                pads=[0] * (2 * dims), strides=[stride] * dims)


def max_pool(b: GraphBuilder, scope: str, x: str, kernel: int, stride: int, pad: int = 0,
             dims: int = 2) -> str:
    return b.op("MaxPool", scope, [x], ceil_mode=0, kernel_shape=[kernel] * dims,
                pads=[pad] * (2 * dims), strides=[stride] * dims)


def pool_out(size: int, kernel: int, stride: int, pad: int = 0) -> int:
    """Output length of a conv or pool (floor mode)."""
    return (size + 2 * pad - kernel) // stride + 1


def relu(b: GraphBuilder, scope: str, x: str) -> str:
    return b.op("Relu", scope, [x])


def linear_gemm(b: GraphBuilder, scope: str, x: str, fin: int, fout: int, *,
                std: float | None = None, out: str | None = None) -> str:
    """nn.Linear on a 2-D input: Gemm(x, W, b, transB=1), W stored [out, in] as in torch.

    Without `std`, torch's default init: U(+-1/sqrt(fin)) for weight and bias.
    """
    if std is None:
        bound = 1.0 / math.sqrt(fin)
        weight = b.param(f"{scope}.weight", [fout, fin], bound=bound)
        bias = b.param(f"{scope}.bias", [fout], bound=bound)
    else:
        weight = b.param(f"{scope}.weight", [fout, fin], std=std)
        bias = b.param(f"{scope}.bias", [fout], fill=0.0)
    return b.op("Gemm", scope, [x, weight, bias], alpha=1.0, beta=1.0, transB=1, out=out)


def pool_flatten(b: GraphBuilder, pool_scope: str, x: str) -> str:
    """Adaptive average pool to 1x1 then torch.flatten(x, 1): GlobalAveragePool + Flatten."""
    x = b.op("GlobalAveragePool", pool_scope, [x])
    return b.op("Flatten", "", [x], axis=1)
