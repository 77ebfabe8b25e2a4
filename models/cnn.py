"""Image classifiers as torchvision defines them: VGG-16, ResNet-18/50, MobileNetV2, GoogLeNet.

The graphs mirror torch.onnx.export (TorchScript, opset 17) of the torchvision modules
exported without constant folding into the convolutions, i.e. as a training export sees
them: Conv (bias only where torchvision has one), BatchNormalization kept separate, Relu,
ReLU6 as Clip, MaxPool, Add for residuals, GlobalAveragePool + Flatten + Gemm heads.
Dropout is left out (the eval export drops it; memsched has no random ops).
Initializer names are torchvision's state-dict keys; init is He normal (fan_out) for convs,
BN gamma 1, beta 0, and torchvision's choices for the linears.
"""
from __future__ import annotations

import numpy as np
import onnx

from .layers import (GraphBuilder, conv, linear_gemm, max_pool, pool_flatten, pool_out,
                     relu)

_VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
              512, 512, 512, "M", 512, 512, 512, "M"]


def _adaptive_avg_pool(b: GraphBuilder, scope: str, x: str, size: int, target: int) -> str:
    """nn.AdaptiveAvgPool2d((target, target)) on a size x size map.

    Where `target` divides `size` this is the AveragePool the exporter writes (kernel 1 at
    VGG's default 224 input). Otherwise (small inputs) it is the exact torch operation as
    two MatMuls with a constant averaging matrix P: out = P @ x @ P^T.
    """
    if size % target == 0:
        k = size // target
        return b.op("AveragePool", scope, [x], ceil_mode=0, kernel_shape=[k, k],
                    pads=[0, 0, 0, 0], strides=[k, k])
    pool = np.zeros((target, size), dtype=np.float32)
    for i in range(target):
        start, end = (i * size) // target, -((-(i + 1) * size) // target)
        pool[i, start:end] = 1.0 / (end - start)
    rows = b.op("MatMul", scope, [b.const(scope, pool), x])
    return b.op("MatMul", scope, [rows, b.const(scope, pool.T.copy())])


def plain_cnn(*, batch: int = 8, size: int = 16, widths: tuple[int, int] = (16, 32),
              classes: int = 10) -> onnx.ModelProto:
    """Conv-Relu-MaxPool-Conv-Relu-GlobalAveragePool-Gemm on 3 x size x size images, without
    BatchNorm: a CNN whose gradients average across data-parallel workers exactly."""
    b = GraphBuilder("plain_cnn", seed=0)
    x = b.input("input", [batch, 3, size, size])
    x = max_pool(b, "/pool", relu(b, "/relu1", conv(b, "conv1", x, 3, widths[0], 3, pad=1, bias=True)), 2, 2)
    x = relu(b, "/relu2", conv(b, "conv2", x, widths[0], widths[1], 3, pad=1, bias=True))
    x = linear_gemm(b, "fc", pool_flatten(b, "/avgpool", x), widths[1], classes, out="logits")
    return b.finish(x, [batch, classes])


def vgg16(*, batch: int = 32, size: int = 224, classes: int = 1000, hidden: int = 4096,
          dtype: str = "float32", seed: int = 0, weights: bool = True) -> onnx.ModelProto:
    """torchvision vgg16 (configuration D, no BN): 13 convs, 3 linears, 138,357,544 params.

    `hidden` is the width of the two hidden linears (4096 in torchvision); smaller values
    give a light graph with the same structure for tests.
    """
    if size < 32:
        raise ValueError(f"vgg16 needs size >= 32 (five 2x2 pools), got {size}")
    b = GraphBuilder("vgg16", dtype=dtype, seed=seed, weights=weights)
    x = b.input("input", [batch, 3, size, size])
    index, channels, side = 0, 3, size
    for v in _VGG16_CFG:
        if v == "M":
            x = max_pool(b, f"features.{index}", x, 2, 2)
            side = pool_out(side, 2, 2)
            index += 1
        else:
            x = conv(b, f"features.{index}", x, channels, v, 3, pad=1, bias=True)
            x = relu(b, f"features.{index + 1}", x)
            channels, index = v, index + 2
    x = _adaptive_avg_pool(b, "avgpool", x, side, 7)
    x = b.op("Flatten", "", [x], axis=1)
    x = relu(b, "classifier.1", linear_gemm(b, "classifier.0", x, 512 * 7 * 7, hidden, std=0.01))
    x = relu(b, "classifier.4", linear_gemm(b, "classifier.3", x, hidden, hidden, std=0.01))
    x = linear_gemm(b, "classifier.6", x, hidden, classes, std=0.01, out="logits")
    return b.finish(x, [batch, classes])


