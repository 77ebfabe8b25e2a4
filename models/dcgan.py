"""DCGAN (Radford et al. 2016) as the PyTorch DCGAN example defines it (examples/dcgan).

- generator: z [N, nz, 1, 1] -> ConvTranspose(nz, ngf*8, 4, 1, 0) -> BN -> ReLU, then
  ConvTranspose(4, 2, 1) stages halving the channels and doubling the side (BN, ReLU each),
  a last ConvTranspose to nc channels and Tanh: the image [N, nc, size, size], named 'image'.
- discriminator: image [N, nc, size, size] -> Conv(nc, ndf, 4, 2, 1) -> LeakyReLU(0.2), then
  Conv(4, 2, 1) stages doubling the channels (BN, LeakyReLU(0.2) each) down to 4x4, and a
  Conv(ndf*8, 1, 4, 1, 0) to one logit per image, flattened as the example does
  (``view(-1, 1).squeeze(1)``): 'logits' [N]. The example's final Sigmoid is left out: the
  GAN step takes binary cross-entropy with logits, the stable form of BCE(sigmoid(x)).

Every convolution is bias-free. At size 64 (the paper's) there are three middle stages and
the counts are the example's: 3,576,704 (generator) and 2,765,568 (discriminator) at nz=100,
ngf=ndf=64, nc=3. Other sizes (a power of two, at least 16) take one stage per doubling;
the widths are ngf * 2**k from the image side as in the example. Module names follow the
example's ``nn.Sequential`` (``main.0.weight``, ``main.1.running_mean``, ...). Init is the
example's ``weights_init``: conv weights N(0, 0.02), BN weights N(1, 0.02), BN biases 0.
"""
from __future__ import annotations

import numpy as np
import onnx

from .layers import GraphBuilder

INIT_STD = 0.02
LEAKY_SLOPE = 0.2


def _stages(size: int) -> int:
    """Stride-2 layers between 4x4 and size x size."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"size must be a power of two >= 16 (4x4 doubled per stage), got {size}")
    return size.bit_length() - 3


def _conv(b: GraphBuilder, op_type: str, scope: str, x: str, shape: list[int], stride: int, pad: int) -> str:
    weight = b.param(f"{scope}.weight", shape, std=INIT_STD)
    return b.op(op_type, scope, [x, weight], dilations=[1, 1], group=1, kernel_shape=[4, 4],
                pads=[pad] * 4, strides=[stride, stride],
                **({"output_padding": [0, 0]} if op_type == "ConvTranspose" else {}))


def _batch_norm(b: GraphBuilder, scope: str, x: str, channels: int) -> str:
    """BatchNorm with the example's init: weight N(1, 0.02) (drawn here), bias 0."""
    y = b.batch_norm(scope, x, channels)
    if b.weights:
        weight = next(t for t in b.graph.initializer if t.name == f"{scope}.weight")
        data = b.rng.standard_normal(channels, dtype=np.float32) * INIT_STD + 1
        weight.raw_data = data.astype(b.np_dtype).tobytes()
    return y


def dcgan_generator(*, batch: int = 64, size: int = 64, nz: int = 100, ngf: int = 64, nc: int = 3,
                    dtype: str = "float32", seed: int = 0, weights: bool = True) -> onnx.ModelProto:
    """The example's Generator: 3,576,704 params at the defaults."""
    stages = _stages(size)
    b = GraphBuilder("dcgan_generator", dtype=dtype, seed=seed, weights=weights)
    x = b.input("input", [batch, nz, 1, 1])
    channels = ngf * 2 ** (stages - 1)
    x = _conv(b, "ConvTranspose", "main.0", x, [nz, channels, 4, 4], 1, 0)
    index = 1
    for stage in range(stages):
        x = _batch_norm(b, f"main.{index}", x, channels)
        x = b.op("Relu", f"main.{index + 1}", [x])
        out = channels // 2 if stage < stages - 1 else nc
        x = _conv(b, "ConvTranspose", f"main.{index + 2}", x, [channels, out, 4, 4], 2, 1)
        channels, index = out, index + 3
    x = b.op("Tanh", f"main.{index}", [x], out="image")
    return b.finish(x, [batch, nc, size, size])


def dcgan_discriminator(*, batch: int = 64, size: int = 64, ndf: int = 64, nc: int = 3,
                        dtype: str = "float32", seed: int = 0, weights: bool = True) -> onnx.ModelProto:
    """The example's Discriminator less its Sigmoid: 2,765,568 params at the defaults."""
    stages = _stages(size)
    b = GraphBuilder("dcgan_discriminator", dtype=dtype, seed=seed, weights=weights)
    x = b.input("input", [batch, nc, size, size])
    x = _conv(b, "Conv", "main.0", x, [ndf, nc, 4, 4], 2, 1)
    x = b.op("LeakyRelu", "main.1", [x], alpha=LEAKY_SLOPE)
    channels, index = ndf, 2
    for _ in range(stages - 1):
        x = _conv(b, "Conv", f"main.{index}", x, [channels * 2, channels, 4, 4], 2, 1)
        channels *= 2
        x = _batch_norm(b, f"main.{index + 1}", x, channels)
        x = b.op("LeakyRelu", f"main.{index + 2}", [x], alpha=LEAKY_SLOPE)
        index += 3
    x = _conv(b, "Conv", f"main.{index}", x, [1, channels, 4, 4], 1, 0)
    x = b.op("Reshape", "", [x, b.shape_const("", [-1, 1])])
    x = b.op("Squeeze", "", [x, b.const("", np.array([1], dtype=np.int64))], out="logits")
    return b.finish(x, [batch])
