"""Multi-layer perceptron on images: Flatten, then Gemm + Relu per hidden layer.

The default is LeCun et al.'s (1998) LeNet-300-100 for 28x28 MNIST digits
(784-300-100-10, 266,610 parameters), written as torch would: ``nn.Flatten`` and
``nn.Linear`` layers ``fc1``, ``fc2``, ... with torch's default init.
"""
from __future__ import annotations

import onnx

from .layers import GraphBuilder, linear_gemm, relu


def mlp(*, batch: int = 64, size: int = 28, channels: int = 1, classes: int = 10,
        hidden: tuple[int, ...] | list[int] = (300, 100), dtype: str = "float32",
        seed: int = 0, weights: bool = True) -> onnx.ModelProto:
    """MLP over [batch, channels, size, size] images; `hidden` lists the hidden widths."""
    b = GraphBuilder("mlp", dtype=dtype, seed=seed, weights=weights)
    x = b.input("input", [batch, channels, size, size])
    x = b.op("Flatten", "", [x], axis=1)
    widths = [channels * size * size, *hidden]
    for i, (fin, fout) in enumerate(zip(widths, widths[1:]), start=1):
        x = relu(b, f"relu{i}", linear_gemm(b, f"fc{i}", x, fin, fout))
    x = linear_gemm(b, f"fc{len(widths)}", x, widths[-1], classes, out="logits")
    return b.finish(x, [batch, classes])
