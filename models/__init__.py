"""A bundled zoo of real architectures, built as ONNX with onnx.helper (nothing downloaded).

Each builder mirrors what torch.onnx.export (TorchScript exporter, opset 17) writes for the
reference implementation (torchvision, Hugging Face, milesial's U-Net, Çiçek's 3-D U-Net):
the same op patterns, torch's initializer names, static shapes, opset 17 / IR 8. Weights
are drawn at build time from a seeded numpy Generator, so equal arguments give
byte-identical models.

Graph interface: image models take ``input`` float [N, C, H, W] (unet3d: [N, C, D, H, W]),
transformers take ``input_ids`` int64 [N, L]; the first graph output is ``logits``
(classifier scores, per-pixel class maps, or per-token vocabulary scores), except for the
DCGAN generator, which takes ``input`` z [N, nz, 1, 1] and outputs ``image`` (models.dcgan).

BatchNorm: by default BatchNormalization is emitted as torch exports it in eval form
(one output, running statistics as inputs). ``bn_training=True`` (models with BN) emits
``training_mode=1`` instead, i.e. batch statistics, with the updated running mean and
variance as node outputs 1 and 2; onnxruntime 1.31 CPU runs that form. Those outputs are
then also graph outputs, after ``logits``: left dangling, onnxruntime computes wrong,
run-to-run varying results (see ``layers.GraphBuilder.batch_norm``).

dtype: "float32" (default) or "float16"; onnxruntime's CPU provider runs every model in
float16 (it inserts casts around kernels that lack a float16 version).

``weights=False`` builds the same graph with data-less initializers (name, dtype, dims):
cheap enough to count parameters of every model at full size, as ``catalog()`` does; such
a model is not runnable and ``export`` refuses it.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import onnx

from memsched.onnx_utils import save_model_atomic

from .cnn import mobilenetv2, resnet18, resnet50, vgg16
from .dcgan import dcgan_discriminator, dcgan_generator
from .layers import count_parameters
from .mlp import mlp
from .transformer import bert_base, gpt2
from .unet import unet2d, unet3d

_MODELS = {
    "mlp": (mlp, "LeNet-300-100 multi-layer perceptron on 28x28 images (LeCun et al. 1998)"),
    "vgg16": (vgg16, "VGG-16 image classifier, torchvision vgg16 (no BN)"),
    "resnet18": (resnet18, "ResNet-18 image classifier, torchvision resnet18"),
    "resnet50": (resnet50, "ResNet-50 (v1.5) image classifier, torchvision resnet50"),
    "mobilenetv2": (mobilenetv2, "MobileNetV2 image classifier, torchvision mobilenet_v2"),
    "unet2d": (unet2d, "2-D U-Net segmentation, milesial/Pytorch-UNet (3 channels, 2 classes)"),
    "unet3d": (unet3d, "3-D U-Net volumetric segmentation (Cicek et al. 2016)"),
    "bert-base": (bert_base, "BERT-base encoder + pooler + classifier, HF "
                             "BertForSequenceClassification"),
    "gpt2": (gpt2, "GPT-2 small decoder with causal mask and tied LM head, HF GPT2LMHeadModel"),
    "dcgan-generator": (dcgan_generator, "DCGAN generator, z -> 64x64 image (PyTorch DCGAN example)"),
    "dcgan-discriminator": (dcgan_discriminator, "DCGAN discriminator, image -> one logit "
                                                 "(PyTorch DCGAN example less its Sigmoid)"),
}

NAMES = tuple(_MODELS)


def _builder(name: str):
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    return _MODELS[name][0]


def options(name: str) -> dict:
    """The keyword options of model `name` with their defaults."""
    return {p.name: p.default for p in inspect.signature(_builder(name)).parameters.values()}


def catalog() -> list[dict]:
    """Every model: name, description, parameters (at default size), defaults."""
    entries = []
    for name, (builder, description) in _MODELS.items():
        defaults = {k: v for k, v in options(name).items() if k != "weights"}
        entries.append({"name": name, "description": description,
                        "parameters": count_parameters(builder(weights=False)),
                        "defaults": defaults})
    return entries


def build(name: str, *, batch: int | None = None, size: int | None = None,
          seq: int | None = None, classes: int | None = None, dtype: str = "float32",
          **extra) -> onnx.ModelProto:
    """Build model `name`; options left None take the model's defaults.

    Raises ValueError for an unknown name or an option that does not apply to the model.
    """
    builder = _builder(name)
    chosen = {k: v for k, v in dict(batch=batch, size=size, seq=seq, classes=classes).items()
              if v is not None}
    chosen.update(extra, dtype=dtype)
    for key in ("batch", "size", "seq", "classes", "layers"):
        value = chosen.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    accepted = options(name)
    for key in chosen:
        if key not in accepted:
            raise ValueError(f"option {key!r} does not apply to {name} "
                             f"(its options: {', '.join(accepted)})")
    model = builder(**chosen)
    onnx.helper.set_model_props(model, {"memsched.model": name,
                                        "memsched.options": json.dumps(chosen, sort_keys=True)})
    return model


def export(name: str, path: str | os.PathLike, **kw) -> Path:
    """Build model `name` (options as for `build`) and save it atomically to `path`."""
    if kw.get("weights") is False:
        raise ValueError("export needs weights: a weights=False model cannot be run or loaded")
    return save_model_atomic(build(name, **kw), path)


__all__ = ["NAMES", "build", "catalog", "count_parameters", "export", "options"]