def _conv_bn(b: GraphBuilder, x: str, conv_scope: str, bn_scope: str, cin: int, cout: int,
             kernel: int, stride: int = 1, groups: int = 1) -> str:
    """Bias-free conv with 'same' padding followed by its BatchNorm (torchvision's pattern)."""
    x = conv(b, conv_scope, x, cin, cout, kernel, stride=stride, pad=(kernel - 1) // 2,
             groups=groups)
    return b.batch_norm(bn_scope, x, cout)


def _residual_block(b: GraphBuilder, scope: str, x: str, cin: int,
                    convs: list[tuple[int, int, int]]) -> tuple[str, int]:
    """torchvision BasicBlock / Bottleneck: conv{i}+bn{i} per (cout, kernel, stride), ReLU
    between them; a 1x1 conv+BN downsample on the shortcut where the shape changes."""
    y, c = x, cin
    for i, (cout, kernel, stride) in enumerate(convs, start=1):
        if i > 1:
            y = relu(b, f"{scope}.relu", y)
        y = _conv_bn(b, y, f"{scope}.conv{i}", f"{scope}.bn{i}", c, cout, kernel, stride)
        c = cout
    stride = max(s for _, _, s in convs)
    if stride != 1 or cin != c:
        x = _conv_bn(b, x, f"{scope}.downsample.0", f"{scope}.downsample.1", cin, c, 1, stride)
    return relu(b, f"{scope}.relu", b.op("Add", scope, [y, x])), c


def _basic_block(b: GraphBuilder, scope: str, x: str, cin: int, planes: int,
                 stride: int) -> tuple[str, int]:
    return _residual_block(b, scope, x, cin, [(planes, 3, stride), (planes, 3, 1)])


def _bottleneck(b: GraphBuilder, scope: str, x: str, cin: int, planes: int,
                stride: int) -> tuple[str, int]:
    """ResNet v1.5: the stride sits on the 3x3 conv; the block widens to 4 * planes."""
    return _residual_block(b, scope, x, cin,
                           [(planes, 1, 1), (planes, 3, stride), (4 * planes, 1, 1)])


def _resnet(name: str, block, blocks: list[int], *, batch: int, size: int, classes: int,
            dtype: str, seed: int, weights: bool, bn_training: bool) -> onnx.ModelProto:
    b = GraphBuilder(name, dtype=dtype, seed=seed, weights=weights, bn_training=bn_training)
    x = b.input("input", [batch, 3, size, size])
    x = relu(b, "relu", _conv_bn(b, x, "conv1", "bn1", 3, 64, 7, stride=2))
    x = max_pool(b, "maxpool", x, 3, 2, pad=1)
    channels = 64
    for stage, (planes, count) in enumerate(zip([64, 128, 256, 512], blocks), start=1):
        for i in range(count):
            stride = 2 if stage > 1 and i == 0 else 1
            x, channels = block(b, f"layer{stage}.{i}", x, channels, planes, stride)
    x = pool_flatten(b, "avgpool", x)
    x = linear_gemm(b, "fc", x, channels, classes, out="logits")
    return b.finish(x, [batch, classes])


def small_resnet(*, batch: int = 8, size: int = 8, width: int = 8, classes: int = 10) -> onnx.ModelProto:
    """A ResNet in miniature: a 3x3 conv+BN+ReLU stem, one BasicBlock of `width` channels and
    one that halves the map into 2 x `width` (a conv+BN downsample on its shortcut), average
    pool, Linear. Every BatchNorm trains on batch statistics: the data-parallel tests' model
    for synchronised BatchNorm."""
    b = GraphBuilder("small_resnet", seed=0)
    x = b.input("input", [batch, 3, size, size])
    x = relu(b, "relu", _conv_bn(b, x, "conv1", "bn1", 3, width, 3))
    x, channels = _basic_block(b, "layer1.0", x, width, width, 1)
    x, channels = _basic_block(b, "layer2.0", x, channels, 2 * width, 2)
    x = linear_gemm(b, "fc", pool_flatten(b, "avgpool", x), channels, classes, out="logits")
    return b.finish(x, [batch, classes])


