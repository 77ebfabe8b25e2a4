"""Reference training steps for calibrating the cpu roofline (`memsched hardware calibrate`).

Bundled models at small sizes, built as training steps (cross-entropy, SGD), give the
calibration real backward ops -- transposed and grouped convolutions, broadcasting
elementwise gradients, reductions -- at the shapes a planned step runs, so each op class's
rate is that of training rather than of one isolated kernel. The models the prediction
benchmark checks (bench/bench_predict.py: resnet18, mobilenetv2) are not among the defaults.
"""
from __future__ import annotations

from memsched import frontend
from memsched.errors import UserError
from memsched.ir import Graph

from .pipeline import load_graph

REFERENCE_SIZES = {"mlp": dict(batch=64), "vgg16": dict(batch=2, size=32), "unet2d": dict(batch=1, size=64),
                   "resnet18": dict(batch=4, size=64), "mobilenetv2": dict(batch=4, size=64),
                   "resnet50": dict(batch=2, size=64), "bert-base": dict(batch=1, seq=32),
                   "gpt2": dict(batch=1, seq=32)}
DEFAULT_REFERENCES = ("vgg16", "unet2d")


def reference_graphs(names) -> list[Graph]:
    """The training steps of bundled models `names` at the small sizes above."""
    import models

    graphs = []
    for name in names:
        if name not in REFERENCE_SIZES:
            raise UserError(f"no reference size for '{name}'; choose from {', '.join(REFERENCE_SIZES)}")
        graph = frontend.lower(models.build(name, **REFERENCE_SIZES[name]))
        graphs.append(load_graph(graph, train=True).replace(name=f"{name}-train"))
    return graphs
