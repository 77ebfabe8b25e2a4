"""U-Nets for segmentation: 2-D (milesial/Pytorch-UNet) and 3-D (Çiçek et al. 2016).

Both are built from the same levels, named as in milesial's modules: ``inc``, ``down{i}``
(MaxPool + DoubleConv), ``up{i}`` (ConvTranspose, Concat with the skip, DoubleConv),
``outc`` (1x1 conv). A DoubleConv is conv-BN-ReLU twice (``double_conv.0`` .. ``.5``).
Convolutions are padded ('same'), so the output map has the input's spatial size; the
size must be divisible by 2**depth (no Pad/crop for odd sizes). The output is the
per-pixel (per-voxel) class map [N, classes, *spatial], named 'logits'.

- unet2d mirrors ``UNet(n_channels=3, n_classes=2, bilinear=False)``: bias-free convs with
  BN, ConvTranspose (with bias) halving the channels, 31,037,698 parameters.
- unet3d follows Çiçek et al. (2016): analysis levels 32->64, 64->128, 128->256,
  256->512 (channels double before each pool), up-convolutions that keep the channel
  count (no bias), convs with bias each followed by BN, a final 1x1x1 conv with bias.
  The paper's 19,069,955 parameters (3 input channels, 3 labels) count no BN affine
  parameters; with BN gamma/beta on the 14 BN layers (2,336 channels) it is 19,074,627.
  The paper uses unpadded convolutions; here they are padded, which changes no
  parameter, only the spatial sizes.
"""
from __future__ import annotations

import onnx

from .layers import GraphBuilder, conv, conv_transpose, max_pool, relu


def _double_conv(b: GraphBuilder, scope: str, x: str, cin: int, mid: int, cout: int,
                 bias: bool, dims: int) -> str:
    for i, (c_in, c_out) in enumerate([(cin, mid), (mid, cout)]):
        x = conv(b, f"{scope}.double_conv.{3 * i}", x, c_in, c_out, 3, pad=1, bias=bias,
                 dims=dims)
        x = b.batch_norm(f"{scope}.double_conv.{3 * i + 1}", x, c_out)
        x = relu(b, f"{scope}.double_conv.{3 * i + 2}", x)
    return x


def _unet(name: str, *, dims: int, batch: int, size: int, channels: int, classes: int,
          encoder: list[tuple[int, int]], up_channels: list[int], decoder: list[int],
          conv_bias: bool, up_bias: bool, dtype: str, seed: int, weights: bool,
          bn_training: bool) -> onnx.ModelProto:
    """Generic U-Net. encoder[i] = (mid, out) of level i's DoubleConv (level 0 is `inc`);
    up_channels[j] / decoder[j] = output channels of up{j+1}'s ConvTranspose / DoubleConv."""
    depth = len(encoder) - 1
    if size % 2 ** depth:
        raise ValueError(f"{name}: size must be divisible by {2 ** depth} (depth {depth}), "
                         f"got {size}")
    b = GraphBuilder(name, dtype=dtype, seed=seed, weights=weights, bn_training=bn_training)
    x = b.input("input", [batch, channels] + [size] * dims)
    mid, cout = encoder[0]
    x = _double_conv(b, "inc", x, channels, mid, cout, conv_bias, dims)
    skips = [(x, cout)]
    for level in range(1, depth + 1):
        scope = f"down{level}.maxpool_conv"
        x = max_pool(b, f"{scope}.0", x, 2, 2, dims=dims)
        mid, c = encoder[level]
        x = _double_conv(b, f"{scope}.1", x, cout, mid, c, conv_bias, dims)
        skips.append((x, c))
        cout = c
    for j, (c_up, c_out) in enumerate(zip(up_channels, decoder)):
        scope = f"up{j + 1}"
        skip, c_skip = skips[depth - 1 - j]
        x = conv_transpose(b, f"{scope}.up", x, cout, c_up, 2, stride=2, bias=up_bias,
                           dims=dims)
        x = b.op("Concat", scope, [skip, x], axis=1)
        x = _double_conv(b, f"{scope}.conv", x, c_skip + c_up, c_out, c_out, conv_bias, dims)
        cout = c_out
    x = conv(b, "outc.conv", x, cout, classes, 1, bias=True, dims=dims, out="logits")
    return b.finish(x, [batch, classes] + [size] * dims)


def unet2d(*, batch: int = 4, size: int = 256, channels: int = 3, classes: int = 2,
           width: int = 64, depth: int = 4, dtype: str = "float32", seed: int = 0,
           weights: bool = True, bn_training: bool = False) -> onnx.ModelProto:
    """2-D U-Net as milesial/Pytorch-UNet (bilinear=False); `width` = channels of level 0."""
    widths = [width * 2 ** i for i in range(depth + 1)]
    return _unet("unet2d", dims=2, batch=batch, size=size, channels=channels, classes=classes,
                 encoder=[(w, w) for w in widths],
                 up_channels=[w // 2 for w in reversed(widths[1:])],
                 decoder=list(reversed(widths[:-1])), conv_bias=False, up_bias=True,
                 dtype=dtype, seed=seed, weights=weights, bn_training=bn_training)


def unet3d(*, batch: int = 1, size: int = 128, channels: int = 1, classes: int = 3,
           width: int = 32, depth: int = 3, dtype: str = "float32", seed: int = 0,
           weights: bool = True, bn_training: bool = False) -> onnx.ModelProto:
    """3-D U-Net of Çiçek et al. (2016) on size^3 volumes; `width` = first conv's channels."""
    mids = [width * 2 ** i for i in range(depth + 1)]
    return _unet("unet3d", dims=3, batch=batch, size=size, channels=channels, classes=classes,
                 encoder=[(m, 2 * m) for m in mids],
                 up_channels=[2 * m for m in reversed(mids[1:])],
                 decoder=list(reversed(mids[1:])), conv_bias=True, up_bias=False,
                 dtype=dtype, seed=seed, weights=weights, bn_training=bn_training)