def resnet18(*, batch: int = 32, size: int = 224, classes: int = 1000, dtype: str = "float32",
             seed: int = 0, weights: bool = True, bn_training: bool = False) -> onnx.ModelProto:
    """torchvision resnet18: BasicBlocks [2, 2, 2, 2], 11,689,512 params."""
    return _resnet("resnet18", _basic_block, [2, 2, 2, 2], batch=batch, size=size,
                   classes=classes, dtype=dtype, seed=seed, weights=weights,
                   bn_training=bn_training)


def resnet50(*, batch: int = 32, size: int = 224, classes: int = 1000, dtype: str = "float32",
             seed: int = 0, weights: bool = True, bn_training: bool = False) -> onnx.ModelProto:
    """torchvision resnet50 (v1.5): Bottlenecks [3, 4, 6, 3], 25,557,032 params."""
    return _resnet("resnet50", _bottleneck, [3, 4, 6, 3], batch=batch, size=size,
                   classes=classes, dtype=dtype, seed=seed, weights=weights,
                   bn_training=bn_training)


def _make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision's channel rounding for width multipliers."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv_bn_relu6(b: GraphBuilder, scope: str, x: str, cin: int, cout: int, kernel: int,
                   stride: int = 1, groups: int = 1) -> str:
    """Conv2dNormActivation(..., ReLU6): scope.0 conv, scope.1 BN, ReLU6 exported as Clip."""
    x = _conv_bn(b, x, f"{scope}.0", f"{scope}.1", cin, cout, kernel, stride, groups)
    return b.op("Clip", f"{scope}.2", [x, b.const(f"{scope}.2", 0.0), b.const(f"{scope}.2", 6.0)])


def _inverted_residual(b: GraphBuilder, scope: str, x: str, cin: int, cout: int, stride: int,
                       expand: int) -> str:
    hidden = int(round(cin * expand))
    y, index = x, 0
    if expand != 1:
        y = _conv_bn_relu6(b, f"{scope}.conv.0", y, cin, hidden, 1)
        index = 1
    y = _conv_bn_relu6(b, f"{scope}.conv.{index}", y, hidden, hidden, 3, stride, groups=hidden)
    y = _conv_bn(b, y, f"{scope}.conv.{index + 1}", f"{scope}.conv.{index + 2}", hidden, cout, 1)
    if stride == 1 and cin == cout:
        y = b.op("Add", scope, [x, y])
    return y


def mobilenetv2(*, batch: int = 32, size: int = 224, classes: int = 1000,
                width: float = 1.0, dtype: str = "float32", seed: int = 0,
                weights: bool = True, bn_training: bool = False) -> onnx.ModelProto:
    """torchvision mobilenet_v2 (width multiplier `width`): 3,504,872 params at width 1."""
    b = GraphBuilder("mobilenetv2", dtype=dtype, seed=seed, weights=weights,
                     bn_training=bn_training)
    x = b.input("input", [batch, 3, size, size])
    channels = _make_divisible(32 * width)
    last = _make_divisible(1280 * max(1.0, width))
    x = _conv_bn_relu6(b, "features.0", x, 3, channels, 3, stride=2)
    index = 1
    # (expansion t, output channels c, repeats n, first stride s), from the paper's Table 2
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
        cout = _make_divisible(c * width)
        for i in range(n):
            x = _inverted_residual(b, f"features.{index}", x, channels, cout,
                                   s if i == 0 else 1, t)
            channels, index = cout, index + 1
    x = _conv_bn_relu6(b, f"features.{index}", x, channels, last, 1)
    x = pool_flatten(b, "", x)
    x = linear_gemm(b, "classifier.1", x, last, classes, std=0.01, out="logits")
    return b.finish(x, [batch, classes])




# (ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj) of torchvision's Inception blocks
_GOOGLENET_CFG = {
    "inception3a": (64, 96, 128, 16, 32, 32), "inception3b": (128, 128, 192, 32, 96, 64),
    "inception4a": (192, 96, 208, 16, 48, 64), "inception4b": (160, 112, 224, 24, 64, 64),
    "inception4c": (128, 128, 256, 24, 64, 64), "inception4d": (112, 144, 288, 32, 64, 64),
    "inception4e": (256, 160, 320, 32, 128, 128), "inception5a": (256, 160, 320, 32, 128, 128),
    "inception5b": (384, 192, 384, 48, 128, 128),
}
_GOOGLENET_POOLS = {"inception3b": ("maxpool3", 3), "inception4e": ("maxpool4", 2)}


