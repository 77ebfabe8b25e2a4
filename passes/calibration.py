"""Reference training steps for calibrating the cost model (`memsched hardware calibrate`).

Every bundled model at a small size, built as a training step (cross-entropy where it applies, SGD), gives the
calibration the ops a planned step runs -- weight-gradient and transposed convolutions,
depthwise convolutions, attention MatMuls, broadcasting elementwise gradients, reductions,
the embedding's scatters -- at real shapes, so each op class's line is fitted to training
rather than to a few isolated kernels. These sizes are also the small size that
bench/bench_predict.py checks the prediction at; its second, larger size is not among them.
"""
from __future__ import annotations

from memsched import frontend
from memsched.errors import UserError
from memsched.ir import Graph

from memsched.passes.pipeline import load_graph

REFERENCE_SIZES = {"mlp": dict(batch=64), "vgg16": dict(batch=2, size=32), "resnet18": dict(batch=4, size=64),
                   "resnet50": dict(batch=2, size=64), "mobilenetv2": dict(batch=4, size=64),
                   "unet2d": dict(batch=1, size=64), "unet3d": dict(batch=1, size=32, width=8),
                   "bert-base": dict(batch=1, seq=32, layers=2), "gpt2": dict(batch=1, seq=32, layers=2),
                   "dcgan-generator": dict(batch=4, size=32), "dcgan-discriminator": dict(batch=4, size=32)}
# the loss of a reference step where cross-entropy does not apply: the generator makes an image
# (mse against a target image), the discriminator one logit per sample
LOSSES = {"dcgan-generator": "mse", "dcgan-discriminator": "bce_with_logits"}
DEFAULT_REFERENCES = tuple(REFERENCE_SIZES)


def reference_graph(name: str, options: dict | None = None) -> Graph:
    """The training step (cross-entropy, SGD) of bundled model `name`, at its reference size
    unless `options` are given."""
    from memsched import models

    if options is None:
        if name not in REFERENCE_SIZES:
            raise UserError(f"no reference size for '{name}'; choose from {', '.join(REFERENCE_SIZES)}")
        options = REFERENCE_SIZES[name]
    graph = frontend.lower(models.build(name, **options))
    return load_graph(graph, train=True, loss=LOSSES.get(name, "cross_entropy"),
                      optimizer="sgd").replace(name=f"{name}-train")


def reference_graphs(names) -> list[Graph]:
    """The training steps of bundled models `names` at the small sizes above."""
    return [reference_graph(name) for name in names]
