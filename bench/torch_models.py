"""Networks written in PyTorch for the benches: small ones exported with torch.onnx.export,
and the PyTorch modules of bundled models whose own peak memory PyTorch is measured on.

The modules are written out in their libraries' style (neither transformers nor milesial's
U-Net is a dependency): a ResNet-style CNN (conv-BN-ReLU basic blocks with identity
shortcuts, adaptive average pooling, a linear head) and a BERT-style encoder (embedding,
multi-head self-attention from Linear layers, LayerNorm, a ReLU feed-forward, a classifier
on the first token), exported by the TorchScript exporter at opset 17 as `models/` mirrors;
torchvision's ResNets and MobileNetV2, milesial's U-Net and Hugging Face's GPT-2, each the
bundled model of that name (tests/test_torch_references.py loads the bundled weights into
the last two and compares their outputs).
"""
from __future__ import annotations

import io
import math

import onnx


def exported(batch: int) -> dict[str, onnx.ModelProto]:
    """name -> the exported model at `batch` (weights seeded)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c: int):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(y)) + x)

    class ResNetStyle(nn.Module):
        def __init__(self, width: int = 32, blocks: int = 4, classes: int = 10):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True))
            self.layers = nn.Sequential(*[Block(width) for _ in range(blocks)])
            self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(width, classes)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))

    class EncoderStyle(nn.Module):
        def __init__(self, d: int = 128, heads: int = 4, layers: int = 2, vocab: int = 1000):
            super().__init__()
            self.emb, self.heads, self.head = nn.Embedding(vocab, d), heads, nn.Linear(d, 2)
            self.layers = nn.ModuleList([nn.ModuleDict({
                "q": nn.Linear(d, d), "k": nn.Linear(d, d), "v": nn.Linear(d, d), "o": nn.Linear(d, d),
                "ln1": nn.LayerNorm(d), "f1": nn.Linear(d, 4 * d), "f2": nn.Linear(4 * d, d),
                "ln2": nn.LayerNorm(d)}) for _ in range(layers)])

        def forward(self, ids):
            x = self.emb(ids)
            b, n, d = x.shape
            h = self.heads

            def split(t):
                return t.reshape(b, n, h, d // h).transpose(1, 2)

            for layer in self.layers:
                q, k, v = split(layer["q"](x)), split(layer["k"](x)), split(layer["v"](x))
                attention = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5, dim=-1)
                y = (attention @ v).transpose(1, 2).reshape(b, n, d)
                x = layer["ln1"](x + layer["o"](y))
                x = layer["ln2"](x + layer["f2"](torch.relu(layer["f1"](x))))
            return self.head(x[:, 0])

    cases = {"torch-resnet-style": (ResNetStyle(), torch.randn(batch, 3, 32, 32), "input"),
             "torch-encoder-style": (EncoderStyle(), torch.randint(0, 1000, (batch, 64)), "input_ids")}
    models = {}
    for name, (module, example, input_name) in cases.items():
        buffer = io.BytesIO()
        torch.onnx.export(module, example, buffer, opset_version=17, dynamo=False, input_names=[input_name],
                          output_names=["logits"])
        models[name] = onnx.load_from_string(buffer.getvalue())
    return models


# ---- torchvision's classifiers, written out (torchvision is not installed here) ---------------
def torchvision_classifier(name: str, classes: int = 1000):
    """torchvision's resnet18, resnet50 (v1.5) or mobilenet_v2 as torch modules, written as
    torchvision writes them (ReLU and ReLU6 in place, BN after every conv, no dropout: the
    bundled models leave it out too), for PyTorch's own peak memory of a training step."""
    import torch

    torch.manual_seed(0)
    builders = {"resnet18": lambda: _resnet("basic", [2, 2, 2, 2], classes),
                "resnet50": lambda: _resnet("bottleneck", [3, 4, 6, 3], classes),
                "mobilenetv2": lambda: _mobilenetv2(classes)}
    if name not in builders:
        raise ValueError(f"no torch version of {name!r}; known: {', '.join(builders)}")
    return builders[name]()


def _resnet(block_kind: str, counts: list[int], classes: int):
    """torchvision's ResNet with basic (18, 34) or bottleneck (50) blocks, `counts` per stage."""
    import torch
    from torch import nn

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, cin: int, planes: int, stride: int):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False), nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = _downsample(cin, planes, stride)

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return self.relu(y + (self.downsample(x) if self.downsample is not None else x))

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, cin: int, planes: int, stride: int):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, planes, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv3, self.bn3 = nn.Conv2d(planes, 4 * planes, 1, bias=False), nn.BatchNorm2d(4 * planes)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = _downsample(cin, 4 * planes, stride)

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            y += self.downsample(x) if self.downsample is not None else x
            return self.relu(y)

    def _downsample(cin: int, cout: int, stride: int):
        if stride == 1 and cin == cout:
            return None
        return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    class ResNet(nn.Module):
        def __init__(self, block, counts):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, 2, 1))
            layers, cin = [], 64
            for stage, (planes, count) in enumerate(zip([64, 128, 256, 512], counts)):
                for i in range(count):
                    layers.append(block(cin, planes, 2 if stage and not i else 1))
                    cin = planes * block.expansion
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))

    return ResNet(Basic if block_kind == "basic" else Bottleneck, counts)


