"""scikit-learn's digits (1,797 8x8 images, bundled in its wheel) and the PyTorch twins of the
models trained on them: shared by the training tests and bench/bench_train.py.

`split()` is models.digits' fixed split (1,437 to train, 360 to test). `mlp_module` is the bundled MLP
as torch modules with the ONNX model's own initial weights; `ConvBnNet` is a small
conv-BN-ReLU network. `torch_losses` trains a module on given batches with torch.optim, as a
PyTorch user's loop does.
"""
from __future__ import annotations

import numpy as np


def split(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test) as {'input': float32 [n, 1, 8, 8] in [0, 1], 'labels': int64 [n]} (models.digits)."""
    from memsched.models.digits import split as digits_split

    return digits_split(seed)


def mlp_module(model):
    """The bundled MLP (Flatten, then Linear + ReLU per hidden layer) as torch modules holding
    the initial weights of ONNX `model`."""
    import torch
    from onnx import numpy_helper

    weights = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    layers = sorted({name.split(".")[0] for name in weights if name.startswith("fc")}, key=lambda n: int(n[2:]))
    modules = [torch.nn.Flatten()]
    for i, name in enumerate(layers):
        w = weights[f"{name}.weight"]
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.copy()))
            linear.bias.copy_(torch.from_numpy(weights[f"{name}.bias"].copy()))
        modules.append(linear)
        if i < len(layers) - 1:
            modules.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*modules)
    # state_dict names as the ONNX model's (fc1.weight, ...)
    return _Named(net, {f"{name}.{p}": f"{2 * i + 1}.{p}" for i, name in enumerate(layers)
                        for p in ("weight", "bias")})


class _Named:
    """A torch module with the ONNX model's parameter names beside its own."""

    def __init__(self, module, names: dict[str, str]):
        self.module, self.names = module, names

    def state(self) -> dict[str, np.ndarray]:
        own = self.module.state_dict()
        return {onnx_name: own[torch_name].detach().numpy().copy() for onnx_name, torch_name in self.names.items()}


def conv_bn_net(seed: int = 0):
    """A conv-BN-ReLU network for 8x8 digits, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def optimizer(module, kind: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
    import torch

    params = module.parameters()
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(kind)


class TorchRun:
    """A PyTorch training loop over `module` (train mode) with torch.optim's `kind`, stepped
    batch by batch; `lr` is a number or a function of the step number (set before each step)."""

    def __init__(self, module, kind: str, lr, momentum: float = 0.9, weight_decay: float = 0.0):
        self.module, self.lr, self.count = module, lr, 0
        self.optimizer = optimizer(module, kind, lr(0) if callable(lr) else lr, momentum, weight_decay)

    def losses(self, batches: list[dict]) -> list[float]:
        import torch

        self.module.train()
        losses = []
        for batch in batches:
            if callable(self.lr):
                for group in self.optimizer.param_groups:
                    group["lr"] = self.lr(self.count)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.module(torch.from_numpy(batch["input"])),
                                                     torch.from_numpy(batch["labels"]))
            loss.backward()
            self.optimizer.step()
            self.count += 1
            losses.append(loss.item())
        return losses


def torch_losses(module, batches: list[dict], kind: str, lr, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> list[float]:
    """Train `module` on `batches` with a fresh torch.optim `kind` (TorchRun); the loss per step."""
    return TorchRun(module, kind, lr, momentum, weight_decay).losses(batches)


def torch_accuracy(module, data: dict[str, np.ndarray]) -> float:
    import torch

    module.eval()
    with torch.no_grad():
        predicted = module(torch.from_numpy(data["input"])).argmax(1).numpy()
    module.train()
    return float((predicted == data["labels"]).mean())


def onnx_accuracy(path, data: dict[str, np.ndarray]) -> float:
    """Top-1 accuracy of the ONNX model at `path` in a plain onnxruntime.InferenceSession."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: data["input"]})[0]
    return float((logits.argmax(1) == data["labels"]).mean())