def _basic_conv(b: GraphBuilder, scope: str, x: str, cin: int, cout: int, kernel: int,
                stride: int = 1, pad: int = 0) -> str:
    """torchvision GoogLeNet's BasicConv2d: bias-free conv, BN (eps 0.001), ReLU."""
    weight = b.param(f"{scope}.conv.weight", [cout, cin, kernel, kernel], std=0.01)
    x = b.op("Conv", f"{scope}.conv", [x, weight], dilations=[1, 1], group=1,
             kernel_shape=[kernel, kernel], pads=[pad] * 4, strides=[stride, stride])
    x = b.batch_norm(f"{scope}.bn", x, cout, epsilon=1e-3)
    return relu(b, scope, x)


def _ceil_max_pool(b: GraphBuilder, scope: str, x: str, kernel: int, stride: int,
                   pad: int = 0) -> str:
    return b.op("MaxPool", scope, [x], ceil_mode=1, kernel_shape=[kernel, kernel],
                pads=[pad] * 4, strides=[stride, stride])


def googlenet(*, batch: int = 32, size: int = 224, classes: int = 1000, width: float = 1.0,
              dtype: str = "float32", seed: int = 0, weights: bool = True,
              bn_training: bool = False) -> onnx.ModelProto:
    """torchvision googlenet without its auxiliary classifiers (an eval-mode export, which
    also leaves out Dropout): BasicConv2d stem, nine Inception blocks whose four branches
    (1x1; 1x1 then 3x3; 1x1 then 3x3; 3x3 max pool (stride 1, ceil mode) then 1x1) meet in
    a Concat, ceil-mode max pools between stages, a linear head; 6,624,904 params at width 1.

    `width` scales every channel count (at least 1), for light graphs of the same structure.
    Convs and the linear are drawn from N(0, 0.01), torchvision's init (truncated there)."""
    def ch(c: int) -> int:
        return max(1, int(round(c * width)))

    b = GraphBuilder("googlenet", dtype=dtype, seed=seed, weights=weights, bn_training=bn_training)
    x = b.input("input", [batch, 3, size, size])
    x = _basic_conv(b, "conv1", x, 3, ch(64), 7, stride=2, pad=3)
    x = _ceil_max_pool(b, "maxpool1", x, 3, 2)
    x = _basic_conv(b, "conv2", x, ch(64), ch(64), 1)
    x = _basic_conv(b, "conv3", x, ch(64), ch(192), 3, pad=1)
    x = _ceil_max_pool(b, "maxpool2", x, 3, 2)
    channels = ch(192)
    for name, cfg in _GOOGLENET_CFG.items():
        c1, c3r, c3, c5r, c5, cp = (ch(c) for c in cfg)
        branch1 = _basic_conv(b, f"{name}.branch1", x, channels, c1, 1)
        branch2 = _basic_conv(b, f"{name}.branch2.0", x, channels, c3r, 1)
        branch2 = _basic_conv(b, f"{name}.branch2.1", branch2, c3r, c3, 3, pad=1)
        branch3 = _basic_conv(b, f"{name}.branch3.0", x, channels, c5r, 1)
        branch3 = _basic_conv(b, f"{name}.branch3.1", branch3, c5r, c5, 3, pad=1)
        branch4 = _ceil_max_pool(b, f"{name}.branch4.0", x, 3, 1, pad=1)
        branch4 = _basic_conv(b, f"{name}.branch4.1", branch4, channels, cp, 1)
        x = b.op("Concat", name, [branch1, branch2, branch3, branch4], axis=1)
        channels = c1 + c3 + c5 + cp
        if name in _GOOGLENET_POOLS:
            pool, kernel = _GOOGLENET_POOLS[name]
            x = _ceil_max_pool(b, pool, x, kernel, 2)
    x = pool_flatten(b, "avgpool", x)
    x = linear_gemm(b, "fc", x, channels, classes, std=0.01, out="logits")
    return b.finish(x, [batch, classes])