def _mobilenetv2(classes: int):
    """torchvision's mobilenet_v2 (width 1.0)."""
    import torch
    from torch import nn

    def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1):
        return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU6(inplace=True))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            parts = [conv_bn_relu6(cin, hidden, 1)] if expand != 1 else []
            parts += [conv_bn_relu6(hidden, hidden, 3, stride, hidden), nn.Conv2d(hidden, cout, 1, bias=False),
                      nn.BatchNorm2d(cout)]
            self.conv, self.residual = nn.Sequential(*parts), stride == 1 and cin == cout

        def forward(self, x):
            return x + self.conv(x) if self.residual else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            features, cin = [conv_bn_relu6(3, 32, 3, 2)], 32
            for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                               (6, 160, 3, 2), (6, 320, 1, 1)]:
                for i in range(n):
                    features.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            features.append(conv_bn_relu6(cin, 1280, 1))
            self.features, self.classifier = nn.Sequential(*features), nn.Linear(1280, classes)

        def forward(self, x):
            return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    return MobileNetV2()


def milesial_unet(channels: int = 3, classes: int = 2, width: int = 64):
    """milesial/Pytorch-UNet's ``UNet(n_channels, n_classes, bilinear=False)`` as its
    unet_parts.py writes it, with its module names (DoubleConv = conv-BN-ReLU twice, ReLU in
    place, bias-free convs; Down = MaxPool + DoubleConv; Up = ConvTranspose halving the
    channels, the pad to the skip's size, Concat [skip, up], DoubleConv; a 1x1 OutConv; `width`
    is level 0's channels, 64 in milesial's): the bundled `unet2d` name for name and shape
    (31,037,698 parameters at width 64), for PyTorch's own peak memory of a training step."""
    import torch
    from torch import nn
    from torch.nn import functional

    class DoubleConv(nn.Module):
        def __init__(self, cin: int, cout: int):
            super().__init__()
            self.double_conv = nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        def forward(self, x):
            return self.double_conv(x)

    class Down(nn.Module):
        def __init__(self, cin: int, cout: int):
            super().__init__()
            self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(cin, cout))

        def forward(self, x):
            return self.maxpool_conv(x)

    class Up(nn.Module):
        def __init__(self, cin: int, cout: int):
            super().__init__()
            self.up, self.conv = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2), DoubleConv(cin, cout)

        def forward(self, x1, x2):
            x1 = self.up(x1)
            dy, dx = x2.size()[2] - x1.size()[2], x2.size()[3] - x1.size()[3]
            x1 = functional.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
            return self.conv(torch.cat([x2, x1], dim=1))

    class OutConv(nn.Module):
        def __init__(self, cin: int, cout: int):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, 1)

        def forward(self, x):
            return self.conv(x)

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            w = [width * 2 ** i for i in range(5)]
            self.inc = DoubleConv(channels, w[0])
            self.down1, self.down2, self.down3, self.down4 = (Down(w[i], w[i + 1]) for i in range(4))
            self.up1, self.up2, self.up3, self.up4 = (Up(w[i], w[i - 1]) for i in (4, 3, 2, 1))
            self.outc = OutConv(w[0], classes)

        def forward(self, x):
            x1 = self.inc(x)
            x2 = self.down1(x1)
            x3 = self.down2(x2)
            x4 = self.down3(x3)
            x = self.up1(self.down4(x4), x4)
            return self.outc(self.up4(self.up3(self.up2(x, x3), x2), x1))

    torch.manual_seed(0)
    return UNet()


def hf_gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 50257, positions: int = 1024):
    """Hugging Face's GPT2LMHeadModel with eager attention, with its module names, as the
    bundled `gpt2` mirrors it (pre-LayerNorm blocks, Conv1D projections (weight [in, out],
    torch.addmm), causal mask by torch.where at finfo.min, tied LM head, no dropout), for
    PyTorch's own peak memory of a training step. GELU is the tanh form in one op (HF's
    "gelu_pytorch_tanh", the same function as the bundled model's "gelu_new"): HF's
    NewGELUActivation written out keeps its intermediates for the backward and would raise
    PyTorch's peak (GPT-Neo-1.3B's shape, b32 x 512: 118.5 GB against 79.8 GB). The forward
    returns the logits as [N * L, vocab] (a view), the form F.cross_entropy takes with labels
    [N * L]."""
    import torch
    from torch import nn

    class Conv1D(nn.Module):
        def __init__(self, fin: int, fout: int):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(fin, fout) * 0.02), nn.Parameter(torch.zeros(fout))

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = Conv1D(hidden, 3 * hidden), Conv1D(hidden, hidden)

        def forward(self, x, causal):
            n, length, _ = x.shape

            def split(t):
                return t.view(n, length, heads, hidden // heads).transpose(1, 2)

            q, k, v = self.c_attn(x).split(hidden, dim=2)
            scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(hidden // heads)
            scores = torch.where(causal[:length, :length], scores, torch.finfo(scores.dtype).min)
            return self.c_proj((scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(n, length, hidden))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = Conv1D(hidden, 4 * hidden), Conv1D(4 * hidden, hidden)

        def forward(self, x):
            return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(hidden), Attention(), nn.LayerNorm(hidden), MLP()

        def forward(self, x, causal):
            x = self.attn(self.ln_1(x), causal) + x
            return self.mlp(self.ln_2(x)) + x

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
            self.h, self.ln_f = nn.ModuleList(Block() for _ in range(layers)), nn.LayerNorm(hidden)
            self.register_buffer("causal", torch.ones(positions, positions, dtype=torch.bool).tril(), persistent=False)

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)[None])
            for block in self.h:
                x = block(x, self.causal)
            return self.ln_f(x)

    class GPT2LMHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = Transformer()

        def forward(self, ids):
            return (self.transformer(ids) @ self.transformer.wte.weight.t()).view(-1, vocab)

    torch.manual_seed(0)
    return GPT2LMHead()
