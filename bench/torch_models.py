"""Small networks written in PyTorch and exported with torch.onnx.export, for the benches.

torchvision and transformers are not installed here, so the modules are written out in
their style: a ResNet-style CNN (conv-BN-ReLU basic blocks with identity shortcuts,
adaptive average pooling, a linear head) and a BERT-style encoder (embedding, multi-head
self-attention from Linear layers, LayerNorm, a ReLU feed-forward, a classifier on the
first token). Exported by the TorchScript exporter at opset 17, as `models/` mirrors.
"""
from __future__ import annotations

import io

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
